"""Pipeline schedules as data: each pipeline rank's ordered instruction list.

A `Schedule` says, per pipeline rank, which `Action`s it runs and in what
order: forwards and backwards of (virtual stage, microbatch), the sends and
receives that move activations and gradients between ranks, the
data-parallel gradient reduction of each stage and its optimizer step. The
planner times these lists with `partitioner.planner.simulate`; the runtime executes
the same lists. Virtual stage v lives on rank `v % pp` (Megatron-LM's
interleaved placement: rank r holds stages r, r + pp, r + 2 pp, ...),
except under zb-v and dualpipe-v, whose two stages per rank form a V: rank r holds
stages r and 2 pp - 1 - r (torch's `generate_stage_to_rank_mapping(style="v")`).

`build_schedule` lowers in passes, like torch's pipelining
(`torch/distributed/pipelining/schedules.py`): the compute order of the
schedule kind, then `_add_p2p` (a RECV right before the compute that needs
it, a SEND right after the compute that produces it), then
`_add_grad_sync` (after a stage's last backward), then `_add_optim` (at the
end of the list). Sends are assumed non-blocking (isend), receives blocking;
`validate` checks that no receive waits forever. A RECV's place is where the
receive is posted at the latest: the runtime posts it one compute earlier
where it can (`runtime.pipeline.executor`), so the message moves meanwhile. Code generation lowers one
step further with `add_unshard_reshard`: the ZeRO parameter all-gathers and
frees as UNSHARD / RESHARD actions (torch's `_add_unshard_reshard`), so a
rank's program lists every data-parallel collective it issues.

>>> s = build_schedule("1f1b", pp=2, num_microbatches=2)
>>> print(s)
schedule kind=1f1b pp=2 num_microbatches=2 interleave=1
rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0GRAD_SYNC 0OPTIM
rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1GRAD_SYNC 1OPTIM
>>> Schedule.parse(str(s)) == s
True
>>> peak_inflight(s)
(2, 1)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import re
from collections.abc import Callable
from typing import NoReturn

from cost_models.actions import DP_OPS, PEER, Action, Op
from cost_models.choices import SCHEDULES, ScheduleKind
from cost_models.errors import DeclarationError, PartitionerError

__all__ = [
    "Op", "Action", "Schedule", "ScheduleKind", "SCHEDULE_KINDS", "V_SHAPED", "stage_rank", "chunk_peaks",
    "build_schedule", "add_unshard_reshard", "validate", "peak_inflight",
]

SCHEDULE_KINDS = SCHEDULES
# The schedules whose two stages per rank form a V: rank r holds stages r and 2 pp - 1 - r
V_SHAPED = frozenset({"zb-v", "dualpipe-v"})
JSON_FORMAT = "partitioner.planner.schedule/1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """Per pipeline rank, its ordered instruction list.

    kind: the schedule family that produced the lists.
    pp: pipeline ranks.
    num_microbatches: microbatches per step (m).
    interleave: virtual stages per rank (v): 1 except for interleaved-1f1b
        and zb-v (2).
    ranks: `ranks[r]` is rank r's instruction list, run in order.

    Prints three ways: `str` (a header and one line per rank; `parse` reads
    it back), `table()` (steps x ranks) and `to_json()` / `from_json()`.
    Construction checks only the shape; `validate` checks the contents.
    """

    kind: ScheduleKind
    pp: int
    num_microbatches: int
    interleave: int
    ranks: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        _check_kind_and_sizes(self.kind, self.pp, self.num_microbatches, self.interleave)
        if not isinstance(self.ranks, tuple):
            raise PartitionerError(f"Schedule ranks must be a tuple of per-rank tuples, got "
                                   f"{type(self.ranks).__name__}")
        if len(self.ranks) != self.pp:
            raise PartitionerError(f"Schedule has {len(self.ranks)} rank lists but pp={self.pp}; "
                                   f"give one instruction list per pipeline rank")
        for r, actions in enumerate(self.ranks):
            if not isinstance(actions, tuple) or not all(isinstance(a, Action) for a in actions):
                raise PartitionerError(f"Schedule ranks[{r}] must be a tuple of Action")

    @property
    def num_stages(self) -> int:
        """Virtual stages: pp * interleave."""
        return self.pp * self.interleave

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that holds virtual stage `stage`: stage % pp (zb-v: its V)."""
        if not 0 <= stage < self.num_stages:
            raise PartitionerError(f"stage={stage} is out of range: this schedule has "
                                   f"stages 0..{self.num_stages - 1} (pp={self.pp} x "
                                   f"interleave={self.interleave})")
        return stage_rank(self.kind, self.pp, stage)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages rank `rank` holds: rank, rank + pp, ..."""
        if not 0 <= rank < self.pp:
            raise PartitionerError(f"rank={rank} is out of range 0..{self.pp - 1}")
        return tuple(s for s in range(self.num_stages) if stage_rank(self.kind, self.pp, s) == rank)

    def counts(self) -> tuple[dict[Op, int], ...]:
        """Per rank, how many actions of each op (every op present, 0 if none).

        >>> build_schedule("gpipe", pp=2, num_microbatches=3).counts()[0][Op.SEND_F]
        3
        """
        out = []
        for actions in self.ranks:
            c = dict.fromkeys(Op, 0)
            for a in actions:
                c[a.op] += 1
            out.append(c)
        return tuple(out)

    # --- printing -----------------------------------------------------------
    def _header(self) -> str:
        return (f"schedule kind={self.kind} pp={self.pp} "
                f"num_microbatches={self.num_microbatches} interleave={self.interleave}")

    def __str__(self) -> str:
        lines = [self._header()]
        lines += [f"rank {r}: " + " ".join(map(str, actions)) for r, actions in enumerate(self.ranks)]
        return "\n".join(lines)

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """Inverse of `str`: a header line, then `rank r: <actions>` for r = 0..pp-1."""
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        header = re.fullmatch(r"schedule kind=(\S+) pp=(\d+) num_microbatches=(\d+) interleave=(\d+)",
                              lines[0] if lines else "")
        if header is None:
            raise PartitionerError(
                f"cannot parse schedule header {lines[0] if lines else ''!r}: expected "
                f"'schedule kind=<{'|'.join(SCHEDULE_KINDS)}> pp=<int> num_microbatches=<int> "
                "interleave=<int>' as the first line")
        kind, pp, m, v = header.group(1), *map(int, header.groups()[1:])
        ranks = []
        for r, line in enumerate(lines[1:]):
            prefix = f"rank {r}:"
            if not line.startswith(prefix):
                raise PartitionerError(f"cannot parse schedule line {line!r}: expected it to start "
                                       f"with {prefix!r} (one line per rank, in rank order)")
            ranks.append(tuple(Action.parse(t) for t in line[len(prefix):].split()))
        return cls(kind=kind, pp=pp, num_microbatches=m, interleave=v, ranks=tuple(ranks))

    def table(self) -> str:
        """Steps down, ranks across (torch's `_format_pipeline_order` layout)."""
        return _format_table(self)

    def to_json(self) -> str:
        return json.dumps({
            "format": JSON_FORMAT, "kind": self.kind, "pp": self.pp,
            "num_microbatches": self.num_microbatches, "interleave": self.interleave,
            "ranks": [[str(a) for a in actions] for actions in self.ranks],
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != JSON_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise PartitionerError(f"not a schedule JSON: expected format {JSON_FORMAT!r}, "
                                   f"found {found!r}")
        missing = {"kind", "pp", "num_microbatches", "interleave", "ranks"} - data.keys()
        if missing:
            raise PartitionerError(f"schedule JSON lacks {sorted(missing)}")
        return cls(kind=data["kind"], pp=data["pp"], num_microbatches=data["num_microbatches"],
                   interleave=data["interleave"],
                   ranks=tuple(tuple(Action.parse(t) for t in actions) for actions in data["ranks"]))


# --- building ---------------------------------------------------------------
def build_schedule(kind: ScheduleKind, *, pp: int, num_microbatches: int,
                   interleave: int = 1) -> Schedule:
    """The instruction lists of a GPipe, 1F1B, interleaved-1F1B, ZB-H1 or ZB-V step.

      gpipe: each rank runs all m forwards, then all m backwards, in
          microbatch order (torch's `ScheduleGPipe`).
      1f1b: PipeDream-Flush (Narayanan et al. 2021), Megatron-LM's
          `forward_backward_pipelining_without_interleaving`: rank r warms up
          with min(pp - r - 1, m) forwards, then alternates one forward and
          one backward, then drains the remaining backwards.
      interleaved-1f1b: Narayanan et al. 2021 (SC'21) section 2.2,
          Megatron-LM's `forward_backward_pipelining_with_interleaving`: each
          rank holds `interleave` stages; microbatches go in groups of pp
          through one stage, then the next; rank r warms up with
          min((pp - r - 1) * 2 + (interleave - 1) * pp, m * interleave)
          forwards, then alternates, then drains. Needs m % pp == 0.
      zb-h1: ZB-H1 of Qi et al. 2023 ("Zero Bubble Pipeline Parallelism",
          section 3.1), torch's `ScheduleInterleavedZeroBubble` with one
          stage per rank: 1F1B with every backward split into I (input
          gradient, sent upstream at once) and W (weight gradients). Rank r
          runs its first r W's late, each after a later I, and the rest at
          the end, where 1F1B's cool-down idles: W's fill the bubble. Each
          rank holds at most pp microbatches, rank 0's 1F1B peak (the max
          over ranks is 1F1B's; rank r holds pp rather than pp - r).
      zb-v: ZB-V of Qi et al. 2023 (section 6), torch's
          `ScheduleZBVZeroBubble`: two stages per rank (interleave=2) in a V,
          rank r holding stages r and 2 pp - 1 - r, so the first and the
          last stage (the loss) share rank 0 and the turn of the V needs no
          message; backwards split into I and W as in zb-h1.
      dualpipe-v: DeepSeek's DualPipe (DeepSeek-V3 report, 2024) folded
          onto zb-v's V, torch's `ScheduleDualPipeV`
          (`_calculate_single_rank_operations`, after
          github.com/deepseek-ai/DualPipe's DualPipeV): warm-up forwards of
          both stages, then a steady state of pairs, the forward of one
          stage with the whole backward (B) of the other, then the cool-down,
          whose later backwards split into I and W. Needs m >= 2 pp (torch's
          check). DualPipe overlaps the two halves of a pair (one's compute
          with the other's all-to-alls); this executor runs one action at a
          time, so each pair runs as the forward, then the backward, in
          DualPipe-V's order (torch's runtime does the same by default:
          OVERLAP_F_B runs its sub-actions in turn).

    >>> s = build_schedule("interleaved-1f1b", pp=2, num_microbatches=2, interleave=2)
    >>> print(s.table())
             rank 0      rank 1
    step 00: 0F0         1RECV_F0
    step 01: 0SEND_F0    1F0
    step 02: 0F1         1SEND_F0
    step 03: 0SEND_F1    1RECV_F1
    step 04: 2RECV_F0    1F1
    step 05: 2F0         1SEND_F1
    step 06: 2SEND_F0    3RECV_F0
    step 07: 2RECV_F1    3F0
    step 08: 2F1         3B0
    step 09: 2SEND_F1    3SEND_B0
    step 10: 2RECV_B0    3RECV_F1
    step 11: 2B0         3F1
    step 12: 2SEND_B0    3B1
    step 13: 2RECV_B1    3SEND_B1
    step 14: 2B1         3GRAD_SYNC
    step 15: 2SEND_B1    1RECV_B0
    step 16: 2GRAD_SYNC  1B0
    step 17: 0RECV_B0    1SEND_B0
    step 18: 0B0         1RECV_B1
    step 19: 0RECV_B1    1B1
    step 20: 0B1         1SEND_B1
    step 21: 0GRAD_SYNC  1GRAD_SYNC
    step 22: 2OPTIM      3OPTIM
    step 23: 0OPTIM      1OPTIM
    """
    _check_kind_and_sizes(kind, pp, num_microbatches, interleave)
    m = num_microbatches
    if kind == "interleaved-1f1b" and m % pp != 0:
        lower, upper = (m // pp) * pp, (m // pp + 1) * pp
        nearest = f"{lower} or {upper}" if lower > 0 else f"{upper}"
        raise DeclarationError(
            f"interleaved-1f1b runs microbatches in groups of pp={pp} (Megatron-LM's "
            f"forward_backward_pipelining_with_interleaving), so num_microbatches must be a "
            f"multiple of {pp}; got {m}. Use num_microbatches={nearest}, or schedule='1f1b'")
    order = {"gpipe": _gpipe_order, "1f1b": _one_f_one_b_order,
             "interleaved-1f1b": _interleaved_order, "zb-h1": _zb_h1_order, "zb-v": _zb_v_order,
             "interleaved-zb": _interleaved_zb_order, "dualpipe-v": _dualpipe_v_order}[kind]
    num_stages = pp * interleave
    ranks = []
    for r in range(pp):
        actions = _add_p2p(order(pp, m, interleave, r), rank=r, pp=pp, num_stages=num_stages,
                           rank_of=lambda s: stage_rank(kind, pp, s))
        ranks.append(tuple(_add_optim(_add_grad_sync(actions))))
    return Schedule(kind=kind, pp=pp, num_microbatches=m, interleave=interleave, ranks=tuple(ranks))


def _check_kind_and_sizes(kind: str, pp: int, m: int, interleave: int) -> None:
    if kind not in SCHEDULE_KINDS:
        raise DeclarationError(f"unknown schedule kind={kind!r}; choose one of "
                               f"{', '.join(map(repr, SCHEDULE_KINDS))}")
    for name, value in (("pp", pp), ("num_microbatches", m), ("interleave", interleave)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DeclarationError(f"{name}={value!r} must be an int >= 1")
    if kind == "interleaved-1f1b" and interleave < 2:
        raise DeclarationError(f"kind='interleaved-1f1b' needs interleave >= 2 virtual stages per "
                               f"rank, got interleave={interleave}; with one use kind='1f1b'")
    if kind == "zb-v" and interleave != 2:
        raise DeclarationError(f"kind='zb-v' places exactly 2 stages per rank, in a V: pass interleave=2, "
                               f"not {interleave}")
    if kind == "dualpipe-v" and interleave != 2:
        raise DeclarationError(f"kind='dualpipe-v' places exactly 2 stages per rank, in a V: pass interleave=2, "
                               f"not {interleave}")
    if kind == "dualpipe-v" and m < 2 * pp:
        raise DeclarationError(f"dualpipe-v needs at least as many microbatches as stages (2 pp = {2 * pp}; "
                               f"torch's ScheduleDualPipeV checks the same), got num_microbatches={m}: use "
                               f"num_microbatches >= {2 * pp}, or kind='zb-v'")
    if kind == "interleaved-zb" and interleave < 2:
        raise DeclarationError(f"kind='interleaved-zb' needs interleave >= 2 virtual stages per rank, got "
                               f"interleave={interleave}; with one use kind='zb-h1'")
    if kind == "interleaved-zb" and m % max(1, m // pp):
        rounds = max(1, m // pp)
        raise DeclarationError(
            f"interleaved-zb runs microbatches in {rounds} rounds of about pp={pp} (torch's "
            f"ScheduleInterleavedZeroBubble), so num_microbatches must be a multiple of {rounds}; got {m}. "
            f"Use num_microbatches={rounds * pp} or a multiple of pp")
    if kind not in ("interleaved-1f1b", "interleaved-zb", "zb-v", "dualpipe-v") and interleave != 1:
        raise DeclarationError(f"kind={kind!r} places one stage per rank, so interleave must be 1, "
                               f"got interleave={interleave}; for {interleave} virtual stages per "
                               f"rank use kind='interleaved-1f1b'")


def _gpipe_order(pp: int, m: int, v: int, rank: int) -> list[Action]:
    return ([Action(op=Op.F, stage=rank, microbatch=i) for i in range(m)]
            + [Action(op=Op.B, stage=rank, microbatch=i) for i in range(m)])


def _one_f_one_b_order(pp: int, m: int, v: int, rank: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    order = [Action(op=Op.F, stage=rank, microbatch=i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(op=Op.F, stage=rank, microbatch=warmup + i),
                  Action(op=Op.B, stage=rank, microbatch=i)]
    order += [Action(op=Op.B, stage=rank, microbatch=i) for i in range(m - warmup, m)]
    return order


def _zb_h1_order(pp: int, m: int, v: int, rank: int) -> list[Action]:
    # torch's _get_1f1b_rank_ops(enable_zero_bubble=True, num_1f1b_microbatches=rank) with one local
    # stage: after the k-th I, the oldest pending W once k >= rank; the W's left run at the end
    warmup = min(pp - rank - 1, m)
    order = [Action(op=Op.F, stage=rank, microbatch=i) for i in range(warmup)]
    pending = collections.deque()
    for k in range(m):
        if warmup + k < m:
            order.append(Action(op=Op.F, stage=rank, microbatch=warmup + k))
        order.append(Action(op=Op.I, stage=rank, microbatch=k))
        pending.append(k)
        if k >= rank:
            order.append(Action(op=Op.W, stage=rank, microbatch=pending.popleft()))
    order += [Action(op=Op.W, stage=rank, microbatch=i) for i in pending]
    return order


def _interleaved_zb_order(pp: int, m: int, v: int, rank: int) -> list[Action]:
    # torch's ScheduleInterleavedZeroBubble._calculate_single_rank_operations: microbatches in rounds of
    # m // max(1, m // pp) (ZB1P of Qi et al. 2023); the k-th forward of a rank runs local stage
    # (k // per_round) % v, the k-th backward local stage v - 1 - ((k - warmup) // per_round) % v, each on its
    # stage's next microbatch; after the k-th I, the oldest pending W once k >= rank (_get_1f1b_rank_ops
    # with enable_zero_bubble), the rest at the end
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + (pp - 1 - rank), m * v)
    total = m * v
    count = collections.Counter()

    def nth(op: Op, stage: int) -> Action:
        count[op, stage] += 1
        return Action(op=op, stage=stage, microbatch=count[op, stage] - 1)

    def forward_stage(k: int) -> int:
        return (k // per_round) % v * pp + rank

    def backward_stage(k: int) -> int:
        return (v - 1 - ((k - warmup) // per_round) % v) * pp + rank

    order = [nth(Op.F, forward_stage(k)) for k in range(warmup)]
    pending = collections.deque()
    for k in range(warmup, total + warmup):
        if k < total:
            order.append(nth(Op.F, forward_stage(k)))
        if k - warmup < total:
            order.append(nth(Op.I, backward_stage(k)))
            pending.append(backward_stage(k))
            if k - warmup >= rank:
                order.append(nth(Op.W, pending.popleft()))
    order += [nth(Op.W, stage) for stage in pending]
    return order


def stage_rank(kind: str, pp: int, stage: int) -> int:
    """The pipeline rank holding virtual stage `stage` under schedule `kind`: stage % pp (Megatron-LM's
    interleaved placement), except zb-v's and dualpipe-v's V (stage s and 2 pp - 1 - s on rank s).

    >>> [stage_rank("interleaved-zb", 2, s) for s in range(4)], [stage_rank("zb-v", 2, s) for s in range(4)]
    ([0, 1, 0, 1], [0, 1, 1, 0])
    """
    if kind in V_SHAPED:   # the V: down the ranks on the way in, back up on the way out
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def _zb_v_order(pp: int, m: int, v: int, rank: int) -> list[Action]:
    # torch's ScheduleZBVZeroBubble._calculate_single_rank_operations (Qi et al. 2023, section 6): built for
    # max(2 pp - 1, m) microbatches, then the actions of microbatches >= m dropped
    n = max(2 * pp - 1, m)
    down, up = rank, 2 * pp - 1 - rank     # the rank's stage on the way in, and on the way out
    out: list[Action] = []
    count = {(op, s): 0 for op in (Op.F, Op.I, Op.W) for s in (down, up)}

    def emit(op: Op, stage: int) -> None:
        out.append(Action(op=op, stage=stage, microbatch=count[op, stage]))
        count[op, stage] += 1

    for _ in range(2 * (pp - rank) - 1):
        emit(Op.F, down)
    for _ in range(rank):
        emit(Op.F, up)
        emit(Op.F, down)
    for _ in range(pp - rank):
        emit(Op.F, up)
        emit(Op.I, up)
        emit(Op.W, up)
    while count[Op.F, up] < count[Op.F, down] or count[Op.F, down] < n:
        if count[Op.F, down] < n:
            emit(Op.F, down)
        emit(Op.I, down)
        emit(Op.W, down)
        emit(Op.F, up)
        emit(Op.I, up)
        emit(Op.W, up)
    for _ in range(rank):
        emit(Op.I, down)
        emit(Op.I, up)
    for _ in range(pp - rank):
        emit(Op.I, down)
        emit(Op.W, down)
    while count[Op.W, up] < count[Op.I, up]:
        emit(Op.W, up)
    while count[Op.W, down] < count[Op.I, down]:
        emit(Op.W, down)
    return [a for a in out if a.microbatch < m]


def _dualpipe_v_order(pp: int, m: int, v: int, rank: int) -> list[Action]:
    # torch's ScheduleDualPipeV._calculate_single_rank_operations, its eight steps; an OVERLAP_F_B pair is its
    # forward, then its whole backward B. B and I share a microbatch counter per stage (torch's BACKWARD_INPUT
    # key); each I queues its W, and W's run oldest first where torch's add_weight_action_if_pending does
    down, up = rank, 2 * pp - 1 - rank     # the rank's stage on the way in, and on the way out
    out: list[Action] = []
    count: collections.Counter = collections.Counter()
    weights: collections.deque = collections.deque()

    def emit(op: Op, stage: int) -> None:
        key = (Op.F if op is Op.F else Op.I, stage)
        out.append(Action(op=op, stage=stage, microbatch=count[key]))
        if op is Op.I:
            weights.append(out[-1])
        count[key] += 1

    def weight() -> None:
        if weights:
            a = weights.popleft()
            out.append(Action(op=Op.W, stage=a.stage, microbatch=a.microbatch))

    for _ in range((pp - rank - 1) * 2):         # 1: F0
        emit(Op.F, down)
    for _ in range(rank + 1):                   # 2: F0 F1
        emit(Op.F, down)
        emit(Op.F, up)
    for _ in range(pp - rank - 1):              # 3: I1 W F1 (zero bubble)
        emit(Op.I, up)
        weight()
        emit(Op.F, up)
    for _ in range(m - 2 * pp + rank + 1):      # 4: the pairs (F0 B1) (F1 B0); on the last rank the first
        emit(Op.F, down)                        #    F0 B1 is not overlapped, the same order here
        emit(Op.B, up)
        emit(Op.F, up)
        emit(Op.B, down)
    for _ in range(pp - rank - 1):              # 5: B1, then the pair (F1 B0)
        emit(Op.B, up)
        emit(Op.F, up)
        emit(Op.B, down)
    split = False
    for i in range(rank + 1):                   # 6: B1 B0, split into I from the middle on
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        emit(Op.I if split else Op.B, up)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        emit(Op.I if split else Op.B, down)
    for _ in range(pp - rank - 1):              # 7: W B0
        weight()
        emit(Op.I if split else Op.B, down)
    for _ in range(rank + 1):                   # 8: W
        weight()
    while weights:                              # none left at m >= 2 pp (tests/test_schedule.py): a guard
        weight()
    return out


def _interleaved_order(pp: int, m: int, v: int, rank: int) -> list[Action]:
    # Megatron-LM: the k-th forward (backward) of a rank runs chunk
    # (k mod pp*v) // pp (reversed for backward) on microbatch
    # (k // (pp*v)) * pp + k mod pp.
    def nth(op: Op, k: int) -> Action:
        group, j = divmod(k, pp * v)
        chunk = j // pp if op is Op.F else v - 1 - j // pp
        return Action(op=op, stage=chunk * pp + rank, microbatch=group * pp + j % pp)

    total = m * v
    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order = [nth(Op.F, k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [nth(Op.F, warmup + k), nth(Op.B, k)]
    order += [nth(Op.B, k) for k in range(total - warmup, total)]
    return order


def chunk_peaks(kind: ScheduleKind, *, pp: int, num_microbatches: int, interleave: int,
                rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per local stage of pipeline rank `rank` (in stage order), the most microbatches it holds at once:
    (forward done and weight gradients not yet: its activations; input gradient I done and W not yet: the
    gradients at its weights' matmuls that a split backward keeps for W). Read off the rank's compute order
    alone, O(m v); zb-v's and interleaved-zb's (in whole rounds) repeat once the pipeline is full, so their
    peaks are those of their first 4 pp / 3 pp microbatches (tests/test_schedule.py checks against the full
    lists), which keeps the cut search's cost flat in m.

    >>> chunk_peaks("interleaved-zb", pp=2, num_microbatches=4, interleave=2, rank=1)
    ((4, 2), (2, 2))
    """
    _check_kind_and_sizes(kind, pp, num_microbatches, interleave)
    m = num_microbatches
    if kind == "zb-v":
        m = min(m, 4 * pp)
    elif kind == "interleaved-zb" and m % pp == 0:
        m = min(m, 3 * pp)
    return _chunk_peaks(kind, pp, m, interleave, rank)


@functools.lru_cache(maxsize=4096)
def _chunk_peaks(kind: str, pp: int, m: int, interleave: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    order = {"gpipe": _gpipe_order, "1f1b": _one_f_one_b_order, "interleaved-1f1b": _interleaved_order,
             "zb-h1": _zb_h1_order, "zb-v": _zb_v_order, "interleaved-zb": _interleaved_zb_order,
             "dualpipe-v": _dualpipe_v_order}[kind]
    local = tuple(s for s in range(pp * interleave) if stage_rank(kind, pp, s) == rank)
    live, held = dict.fromkeys(local, 0), dict.fromkeys(local, 0)
    peak_live, peak_held = dict(live), dict(held)
    for a in order(pp, m, interleave, rank):
        if a.op is Op.F:
            live[a.stage] += 1
            peak_live[a.stage] = max(peak_live[a.stage], live[a.stage])
        elif a.op is Op.I:
            held[a.stage] += 1
            peak_held[a.stage] = max(peak_held[a.stage], held[a.stage])
        elif a.op is Op.W:
            live[a.stage] -= 1
            held[a.stage] -= 1
        elif a.op is Op.B:
            live[a.stage] -= 1
    return tuple(peak_live[s] for s in local), tuple(peak_held[s] for s in local)


def _add_p2p(order: list[Action], *, rank: int, pp: int, num_stages: int,
             rank_of: Callable[[int], int]) -> list[Action]:
    """A RECV right before each compute whose input lives on another rank, a
    SEND right after each compute whose output another rank needs."""
    def remote(stage: int) -> bool:
        return 0 <= stage < num_stages and rank_of(stage) != rank

    out = []
    for a in order:
        s, mb = a.stage, a.microbatch
        if a.op is Op.W:   # weight gradients stay on the rank
            out.append(a)
            continue
        src, dst = (s - 1, s + 1) if a.op is Op.F else (s + 1, s - 1)
        recv, send = (Op.RECV_F, Op.SEND_F) if a.op is Op.F else (Op.RECV_B, Op.SEND_B)
        if remote(src):
            out.append(Action(op=recv, stage=s, microbatch=mb))
        out.append(a)
        if remote(dst):
            out.append(Action(op=send, stage=s, microbatch=mb))
    return out


def _add_grad_sync(actions: list[Action]) -> list[Action]:
    """GRAD_SYNC of a stage right after its last backward B or W, the last
    action that adds to its weight gradients (and after that B's SEND_B, so
    the gradient the previous stage waits for leaves first)."""
    last_b = {a.stage: i for i, a in enumerate(actions) if a.op in _GRAD_DONE}
    after = {}
    for stage, i in last_b.items():
        nxt = actions[i + 1] if i + 1 < len(actions) else None
        sent = nxt is not None and nxt.op is Op.SEND_B and nxt.stage == stage
        after[i + 1 if sent else i] = stage
    out = []
    for i, a in enumerate(actions):
        out.append(a)
        if i in after:
            out.append(Action(op=Op.GRAD_SYNC, stage=after[i]))
    return out


def _add_optim(actions: list[Action]) -> list[Action]:
    """OPTIM of each stage at the end, in the order the gradient syncs were
    issued, so the first-reduced stage steps while later syncs still run."""
    return actions + [Action(op=Op.OPTIM, stage=a.stage) for a in actions if a.op is Op.GRAD_SYNC]


def add_unshard_reshard(schedule: Schedule, *, zero_stage: int) -> Schedule:
    """The lists with the ZeRO parameter collectives as actions, as the runtime runs them.

    One data-parallel engine serves all of a pipeline rank's virtual stages,
    so each rank gets each action once, named after the stage where it falls:
      ZeRO-1/2: UNSHARD at the end, after the last OPTIM: the updated
          parameter shards all-gathered into the replicated parameters the
          next forward reads.
      ZeRO-3: UNSHARD first, before any receive: the first unit of the
          forward is all-gathered (prefetched) while the rank waits for its
          input; the other units are gathered inside F and B, one ahead,
          as each module needs them (FSDP's hooks, as in torch's pipelining,
          whose UNSHARD also gathers the root only). RESHARD right after the
          rank's last GRAD_SYNC frees any unit still gathered.
      DDP (zero_stage 0): nothing to add; GRAD_SYNC is the whole of it.
    The gradient reductions themselves stay GRAD_SYNC (torch's REDUCE_GRAD):
    the rank's last B launches them bucket by bucket as its gradients fill
    (the overlap with backward), and GRAD_SYNC waits for them.

    >>> s = build_schedule("1f1b", pp=2, num_microbatches=2)
    >>> print(add_unshard_reshard(s, zero_stage=3))
    schedule kind=1f1b pp=2 num_microbatches=2 interleave=1
    rank 0: 0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0GRAD_SYNC 0RESHARD 0OPTIM
    rank 1: 1UNSHARD 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1GRAD_SYNC 1RESHARD 1OPTIM
    >>> " ".join(map(str, add_unshard_reshard(s, zero_stage=1).ranks[0][-3:]))
    '0GRAD_SYNC 0OPTIM 0UNSHARD'
    """
    if zero_stage not in (0, 1, 2, 3):
        raise DeclarationError(f"zero_stage={zero_stage!r} must be 0 (DDP), 1, 2 or 3")
    if any(a.op in DP_OPS for actions in schedule.ranks for a in actions):
        raise PartitionerError("this schedule already holds UNSHARD / RESHARD actions: lower it once")
    ranks = []
    for actions in schedule.ranks:
        out = list(actions)
        if zero_stage in (1, 2):
            last = next(a for a in reversed(out) if a.op is Op.OPTIM)
            out.append(Action(op=Op.UNSHARD, stage=last.stage))
        elif zero_stage == 3:
            first = next(a for a in out if a.op is Op.F)
            i = max(i for i, a in enumerate(out) if a.op is Op.GRAD_SYNC)
            out.insert(i + 1, Action(op=Op.RESHARD, stage=out[i].stage))
            out.insert(0, Action(op=Op.UNSHARD, stage=first.stage))
        ranks.append(tuple(out))
    return dataclasses.replace(schedule, ranks=tuple(ranks))


# --- checking ---------------------------------------------------------------
def peak_inflight(schedule: Schedule) -> tuple[int, ...]:
    """Per virtual stage, the most microbatches whose forward is done and
    backward not yet: the activations that stage holds at its peak.

    GPipe: m. 1F1B: min(m, pp - stage). ZB-H1: min(m, pp), the
    activations kept until W. Read off the program order (one stage's
    actions all run on one rank, in order), so no timing is needed.

    >>> peak_inflight(build_schedule("1f1b", pp=4, num_microbatches=8))
    (4, 3, 2, 1)
    >>> peak_inflight(build_schedule("zb-h1", pp=4, num_microbatches=8))
    (4, 4, 4, 4)
    """
    live = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    for actions in schedule.ranks:
        for a in actions:
            if a.op is Op.F:
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.op in _GRAD_DONE:
                live[a.stage] -= 1
    return tuple(peak)


def validate(schedule: Schedule) -> None:
    """Raise PartitionerError (a ValueError) unless `schedule` is runnable.

    Checks: every action's stage lives on its rank; every (stage,
    microbatch) has exactly one F and either one B or one I and one W,
    F before B (or I) and I before W; the forward input of
    stage v + 1 comes after stage v's forward (program order on one rank, or
    SEND_F after the F and a matching RECV_F before the consumer's F on the
    other rank), likewise gradients backwards (B or I); no send or receive without
    its peer, none between stages on the same rank; one GRAD_SYNC per stage
    after its last B or W, one OPTIM per stage after its GRAD_SYNC; at most one
    UNSHARD per stage, before its first F or after its OPTIM, and at most one
    RESHARD, after its last B; and, running
    the lists with non-blocking sends and blocking receives, no deadlock.
    The message shows the rank's list with the failing action marked
    `<-- ERROR HERE`.

    >>> validate(build_schedule("interleaved-1f1b", pp=4, num_microbatches=8, interleave=2))
    """
    S, m, pp = schedule.num_stages, schedule.num_microbatches, schedule.pp
    where: dict[_Key, tuple[int, int]] = {}   # action -> (rank, step)

    def fail(rank: int, step: int, what: str) -> NoReturn:
        raise PartitionerError(f"invalid pipeline schedule: {what}\n"
                               + _format_rank(schedule, rank, step))

    def rank_of(stage: int) -> int:
        return stage_rank(schedule.kind, pp, stage)

    def anchor(stage: int) -> tuple[int, int]:   # where to point when an action is missing
        return rank_of(stage), len(schedule.ranks[rank_of(stage)]) - 1

    for r, actions in enumerate(schedule.ranks):
        for i, a in enumerate(actions):
            if a.stage >= S:
                fail(r, i, f"{a} names stage {a.stage}, but the schedule has stages 0..{S - 1}")
            if rank_of(a.stage) != r:
                fail(r, i, f"{a} runs on rank {r}, but stage {a.stage} lives on rank "
                           f"{rank_of(a.stage)} ({'its V' if schedule.kind in V_SHAPED else 'stage % pp'})")
            if a.microbatch is not None and a.microbatch >= m:
                fail(r, i, f"{a} names microbatch {a.microbatch}, but the schedule has "
                           f"microbatches 0..{m - 1}")
            key = _key(a)
            if key in where:
                fail(r, i, f"{a} appears twice on rank {r} (first at step {where[key][1]})")
            where[key] = (r, i)

    def input_grad(s: int, mb: int) -> _Key:   # the backward that yields the input gradient: B or I
        return ("B", s, mb) if ("B", s, mb) in where else ("I", s, mb)

    def grads_done(s: int, mb: int) -> _Key:   # the backward that completes the weight gradients: B or W
        return ("B", s, mb) if ("B", s, mb) in where else ("W", s, mb)

    for s in range(S):
        for mb in range(m):
            f, b = where.get(("F", s, mb)), where.get(("B", s, mb))
            i, w = where.get(("I", s, mb)), where.get(("W", s, mb))
            if f is None:
                fail(*anchor(s), f"no {s}F{mb}: every stage runs the forward of every microbatch once")
            if b is not None and (i or w):
                fail(*(i or w), f"{s}B{mb} is the whole backward of microbatch {mb}, so it cannot also be split "
                                f"into {s}I{mb} / {s}W{mb}: keep either the B or the I and W")
            if b is None and i is None and w is None:
                fail(*anchor(s), f"no {s}B{mb} (or {s}I{mb} and {s}W{mb}): every stage runs the backward of every "
                                 f"microbatch once")
            if b is None and i is None:
                fail(*w, f"{s}W{mb} has no {s}I{mb}: a split backward runs the input gradient I, then W")
            if b is None and w is None:
                fail(*i, f"{s}I{mb} has no {s}W{mb}: without it stage {s}'s weight gradients miss microbatch {mb}")
            first = b or i
            if first[1] < f[1]:
                fail(*first, f"{_text(input_grad(s, mb))} comes before its forward {s}F{mb}")
            if w is not None and w[1] < i[1]:
                fail(*w, f"{s}W{mb} comes before {s}I{mb}: W reuses the gradients I computes, so put it after")
    for s in range(S - 1):   # every stage has its computes now: check what flows between them
        for mb in range(m):
            _check_edge(schedule, where, fail, ("F", s, mb), ("F", s + 1, mb))
            _check_edge(schedule, where, fail, input_grad(s + 1, mb), input_grad(s, mb))
    for s in range(S):
        last_b = max(where[grads_done(s, mb)][1] for mb in range(m))
        sync, optim = where.get(("GRAD_SYNC", s, None)), where.get(("OPTIM", s, None))
        if sync is None:
            fail(*anchor(s), f"no {s}GRAD_SYNC: add it after stage {s}'s last backward")
        if sync[1] < last_b:
            fail(*sync, f"{s}GRAD_SYNC comes before stage {s}'s last backward "
                        f"{schedule.ranks[sync[0]][last_b]}; its gradients are not complete yet")
        if optim is None:
            fail(*anchor(s), f"no {s}OPTIM: add it after {s}GRAD_SYNC")
        if optim[1] < sync[1]:
            fail(*optim, f"{s}OPTIM comes before {s}GRAD_SYNC; the step would use unreduced gradients")
        first_f = min(where[("F", s, mb)][1] for mb in range(m))
        unshard, reshard = where.get(("UNSHARD", s, None)), where.get(("RESHARD", s, None))
        if unshard is not None and first_f < unshard[1] < optim[1]:
            fail(*unshard, f"{s}UNSHARD falls inside stage {s}'s step: put it before its first forward "
                           f"(ZeRO-3's prefetch) or after {s}OPTIM (ZeRO-1/2's gather of the updated shards)")
        if reshard is not None and reshard[1] < last_b:
            fail(*reshard, f"{s}RESHARD comes before stage {s}'s last backward, which still needs the "
                           f"parameters; put it after {schedule.ranks[reshard[0]][last_b]}")

    for key, (r, i) in where.items():
        if key[0] in PEER:
            peer = _peer_key(key)
            if not 0 <= peer[1] < S or rank_of(peer[1]) == r:
                fail(r, i, f"{_text(key)} has no peer on another rank: sends and receives only "
                           f"cross between consecutive stages on different ranks")
            if peer not in where:
                fail(r, i, f"{_text(key)} has no matching {_text(peer)} on rank {rank_of(peer[1])}")
    _check_deadlock(schedule)


# validate works on (op spelling, stage, microbatch) keys: tuples of str and
# int hash far faster than Actions (Enum's __hash__ is Python code), and
# schedules reach 10^5 actions.
_Key = tuple[str, int, "int | None"]
_LINK = {"F": ("SEND_F", "RECV_F"), "B": ("SEND_B", "RECV_B"), "I": ("SEND_B", "RECV_B")}
_GRAD_DONE = frozenset({Op.B, Op.W})   # the actions after which a microbatch's weight gradients are complete


def _key(a: Action) -> _Key:
    return (a.op._value_, a.stage, a.microbatch)


def _peer_key(key: _Key) -> _Key:
    op, shift = PEER[key[0]]
    return (op, key[1] + shift, key[2])


def _text(key: _Key) -> str:
    return f"{key[1]}{key[0]}{'' if key[2] is None else key[2]}"


def _check_edge(schedule: Schedule, where: dict[_Key, tuple[int, int]],
                fail: Callable[[int, int, str], NoReturn], producer: _Key, consumer: _Key) -> None:
    """The consumer compute runs after the producer: same rank, program
    order; else SEND after the producer and RECV before the consumer."""
    (pr, pi), (cr, ci) = where[producer], where[consumer]
    if pr == cr:
        if ci < pi:
            fail(cr, ci, f"{_text(consumer)} needs the output of {_text(producer)}, which comes "
                         f"later on this rank")
        return
    send_op, recv_op = _LINK[producer[0]]
    send, recv = (send_op, producer[1], producer[2]), (recv_op, consumer[1], consumer[2])
    if send not in where:
        fail(pr, pi, f"{_text(producer)} feeds {_text(consumer)} on rank {cr}, but rank {pr} "
                     f"never sends it: add {_text(send)} after {_text(producer)}")
    if recv not in where:
        fail(cr, ci, f"{_text(consumer)} needs {_text(producer)} from rank {pr}, but rank {cr} "
                     f"never receives it: add {_text(recv)} before {_text(consumer)}")
    if where[send][1] < pi:
        fail(pr, where[send][1], f"{_text(send)} comes before {_text(producer)}, which computes "
                                 f"what it sends")
    if where[recv][1] > ci:
        fail(cr, ci, f"{_text(consumer)} runs before {_text(recv)} delivers its input")


def _check_deadlock(schedule: Schedule) -> None:
    """Run the lists with non-blocking sends and blocking receives; fail at a
    receive that waits forever, following the chain of waiting ranks."""
    pc = [0] * schedule.pp
    sent: set[_Key] = set()                  # sends issued so far
    waiting: dict[_Key, int] = {}            # send awaited -> the rank waiting for it
    ready = collections.deque(range(schedule.pp))
    while ready:
        r = ready.popleft()
        actions = schedule.ranks[r]
        while pc[r] < len(actions):
            a = actions[pc[r]]
            op = a.op._value_
            if op == "RECV_F" or op == "RECV_B":
                send = _peer_key(_key(a))
                if send not in sent:
                    waiting[send] = r
                    break
            elif op == "SEND_F" or op == "SEND_B":
                key = _key(a)
                sent.add(key)
                if key in waiting:
                    ready.append(waiting.pop(key))
            pc[r] += 1
    blocked = [r for r in range(schedule.pp) if pc[r] < len(schedule.ranks[r])]
    if not blocked:
        return
    chain, r = [], blocked[0]
    while r not in chain:     # each blocked rank waits on a send of a rank that is blocked too
        chain.append(r)
        r = stage_rank(schedule.kind, schedule.pp, _peer_key(_key(schedule.ranks[r][pc[r]]))[1])
    cycle = chain[chain.index(r):]
    waits = ", ".join(f"rank {q} waits at {schedule.ranks[q][pc[q]]} for "
                      f"{_text(_peer_key(_key(schedule.ranks[q][pc[q]])))}" for q in cycle)
    listings = "\n".join(_format_rank(schedule, q, pc[q]) for q in cycle)
    raise PartitionerError(
        f"invalid pipeline schedule: deadlock: {waits}, and each awaited send comes after its "
        f"rank's blocked receive. Sends do not block and receives do, so move the send ahead of "
        f"the receive on one of these ranks\n{listings}")


_WINDOW = 12   # actions shown either side of the marked one in error messages


def _format_rank(schedule: Schedule, rank: int, index: int) -> str:
    actions = schedule.ranks[rank]
    if not actions:
        return f"rank {rank}: no actions  <-- ERROR HERE"
    lo, hi = max(0, index - _WINDOW), min(len(actions), index + _WINDOW + 1)
    width = len(str(len(actions) - 1))
    lines = [f"rank {rank} ({len(actions)} actions):"]
    if lo > 0:
        lines.append(f"  ... {lo} earlier actions")
    for i in range(lo, hi):
        mark = "  <-- ERROR HERE" if i == index else ""
        lines.append(f"  step {i:0{width}d}: {actions[i]}{mark}")
    if hi < len(actions):
        lines.append(f"  ... {len(actions) - hi} later actions")
    return "\n".join(lines)


def _format_table(schedule: Schedule) -> str:
    columns = [[str(a) for a in actions] for actions in schedule.ranks]
    steps = max((len(c) for c in columns), default=0)
    width = [max([len(f"rank {r}")] + [len(t) for t in c]) for r, c in enumerate(columns)]
    label = len(str(max(steps - 1, 0)))
    rows = [" " * (label + 7) + "  ".join(f"rank {r}".ljust(width[r]) for r in range(schedule.pp))]
    for i in range(steps):
        cells = [(c[i] if i < len(c) else "").ljust(width[r]) for r, c in enumerate(columns)]
        rows.append(f"step {i:0{label}d}: " + "  ".join(cells))
    return "\n".join(row.rstrip() for row in rows)

