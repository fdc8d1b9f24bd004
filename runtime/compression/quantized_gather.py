"""ZeRO-3 parameter all-gather with int8 blockwise-quantized shards (ZeRO++'s qwZ).

Each rank quantizes its fp32 master shard (`runtime.compression.quantize`, absmax per
block of 256, no residual: the weights are re-quantized from the exact
masters every time they are gathered, so nothing accumulates), the codes and
scales are all-gathered, and every rank dequantizes all of them into the
gathered buffer: 1 + 4/256 bytes per element on the wire instead of 2 (bf16)
or 4 (fp32). Every rank decodes the same bytes, so every replica computes
with the same weights, each within half a block scale of its master:
``|w - Q(w)| <= absmax(block) / 254``.

The forward and the backward of a unit gather the same master shard, so
they see the same quantized weights; the gradient is taken at Q(w) and
applied to w (the straight-through rule every weight-quantized trainer uses).

Inside a process group, as DataParallel does it for one unit (a group of one process here):

>>> import torch
>>> import torch.distributed as dist
>>> from runtime.comm.collectives import Collectives
>>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
>>> group = dist.group.WORLD
>>> shard = torch.linspace(-1, 1, 300)            # this rank's fp32 master shard
>>> full = torch.empty(dist.get_world_size(group) * shard.numel())
>>> h = quantized_all_gather(full, shard, group, Collectives(), async_op=True)
>>> h.wait()   # full now holds every rank's dequantized shard
>>> bool((full - shard).abs().max() <= 1 / 254)   # absmax(block) / 254, and absmax is 1 here
True
>>> dist.destroy_process_group()
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from cost_models.compression import QUANT_BLOCK
from runtime.comm.collectives import Collectives
from runtime.compression.quantize import Quantized, dequantize, quantize

__all__ = ["QuantizedGather", "gather_quantized", "quantized_all_gather"]


class QuantizedGather:
    """An all-gather of codes and scales in flight; `wait()` decodes them into the output buffer."""

    def __init__(self, out: torch.Tensor, works: list, codes: torch.Tensor, scales: torch.Tensor, q: Quantized, *,
                 world: int, shard: int, decode: Callable[[Quantized], torch.Tensor]):
        self._out, self._works, self._codes, self._scales, self._q = out, works, codes, scales, q
        self._world, self._shard, self._decode = world, shard, decode

    def wait(self) -> None:
        for w in self._works:
            if w is not None:
                w.wait()
        self._works = []
        padded = self._q.numel
        values = self._decode(Quantized(codes=self._codes, scales=self._scales, numel=self._world * padded,
                                        bits=self._q.bits, block=self._q.block))
        with torch.no_grad():
            self._out.view(self._world, self._shard).copy_(values.view(self._world, padded)[:, :self._shard])


def gather_quantized(out: torch.Tensor, q: Quantized, group, collectives: Collectives, *, shard: int,
                     async_op: bool = False,
                     decode: Callable[[Quantized], torch.Tensor] = dequantize) -> QuantizedGather | None:
    """All-gather every rank's `q` (its shard quantized, padded to whole blocks, the same size on every
    rank) and decode the first `shard` elements of each into `out` (world * shard elements). Returns
    the handle to wait on when async_op, else None (done)."""
    p = dist.get_world_size(group)
    if out.numel() != p * shard:
        raise ValueError(f"quantized all-gather: out has {out.numel()} elements, expected world {p} x shard {shard}")
    codes = torch.empty(p * q.codes.numel(), dtype=q.codes.dtype, device=q.codes.device)
    scales = torch.empty(p * q.scales.numel(), dtype=torch.float32, device=q.scales.device)
    works = [collectives.all_gather(codes, q.codes, group, async_op=async_op),
             collectives.all_gather(scales, q.scales, group, async_op=async_op)]
    h = QuantizedGather(out, works, codes, scales, q, world=p, shard=shard, decode=decode)
    if async_op:
        return h
    h.wait()
    return None


def quantized_all_gather(out: torch.Tensor, shard: torch.Tensor, group, collectives: Collectives, *,
                         bits: int = 8, block: int = QUANT_BLOCK, async_op: bool = False) -> QuantizedGather | None:
    """Gather every rank's `shard` (fp32, equal sizes) into `out` (world * shard elements, any float
    dtype), quantized on the wire. Returns the handle to wait on when async_op, else None (done)."""
    n = shard.numel()
    y = torch.zeros(max(1, math.ceil(n / block)) * block, device=shard.device)
    y[:n] = shard.detach().reshape(-1).float()
    q, _ = quantize(y, bits=bits, block=block)
    return gather_quantized(out, q, group, collectives, shard=n, async_op=async_op)
