"""The search: every configuration the declarations allow, best first, exactly.

Enumerates (tp, pp, dp, microbatch, schedule, interleave, ZeRO stage,
recompute), orders them by a lower bound on step time, and runs the exact
stage cut (cut.py) on each until the bound exceeds the k-th best step time
found: branch and bound, so the k best are exact under the cost model while
most candidates are never cut. Ties go to the simpler configuration (fewer
pipeline stages, smaller tensor groups, lower ZeRO stage, less recompute,
simpler schedule, larger microbatch), the order a person would try them in.

Gradient compression is not a dimension of the enumeration: it changes only
each stage's tail (costing.py), so every stage takes its best compression and
the cut is found once. That is exact when the stages of the best cut agree,
which is the rule (one stage when pp = 1; the same choice for stages of similar
size): no single compression can beat every stage having its best, and the
agreed choice achieves it. When they disagree, the candidate is cut again
under each compression it allows and the best taken.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

from partitioner.costing import CostContext
from partitioner.cut import Cut, cut_stages, evaluate_cut
from partitioner.declarations import Declarations, divisors
from partitioner.plan import ParallelConfig

__all__ = ["Scored", "SearchResult", "enumerate_candidates", "search", "simplicity"]

_RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}
_SCHEDULE_ORDER = {"1f1b": 0, "gpipe": 1, "interleaved-1f1b": 2}
_INTERLEAVES = (2, 3, 4)


def simplicity(c: ParallelConfig) -> tuple:
    return (c.pp, c.tp, c.zero_stage, _RECOMPUTE_ORDER[c.recompute], _SCHEDULE_ORDER[c.schedule], c.interleave,
            -c.microbatch_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scored:
    cand: ParallelConfig
    cut: Cut
    compression: tuple[str, str] = ("none", "none")  # (intra_node, inter_node), the same for every stage


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchResult:
    ranked: tuple[Scored, ...]  # best first
    evaluated: int  # candidates whose stages were cut
    space: int  # candidates enumerated


def enumerate_candidates(d: Declarations, *, world_size: int, devices_per_node: int, num_units: int,
                         valid_tp: tuple[int, ...]) -> Iterator[ParallelConfig]:
    """Every configuration the declarations allow (not yet checked for memory)."""
    gb = d.global_batch_size
    tps = [d.tp] if d.tp is not None else [t for t in valid_tp if world_size % t == 0 and t <= devices_per_node]
    for tp in tps:
        for pp in ([d.pp] if d.pp is not None else divisors(world_size // tp)):
            if pp > num_units or (world_size // tp) % pp:
                continue
            dp = world_size // (tp * pp)
            if (d.dp is not None and dp != d.dp) or gb % dp:
                continue
            per_replica = gb // dp
            mbs = [d.microbatch_size] if d.microbatch_size is not None else [
                x for x in divisors(per_replica) if x & (x - 1) == 0 or x == per_replica]
            for mb in mbs:
                if per_replica % mb:
                    continue
                m = per_replica // mb
                for sched, v in _schedules(d, pp, m, num_units):
                    zeros = [d.zero_stage] if d.zero_stage is not None else ([0, 1, 2, 3] if dp > 1 else [0])
                    recomputes = [d.recompute] if d.recompute is not None else ["none", "selective", "full"]
                    for z in zeros:
                        for rc in recomputes:
                            yield ParallelConfig(dp=dp, tp=tp, pp=pp, zero_stage=z, microbatch_size=mb,
                                            num_microbatches=m, schedule=sched, interleave=v, recompute=rc)


def _schedules(d: Declarations, pp: int, m: int, num_units: int) -> list[tuple[str, int]]:
    if pp == 1:
        # One stage: every schedule is gradient accumulation; name it 1F1B.
        return [("1f1b", 1)] if d.schedule in (None, "1f1b", "gpipe") else []
    out = []
    for sched in ([d.schedule] if d.schedule is not None else ["1f1b", "gpipe", "interleaved-1f1b"]):
        if sched != "interleaved-1f1b":
            out.append((sched, 1))
            continue
        for v in ([d.interleave] if d.interleave is not None else _INTERLEAVES):
            # Megatron's interleaved schedule needs the microbatches in groups of pp.
            if pp * v <= num_units and m % pp == 0:
                out.append((sched, v))
    return out


def search(ctx: CostContext, candidates: list[ParallelConfig], *, keep: int = 5) -> SearchResult:
    """The `keep` best candidates with their exact cuts."""
    order = []
    for cand in candidates:
        ev = ctx.prepare(cand)
        order.append((ev.lower_bound(), simplicity(cand), cand, ev))
    order.sort(key=lambda x: (x[0], x[1]))
    ranked: list[tuple[float, tuple, ParallelConfig, Cut]] = []
    evaluated = 0
    for lb, simple, cand, ev in order:
        kth = ranked[keep - 1][0] if len(ranked) >= keep else math.inf
        if math.isinf(lb):
            continue  # its model state alone does not fit
        if lb > kth:
            break  # sorted by bound: nothing after this can enter the top `keep`
        evaluated += 1
        cut = _cut_one_compression(ctx, ev, incumbent=kth)
        if cut is None:
            continue
        ranked.append((cut.step_time_s, simple, cand, cut))
        ranked.sort(key=lambda x: (x[0], x[1]))
        del ranked[keep:]
    return SearchResult(ranked=tuple(Scored(cand=c, cut=cut, compression=cut.stages[0].compression)
                                     for _, _, c, cut in ranked),
                        evaluated=evaluated, space=len(candidates))


def _cut_one_compression(ctx: CostContext, ev, *, incumbent: float) -> Cut | None:
    """The best cut whose stages all use one compression (see the module docstring)."""
    cut = cut_stages(ev, incumbent=incumbent)
    if cut is None or len({st.compression for st in cut.stages}) == 1:
        return cut
    best = None
    for option in ev.options:
        other = cut_stages(ctx.prepare(ev.cand, option), incumbent=incumbent)
        if other is not None and (best is None or other.step_time_s < best.step_time_s):
            best = other
    return best


def least_memory(ctx: CostContext, candidates: list[ParallelConfig]) -> tuple[float, ParallelConfig | None]:
    """The smallest peak memory per rank of any candidate's balanced cut (for the infeasible error)."""
    best, who = math.inf, None
    for cand in candidates:
        ev = ctx.prepare(cand)
        n, S = len(ctx.units), ev.num_stages
        if S > n:
            continue
        bounds = tuple(round(k * n / S) for k in range(S + 1))
        peak = max(ev.stage(bounds[k], bounds[k + 1], k).memory_total * cand.interleave for k in range(S))
        if peak < best:
            best, who = peak, cand
    return best, who


__all__ += ["least_memory", "evaluate_cut"]
