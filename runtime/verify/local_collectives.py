"""A tensor-parallel group inside one process: one Python thread per tensor slice, no torch.distributed.

`plan.verify` (runtime.verify.check) runs every tensor slice of a stage in its own
thread of one process, with no process group. The generated code calls the
same `runtime.pipeline.tensor_parallel` functions as in training; those call the
`Collectives` methods with the group they were given. With a `LocalGroup`
and one `LocalCollectives` per slice, the collectives meet in memory:

    group = LocalGroup(2)
    # thread t (t = 0, 1):
    t_ = torch.full((2,), float(t + 1))
    LocalCollectives(rank=t).all_reduce(t_, group)      # both threads: tensor([3., 3.])

Sums run in rank order (rank 0 + 1 + ...), so results are deterministic.
Every call checks that all slices issue the same collective on tensors of the
same shape: slices issuing different collectives (a program edited for one
slice only) stop with a `LocalCollectiveError` naming both calls, rather
than pairing unrelated tensors. A slice that raises or finishes while its
peers wait in a collective breaks the group, so no thread waits for ever.
"""

from __future__ import annotations

import collections
import threading
from typing import Literal

import torch

from cost_models.errors import PartitionerError

__all__ = ["LocalCollectiveError", "LocalCollectives", "LocalGroup"]


class LocalCollectiveError(PartitionerError):
    """The tensor slices of an in-process group did not issue the same collectives."""


class LocalGroup:
    """The meeting point of `world` threads: each collective is an exchange of one tensor per slice.

    `local_world_size` is what `runtime.comm.groups.group_size` asks of a group that is not a c10d one.
    """

    def __init__(self, world: int, *, timeout_s: float = 120.0):
        if world < 1:
            raise ValueError(f"LocalGroup of {world} slices: needs at least 1")
        self.local_world_size = world
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._slots: dict[int, tuple[str, torch.Tensor]] = {}
        self._result: list[torch.Tensor] = []
        self._generation = 0  # collectives completed
        self._broken: str | None = None
        self._left: set[int] = set()

    def reset(self) -> None:
        """Ready for a new run of every slice (after one that finished or broke)."""
        with self._cond:
            self._slots, self._result, self._broken, self._left = {}, [], None, set()

    def exchange(self, rank: int, what: str, t: torch.Tensor) -> list[torch.Tensor]:
        """Every slice's `t` (a copy, in rank order) once all have called with the same `what`."""
        with self._cond:
            self._check(rank, what)
            gen = self._generation
            # a copy: a slice may write its result into its own tensor while a peer still reads it
            self._slots[rank] = (what, t.detach().clone())
            if len(self._slots) == self.local_world_size:
                calls = {r: w for r, (w, _) in self._slots.items()}
                if len(set(calls.values())) > 1:
                    self._break("the tensor slices issued different collectives as call "
                                f"#{gen + 1}: " + "; ".join(f"slice {r}: {w}" for r, w in sorted(calls.items())))
                    self._check(rank, what)
                self._result = [self._slots[r][1] for r in range(self.local_world_size)]
                self._slots = {}
                self._generation += 1
                self._cond.notify_all()
            else:
                while self._generation == gen and self._broken is None:
                    if not self._cond.wait(self.timeout_s):
                        self._break(f"slice {rank} waited {self.timeout_s:g} s in {what} (call #{gen + 1}) for "
                                    f"slices {sorted(set(range(self.local_world_size)) - set(self._slots))}")
                if self._generation == gen:
                    self._check(rank, what)
            # the next exchange cannot complete before this slice has read this one's result
            return list(self._result)

    def leave(self, rank: int, error: BaseException | None = None) -> None:
        """Slice `rank` is done (or failed): peers waiting in a collective stop instead of hanging."""
        with self._cond:
            self._left.add(rank)
            if self._slots and self._broken is None:
                waiting = ", ".join(f"slice {r} in {w}" for r, (w, _) in sorted(self._slots.items()))
                how = f"raised {type(error).__name__}" if error is not None else "finished"
                self._break(f"slice {rank} {how} while {waiting} waited for it (call #{self._generation + 1}): "
                            "the slices do not issue the same collectives")
            self._cond.notify_all()

    def _break(self, why: str) -> None:
        self._broken = why
        self._cond.notify_all()

    def _check(self, rank: int, what: str) -> None:
        if self._broken is not None:
            raise LocalCollectiveError(f"in-process tensor group broken: {self._broken}")
        gone = sorted(self._left - {rank})
        if gone:
            self._break(f"slice {rank} calls {what} (call #{self._generation + 1}) after slices {gone} finished: "
                        "the slices do not issue the same collectives")
            raise LocalCollectiveError(f"in-process tensor group broken: {self._broken}")


class _Done:
    """The handle of an async call: the work is already done."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class LocalCollectives:
    """`runtime.comm.collectives.Collectives`' tensor-parallel methods over a `LocalGroup`, for slice `rank`.

    Counts calls and bytes as Collectives does (`counts`, `bytes`), so a test can compare them."""

    def __init__(self, rank: int):
        self.rank = rank
        self.counts: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()

    def _gather(self, op: str, t: torch.Tensor, group: LocalGroup, detail: str = "") -> list[torch.Tensor]:
        if not isinstance(group, LocalGroup):
            raise TypeError(f"LocalCollectives.{op}: group must be a LocalGroup, got {type(group).__name__}; "
                            "a c10d process group goes with runtime.comm.collectives.Collectives")
        self.counts[op] += 1
        self.bytes[op] += t.numel() * t.element_size()
        return group.exchange(self.rank, f"{op}{detail} of {tuple(t.shape)} {t.dtype}", t)

    @staticmethod
    def _reduce(values: list[torch.Tensor], op: str) -> torch.Tensor:
        out = values[0].clone()
        for v in values[1:]:  # rank order: deterministic
            out = torch.maximum(out, v) if op == "max" else out.add_(v)
        return out.div_(len(values)) if op == "avg" else out

    def all_reduce(self, t: torch.Tensor, group: LocalGroup, *, op: Literal["sum", "avg", "max"] = "sum",
                   async_op: bool = False):
        """In place, as c10d's."""
        values = self._gather("all_reduce", t, group, f"({op})")
        with torch.no_grad():
            t.copy_(self._reduce(values, op))
        return _Done() if async_op else None

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: LocalGroup, *,
                       op: Literal["sum", "avg"] = "sum", async_op: bool = False):
        """out = this slice's 1/p of the sum over slices of inp (flat, in rank order)."""
        p = group.local_world_size
        assert inp.numel() == out.numel() * p, f"reduce_scatter: input {inp.numel()} != {p} x output {out.numel()}"
        values = self._gather("reduce_scatter", inp, group, f"({op})")
        with torch.no_grad():
            out.copy_(self._reduce(values, op).reshape(p, -1)[self.rank].view_as(out))
        return _Done() if async_op else None

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: LocalGroup, *, async_op: bool = False):
        """out = every slice's inp concatenated (flat, in rank order), as all_gather_into_tensor."""
        p = group.local_world_size
        assert out.numel() == inp.numel() * p, f"all_gather: output {out.numel()} != {p} x input {inp.numel()}"
        values = self._gather("all_gather", inp, group)
        with torch.no_grad():
            out.copy_(torch.cat([v.reshape(-1) for v in values]).view_as(out))
        return _Done() if async_op else None
