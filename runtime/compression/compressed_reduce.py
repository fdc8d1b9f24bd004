"""Data-parallel reduction of int8/int4-quantized gradients, with error feedback on both sides.

A two-phase collective (the scheme of ZeRO++'s qgZ and 1-bit Adam's
compressed all-reduce), over p ranks, for a flat fp32 gradient of n elements
padded to p equal chunks of whole quantization blocks:

1. each rank adds its phase-1 residual, quantizes (`runtime.compression.quantize`,
   blockwise absmax), keeps the new residual, and sends chunk j of the codes
   and scales to rank j (one all-to-all of codes, one of scales);
2. rank j dequantizes the p pieces of its chunk, sums them in rank order in
   fp32, adds its phase-2 residual, re-quantizes, keeps that residual, and
   the owners' codes and scales are all-gathered; every rank dequantizes the
   same bytes, so every rank ends with a bitwise identical result.

Bytes each rank sends: about 2 n (b/8 + 4/block) against 2 n * 4 for a ring
all-reduce of fp32 (b = 8: 3.9x less at block 256).

Error. Without feedback, each element's error is at most the sum over ranks
of half its phase-1 block scale, plus half its phase-2 block scale (`bound`).
With feedback, what is not sent now is sent later: the residuals carry it,
so the error does not accumulate over steps. Residuals are kept per `key`
(a stable name of what is reduced, e.g. a parameter shard), and dropped with
a warning when the tensor's size or the group changes.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.distributed as dist

from cost_models.compression import QUANT_BLOCK
from runtime.comm.collectives import Collectives
from runtime.compression.quantize import Quantized
from runtime.compression.quantize import dequantize as _dequantize
from runtime.compression.quantize import quantize as _quantize
from runtime.compression.quantized_gather import gather_quantized
from runtime.device import rank_device

__all__ = ["CompressedReduce"]


def quantize(y: torch.Tensor, *, bits: int, block: int, residual: torch.Tensor | None):
    """runtime.compression.quantize's blockwise absmax codes (on CUDA tensors its Triton kernel,
    runtime.compression.quantize_triton: the torch ops are for CPU, where Triton only interprets); bits=1: each block's sign times its mean |y| (signSGD-like,
    one int8 per element here: a control for tests, not a compressor the planner offers)."""
    if bits != 1:
        if y.is_cuda and block & (block - 1) == 0:  # the fused kernel, bit for bit the torch reference
            from runtime.compression.quantize_triton import quantize_triton

            return quantize_triton(y, bits=bits, block=block, residual=residual)
        return _quantize(y, bits=bits, block=block, residual=residual)
    v = y if residual is None else y + residual
    blocks = v.view(-1, block)
    q = Quantized(codes=torch.sign(blocks).to(torch.int8).reshape(-1), scales=blocks.abs().mean(dim=1),
                  numel=v.numel(), bits=1, block=block)
    return q, None if residual is None else v - dequantize(q)


def dequantize(q: Quantized) -> torch.Tensor:
    if q.bits != 1:
        if q.scales.is_cuda and q.block & (q.block - 1) == 0:
            from runtime.compression.quantize_triton import dequantize_triton

            return dequantize_triton(q)
        return _dequantize(q)
    return (q.codes.view(-1, q.block).float() * q.scales.unsqueeze(1)).reshape(-1)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CompressedReduce:
    """`reduce(x, key)` -> the sum (or mean) over the group of every rank's x, int8/int4 on the wire."""

    group: object
    collectives: Collectives
    bits: int = 8
    block: int = QUANT_BLOCK
    feedback: bool = True
    residuals: dict = dataclasses.field(default_factory=dict)  # (key, phase) -> fp32 tensor

    def __post_init__(self) -> None:
        if self.bits not in (1, 4, 8):
            raise ValueError(f"bits={self.bits}: the compressed reduction sends int8 (8) or int4 (4) codes "
                             "(1: scaled sign, the negative control of the convergence tests)")
        if self.block < 2 or self.block % 2:
            raise ValueError(f"block={self.block}: blocks must hold an even number of elements (int4 packs pairs)")

    def _residual(self, key: str, phase: int, numel: int) -> torch.Tensor | None:
        if not self.feedback:
            return None
        r = self.residuals.get((key, phase))
        if r is not None and r.numel() != numel:
            log.warning("compressed reduce: residual of %r was for %d elements, now %d (world size or shard "
                        "changed): dropped, this step is sent without it", key, r.numel(), numel)
            r = None
        return torch.zeros(numel, device=rank_device()) if r is None else r

    @torch.no_grad()
    def reduce(self, x: torch.Tensor, key: str, *, op: str = "sum") -> torch.Tensor:
        """Phase 1 then phase 2: every rank ends with the same sum (or mean) of every rank's x."""
        p = dist.get_world_size(self.group)
        n = x.numel()
        chunk = max(1, math.ceil(n / (p * self.block))) * self.block
        y = torch.zeros(p * chunk, device=x.device)
        y[:n] = x.detach().reshape(-1).float()
        mine = self.reduce_scatter(y, key)
        del y  # a full fp32 copy: not held through phase 2, which allocates the gathered result
        out = self.all_gather(mine, key)[:n]
        if op == "avg":
            out /= p
        return out.view_as(x)

    @torch.no_grad()
    def reduce_scatter(self, y: torch.Tensor, key: str) -> torch.Tensor:
        """Phase 1: the sum over the group of chunk `me` of every rank's y (p equal chunks of y).

        Chunks that are not whole blocks are padded to whole blocks for the wire (ZeRO shards)."""
        p = dist.get_world_size(self.group)
        if y.numel() % p:
            raise ValueError(f"reduce_scatter of {y.numel()} elements over {p} ranks: pad to a multiple of {p}")
        c = y.numel() // p
        chunk = max(1, math.ceil(c / self.block)) * self.block
        if chunk != c:
            padded = torch.zeros(p, chunk, device=y.device)
            padded[:, :c] = y.detach().reshape(p, c)
            y = padded.view(-1)
        q, r1 = quantize(y.detach().reshape(-1).float(), bits=self.bits, block=self.block,
                         residual=self._residual(key, 1, y.numel()))
        if r1 is not None:
            self.residuals[(key, 1)] = r1
        per_codes, per_scales = q.codes.numel() // p, chunk // self.block
        codes, scales = torch.empty_like(q.codes), torch.empty_like(q.scales)
        self.collectives.all_to_all(codes, q.codes, self.group)
        self.collectives.all_to_all(scales, q.scales, self.group)
        mine = torch.zeros(chunk, device=codes.device)
        for i in range(p):  # rank order: the same sum on every owner, whatever arrived first
            mine += dequantize(Quantized(codes=codes[i * per_codes:(i + 1) * per_codes],
                                         scales=scales[i * per_scales:(i + 1) * per_scales],
                                         numel=chunk, bits=self.bits, block=self.block))
        return mine[:c]

    @torch.no_grad()
    def all_gather(self, mine: torch.Tensor, key: str) -> torch.Tensor:
        """Phase 2: re-quantize this rank's chunk (with its own residual) and gather every rank's:
        p * mine.numel() elements, the same bytes on every rank."""
        p, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        c = mine.numel()
        chunk = max(1, math.ceil(c / self.block)) * self.block
        y = torch.zeros(chunk, device=mine.device)
        y[:c] = mine.reshape(-1)
        q2, r2 = quantize(y, bits=self.bits, block=self.block, residual=self._residual(f"{key}@{me}", 2, chunk))
        if r2 is not None:
            self.residuals[(f"{key}@{me}", 2)] = r2
        out = torch.empty(p * c, device=mine.device)
        gather_quantized(out, q2, self.group, self.collectives, shard=c, decode=dequantize)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals, as flat names -> tensors (phase 1: "1/<key>"; phase 2: "2/<key>@<owner>")."""
        return {f"{phase}/{key}": r.clone() for (key, phase), r in self.residuals.items()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        # a checkpoint is read into host memory: the residuals go back to the rank's device
        self.residuals = {(name[2:], int(name[0])): r.float().to(rank_device(), copy=True) for name, r in sd.items()}

    def bound(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """Per-element error bound of one reduction without residuals, from every rank's input."""
        p = len(xs)
        n = xs[0].numel()
        chunk = max(1, math.ceil(n / (p * self.block))) * self.block
        qmax = 127 if self.bits == 8 else 7

        def half_scales(v: torch.Tensor) -> torch.Tensor:
            y = torch.zeros(p * chunk, device=v.device)
            y[:v.numel()] = v.reshape(-1)
            s = y.view(-1, self.block).abs().amax(dim=1) / qmax / 2
            return s.repeat_interleave(self.block)

        phase1 = sum(half_scales(v.float()) for v in xs)
        total = torch.zeros(p * chunk, device=xs[0].device)
        total[:n] = sum(v.reshape(-1).double() for v in xs).float()
        # the owner re-quantizes its sum, which is off by at most phase1: its block absmax is bounded by that
        phase2 = (total.view(-1, self.block).abs().amax(dim=1, keepdim=True)
                  + phase1.view(-1, self.block).amax(dim=1, keepdim=True)).expand(-1, self.block).reshape(-1) / qmax / 2
        return (phase1 + phase2)[:n] * 1.0001 + 1e-7  # fp32 rounding of the sums
