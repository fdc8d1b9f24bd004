"""Blockwise absmax int8 / int4 gradient quantization with error feedback (torch reference).

This is the implementation the CPU runtime uses; `runtime.compression.quantize_triton`
fuses the same arithmetic into one kernel per side and matches it bit for
bit. The semantics, fixed exactly (every operation is one fp32 operation,
rounded to nearest even, in this order):

- ``qmax = 127`` (``bits=8``) or ``7`` (``bits=4``). Codes are symmetric:
  ``-qmax..qmax`` (int4 never uses -8).
- ``y = x + residual`` (one fp32 add) with error feedback, else ``y = x``.
- ``y`` is cut into blocks of ``block`` elements; the last block may be short
  (its missing elements count as 0).
- per block: ``absmax = max |y|``; ``scale = absmax / qmax`` (fp32 division).
- per element: ``v = y / d`` with ``d = scale if scale > 0 else 1`` (so an
  all-zero block, or one whose ``absmax / qmax`` underflows to 0, has scale 0
  and codes 0: no NaN, no division by zero); ``v = clamp(v, -qmax, qmax)``;
  ``code = round_half_even(v)``. Clamping before rounding equals clamping
  after (qmax is an integer) and keeps ``|v| <= qmax``, which is what the
  Triton kernel's fp32 rounding trick ``(v + 1.5 * 2**23) - 1.5 * 2**23``
  needs.
- stochastic rounding instead (``stochastic=True``, never with a residual):
  ``code = clamp(floor(v + u), -qmax, qmax)`` with ``u ~ U[0, 1)`` from
  ``generator``; unbiased up to fp32 rounding of ``v + u``.
- dequantized value: ``float(code) * scale`` (one fp32 multiply).
- new residual: ``y - float(code) * scale`` (a multiply, then a subtract:
  no fused multiply-add).
- int4 packing: element ``2i`` in the low nibble of byte ``i``, ``2i + 1``
  in the high nibble, each stored as ``code + 8`` (0..15); an odd tail's high
  nibble is 8 (code 0).

Inputs must be finite (an inf makes its block's scale inf and its codes
undefined).

>>> x = torch.tensor([0.5, -1.0, 0.25, 0.0])
>>> q, _ = quantize(x, bits=4, block=2)
>>> q.codes.tolist(), q.scales.tolist(), dequantize(q).tolist()
([27, 143], [0.1428571492433548, 0.0357142873108387], [0.4285714626312256, -1.0, 0.25, 0.0])
>>> q, r = quantize(x, bits=4, block=2, residual=torch.zeros(4))
>>> r.tolist()
[0.07142853736877441, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import dataclasses

import torch

from cost_models.compression import QUANT_BLOCK

__all__ = ["Quantized", "dequantize", "nbytes", "pack_int4", "qmax", "quantize", "unpack_int4"]


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A quantized fp32 vector: the codes and per-block scales that go on the wire."""

    codes: torch.Tensor
    """bits=8: int8 ``[numel]``; bits=4: uint8 ``[ceil(numel / 2)]``, two codes per byte."""
    scales: torch.Tensor
    """fp32 ``[ceil(numel / block)]``: each block's absmax / qmax (0 for an all-zero block)."""
    numel: int
    """Number of elements of the original vector."""
    bits: int
    """8 or 4."""
    block: int
    """Elements per scale."""


def qmax(bits: int) -> int:
    """Largest code magnitude: 127 for int8, 7 for int4."""
    if bits not in (8, 4):
        raise ValueError(f"bits={bits} is not supported: use bits=8 (int8) or bits=4 (packed int4)")
    return (1 << (bits - 1)) - 1


def check_args(x: torch.Tensor, bits: int, block: int, residual: torch.Tensor | None) -> None:
    """Validate `quantize`'s arguments (shared with the Triton version); raises ValueError."""
    qmax(bits)
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} must be a positive int (elements per scale, e.g. 256)")
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(
            f"x must be a contiguous 1-D fp32 tensor, got dtype={x.dtype} shape={tuple(x.shape)} "
            f"contiguous={x.is_contiguous()}: pass x.float().flatten().contiguous()"
        )
    if residual is not None and (
        residual.dtype != torch.float32 or residual.shape != x.shape or not residual.is_contiguous()
        or residual.device != x.device
    ):
        raise ValueError(
            f"residual must be a contiguous fp32 tensor shaped like x {tuple(x.shape)} on {x.device}, "
            f"got dtype={residual.dtype} shape={tuple(residual.shape)} on {residual.device}: start "
            "error feedback with torch.zeros_like(x)"
        )


def quantize(
    x: torch.Tensor,
    *,
    bits: int = 8,
    block: int = QUANT_BLOCK,
    residual: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[Quantized, torch.Tensor | None]:
    """Quantize ``x`` (fp32, 1-D, contiguous) blockwise; see the module docstring for the exact rules.

    With ``residual`` (fp32, shaped like x): ``y = x + residual`` is quantized
    and the new residual ``y - dequantize(q)`` is returned (error feedback);
    without: returns ``(q, None)``. ``stochastic`` rounds ``floor(v + u)`` with
    ``u`` drawn from ``generator``; it is unbiased by itself, so it is refused
    together with a residual.

    >>> q, r = quantize(torch.tensor([1.0, -2.0, 0.0]), block=2)
    >>> q.codes.tolist(), q.scales.tolist(), r
    ([64, -127, 0], [0.015748031437397003, 0.0], None)
    """
    check_args(x, bits, block, residual)
    if stochastic and residual is not None:
        raise ValueError(
            "stochastic rounding is not combined with error feedback (the residual already removes "
            "the bias): pass either stochastic=True or residual=..., not both"
        )
    q = qmax(bits)
    n = x.numel()
    nblocks = -(-n // block)
    if residual is None and n % block == 0:
        y = x  # already whole blocks: no copy
    else:
        y = torch.zeros(nblocks * block, dtype=torch.float32, device=x.device)  # padded with exact zeros
        if residual is None:
            y[:n] = x
        else:
            torch.add(x, residual, out=y[:n])
    yb = y.view(nblocks, block)  # (nblocks, block)
    lo, hi = torch.aminmax(yb, dim=1) if n else (y.new_zeros(0), y.new_zeros(0))  # (nblocks,)
    absmax = torch.maximum(hi.abs(), lo.abs())
    # divided by a tensor, not the Python int: CUDA divides a tensor by a scalar as a multiplication by its
    # reciprocal (one ulp off IEEE division, and off the Triton kernel); never -0.0
    scales = absmax / torch.full_like(absmax, q)
    div = torch.where(scales > 0, scales, torch.ones_like(scales))
    v = torch.div(yb, div[:, None]).clamp_(-q, q)  # (nblocks, block)
    if stochastic:
        u = torch.rand(v.shape, generator=generator, dtype=torch.float32, device=v.device)
        v = v.add_(u).floor_().clamp_(-q, q)
    else:
        v = v.round_()
    codes = v.view(-1)[:n].to(torch.int8)  # (n,)
    del v  # an fp32 copy of the gradient: freed before the dequantized one is made (the reduction's peak)
    quantized = Quantized(
        codes=_pack_int4(codes) if bits == 4 else codes, scales=scales, numel=n, bits=bits, block=block
    )
    if residual is None:
        return quantized, None
    deq = _dequantize_codes(codes, scales, block)
    return quantized, torch.sub(y[:n], deq, out=deq)  # y - dequantize(q)


def dequantize(q: Quantized) -> torch.Tensor:
    """fp32 ``[numel]``: ``float(code) * scale`` per element."""
    codes = unpack_int4(q.codes, q.numel) if q.bits == 4 else q.codes
    return _dequantize_codes(codes, q.scales, q.block)


def _dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    n = codes.numel()
    # multiplied in place: one fp32 buffer instead of two at once, the same fp32 multiply
    if n % block == 0:
        return codes.view(-1, block).float().mul_(scales[:, None]).view(-1)
    return codes.float().mul_(scales.repeat_interleave(block)[:n])


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7], ``[n]`` -> uint8 ``[ceil(n / 2)]`` (even index low nibble, +8 offset).

    >>> pack_int4(torch.tensor([-8, 7, 1], dtype=torch.int8)).tolist()
    [240, 137]
    """
    if codes.dtype != torch.int8 or codes.dim() != 1:
        raise ValueError(f"codes must be 1-D int8, got dtype={codes.dtype} shape={tuple(codes.shape)}")
    if codes.numel() and (int(codes.min()) < -8 or int(codes.max()) > 7):
        raise ValueError(f"int4 codes must lie in [-8, 7], got [{int(codes.min())}, {int(codes.max())}]")
    return _pack_int4(codes)


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    nib = (codes + 8).view(torch.uint8)
    if nib.numel() % 2:
        nib = torch.cat([nib, nib.new_full((1,), 8)])
    return nib[0::2] | (nib[1::2] << 4)


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """uint8 ``[ceil(numel / 2)]`` -> int8 codes ``[numel]`` in [-8, 7] (inverse of `pack_int4`)."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != -(-numel // 2):
        raise ValueError(
            f"packed must be 1-D uint8 of {-(-numel // 2)} bytes for numel={numel}, "
            f"got dtype={packed.dtype} shape={tuple(packed.shape)}"
        )
    nib = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:numel]  # (2 * bytes,) -> (numel,)
    return nib.to(torch.int8) - 8


def nbytes(q: Quantized) -> int:
    """Bytes on the wire: codes + fp32 scales (numel, bits and block are known to both sides)."""
    return q.codes.numel() * q.codes.element_size() + q.scales.numel() * q.scales.element_size()
