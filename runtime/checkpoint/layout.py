"""Where a rank's pieces of a parameter sit in the full tensor: the geometry checkpoints are written in.

A rank holds parameter elements in two nested layouts: tensor parallelism
gives it a slice of the full tensor (`runtime.pipeline.tensor_parallel.shard_parameter`:
block `rank` of `world` along one dim, of every fused chunk), and ZeRO gives it
a contiguous range of that slice's flattening (`runtime.engines.flat.FlatLayout`). A
checkpoint must not depend on either, so that any other plan can read it: it
stores boxes (offsets, sizes) of the *full* tensor, as torch.distributed.checkpoint
(DCP) does for DTensor shards. A contiguous range of a row-major tensor is at
most 2 * ndim - 1 boxes, and a box of a tensor-parallel slice is at most
`fused` boxes of the full tensor, so the number of chunks stays small.

>>> range_boxes((4, 6), 2, 20)   # elements 2..19 of a 4 x 6 tensor
[Box(offsets=(0, 2), sizes=(1, 4)), Box(offsets=(1, 0), sizes=(2, 6)), Box(offsets=(3, 0), sizes=(1, 2))]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Box", "LocalBox", "full_shape", "local_to_full", "range_boxes"]


class Box(NamedTuple):
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Elements [start, stop) of a row-major tensor of `shape`, as boxes in flattening order."""
    shape = tuple(int(s) for s in shape)
    if start >= stop:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    rest = shape[1:]
    if r0 == r1:  # inside one row: recurse into it
        return [Box((r0, *b.offsets), (1, *b.sizes)) for b in range_boxes(rest, c0, c1)]
    out: list[Box] = []
    if c0:
        out += [Box((r0, *b.offsets), (1, *b.sizes)) for b in range_boxes(rest, c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(Box((r0, *(0,) * len(rest)), (r1 - r0, *rest)))
    if c1:
        out += [Box((r1, *b.offsets), (1, *b.sizes)) for b in range_boxes(rest, 0, c1)]
    return out


class LocalBox(NamedTuple):
    """A box of the full tensor and where its elements are in a rank's slice: `local` is the box in slice
    coordinates (same sizes)."""

    full: Box
    local: Box


def local_to_full(box: Box, local_shape: Sequence[int], spec_dim: int | None, tp_rank: int, tp_world: int,
                  fused: int = 1) -> list[LocalBox]:
    """A box of rank `tp_rank`'s tensor-parallel slice (`shard_parameter`'s layout, shape `local_shape`) as
    boxes of the full tensor.

    >>> local_to_full(Box((1,), (2,)), (4,), 0, tp_rank=1, tp_world=2, fused=2)   # slice [2, 3, 6, 7] of arange(8)
    [LocalBox(full=Box(offsets=(3,), sizes=(1,)), local=Box(offsets=(1,), sizes=(1,))), \
LocalBox(full=Box(offsets=(6,), sizes=(1,)), local=Box(offsets=(2,), sizes=(1,)))]
    """
    if spec_dim is None or tp_world == 1:
        return [LocalBox(box, box)]
    d = spec_dim
    # Along d the slice is `fused` runs of `run` rows; run j is the slice's rows [j * run, (j + 1) * run)
    # and the full tensor's rows [j * run * tp_world + tp_rank * run, ...).
    run = local_shape[d] // fused
    lo, hi = box.offsets[d], box.offsets[d] + box.sizes[d]
    out = []
    for j in range(lo // run, (hi - 1) // run + 1):
        a, b = max(lo, j * run), min(hi, (j + 1) * run)
        full_at = j * run * tp_world + tp_rank * run + (a - j * run)
        local = Box(_put(box.offsets, d, a), _put(box.sizes, d, b - a))
        out.append(LocalBox(Box(_put(box.offsets, d, full_at), local.sizes), local))
    return out


def full_shape(local_shape: Sequence[int], spec_dim: int | None, tp_world: int) -> tuple[int, ...]:
    """The full tensor's shape from a slice's."""
    return tuple(s * tp_world if i == spec_dim else s for i, s in enumerate(local_shape))


def _put(t: tuple[int, ...], i: int, v: int) -> tuple[int, ...]:
    return (*t[:i], v, *t[i + 1:])
