"""The search: every configuration the declarations allow, best first, exactly.

Enumerates (tp, cp, pp, dp, microbatch, schedule, interleave, sequence
parallelism, ZeRO stage, recompute, and ep for a model with MoE layers),
orders them by a lower bound on step time, and runs the exact
stage cut (cut.py) on each until the bound exceeds the k-th best step time
found: branch and bound, so the k best are exact under the cost model while
most candidates are never cut. Ties go to the simpler configuration (fewer
pipeline stages, smaller tensor groups, lower ZeRO stage, less recompute,
simpler schedule, larger microbatch), the order a person would try them in.

Gradient compression is not a dimension of the enumeration: it changes only
each stage's tail (stage_costs.py), so every stage takes its best compression and
the cut is found once. That is exact when the stages of the best cut agree,
which is the rule (one stage when pp = 1; the same choice for stages of similar
size): no single compression can beat every stage having its best, and the
agreed choice achieves it. When they disagree, the candidate is cut again
under each compression it allows and the best taken.

The runners-up that lost on memory rather than time (`over_memory`) are timed
by a balanced cut, not searched: they only have to show that a faster
configuration exists and how far it is from fitting.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence

from cost_models.choices import SELECTIVE_RECOMPUTE
from partitioner.planner.cut import Cut, cut_stages, evaluate_cut, step_time
from partitioner.planner.declarations import INTERLEAVED, MAX_MICROBATCHES, SPLIT_BACKWARD, Declarations, divisors
from partitioner.planner.plan import ParallelConfig, per_rank_memory
from partitioner.planner.stage_costs import StageEvaluator
from partitioner.planner.unit_costs import CostContext

__all__ = ["PARTIAL_RECOMPUTE", "Scored", "SearchResult", "enumerate_candidates", "recompute_part", "search",
           "simplicity"]

_RECOMPUTE_ORDER = {"none": 0, "selective": 1, "selective-op": 2, "full": 3}
# Shares of the blocks (ParallelConfig.recompute_blocks) a leader that recomputes every block fully is tried with,
# least recomputation first: Megatron-LM's recompute_num_layers and torchtitan's every-N-th-block AC do the same
PARTIAL_RECOMPUTE = ((1, 4), (1, 3), (1, 2), (2, 3), (3, 4))
_SCHEDULE_ORDER = {"1f1b": 0, "gpipe": 1, "interleaved-1f1b": 2, "zb-h1": 3, "interleaved-zb": 4, "zb-v": 5,
                   "dualpipe-v": 6}
# Virtual stages per rank tried unpinned (and pinned without interleave): interleaved-1f1b 2-4; interleaved-zb 2
# only (each v adds a candidate per configuration); zb-v exactly 2
_INTERLEAVES = {"interleaved-1f1b": (2, 3, 4), "interleaved-zb": (2,), "zb-v": (2,), "dualpipe-v": (2,)}
# Balanced cuts tried when looking for faster configurations that do not fit: each costs one stage
# evaluation per stage, a few ms on 1000 ranks, so a cap keeps the search's time what it was.
_OVER_MEMORY_TRIES = 24
_OVER_MEMORY_TRIES_PER_SHAPE = 4


def simplicity(c: ParallelConfig) -> tuple:
    return (c.pp, c.tp, c.cp, c.cp_kind != "ring", c.ep, c.zero_stage, c.zero3_unit != "block",
            _RECOMPUTE_ORDER[c.recompute], c.recompute_blocks[0] / c.recompute_blocks[1],
            _SCHEDULE_ORDER[c.schedule], c.interleave, c.sp, -c.microbatch_size)


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
    # faster than ranked[0] by a balanced cut but over memory, at most one per mesh shape (tp, cp, pp)
    over_memory: tuple[Scored, ...] = ()


def module_units_run(tp: int, cp: int) -> bool:
    """Whether programs of that shape run ZeRO-3 with per-module units (zero3_unit="module"): where the module
    runs its own forward (its modules' hooks gather) and under generated stage code, pipelines included
    (runtime.engines.zero3's deferred placeholders), but not yet with tensor or context parallelism."""
    return tp == 1 and cp == 1


def enumerate_candidates(d: Declarations, *, world_size: int, devices_per_node: int, num_units: int,
                         valid_tp: tuple[int, ...], sp_allows: Callable[[int, int], bool] = lambda tp, mb: False,
                         sp_dominates: Callable[[int, int, str], bool] = lambda tp, mb, rc: False,
                         context: Callable[[int], Sequence[tuple[int, str]]] = lambda tp: ((1, "ring"),),
                         experts: Callable[[int, int, int], Sequence[int]] = lambda dp, tp, cp: (1,),
                         module_units: Callable[[int, int, int], bool] = lambda pp, tp, cp: False
                         ) -> Iterator[ParallelConfig]:
    """Every configuration the declarations allow (not yet checked for memory).

    `sp_allows(tp, microbatch)`: whether the model can run sequence parallelism there. Unpinned, both are
    candidates where it can: it divides the activations between the tensor-split regions by tp, but issues
    more collectives, whose latency outweighs the saving on small layers. Where `sp_dominates(tp, microbatch,
    recompute)` (no slower per unit, and never more memory), only sp is: the twin without it cannot win.

    `context(tp)`: the (cp, cp_kind) a candidate of tensor degree tp may take
    (partitioner.planner.context_split.cp_options); dp * cp * tp * pp is the world size.
    `experts(dp, tp, cp)`: the expert-parallel degrees a candidate may take (partitioner.planner.expert_split
    .ep_options; (1,) for a dense model, so its space is what it was).
    `module_units(pp, tp, cp)`: whether a ZeRO-3 candidate of that shape may gather per module (its program
    runs the module's own forward); where it may, ZeRO-3 candidates come with zero3_unit "block" and
    "module" unless one is pinned.
    """
    gb = d.global_batch_size
    tps = [d.tp] if d.tp is not None else [t for t in valid_tp if world_size % t == 0 and t <= devices_per_node]
    if d.sp:
        tps = [t for t in tps if t > 1]
    for tp, (cp, cp_kind) in ((t, c) for t in tps for c in context(t)):
        if world_size % (tp * cp):
            continue
        for pp in ([d.pp] if d.pp is not None else divisors(world_size // (tp * cp))):
            if pp > num_units or (world_size // (tp * cp)) % pp:
                continue
            dp = world_size // (tp * cp * pp)
            if (d.dp is not None and dp != d.dp) or gb % dp:
                continue
            eps = experts(dp, tp, cp)
            if not eps:
                continue
            per_replica = gb // dp
            mbs = [d.microbatch_size] if d.microbatch_size is not None else [
                x for x in divisors(per_replica) if x & (x - 1) == 0 or x == per_replica]
            for mb in mbs:
                if per_replica % mb or per_replica // mb > MAX_MICROBATCHES:  # a schedule too long to list
                    continue
                m = per_replica // mb
                can = tp > 1 and d.sp is not False and sp_allows(tp, mb)
                if d.sp and not can:
                    continue
                for sched, v in _schedules(d, pp, m, num_units):
                    zeros = [d.zero_stage] if d.zero_stage is not None else ([0, 1, 2, 3] if dp * cp > 1 else [0])
                    recomputes = [d.recompute] if d.recompute is not None else \
                        ["none", "selective", "selective-op", "full"]
                    if sched in SPLIT_BACKWARD:  # what a split backward does not run with (declarations.py)
                        # ZeRO-3 runs when pinned with this schedule, each W gathering its units again
                        # (zero3.split_backward); the cost model charges that gather, but measured on Gloo the
                        # pair ran 1.3-1.45x slower than ZeRO-3 with 1F1B where it predicts 0.91x: the search
                        # does not pick it by itself until W's cost is understood
                        zeros = [z for z in zeros if z != 3 or (d.zero_stage == 3 and d.schedule == sched)]
                        recomputes = [rc for rc in recomputes if rc not in SELECTIVE_RECOMPUTE]
                    share = d.recompute_blocks or (1, 1)
                    for z, rc in itertools.product(zeros, recomputes):
                        sps = [True] if d.sp or (can and sp_dominates(tp, mb, rc)) else [False, True] if can else [False]
                        units = ["block"]
                        if z == 3 and module_units(pp, tp, cp):
                            units = [d.zero3_unit] if d.zero3_unit is not None else ["block", "module"]
                        elif d.zero3_unit == "module":
                            continue  # pinned, and this shape's program cannot gather per module
                        for sp, ep, unit in itertools.product(sps, eps, units):
                            if ep > 1 and unit == "module":
                                continue  # expert-parallel programs keep block units (per module: not run yet)
                            yield ParallelConfig(dp=dp, tp=tp, pp=pp, zero_stage=z, microbatch_size=mb,
                                                 num_microbatches=m, schedule=sched, interleave=v, recompute=rc, sp=sp,
                                                 cp=cp, cp_kind=cp_kind, ep=ep, zero3_unit=unit,
                                                 recompute_blocks=share if rc == "full" else (1, 1))


def _schedules(d: Declarations, pp: int, m: int, num_units: int) -> list[tuple[str, int]]:
    if pp == 1:
        # One stage: every schedule is gradient accumulation; name it 1F1B.
        return [("1f1b", 1)] if d.schedule in (None, "1f1b", "gpipe") else []
    if d.schedule is not None:  # pinned: every interleave its lists allow
        if d.schedule not in INTERLEAVED:
            return [(d.schedule, 1)]
        vs = [d.interleave] if d.interleave is not None else _INTERLEAVES[d.schedule]
        # dualpipe-v: pinned only (its pairs overlap nothing in this runtime, so it cannot beat zb-v here), with
        # at least as many microbatches as stages
        allowed = {"interleaved-1f1b": m % pp == 0, "interleaved-zb": m % max(1, m // pp) == 0, "zb-v": True,
                   "dualpipe-v": m >= 2 * pp}
        return [(d.schedule, v) for v in vs if pp * v <= num_units and allowed[d.schedule]]
    out = [(s, 1) for s in ("1f1b", "gpipe", "zb-h1")]
    for v in ([d.interleave] if d.interleave is not None else _INTERLEAVES["interleaved-1f1b"]):
        # Megatron's interleaved schedule needs the microbatches in groups of pp
        if pp * v <= num_units and m % pp == 0:
            out.append(("interleaved-1f1b", v))
    if d.interleave in (None, 2) and 2 * pp <= num_units:
        # The zero-bubble schedules with two stages per rank, where the cut search's closed form is exact
        # (stage_costs.sum_weight): zb-v once m >= 2 pp - 1 fills its V (with fewer it is charged zb-h1's
        # bubble and more memory: it cannot win). There it has interleaved-zb's bubble and holds less (2 pp + 1
        # half-stage microbatches per rank against 3 pp: tests/test_schedule.py), so interleaved-zb is searched
        # only below, at m = pp, its one whole round
        if m >= 2 * pp - 1:
            out.append(("zb-v", 2))
        elif m % pp == 0:
            out.append(("interleaved-zb", 2))
    return out


def search(ctx: CostContext, candidates: list[ParallelConfig], *, keep: int = 5,
           compression: tuple[str, str] | None = None, incumbent: float = math.inf, max_cuts: int | None = None,
           over_memory: int = 0, bounds: tuple[int, ...] | None = None) -> SearchResult:
    """The `keep` best candidates with their exact cuts.

    compression: cost every candidate with this (intra_node, inter_node) compression instead of its
    best allowed one. incumbent: only cuts at most this fast count (a known step time to beat).
    max_cuts: stop after this many exact cuts; the result is then the best found, not the best.
    over_memory: also find up to this many faster configurations that do not fit (`_over_memory`).
    bounds: cost only this cut (unit indices, one stage per pair) instead of searching for the best one;
    candidates with another number of stages are skipped.
    """
    order = []
    for cand in candidates:
        ev = StageEvaluator(ctx, cand, compression)
        order.append((ev.lower_bound(), simplicity(cand), cand, ev))
    order.sort(key=lambda x: (x[0], x[1]))
    ranked: list[tuple[float, tuple, ParallelConfig, Cut]] = []
    evaluated = 0
    # Where a rank holds several virtual stages, a stage within 1/v of the memory is sufficient for its rank
    # but not necessary (its early chunks keep more microbatches in flight than its late ones). Only where
    # no candidate fits that way does a second pass check each chunk alone and the ranks' sums on whole cuts
    # (rank_peak, the rule a plan reports memory by): the looser rule lets more stages fit, and the cut search
    # then explores more cuts (2-5x the stages costed on 175B-1T), for a fit the first pass mostly finds.
    for loose in (False, True):
        if loose and (ranked or bounds is not None or not math.isinf(incumbent)):
            break
        for lb, simple, cand, ev in order:
            kth = ranked[keep - 1][0] if len(ranked) >= keep else incumbent
            if math.isinf(lb):
                continue  # its model state alone does not fit
            if lb > kth or (max_cuts is not None and evaluated >= max_cuts):
                break  # sorted by bound: nothing after this can enter the top `keep`
            if loose and ev.num_stages == cand.pp:
                continue  # one stage per rank: the first pass's rule was already exact
            evaluated += 1
            if bounds is not None:
                cut = evaluate_cut(ev, bounds) if len(bounds) - 1 == ev.num_stages else None
            elif loose:
                cut = _cut_loose(ctx, ev, incumbent=kth)
            else:
                cut = _one_compression(ctx, ev, incumbent=kth)
            if cut is None:
                continue
            ranked.append((cut.step_time_s, simple, cand, cut))
            ranked.sort(key=lambda x: (x[0], x[1]))
            del ranked[keep:]
    if bounds is None:
        # The first pass's rule (each chunk within 1/v of the memory) can force a rank's chunks apart in size where
        # one chunk holds more than the others (the embedding's), so the cut it finds may be far slower than one
        # the looser rule accepts: the leaders with several chunks per rank whose slowest chunk is well above the
        # average are cut again the loose way (a balanced cut has nothing to gain, and is the common case).
        evs = {id(cand): ev for _, _, cand, ev in order}
        for k, (t, simple, cand, cut) in enumerate(ranked):
            ev, cs = evs[id(cand)], [st.c for st in cut.stages]
            if ev.num_stages > cand.pp and max(cs) > 1.02 * max(sum(cs) / len(cs), ev.arrays.max_unit_c):
                better = _cut_loose(ctx, ev, incumbent=t * (1 - 1e-9))
                if better is not None and better.step_time_s < t:
                    ranked[k] = (better.step_time_s, simple, cand, better)
        ranked.sort(key=lambda x: (x[0], x[1]))
    scored = tuple(Scored(cand=c, cut=cut, compression=cut.stages[0].compression) for _, _, c, cut in ranked)
    missed = _over_memory(ctx, order, scored, limit=over_memory) if over_memory and scored else ()
    return SearchResult(ranked=scored, evaluated=evaluated, space=len(candidates), over_memory=missed)


def recompute_part(ctx: CostContext, result: SearchResult, *, bounds: tuple[int, ...] | None = None) -> SearchResult:
    """`result` with each ranked candidate that recomputes every block fully tried with part of its blocks
    recomputed (PARTIAL_RECOMPUTE, least first): the first share that fits and is faster takes its place.

    Full recomputation wins where keeping every activation does not fit; keeping some often does, and each
    block that keeps its activations saves a forward in the backward. The enumeration leaves the shares out
    (five more candidates for each that recomputes: the planning time of the largest models), so they are
    tried here, on the configurations that already won with every block recomputed, where the leader recomputes
    something (one that keeps every activation needs no recomputation; a selective leader may lose to part of
    the blocks recomputed fully)."""
    ranked, evaluated, space = list(result.ranked), result.evaluated, result.space
    if not ranked or ranked[0].cand.recompute == "none":
        return result  # the leader keeps every activation: they fit where it matters
    for i, s in enumerate(result.ranked):
        c = s.cand
        if c.recompute != "full" or c.recompute_blocks != (1, 1):
            continue
        for share in PARTIAL_RECOMPUTE:
            ev = StageEvaluator(ctx, dataclasses.replace(c, recompute_blocks=share))
            space += 1
            if ev.lower_bound() >= s.cut.step_time_s:
                break  # more recomputation only raises the bound
            evaluated += 1
            if bounds is not None:
                cut = evaluate_cut(ev, bounds)
            else:
                cut = _one_compression(ctx, ev, incumbent=s.cut.step_time_s)
                if cut is None and ev.num_stages > c.pp:
                    cut = _cut_loose(ctx, ev, incumbent=s.cut.step_time_s)
            if cut is not None and cut.step_time_s < s.cut.step_time_s:
                ranked[i] = Scored(cand=ev.cand, cut=cut, compression=cut.stages[0].compression)
                break
    ranked.sort(key=lambda x: (x.cut.step_time_s, simplicity(x.cand)))
    beat = ranked[0].cut.step_time_s  # the faster configurations that do not fit: only those still faster
    missed = tuple(s for s in result.over_memory if s.cut.step_time_s < beat)
    return dataclasses.replace(result, ranked=tuple(ranked), evaluated=evaluated, space=space, over_memory=missed)


def _over_memory(ctx: CostContext, order: list, ranked: tuple[Scored, ...], *, limit: int) -> tuple[Scored, ...]:
    """Up to `limit` configurations whose balanced cut beats ranked[0] but needs more memory per rank than
    the cap: the fastest found of each mesh shape (tp, cp, pp), the winner's own shape first (it answers "why
    not less recompute, a lower ZeRO stage"), then others by their compute bound.

    The compute bound ignores memory (lower_bound() is infinite once model state does not fit), so it
    orders the candidates a bigger device would have tried first; at most _OVER_MEMORY_TRIES balanced
    cuts are evaluated, _OVER_MEMORY_TRIES_PER_SHAPE per shape.
    """
    best = ranked[0]
    beat, home = best.cut.step_time_s, (best.cand.tp, best.cand.cp, best.cand.pp)
    seen = {s.cand for s in ranked}
    pending = sorted(((_compute_bound(ev), simple, cand, ev) for _, simple, cand, ev in order if cand not in seen),
                     key=lambda x: ((x[2].tp, x[2].cp, x[2].pp) != home, x[0], x[1]))
    tries: dict[tuple[int, int, int], int] = {}
    found: dict[tuple[int, int, int], Scored] = {}
    for bound, _, cand, ev in pending:
        if bound >= beat:
            continue  # cannot be faster; later ones of another shape still may be
        shape = (cand.tp, cand.cp, cand.pp)
        if shape in found or tries.get(shape, 0) >= _OVER_MEMORY_TRIES_PER_SHAPE:
            continue
        if sum(tries.values()) >= _OVER_MEMORY_TRIES or len(found) >= limit:
            break
        tries[shape] = tries.get(shape, 0) + 1
        cut = _balanced_cut(ev)
        if cut is not None and cut.step_time_s < beat and rank_peak(cut, cand.pp, cand.schedule) > ctx.cap(cand):
            found[shape] = Scored(cand=cand, cut=cut, compression=cut.stages[0].compression)
    return tuple(found.values())


def _compute_bound(ev) -> float:
    """lower_bound() without its memory test and optimizer tail: perfectly balanced compute, no p2p, the
    calibrated share of idle time charged."""
    c, S = ev.cand, ev.num_stages
    m, v = c.num_microbatches, c.interleave
    full = (m * v - 1) * max(ev.total_c / S, ev.arrays.max_unit_c) + ev.total_c / v
    if c.pp == 1:
        return full
    busy = m * ev.total_c / c.pp
    return busy + ev.ctx.cal.pipeline_idle_cost * (full - busy)


def _balanced_cut(ev) -> Cut | None:
    """Equal numbers of units per stage, memory not checked (each stage says whether it fits)."""
    n, S = len(ev.ctx.units), ev.num_stages
    if S > n:
        return None
    bounds = tuple(round(k * n / S) for k in range(S + 1))
    stages = ev.settle(bounds, tuple(ev.stage(bounds[k], bounds[k + 1], k) for k in range(S)))
    return Cut(bounds=bounds, stages=stages, step_time_s=step_time(stages, ev.cand.num_microbatches, ev.cand.interleave,
                                                                    idle_cost=ev.ctx.cal.pipeline_idle_cost,
                                                                    sum_weight=ev.sum_weight))


def rank_peak(cut: Cut, pp: int, schedule: str = "1f1b") -> float:
    """The largest per-rank memory of a cut (per_rank_memory: a rank's virtual stages summed, buffers once)."""
    return max(m.total for m in per_rank_memory([st.memory for st in cut.stages], pp, schedule).values())


def _cut_loose(ctx: CostContext, ev, *, incumbent: float) -> Cut | None:
    """The best cut with each virtual stage's memory checked alone and each rank's sum on whole cuts."""
    pp, cap, schedule = ev.cand.pp, ctx.cap(ev.cand), ev.cand.schedule
    loose = StageEvaluator(ctx, ev.cand, ev.options[0] if len(ev.options) == 1 else None, chunk_alone=True)
    return _one_compression(ctx, loose, incumbent=incumbent, accept=lambda c: rank_peak(c, pp, schedule) <= cap)


def _one_compression(ctx: CostContext, ev, *, incumbent: float, accept=None) -> Cut | None:
    """The best cut whose stages all use one compression (see the module docstring)."""
    cut = cut_stages(ev, incumbent=incumbent, accept=accept)
    if cut is None or len({st.compression for st in cut.stages}) == 1:
        return cut
    best = None
    for option in ev.options:
        other = cut_stages(StageEvaluator(ctx, ev.cand, option, chunk_alone=ev.chunk_alone), incumbent=incumbent,
                           accept=accept)
        if other is not None and (best is None or other.step_time_s < best.step_time_s):
            best = other
    return best


def least_memory(ctx: CostContext, candidates: list[ParallelConfig],
                 compression: tuple[str, str] | None = None) -> tuple[float, ParallelConfig | None]:
    """The smallest peak memory per rank of any candidate's balanced cut (for the infeasible error), with the
    allocator's slack for its recompute mode where that counts (CostContext.slack): the candidate nearest to
    fitting."""
    best, who = math.inf, None
    for cand in candidates:
        cut = _balanced_cut(StageEvaluator(ctx, cand, compression))
        if cut is None:
            continue
        peak = rank_peak(cut, cand.pp, cand.schedule)
        if who is None or peak * ctx.slack(cand) < best * ctx.slack(who):
            best, who = peak, cand
    return best, who


__all__ += ["evaluate_cut", "least_memory", "rank_peak"]
