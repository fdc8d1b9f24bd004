"""The values a pipeline cut hands on, as one tensor.

Where more than the hidden state crosses the cuts between blocks (Zamba's input embeddings, HunYuan's top-k
indices: partitioner.codegen.segment_carry), a stage hands them all on as one message, so that the executor,
its schedules and the split backward move one tensor as ever.

The message is 1-D, in the hidden state's dtype: a header of int64 words (per value: its dtype's code, ndim
and sizes; code -1 for a value not written yet, None), stored bitwise; then each value in turn. A floating
value of the hidden state's dtype goes as itself, so its gradient comes back through the cut; any other (token
indices, a mask) goes bitwise, and has none.

>>> import torch
>>> x, idx = torch.randn(2, 3), torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
>>> y, none, i = unpack(pack([x, None, idx]), 3)
>>> bool((y == x).all()), none, bool((i == idx).all()), i.dtype
(True, None, True, torch.int32)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["pack", "unpack"]

_MAX_DIMS = 8
_WORDS = 2 + _MAX_DIMS  # per value: dtype code, ndim, sizes
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bits(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t's bytes as elements of `dtype`, zero-padded to a whole one."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % _size(dtype)
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(dtype)


def pack(values: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """One tensor holding `values` (the hidden state first), for `unpack` on the next stage."""
    x = values[0]
    if x is None or not x.is_floating_point():
        raise TypeError("pack: the first value is the hidden state, a floating-point tensor")
    words = torch.full((len(values), _WORDS), -1, dtype=torch.int64)
    parts = []
    for j, v in enumerate(values):
        if v is None:
            continue
        if v.dim() > _MAX_DIMS or v.dtype not in _DTYPES:
            raise TypeError(f"pack: value {j} ({v.dtype}, {v.dim()} dims) cannot cross a pipeline cut")
        words[j, 0], words[j, 1] = _DTYPES.index(v.dtype), v.dim()
        words[j, 2:2 + v.dim()] = torch.tensor(v.shape, dtype=torch.int64)
        if v.dtype == x.dtype:
            parts.append(v.reshape(-1))
        elif v.requires_grad:
            raise TypeError(f"pack: value {j} is {v.dtype} and needs a gradient, but the cut carries "
                            f"{x.dtype}: only values of the hidden state's dtype send their gradients back")
        else:
            parts.append(_bits(v, x.dtype))
    return torch.cat([_bits(words.to(x.device), x.dtype), *parts])


def unpack(packed: torch.Tensor, n: int) -> list[torch.Tensor | None]:
    """The `n` values `pack` put into `packed`: views of it for those of its dtype (a gradient flows back
    through them), copies for the others."""
    head = n * _WORDS * 8 // _size(packed.dtype)
    words = _bits(packed[:head], torch.int64).view(n, _WORDS).tolist()
    out: list[torch.Tensor | None] = []
    at = head
    for code, ndim, *dims in words:
        if code < 0:
            out.append(None)
            continue
        dtype, shape = _DTYPES[code], tuple(dims[:ndim])
        numel = math.prod(shape)
        if dtype == packed.dtype:
            out.append(packed[at:at + numel].view(shape))
            at += numel
            continue
        nbytes = numel * _size(dtype)
        k = -(-nbytes // _size(packed.dtype))
        out.append(_bits(packed[at:at + k], torch.uint8)[:nbytes].clone().view(dtype).view(shape))
        at += k
    if at != packed.numel():
        raise ValueError(f"unpack: {packed.numel()} elements received, {at} described by their header")
    return out
