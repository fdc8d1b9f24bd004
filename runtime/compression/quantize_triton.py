"""Triton kernels for `runtime.compression.quantize`: one fused kernel per side, bit-exact with the torch reference.

`quantize_triton` adds the residual, finds each block's absmax, quantizes,
packs int4 two codes per byte, and stores codes, scales and the new residual,
all in one kernel with one program per block (``BLOCK`` = ``block``, a power of
two). `dequantize_triton` / `dequantize_add_triton` are the other side; the
latter accumulates into ``out`` in place (what a compressed all-reduce sums
with). The arithmetic is the module docstring of `runtime.compression.quantize`, op for op:
round-half-even is ``(v + 1.5 * 2**23) - 1.5 * 2**23`` in fp32 (exact for
``|v| <= 2**22``; ``v`` is clamped to ``[-qmax, qmax]`` first), and every
launch passes ``enable_fp_fusion=False`` so ``y - code * scale`` and
``out + code * scale`` are not contracted into an FMA on a GPU.

Stochastic rounding uses ``tl.rand(seed, element_index)``: unbiased, but not
the same draws as the torch reference's generator.

Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set
before triton is first imported). Importing `runtime.compression.quantize` never needs
triton; this module does.

>>> import os
>>> import torch
>>> device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
>>> x = torch.randn(1000, device=device)
>>> q, r = quantize_triton(x, bits=4, block=256, residual=torch.zeros_like(x))
>>> q.codes.shape, q.scales.shape
(torch.Size([500]), torch.Size([4]))
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cost_models.compression import QUANT_BLOCK
from runtime.compression.quantize import Quantized, check_args, qmax

__all__ = ["dequantize_add_triton", "dequantize_triton", "quantize_triton"]

_RNE_MAGIC = 12582912.0  # 1.5 * 2**23: adding it leaves no fraction bits, so fp32 add rounds half-even


@triton.jit
def _quantize_kernel(
    x_ptr, r_ptr, codes_ptr, scales_ptr, rout_ptr, numel, seed,
    QMAX: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, STOCHASTIC: tl.constexpr, MAGIC: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = offs < numel
    y = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        y = y + tl.load(r_ptr + offs, mask=mask, other=0.0)
    # div_rn: Triton's `/` compiles to an approximate division on CUDA (div.full.f32, up to 2 ulp), which would
    # break bit-equality with the torch reference (IEEE division); the interpreter divides exactly either way
    scale = tl.div_rn(tl.max(tl.abs(y), axis=0), tl.full((), QMAX, tl.float32))
    v = tl.div_rn(y, tl.broadcast_to(tl.where(scale > 0, scale, 1.0), y.shape))
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    if STOCHASTIC:
        v = tl.floor(v + tl.rand(seed, offs))
        v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    else:
        v = (v + MAGIC) - MAGIC
    code = v.to(tl.int8)  # (BLOCK,), integral values in [-QMAX, QMAX]
    tl.store(scales_ptr + pid, scale)
    if HAS_RESIDUAL:
        tl.store(rout_ptr + offs, y - code.to(tl.float32) * scale, mask=mask)
    if BITS == 8:
        tl.store(codes_ptr + offs, code, mask=mask)
    else:
        nib = (code + 8).to(tl.uint8)
        lo, hi = tl.split(tl.reshape(nib, (BLOCK // 2, 2)))  # even, odd elements
        boffs = pid.to(tl.int64) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)  # (BLOCK // 2,)
        tl.store(codes_ptr + boffs, lo | (hi << 4), mask=boffs < (numel + 1) // 2)


@triton.jit
def _dequantize_kernel(
    codes_ptr, scales_ptr, out_ptr, numel,
    BITS: tl.constexpr, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = offs < numel
    scale = tl.load(scales_ptr + pid)
    if BITS == 8:
        code = tl.load(codes_ptr + offs, mask=mask, other=0)
    else:
        boffs = pid.to(tl.int64) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)  # (BLOCK // 2,)
        byte = tl.load(codes_ptr + boffs, mask=boffs < (numel + 1) // 2, other=0x88)
        lo = (byte & 15).to(tl.int8) - 8
        hi = (byte >> 4).to(tl.int8) - 8
        code = tl.reshape(tl.join(lo, hi), (BLOCK,))  # interleave: lo0 hi0 lo1 hi1 ...
    value = code.to(tl.float32) * scale
    if ACCUMULATE:
        value = tl.load(out_ptr + offs, mask=mask, other=0.0) + value
    tl.store(out_ptr + offs, value, mask=mask)


def _check_block(block: int) -> None:
    if not isinstance(block, int) or block < 2 or block & (block - 1):
        raise ValueError(
            f"block={block!r}: the Triton kernels need a power of two >= 2 (one program per block, "
            "BLOCK = block); use e.g. 256, or runtime.compression.quantize.quantize for other sizes"
        )


def _check_device(t: torch.Tensor) -> None:
    interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    if not t.is_cuda and not interpret:
        raise ValueError(
            f"Triton kernels need CUDA tensors, got one on {t.device}: move it to the GPU, use "
            "runtime.compression.quantize on CPU, or set TRITON_INTERPRET=1 before importing triton"
        )


def _check_buffer(name: str, t: torch.Tensor, dtype: torch.dtype, n: int, like: torch.Tensor) -> None:
    if t.dtype != dtype or t.shape != (n,) or not t.is_contiguous() or t.device != like.device:
        raise ValueError(
            f"{name} must be a contiguous {dtype} tensor of shape ({n},) on {like.device}, "
            f"got {t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()} on {t.device}"
        )


def quantize_triton(
    x: torch.Tensor,
    *,
    bits: int = 8,
    block: int = QUANT_BLOCK,
    residual: torch.Tensor | None = None,
    stochastic: bool = False,
    seed: int = 0,
    out: Quantized | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[Quantized, torch.Tensor | None]:
    """`runtime.compression.quantize.quantize` in one kernel; same result bit for bit (except stochastic draws).

    ``out`` (a `Quantized` with matching numel/bits/block) and ``residual_out``
    are optional preallocated outputs; ``residual_out`` may be ``residual``
    itself (updated in place: each element is read before it is written, by the
    same program). ``seed`` seeds ``tl.rand`` when ``stochastic``.
    """
    check_args(x, bits, block, residual)
    _check_block(block)
    _check_device(x)
    if stochastic and residual is not None:
        raise ValueError(
            "stochastic rounding is not combined with error feedback (the residual already removes "
            "the bias): pass either stochastic=True or residual=..., not both"
        )
    n = x.numel()
    nblocks = -(-n // block)
    ncodes = -(-n // 2) if bits == 4 else n
    code_dtype = torch.uint8 if bits == 4 else torch.int8
    if out is None:
        out = Quantized(
            codes=torch.empty(ncodes, dtype=code_dtype, device=x.device),
            scales=torch.empty(nblocks, dtype=torch.float32, device=x.device),
            numel=n, bits=bits, block=block,
        )
    elif (out.numel, out.bits, out.block) != (n, bits, block):
        raise ValueError(
            f"out has numel={out.numel} bits={out.bits} block={out.block}, "
            f"the call numel={n} bits={bits} block={block}"
        )
    _check_buffer("out.codes", out.codes, code_dtype, ncodes, x)
    _check_buffer("out.scales", out.scales, torch.float32, nblocks, x)
    if residual is not None:
        if residual_out is None:
            residual_out = torch.empty_like(x)
        _check_buffer("residual_out", residual_out, torch.float32, n, x)
    if n:
        _quantize_kernel[(nblocks,)](
            x, residual if residual is not None else x, out.codes, out.scales,
            residual_out if residual is not None else x, n, seed,
            QMAX=qmax(bits), BITS=bits, BLOCK=block, HAS_RESIDUAL=residual is not None,
            STOCHASTIC=stochastic, MAGIC=_RNE_MAGIC, enable_fp_fusion=False,
        )
    return out, (residual_out if residual is not None else None)


def dequantize_triton(q: Quantized, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[numel]`` equal bit for bit to `runtime.compression.quantize.dequantize`; written into ``out`` if given."""
    if out is None:
        out = torch.empty(q.numel, dtype=torch.float32, device=q.scales.device)
    return _dequantize(q, out, accumulate=False)


def dequantize_add_triton(q: Quantized, out: torch.Tensor) -> torch.Tensor:
    """``out += dequantize(q)`` in place (one fp32 add per element after the multiply); returns ``out``."""
    return _dequantize(q, out, accumulate=True)


def _dequantize(q: Quantized, out: torch.Tensor, *, accumulate: bool) -> torch.Tensor:
    _check_block(q.block)
    qmax(q.bits)
    _check_device(q.scales)
    _check_buffer("out", out, torch.float32, q.numel, q.scales)
    ncodes = -(-q.numel // 2) if q.bits == 4 else q.numel
    _check_buffer("q.codes", q.codes, torch.uint8 if q.bits == 4 else torch.int8, ncodes, q.scales)
    _check_buffer("q.scales", q.scales, torch.float32, -(-q.numel // q.block), q.scales)
    if q.numel:
        _dequantize_kernel[(q.scales.numel(),)](
            q.codes, q.scales, out, q.numel,
            BITS=q.bits, BLOCK=q.block, ACCUMULATE=accumulate, enable_fp_fusion=False,
        )
    return out
