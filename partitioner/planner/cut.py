"""`cut_stages`: split units into pipeline stages minimising the step time.

The step time of a cut (stage_costs.py) is

    T = (m*v - 1) * max_k c_k + sum_k c_k / v + max_k tail_k

(ZB-H1: another coefficient of sum_k c_k, stage_costs.sum_weight.)

It is not a plain bottleneck objective, so the dynamic programme keeps, for
each (stages used, units covered), the Pareto front of
(max c, max tail, sum c) over the cuts that reach it: every criterion is
combined monotonically, so the optimum's prefix is on its prefix's front and
the result is exact. Stages that do not fit in memory are never formed (a
longer stage never needs less memory, so the scan over the end stops there),
and stages whose c or tail alone would make T worse than a known cut are
pruned (`c_limit`, `tail_limit`), which keeps it fast on 100-layer models.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable

from partitioner.planner.stage_costs import StageCost, StageEvaluator

__all__ = ["Cut", "charge_idle", "cut_stages", "evaluate_cut", "step_time"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cut:
    bounds: tuple[int, ...]  # unit index where each stage starts, plus the end
    stages: tuple[StageCost, ...]
    step_time_s: float


def step_time(stages: tuple[StageCost, ...], m: int, v: int, *, idle_cost: float = 1.0,
              sum_weight: float | None = None) -> float:
    """T above; `sum_weight` replaces its 1 / v for the zero-bubble schedules (stage_costs.sum_weight)."""
    max_c = max(s.c for s in stages)
    w = 1 / v if sum_weight is None else sum_weight
    t = (m * v - 1) * max_c + sum(s.c for s in stages) * w + max(s.tail_s for s in stages)
    return charge_idle(stages, m, v, t, idle_cost)


def charge_idle(stages: tuple[StageCost, ...], m: int, v: int, t: float, idle_cost: float) -> float:
    """Step time `t` with only `idle_cost` of each rank's idle time charged (Calibration.pipeline_idle_cost).

    The busiest pipeline rank works m * (its stages' c_k) + its tail; the rest of `t` is waiting.
    """
    if idle_cost >= 1.0 or len(stages) == 1:
        return t
    pp = len(stages) // v
    busy = max(m * sum(st.c for st in stages[p::pp]) for p in range(pp)) + max(st.tail_s for st in stages)
    return busy + idle_cost * max(0.0, t - busy)


def evaluate_cut(ev: StageEvaluator, bounds: tuple[int, ...], *, fitting: bool = True) -> Cut | None:
    """The Cut for given stage bounds, or None when a stage does not fit (fitting=False: the Cut all the same, to
    compare times with a cut whose option made it fit: a ZeRO-3 unit's bf16 reduction holds less)."""
    stages = tuple(ev.stage(bounds[k], bounds[k + 1], k) for k in range(len(bounds) - 1))
    if fitting and not all(s.fits for s in stages):
        return None
    stages = ev.settle(bounds, stages)
    c = ev.cand
    return Cut(bounds=bounds, stages=stages, step_time_s=step_time(stages, c.num_microbatches, c.interleave,
                                                                    idle_cost=ev.ctx.cal.pipeline_idle_cost,
                                                                    sum_weight=ev.sum_weight))


def _balanced(ev: StageEvaluator, n: int, S: int) -> Cut | None:
    """Equal-time cut by cumulative compute: a quick incumbent for pruning."""
    total = ev.total_c
    bounds = [0]
    acc = ev.c_floor
    for k in range(1, S):
        target = total * k / S
        u = min(range(bounds[-1] + 1, n - (S - k) + 1), key=lambda x: abs(acc[x] - target))
        bounds.append(u)
    bounds.append(n)
    return evaluate_cut(ev, tuple(bounds))


def cut_stages(ev: StageEvaluator, *, incumbent: float = math.inf,
               accept: Callable[[Cut], bool] | None = None) -> Cut | None:
    """The best cut of all units into ev.num_stages stages, or None if none fits / beats `incumbent`.

    `accept`: a test whole cuts must also pass (the per-rank memory of interleaved stages, which no single
    stage decides); the best of the cuts on the final front that pass it. With it the result is the best
    accepted cut of that front, which may miss an accepted cut the front dropped for a faster rejected one.
    """
    n, S = len(ev.ctx.units), ev.num_stages
    if S > n:
        return None
    m, v = ev.cand.num_microbatches, ev.cand.interleave
    best = _balanced(ev, n, S)
    if best is not None and accept is not None and not accept(best):
        best = None
    bound = min(incumbent, best.step_time_s if best else math.inf)
    if ev.ctx.cal.pipeline_idle_cost < 1.0:
        # the front's bound below assumes every idle second costs one; with less charged, a cut
        # past it may still win, so no pruning (the front ranks by the full charge: near-optimal)
        bound = math.inf
    slope = m * v - 1
    c_min_total = ev.total_c  # sum of c without p2p; any cut has sum c >= this
    c_limit = (bound - c_min_total * ev.sum_weight) / slope * (1 + 1e-12) if slope > 0 and math.isfinite(bound) else math.inf
    # a stage whose tail alone (exposed data-parallel traffic, optimizer step) makes T worse than a known cut, with
    # every other term at its least (ev.min_max_c: the slowest stage's c over all cuts), is never formed
    tail_limit = bound - slope * ev.min_max_c() - c_min_total * ev.sum_weight + 1e-12 * bound \
        if math.isfinite(bound) else math.inf
    pre = ev.c_floor  # without p2p: a lower bound on c
    # front[j]: points (max_c, max_tail, sum_c, bounds) reaching unit j with k stages
    front: dict[int, list[tuple[float, float, float, tuple[int, ...]]]] = {0: [(0.0, 0.0, 0.0, (0,))]}
    for k in range(S):
        nxt: dict[int, list] = {}
        last = k == S - 1
        rest = S - k - 1  # stages after this one
        # Units from j on must fit in `rest` stages of c <= c_limit each.
        j_min = bisect.bisect_left(pre, pre[n] - rest * c_limit) if math.isfinite(c_limit) else 0
        for i, points in front.items():
            j_lo, j_hi = (n, n) if last else (max(i + 1, j_min), n - rest)
            best_c = min(p[0] for p in points)
            if best_c > c_limit:
                continue
            for j in range(j_lo, j_hi + 1):
                st = ev.stage(i, j, k)
                if not st.fits or st.c > c_limit:
                    break  # longer stages only need more memory and time
                if st.tail_s > tail_limit:
                    continue  # (a longer stage may hide more of its traffic)
                for mc, mt, sc, bnds in points:
                    p = (max(mc, st.c), max(mt, st.tail_s), sc + st.c, bnds + (j,))
                    _insert(nxt.setdefault(j, []), p)
        front = nxt
        if not front:
            return best if best and best.step_time_s <= incumbent else None
    result = best
    for mc, mt, sc, bnds in front.get(n, []):
        t = slope * mc + sc * ev.sum_weight + mt
        if result is None or t < result.step_time_s - 1e-15 * t or (abs(t - result.step_time_s) <= 1e-15 * t and bnds < result.bounds):
            cut = evaluate_cut(ev, bnds)
            if cut is not None and (accept is None or accept(cut)):
                result = cut
    if result is None or result.step_time_s > incumbent:
        return None
    return result


def _insert(points: list, p: tuple) -> None:
    """Add p to a Pareto front of (max_c, max_tail, sum_c), dropping dominated points."""
    for q in points:
        if q[0] <= p[0] and q[1] <= p[1] and q[2] <= p[2]:
            return
    points[:] = [q for q in points if not (p[0] <= q[0] and p[1] <= q[1] and p[2] <= q[2])]
    points.append(p)
