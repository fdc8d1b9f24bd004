"""`program(plan, rank) -> RankProgram`: the readable Python one rank runs.

The program imports only torch and `runtime` (as a compiler's output links
its runtime). Every block is commented with the plan decision it implements:
which groups exist, which collective runs where and why, which rows of the
batch and which slice of the parameters this rank holds. Executing the
source defines `build(model_fn, optimizer_fn, loss_fn)`, which returns the
runtime's step runner (`runtime.step.StepRunner`).

Data-parallel plans (pp = tp = 1, any ZeRO stage) are emitted here;
pipeline, tensor-parallel and 3D programs by `partitioner.codegen_pipeline`;
async SGD plans (`plan.async_sgd`) by `partitioner.codegen_async`.

>>> print(plan.program(1).source)           # doctest: +SKIP
\"\"\"Per-rank program: rank 1 of 4 ...
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from cost_models.errors import PartitionerError

if TYPE_CHECKING:
    from partitioner.plan import Plan

__all__ = ["RankProgram", "program", "write_programs", "expected_collectives", "CodegenError"]

_ZERO_WHAT = {
    0: "DDP: parameters and optimizer state replicated; gradients all-reduced in buckets while backward runs",
    1: "ZeRO-1: optimizer state sharded by even flat slices; gradients all-reduced, each rank steps its slice, "
       "updated slices all-gathered",
    2: "ZeRO-2: gradients reduce-scattered into the owner's slice during backward; optimizer state sharded; "
       "updated slices all-gathered",
    3: "ZeRO-3 (FSDP): parameters sharded at rest, all-gathered per block just in time and freed after use, "
       "the next block prefetched; gradients reduce-scattered per block",
}


class CodegenError(PartitionerError):
    """A plan this code generator cannot emit a program for."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankProgram:
    """What one rank runs: `source` is readable, directly executable Python."""

    rank: int
    world_size: int
    source: str
    program_hash: str  # sha256 of the plan JSON: every rank of one plan shares it

    def namespace(self) -> dict:
        """Execute the source; the returned namespace holds `build`."""
        ns: dict = {"__name__": f"rank_{self.rank}"}
        exec(compile(self.source, f"<rank_{self.rank}.py>", "exec"), ns)  # noqa: S102 - our own generated code
        return ns


def _reduce_scatter_impl(plan: "Plan") -> tuple[str, str]:
    # TORCH-NOTES (measured here): Gloo's reduce_scatter of 16M floats takes 96 ms on 2 ranks
    # against 58 ms for all_reduce of the same buffer, so on CPU processes all-reduce-then-slice
    # wins; NCCL's reduce-scatter moves half the bytes of an all-reduce and is the faster one.
    device = plan.topology.get("device")
    name = device.get("name") if isinstance(device, dict) else device
    if plan.topology.get("local") or name == "CPU":
        return "all_reduce_slice", "Gloo: all-reduce then slice beats reduce-scatter (TORCH-NOTES)"
    return "reduce_scatter", "NCCL: reduce-scatter moves half the bytes of an all-reduce"


def params_table(plan: "Plan") -> str:
    """The PARAMS lines of a program: every parameter the plan was compiled for, (name, full shape)."""
    return ",\n".join(f"    ({p.param!r}, {tuple(p.shape)!r})" for p in plan.placements)


@dataclasses.dataclass(frozen=True)
class DpCompression:
    """How a program's data-parallel engine compresses: the `compression=` and `nodes=` arguments it
    passes, why, and the lines (run on every rank) that create the intra/cross-node groups."""

    arg: str
    nodes: str
    why: str
    setup: str


def dp_compression(plan: "Plan", dp_ranks: tuple[int, ...]) -> DpCompression:
    """The compressor(s) of this data-parallel group's gradient reduction, and why.

    The plan names one per link level. A group inside one node uses the intra-node one, a group with
    one rank per node (or ragged) the inter-node one, flat. At ZeRO-0/1 a group spanning several nodes
    with k > 1 ranks on each reduces hierarchically, as the cost model assumes: the intra-node
    compressor inside each node, the inter-node one across (runtime.grad_compression); its node groups
    are created by every rank, since c10d requires it. ZeRO-2/3 reduce-scatter flat over the group.
    """
    from runtime.groups import group_ranks, node_split  # the runtime's own rule for what splits by node

    node_of = tuple(m.node for m in sorted(plan.mesh, key=lambda m: m.rank))
    zero = plan.config.zero_stage
    levels = {lv: plan.compression.get(lv, "none") for lv in ("intra_node", "inter_node")}
    anything = any(c != "none" for c in levels.values())
    split_any = anything and zero <= 1 and any(node_split(g, node_of) for g in group_ranks(plan.mesh)["dp"])
    setup = ("    # Every rank creates the intra- and cross-node groups of every data-parallel group that spans\n"
             "    # nodes (c10d requires it), for the hierarchical reductions.\n"
             "    nodes = make_node_groups(RANK, group_ranks(MESH)['dp'], NODE_OF)\n") if split_any else ""
    if len(dp_ranks) == 1 or not anything:
        return DpCompression("'none'", "None", "the plan compresses nothing on this group's links", setup)
    if split_any and node_split(dp_ranks, node_of):
        ci, ce = levels["intra_node"], levels["inter_node"]
        return DpCompression(repr(levels), "nodes", f"hierarchical: {ci} inside each node, {ce} across nodes",
                             setup)
    level = "inter_node" if len({node_of[r] for r in dp_ranks}) > 1 else "intra_node"
    name = levels[level]
    why = f"the plan's choice for {level} links" + (", reduce-scattered flat over the group" if zero >= 2 else "")
    return DpCompression(repr(name), "None", why if name != "none" else
                         f"the plan compresses nothing on {level} links", setup)


def program(plan: "Plan", rank: int) -> RankProgram:
    if not isinstance(rank, int) or not 0 <= rank < plan.world_size:
        raise CodegenError(f"rank={rank!r}: the plan has ranks 0..{plan.world_size - 1}")
    c = plan.config
    if c.pp > 1 or c.tp > 1:
        from partitioner.codegen_pipeline import pipeline_program_source

        source, h = pipeline_program_source(plan, rank)
        return RankProgram(rank=rank, world_size=plan.world_size, source=source, program_hash=h)
    plan_json = plan.to_json()
    h = hashlib.sha256(plan_json.encode()).hexdigest()
    if plan.async_sgd:  # replicas that step alone and average parameters: no DataParallel engine
        from partitioner.codegen_async import async_program_source

        return RankProgram(rank=rank, world_size=plan.world_size, source=async_program_source(plan, rank, h),
                           program_hash=h)
    me = plan.mesh[rank]
    dp_ranks = tuple(m.rank for m in plan.mesh if m.pp == me.pp and m.tp == me.tp)
    impl, why_impl = _reduce_scatter_impl(plan)
    comp = dp_compression(plan, dp_ranks)
    # int8/int4 send each reduction as all-to-alls and all-gathers of codes, PowerSGD as factor all-reduces
    counted = " (uncompressed)" if comp.arg.strip("'") not in ("none", "bf16") else ""
    per = c.microbatch_size * c.num_microbatches
    first = me.dp * per
    expected = ", ".join(f"{n} {op}" for op, n in sorted(expected_collectives(plan).items())) or "none"

    params = params_table(plan)
    blocks: dict[str, list[str]] = {}
    for p in plan.placements:
        blocks.setdefault(p.block or "(outside the blocks)", []).append(p.param)
    units = ",\n".join(f"    ({', '.join(repr(n) for n in names)}{',' if len(names) == 1 else ''})"
                       for names in blocks.values())
    numel = {p.param: math.prod(p.shape) for p in plan.placements}
    shard_lines = []
    if c.zero_stage == 3:
        for name, names in blocks.items():
            n = sum(numel[x] for x in names)
            shard_lines.append(f"    #   {name}: {n:,} parameters; this rank holds {math.ceil(n / c.dp):,} "
                               f"(slice {me.dp} of {c.dp})")
    elif c.zero_stage in (1, 2):
        n = sum(numel.values())
        shard = math.ceil(n / c.dp)
        what = "optimizer state" if c.zero_stage == 1 else "gradients and optimizer state"
        shard_lines.append(f"    #   {what} for elements [{me.dp * shard:,}, {min(n, (me.dp + 1) * shard):,}) of the "
                           f"{n:,}-element flat parameter buffer (slice {me.dp} of {c.dp})")
    shards = "\n".join(shard_lines) or "    #   nothing sharded: every replica holds every parameter, gradient and state"
    recompute = recompute_lines(plan, "engine.checkpoint_blocks(")

    source = f'''"""Per-rank program: rank {rank} of {plan.world_size}.

Plan {h[:12]} for {plan.model_name} on {plan.topology_name}: {c}.
Precision {plan.precision}; global batch {plan.global_batch_size}. Generated by partitioner.codegen:
it imports only torch and runtime; `build(model_fn, optimizer_fn, loss_fn)` returns the step runner.
"""

import runtime.step
from runtime.collectives import Collectives
from runtime.data_parallel import DataParallel
from runtime.groups import {"group_ranks, make_groups, make_node_groups" if comp.setup else "make_groups"}

PROGRAM_HASH = {h!r}
RANK = {rank}
WORLD_SIZE = {plan.world_size}

# The mesh: rank -> (pipeline stage, data-parallel replica, tensor slice). Every rank creates
# every process group, in this order (c10d requires it).
MESH = {tuple((m.rank, m.pp, m.dp, m.tp) for m in plan.mesh)!r}
NODE_OF = {tuple(m.node for m in sorted(plan.mesh, key=lambda m: m.rank))!r}  # rank -> node

# The parameters the plan was compiled for (name, shape): any other model is refused.
PARAMS = (
{params},
)

# Blocks: ZeRO-3 gathers and frees parameters one block at a time.
UNITS = (
{units},
)


def build(model_fn, optimizer_fn, loss_fn):
    groups = make_groups(RANK, MESH)
{comp.setup}    # reduce-scatter implementation: {impl} ({why_impl}).
    collectives = Collectives(reduce_scatter_impl={impl!r})
    model = model_fn()
    runtime.step.check_parameters(model, PARAMS)

    # Data parallelism over replicas {dp_ranks} (this rank is replica {me.dp} of {c.dp}).
    # {_ZERO_WHAT[c.zero_stage]}.
    # Gradient buckets of {plan.bucket_bytes:,} bytes. Collectives per step{counted}: {expected}.
    # This rank holds:
{shards}
    # Gradient compression on this group: {comp.why}.
    engine = DataParallel(model, group=groups.dp, ranks={dp_ranks!r}, zero_stage={c.zero_stage},
                          collectives=collectives, bucket_bytes={plan.bucket_bytes}, precision={plan.precision!r},
                          units=UNITS, compression={comp.arg}, nodes={comp.nodes},
                          compression_warmup={plan.compression_warmup})
{recompute}    optimizer = optimizer_fn(engine.optimizer_params())

    # Each step: rows [{first}, {first + per}) of the {plan.global_batch_size}-sample global batch, as
    # {c.num_microbatches} microbatch(es) of {c.microbatch_size}; gradients accumulate without
    # communication until the last microbatch, then the reduction above completes.
    return runtime.step.StepRunner(
        engine=engine, optimizer=optimizer, loss_fn=loss_fn, collectives=collectives, dp_group=groups.dp,
        dp_rank={me.dp}, dp_size={c.dp}, microbatch_size={c.microbatch_size}, num_microbatches={c.num_microbatches},
        clip_grad_norm={plan.clip_grad_norm!r}, program_hash=PROGRAM_HASH)
'''
    return RankProgram(rank=rank, world_size=plan.world_size, source=source, program_hash=h)


_RECOMPUTE_WHAT = {
    "full": "each block keeps only its input in forward and runs again in backward",
    "selective": "each block keeps the outputs of its matrix products and layer norms and runs every other op "
                 "again in backward, the s x s attention scores included"}


def recompute_lines(plan: "Plan", call: str) -> str:
    """The program lines that make the plan's blocks recompute (none without recomputation): a comment
    saying how, then `call` (ending in "(") applied to the block names and the mode."""
    mode = plan.config.recompute
    if mode == "none":
        return ""
    names = tuple(dict.fromkeys(p.block for p in plan.placements if p.block is not None))
    why = textwrap.fill(f"Recompute ({mode}, runtime.recompute): {_RECOMPUTE_WHAT[mode]}.", width=100,
                        initial_indent="    # ", subsequent_indent="    # ")
    return f"{why}\n    {call}{names!r}, {mode!r})\n"


def expected_collectives(plan: "Plan") -> dict[str, int]:
    """The collectives one training step of a data-parallel program issues, by op.

    The plan's instruction lists hold one GRAD_SYNC per stage per step; the
    data-parallel engine realises it as (B = gradient buckets, cut by
    `runtime.flat.bucket` over parameters in reverse registration order;
    U = ZeRO-3 units, the blocks plus the parameters outside them; m =
    microbatches):
      DDP      B all-reduces
      ZeRO-1   B all-reduces, then 1 all-gather of the updated flat buffer
      ZeRO-2   m*B reduce-scatters (every microbatch), B all-gathers
      ZeRO-3   m*U reduce-scatters; m*(2U - 1) all-gathers: U in forward, U - 1 in
               backward (the unit outside the blocks stays gathered until its backward)
    plus one all-reduce of the reported loss, and one of the squared norm when
    clipping at ZeRO >= 1. Tests compare these with the counting shim.
    """
    from runtime.flat import bucket  # the engine's own bucketing rule, not a copy of it

    c = plan.config
    if c.dp == 1:
        return {}
    names = [p.param for p in plan.placements][::-1]
    numels = [math.prod(p.shape) for p in plan.placements][::-1]
    B = len(bucket(names, numels, plan.bucket_bytes))
    U = len({p.block for p in plan.placements})
    m = c.num_microbatches
    out = {0: {"all_reduce": B}, 1: {"all_reduce": B, "all_gather": 1},
           2: {"reduce_scatter": m * B, "all_gather": B},
           3: {"reduce_scatter": m * U, "all_gather": m * (2 * U - 1)}}[c.zero_stage]
    out["all_reduce"] = out.get("all_reduce", 0) + 1 + (1 if plan.clip_grad_norm and c.zero_stage >= 1 else 0)
    return out


def write_programs(plan: "Plan", directory: str | Path) -> Path:
    """`directory/plan.json` and `directory/rank_{r}.py` for every rank; returns the directory."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for r in range(plan.world_size):
        (d / f"rank_{r}.py").write_text(program(plan, r).source)
    plan.save(d / "plan.json")
    return d
