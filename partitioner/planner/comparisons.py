"""What a plan is measured against, each costed by the plan's own cost model.

    over_memory_alternatives  faster configurations that do not fit in memory (search.py finds them)
    pinned_out                the best configuration the declarations rule out (a second, capped search)
    hand_baselines            pure data parallel; ZeRO-3 only; Megatron: tp = min(8, devices per node)
                              with the fewest pipeline stages that fit

A baseline is searched like the plan, over its free dimensions only (the
microbatch, schedule and recompute that suit it best) and without gradient
compression, then its step is simulated like the plan's, so the gain printed
by `plan.explain()` compares like with like:

>>> from partitioner import compile
>>> from examples.mlp import mlp, example_inputs
>>> model = mlp()
>>> plan = compile(model, "8xA100-80GB", example_inputs(model), global_batch_size=64)
>>> [(b.name, b.fits) for b in plan.baselines]
[('pure data parallel', True), ('ZeRO-3 only', True), ('Megatron tp=8', True)]
"""

from __future__ import annotations

from typing import Any

from cost_models.compression import LEVELS
from partitioner.planner.cut import Cut, charge_idle
from partitioner.planner.declarations import Declarations, divisors
from partitioner.planner.expert_split import ep_options
from partitioner.planner.plan import Alternative, Baseline, ParallelConfig
from partitioner.planner.schedule import build_schedule
from partitioner.planner.search import (
    Scored,
    enumerate_candidates,
    least_memory,
    module_units_run,
    rank_peak,
    search,
)
from partitioner.planner.simulate import Durations, simulate
from partitioner.planner.stage_costs import StageEvaluator
from partitioner.planner.unit_costs import CostContext

__all__ = ["durations", "hand_baselines", "over_memory_alternatives", "pinned_out"]

GiB = 2**30
NO_COMPRESSION = ("none", "none")
# Exact cuts the declaration-free search may spend: it only has to show what the pins cost, and the
# candidates it visits first (lowest bound) are the likely winners.
_UNPINNED_MAX_CUTS = 24
_PINNABLE = ("dp", "tp", "pp", "cp", "cp_kind", "ep", "zero_stage", "zero3_unit", "microbatch_size", "schedule",
             "interleave", "recompute", "recompute_blocks")


def durations(ev: StageEvaluator, cut: Cut) -> Durations:
    """Per-stage times for the simulator: compute apart from the p2p it models itself."""
    S = len(cut.stages)
    p2p = ev.p2p
    fwd, bwd, sync, optim = [], [], [], []
    for k, st in enumerate(cut.stages):
        i, j = cut.bounds[k], cut.bounds[k + 1]
        fwd.append(st.forward_s - (p2p[i - 1] if k > 0 else 0.0))
        bwd.append(st.backward_s - (p2p[j - 1] if k < S - 1 else 0.0))
        sync.append(st.exposed_comm_s)
        optim.append(st.tail_s - st.exposed_comm_s)
    links = tuple(p2p[cut.bounds[k + 1] - 1] for k in range(S - 1))
    # a split backward's W: the graph's weight-gradient share of the backward (unit_costs.UnitCost.weight_s)
    arr = ev.arrays
    share = arr.total_w / arr.total_b if arr.total_b > 0 else 0.0
    return Durations(forward=tuple(fwd), backward=tuple(bwd), p2p=links, grad_sync=tuple(sync), overlap=0.0,
                     optim=tuple(optim), weight_grad=tuple(share * b for b in bwd))


def _faster(best: Scored, other: Scored) -> str:
    return f"{100 * (1 - other.cut.step_time_s / best.cut.step_time_s):.1f} % faster"


def over_memory_alternatives(best: Scored, found: tuple[Scored, ...], cap_of: Any) -> tuple[Alternative, ...]:
    """`SearchResult.over_memory` as runners-up: how much faster each would be, and how far over the peak its
    recompute mode may reach (`cap_of(candidate)`, CostContext.cap)."""
    out = []
    for s in found:
        peak, cap = rank_peak(s.cut, s.cand.pp), cap_of(s.cand)
        out.append(Alternative(
            config=s.cand, step_time_s=s.cut.step_time_s, peak_memory_bytes=peak, fits=False,
            why=f"out of memory by {(peak - cap) / GiB:.1f} GiB ({_faster(best, s)} by a balanced cut; needs "
                f"{peak / GiB:.1f} GiB per rank of the {cap / GiB:.1f} GiB allowed)",
            compression=dict(zip(LEVELS, s.compression))))
    return tuple(out)


def pinned_out(ctx: CostContext, decl: Declarations, best: Scored, *, valid_tp: tuple[int, ...],
               forced: dict[str, Any]) -> Alternative | None:
    """The fastest configuration found without the user's pins, when it beats `best` and breaks a pin.

    `ctx` must not carry the compression pins (every candidate then has an option). `forced`: restrictions that are not the user's choice
    (no per-rank program for pp or tp > 1), kept. The search starts from `best`'s step time as its
    incumbent and stops after _UNPINNED_MAX_CUTS exact cuts, so what it reports is a configuration at
    least that much faster, not necessarily the fastest.
    """
    pins = {k: v for k, v in decl.pinned().items() if k not in forced}
    if not pins:
        return None
    free = Declarations(global_batch_size=decl.global_batch_size, precision=decl.precision, optimizer=decl.optimizer,
                        max_memory_fraction=decl.max_memory_fraction, **forced)
    # Candidates that keep every pinned dimension can at best tie `best`: leave them out. Without
    # compression pins every candidate has a compression option, so none needs checking.
    cands = [c for c in enumerate_candidates(free, world_size=ctx.topo.world_size,
                                             devices_per_node=ctx.topo.devices_per_node, num_units=len(ctx.units),
                                             valid_tp=valid_tp,
                                             experts=lambda dp, tp, cp: ep_options(
                                                 free, ctx.experts, dp=dp, tp=tp, cp=cp,
                                                 devices_per_node=ctx.topo.devices_per_node),
                                             module_units=lambda pp, tp, cp: module_units_run(tp, cp))
             if any(getattr(c, k) != v for k, v in pins.items() if k in _PINNABLE) or "compression" in pins]
    result = search(ctx, cands, keep=1, incumbent=best.cut.step_time_s, max_cuts=_UNPINNED_MAX_CUTS)
    if not result.ranked or result.ranked[0].cut.step_time_s >= best.cut.step_time_s:
        return None
    top = result.ranked[0]
    # (what was declared, what the configuration has instead)
    broken = [(f"{k}={pins[k]}", f"{k}={getattr(top.cand, k)}") for k in _PINNABLE
              if k in pins and getattr(top.cand, k) != pins[k]]
    crossed = ctx.crossed_levels(top.cand)
    broken += [(f"{level} compression {c}", f"{level} {top.compression[LEVELS.index(level)]}")
               for level, c in pins.get("compression", {}).items()
               if level in crossed and top.compression[LEVELS.index(level)] != c]
    if not broken:
        return None
    return Alternative(config=top.cand, step_time_s=top.cut.step_time_s, peak_memory_bytes=rank_peak(top.cut, top.cand.pp),
                       fits=True, why=f"violates declared {', '.join(d for d, _ in broken)} ({_faster(best, top)}; "
                                      f"it has {', '.join(h for _, h in broken)})",
                       compression=dict(zip(LEVELS, top.compression)))


def hand_baselines(ctx: CostContext, decl: Declarations) -> tuple[Baseline, ...]:
    """Pure data parallelism (ZeRO 0), ZeRO-3 only, and Megatron (tp = min(8, devices per node), ZeRO 0
    or 1, the fewest pipeline stages that fit), each at its best microbatch, schedule and recompute."""
    world = ctx.topo.world_size
    return (_flat(ctx, decl, "pure data parallel", zero_stage=0),
            _flat(ctx, decl, "ZeRO-3 only", zero_stage=3),
            _megatron(ctx, decl, min(8, ctx.topo.devices_per_node)) if world > 1 else
            Baseline(name="Megatron", config=None, step_time_s=None, peak_memory_bytes=None, fits=False,
                     note="one device: no tensor group to form"))


def _hand(decl: Declarations, **pins: Any) -> Declarations:
    return Declarations(global_batch_size=decl.global_batch_size, precision=decl.precision, optimizer=decl.optimizer,
                        max_memory_fraction=decl.max_memory_fraction, **pins)


def _candidates(ctx: CostContext, d: Declarations) -> list[ParallelConfig]:
    return list(enumerate_candidates(d, world_size=ctx.topo.world_size, devices_per_node=ctx.topo.devices_per_node,
                                     num_units=len(ctx.units), valid_tp=(d.tp,)))


def _fitted(ctx: CostContext, name: str, s: Scored, note: str = "") -> Baseline:
    c = s.cand
    sched = build_schedule(c.schedule, pp=c.pp, num_microbatches=c.num_microbatches, interleave=c.interleave)
    simulated = simulate(sched, durations(StageEvaluator(ctx, c, NO_COMPRESSION), s.cut)).step_time_s
    step = charge_idle(s.cut.stages, c.num_microbatches, c.interleave, simulated, ctx.cal.pipeline_idle_cost)  # as _predict
    return Baseline(name=name, config=c, step_time_s=step, peak_memory_bytes=rank_peak(s.cut, c.pp), fits=True,
                    note=note)


def _unfit(ctx: CostContext, name: str, cands: list[ParallelConfig], note: str = "") -> Baseline:
    need, who = least_memory(ctx, cands, NO_COMPRESSION)
    return Baseline(name=name, config=who, step_time_s=None, peak_memory_bytes=need, fits=False,
                    note=f"{note}needs {need / GiB:.1f} GiB per rank of the "
                         f"{ctx.cap(who) / GiB:.1f} GiB allowed")


def _flat(ctx: CostContext, decl: Declarations, name: str, *, zero_stage: int) -> Baseline:
    world = ctx.topo.world_size
    cands = _candidates(ctx, _hand(decl, dp=world, tp=1, pp=1, zero_stage=zero_stage))
    if not cands:
        return Baseline(name=name, config=None, step_time_s=None, peak_memory_bytes=None, fits=False,
                        note=f"the global batch {decl.global_batch_size} does not split over {world} replicas")
    result = search(ctx, cands, keep=1, compression=NO_COMPRESSION)
    return _fitted(ctx, name, result.ranked[0]) if result.ranked else _unfit(ctx, name, cands)


def _megatron(ctx: CostContext, decl: Declarations, tp: int) -> Baseline:
    world, name = ctx.topo.world_size, f"Megatron tp={tp}"

    def absent(why: str) -> Baseline:
        return Baseline(name=name, config=None, step_time_s=None, peak_memory_bytes=None, fits=False, note=why)

    if tp == 1:
        return absent("one device per node: no tensor group to form inside a node")
    if world % tp:
        return absent(f"tp={tp} does not divide the {world} devices")
    bad = [(what, n) for what, n in ctx.splits.divisors if n % tp]
    if bad:
        return absent(f"tp={tp} does not divide the {bad[0][0]} ({bad[0][1]})")
    last: list[ParallelConfig] = []
    for pp in divisors(world // tp):
        if pp > len(ctx.units):
            break
        # Megatron-LM keeps full optimizer state per replica, or shards it (its distributed optimizer: ZeRO-1).
        cands = [c for c in _candidates(ctx, _hand(decl, tp=tp, pp=pp)) if c.zero_stage <= 1]
        if not cands:
            continue
        last = cands
        result = search(ctx, cands, keep=1, compression=NO_COMPRESSION)
        if result.ranked:
            return _fitted(ctx, name, result.ranked[0], note=f"pp={pp}, the fewest pipeline stages that fit")
    if not last:
        return absent(f"the global batch {decl.global_batch_size} does not split over the data-parallel replicas "
                      f"of any pipeline depth with tp={tp}")
    return _unfit(ctx, name, last, note="no pipeline depth fits; the deepest ")
