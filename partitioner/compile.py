"""`compile(model, topology, ...) -> Plan`: trace, split, search, cut, schedule, predict.

    trace            model -> OpGraph (skipped when given an OpGraph)
    find_splits      Megatron splits from the graph's dataflow
    search           every allowed configuration (and its best gradient compression), exact stage cuts, best first
    build_schedule   the winner's per-rank instruction lists
    simulate         the predicted step time from those same lists
    comparisons      runners-up that lost on memory or on the declarations, and the hand configurations

Pure: the same inputs give a byte-identical plan. What is derived from the graph alone (its tensor splits,
the code cut from it for each degree) is kept beside the graph for the next compile of it (`_derived`):
autotune, elastic re-planning and a sweep of pins compile one OpGraph many times, and cutting its code was
three quarters of such a compile. An OpGraph is frozen, so nothing kept can go stale.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cost_models.calibration import Calibration
from cost_models.compression import (
    GATHER_CODE_BYTES,
    LEVELS,
    REDUCE_BYTES_OF_PRECISION,
    group_compressor,
    traffic_levels,
    wire_bytes,
)
from cost_models.compute import dtype_for
from cost_models.errors import DeclarationError, PartitionerError
from cost_models.fp8 import FP8_PRECISIONS
from cost_models.memory import DDP_BUCKET_BYTES
from cost_models.mesh import Mesh
from cost_models.placements import REPLICATED
from cost_models.powersgd import LowRank
from cost_models.specs import LinkLevel
from cost_models.topology import Topology
from partitioner.codegen.cp_masks import unsplittable_mask
from partitioner.codegen.segments import SegmentError, extract, reads_router_logits
from partitioner.planner.context_split import LONG_SEQUENCE, attention_heads, cp_options, local
from partitioner.planner.expert_split import (Experts, check_context, check_experts, ep_options, ep_ranks, experts_of,
                                              summary)
from partitioner.planner.comparisons import (
    durations,
    hand_baselines,
    over_memory_alternatives,
    pinned_out,
)
from partitioner.planner.cut import Cut, charge_idle, evaluate_cut
from partitioner.planner.declarations import (
    ASYNC_SGD_FORCED,
    Declarations,
    PlannerOptions,
    check_declarations,
    compression_refusal,
    reduction_pins,
)
from partitioner.planner.model_code import ModelCode
from partitioner.planner.plan import (
    PLAN_VERSION,
    Alternative,
    Baseline,
    MemoryBreakdown,
    MeshCoord,
    ParallelConfig,
    ParamPlacement,
    Plan,
    Predicted,
    StagePlan,
    per_rank_memory,
)
from partitioner.planner.schedule import build_schedule, stage_rank
from partitioner.planner.search import (
    Scored,
    SearchResult,
    enumerate_candidates,
    least_memory,
    module_units_run,
    recompute_part,
    search,
)
from partitioner.planner.simulate import simulate
from partitioner.planner.stage_costs import StageEvaluator
from partitioner.planner.tensor_split import TensorSplits, find_splits
from partitioner.tracer.batch_statistics import (describe_statistic, module_path, nonlinear_batch_statistics,
                                                 training_batch_norms)
from partitioner.tracer.blocks import block_index
from partitioner.tracer.capture import written_buffers
from partitioner.tracer.experts import experts_text
from partitioner.planner.unit_costs import CostContext, units_of
from partitioner.tracer.opgraph import OpGraph
from partitioner.tracer.trace import trace

__all__ = ["PlanInfeasibleError", "compile", "plan_graph"]


# Faster configurations that do not fit, shown among the runners-up (one per mesh shape).
_OVER_MEMORY_SHOWN = 3


def _defaults() -> dict[str, Any]:
    import inspect

    return {k: p.default for k, p in inspect.signature(compile).parameters.items()
            if p.default is not inspect.Parameter.empty}


class PlanInfeasibleError(PartitionerError):
    """No configuration fits in memory: says how far off the best one is and what to relax."""


def compile(model: Any, topology: Topology | str | dict, example_inputs: Sequence[Any] | None = None,
            example_kwargs: dict[str, Any] | None = None, *, global_batch_size: int | None = None,
            precision: str = "bf16-mixed", optimizer: str = "adam", dp: int | None = None, tp: int | None = None,
            pp: int | None = None, zero_stage: int | None = None, microbatch_size: int | None = None,
            schedule: str | None = None, interleave: int | None = None, recompute: str | None = None,
            recompute_blocks: tuple[int, int] | str | None = None, sp: bool | None = None, cp: int | None = None,
            cp_kind: str | None = None, ep: int | None = None,
            zero3_unit: str | None = None, max_memory_fraction: float | None = None, clip_grad_norm: float | None = None,
            calibration: Calibration | str | os.PathLike | None = None,
            cut_granularity: str = "block", alternatives: int = 5,
            compression: str | dict[str, str] | None = None, compression_warmup: int = 0,
            async_sgd: dict[str, int] | None = None, rewrite_attention: bool = True,
            grad_reduce_dtype: str | None = None, optimizer_layout: str | None = None,
            torch_compile: bool | str = False, stage_bounds: Sequence[int] | None = None, verify: bool = False,
            declarations: Declarations | None = None) -> Plan:
    """Choose how to train `model` on `topology`; a declared value pins it, None lets the planner choose.

    `compression` pins the compressor of the data-parallel gradient reduction
    ("none", "bf16", "int8", "int4", "powersgd"): a name for every link level,
    or a dict per level ({"inter_node": "int8"}; levels left out stay free).
    A plan whose data-parallel group does not cross a level records "none"
    there (with dp = 1 nothing is compressed). What the runtime runs: at
    ZeRO-2/3 one compressor for the whole group (no PowerSGD); PowerSGD on a
    group crossing both levels only as {"intra_node": "none", "inter_node":
    "powersgd"}. int8/int4 at ZeRO-3 also gather the weights as int8 codes:
    the planner picks that only where pinned. Under precision="fp32" it
    compresses nothing on its own (fp32 end to end, as declared); levels
    pinned there still compress. Pins no allowed configuration
    can run are refused, as is a compressor pinned with dp=1 or PowerSGD with
    zero_stage >= 2. `compression_warmup` steps first run uncompressed (PowerSGD
    with Adam needs some: tests/test_compression_convergence.py).

    `async_sgd` trains the data-parallel replicas asynchronously (runtime.engines.async_sgd):
    dict(every=k) is local SGD, each replica steps on its own gradients and the
    parameters are averaged after every k-th step; dict(staleness=s) averages
    every step's update asynchronously and applies it s steps later. It changes
    the training math, so the planner never chooses it; pinned, it needs pure
    data parallelism in fp32 (tp = pp = 1, zero_stage 0, no compression) and
    is refused otherwise, saying why. The cost model charges its parameter
    all-reduce (1/k per step, or hidden behind compute); the hand baselines
    stay synchronous, so explain() shows what it gains.

    `precision` is "bf16-mixed" (the default), "fp16-mixed" (16-bit compute, fp32 masters and optimizer
    state), "fp32", "bf16": pure bf16 (Composer's PURE), parameters, gradients and optimizer state in bf16,
    no masters, or "fp8-mixed": bf16-mixed whose linear layers' GEMMs take float8 operands with per-tensor
    current scaling (cost_models.fp8, runtime.engines.fp8; refused on a GPU without FP8 tensor cores, emulated
    on CPU). `grad_reduce_dtype` ("fp32" or "bf16", mixed precisions only) is the dtype the data-parallel
    gradients are reduced in; they accumulate in fp32 either way ("bf16" is the "bf16" compressor on every
    link level; None: fp32, the planner free to compress). `optimizer_layout` "distributed" is Megatron's
    distributed optimizer (masters and optimizer state sharded over dp: ZeRO-1) and pins zero_stage=1;
    "replicated" pins 0; a contradicting zero_stage is refused.

    `cp` splits each sequence over cp ranks for the whole layer (context parallelism; each rank holds 2 of
    its 2*cp chunks, the causal load balance), `cp_kind` "ring" (ring attention) or "all-to-all"
    (DeepSpeed-Ulysses); dp * cp * tp * pp is the world size, and gradients are reduced over dp x cp.
    Unpinned, the planner considers cp > 1 from LONG_SEQUENCE tokens on, or where nothing fits without
    it (partitioner.planner.context_split).

    `recompute` is "none", "selective" (a block's matrix products and norms kept, the rest, the s x s
    attention scores included, run again in backward), "full" (a block keeps only its input) or
    "selective-op" (torchtitan's per-op selective AC: fused attention's outputs and every second matrix
    product's kept, the other products and every other op run again: between selective and full in time and
    memory). Pinned "full" recomputes every block; `recompute_blocks` (k, n) or "k/n" recomputes only the
    first k of every n consecutive blocks and lets the others keep their activations (Megatron-LM's
    recompute_num_layers, torchtitan's selective_ac_option=N as (1, N)); it pins recompute="full". Unpinned,
    where the fastest plan recomputes (in any mode), the leaders that recompute every block fully are tried
    with part of them (1/4, 1/3, 1/2, 2/3, 3/4): the least that fits and is faster.

    `zero3_unit` is what ZeRO-3 gathers and frees at once: "block" (a repeated block, FSDP2's per-layer
    wrapping) or "module" (each module holding parameters, DeepSpeed ZeRO-3's granularity: a few Linear
    layers' parameters whole at a time instead of a block's, for more and smaller collectives); it pins
    zero_stage=3. Unpinned, ZeRO-3 candidates try both where tp = cp = 1 (partitioner.planner.search.module_units_run:
    the module's own forward gathers in its modules' hooks, generated stage code in runtime.engines.zero3's).

    `ep` divides each mixture-of-experts layer's experts over ep ranks of the data-parallel group
    (expert parallelism as Megatron-Core's: ep divides dp and the number of experts; tokens reach their
    experts by all-to-alls; expert gradients are reduced over the dp / ep ranks holding the same experts).
    Unpinned, the planner searches it for models whose traced graph has MoE layers
    (partitioner.planner.expert_split), preferring groups inside a node; a model whose experts cannot be
    divided is planned with ep=1 and `plan.explain()` says why.

    `rewrite_attention` (default True) traces eager attention (a matmul of q and k^T, a scale, an
    additive bias or mask such as ALiBi or causal, softmax, dropout, a matmul with v) as one
    `scaled_dot_product_attention` where that is the same math (partitioner.tracer.attention): the plan
    costs a fused kernel's time and O(s) memory, and every program runs it (data-parallel and async SGD
    programs then run the generated model code, not the module's forward); a GELU or SiLU written out as
    elementwise ops (GPT-2's gelu_new, BLOOM's GELU, x * sigmoid(x)) runs as `aten.gelu` / `aten.silu`
    (partitioner.tracer.pointwise). False keeps the traced ops.

    `torch_compile` (True: the "inductor" backend; or a backend name, e.g. "aot_eager") makes every program
    run its model code under torch.compile: each block compiled on its own (a pipeline or tensor-parallel
    stage's prefix and suffix code too), so recomputation wraps the compiled block as the plan says and
    collectives and the engines' hooks stay outside the compiled regions (runtime.engines.compiled,
    docs/running.md). It changes no decision of the plan; `print(plan)` says it.

    `stage_bounds` pins the pipeline cut, as graph node indices (`plan.stage_bounds` of an earlier
    plan): where each stage starts, then one past the last node. Autotune uses it to cost the plan it
    measured again under a new calibration, rather than whatever cut the new calibration prefers.

    `model` is an nn.Module (traced with `example_inputs`/`example_kwargs`,
    which may live on the meta device) or an OpGraph from `trace`.

    `declarations` is the same declarations as one value, `partitioner.Declarations` (what the
    keyword arguments from `global_batch_size` to `compression_warmup` become): give either, not both.
    Below `compile()` the planner takes that value and `PlannerOptions` (`plan_graph`).

    `verify=True` runs the chosen plan's generated code in this process against a copy of `model`
    on the example inputs (`Plan.verify`; the model is never modified) and raises VerifyError where they
    differ. It needs the model's values: for a model on the meta device call
    `plan.verify(model_fn)` with a function that builds it on the CPU.

    Besides the `alternatives` fastest runners-up, the plan records in `rejected`
    up to three faster configurations that do not fit and, when something is
    pinned, the best one the pins rule out; in `baselines`, the usual hand
    configurations costed the same way (partitioner.planner.comparisons). `explain()`
    prints them.

    >>> from examples.gpt import gpt_small, example_batch
    >>> m = gpt_small()
    >>> plan = compile(m, "local:4", example_inputs=example_batch(m, 8), global_batch_size=32)
    >>> print(plan)
    Plan for GPT on local:4 (4 devices), global batch 32 x seq 128, bf16-mixed, adam
      config       dp4 tp1 pp1 zero3 mb8x1 1f1b recompute=none
      mesh         pp 1 x dp 4 x tp 1; rank = pp*4 + dp*1 + tp; node 0: ranks 0-3
      zero         stage 3: parameters, gradients and optimizer state sharded over 4 data-parallel replicas;
                   gathered one block at a time
      batch        32 samples per step = 4 replicas x 1 microbatch of 8 (4.1K tokens of seq 128)
    ...
    """
    topo = Topology.coerce(topology)
    pins = dict(global_batch_size=global_batch_size, precision=precision, optimizer=optimizer, dp=dp, tp=tp, pp=pp,
                zero_stage=zero_stage, microbatch_size=microbatch_size, schedule=schedule, interleave=interleave,
                recompute=recompute, recompute_blocks=recompute_blocks, sp=sp, cp=cp, cp_kind=cp_kind, ep=ep,
                zero3_unit=zero3_unit, max_memory_fraction=max_memory_fraction,
                compression=compression,
                async_sgd=async_sgd, rewrite_attention=rewrite_attention, clip_grad_norm=clip_grad_norm,
                compression_warmup=compression_warmup, grad_reduce_dtype=grad_reduce_dtype,
                optimizer_layout=optimizer_layout, torch_compile=torch_compile)
    if declarations is not None:
        if not isinstance(declarations, Declarations):
            raise DeclarationError(f"declarations={declarations!r}: pass a partitioner.Declarations, or the "
                                   "declarations as keyword arguments (compile(model, topology, x, tp=2, ...))")
        defaults = _defaults()
        both = sorted(k for k, v in pins.items() if v != defaults[k])
        if both:
            raise DeclarationError(f"declarations= and {', '.join(f'{k}=' for k in both)} both given: declare each "
                                   f"value once, e.g. declarations=dataclasses.replace(declarations, {both[0]}=...)")
        decl = declarations
    else:
        decl = Declarations.declare(**pins)
    opts = PlannerOptions.declare(calibration=calibration, cut_granularity=cut_granularity,
                                  alternatives=alternatives, stage_bounds=stage_bounds, device=topo.device.name)
    if verify:
        _check_verifiable(model)
        if decl.cp not in (None, 1):
            raise DeclarationError(f"verify=True with cp={decl.cp}: plan.verify replays the code in one process, "
                                   "without the context group its attention runs over; compile without verify "
                                   "(context-parallel programs are checked against one process by running them, "
                                   "tests/test_context_run.py), or with cp=1")
        if decl.ep not in (None, 1):
            raise DeclarationError(f"verify=True with ep={decl.ep}: plan.verify replays the code in one process, "
                                   "without the ep group its experts run over; compile without verify "
                                   "(expert-parallel programs are checked against one process by running them, "
                                   "tests/test_expert_run.py), or with ep=1")
    rewrite = decl.rewrite_attention
    if isinstance(model, OpGraph):
        g = model
        if g.rewritten and not rewrite:
            raise DeclarationError("rewrite_attention=False: trace the model with trace(..., rewrite_attention=False) "
                                   "(this OpGraph's attention, norms or activations were rewritten to fused ops), "
                                   "or compile the module")
    else:
        if example_inputs is None and not example_kwargs:
            raise DeclarationError("example_inputs: required to trace the model, e.g. example_inputs=(tokens,); "
                                   "or pass an OpGraph from partitioner.tracer.trace")
        g = trace(model, example_inputs or (), example_kwargs, rewrite_attention=rewrite)
        if g.rewritten and not _runs_code(g):  # no program can run the rewritten code: cost what runs
            g = trace(model, example_inputs or (), example_kwargs, rewrite_attention=False)
    plan = plan_graph(g, topo, decl, opts)
    _warn_batch_norm(g, plan)
    _warn_buffer_writes(g, plan)
    if verify and plan.config.pp > 1 and plan.load_balancing_loss:
        raise DeclarationError(f"verify=True with pp={plan.config.pp} and the model's load-balancing loss "
                               "(output_router_logits=True): each pipeline stage hands its MoE layers' sums to the "
                               "next (runtime.experts.pipeline_aux), which plan.verify, building each pipeline rank "
                               "apart, does not; compile without verify (such programs are checked against one "
                               "process by running them, tests/test_expert_run.py), or pin pp=1")
    if verify:
        _verify(plan, model, example_inputs, example_kwargs)
    return plan


def plan_graph(g: OpGraph, topo: Topology, decl: Declarations, opts: PlannerOptions = PlannerOptions()) -> Plan:
    """The plan of a traced graph: `compile()` after tracing and reading its arguments."""
    splits = _splits(g)
    valid_tp = splits.valid_tp(tuple(t for t in range(1, topo.world_size + 1) if topo.world_size % t == 0))
    # Nothing the planner proposes may be unrunnable: where stage code cannot be generated for this
    # model, pipeline (and tensor) parallelism are off the table, unless the user pinned them (where no
    # code can be cut at all, both are).
    shared = _shared_blocks(g)  # one module as several layers: stages and ZeRO-3's units would hold it apart
    for axis, value, bad in (("pp", decl.pp, lambda v: v not in (None, 1)),
                             ("zero_stage", decl.zero_stage, lambda v: v == 3)):
        if shared and bad(value):
            raise DeclarationError(f"{axis}={value}: {shared}; pin pp=1 and zero_stage 0, 1 or 2 (data and tensor "
                                   "parallelism keep such blocks whole)")
    no_pp, no_tp = _code_limits(g, splits, valid_tp, ep=decl.ep or 1)
    no_code = no_pp  # set only where no code can be cut at all (then cp's cannot be either)
    no_pp = no_pp or shared or _no_stack(g)
    no_sp = no_tp or _sp_code_limit(g, splits, valid_tp)
    for axis, value, why in (("pp", decl.pp, no_pp), ("tp", decl.tp, no_tp)):
        if why and value not in (None, 1):
            raise DeclarationError(f"{axis}={value}: no per-rank program can be generated for this model with "
                                   f"{axis} > 1 ({why}); leave {axis} unpinned or pin {axis}=1")
    forced: dict[str, int] = {}  # restrictions that are not the user's choice
    if no_pp or no_tp:
        valid_tp = (1,) if no_tp else valid_tp
        forced = {**({"tp": 1} if no_tp else {}), **({"pp": 1} if no_pp else {})}
        decl = dataclasses.replace(decl, **forced)
    unit_name = "blocks" if g.blocks and opts.cut_granularity == "block" else "nodes"
    num_units = len(units_of(g, opts.cut_granularity))
    heads = attention_heads(g)
    check_declarations(decl, world_size=topo.world_size, topology_name=str(topo), num_units=num_units,
                       unit_name=unit_name, valid_tp=valid_tp, tp_divisors=splits.divisors,
                       seq_len=g.traced_seq_len, heads=heads)
    experts = _runnable_experts(g, experts_of(g), splits, decl.ep)
    check_experts(decl, experts)
    no_cp = check_context(decl, experts)  # MoE layers do not run under cp: pinned, refused; else left out
    one_replica = _check_batch_statistics(g, decl)  # a statistic split batches cannot reproduce: dp = cp = 1 (why)
    if no_code and decl.cp not in (None, 1):
        raise DeclarationError(f"cp={decl.cp}: a context-parallel program runs the model as generated code, and "
                               f"none can be generated for this model ({no_code}); leave cp unpinned or pin cp=1")
    seq = g.traced_seq_len or 1
    long_sequence = seq >= LONG_SEQUENCE
    no_cp_code = no_code  # why no context-parallel program can be generated, where the search would try one
    if not (no_cp or no_code) and (decl.cp not in (None, 1) or (decl.cp is None and long_sequence)):
        no_cp_code = _cp_code_limit(g, splits, decl.cp or 2)
        if no_cp_code and decl.cp not in (None, 1):
            raise DeclarationError(f"cp={decl.cp}: no context-parallel program can be generated for this model "
                                   f"({no_cp_code})")
    no_cp = no_cp or no_cp_code
    declared = decl.pinned()  # the plan records what the user pinned, not what async SGD implies
    if no_cp or one_replica:
        forced = {**forced, "cp": 1, **({"dp": 1} if one_replica else {})}
        decl = dataclasses.replace(decl, cp=1, **({"dp": 1} if one_replica else {}))
    if decl.async_sgd:  # checked above: nothing pinned contradicts these
        forced = {**forced, **ASYNC_SGD_FORCED}
        decl = dataclasses.replace(decl, **ASYNC_SGD_FORCED)

    def context(compression: dict[str, str], async_sgd: dict[str, int] | None = None) -> CostContext:
        return CostContext(g, topo, splits, precision=decl.precision, optimizer=decl.optimizer,
                           seq_len=g.traced_seq_len,
                           memory_cap=(decl.max_memory_fraction or 1.0) * topo.device.memory_bytes,
                           allocator_slack=decl.max_memory_fraction is None,
                           calibration=opts.calibration, granularity=opts.cut_granularity, compression=compression,
                           async_sgd=async_sgd, experts=experts, compression_warmup=decl.compression_warmup)

    reduction = reduction_pins(decl)  # the compression pins, grad_reduce_dtype's included
    ctx = context(reduction, decl.async_sgd)
    # what the plan is compared with (runners-up that break a pin, hand baselines) trains synchronously
    sync_ctx = context(reduction) if decl.async_sgd else ctx
    sp_dominates = functools.cache(lambda t, mb, rc: _sp_dominates(ctx, t, mb, rc))
    sp_allows = functools.cache(lambda t, mb: not no_sp and _sp_allows(splits, g, t, mb))  # each pp asks again

    def candidates(search_cp: bool) -> list[ParallelConfig]:
        return list(enumerate_candidates(
            decl, world_size=topo.world_size, devices_per_node=topo.devices_per_node, num_units=len(ctx.units),
            valid_tp=valid_tp, sp_allows=sp_allows,
            sp_dominates=sp_dominates,
            context=lambda t: cp_options(decl, tp=t, world_size=topo.world_size, seq_len=seq, heads=heads,
                                         search=search_cp),
            experts=lambda dp, t, c: ep_options(decl, experts, dp=dp, tp=t, cp=c,
                                                devices_per_node=topo.devices_per_node),
            module_units=lambda p, t, c: module_units_run(t, c)))

    if decl.zero3_unit == "module":
        _check_module_units(g, decl)
    allowed = candidates(long_sequence)
    if decl.sp and not allowed:
        _refuse_sp(splits, g, decl, no_sp)
    if decl.ep not in (None, 1) and not allowed:
        raise DeclarationError(
            f"ep={decl.ep} divides no data-parallel degree the other declarations {decl.pinned()} allow on "
            f"{topo.world_size} devices (expert-parallel groups are taken inside the data-parallel group, so dp must "
            f"be a multiple of ep); pin dp to a multiple of {decl.ep}, a smaller ep, or unpin tp/pp/cp")
    cands = [c for c in allowed if ctx.compression_options(c) and not (shared and c.zero_stage == 3)]  # those that
    # can run the pinned compressors (and hold shared blocks whole)
    if allowed and not cands:
        _refuse_compression(ctx, allowed, decl)
    if not cands and one_replica:
        raise DeclarationError(
            f"no configuration with dp = cp = 1 runs on {topo.world_size} devices: the model's forward combines "
            f"statistics of the whole batch non-linearly ({one_replica}), which ranks splitting the batch would each "
            "compute on their own tokens, so the batch is not split, and no pipeline or tensor-parallel plan fills "
            "them for this model; compile for fewer devices, or compute the loss from "
            "router logits the model returns (Hugging Face's output_router_logits=True), which programs split")
    if not cands:
        raise DeclarationError(
            f"no configuration satisfies the declarations {decl.pinned()} with global_batch_size="
            f"{decl.global_batch_size} on {topo.world_size} devices; relax a pinned value")
    bounds = None if opts.stage_bounds is None else _unit_bounds(opts.stage_bounds, ctx.units)
    if bounds is not None and not any(c.pp * c.interleave == len(bounds) - 1 for c in cands):
        raise DeclarationError(f"stage_bounds={tuple(opts.stage_bounds)}: {len(bounds) - 1} stages, but no "
                               f"configuration the declarations {decl.pinned()} allow has that many (pp x interleave)")
    result = search(ctx, cands, keep=max(1, opts.alternatives + 1),
                    over_memory=min(opts.alternatives, _OVER_MEMORY_SHOWN), bounds=bounds)
    if not result.ranked and decl.cp is None and not long_sequence and not _cp_code_limit(g, splits, 2):
        # nothing fits: context parallelism divides the activations by cp, so it is worth a second search
        more = [c for c in candidates(True) if c.cp > 1 and ctx.compression_options(c)]
        if more:
            cands += more
            result = search(ctx, more, keep=max(1, opts.alternatives + 1),
                            over_memory=min(opts.alternatives, _OVER_MEMORY_SHOWN), bounds=bounds)
    if not result.ranked:
        _infeasible(ctx, cands, decl, topo)
    if decl.recompute is None:  # pinned "full" recomputes every block, as Megatron's --recompute-granularity full
        result = recompute_part(ctx, result, bounds=bounds)
    best = result.ranked[0]
    rejected = over_memory_alternatives(best, result.over_memory, ctx.cap)
    if opts.alternatives > 0:
        free_ctx = context({}) if reduction else sync_ctx
        rejected += tuple(x for x in [pinned_out(free_ctx, decl, best, valid_tp=valid_tp, forced=forced)] if x)
    return _assemble(g, topo, decl, splits, ctx, result, rejected=rejected, declared=declared,
                     baselines=hand_baselines(sync_ctx, decl) if opts.alternatives > 0 else ())


def _sp_allows(splits: TensorSplits, g: OpGraph, tp: int, mb: int) -> bool:
    seq = splits.sequence
    return bool(seq.scatters) and not seq.divides(tp, mb, g.traced_seq_len or 1)


def _sp_dominates(ctx: CostContext, tp: int, mb: int, recompute: str) -> bool:
    """Whether sequence parallelism takes no longer per unit than its absence at this setting: it never holds
    more (activations, hidden state sent between stages), so the twin without it cannot be better."""
    return ctx.total_unit_time(tp, mb, recompute, True) <= ctx.total_unit_time(tp, mb, recompute, False)


def _refuse_sp(splits: TensorSplits, g: OpGraph, decl: Declarations, no_sp: str) -> None:
    """sp=True and no configuration can run it: say why."""
    seq = splits.sequence
    if no_sp:
        raise DeclarationError(f"sp=True: no per-rank program can be generated for this model with sequence "
                               f"parallelism ({no_sp}); pin sp=False")
    if not seq.scatters:
        raise DeclarationError("sp=True: this model has no tensor-parallel all-reduce to turn into a reduce-scatter "
                               "(no row-parallel matmul or vocab-parallel embedding), so there is nothing to run on "
                               "1/tp of the tokens; pin sp=False")
    tp = decl.tp or 2
    why = seq.divides(tp, decl.microbatch_size or 1, g.traced_seq_len or 1)
    raise DeclarationError(why or f"sp=True: no configuration the declarations {decl.pinned()} allow runs sequence "
                                  "parallelism (it needs tp > 1); relax tp or drop sp")


def _check_verifiable(model: Any) -> None:
    """verify=True needs the module's values: refused up front, before the search runs."""
    if isinstance(model, OpGraph):
        raise DeclarationError("verify=True: an OpGraph carries no weights to run; compile the nn.Module, or call "
                               "plan.verify(model_fn) with a function that builds the model on the CPU")
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        raise DeclarationError("verify=True: the model lives on the meta device, so it cannot be run; call "
                               "plan.verify(model_fn) on the compiled plan with a model_fn that builds the model "
                               "on the CPU (for a large model, a smaller configuration of the same code)")


def _verify(plan: Plan, model: torch.nn.Module, example_inputs: Sequence[Any] | None,
            example_kwargs: dict[str, Any] | None) -> None:
    """The plan's code against a deep copy of the user's module (never the module itself), on the example inputs."""
    import copy

    import torch.utils._pytree as pytree

    inputs: Any = None  # both positional and keyword, or on meta: verify draws its own token ids
    if example_kwargs and not example_inputs:
        inputs = dict(example_kwargs)
    elif example_inputs and not example_kwargs:
        inputs = tuple(example_inputs)
    if any(isinstance(x, torch.Tensor) and x.is_meta for x in pytree.tree_leaves(inputs)):
        inputs = None
    plan.verify(lambda: copy.deepcopy(model), inputs)


def _unit_bounds(stage_bounds: Sequence[int], units: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Node-index stage bounds as indices into `units` (each a (first node, one past the last) range)."""
    starts = {first: u for u, (first, _) in enumerate(units)}
    starts[units[-1][1]] = len(units)
    b = tuple(stage_bounds) if isinstance(stage_bounds, (list, tuple)) else None
    if (b is None or len(b) < 2 or any(isinstance(x, bool) or not isinstance(x, int) or x not in starts for x in b)
            or b[0] != 0 or b[-1] != units[-1][1] or any(x >= y for x, y in itertools.pairwise(b))):
        raise DeclarationError(f"stage_bounds={stage_bounds!r}: expected increasing node indices from 0 to "
                               f"{units[-1][1]}, each where a cut unit starts (pass plan.stage_bounds of a plan of "
                               "this model)")
    return tuple(starts[x] for x in b)


def _refuse_compression(ctx: CostContext, allowed: list[ParallelConfig], decl: Declarations) -> None:
    """No configuration the other declarations allow can run the pinned compressors: say why, per kind of group."""
    why: dict[str, str] = {}
    for c in allowed:
        levels = ctx.crossed_levels(c)
        reason = compression_refusal(decl.compression, zero_stage=c.zero_stage, levels=levels)
        if reason:
            why.setdefault(reason, f"{reason} (e.g. {c}: its data-parallel group crosses {' and '.join(levels)})")
    raise DeclarationError(f"compression={decl.compression}: no configuration the declarations {decl.pinned()} "
                           f"allow can run it: {'; '.join(list(why.values())[:2])}")


def _infeasible(ctx: CostContext, cands: list[ParallelConfig], decl: Declarations, topo: Topology) -> None:
    need, who = least_memory(ctx, cands)
    have = ctx.cap(who)
    if decl.max_memory_fraction is None:
        allowed = (f"{topo.device.memory_bytes / 2**30:.0f} GiB over the caching allocator's {ctx.slack(who):.3g} "
                   f"at recompute={who.recompute_text if who is not None else 'none'}")
    else:
        allowed = f"{decl.max_memory_fraction:g} of {topo.device.memory_bytes / 2**30:.0f} GiB"
    hints = []
    if decl.zero_stage is None or decl.zero_stage < 3:
        hints.append("ZeRO-3 (zero_stage=3)")
    if decl.recompute != "full":
        hints.append("activation recomputation (recompute='full')")
    elif decl.recompute_blocks not in (None, (1, 1)):
        hints.append("recomputing every block (drop recompute_blocks)")
    if decl.microbatch_size not in (None, 1):
        hints.append("a smaller microbatch_size")
    if decl.cp in (None, 1) and (ctx.g.traced_seq_len or 1) % 4 == 0:
        hints.append("context parallelism (cp=2 or more: activations per rank divided by cp)")
    if decl.ep == 1 and ctx.experts.layers and not ctx.experts.why_not:
        hints.append("expert parallelism (ep=2 or more: expert parameters and their state per rank divided by ep)")
    if decl.pinned():
        hints.append(f"unpinning {', '.join(decl.pinned())}")
    hints.append("more devices")
    raise PlanInfeasibleError(
        f"no plan fits: the least memory per rank any candidate needs is {need / 2**30:.1f} GiB "
        f"({who}), but {topo.device.name} offers {have / 2**30:.1f} GiB "
        f"({allowed}); try {', or '.join(hints)}")


def _mesh(c: ParallelConfig, topo: Topology) -> tuple[MeshCoord, ...]:
    """Every rank's coordinates, as cost_models.mesh lays them out (tensor groups on consecutive ranks, context
    groups next)."""
    mesh = Mesh(c.pp, c.dp, c.tp, c.cp)
    return tuple(MeshCoord(rank=r, pp=pp, dp=dp, tp=tp, cp=cp, node=topo.node_of(r))
                 for r in range(topo.world_size) for pp, dp, tp, cp in [mesh.coords4(r)])


def rank_memory(cut: Cut, pp: int, schedule: str = "1f1b") -> dict[int, MemoryBreakdown]:
    """Per pipeline rank: its virtual stages summed, buffers once (per_rank_memory)."""
    return per_rank_memory([st.memory for st in cut.stages], pp, schedule)


def _why(best: Scored, other: Scored) -> str:
    t0, t1 = best.cut.step_time_s, other.cut.step_time_s
    a, b = best.cand, other.cand
    diffs = [f"{k}={getattr(b, k)} vs {getattr(a, k)}" for k in
             ("dp", "ep", "cp", "cp_kind", "tp", "pp", "zero_stage", "zero3_unit", "microbatch_size", "schedule",
              "interleave")
             if getattr(a, k) != getattr(b, k)]
    if a.recompute_text != b.recompute_text:
        diffs.append(f"recompute={b.recompute_text} vs {a.recompute_text}")
    diffs += [f"{level} compression {y} vs {x}" for level, x, y in zip(LEVELS, best.compression, other.compression)
              if x != y]
    if t1 > t0:
        return f"slower by {100 * (t1 / t0 - 1):.1f} % ({', '.join(diffs)})"
    return f"as fast, but not simpler ({', '.join(diffs)})"


def _assemble(g: OpGraph, topo: Topology, decl: Declarations, splits: TensorSplits, ctx: CostContext,
              result: SearchResult, *, rejected: tuple[Alternative, ...] = (), baselines: tuple[Baseline, ...] = (),
              declared: dict[str, Any] | None = None) -> Plan:
    ranked = result.ranked
    best = ranked[0]
    cand, cut = best.cand, best.cut
    ev = StageEvaluator(ctx, cand, best.compression)
    mesh = _mesh(cand, topo)
    S = cand.pp * cand.interleave

    stages = []
    unit_stage = {}
    for k in range(S):
        i, j = cut.bounds[k], cut.bounds[k + 1]
        for u in range(i, j):
            unit_stage[u] = k
        st = cut.stages[k]
        first, last = ctx.units[i][0], ctx.units[j - 1][1] - 1
        names = tuple(dict.fromkeys(_segment_name(g, n) for n in range(first, last + 1)))
        rank = stage_rank(cand.schedule, cand.pp, k)
        ranks = tuple(m.rank for m in mesh if m.pp == rank)
        stages.append(StagePlan(index=k, blocks=names, first_node=first, last_node=last, num_params=round(st.params),
                                ranks=ranks, forward_s=st.forward_s, backward_s=st.backward_s,
                                memory=MemoryBreakdown(**st.memory._asdict())))

    node_stage = {}
    for u, (a, b) in enumerate(ctx.units):
        for n in range(a, b):
            node_stage[n] = unit_stage[u]
    param_stages: dict[str, set[int]] = {}
    for idx, n in enumerate(g.nodes):
        for p in n.params:
            param_stages.setdefault(p, set()).add(node_stage[idx])
    placements = []
    param_spec = {p.name: p for p in g.params}
    for pl in splits.placements:
        spec, role, reason = (pl.spec, pl.role, pl.reason) if cand.tp > 1 else \
            (REPLICATED, "replicated", f"tp=1: every rank holds the whole tensor (with tp > 1: {pl.role}, {pl.spec})")
        spec_ = param_spec[pl.param]
        placements.append(ParamPlacement(param=pl.param, shape=spec_.shape, spec=spec, role=role, reason=reason,
                                         block=g.blocks[spec_.block].name if spec_.block is not None else None,
                                         stages=tuple(sorted(param_stages.get(pl.param, ()))), fused=pl.fused,
                                         aliases=tuple(spec_.aliases)))

    sched = build_schedule(cand.schedule, pp=cand.pp, num_microbatches=cand.num_microbatches,
                           interleave=cand.interleave)
    sim = simulate(sched, durations(ev, cut))
    saving, needed = 0.0, False
    if best.compression != ("none", "none"):
        plain = StageEvaluator(ctx, cand, ("none", "none"))
        plain_cut = evaluate_cut(plain, cut.bounds, fitting=False)  # (it may not fit: the compression may be why)
        saving = simulate(sched, durations(plain, plain_cut)).step_time_s - sim.step_time_s
        needed = not all(st.fits for st in plain_cut.stages)
    predicted = _predict(g, topo, decl, ctx, ev, cand, cut, stages, sim, best.compression, saving, needed)
    aux_loss = _load_balancing_loss(g)
    alternatives = tuple(Alternative(config=o.cand, step_time_s=o.cut.step_time_s,
                                     peak_memory_bytes=max(m.total for m in rank_memory(o.cut, o.cand.pp, o.cand.schedule).values()),
                                     fits=True, why=_why(best, o), compression=dict(zip(LEVELS, o.compression)))
                         for o in ranked[1:])
    return Plan(version=PLAN_VERSION, model_name=g.model_name, graph_hash=_kept(g, "fingerprint", g.fingerprint),
                topology=topo.to_dict(),
                topology_hash=topo.fingerprint(), topology_name=str(topo), world_size=topo.world_size,
                global_batch_size=decl.global_batch_size, seq_len=g.traced_seq_len, precision=decl.precision,
                optimizer=decl.optimizer, declarations=decl.pinned() if declared is None else declared,
                config=cand, mesh=mesh, stages=tuple(stages), placements=tuple(placements), instructions=sched, predicted=predicted,
                alternatives=alternatives, bucket_bytes=DDP_BUCKET_BYTES, clip_grad_norm=decl.clip_grad_norm,
                candidates_evaluated=result.evaluated, search_space=result.space,
                compression=dict(zip(LEVELS, best.compression)),
                compression_warmup=decl.compression_warmup if best.compression != ("none", "none") else 0,
                rejected=rejected, baselines=baselines, async_sgd=decl.async_sgd,
                attention_rewrites=g.attention_rewrites, fused=_fused_text(g), experts=experts_text(g),
                block_kinds=_block_kinds(g),
                expert_parallel=_expert_note(ctx, cand, topo, declared="ep" in (declared or decl.pinned())),
                block_container=g.block_container if _block_kinds(g) else None, torch_compile=decl.torch_compile,
                load_balancing_loss=aux_loss,
                **_model_code(g, splits, cand, fp8=decl.precision in FP8_PRECISIONS,
                              aux_loss=aux_loss and not decl.async_sgd))


def _expert_note(ctx: CostContext, cand: ParallelConfig, topo: Topology, *, declared: bool) -> str:
    """explain()'s paragraph on expert parallelism ("" for a dense model)."""
    ex: Experts = ctx.experts
    if not ex.layers:
        return ""
    level = ""
    if cand.ep > 1:
        nodes = {topo.node_of(r) for r in ep_ranks(cand)}
        level = "inside a node" if len(nodes) == 1 else f"across {len(nodes)} nodes"
    t = ctx.expert_exchange_s(cand.microbatch_size, cand.tp, cand.cp, cand.ep) * cand.num_microbatches
    return summary(ex, cand, numel={p.name: p.numel for p in ctx.g.params}, all_to_all_s=t, level=level,
                   declared=declared, cal_imbalance=ctx.cal.expert_imbalance)


def _block_kinds(g: OpGraph) -> tuple[int, ...]:
    kinds = tuple(b.kind for b in g.blocks)
    return kinds if len(set(kinds)) > 1 else ()


def _shared_blocks(g: OpGraph) -> str:
    """Why pipeline stages and ZeRO-3's per-block units cannot hold the model ("" where they can): blocks of its
    stack that share parameters (one module used as every layer, as ALBERT's), which a stage or a unit would each
    hold, gather and step apart."""
    if g.block_container is None:
        return ""
    pre = f"{g.block_container}." if g.block_container else ""
    for p in g.params:
        held: dict[int, str] = {}  # block -> the name it reads the parameter by
        for name in (p.name, *p.aliases):
            b = block_index(name, g.block_container)
            if b is not None:
                held.setdefault(b, name)
        if len(held) > 1:
            (i, first), (j, second) = sorted(held.items())[:2]
            return (f"the blocks {pre}{i}, {pre}{j}{', ...' if len(held) > 2 else ''} share their parameters "
                    f"({first} is also {second}: one module used as several layers, as in ALBERT), and pipeline "
                    "stages and ZeRO-3's per-block units would each hold and step their own copy")
    return ""


def _no_stack(g: OpGraph) -> str:
    """Why no pipeline program can be cut from an exported graph without blocks ("" where it has them): stage code
    cuts between the blocks of a layer stack (codegen.pipeline). Tensor and context programs need none."""
    if g.blocks or not isinstance(g.graph_module, torch.export.ExportedProgram):
        return ""
    return ("the trace found no stack of repeated blocks to cut into pipeline stages (a layer applied in a loop, as "
            "ALBERT's, is one module)")


def _code_limits(g: OpGraph, splits, valid_tp: tuple[int, ...], *, ep: int = 1) -> tuple[str, str]:
    """(why pp > 1 cannot run, why tp > 1 cannot run), "" where it can or where the graph is not at hand; `ep`:
    the pinned expert-parallel degree (its code hands the router logits to the ep context, not across cuts).
    A graph that cannot be cut runs neither."""
    if not isinstance(g.graph_module, torch.export.ExportedProgram):
        return "", ""
    try:
        _extract(g, splits, tp=1, expert_parallel=ep)
    except SegmentError as e:
        return str(e), str(e)
    t = next((t for t in valid_tp if t > 1), None)
    if t is None:
        return "", ""
    try:
        _extract(g, splits, tp=t, expert_parallel=ep)
    except SegmentError as e:
        return "", str(e)
    return "", ""


def _runnable_experts(g: OpGraph, experts: Experts, splits, ep: int | None) -> Experts:
    """`experts`, with why no expert-parallel program can be generated for them where none can (the code generator
    runs batched experts; a list of expert modules, or experts with biases, it refuses): a pinned ep > 1 is then
    refused before anything is searched (check_experts), and the search keeps ep = 1 and says why."""
    if ep == 1 or not experts.layers or experts.why_not or not isinstance(g.graph_module, torch.export.ExportedProgram):
        return experts
    degree = ep or min(d for d in range(2, experts.num_experts + 1) if experts.num_experts % d == 0)
    try:
        _extract(g, splits, tp=1, expert_parallel=degree)
    except SegmentError as e:
        return dataclasses.replace(experts, why_not=f"no expert-parallel program can be generated for them ({e})")
    return experts


def _batch_split(c) -> str:
    """How a plan splits each batch: "dp=2, 4 microbatches"."""
    return ", ".join(x for x in (f"dp={c.dp}" if c.dp > 1 else "", f"cp={c.cp}" if c.cp > 1 else "",
                                 f"{c.num_microbatches} microbatches" if c.num_microbatches > 1 else "") if x)


def _warn_batch_norm(g: OpGraph, plan: Plan) -> None:
    """Say so where the plan splits the batch of a model whose batch norms normalise with the batch's statistics:
    each replica, context slice and microbatch then normalises its own share, as torch's DDP does, and training
    differs from one process on the whole batch (partitioner.tracer.batch_statistics.training_batch_norms)."""
    c = plan.config
    if c.dp * c.cp == 1 and c.num_microbatches == 1:
        return
    found = training_batch_norms(g.graph_module)
    if not found:
        return
    where = sorted({module_path(n) for n in found})
    shown = where[0] + (", ..." if len(where) > 1 else "")  # the trace may hold a few of a stack's blocks
    split = _batch_split(c)
    warnings.warn(
        f"batch norm in training mode ({shown}): this plan splits each batch of {plan.global_batch_size} ({split}), "
        f"so every microbatch of {c.microbatch_size} normalises with its own statistics, as torch's DDP does, and "
        "training differs from one process on the whole batch; pin dp=1, cp=1 and "
        f"microbatch_size={plan.global_batch_size} to keep batches whole, or freeze the statistics (model.eval())",
        stacklevel=3)


def _warn_buffer_writes(g: OpGraph, plan: Plan) -> None:
    """Say so where the plan splits the batch of a model whose forward writes buffers other than its batch norms'
    (a running statistic updated under torch.no_grad()): each microbatch and replica writes them from its own
    share, and training differs from one process, which writes them once per step from the whole batch."""
    c = plan.config
    if (c.dp * c.cp == 1 and c.num_microbatches == 1) or not isinstance(g.graph_module, torch.export.ExportedProgram):
        return
    norms = tuple(module_path(n) + "." for n in training_batch_norms(g.graph_module))
    found = sorted(b for b in written_buffers(g.graph_module) if not b.startswith(norms))
    if not found:
        return
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    split = _batch_split(c)
    warnings.warn(
        f"the model's forward writes buffer {shown} from the batch it sees: this plan splits each batch of "
        f"{plan.global_batch_size} ({split}), so every microbatch of {c.microbatch_size} writes it from its own "
        "rows (each replica its own copy, as torch's DDP without broadcast_buffers), and training differs from one "
        f"process on the whole batch; pin dp=1, cp=1 and microbatch_size={plan.global_batch_size} to keep "
        "batches whole", stacklevel=3)


def _check_batch_statistics(g: OpGraph, decl: Declarations) -> str:
    """A model whose own forward combines statistics of the batch non-linearly (partitioner.tracer.batch_statistics:
    a product of two means over the tokens, as a router's load-balancing loss computed inside the model) trains
    the same as one process only on unsplit batches: dp or cp pinned > 1 is refused; where the search must keep
    dp = cp = 1, the nodes that say why ("" where it need not). Hugging Face's router loss
    (output_router_logits=True) is computed over every rank's tokens by the programs (codegen.segment_ep), and
    async SGD's replicas train apart: both left alone."""
    if decl.async_sgd or not isinstance(g.graph_module, torch.export.ExportedProgram) or _load_balancing_loss(g):
        return ""
    found = _kept(g, "batch_statistics", lambda: nonlinear_batch_statistics(g.graph_module))
    if not found:
        return ""
    what = ", ".join(describe_statistic(n) for n in found[:3])
    what += f" and {len(found) - 3} more" if len(found) > 3 else ""
    for axis in ("dp", "cp"):
        value = getattr(decl, axis)
        if value not in (None, 1):
            raise DeclarationError(
                f"{axis}={value}: the model's forward combines statistics of the whole batch non-linearly ({what}: "
                "e.g. a product of two means over the tokens, as a router's load-balancing loss E * sum_e f_e * P_e "
                "computed inside the model); each of the ranks splitting the batch would compute it on its own "
                "tokens, and the mean of those is not the batch's, so training would differ from one process. Pin "
                f"{axis}=1 (pipeline and tensor parallelism keep each microbatch's tokens together), or compute the "
                "loss from router logits the model returns, as Hugging Face's output_router_logits=True does (the "
                "programs compute that one over every rank's tokens)")
    return what


def _sp_code_limit(g: OpGraph, splits, valid_tp: tuple[int, ...]) -> str:
    """Why programs with sequence parallelism cannot be generated ("" where they can, or where nothing splits)."""
    t = next((t for t in valid_tp if t > 1), None)
    if t is None or not splits.sequence.scatters or not isinstance(g.graph_module, torch.export.ExportedProgram):
        return ""
    try:
        code = _extract(g, splits, tp=t, sp=True)
    except SegmentError as e:
        return str(e)
    if code.aux_loss:  # codegen.program.not_runnable_aux
        return ("each tensor slice would route its own share of the tokens, and the model's load-balancing loss is "
                "summed over the data-parallel ranks only")
    return ""


def _cp_code_limit(g: OpGraph, splits, cp: int) -> str:
    """Why programs with context parallelism cannot be generated ("" where they can, or where the graph is not at
    hand): an op relating tokens outside attention (a pooler reading the first token, a last-token index, a scan)
    is refused when the code is cut for cp, which a plan found by the search, or pinned, must not reach."""
    if not isinstance(g.graph_module, torch.export.ExportedProgram):
        return ""
    try:
        _extract(g, splits, tp=1, cp=cp)
    except SegmentError as e:
        return str(e)
    return unsplittable_mask(g.graph_module, g.traced_seq_len or 1)  # a sliding window: refused now, not at step 1


def _check_module_units(g: OpGraph, decl: Declarations) -> None:
    """zero3_unit='module' pinned where no program could run it: say why and what to pin instead."""
    axes = [f"{a}={getattr(decl, a)}" for a in ("tp", "cp") if getattr(decl, a) not in (None, 1)]
    if axes:
        raise DeclarationError(f"zero3_unit='module' with {', '.join(axes)}: tensor- and context-parallel programs "
                               "are not run with per-module ZeRO-3 units yet; pin zero3_unit='block', or tp=cp=1")


def _derived(g: OpGraph) -> dict:
    """What this process derived from `g` alone, kept while `g` lives (an OpGraph is frozen: it cannot go
    stale). Keyed by the graph's identity, since its fields (lists, polynomials) do not hash."""
    memo = _DERIVED.get(id(g))
    if memo is None:
        memo = _DERIVED[id(g)] = {}
        weakref.finalize(g, _DERIVED.pop, id(g), None)  # the id is reused once g is gone
    return memo


_DERIVED: dict[int, dict] = {}


def _kept(g: OpGraph, key: str, make: Callable[[], Any]) -> Any:
    """make(), a function of `g` alone, computed once while `g` lives."""
    memo = _derived(g)
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _splits(g: OpGraph) -> TensorSplits:
    return _kept(g, "splits", lambda: find_splits(g))


def _extract(g: OpGraph, splits: TensorSplits | None, **kw: Any) -> ModelCode:
    """segments.extract of `g` with `splits` (its own, from _splits, or None), kept for the next compile of `g`;
    a SegmentError is kept and raised again."""
    memo = _derived(g)
    if splits is not None and splits is not memo.get("splits"):  # splits of another making: not what is kept
        return extract(g.graph_module, g, splits=splits, **kw)
    key = ("code", splits is not None, tuple(sorted(kw.items())))
    if key not in memo:
        try:
            memo[key] = extract(g.graph_module, g, splits=splits, **kw)
        except SegmentError as e:
            # its words only: the error's traceback holds the frames that hold g, which would never be freed
            memo[key] = SegmentError(*e.args)
    got = memo[key]
    if isinstance(got, SegmentError):
        raise SegmentError(*got.args)  # a new one: raising the kept one would attach this traceback to it
    return got


def _runs_code(g: OpGraph) -> bool:
    """Whether programs can run `g` as generated code (its exported graph cuts into prefix, blocks, suffix)."""
    try:
        _extract(g, None, tp=1)
    except SegmentError:
        return False
    return True


def _model_code(g: OpGraph, splits, cand: ParallelConfig, *, fp8: bool = False, aux_loss: bool = False) -> dict:
    """The prefix/block/suffix code that pipeline and tensor-parallel programs run; data-parallel and async
    SGD programs run it too when the graph's attention, norms or activations were rewritten to fused ops (the
    module's own forward would run them eagerly: OpGraph.rewritten), and data-parallel ones where the model
    computes its routers' load-balancing loss (`aux_loss`, async SGD's replicas excepted: the module's own
    forward would compute each replica's, not the batch's)."""
    if cand.pp == 1 and cand.tp == 1 and cand.cp == 1 and cand.ep == 1 and not g.rewritten and \
            not (cand.replicas > 1 and aux_loss):
        return {}
    if not isinstance(g.graph_module, torch.export.ExportedProgram):
        how = "traced with torch.fx" if g.graph_module is not None else "given as an OpGraph without its graph"
        return {"code_note": f"the model was {how}; programs for pp/tp plans are generated from torch.export's "
                             "graph: compile the nn.Module (trace method 'export')"}
    try:
        return {"code": _extract(g, splits, tp=cand.tp, sp=cand.sp, fp8=fp8, cp=cand.cp,
                                expert_parallel=cand.ep)}
    except SegmentError as e:
        return {"code_note": str(e)}


def _fused_text(g: OpGraph) -> str:
    """Plan.fused: the fused ops the tracer wrote, with how many of each."""
    return ", ".join(f"{op} x{k}" for op, k in sorted(g.fused.items()))


def _load_balancing_loss(g: OpGraph) -> bool:
    """Whether the model computes its routers' load-balancing loss (the suffix reads the MoE layers' router
    logits, partitioner.codegen.segments): a statistic of the batch, which only the generated code computes over
    the data-parallel ranks' tokens (at ep = 1 the module's own forward would compute each rank's)."""
    return bool(g.blocks) and isinstance(g.graph_module, torch.export.ExportedProgram) and \
        reads_router_logits(g.graph_module, g)


def _segment_name(g: OpGraph, n: int) -> str:
    node = g.nodes[n]
    if node.block is not None:
        return g.blocks[node.block].name
    first_block = g.blocks[0].first_node if g.blocks else len(g.nodes)
    return "prefix" if n < first_block else "suffix"


def _predict(g: OpGraph, topo: Topology, decl: Declarations, ctx: CostContext, ev: StageEvaluator, cand: ParallelConfig,
             cut: Cut, stages: list[StagePlan], sim: Any, compression: tuple[str, str], saving: float,
             needed: bool = False) -> Predicted:
    step = charge_idle(cut.stages, cand.num_microbatches, cand.interleave, sim.step_time_s, ctx.cal.pipeline_idle_cost)
    gb, s = decl.global_batch_size, g.traced_seq_len or 1
    model_flops = g.flops(batch_size=gb, seq_len=g.traced_seq_len) if g.batch_symbolic else \
        g.flops() * gb / g.traced_batch_size
    per_device = model_flops / topo.world_size / step
    peak = topo.device.flops(dtype_for(decl.precision))
    worst = max(rank_memory(cut, cand.pp, cand.schedule).values(), key=lambda m: m.total)
    return Predicted(step_time_s=step, tokens_per_s=gb * s / step, samples_per_s=gb / step,
                     model_tflops_per_device=per_device / 1e12, mfu=per_device / peak,
                     peak_memory_bytes=worst.total, memory=worst, memory_capacity_bytes=float(topo.device.memory_bytes),
                     bytes_per_link=_traffic(ctx, ev, cand, cut, topo, dict(zip(LEVELS, compression))),
                     bubble_fraction=sim.bubble_fraction, exposed_comm_s=max(st.exposed_comm_s for st in cut.stages),
                     compression_saving_s=saving, compression_needed_to_fit=needed, search_step_time_s=cut.step_time_s,
                     context_buffer_bytes=_context_buffers(ctx, cand))


def _context_buffers(ctx: CostContext, cand: ParallelConfig) -> float:
    """The largest context-parallel attention buffers of any unit, as the memory model scales buffers (0 at cp = 1)."""
    if cand.cp == 1:
        return 0.0
    arr = ctx.unit_arrays(cand.tp, cand.microbatch_size, cand.recompute, cand.sp, cand.cp, cand.cp_kind, cand.ep,
                          cand.recompute_blocks)
    return max(arr.cp_buffers, default=0.0) * ctx.cal.buffer_mem_scale


def _traffic(ctx: CostContext, ev: StageEvaluator, cand: ParallelConfig, cut: Cut, topo: Topology,
             compression: dict[str, str]) -> dict[str, float]:
    """Bytes one rank of the busiest stage sends per step, by link level (ring collectives: 2(p-1)/p of the buffer).

    Tensor-parallel all-reduces, context-parallel attention traffic (CostContext.context_bytes), pipeline
    sends, and the data-parallel traffic of `_dp_traffic` (over dp x cp ranks).
    """
    out = {LinkLevel.INTRA_NODE.value: 0.0, LinkLevel.INTER_NODE.value: 0.0}
    mb, m, s = cand.microbatch_size, cand.num_microbatches, ctx.seq
    busiest = max(range(len(cut.stages)), key=lambda k: cut.stages[k].params)
    i, j = cut.bounds[busiest], cut.bounds[busiest + 1]
    if cand.tp > 1:
        level = topo.group_level(Mesh(cand.pp, cand.dp, cand.tp, cand.cp).tp_ranks()).value
        tp_bytes = sum(local(c.bytes, mb, s, cand.cp) * ctx.scale for u in range(i, j) for a, b in [ctx.units[u]]
                       for n in ctx.g.nodes[a:b] for c in ctx._collectives.get(n.name, ()))
        out[level] = out.get(level, 0.0) + 2 * (cand.tp - 1) / cand.tp * tp_bytes * m
    if cand.cp > 1:
        level = topo.group_level(Mesh(cand.pp, cand.dp, cand.tp, cand.cp).cp_ranks()).value
        out[level] = out.get(level, 0.0) + m * sum(ctx.context_bytes(u, mb, cand.tp, cand.cp, cand.cp_kind)
                                                   for u in range(i, j))
    if cand.replicas > 1:
        fpar = ev.arrays.fpar  # frozen parameters: never reduced nor gathered (held whole on every replica)
        trained = max(0.0, cut.stages[busiest].params - (fpar[j] - fpar[i] if fpar else 0.0))
        dp = _dp_traffic(ctx, cand, ev.dp_ranks(stage_rank(cand.schedule, cand.pp, busiest)), trained,
                         tuple(compression[lv] for lv in LEVELS), ev.stage_low_rank(i, j))
        every = (ctx.async_sgd or {}).get("every", 1)  # local SGD averages the fp32 parameters every k steps
        for level, nbytes in dp.items():
            out[level] += nbytes / every
    if cand.ep > 1:
        level = topo.group_level(ep_ranks(cand)).value
        out[level] = out.get(level, 0.0) + m * sum(ctx.expert_bytes(u, mb, cand.tp, cand.cp, cand.ep)
                                                   for u in range(i, j))
    if cand.pp > 1 and busiest < len(cut.stages) - 1:
        level = topo.link_level(0, cand.dp * cand.cp * cand.tp).value
        out[level] = out.get(level, 0.0) + 2 * ctx.boundary_bytes(j - 1, mb, cp=cand.cp) * m
    return {k: v for k, v in out.items() if k != LinkLevel.SAME_DEVICE.value}


def _dp_traffic(ctx: CostContext, cand: ParallelConfig, ranks: tuple[int, ...], n: float,
                compression: tuple[str, str], lr: LowRank | None) -> dict[str, float]:
    """Bytes one rank sends per step, per link level, for a stage's `n` parameters' data-parallel traffic,
    as cost_models/compression.py times it.

    Gradients (fp32, or compressed): DDP/ZeRO-1 all-reduce, hierarchical across both levels (PowerSGD:
    the inter-node phase on all n elements, f = its wire fraction); ZeRO-2/3 reduce-scatter, flat (int8/int4:
    an all-to-all, so (p-k)/p of the bytes leave the node). Parameters: ZeRO-1/2 all-gather the updated ones,
    ZeRO-3 gathers them 2m times (int8 codes under int8/int4), in the hierarchical form across both levels.
    """
    topo, z, m = ctx.topo, cand.zero_stage, cand.num_microbatches
    levels, p = traffic_levels(ctx.comm, ranks), len(ranks)
    both = levels == tuple(LEVELS)
    nodes, k = topo.nodes_spanned(ranks), topo.max_ranks_per_node(ranks) if both else 1

    def ring(nbytes: float) -> dict[str, float]:  # one reduce-scatter or all-gather of nbytes, per level
        if both:
            return {"intra_node": (k - 1) / k * nbytes, "inter_node": (nodes - 1) / nodes * nbytes / k}
        return {levels[0]: (p - 1) / p * nbytes}

    def w(c: str) -> float:
        return wire_bytes(c, low_rank=lr, reduce_bytes=REDUCE_BYTES_OF_PRECISION[ctx.precision])

    parts: list[dict[str, float]] = []
    if z <= 1:
        ci, ce = compression
        if both:
            inter = 2 * (nodes - 1) / nodes * n * (w(ce) if ce == "powersgd" else w(ce) / k)
            parts.append({"intra_node": 2 * (k - 1) / k * n * w(ci), "inter_node": inter})
        else:
            parts.append({lv: 2 * v for lv, v in ring(n * w(compression[LEVELS.index(levels[0])])).items()})
    else:
        c = group_compressor(compression)
        if c in ("int8", "int4") and both:
            parts.append({"intra_node": (k - 1) / p * n * w(c), "inter_node": (p - k) / p * n * w(c)})
        else:
            parts.append(ring(n * w(c)))
    param_bytes = 4 if ctx.precision == "fp32" else 2
    if z in (1, 2):
        parts.append(ring(n * param_bytes))
    elif z == 3:
        gathered = GATHER_CODE_BYTES if group_compressor(compression) in ("int8", "int4") else param_bytes
        parts.append({lv: 2 * m * v for lv, v in ring(n * gathered).items()})
    out: dict[str, float] = {}
    for part in parts:
        for lv, v in part.items():
            out[lv] = out.get(lv, 0.0) + v
    return out
