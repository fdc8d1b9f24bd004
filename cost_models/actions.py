"""The pipeline action vocabulary: what the planner writes into a schedule and the runtime executes.

One instruction of a pipeline rank is an `Action`: an `Op`, the virtual stage it belongs to and the
microbatch (none for the once-per-stage GRAD_SYNC, OPTIM, UNSHARD and RESHARD). Its text form is torch's
`_Action` spelling, `<stage><op><microbatch>`: `2F0`, `3SEND_B12`, `0GRAD_SYNC`, `1UNSHARD`;
`Action.parse` reads it back. A backward is either one `B` (input and weight gradients together) or,
in the zero-bubble schedules, split as torch splits it: `I` (the input gradient, which the previous
stage waits for) and a later `W` (the weight gradients, which nobody waits for, so they fill bubbles).

The data-parallel collectives are actions too (torch's pipelining lowers FSDP the same way, into
UNSHARD / RESHARD / REDUCE_GRAD): GRAD_SYNC is torch's REDUCE_GRAD, the gradient reduction over the
replicas completing; UNSHARD all-gathers parameters from their shards (ZeRO-1/2: the updated shards
after OPTIM; ZeRO-3: the first unit of the next forward, prefetched); RESHARD frees gathered ZeRO-3
parameters. `partitioner.planner.schedule.add_unshard_reshard` places them.
`partitioner.planner.schedule` builds lists of them; `runtime.pipeline.executor` runs the same lists
(`Action.of` accepts the text, an Action, or any object with .op/.stage/.microbatch).

>>> str(Action(op=Op.SEND_F, stage=2, microbatch=0))
'2SEND_F0'
>>> Action.parse("2GRAD_SYNC")
Action(op=<Op.GRAD_SYNC: 'GRAD_SYNC'>, stage=2, microbatch=None)
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any

from cost_models.errors import PartitionerError

__all__ = ["Op", "Action", "COMPUTE_OPS", "P2P_OPS", "STAGE_OPS", "DP_OPS", "PEER", "GRAMMAR"]


class Op(str, enum.Enum):
    """What one action does. Its value is its spelling in the compact string."""

    F = "F"                  # forward of one microbatch through one stage
    B = "B"                  # full backward (input and weight gradients)
    I = "I"                  # input-gradient half of a split backward (torch's BACKWARD_INPUT): feeds SEND_B
    W = "W"                  # weight-gradient half (torch's BACKWARD_WEIGHT): after its I, frees the microbatch
    SEND_F = "SEND_F"        # send this stage's output activation to stage + 1
    RECV_F = "RECV_F"        # receive this stage's input activation from stage - 1
    SEND_B = "SEND_B"        # send the gradient of this stage's input to stage - 1
    RECV_B = "RECV_B"        # receive the gradient of this stage's output from stage + 1
    GRAD_SYNC = "GRAD_SYNC"  # data-parallel reduction of this stage's gradients completes (torch's REDUCE_GRAD)
    OPTIM = "OPTIM"          # optimizer step of this stage's parameters
    UNSHARD = "UNSHARD"      # all-gather parameters from their data-parallel shards
    RESHARD = "RESHARD"      # free gathered parameters (ZeRO-3), no communication

    def __str__(self) -> str:
        return self.value


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.I, Op.W})
P2P_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})
STAGE_OPS = frozenset({Op.GRAD_SYNC, Op.OPTIM, Op.UNSHARD, Op.RESHARD})   # once per stage, no microbatch
DP_OPS = frozenset({Op.UNSHARD, Op.RESHARD})   # added by the data-parallel lowering; optional in a schedule

# a send or receive -> (the op at the other end, the other end's stage minus this one's)
PEER = {"SEND_F": ("RECV_F", 1), "RECV_F": ("SEND_F", -1), "SEND_B": ("RECV_B", -1), "RECV_B": ("SEND_B", 1)}

_OP_ALTERNATIVES = "|".join(sorted((op.value for op in Op), key=len, reverse=True))
_RE = re.compile(rf"(\d+)({_OP_ALTERNATIVES})(\d*)")
GRAMMAR = (
    "<stage><op><microbatch> with op one of F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B "
    "(e.g. '2F0', '1I3', '1W3', '3SEND_B12'), or <stage><op> with op GRAD_SYNC, OPTIM, UNSHARD or RESHARD "
    "(e.g. '2GRAD_SYNC', '0OPTIM', '1UNSHARD')")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Action:
    """One instruction of a pipeline rank, printed like torch's `_Action`.

    op: what to do.
    stage: the virtual stage it belongs to. For sends and receives it is the
        stage on *this* rank: `2SEND_F0` sends stage 2's output of
        microbatch 0 to stage 3; `3RECV_F0` is stage 3 receiving it;
        `3SEND_B0` sends stage 3's input gradient to stage 2; `2RECV_B0`
        receives it.
    microbatch: the microbatch index; None exactly for the stage ops (GRAD_SYNC, OPTIM, UNSHARD,
        RESHARD).

    >>> str(Action(op=Op.SEND_F, stage=2, microbatch=0))
    '2SEND_F0'
    >>> Action.parse("2GRAD_SYNC")
    Action(op=<Op.GRAD_SYNC: 'GRAD_SYNC'>, stage=2, microbatch=None)
    """

    op: Op
    stage: int
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.op, Op):
            raise PartitionerError(f"Action op={self.op!r} is not an Op; use one of "
                                   f"{', '.join('Op.' + o.name for o in Op)}")
        if not isinstance(self.stage, int) or self.stage < 0:
            raise PartitionerError(f"Action stage={self.stage!r} must be an int >= 0")
        if self.op in STAGE_OPS:
            if self.microbatch is not None:
                raise PartitionerError(f"{self.op.value} applies to a whole stage: pass "
                                       f"microbatch=None, not {self.microbatch!r}")
        elif not isinstance(self.microbatch, int) or self.microbatch < 0:
            raise PartitionerError(f"{self.op.value} needs microbatch=<int >= 0>, "
                                   f"got {self.microbatch!r}")

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else self.microbatch
        return f"{self.stage}{self.op._value_}{mb}"   # _value_: Enum's .value is a slow descriptor

    def peer(self, num_stages: int) -> Action | None:
        """For a send or receive, the action at the other end (None off the
        ends of the pipeline): `2SEND_F0` <-> `3RECV_F0`, `3SEND_B0` <-> `2RECV_B0`.

        >>> str(Action.parse("3RECV_F0").peer(4))
        '2SEND_F0'
        """
        if self.op not in P2P_OPS:
            raise PartitionerError(f"{self} is not a send or receive, so it has no peer")
        op, shift = PEER[self.op._value_]
        stage = self.stage + shift
        return Action(op=Op(op), stage=stage, microbatch=self.microbatch) if 0 <= stage < num_stages else None

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of `str`: `Action.parse("2SEND_F0")`."""
        match = _RE.fullmatch(text.strip())
        if match is None:
            raise PartitionerError(f"cannot parse pipeline action {text!r}: expected {GRAMMAR}")
        stage, op, mb = match.groups()
        op = Op(op)
        if (op in STAGE_OPS) != (mb == ""):
            raise PartitionerError(f"cannot parse pipeline action {text!r}: expected {GRAMMAR}")
        return cls(op=op, stage=int(stage), microbatch=int(mb) if mb else None)

    @classmethod
    def of(cls, action: Any) -> Action:
        """An Action from its text ("2SEND_F0"), or from any object with `.op` (an Op or its spelling),
        `.stage` and `.microbatch`: what the runtime accepts as an instruction list."""
        if isinstance(action, cls):
            return action
        if isinstance(action, str):
            return cls.parse(action)
        try:
            op, stage, mb = action.op, action.stage, action.microbatch
        except AttributeError:
            raise TypeError(f"pipeline action {action!r} is neither a string like '2F0' nor an object with "
                            ".op, .stage and .microbatch") from None
        try:
            return cls(op=Op(getattr(op, "value", op)), stage=stage, microbatch=mb)
        except (ValueError, PartitionerError) as exc:
            raise PartitionerError(f"pipeline action {action!r} is malformed ({exc}): expected {GRAMMAR}") from None
