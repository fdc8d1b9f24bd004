"""Plan: the planner's decision and its evidence, as plain frozen data.

A Plan names the parallel configuration, the device mesh, the stage cuts,
the tensor placement of every parameter, the pipeline schedule and its per-rank
instruction lists (`plan.instructions`), the predicted cost and the runners-up. It saves as
versioned JSON tied to the hashes of the graph and the topology it was made
for, so a plan for another model or cluster is refused on load.

>>> from partitioner import compile, Topology
>>> from examples.mlp import mlp, example_inputs
>>> model = mlp()
>>> x, = example_inputs(model)
>>> plan = compile(model, Topology.parse("8xA100-80GB"), example_inputs=(x,), global_batch_size=64)
>>> plan.dp, plan.tp, plan.pp, plan.zero_stage
(1, 4, 2, 0)
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cost_models.choices import CpKind, Precision, Recompute, Zero3Unit
from cost_models.compression import Compressor, Level, no_compression
from cost_models.errors import PartitionerError
from partitioner.planner.model_code import ModelCode
from partitioner.planner.plan_check import check_plan
from partitioner.planner.plan_json import PlanFormatError, decode, encode
from partitioner.planner.schedule import Schedule, ScheduleKind, stage_rank

__all__ = [
    "PLAN_VERSION",
    "Alternative",
    "Baseline",
    "MemoryBreakdown",
    "MeshCoord",
    "ParallelConfig",
    "ParamPlacement",
    "Plan",
    "PlanMismatchError",
    "Predicted",
    "StagePlan",
    "per_rank_memory",
]

PLAN_VERSION = 1



class PlanMismatchError(PartitionerError):
    """A plan loaded against a model or topology other than the one it was made for."""


@dataclasses.dataclass(frozen=True, kw_only=True, order=True)
class ParallelConfig:
    """One point of the search space.

    dp, tp, pp: data, tensor and pipeline degrees (dp * cp * tp * pp = world size, cp below).
    zero_stage: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters: FSDP).
    microbatch_size x num_microbatches per data-parallel rank = global batch / dp.
    schedule/interleave: the pipeline schedule and virtual stages per rank.
    recompute: activation recomputation policy.
    recompute_blocks: (k, n) under recompute "full": of every n consecutive blocks (by their index in the model's
        block stack, `OpGraph.blocks`) the first k run under full recomputation and the others keep their
        activations (`recomputes_block`); (1, 1) every block. Megatron-LM's recompute_num_layers and
        torchtitan's selective_ac_option=N ((1, N): every N-th block) recompute part of the blocks this way, for
        a model whose activations fit with some blocks recomputed, not all. Written in plan JSON only when not
        (1, 1).
    sp: Megatron sequence parallelism inside each tensor group (tp > 1 only): the ops between the
        tensor-split regions run on 1/tp of the tokens (partitioner.planner.sequence_split).
    cp: context parallelism, the sequence split over cp ranks for the whole layer (dp * cp * tp * pp =
        world size); each rank holds 2 of the sequence's 2*cp chunks (the causal load balance).
        Gradients are reduced, and ZeRO shards, over dp x cp ranks (`replicas`).
    cp_kind: how attention sees the whole sequence under cp > 1: "ring" (key/value blocks passed around
        the context group, runtime.context.ring_attention) or "all-to-all" (DeepSpeed-Ulysses: heads
        re-sharded, runtime.context.ulysses).
    ep: expert parallelism (Megatron-Core's): each MoE layer's experts divided over ep ranks taken inside
        the data-parallel group (ep divides dp and the number of experts; no mesh axis of its own: an ep
        group is ep consecutive data-parallel ranks), tokens sent to their experts and back by all-to-alls;
        expert gradients reduced over the dp / ep ranks holding the same experts, dense ones over dp
        (partitioner.planner.expert_split). Written in plan JSON only when > 1.
    zero3_unit: what ZeRO-3 (zero_stage 3) gathers and frees at once (cost_models.choices.Zero3Unit): "block"
        (a repeated block; the parameters outside the blocks one more unit) or "module" (each module that
        holds parameters directly, DeepSpeed's granularity): less memory gathered, more collectives. Always
        "block" below ZeRO-3. Written in plan JSON only when "module" (older plans read as "block").
    """

    dp: int
    tp: int
    pp: int
    zero_stage: int
    microbatch_size: int
    num_microbatches: int
    schedule: ScheduleKind
    interleave: int
    recompute: Recompute
    sp: bool = False
    cp: int = 1
    cp_kind: CpKind = "ring"
    ep: int = dataclasses.field(default=1, metadata={"omit_default": True})
    zero3_unit: Zero3Unit = dataclasses.field(default="block", metadata={"omit_default": True})
    recompute_blocks: tuple[int, int] = dataclasses.field(default=(1, 1), metadata={"omit_default": True})

    def __post_init__(self) -> None:
        if not isinstance(self.recompute_blocks, tuple):  # a list, from JSON read by something other than plan_json
            object.__setattr__(self, "recompute_blocks", tuple(self.recompute_blocks))
        k, n = self.recompute_blocks
        if not (isinstance(k, int) and isinstance(n, int) and 1 <= k <= n):
            raise ValueError(f"recompute_blocks={self.recompute_blocks!r}: must be (k, n) with 1 <= k <= n, the "
                             "first k of every n blocks recomputed")

    def recomputes_block(self, index: int) -> bool:
        """Whether block `index` (its place in the model's block stack) runs under the plan's recomputation."""
        k, n = self.recompute_blocks
        return self.recompute != "none" and index % n < k

    @property
    def recompute_text(self) -> str:
        """The recomputation as the config line shows it: "full", or "full:1/2" for part of the blocks."""
        k, n = self.recompute_blocks
        return self.recompute if (k, n) == (1, 1) else f"{self.recompute}:{k}/{n}"

    @property
    def replicas(self) -> int:
        """The ranks that reduce gradients together and share ZeRO's shards: dp x cp (Megatron's)."""
        return self.dp * self.cp

    def __str__(self) -> str:
        sched = self.schedule + (f"x{self.interleave}" if self.interleave > 1 else "")
        cp = "" if self.cp == 1 else f" cp{self.cp}" + ("" if self.cp_kind == "ring" else "(all-to-all)")
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        unit = "/module" if self.zero3_unit == "module" else ""
        return (f"dp{self.dp}{ep}{cp} tp{self.tp}{'+sp' if self.sp else ''} pp{self.pp} zero{self.zero_stage}{unit} "
                f"mb{self.microbatch_size}x{self.num_microbatches} {sched} recompute={self.recompute_text}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshCoord:
    """Where one rank sits: its pipeline stage, data-parallel replica, context and tensor slices, and its node."""

    rank: int
    pp: int
    dp: int
    tp: int
    node: int
    cp: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes one rank holds at its peak."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


def per_rank_memory(memories: Sequence[Any], pp: int, schedule: str = "1f1b") -> dict[int, MemoryBreakdown]:
    """Per pipeline rank, from the memory of every virtual stage in stage order (stage k lives on rank
    schedule.stage_rank: k % pp, zb-v's and dualpipe-v's V): its stages' params, grads, optimizer state and activations
    summed, buffers once (they are reused). The one rule the search, compile and a plan count a rank's
    memory by."""
    out: dict[int, MemoryBreakdown] = {}
    for k, m in enumerate(memories):
        r = stage_rank(schedule, pp, k)
        prev = out.get(r)
        out[r] = MemoryBreakdown(params=m.params, grads=m.grads, optimizer=m.optimizer, activations=m.activations,
                                 buffers=m.buffers) if prev is None else MemoryBreakdown(
            params=prev.params + m.params, grads=prev.grads + m.grads, optimizer=prev.optimizer + m.optimizer,
            activations=prev.activations + m.activations, buffers=max(prev.buffers, m.buffers))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage (a virtual stage when interleaved).

    blocks: names of the repeated blocks it holds ("prefix"/"suffix" for the
    nodes before and after the layer stack). first_node/last_node: inclusive
    range into OpGraph.nodes. num_params: parameters each of its ranks holds
    before ZeRO sharding (tensor-parallel shards counted per rank).
    forward_s/backward_s: predicted time per microbatch, including
    tensor-parallel collectives and recomputation.
    """

    index: int
    blocks: tuple[str, ...]
    first_node: int
    last_node: int
    num_params: int
    ranks: tuple[int, ...]
    forward_s: float
    backward_s: float
    memory: MemoryBreakdown


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamPlacement:
    """How one parameter is laid out over its tensor group: "S(d)" sharded on dim d, "R" replicated."""

    param: str
    shape: tuple[int, ...]
    spec: str
    role: str
    reason: str
    stages: tuple[int, ...]
    block: str | None = None  # the repeated block it belongs to (ZeRO-3 gathers per block)
    fused: int = 1
    # its other names in the module (a tied LM head's weight is the embedding's): the module reading it under
    # each, which per-module ZeRO-3 needs (a unit read by modules with no common parent but the root is the
    # root's, kept from forward to backward). Written in plan JSON only when there are some.
    aliases: tuple[str, ...] = dataclasses.field(default=(), metadata={"omit_default": True})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Predicted:
    """The cost model's prediction for one training step.

    peak_memory_bytes: the largest per-rank total, memory its breakdown;
    bytes_per_link: bytes each rank sends per step, per link level.
    """

    step_time_s: float
    tokens_per_s: float
    samples_per_s: float
    model_tflops_per_device: float
    mfu: float
    peak_memory_bytes: float
    memory: MemoryBreakdown
    memory_capacity_bytes: float
    bytes_per_link: dict[str, float]
    bubble_fraction: float
    exposed_comm_s: float  # the busiest stage's data-parallel communication and compression kernels nothing hides
    # step time the plan's gradient compression saves against the same configuration and cut uncompressed
    compression_saving_s: float = 0.0
    # uncompressed, that cut does not fit (a ZeRO-3 unit's bf16 reduction holds less: cost_models.compression_memory).
    # Written in plan JSON only when true.
    compression_needed_to_fit: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # the search's closed-form estimate of this cut's step time (cut.step_time), the basis on which the
    # runners-up were ranked; step_time_s simulates the instruction lists. 0.0: not recorded (older plans)
    search_step_time_s: float = 0.0
    # cp > 1: the most one attention node's context-parallel kernel holds beyond the activations while it runs
    # (a ring's k/v blocks arriving and dk/dv accumulators travelling, Ulysses' all-to-all buffers:
    # partitioner.planner.context_split.attention_buffer_bytes), part of memory.buffers when the rank's
    # peak is mid-backward. Written in plan JSON only under cp > 1.
    context_buffer_bytes: float = dataclasses.field(default=0.0, metadata={"omit_default": True})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Alternative:
    """A runner-up: its configuration, prediction, and why it lost.

    step_time_s: the search's estimate of its best cut (of a balanced cut when it does not fit, fits False),
    comparable with Predicted.search_step_time_s rather than the simulated Predicted.step_time_s.
    """

    config: ParallelConfig
    step_time_s: float
    peak_memory_bytes: float
    fits: bool
    why: str
    compression: dict[Level, Compressor] = dataclasses.field(default_factory=no_compression)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Baseline:
    """A configuration people write by hand, costed like the plan, to show what the search gains.

    name: "pure data parallel", "ZeRO-3 only", "Megatron tp=8". config: its best
    configuration; when nothing of that kind fits, the one needing the least memory
    (fits False), and None when it cannot exist here (note says why).
    step_time_s: simulated like the plan's (None unless it fits); peak_memory_bytes:
    its largest per-rank total (the least any variant needs, when none fits).
    """

    name: str
    config: ParallelConfig | None
    step_time_s: float | None
    peak_memory_bytes: float | None
    fits: bool
    note: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """The compiled plan. Plain data: `save`/`load` JSON, `print` for the table."""

    version: int
    model_name: str
    graph_hash: str
    topology: dict[str, Any]
    topology_hash: str
    topology_name: str
    world_size: int
    global_batch_size: int
    seq_len: int | None
    precision: Precision
    optimizer: str
    declarations: dict[str, Any]
    config: ParallelConfig
    mesh: tuple[MeshCoord, ...]
    stages: tuple[StagePlan, ...]
    placements: tuple[ParamPlacement, ...]
    instructions: Schedule  # per pipeline rank, the ordered actions (0F0 0SEND_F0 ...)
    predicted: Predicted
    alternatives: tuple[Alternative, ...]
    bucket_bytes: int  # data-parallel gradient bucket (torch DDP's 25 MiB default)
    clip_grad_norm: float | None  # clip gradients to this global L2 norm (over all shards) before each step
    candidates_evaluated: int
    search_space: int
    # the model as code (prefix, block, suffix) for pipeline / tensor-parallel programs; None for
    # data-parallel plans, or when the graph could not be cut (code_note says why)
    code: ModelCode | None = None
    code_note: str = ""
    # a layer stack whose blocks are not all alike (partitioner.tracer.block_kinds): the kind of every block
    # of `block_container` (each kind runs its own code template); () when all are alike
    block_kinds: tuple[int, ...] = ()
    block_container: str | None = None
    # link level ("intra_node", "inter_node") -> compressor of the data-parallel gradient reduction's
    # traffic at that level: "none", "bf16", "int8", "int4" or "powersgd"; "none" where no such traffic flows
    compression: dict[Level, Compressor] = dataclasses.field(default_factory=no_compression)
    # the first steps reduce uncompressed (runtime.compression.grad_compression), before error feedback starts
    compression_warmup: int = 0
    # the model spec it was compiled from ("examples/gpt.py:gpt_tiny"), so `partitioner run` needs no
    # --model; "" when compiled from Python or by an older version
    model_source: str = ""
    # runners-up that lost for a reason other than time: faster configurations that do not fit in
    # memory (fits False, timed by a balanced cut) and, when something was pinned, the best one the
    # pins rule out
    rejected: tuple[Alternative, ...] = ()
    # the usual hand configurations (pure data parallel, ZeRO-3 only, Megatron tensor x pipeline)
    baselines: tuple[Baseline, ...] = ()
    # asynchronous data parallelism, pinned by the user (the planner never chooses it: it changes the
    # training math): {"every": k}, local SGD, replicas step alone and average parameters every k steps;
    # {"staleness": s}, every step's update is averaged asynchronously and applied s steps later
    # (runtime.engines.async_sgd). None: synchronous training
    async_sgd: dict[str, int] | None = None
    # eager attentions the tracer rewrote to one fused scaled_dot_product_attention each
    # (partitioner.tracer.attention): costed so, and run so by every program of the plan; 0: none
    attention_rewrites: int = 0
    # chains of ops the tracer ran as one fused ATen op each, in words ("rms_norm x9, silu x4";
    # partitioner.tracer.norms and .pointwise): costed so, and run so by every program of the plan; "": none
    fused: str = dataclasses.field(default="", metadata={"omit_default": True})
    # the mixture-of-experts layers the tracer found (partitioner.tracer.experts), in words; "" for a dense model
    experts: str = ""
    # why the plan divides the experts over ep ranks, or why it cannot (partitioner.planner.expert_split); "" for
    # a dense model. Written in plan JSON only when set.
    expert_parallel: str = dataclasses.field(default="", metadata={"omit_default": True})
    # the model computes its routers' load-balancing loss (Switch Transformer's, Hugging Face's
    # output_router_logits=True): a statistic of the batch, which the programs compute over the dp x cp ranks'
    # tokens of each microbatch (partitioner.codegen.segment_ep). Written in plan JSON only when set.
    load_balancing_loss: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # torch.compile of the model code every rank runs, by this backend ("inductor", "aot_eager"); "": eager.
    # Each block (and a stage's prefix and suffix code) is compiled on its own, recomputation, collectives and
    # engine hooks outside (runtime.engines.compiled). Written in plan JSON only when set: older plans load as eager.
    torch_compile: str = dataclasses.field(default="", metadata={"omit_default": True})

    # ---- the configuration, by name ---------------------------------------
    dp = property(lambda self: self.config.dp)
    tp = property(lambda self: self.config.tp)
    pp = property(lambda self: self.config.pp)
    zero_stage = property(lambda self: self.config.zero_stage)
    microbatch_size = property(lambda self: self.config.microbatch_size)
    num_microbatches = property(lambda self: self.config.num_microbatches)
    interleave = property(lambda self: self.config.interleave)
    recompute = property(lambda self: self.config.recompute)
    cp = property(lambda self: self.config.cp)
    cp_kind = property(lambda self: self.config.cp_kind)
    ep = property(lambda self: self.config.ep)
    zero3_unit = property(lambda self: self.config.zero3_unit)

    schedule = property(lambda self: self.config.schedule)  # "gpipe" | "1f1b" | "interleaved-1f1b"

    def placement(self, param: str) -> ParamPlacement:
        for p in self.placements:
            if p.param == param:
                return p
        raise KeyError(f"no parameter {param!r} in this plan")

    @property
    def stage_bounds(self) -> tuple[int, ...]:
        """The stage cut as graph node indices: where each stage starts, then one past the last stage's
        last node. `compile(..., stage_bounds=plan.stage_bounds)` costs this very cut again."""
        return (*(st.first_node for st in self.stages), self.stages[-1].last_node + 1)

    def rank_memory(self) -> dict[int, MemoryBreakdown]:
        """Per pipeline rank: its virtual stages' memory summed, buffers once (per_rank_memory)."""
        return per_rank_memory([st.memory for st in sorted(self.stages, key=lambda st: st.index)], self.pp,
                               self.schedule)

    # ---- programs ------------------------------------------------------
    def program(self, rank: int):
        """The RankProgram of `rank`: readable, executable Python (see partitioner.codegen.program)."""
        from partitioner.codegen.program import program

        return program(self, rank)

    def verify(self, model_fn: Any, inputs: Any = None, loss_fn: Any = None, *, targets: Any = None,
               sources: dict[int, str] | None = None, rtol: float = 1e-5, atol: float = 1e-6) -> Any:
        """Run the generated programs' model code in this process, with no process group, and compare outputs,
        loss and every gradient with `model_fn()`'s module (runtime.verify.check). Raises VerifyError naming where
        the first difference appears; returns a VerifyReport. `inputs`: one microbatch of the model's forward
        arguments (None: random token ids); `loss_fn(output, targets)` (None: a fixed random weighting of
        the outputs); `sources`: rank -> program source to check instead of `program(rank).source`.

        >>> from partitioner import compile
        >>> from examples.gpt import example_batch
        >>> from examples.training import gpt_4l_seeded
        >>> model = gpt_4l_seeded()
        >>> plan = compile(model, "local:4", example_inputs=example_batch(model, 2)[:1], global_batch_size=8,
        ...                pp=2, tp=2)
        >>> print(plan.verify(gpt_4l_seeded))
        verified pp2 tp2 (2 stages, 4 programs): outputs, loss and 52 gradients match the module (max abs error
        ..., max rel error ...) in ... s
        """
        from runtime.verify.check import verify_plan  # the planner reaches the runtime only here, lazily

        return verify_plan(self, model_fn, inputs, loss_fn, targets=targets, sources=sources, rtol=rtol, atol=atol)

    def write_programs(self, directory: str | Path) -> Path:
        """Write plan.json and rank_{r}.py for every rank into `directory`."""
        from partitioner.codegen.program import write_programs

        return write_programs(self, directory)

    # ---- JSON ----------------------------------------------------------
    def to_json(self) -> str:
        """Deterministic: the same plan gives byte-identical text."""
        return json.dumps(encode(self), indent=1, sort_keys=True) + "\n"

    @staticmethod
    def from_json(text: str | bytes) -> Plan:
        """Decode a plan's JSON, checking each field's type and the relations between fields (plan_check)."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise PlanFormatError(f"plan: expected the plan's JSON text (str or bytes), got {type(text).__name__}; "
                                  "to read a file use Plan.load(path)")
        try:
            data = json.loads(text)
        except UnicodeDecodeError as e:
            raise PlanFormatError(f"plan: not UTF-8 text ({e.reason} at byte {e.start}): not a plan file") from None
        except json.JSONDecodeError as e:
            raise PlanFormatError(f"plan: not JSON ({e})") from None
        except (ValueError, RecursionError) as e:  # an int of more than 4300 digits; nesting deeper than Python's stack
            raise PlanFormatError(f"plan: not a plan's JSON ({type(e).__name__}: {str(e)[:120]})") from None
        if not isinstance(data, dict):
            raise PlanFormatError(f"plan: expected a JSON object at the top level, got {type(data).__name__}")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise PlanFormatError(f"plan: version {version!r} is not supported (this build reads version {PLAN_VERSION}); "
                                  "recompile the plan with this version")
        plan = decode(Plan, data)
        check_plan(plan)
        return plan

    def save(self, path: str | Path) -> Path:
        """Write the JSON to `path` atomically (a reader never sees half a plan); nothing else is left behind."""
        path = Path(path)
        text = self.to_json()
        # a fresh temporary beside the target (same filesystem, so the rename is atomic), created exclusively
        # ("x") with the usual permissions: a fixed name such as PATH.tmp would clobber a user's file of that name
        tmp = path.with_name(f".{path.name[:64]}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
        created = False
        try:
            with open(tmp, "x", encoding="utf-8") as f:
                created = True
                f.write(text)
            os.replace(tmp, path)
        except OSError as e:
            if created:
                tmp.unlink(missing_ok=True)
            raise PartitionerError(f"plan file {path}: cannot write it ({e.strerror or e}); pass a file path in an "
                                   "existing, writable directory") from None
        return path

    @staticmethod
    def load(path: str | Path, *, graph: Any = None, topology: Any = None) -> Plan:
        """Read a plan; with `graph` (an OpGraph) or `topology`, refuse one made for others."""
        path = Path(path)
        try:
            blob = path.read_bytes()  # bytes: from_json says where text that is not UTF-8 goes wrong
        except FileNotFoundError:
            raise PlanFormatError(f"plan file {path} does not exist") from None
        except OSError as e:
            raise PlanFormatError(f"plan file {path} cannot be read ({e.strerror or e}): pass the path of a plan "
                                  "JSON written by `partitioner compile -o` or Plan.save") from None
        try:
            plan = Plan.from_json(blob)
        except PlanFormatError as e:
            raise PlanFormatError(f"{path}: {e}") from None
        plan.check(graph=graph, topology=topology)
        return plan

    def check(self, *, graph: Any = None, topology: Any = None) -> None:
        if graph is not None and graph.fingerprint() != self.graph_hash:
            raise PlanMismatchError(
                f"this plan was compiled for another model: graph hash {self.graph_hash[:12]} "
                f"({self.model_name}) != {graph.fingerprint()[:12]} ({graph.model_name}); "
                "compile a plan for this model")
        if topology is not None:
            from cost_models.topology import Topology

            topo = Topology.coerce(topology)
            if topo.fingerprint() != self.topology_hash:
                raise PlanMismatchError(
                    f"this plan was compiled for topology {self.topology_name} (world size {self.world_size}), "
                    f"not {topo} (world size {topo.world_size}); compile a plan for this topology")

    # ---- text --------------------------------------------------------------
    def __str__(self) -> str:
        from partitioner.show.text import format_plan

        return format_plan(self)

    def explain(self) -> str:
        from partitioner.show.text import explain_plan

        return explain_plan(self)

    def to_html(self, path: str | Path) -> Path:
        """Write the plan as one self-contained HTML page (partitioner.show.html)."""
        from partitioner.show.html import write_html

        return write_html(self, path)

    def timeline(self, path: str | Path | None = None, *, png: str | Path | None = None) -> dict[str, Any]:
        """The simulated step as a Chrome/Perfetto trace dict; JSON to `path`, a Gantt PNG to `png` (matplotlib)."""
        from partitioner.show.timeline import write_timeline

        return write_timeline(self, path, png=png)
