"""Every collective the emitted programs issue goes through here.

One thin module over torch.distributed (c10d) so that (a) torch 2.13's
renames (`reduce_scatter_tensor` -> `reduce_scatter_single`,
`all_gather_into_tensor` -> `all_gather_single`) live in one place, (b)
Gloo's gaps are handled once (no PREMUL_SUM; all-gather needs equal shards),
and (c) each call is counted, so tests compare the collectives a step issues
with the plan's instruction lists.

`Collectives.counts` maps an op name ("all_reduce", "reduce_scatter",
"all_gather", "all_to_all" (even, or uneven with split sizes), "broadcast", "send", "recv", "barrier") to calls made;
`Collectives.bytes` to bytes passed (the full buffer of a collective, the
tensor of a send or receive); `Collectives.seconds` to the wall time spent inside the blocking
all-to-alls (expert parallelism's dispatch and combine, Ulysses' exchanges: waiting for the slowest peer
included), for the share of a step they take (bench/moe.py). Other ops are not timed: most run
asynchronously, overlapped with the backward.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Literal

import torch
import torch.distributed as dist

__all__ = ["Collectives", "ReduceScatterImpl"]

ReduceScatterImpl = Literal["reduce_scatter", "all_reduce_slice"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclasses.dataclass
class Collectives:
    """Counting wrappers; `group=None` is the default (world) group.

    reduce_scatter_impl: Gloo's reduce-scatter is slower than all-reduce of the same buffer (96 vs 58 ms
    for 16M floats on 2 ranks:
    docs/torch-notes.md#gloo-collective-timings-reduce-scatter-is-slower-than-all-reduce), so the plan may
    choose "all_reduce_slice": all-reduce, then keep this rank's slice.
    """

    reduce_scatter_impl: ReduceScatterImpl = "reduce_scatter"
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    seconds: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def _timed(self, op: str, async_op: bool, fn, *args, **kwargs):
        if async_op:
            return fn(*args, async_op=True, **kwargs)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[op] += time.perf_counter() - t0
        return out

    def _count(self, op: str, t: torch.Tensor) -> None:
        self.counts[op] += 1
        self.bytes[op] += t.numel() * t.element_size()

    def reset(self) -> None:
        self.counts.clear()
        self.bytes.clear()
        self.seconds.clear()

    # ---- reductions -------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, group=None, *, op: Literal["sum", "avg", "max"] = "sum",
                   async_op: bool = False):
        """In place. "avg" divides after summing: Gloo has no PREMUL_SUM and AVG is not on every backend."""
        self._count("all_reduce", t)
        red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        work = dist.all_reduce(t, op=red, group=group, async_op=async_op)
        if op == "avg":
            n = dist.get_world_size(group)
            if async_op:
                return _Then(work, lambda: t.div_(n))
            t.div_(n)
        return work

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group=None, *, op: Literal["sum", "avg"] = "sum",
                       async_op: bool = False):
        """out (n/p elements) = this rank's slice of the sum over ranks of inp (n elements, n % p == 0)."""
        p = dist.get_world_size(group)
        assert inp.numel() == out.numel() * p, f"reduce_scatter: input {inp.numel()} != {p} x output {out.numel()}"
        self._count("reduce_scatter", inp)
        if self.reduce_scatter_impl == "all_reduce_slice":
            r = dist.get_rank(group)
            buf = inp.clone()
            dist.all_reduce(buf, group=group)
            out.copy_(buf.view(p, -1)[r].view_as(out))
            work = None
        else:
            work = _reduce_scatter(out, inp, group=group, async_op=async_op)
        if op == "avg":
            if work is not None and async_op:
                return _Then(work, lambda: out.div_(p))
            out.div_(p)
        return work

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group=None, *, async_op: bool = False):
        """out (p * n elements) = concatenation of every rank's inp (n elements each: pad shards to equal size)."""
        p = dist.get_world_size(group)
        assert out.numel() == inp.numel() * p, f"all_gather: output {out.numel()} != {p} x input {inp.numel()}"
        self._count("all_gather", out)
        return _all_gather(out, inp, group=group, async_op=async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group=None, *, async_op: bool = False):
        """Chunk j of inp (p equal chunks along dim 0) goes to rank j; out's chunk i came from rank i."""
        p = dist.get_world_size(group)
        assert inp.shape[0] % p == 0 and out.shape == inp.shape, \
            f"all_to_all: {tuple(inp.shape)} -> {tuple(out.shape)} with {p} ranks: equal chunks, equal shapes"
        self._count("all_to_all", inp)
        return self._timed("all_to_all", async_op, dist.all_to_all_single, out, inp, group=group)

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], group=None, *, async_op: bool = False):
        """Uneven all-to-all along dim 0: rows input_split_sizes[j] of inp go to rank j, and out's
        output_split_sizes[i] rows came from rank i (expert parallelism's token dispatch). Counted as an
        "all_to_all", its bytes those this rank sends."""
        p = dist.get_world_size(group)
        if len(input_split_sizes) != p or len(output_split_sizes) != p:
            raise ValueError(f"all_to_all_single: {len(input_split_sizes)} input and {len(output_split_sizes)} output "
                             f"split sizes for a group of {p} ranks: give one size per rank")
        if sum(input_split_sizes) != inp.shape[0] or sum(output_split_sizes) != out.shape[0]:
            raise ValueError(f"all_to_all_single: input splits {list(input_split_sizes)} (sum "
                             f"{sum(input_split_sizes)}) for {inp.shape[0]} rows, output splits "
                             f"{list(output_split_sizes)} (sum {sum(output_split_sizes)}) for {out.shape[0]} rows: "
                             f"the splits must sum to the rows of their tensor")
        self._count("all_to_all", inp)
        return self._timed("all_to_all", async_op, dist.all_to_all_single, out, inp,
                           output_split_sizes=list(output_split_sizes), input_split_sizes=list(input_split_sizes),
                           group=group)

    def broadcast(self, t: torch.Tensor, src: int, group=None, *, async_op: bool = False):
        """`src` is a global rank."""
        self._count("broadcast", t)
        return dist.broadcast(t, src=src, group=group, async_op=async_op)

    @torch.no_grad()
    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int, group=None) -> None:
        """Overwrite `tensors` in place with `src`'s, in one broadcast per dtype (a replica's start-up state)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype, ts in by_dtype.items():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            wire = flat.view(torch.uint8) if dtype == torch.bool else flat  # Gloo has no bool
            self.broadcast(wire, src=src, group=group)
            for t, piece in zip(ts, torch.split(flat, [t.numel() for t in ts])):
                t.copy_(piece.view_as(t))

    # ---- point to point -----------------------------------------------------
    def send(self, t: torch.Tensor, dst: int, *, tag: int, group=None):
        """Gloo matches messages by (source, tag) only: every (stage, microbatch, direction) needs its own tag."""
        self._count("send", t)
        return dist.isend(t, dst=dst, tag=tag, group=group)

    def recv(self, t: torch.Tensor, src: int, *, tag: int, group=None):
        self._count("recv", t)
        return dist.irecv(t, src=src, tag=tag, group=group)

    def barrier(self, group=None) -> None:
        self.counts["barrier"] += 1
        dist.barrier(group=group)


class _Then:
    """A Work handle that runs a finishing step (the division of an average) after wait()."""

    def __init__(self, work, then):
        self._work, self._then, self._done = work, then, False

    def wait(self, *args, **kwargs):
        if self._done:
            return True
        ok = self._work.wait(*args, **kwargs)
        self._then()
        self._done = True
        return ok

    def is_completed(self) -> bool:
        return self._work.is_completed()
