"""Time a pipeline `Schedule`: an event simulator of its per-rank instruction lists.

The planner predicts step time with it; its events become a Perfetto trace.

Model (the same lists the runtime executes, run with these rules):
  - Each rank runs its list in order, one compute action (F, B, I, W,
    OPTIM) at a time on its compute stream. A split backward's W takes
    `weight_grad[v]` of the stage's backward and its I the rest.
  - SEND costs the sender nothing (isend); the data arrives `p2p` later.
    Transfers do not contend with each other.
  - RECV blocks: it completes at max(the rank's time, the send's issue time
    + p2p of that boundary).
  - GRAD_SYNC runs on the rank's communication stream, one collective at a
    time, without blocking the compute stream; OPTIM of a stage first waits
    for that stage's GRAD_SYNC. So a stage's reduction hides behind whatever
    compute the rank still has (the later backwards of its other stages in
    an interleaved schedule).
  - `Durations.overlap` adds DDP-style bucketing inside the stage's last
    backward: when GRAD_SYNC follows the stage's last B with no other
    compute between them, the reduction may start `overlap * backward[v]`
    before that B ends (after a last W: `overlap * weight_grad[v]`) (buckets are reduced as backward fills them):
        start = max(end of that B - overlap * backward[v], comm stream free)
    otherwise start = max(issue time, comm stream free). The exposed part
    is what runs past the rank's remaining compute: for the stage a rank
    finishes last, with an idle comm stream,
        exposed = max(0, grad_sync[v] - overlap * backward[v]),
    and for an earlier stage it also hides behind the compute between that
    B and the stage's OPTIM (the rule of thumb
    max(0, grad_sync - overlap * remaining backward compute) with the
    later compute counted fully, since it runs on another stream).
  - UNSHARD and RESHARD (the ZeRO parameter gathers and frees that code
    generation adds, `schedule.add_unshard_reshard`) take no time here: the
    durations already charge them where they run, OPTIM's `optim` holding
    ZeRO-1/2's all-gather of the updated shards and `forward` / `backward`
    ZeRO-3's gathers, so a lowered list predicts the step its plan does.
  - The step ends when the last action (compute, transfer or collective)
    of any rank ends.

>>> from partitioner.planner.schedule import build_schedule
>>> s = build_schedule("gpipe", pp=4, num_microbatches=8)
>>> r = simulate(s, Durations.uniform(s.num_stages, forward=1.0, backward=2.0))
>>> r.step_time_s, round(r.bubble_fraction, 4)          # (m + pp - 1)(f + b); (pp - 1)/(m + pp - 1)
(33.0, 0.2727)
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Literal

from cost_models.errors import PartitionerError
from partitioner.planner.schedule import Op, Schedule, validate

__all__ = ["Durations", "Event", "SimResult", "simulate", "WEIGHT_GRAD_SHARE"]

# The weight-gradient share of a backward when none is given. A matmul y = x W^T costs 2 n k m FLOPs
# forward and twice that backward: dx = dy W and dW = dy^T x, the same size each, so in the
# matmul-dominated stages of a transformer W is half of the backward (Qi et al. 2023, section 2: T_W = T_B).
WEIGHT_GRAD_SHARE = 0.5

EventKind = Literal["compute", "p2p", "collective", "optim"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Durations:
    """What each action of a schedule costs, in seconds.

    forward / backward: per virtual stage, one microbatch's forward / full
        backward.
    p2p: per boundary v (between virtual stage v and v + 1, so num_stages - 1
        entries), one activation or gradient transfer.
    grad_sync: per virtual stage, the data-parallel reduction of its
        gradients (0 without data parallelism).
    optim: per virtual stage, its optimizer step.
    overlap: in [0, 1], the fraction of the stage's last backward during
        which its gradient reduction already runs (DDP bucketing); see the
        module docstring for the exact rule.
    weight_grad: per virtual stage, the part of `backward` a split
        backward's W takes (its I takes the rest); empty: WEIGHT_GRAD_SHARE
        of each backward.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    p2p: tuple[float, ...]
    grad_sync: tuple[float, ...]
    optim: tuple[float, ...]
    overlap: float = 0.0
    weight_grad: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "p2p", "grad_sync", "optim", "weight_grad"):
            values = getattr(self, name)
            if not isinstance(values, tuple):
                raise PartitionerError(f"Durations.{name} must be a tuple of seconds, "
                                       f"got {type(values).__name__}")
            bad = [x for x in values if not (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0)]
            if bad:
                raise PartitionerError(f"Durations.{name} must hold finite seconds >= 0, got {bad[0]!r}")
        if not 0.0 <= self.overlap <= 1.0:
            raise PartitionerError(f"Durations.overlap={self.overlap!r} must lie in [0, 1]: the "
                                   f"fraction of the last backward that gradient reduction overlaps")
        if self.weight_grad and len(self.weight_grad) != len(self.backward):
            raise PartitionerError(f"Durations.weight_grad has {len(self.weight_grad)} entries but backward "
                                   f"{len(self.backward)}: give one per virtual stage, or none for "
                                   f"{WEIGHT_GRAD_SHARE} of each backward")
        over = [(v, w, b) for v, (w, b) in enumerate(zip(self.weight_grad, self.backward)) if w > b]
        if over:
            v, w, b = over[0]
            raise PartitionerError(f"Durations.weight_grad[{v}]={w!r} exceeds backward[{v}]={b!r}: W is a part "
                                   f"of the backward, so it takes at most all of it")

    def split_backward(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per stage, (I, W) seconds of a split backward.

        >>> Durations.uniform(2, forward=1.0, backward=2.0).split_backward()
        ((1.0, 1.0), (1.0, 1.0))
        """
        w = self.weight_grad or tuple(WEIGHT_GRAD_SHARE * b for b in self.backward)
        return tuple(b - x for b, x in zip(self.backward, w)), w

    @classmethod
    def uniform(cls, num_stages: int, *, forward: float, backward: float, p2p: float = 0.0,
                grad_sync: float = 0.0, optim: float = 0.0, overlap: float = 0.0,
                weight_grad: float | None = None) -> Durations:
        """The same costs for every stage and boundary.

        >>> Durations.uniform(2, forward=1.0, backward=2.0).p2p
        (0.0,)
        """
        return cls(forward=(forward,) * num_stages, backward=(backward,) * num_stages,
                   p2p=(p2p,) * (num_stages - 1), grad_sync=(grad_sync,) * num_stages,
                   optim=(optim,) * num_stages, overlap=overlap,
                   weight_grad=() if weight_grad is None else (weight_grad,) * num_stages)

    def check(self, schedule: Schedule) -> None:
        """Raise unless there is one entry per stage (per boundary for p2p)."""
        S = schedule.num_stages
        for name, want in (("forward", S), ("backward", S), ("p2p", S - 1),
                           ("grad_sync", S), ("optim", S)):
            have = len(getattr(self, name))
            if have != want:
                per = "boundary between consecutive stages" if name == "p2p" else "virtual stage"
                raise PartitionerError(
                    f"Durations.{name} has {have} entries, but the schedule has {S} virtual stages "
                    f"(pp={schedule.pp} x interleave={schedule.interleave}): give one per {per}, "
                    f"{want} in all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    """One action as it ran: on `rank`, from `start` to `end` (seconds).

    kind: compute (F, B, I, W), p2p (a SEND spans the transfer, a RECV the wait),
    collective (GRAD_SYNC, on the communication stream; UNSHARD and RESHARD,
    instants), optim (OPTIM, from the end of the wait for its GRAD_SYNC).
    """

    rank: int
    action: str
    start: float
    end: float
    kind: EventKind

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimResult:
    """A simulated step.

    step_time_s: when the last action of any rank ends (seconds).
    per_rank_busy_s: per rank, seconds of compute (F, B, I, W and OPTIM).
    bubble_fraction: 1 - sum(busy) / (ranks * step time).
    events: one per action, rank by rank, each rank's in program order.
    """

    step_time_s: float
    per_rank_busy_s: tuple[float, ...]
    bubble_fraction: float
    events: tuple[Event, ...]

    def __str__(self) -> str:
        busy = " ".join(f"{b:.4g}" for b in self.per_rank_busy_s)
        return (f"step {self.step_time_s:.6g} s, bubble {self.bubble_fraction:.1%}, "
                f"busy per rank [{busy}] s, {len(self.events)} events")


def simulate(schedule: Schedule, durations: Durations) -> SimResult:
    """Time one step of `schedule` under the module docstring's rules.

    Runs each rank until it blocks on a receive and resumes it when the
    matching send is issued: linear in the number of actions. A schedule in
    which some receive never completes, or a send is never received, raises
    the `validate` error (rank, action marked `<-- ERROR HERE`, and the
    fix). Other defects (a missing forward, say) are not looked for: run
    `validate` on schedules that do not come from `build_schedule`.

    >>> from partitioner.planner.schedule import build_schedule
    >>> s = build_schedule("1f1b", pp=2, num_microbatches=1)
    >>> simulate(s, Durations.uniform(2, forward=1.0, backward=2.0, p2p=0.5)).step_time_s
    7.0
    """
    durations.check(schedule)
    R = schedule.pp
    fwd, bwd, p2p, sync, opt = (durations.forward, durations.backward, durations.p2p,
                                durations.grad_sync, durations.optim)
    overlap = durations.overlap
    cost = {Op.F: fwd, Op.B: bwd}
    cost[Op.I], cost[Op.W] = durations.split_backward()
    B, W = Op.B, Op.W
    SEND_F, RECV_F, SEND_B, RECV_B, GRAD_SYNC, OPTIM = (Op.SEND_F, Op.RECV_F, Op.SEND_B,
                                                        Op.RECV_B, Op.GRAD_SYNC, Op.OPTIM)

    now = [0.0] * R                  # each rank's compute-stream time
    comm_free = [0.0] * R            # when each rank's communication stream is idle
    busy = [0.0] * R
    pc = [0] * R
    # (stage, end, duration) if the last compute completed weight gradients (a B or W)
    last_b_end: list[tuple[int, float, float] | None] = [None] * R
    sync_end: dict[int, float] = {}  # stage -> end of its GRAD_SYNC
    arrival: dict[tuple[bool, int, int], float] = {}  # (forward?, receiving stage, mb) -> time
    waiting: dict[tuple[bool, int, int], int] = {}    # same key -> the rank blocked on it
    events: list[list[Event]] = [[] for _ in range(R)]
    ready = collections.deque(range(R))

    while ready:
        r = ready.popleft()
        actions, out, t = schedule.ranks[r], events[r], now[r]
        while pc[r] < len(actions):
            a = actions[pc[r]]
            op, s = a.op, a.stage
            if op in cost:
                d = cost[op][s]
                out.append(Event(rank=r, action=str(a), start=t, end=t + d, kind="compute"))
                t += d
                busy[r] += d
                last_b_end[r] = (s, t, d) if op is B or op is W else None
            elif op is RECV_F or op is RECV_B:
                key = (op is RECV_F, s, a.microbatch)
                if key not in arrival:
                    waiting[key] = r
                    break
                done = max(t, arrival.pop(key))
                out.append(Event(rank=r, action=str(a), start=t, end=done, kind="p2p"))
                t = done
            elif op is SEND_F or op is SEND_B:
                forward = op is SEND_F
                key = (forward, s + 1 if forward else s - 1, a.microbatch)
                arrival[key] = t + p2p[s if forward else s - 1]
                out.append(Event(rank=r, action=str(a), start=t, end=arrival[key], kind="p2p"))
                if key in waiting:
                    ready.append(waiting.pop(key))
            elif op is GRAD_SYNC:
                issue = t
                if last_b_end[r] is not None and last_b_end[r][0] == s:
                    issue = last_b_end[r][1] - overlap * last_b_end[r][2]
                start = max(issue, comm_free[r])
                comm_free[r] = sync_end[s] = start + sync[s]
                out.append(Event(rank=r, action=str(a), start=start, end=sync_end[s], kind="collective"))
            elif op is not OPTIM:  # UNSHARD, RESHARD: charged by the actions around them (docstring)
                out.append(Event(rank=r, action=str(a), start=t, end=t, kind="collective"))
            else:
                start = max(t, sync_end.get(s, t))
                out.append(Event(rank=r, action=str(a), start=start, end=start + opt[s], kind="optim"))
                t = start + opt[s]
                busy[r] += opt[s]
                last_b_end[r] = None
            pc[r] += 1
        now[r] = t

    if any(pc[r] < len(schedule.ranks[r]) for r in range(R)) or arrival:
        validate(schedule)   # raises with the marked rank list
        raise AssertionError("simulate stalled on a schedule that validate accepts")
    step = max((ev.end for rank_events in events for ev in rank_events), default=0.0)
    bubble = 1.0 - sum(busy) / (R * step) if step > 0 else 0.0
    return SimResult(step_time_s=step, per_rank_busy_s=tuple(busy), bubble_fraction=bubble,
                     events=tuple(ev for rank_events in events for ev in rank_events))
