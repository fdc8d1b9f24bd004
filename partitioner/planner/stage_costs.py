"""What a stage costs: a run of units at one pipeline position, its time and its peak memory.

The units' costs come from `partitioner.planner.unit_costs`; a stage (a run of units at pipeline position
k) gets

    c_k    = f_k + b_k                 compute + TP collectives + p2p receive, per microbatch (the last stage's
                                       with the caller's loss on the model's output: compute.loss_times)
    tail_k = exposed DP sync (+ its compression kernels) + optimizer step, once per training step
    mem_k  = model state at rest (ZeRO) + the most of the moments of a backward (the loss's,
             a block's, the end's, a compressed reduction's): activations x in-flight microbatches,
             gradients formed, reductions in flight, ZeRO-3's gathered parameters, a compressor's
             error feedback and working set, the process's fixed memory (StageEvaluator._peak_memory)

A stage takes the compression with the least exposed time among those whose
buffers fit in memory.

and the step time of a cut (Narayanan et al. 2021, eq. 1 generalised to
unequal stages; v = virtual stages per rank) is

    T = (m*v - 1) * max_k c_k + sum_k c_k / v + max_k tail_k

which the schedule simulator reproduces for uniform stages (tests check it).

Async SGD (pinned only; pure data parallel, ZeRO 0, fp32) replaces the
gradient all-reduce in tail_k by averaging parameters (runtime/engines/async_sgd.py):
with every=k an fp32 all-reduce of the parameters after every k-th optimizer
step, blocking, so 1/k of it per step; with staleness=s >= 1 one per step,
asynchronous, hidden behind the next step's compute up to dp_overlap of it
(with s = 0 it is waited for at once: every=1). Its flat buffers replace
DDP's gradient buckets in the memory.

Gradient compression (cost_models/compression.py) changes only tail_k: the
DDP/ZeRO-1 gradient all-reduce, ZeRO-2/3's reduce-scatter and (ZeRO-3 with
int8/int4) its parameter all-gathers. Wire time hides behind compute like an
uncompressed collective's (dp_overlap), kernel time never does. PowerSGD's
bytes depend on the gradients' shapes: each stage's (cost_models/powersgd.py),
local to a tensor rank.

Units of everything: seconds and bytes.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

from cost_models.compression import (
    LEVELS,
    REDUCE_BYTES_OF_PRECISION,
    all_reduce_time,
    gather_time,
    group_compressor,
    group_shape,
    reduce_scatter_time,
)
from cost_models.compression_memory import ReductionMemory, reduction_memory, sixteen_bit_units
from cost_models.compute import elementwise_bytes_per_s, loss_times
from cost_models.memory import (
    DDP_BUCKET_BYTES,
    ModelStateBytes,
    chunk_inflight,
    chunk_live,
    inflight_microbatches,
    model_state_bytes,
    process_fixed_bytes,
)
from cost_models.mesh import Mesh
from cost_models.optimizer import gradient_buffer_bytes, optimizer_bytes_per_s, optimizer_step_bytes
from cost_models.powersgd import LowRank
from partitioner.planner.context_split import local
from partitioner.planner.declarations import SPLIT_BACKWARD
from partitioner.planner.expert_split import edp_ranks
from partitioner.planner.plan import ParallelConfig
from partitioner.planner.schedule import chunk_peaks, stage_rank
from partitioner.planner.unit_costs import CostContext, UnitArrays

__all__ = ["StageCost", "StageEvaluator", "StageMemory"]

_FP32_GRADIENTS = ("bf16-mixed", "fp16-mixed", "fp8-mixed")  # 16-bit compute whose gradients the engine accumulates in fp32
_NO_STATE = ModelStateBytes(params=0.0, grads=0.0, optimizer=0.0)
_NO_BUFFERS = ReductionMemory()  # an uncompressed reduction's: the engine's own buffers are in the moments


class StageMemory(NamedTuple):
    """Bytes one rank holds at its peak for one (virtual) stage: a tuple, cheap in the search's inner loop."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCost:
    forward_s: float
    backward_s: float
    tail_s: float
    exposed_comm_s: float
    params: float
    memory: StageMemory
    fits: bool
    compression: tuple[str, str] = ("none", "none")  # (intra_node, inter_node) compressor of its gradient reduction

    @property
    def c(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def memory_total(self) -> float:
        return sum(self.memory)


# The zero-bubble schedules with several stages per rank: their counts per chunk are read off the lists
_SPLIT_CHUNKED = frozenset({"interleaved-zb", "zb-v", "dualpipe-v"})


def sum_weight(schedule: str, pp: int, v: int, m: int, weight_share: float) -> float:
    """The coefficient of sum_k c_k in the step time T = (m v - 1) max_k c_k + sum_weight * sum_k c_k + tail.

    1 / v for GPipe, 1F1B and interleaved 1F1B (the fill and drain pass every stage once, in chunks of
    1 / v). ZB-H1 (Qi et al. 2023, section 3.1) shortens 1F1B's bubble from (pp - 1)(F + B) to
    (pp - 1)(F + B - 2 W) (their F + I - W, with I = B - W) when m >= pp: the drain's W's fill it. With
    fewer microbatches fewer W's are left to fill it: the simulated saving over 1F1B on uniform stages is
    W (pp - 2 + min(m, pp)) (pp - 1 W's at m = 1: only the last stage's first W overlaps). With W a share
    rho of each stage's c = F + B (`weight_share`, from the graph's weight-gradient FLOPs), that is a
    coefficient 1 - rho (pp - 2 + min(m, pp)) / pp. The simulator times the exact lists; this closed form
    lets the cut search stay exact and fast.

    interleaved-zb (torch's ScheduleInterleavedZeroBubble) divides ZB-H1's coefficient by v, as interleaving
    divides 1F1B's: (pp - 1)(F + B - 2 W) / v. zb-v (Qi et al. 2023, section 6) has ZB-H1's bubble in half
    stages, (pp - 1)(F + B - 2 W) / 2, once m >= 2 pp - 1 microbatches fill its V; with fewer it is charged
    ZB-H1's (the V's saving not assumed). Both are exact on uniform stages with W = F = B / 2 (the paper's
    matmul case, weight_share 1 / 3) and m at least those counts (tests/test_simulate.py); elsewhere they
    estimate, and the plan's predicted step is the simulator's on the exact lists.

    >>> sum_weight("1f1b", 4, 1, 8, 0.3)
    1.0
    >>> round(sum_weight("zb-h1", 4, 1, 8, 1 / 3), 4), sum_weight("zb-h1", 4, 1, 1, 1 / 3)  # bubble a third; m=1
    (0.5, 0.75)
    >>> sum_weight("interleaved-zb", 4, 2, 8, 1 / 3), sum_weight("zb-v", 4, 2, 8, 1 / 3)
    (0.25, 0.25)
    """
    zb_h1 = max(1 / pp, 1 - weight_share * (pp - 2 + min(m, pp)) / pp)
    if schedule == "zb-h1":
        return zb_h1
    if schedule == "interleaved-zb":
        return zb_h1 / v
    if schedule in ("zb-v", "dualpipe-v"):  # dualpipe-v (m >= 2 pp) charged zb-v's: the simulator times its list
        return zb_h1 / 2 if m >= 2 * pp - 1 else zb_h1
    return 1 / v


@functools.lru_cache(maxsize=1024)  # keyed by the mesh shape: thousands of candidates share a few shapes
def _dp_groups(pp: int, dp: int, tp: int, cp: int = 1) -> tuple[tuple[int, ...], ...]:
    """Per pipeline rank (an index), the global ranks of its first data-parallel group: dp x cp ranks, over
    which gradients are reduced and ZeRO shards (Megatron's data-parallel group under context parallelism)."""
    mesh = Mesh(pp, dp, tp, cp)
    return tuple(mesh.replica_ranks(pp=r) for r in range(pp))


def _stage_counts(cand: ParallelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per virtual stage k: (microbatches whose activations it holds at its peak, microbatches between their I
    and W: zero-bubble schedules with several stages per rank only, 0 elsewhere)."""
    return _schedule_counts(cand.schedule, cand.pp, cand.num_microbatches, cand.interleave)


@functools.lru_cache(maxsize=4096)  # a function of the schedule alone, which thousands of candidates share
def _schedule_counts(schedule: str, pp: int, m: int, v: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    inflight, waiting = [], []
    for k in range(pp * v):
        rank = stage_rank(schedule, pp, k)
        held = 0
        if schedule in _SPLIT_CHUNKED:  # per chunk, off the rank's order; held until W
            live, between = chunk_peaks(schedule, pp=pp, num_microbatches=m, interleave=v, rank=rank)
            count, held = live[k // pp], between[k // pp]
        elif v > 1:  # this chunk's own count: the rank's first chunks hold more than its last
            count = chunk_inflight(pp=pp, stage=rank, num_microbatches=m, interleave=v)[k // pp]
        else:  # zb-h1: what I keeps for W besides (the gradients at the weights' matmuls) is charged in _peak_memory
            count = inflight_microbatches(schedule, pp=pp, stage=rank, num_microbatches=m,
                                          interleave=v) if pp > 1 else 1
        inflight.append(count)
        waiting.append(held)
    return tuple(inflight), tuple(waiting)


def _engine_floor(arr: UnitArrays, accum_s: float) -> list[float]:
    """Prefix sums of a floor on the units' share of the engine's gradient buffers per microbatch (`accum_s` a
    parameter): their parameters less every one read by several units (a stage holds those once, or not at all
    where another stage ties them), so the cut search's bounds stay bounds."""
    floor = [0.0] * len(arr.par)
    for users in arr.shared:
        for u, size in users:
            floor[u + 1] += size
    less = 0.0
    out = []
    for u, par in enumerate(arr.par):
        less += floor[u]
        if arr.fpar:  # frozen parameters have no gradient buffer
            par -= arr.fpar[u]
        out.append(max(0.0, par - less) * accum_s)
    return out


def _packs(pre: list[float], stages: int, x: float) -> bool:
    """Whether units with prefix sums `pre` pack into at most `stages` contiguous stages of at most x each
    (greedy: each stage takes as many units as fit)."""
    n, i = len(pre) - 1, 0
    for _ in range(stages):
        i = bisect.bisect_right(pre, pre[i] + x, i) - 1
        if i >= n:
            return True
    return False


class StageEvaluator:
    """Stage costs for one candidate in O(1) per stage, from prefix sums over units."""

    def __init__(self, ctx: CostContext, cand: ParallelConfig, compression: tuple[str, str] | None = None, *,
                 chunk_alone: bool = False):
        self.ctx, self.cand = ctx, cand
        # how a virtual stage's memory is checked when a rank holds several (interleaved): False, each within
        # 1/v of the cap (sufficient for its rank); True, each alone within the cap (necessary only: the cut
        # search then checks its ranks' sums, `search.rank_peak`)
        self.chunk_alone = chunk_alone
        self.options = (compression,) if compression is not None else ctx.compression_options(cand)
        assert self.options, f"{cand} cannot honour the pinned compression {ctx.compression_pins}: filter it out"
        self._compressor = {o: group_compressor(o) for o in self.options}
        self.num_stages = cand.pp * cand.interleave
        arr = ctx.unit_arrays(cand.tp, cand.microbatch_size, cand.recompute, cand.sp, cand.cp, cand.cp_kind, cand.ep,
                              cand.recompute_blocks)
        self.arrays = arr
        self.unit_costs = arr.costs
        self._f, self._b, self._act, self._par, self._work = arr.f, arr.b, arr.act, arr.par, arr.work
        self._shared = arr.shared
        # per unit boundary; pipeline neighbours dp*cp*tp ranks apart, each rank sending its own tokens
        self.p2p = ctx.p2p_times(cand.pp, cand.dp * cand.cp * cand.tp, cand.microbatch_size,
                                 cand.tp if cand.sp else 1, cand.cp)
        self._param_bytes = 4 if ctx.precision == "fp32" else 2  # parameters gathered in the compute dtype
        self._grad_bytes = REDUCE_BYTES_OF_PRECISION[ctx.precision]  # the engine's gradient buffers, reduced as such
        # seconds of the optimizer step per parameter this rank steps (cost_models.optimizer)
        self._optim_s = optimizer_step_bytes(ctx.optimizer, ctx.precision) / optimizer_bytes_per_s(
            ctx.optimizer, ctx.topo.device, ctx.cal)
        # seconds per parameter the engine's gradient buffers take per microbatch (in the backward's hooks) and per
        # step (cost_models.optimizer.gradient_buffer_bytes), at the elementwise rate; none where no engine runs
        # (async SGD's own; runtime.engines.unreplicated: pipeline / tensor-parallel programs at dp = 1 in fp32)
        engine = not ctx.async_sgd and not (cand.replicas == 1 and ctx.precision == "fp32" and
                                            (cand.pp > 1 or cand.tp > 1))
        per_mb, per_step = gradient_buffer_bytes(ctx.precision, cand.zero_stage) if engine else (0, 0)
        rate = elementwise_bytes_per_s(ctx.topo.device, ctx.cal)
        self._accum_s, self._settle_s = per_mb / rate, per_step / rate
        # a floor on the units' share of that per microbatch, as prefix sums (`_engine_floor`), shared by the
        # candidates with the same unit arrays and rate
        key = (id(arr), self._accum_s)
        floor = ctx._engine_floors.get(key)
        self.engine_floor = floor if floor is not None else ctx._engine_floors.setdefault(key, _engine_floor(
            arr, self._accum_s))
        dev = ctx.topo.device  # the context and the collective buffers of each group this rank talks in
        self._fixed = process_fixed_bytes(process_bytes=dev.process_bytes, comm_buffer_bytes=dev.comm_buffer_bytes,
                                          communicators=sum(d > 1 for d in (cand.replicas, cand.tp, cand.pp, cand.cp)))
        self.total_c = arr.total_c
        self.sum_weight = sum_weight(cand.schedule, cand.pp, cand.interleave, cand.num_microbatches,
                                     arr.total_w / arr.total_c if arr.total_c > 0 else 0.0)
        self._rest, self._shared_in_block = arr.rest, arr.shared_in_block
        # per virtual stage: microbatches whose activations it holds at its peak, and (zero-bubble schedules with
        # several stages per rank) those between their I and W; a function of the stage alone, so worked out once
        self._inflight, self._waiting = _stage_counts(cand)
        self._stage_memo: dict[tuple, StageCost] = {}
        # gradients reduced, and ZeRO sharded, over dp x cp ranks (Megatron's data-parallel group with cp)
        self._dp_groups = _dp_groups(cand.pp, cand.dp, cand.tp, cand.cp)
        self._reduce_memo: dict[tuple, tuple[float, float]] = {}
        # the data-parallel group's collective times, shared by the candidates of one mesh shape, reduction kind and
        # set of compression options (their sizes repeat from candidate to candidate)
        self._comm_memo = ctx._comm_memos.setdefault(
            (cand.pp, cand.dp, cand.tp, cand.cp, cand.zero_stage <= 1, self.options), {})
        # expert parallelism: expert gradients reduced, and ZeRO-sharded, over the dp x cp / ep ranks holding the
        # same experts (partitioner.planner.expert_split); None at ep = 1
        self._epar = arr.epar or None
        self._fpar = arr.fpar or None
        self._edp = edp_ranks(cand) if cand.ep > 1 else ()
        self._low_rank = ctx.low_rank_sums(cand.tp) if any("powersgd" in o for o in self.options) else None
        crossed = ctx.crossed_levels(cand)
        nodes = group_shape(ctx.comm, self.dp_ranks(0))[0] if crossed == LEVELS else 1  # cached per group
        self._nodes = nodes  # (for `_reduction_mem`)
        # The loss is not in the traced graph, but the last stage runs it on the model's output. Per
        # microbatch in flight it keeps one output-sized tensor (the pipeline executor the output
        # until that microbatch's backward, the step runner a cross-entropy's log-softmax); the
        # backward of a cross-entropy then holds two more output-sized tensors at once (the
        # gradients of the log-softmax and of the logits). Measured on the example GPT with
        # runtime.launch.memory_probe. Under context parallelism each rank's loss sees its own tokens' outputs.
        # Logits split over the vocab (tp > 1, an output LM head) reach the loss split: a cross entropy then runs
        # vocab-parallel (runtime.pipeline.vocab_logits) on this rank's 1/tp, in fp32 (its softmax kept for the
        # backward, as Megatron's), so the same three tensors at 4 B an element.
        last = ctx.g.nodes[-1] if ctx.g.nodes else None
        out = local(last.cost.bytes_written, cand.microbatch_size, ctx.seq, cand.cp) * ctx.scale if last else 0.0
        elements = out / self._param_bytes  # (the output is at the compute dtype)
        if last is not None and cand.tp > 1 and last.name in ctx.splits.sharded_nodes:
            out *= (4 / self._param_bytes) / cand.tp
            elements /= cand.tp
        self._loss_kept, self._loss_work = out, 2 * out
        # and its time, per microbatch on the last stage: the same cross entropy, in fp32 (cost_models.compute)
        self._loss_f, self._loss_b = loss_times(elements, ctx.topo.device, ctx.cal)

    def lower_bound(self) -> float:
        """No cut beats this (math.inf: no cut fits in memory).

        Compute: perfectly balanced stages, no p2p. Tail: the stage holding the
        most parameters holds at least the average, and its optimizer step
        (and, for ZeRO-1/2, its parameter all-gather, which nothing hides) is
        increasing and affine in them. Memory: that stage's model state alone.
        """
        c, ctx = self.cand, self.ctx
        S, m, v = self.num_stages, c.num_microbatches, c.interleave
        avg = self._unique_params / S  # (a parameter several units read is held once where they share a stage)
        state = model_state_bytes(avg, precision=ctx.precision, optimizer=ctx.optimizer,
                                  zero_stage=c.zero_stage, dp=c.replicas).total
        if self._fpar:  # frozen parameters: the fullest stage may hold only those, with no state but themselves
            state = avg * self._param_bytes
        if state * v + self._fixed > ctx.cap(c) or not self._activations_may_fit():
            return math.inf
        tail = avg / (c.replicas if c.zero_stage >= 1 else 1) * self._optim_s + avg * self._settle_s
        if self._fpar:
            tail = 0.0  # (nor need it step anything)
        if c.zero_stage in (1, 2) and c.replicas > 1 and c.ep == 1:
            # (under ep the expert parameters gather over a smaller group: left out, so this stays a bound)
            tail += ctx.comm.all_gather(avg * self._param_bytes, self.dp_ranks(0))
        total_c = self.total_c + self.engine_floor[-1]  # the engine's gradient buffers, every microbatch
        full = (m * v - 1) * self.min_max_c() + total_c * self.sum_weight + tail
        # with part of the idle time charged, the least the busiest rank works (the average) bounds it
        busy = m * total_c / c.pp + tail
        return busy + ctx.cal.pipeline_idle_cost * (full - busy) if c.pp > 1 else full

    @functools.cached_property
    def c_floor(self) -> list[float]:
        """Prefix sums over units of a floor on a stage's c: compute and the engine's floor, p2p left out."""
        return [self._f[u] + self._b[u] + self.engine_floor[u] for u in range(len(self._f))]

    def min_max_c(self) -> float:
        """A lower bound on the slowest stage's c over every cut into num_stages contiguous stages, memory aside:
        the bottleneck of the best partition of the units' compute (with the engine's floor; p2p left out), at
        least total / stages and the largest unit, more where whole units cannot share the total evenly (96
        blocks and an LM head on 16 stages: 7 blocks on some stage, not 6.02). Bisection on greedy packings: a
        packing into num_stages stages of at most x each exists exactly when x >= the bottleneck, and the bound
        returned is an x for which none does (or the trivial bound, if larger). Memoised per context on the unit
        arrays, the engine's rate and the number of stages, which many candidates share."""
        arr, S = self.arrays, self.num_stages
        key = (id(arr), self._accum_s, S)
        memo = self.ctx._bottlenecks
        hit = memo.get(key)
        if hit is None:
            pre = self.c_floor
            n = len(pre) - 1
            lo = max(pre[n] / S, max((pre[u + 1] - pre[u] for u in range(n)), default=0.0))
            if S > 1 and n > S and not _packs(pre, S, lo):
                fail, fit = lo, pre[n]
                while fit - fail > 1e-7 * fit:
                    x = (fail + fit) / 2
                    if _packs(pre, S, x):
                        fit = x
                    else:
                        fail = x
                lo = fail * (1 - 1e-9)  # (the stages' c are sums in another order: rounding stays below)
            hit = memo[key] = lo
        return hit

    @functools.cached_property
    def _unique_params(self) -> float:
        """The parameters one rank's stages hold together, each counted once (every stage holds at least its
        share of these: one read by units of two stages is held by both)."""
        return max(0.0, self._par[-1] - sum(size for users in self._shared for _, size in users[1:]))

    def _activations_may_fit(self) -> bool:
        """A necessary condition for some cut to fit in memory, O(stages).

        Virtual stage k holds, at the block moment of `_peak_memory`, its units' activations a_k for inflight_k
        microbatches beside its model state s_k (with the gradients the engine holds then) and the process's
        fixed bytes; the peak a fitting stage reaches is at least that, so a_k <= (R - s_k) / inflight_k and
        s_k <= R, with R the cap less the fixed bytes. So the units' activations summed are at most the most
        that sum_k (R - s_k) / inflight_k can be with the s_k summing to the state of all parameters: that state
        placed on the stages that hold the most microbatches first, up to R on each. The last stage's loss
        moment holds the loss's tensors besides, so its room is less by them.

        Where a rank holds v chunks, `stage` checks each chunk's model state and activations within 1/v of the
        room, at its peak moment. That moment's state and activations are at least the block moment's less
        what it holds in buffers beyond the block moment's: nothing, or an option's compressed reduction's working
        set over one bucket (its own moment), which is added to each chunk's room. Under chunk_alone, and at
        ZeRO-3 with a compressor (its unit has no cap), the room is whole, and only then is the loss's counted.
        `_peak_memory` picks the moment on unscaled bytes; with a calibration that scales memory terms apart
        the comparison of moments above does not hold, and the test passes every candidate."""
        ctx, c = self.ctx, self.cand
        cal = ctx.cal
        if any(x != 1.0 for x in (cal.grad_mem_scale, cal.activation_mem_scale, cal.loss_mem_scale,
                                  cal.buffer_mem_scale)):
            return True
        total = self._act[-1]
        # the most a compressed reduction's own moment holds in buffers beyond the block moment's: its working
        # set over one bucket (at ZeRO 0-2 a bucket is at most DDP_BUCKET_BYTES; a ZeRO-3 unit has no such cap)
        working = max(self._reduction_mem[o].working for o in self.options)
        whole = self.chunk_alone or c.interleave == 1 or (working > 0 and c.zero_stage == 3)
        share = 1 if whole else c.interleave
        room = (ctx.cap(c) - self._fixed) / share + (working * DDP_BUCKET_BYTES if share > 1 else 0.0)
        if room <= 0:
            return False
        state = 0.0
        if not self._fpar and not self._epar and not ctx.async_sgd:
            # per parameter, what the block moment holds: the parameters and optimizer state, and the engine's
            # gradients where they stay from step to step (flat buffers, fp32 in the mixed precisions) or where
            # every stage runs a backward while earlier microbatches' gradients wait (more microbatches than any
            # stage holds at once); a parameter several units read may be tied across stages, whose gradient the
            # block moment does not hold: not counted there
            z = c.zero_stage
            per = model_state_bytes(1.0, precision=ctx.precision, optimizer=ctx.optimizer, zero_stage=z,
                                    dp=c.replicas)
            grads = per.grads * (2 if z < 3 and ctx.precision in _FP32_GRADIENTS else 1)
            flat = z <= 1 and not (c.replicas == 1 and ctx.precision == "fp32" and (c.pp > 1 or c.tp > 1))
            held = flat or c.num_microbatches > max(self._inflight)
            untied = max(0.0, self._unique_params - sum(users[0][1] for users in self._shared))
            state = self._unique_params * (per.params + per.optimizer)
            state += untied * grads if held else 0.0
        rooms = [room] * self.num_stages
        if share == 1:
            rooms[-1] -= self._loss_kept * max(1, self._inflight[-1]) + self._loss_work
        most = 0.0
        for r, k in sorted(((r, k) for k, r in enumerate(rooms)), key=lambda x: -max(1, self._inflight[x[1]])):
            put = min(max(0.0, r), state)
            state -= put
            most += max(0.0, r - put) / max(1, self._inflight[k])
        return state <= 0 and total <= most

    def dp_ranks(self, pipeline_rank: int) -> tuple[int, ...]:
        return self._dp_groups[pipeline_rank]

    def settle(self, bounds: tuple[int, ...], stages: tuple[StageCost, ...]) -> tuple[StageCost, ...]:
        """A whole cut's stages with each interleaved rank's activations at its true peak.

        Alone, virtual stage k counts the most microbatches its own chunk ever holds (chunk_inflight): safe
        for a stage checked on its own, but a rank's chunks peak at different moments, and their sum counts
        microbatches never in flight together (63 for 47 on the first rank at pp 8, 5 chunks, 64
        microbatches). Here each stage keeps what it holds at the moment its rank's kept activations are
        largest (cost_models.memory.chunk_live), so that a rank's stages sum to its peak; `fits` stays the
        stage's own, safe, verdict."""
        c = self.cand
        if c.schedule != "interleaved-1f1b" or c.interleave < 2:
            return stages
        pp, v, scale = c.pp, c.interleave, self.ctx.cal.activation_mem_scale
        out = list(stages)
        for rank in range(pp):
            ks = [rank + chunk * pp for chunk in range(v)]
            kept = [self._microbatch_act(bounds[k], bounds[k + 1]) * scale for k in ks]
            moments = chunk_live(pp=pp, stage=rank, num_microbatches=c.num_microbatches, interleave=v)
            peak = max(moments, key=lambda live: sum(n * a for n, a in zip(live, kept)))
            for k, a, n in zip(ks, kept, peak):
                mem = stages[k].memory
                # (a stage whose own peak is the end of a backward counts one microbatch fewer: never below 0)
                over = min(a * (self._inflight[k] - n), mem.activations)
                if over > 0:
                    out[k] = dataclasses.replace(stages[k], memory=mem._replace(activations=mem.activations - over))
        return tuple(out)

    def stage(self, i: int, j: int, k: int) -> StageCost:
        """Units [i, j) as virtual stage k of num_stages.

        Memoised on what the cost depends on: the range's contents (`CostContext.range_codes`, PowerSGD's view of
        its gradients included where an option uses it), the p2p time into it, which units of a shared parameter
        it holds, and k. A pipeline of repeated blocks asks for the same range at many offsets; the cut search
        asks O(n^2 S) times, of which only O(n S) differ here.
        """
        code, power = self._range_codes
        key = (code[j] - code[i] * power[j - i], self.p2p[i - 1] if i > 0 else None, k,
               tuple(tuple(size for u, size in users if i <= u < j) for users in self._shared))
        hit = self._stage_memo.get(key)
        if hit is None:
            hit = self._stage_memo[key] = self._stage(i, j, k)
        return hit

    @functools.cached_property
    def _range_codes(self) -> tuple[list[int], list[int]]:
        low_ranks = self.ctx.unit_low_ranks(self.cand.tp) if self._low_rank is not None else None
        return self.ctx.range_codes(self.arrays, self.p2p, low_ranks)

    @functools.cached_property
    def _reduction_mem(self) -> dict[tuple[str, str], ReductionMemory]:
        """Per compression option, what its reduction holds (cost_models.compression_memory)."""
        c = self.cand
        return {o: reduction_memory(o, zero_stage=c.zero_stage, dp=c.replicas, nodes=self._nodes,
                                    sixteen_bit_units=self._sixteen_bit_units) for o in self.options}

    @functools.cached_property
    def _sixteen_bit_units(self) -> bool:
        """A bf16 reduction takes ZeRO-3's units' 16-bit gradients as they are, in the background like an
        uncompressed one (cost_models.compression_memory.sixteen_bit_units)."""
        return sixteen_bit_units(zero_stage=self.cand.zero_stage, precision=self.ctx.precision,
                                 compression_warmup=self.ctx.compression_warmup)

    def _stage(self, i: int, j: int, k: int) -> StageCost:
        ctx, cand = self.ctx, self.cand
        S = self.num_stages
        f = self._f[j] - self._f[i] + (self.p2p[i - 1] if k > 0 else 0.0)
        b = self._b[j] - self._b[i] + (self.p2p[j - 1] if k < S - 1 else 0.0)
        if k == S - 1:  # the loss on the model's output
            f, b = f + self._loss_f, b + self._loss_b
        params = self._par[j] - self._par[i]
        rest = self._rest[j] - self._rest[i]
        tied = 0.0  # parameters this stage shares with another pipeline rank (a tied embedding and LM head)
        root = 0.0  # read by several of its units outside the blocks: per-module ZeRO-3 keeps it on the root
        for users, in_block in zip(self._shared, self._shared_in_block):
            inside = [size for u, size in users if i <= u < j]
            drop = sum(inside[1:])  # read by several of its units: held once
            if inside and len(inside) < len(users) and cand.pp > 1:
                tied += inside[0]
                drop_rest = drop + inside[0]  # outside the engine's units: ZeRO-3 never gathers it
            else:
                drop_rest = drop
                root += inside[0] if len(inside) > 1 and not in_block else 0.0
            params -= drop
            rest -= 0.0 if in_block else drop_rest
        # the engine's gradient buffers, each parameter's once (a tied one, whose gradient is summed outside the
        # engine between the pipeline ranks holding it, counted as if inside: small beside the rest)
        # frozen parameters (no gradient, no optimizer state): held, never reduced or stepped; one read by several
        # units is counted once, like the rest
        frozen = min(self._fpar[j] - self._fpar[i], params) if self._fpar else 0.0
        trained = params - frozen
        b += trained * self._accum_s
        v = cand.interleave
        inflight = self._inflight[k]
        expert = self._epar[j] - self._epar[i] if self._epar else 0.0
        per_module = cand.zero_stage == 3 and cand.zero3_unit == "module"
        units = round(self.arrays.modules[j] - self.arrays.modules[i]) if per_module else j - i
        exposed, optim = self._tail(trained, f, b, self.stage_low_rank(i, j), units=units, expert=expert)
        if ctx.async_sgd:
            memory_of = lambda option: self._async_memory(i, j, k, params, inflight)
        else:
            memory_of = self._peak_memory(i, j, k, params=params, tied=tied, rest=rest, inflight=inflight,
                                          expert=expert, root=root, frozen=frozen)
        # The compression with the least exposed time of those that fit (a compressor's buffers may not;
        # the fastest when none does); the first, least lossy, on a tie. Interleaved: a rank holds v
        # chunks; each may use 1/v of the memory (safe, if conservative for uneven chunks), or under
        # chunk_alone all of it (the rank's sum is checked on whole cuts).
        chosen = memory = None
        share = 1 if self.chunk_alone else v
        for option in sorted(self.options, key=exposed.__getitem__):
            mem = memory_of(option)
            fits = sum(mem[:4]) * share + mem[4] <= ctx.cap(cand)
            if memory is None or fits:
                chosen, memory = option, mem
            if fits:
                break
        return StageCost(forward_s=f, backward_s=b, tail_s=exposed[chosen] + optim, exposed_comm_s=exposed[chosen],
                         params=params, memory=memory, fits=fits, compression=chosen)

    def stage_low_rank(self, i: int, j: int) -> LowRank | None:
        """PowerSGD's view of units [i, j)'s gradients, each parameter once (None: no option uses PowerSGD)."""
        if self._low_rank is None:
            return None
        prefix, shared = self._low_rank
        lr = prefix[j] - prefix[i]
        for users in shared:
            inside = [x for u, x in users if i <= u < j]
            for x in inside[1:]:
                lr = lr - x
        return lr

    def _peak_memory(self, i: int, j: int, k: int, *, params: float, tied: float, rest: float,
                     inflight: int, expert: float = 0.0, root: float = 0.0, frozen: float = 0.0
                     ) -> Callable[[tuple[str, str]], tuple[float, float, float, float, float]]:
        """(params, grads, optimizer, activations, buffers) of units [i, j) as virtual stage k at its peak,
        as a function of the compression option (what all options share is worked out once).

        What the runtime holds (runtime.engines.data_parallel, runtime.pipeline.executor, runtime.engines.unreplicated):

        - At rest, model state (cost_models.memory.model_state_bytes) of the parameters in the
          data-parallel engine, ZeRO-sharded; tied parameters (`tied`: shared with another pipeline
          rank) live outside it, whole on every replica (params and optimizer state, grads in .grad).
          Gradients at rest only where the engine keeps flat gradient buffers (DDP, ZeRO-1). ZeRO-2/3
          shard gradients, Unreplicated's and the tied parameters' .grad exist from a step's first
          backward to its optimizer step: at a moment of a microbatch's backward only when an earlier
          microbatch's backward ran (m > microbatches in flight), or at the end of a backward.
        - On top, the most of three moments of one microbatch's backward:
          loss (last stage): the in-flight microbatches' activations, the loss's kept output per
              microbatch in flight and the two output-sized gradients of its backward;
          block: those activations, the gradients into and out of the blocks' largest op, under cp > 1 the
              buffers of one attention node's context-parallel kernel
              (partitioner.planner.context_split.attention_buffer_bytes), ZeRO-2's
              gradient bucket being filled (and the one before it, in flight), ZeRO-3's block gathered
              with the one prefetched and their fp32 gradient (the first block backpropagated has
              none yet, the second has freed a block's activations), before the last stage the
              received gradient of the stage's output;
          end: the other in-flight microbatches' activations, every gradient formed (ZeRO-2/3: the
              last reductions in flight), and the largest parameter's gradient as autograd forms it:
              for one read twice in the stage (a tied embedding and LM head) both contributions and,
              before the engine copies it into its bucket, their sum.
          ZeRO-3 keeps the parameters outside the blocks (`rest`, on the root module) gathered from
          forward to backward: live at every moment.
        - ZeRO-3 per module (zero3_unit="module", runtime.engines.zero3): a unit is a module holding
          parameters (its largest in the stage: `unit`), so the block moment's gathered parameters are
          two units' (the one in use, the one prefetched), three under recomputation (the block's
          recomputed forward gathers each unit while the one in backward and the prefetched one stay),
          and its fp32 gradients those of the unit being filled and the one being reduced; one reduction
          is a unit's. Kept from forward to backward: only the parameters read by several modules
          outside the blocks (`root`: a tied embedding and LM head, a unit on the root module); the
          rest of the parameters outside the blocks are units like any other.
        - A compressed reduction (cost_models.compression_memory) holds its error feedback at every
          moment (counted with the gradients), and its working set (a buffer) for the largest bucket
          or unit while one runs: a fourth moment at the end of the backward, and in the block moment
          too where the stage reduces several buckets or units.
        - The process's fixed memory (the device's context and a collective library's buffers per
          group the rank talks in, cost_models.memory.process_fixed_bytes) with the buffers, unscaled.
        The moment is chosen on the uncalibrated bytes, so each calibration factor scales its terms
        linearly (cost_models.fit.fit_memory).
        """
        ctx, cand, cal, arr = self.ctx, self.cand, self.ctx.cal, self.arrays
        z, last, mb = cand.zero_stage, k == self.num_stages - 1, cand.microbatch_size
        kw = dict(precision=ctx.precision, optimizer=ctx.optimizer)
        # (a frozen parameter several stages read counts among `tied` too: never below none)
        own = model_state_bytes(max(0.0, params - tied - frozen), zero_stage=z, dp=cand.replicas, **kw)
        if expert:  # ep > 1: the expert parameters' state is sharded by ZeRO over the ranks holding the same experts
            dense = model_state_bytes(max(0.0, params - tied - expert - frozen), zero_stage=z, dp=cand.replicas, **kw)
            mine = model_state_bytes(expert, zero_stage=z, dp=cand.replicas // cand.ep, **kw)
            own = ModelStateBytes(params=dense.params + mine.params, grads=dense.grads + mine.grads,
                                  optimizer=dense.optimizer + mine.optimizer)
        if frozen:  # held in the compute dtype (the engine casts every parameter), nothing else: no gradient, no state
            own = ModelStateBytes(params=own.params + frozen * self._param_bytes, grads=own.grads,
                                  optimizer=own.optimizer)
        own_grads = own.grads
        if z < 3 and ctx.precision in _FP32_GRADIENTS:
            # The engine accumulates the mixed precisions' gradients in fp32 buffers (4 B, where the ZeRO paper's
            # formula counts a 16-bit gradient's 2: DataParallel.held_bytes measures 18 B per parameter at ZeRO-0,
            # as Megatron's "bf16 param, fp32 grads"). ZeRO-3 holds no 16-bit shard (it gathers from the fp32
            # master), which the formula's total of 16/dp already is.
            own_grads = 2 * own.grads  # a local, not a dataclasses.replace: this runs per stage of every cut
        whole = model_state_bytes(tied, zero_stage=0, dp=1, **kw) if tied else _NO_STATE
        pb, gb = self._param_bytes, self._grad_bytes  # gb: the engine's gradient buffers (fp32; bf16 if pure)
        # runtime.engines.unreplicated: pipeline / tensor-parallel programs at dp = 1 in fp32 (codegen_pipeline)
        flat_grads = z <= 1 and not (cand.replicas == 1 and ctx.precision == "fp32" and (cand.pp > 1 or cand.tp > 1))
        rest_grads = own_grads if flat_grads else 0.0  # held through the step
        step_grads = whole.grads + (0.0 if flat_grads else own_grads)  # formed by the first backward
        carried = cand.num_microbatches > inflight
        grads = max(0.0, params - tied - frozen) * gb  # what the engine reduces
        # one reduction's fp32 input (ZeRO-2: a bucket; ZeRO-3: a unit, the largest of blocks and the rest)
        block = max(arr.block_par[i:j], default=0.0)
        if z == 3 and cand.zero3_unit == "module":  # units are modules; blocks count them, `block` is the largest
            block = max(arr.max_module[i:j], default=0.0)
            blocks = arr.modules[j] - arr.modules[i]
            rest, live = root, (3 if cand.recompute != "none" else 2)
        else:
            blocks, live = arr.blocks[j] - arr.blocks[i], 2
        several = z == 3 or grads > DDP_BUCKET_BYTES
        kept = rest * pb if z == 3 else 0.0
        gathered = min(live, blocks) * block * pb if z == 3 else 0.0  # the unit, the one prefetched (recomputed)
        act1 = self._microbatch_act(i, j)
        acts = act1 * inflight + max(self._work[i:j], default=0.0)
        if k > 0 and cand.schedule in _SPLIT_CHUNKED:
            # as zb-h1 below, the count of microbatches between I and W read off the rank's order
            held = arr.wgrad[j] - arr.wgrad[i] - (self._loss_kept if last else 0.0)
            acts += self._waiting[k] * max(0.0, held)
        if cand.schedule == "zb-h1" and k > 0:
            # between a microbatch's I and its W the stage also keeps the gradients into its weights' matmuls
            # (runtime.pipeline.split_backward); rank r runs W r I's late, so r + 1 microbatches at once, right
            # after an I. Stage 0 has no input gradient: its I computes nothing and its W the whole backward.
            # On the last stage the LM head's is the logits' gradient, where I freed the loss's kept output.
            held = arr.wgrad[j] - arr.wgrad[i] - (self._loss_kept if last else 0.0)
            acts += min(k % cand.pp + 1, cand.num_microbatches) * max(0.0, held)
        big, twice = self._largest_param(i, j)

        carry = step_grads if carried else 0.0
        freed = min(arr.unit_act[i:j], default=0.0)
        received = 0.0 if last else ctx.boundary_bytes(j - 1, mb, self.cand.tp if self.cand.sp else 1, self.cand.cp)
        # cp > 1: one attention node's context-parallel buffers (a ring's k/v blocks and dk/dv accumulators), held
        # while it runs in this backward
        attention = max(arr.cp_buffers[i:j], default=0.0)
        # without an engine (Unreplicated) the parameter's .grad is the gradient, already in step_grads
        parts = (max(big, 2 * twice) + (twice if z < 3 else 0.0)) * pb if (flat_grads or z >= 2) else 0.0
        # A compressed reduction runs synchronously in the hook of its bucket's last gradient, which the
        # hook still holds: the gradients then, the bucket being reduced (ZeRO-2/3: the input; at ZeRO-0/1
        # it is in the flat gradients), that parameter's gradient, and the working set on top.
        # (a tied parameter is outside the engine: no hook holds it; the engine's own largest is then
        # not known here, and small beside the tied embedding it stands in for)
        hook = (0.0 if tied and big <= tied else max(big, twice)) * pb if (flat_grads or z >= 2) else 0.0

        @functools.cache
        def moments_of(ub: float) -> tuple[list, tuple, float]:
            """(moments, the reduction's own moment, one reduction's input) when a ZeRO-3 unit's reduction
            takes its gradient at `ub` bytes per element (the engine's buffers' gb, or a bf16 reduction's 2)."""
            reduction = {2: min(grads, DDP_BUCKET_BYTES), 3: max(block, rest) * ub}.get(z, 0.0)
            before = reduction if carried else 0.0  # the previous microbatch's last reduction, still in flight
            # (grads, activations, loss, buffers) beyond the state at rest, per moment
            moments = []
            if last:
                moments.append((carry + before, acts, self._loss_kept * inflight + self._loss_work, kept))
            filling = {2: reduction + (reduction if carried or several else 0.0),
                       3: max(0.0, min(2, blocks) * block * ub - freed) + before}.get(z, 0.0)
            moments.append((carry + filling, acts + 2 * max(arr.biggest[i:j], default=0.0), 0.0,
                            kept + gathered + received + attention))
            ending = {2: reduction * (2 if carried or several else 1) + reduction / cand.replicas,
                      3: 2 * reduction}.get(z, 0.0)
            moments.append((step_grads + ending + parts, act1 * (inflight - 1), 0.0, kept + gathered))
            reducing = (step_grads + (reduction if z >= 2 else 0.0) + hook, act1 * (inflight - 1), 0.0,
                        kept + gathered)
            return moments, reducing, reduction if z >= 2 else min(grads, DDP_BUCKET_BYTES)

        def at_peak(rm: ReductionMemory) -> StageMemory:
            moments, reducing, bucket = moments_of(rm.input_bytes or gb)
            if rm == _NO_BUFFERS:
                at = moments
            else:  # the error feedback at every moment (gradient-shaped state, per chunk: with the
                # gradients); the working set while a reduction runs (reused: a buffer)
                at = [(g + rm.held * grads, a, loss, b) for g, a, loss, b in moments]
                at.append((reducing[0] + rm.held * grads,) + reducing[1:3] + (reducing[3] + rm.working * bucket,))
                if several:  # one runs mid-backward, under the block moment's activations
                    g, a, loss, b = at[-3]
                    at[-3] = (g, a, loss, b + rm.working * bucket)
            g, a, loss, b = max(at, key=sum)
            return StageMemory(own.params + whole.params,
                               (rest_grads + g) * cal.grad_mem_scale,
                               own.optimizer + whole.optimizer,
                               a * cal.activation_mem_scale + loss * cal.loss_mem_scale,
                               b * cal.buffer_mem_scale + cal.memory_overhead_bytes + self._fixed)

        return lambda option: at_peak(self._reduction_mem[option])

    def _largest_param(self, i: int, j: int) -> tuple[float, float]:
        """(largest parameter of units [i, j), largest one read by two or more of them), elements per tensor rank."""
        big = max(self.arrays.max_param[i:j], default=0.0)
        twice = max((inside[0] for users in self._shared
                     if len(inside := [size for u, size in users if i <= u < j]) > 1), default=0.0)
        return big, twice

    def _microbatch_act(self, i: int, j: int) -> float:
        """What units [i, j) as one stage keep per microbatch in flight: their activations and what _held adds."""
        return self._act[j] - self._act[i] + self._held(i)

    def _held(self, i: int) -> float:
        """What a stage starting at unit i keeps per microbatch beyond its units' own activations: the tensors
        made before the unit ahead of it that its blocks read, under recomputation (UnitCost.stage_start_bytes)."""
        start = self.arrays.start
        return start[i] if i < len(start) else 0.0

    def _async_memory(self, i: int, j: int, k: int, params: float,
                      inflight: int) -> StageMemory:
        """Async SGD (pure data parallel, fp32, ZeRO 0): model state, activations and the loss of the one stage,
        and runtime.engines.async_sgd's flat buffers: every=k averages through one flat copy of the parameters;
        staleness=s keeps the agreed parameters plus, per step in flight, its update and the all-reduce's
        buffer."""
        ctx, cal = self.ctx, self.ctx.cal
        state = model_state_bytes(params, precision=ctx.precision, optimizer=ctx.optimizer, zero_stage=0, dp=1)
        acts = self._microbatch_act(i, j) * inflight + max(self._work[i:j], default=0.0)
        loss = self._loss_kept * inflight + self._loss_work if k == self.num_stages - 1 else 0.0
        s = ctx.async_sgd.get("staleness")
        flat = (1 if s is None else 2 * s + 1) * params * 4 if self.cand.dp > 1 else 0.0
        return StageMemory(state.params, state.grads * cal.grad_mem_scale, state.optimizer,
                           acts * cal.activation_mem_scale + loss * cal.loss_mem_scale,
                           flat * cal.buffer_mem_scale + cal.memory_overhead_bytes + self._fixed)

    def _param_gather(self, params: float) -> float:
        """The ZeRO-1/2 all-gather of a stage's updated parameters over its data-parallel group, in the
        compute dtype. Every pipeline rank's group has the same shape (the mesh is regular), so pipeline
        rank 0's stands for all; stages repeat sizes, hence the memo."""
        key = ("sync", params)
        hit = self._comm_memo.get(key)
        if hit is None:
            hit = self._comm_memo[key] = self.ctx.comm.all_gather(params * self._param_bytes, self.dp_ranks(0))
        return hit

    def _reduction(self, params: float, compression: tuple[str, str], lr: LowRank | None) -> tuple[float, float]:
        """(wire, kernel) seconds of the stage's gradient reduction with that (intra_node, inter_node)
        compression: the all-reduce of DDP/ZeRO-1, the flat reduce-scatter of ZeRO-2/3."""
        lr = lr if "powersgd" in compression else None
        key = (params, compression, lr)
        hit = self._comm_memo.get(key)
        if hit is None:
            ranks, comm = self.dp_ranks(0), self.ctx.comm
            if self.cand.zero_stage <= 1:
                t = all_reduce_time(params, ranks, comm, dict(zip(LEVELS, compression)), low_rank=lr,
                                    reduce_bytes=self._grad_bytes)
            else:
                t = reduce_scatter_time(params, ranks, comm, group_compressor(compression),
                                        reduce_bytes=self._grad_bytes)
            hit = self._comm_memo[key] = (t.wire_s, t.kernel_s)
        return hit

    def _reductions(self, params: float, lr: LowRank | None) -> list[tuple[tuple[str, str], float, float, bool]]:
        """(option, wire, kernel, compressed) of the stage's gradient reduction for each compression option: the
        cut search asks for the same stage sizes many times, each with every option."""
        key = ("all", params, lr)
        hit = self._comm_memo.get(key)
        if hit is None:
            hit = self._comm_memo[key] = [(o, *self._reduction(params, o, lr), self._compressor[o] != "none")
                                            for o in self.options]
        return hit

    def _gather(self, params: float, compressor: str) -> tuple[float, float]:
        """(wire, kernel) seconds of one ZeRO-3 parameter all-gather of the stage (int8 codes under int8/int4)."""
        key = ("gather", params, compressor)
        hit = self._comm_memo.get(key)
        if hit is None:
            t = gather_time(params, self.dp_ranks(0), self.ctx.comm, compressor, param_bytes=self._param_bytes)
            hit = self._comm_memo[key] = (t.wire_s, t.kernel_s)
        return hit

    def _tail(self, params: float, f: float, b: float, lr: LowRank | None,
              units: int = 1, expert: float = 0.0) -> tuple[dict[tuple[str, str], float], float]:
        """(exposed data-parallel communication per compression option, optimizer step) of one stage, per step.

        Wire time hides behind compute up to dp_overlap of it, kernel time never, and a compressed
        reduction's not at all (the engine runs it synchronously inside the backward's gradient hooks:
        runtime.engines.dp_buckets, data_parallel._reduce_scatter): DDP/ZeRO-1 all-reduce behind the last
        backward; ZeRO-2/3 reduce-scatter every microbatch (runtime.engines.data_parallel: no_sync only defers stages 0
        and 1), each behind its backward; ZeRO-3 gathers and reduce-scatters
        per unit (block), so a stage of `units` issues that many of each per
        microbatch, the forward's gathers behind its forward, the backward's
        gathers and reduce-scatters together behind its backward (`_zero3_exposed`);
        the ZeRO-1/2 parameter all-gather after the optimizer step is exposed. The stage takes the compression with the least exposed time
        of those that fit in memory (StageEvaluator.stage); the search checks
        that all stages agree (search.py).

        Under expert parallelism `expert` of the `params` are expert parameters: the dense rest is reduced
        as above, the expert ones over the dp x cp / ep ranks holding the same experts, uncompressed (what
        the compressors run on is the data-parallel group), `_expert_tail`.
        """
        if expert:
            exposed, optim = self._tail(params - expert, f, b, lr, units)
            more, optim_e = self._expert_tail(expert, f, b, units)
            return {o: t + more for o, t in exposed.items()}, optim + optim_e
        cand = self.cand
        m, z = cand.num_microbatches, cand.zero_stage
        overlap = self.ctx.cal.dp_overlap
        exposed = dict.fromkeys(self.options, 0.0)
        if cand.dp > 1 and self.ctx.async_sgd:
            exposed = dict.fromkeys(self.options, self._async_sync(params, f, b))
        elif cand.replicas > 1:
            per_step = m if z >= 2 else 1
            n = max(1, units) if z == 3 else 1
            regathers = self._zero3_regathers() if z == 3 else 0
            gather = self._param_gather(params) if z in (1, 2) else 0.0  # the updated parameters', in the compute dtype
            if z == 3:
                for option in self.options:
                    exposed[option] = m * self._zero3_exposed(params / n, n, f, b, option, regathers=regathers)
            else:
                for option, wire, kernel, compressed in self._reductions(params, lr):
                    hidden = 0.0 if compressed else overlap * b  # compressed: synchronous
                    exposed[option] = per_step * (max(0.0, wire - hidden) + kernel) + gather
        shard = params / (cand.replicas if z >= 1 else 1)
        optim = shard * self._optim_s + params * self._settle_s
        return exposed, optim

    def _expert_tail(self, expert: float, f: float, b: float, units: int) -> tuple[float, float]:
        """(exposed seconds, optimizer step) per step of the expert parameters' reduction over the ranks that
        hold the same experts (`_edp`), as `_tail` times the dense one: DDP/ZeRO-1 all-reduce behind the last
        backward, ZeRO-2 reduce-scatter every microbatch, ZeRO-1/2 parameter all-gather exposed, ZeRO-3's
        gathers and reduce-scatters per unit and microbatch. Uncompressed; memoised on the stage's size. It hides
        behind the same backward as the dense reduction, each on its own: optimistic where both are long (they
        run on different groups, so on different links only where those groups differ in span)."""
        cand, comm, ranks = self.cand, self.ctx.comm, self._edp
        key = ("expert", expert, f, b, units)
        hit = self._reduce_memo.get(key)
        if hit is not None:
            return hit
        m, z, overlap = cand.num_microbatches, cand.zero_stage, self.ctx.cal.dp_overlap
        exposed = 0.0
        if len(ranks) > 1:
            if z == 3:
                n = max(1, units)
                g = gather_time(expert / n, ranks, comm, "none", param_bytes=self._param_bytes)
                r = reduce_scatter_time(expert / n, ranks, comm, "none", reduce_bytes=self._grad_bytes)
                gathers = 1 + self._zero3_regathers()
                exposed = m * (max(0.0, n * g.wire_s - overlap * f) +
                               max(0.0, n * (gathers * g.wire_s + r.wire_s) - overlap * b))
            else:
                t = all_reduce_time(expert, ranks, comm, {}, reduce_bytes=self._grad_bytes) if z <= 1 else \
                    reduce_scatter_time(expert, ranks, comm, "none", reduce_bytes=self._grad_bytes)
                exposed = (m if z >= 2 else 1) * (max(0.0, t.wire_s - overlap * b) + t.kernel_s)
                if z in (1, 2):
                    exposed += comm.all_gather(expert * self._param_bytes, ranks)
        shard = expert / (len(ranks) if z >= 1 else 1)
        hit = self._reduce_memo[key] = (exposed, shard * self._optim_s)
        return hit

    def _zero3_regathers(self) -> float:
        """How many more times than once a ZeRO-3 unit is gathered in each microbatch's backward, on average: again
        for a recomputed forward where units are per module (runtime.engines.zero3; a block unit is still whole
        from the backward's own gather), for the share of blocks recomputed (k / n under recompute_blocks), and
        again for W where the schedule splits the backward (each W gathers the units it reaches, freed after I:
        runtime.engines.zero3 split_backward)."""
        cand = self.cand
        k, n = cand.recompute_blocks
        recomputed = k / n if cand.zero3_unit == "module" and cand.recompute != "none" else 0.0
        return recomputed + int(cand.schedule in SPLIT_BACKWARD)

    def _zero3_exposed(self, unit_params: float, n: int, f: float, b: float, option: tuple[str, str], *,
                       regathers: float = 0) -> float:
        """Exposed seconds of one microbatch's ZeRO-3 traffic: n units of `unit_params` each, gathered
        for the forward and again for the backward, their gradients reduce-scattered in the backward.

        The collectives of a group queue on one link (one NCCL communicator runs them in order), so
        what a phase sends hides behind that phase's compute once: the forward's n gathers behind
        f, the backward's n gathers and n reduce-scatters together behind b, each up to dp_overlap
        of it (the ZeRO paper's 3 transfers of the parameters per step, 1.5x DDP's volume, where
        a pass of data parallelism's all-reduce is 2). Not each behind the whole backward, as if
        the link carried a gather and a reduce-scatter at once. Kernel time (int8 codes) never
        hides. `regathers` (`_zero3_regathers`: per-module units under recomputation, a split backward's W)
        adds that many more gathers of each unit behind b (the backward's time counts the recomputation and
        W), 4 or 5 transfers of the parameters per step. Each collective pays its link's
        latency (the alpha of `gather_time` and `reduce_scatter_time`), so n units of P/n cost more
        than one of P: what finer units pay for holding less. A compressed reduce-scatter hides behind
        nothing (the engine runs it synchronously), except a bf16 one of 16-bit gradients
        (`_sixteen_bit_units`), which runs in the background; the (quantized) gathers still prefetch.
        """
        overlap = self.ctx.cal.dp_overlap
        compressor = self._compressor[option]
        g_wire, g_kernel = self._gather(unit_params, compressor)
        r_wire, r_kernel = self._reduction(unit_params, option, None)
        gathers = 1 + regathers  # in the backward
        forward = max(0.0, n * g_wire - overlap * f)
        background = compressor == "bf16" and self._sixteen_bit_units
        if background:  # its one pass, dividing the 16-bit gradient in place, is the engine's cast
            r_kernel = 0.0  # (cost_models.optimizer.gradient_buffer_bytes)
        if compressor != "none" and not background:  # a synchronous reduce-scatter; the gathers still prefetch
            backward = max(0.0, n * gathers * g_wire - overlap * b) + n * r_wire
        else:
            backward = max(0.0, n * (gathers * g_wire + r_wire) - overlap * b)
        return forward + backward + n * ((1 + gathers) * g_kernel + r_kernel)

    def _async_sync(self, params: float, f: float, b: float) -> float:
        """Exposed seconds per step of async SGD's parameter averaging (an fp32 all-reduce of the stage's
        parameters, uncompressed): every=k, blocking after every k-th step, 1/k of it per step;
        staleness=s >= 1, one per step behind the next step's m forwards and backwards (up to dp_overlap
        of them: a link slower than the compute still bounds the step); staleness=0 waits at once."""
        wire, kernel = self._reduction(params, ("none", "none"), None)
        a = self.ctx.async_sgd
        if "every" in a:
            return (wire + kernel) / a["every"]
        if a["staleness"] == 0:
            return wire + kernel
        return max(0.0, wire - self.ctx.cal.dp_overlap * self.cand.num_microbatches * (f + b)) + kernel
