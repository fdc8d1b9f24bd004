"""The fp8 cast of `runtime.engines.fp8` as one Triton kernel on CUDA: scale, saturate and round in one pass.

Written as torch ops (`runtime.engines.fp8.reference_quantize`), the cast is an fp32 copy scaled, saturated
and rounded in place: 29 B moved per bf16 element, and on an H200 (docs/benchmarks.md, "On a lent H200") fp8
linears ran at 0.4-1.0x the speed of bf16 ones. Here one kernel reads t once (2 B per element in bf16) and
writes its codes (1 B), after one reduction for the amax (another read): 5 B.

The codes are the reference's, bit for bit. The scale is computed as torch computes ``fmax / amax``
(``reciprocal(amax) * fmax``: an IEEE reciprocal, div_rn, then one fp32 product); each element is multiplied
by it in fp32 and clamped to +-fmax; then it is rounded to nearest-even onto the format's grid in fp32
arithmetic (the grid step from the value's binary exponent, floored at the smallest normal's: subnormals
share that step), so the final conversion to fp8 is exact. Converting directly is not safe: Triton's
fp32 -> fp8 conversion dropped the carry when rounding up crossed a power of two (31.03 -> 16 instead of 32
in e4m3), on an H200 with Triton 3.6 and in Triton's interpreter alike. And nothing here is trusted blind:
`cast_to_fp8` checks the kernel once per device against the torch reference on values that round across
powers of two, ties and subnormals, and uses the reference (with a warning) where they differ.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

__all__ = ["cast_to_fp8"]

_BLOCK = 4096
_TL_FORMAT = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


# 1.5 * 2^23: v + M - M rounds |v| < 2^22 to an integer, ties to even, in fp32. Passed as a constexpr argument:
# compiled Triton refuses a kernel that reads a plain global (the interpreter does not, so only a GPU showed it)
_RNE_MAGIC = 12582912.0
# per format: (mantissa bits, biased fp32 exponent of its smallest normal)
_GRID = {torch.float8_e4m3fn: (3, 127 - 6), torch.float8_e5m2: (2, 127 - 14)}


@triton.jit
def _cast_kernel(x_ptr, amax_ptr, out_ptr, scale_ptr, n, FMAX: tl.constexpr, EPS: tl.constexpr,
                 OUT: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, RNE: tl.constexpr,
                 BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    amax = tl.maximum(tl.load(amax_ptr).to(tl.float32), EPS)
    scale = tl.div_rn(tl.full((), 1.0, tl.float32), amax) * FMAX
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    y = tl.minimum(tl.maximum(x * scale, -FMAX), FMAX)
    # |y| rounded onto the grid, its step 2^(exponent - MBITS) with the exponent floored at the smallest
    # normal's (built as bits); the sign put back as a bit (a negative value that rounds to zero is -0, as in torch)
    bits = y.to(tl.int32, bitcast=True)
    step = ((tl.maximum((bits >> 23) & 0xFF, EMIN) - MBITS) << 23).to(tl.float32, bitcast=True)
    v = tl.div_rn(tl.abs(y), step)  # exact: a power of two (div_rn: Triton's `/` is an approximate division)
    mag = ((v + RNE) - RNE) * step  # v <= 2^(MBITS + 1): rounded to even, exactly
    on_grid = (mag.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    tl.store(out_ptr + offs, on_grid.to(OUT), mask=inside)
    if pid == 0:
        tl.store(scale_ptr, scale)


def _launch(x: torch.Tensor, dtype: torch.dtype, fmax: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    amax = torch.linalg.vector_norm(x, float("inf"))  # max |t|: one reduction, exact in any float dtype
    codes = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    n = x.numel()
    mbits, emin = _GRID[dtype]
    _cast_kernel[(max(1, triton.cdiv(n, _BLOCK)),)](x, amax, codes, scale, n, FMAX=fmax, EPS=eps,
                                                   OUT=_TL_FORMAT[dtype], MBITS=mbits, EMIN=emin, RNE=_RNE_MAGIC,
                                                   BLOCK=_BLOCK)
    return codes, scale


def _probe_values() -> torch.Tensor:
    """Values whose scaled images round across powers of two, sit on ties, or fall among the subnormals."""
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(4096, generator=g) * torch.logspace(-6, 1, 4096)
    edges = torch.tensor([448.0, -448.0, 31.03, 15.9, 0.0, 1e-8, -2.0 ** -8, 2.0 ** -10, 17.0, 19.0, 3.0 * 2 ** -9])
    return torch.cat([rand, edges])


_trusted: dict[tuple[torch.device, torch.dtype, torch.dtype], bool] = {}


def cast_to_fp8(t: torch.Tensor, dtype: torch.dtype, fmax: float, eps: float,
                reference) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of a CUDA tensor `t`, as `reference(t, dtype)` (the torch ops) defines them: by the kernel
    where it agrees with the reference on this device (checked once per device and dtypes), else by `reference`."""
    key = (t.device, t.dtype, dtype)
    if key not in _trusted:
        probe = _probe_values().to(device=t.device, dtype=t.dtype)
        got, want = _launch(probe, dtype, fmax, eps), reference(probe, dtype)
        _trusted[key] = bool(torch.equal(got[1], want[1]) and
                             torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)))
        if not _trusted[key]:
            warnings.warn(f"the fused fp8 cast ({t.dtype} -> {dtype}) disagrees with the torch reference on "
                          f"{t.device}; fp8 casts there run as torch ops (slower, same codes)", stacklevel=3)
    if not _trusted[key]:
        return reference(t, dtype)
    return _launch(t.detach().contiguous(), dtype, fmax, eps)
