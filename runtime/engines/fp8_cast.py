"""The fp8 cast of `runtime.engines.fp8` as one Triton kernel on CUDA: scale, saturate and round in one pass.

Written as torch ops, ``(t.float() * scale).clamp(-fmax, fmax).to(float8)`` is four kernels that each read and
write the whole tensor in fp32, and the scale two more: measured on an H200 (docs/benchmarks.md, "fp8 linears
on a lent H200"), fp8 linears ran at 0.4-1.0x the speed of bf16 ones, the casts and their launches costing more
than the faster GEMMs saved. Here the cast is one kernel that reads t once (2 B per element in bf16) and writes
its codes (1 B); the amax it needs is one reduction before it (torch.linalg.vector_norm(t, inf), another read):
the 5 B per element cost_models.fp8 charges.

The codes are the torch reference's, bit for bit (checked on CUDA by tests/test_fp8.py): the scale is computed
as the reference computes it (``fmax / amax`` is torch's ``reciprocal(amax) * fmax``: an IEEE reciprocal,
div_rn, then one fp32 product), each element is multiplied by it in fp32, clamped to +-fmax, and rounded to
nearest-even into the format (Triton's fp32 -> fp8 conversion: cvt.rn.satfinite), as c10's Float8 conversion
rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["cast_to_fp8"]

_BLOCK = 4096
_TL_FORMAT = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def _cast_kernel(x_ptr, amax_ptr, out_ptr, scale_ptr, n, FMAX: tl.constexpr, EPS: tl.constexpr,
                 OUT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    amax = tl.maximum(tl.load(amax_ptr).to(tl.float32), EPS)
    scale = tl.div_rn(tl.full((), 1.0, tl.float32), amax) * FMAX
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    y = tl.minimum(tl.maximum(x * scale, -FMAX), FMAX)
    tl.store(out_ptr + offs, y.to(OUT), mask=inside)
    if pid == 0:
        tl.store(scale_ptr, scale)


def cast_to_fp8(t: torch.Tensor, dtype: torch.dtype, fmax: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of a CUDA tensor `t`, as runtime.engines.fp8.quantize defines them."""
    x = t.detach().contiguous()
    amax = torch.linalg.vector_norm(x, float("inf"))  # max |t|: one reduction, exact in any float dtype
    codes = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    n = x.numel()
    _cast_kernel[(max(1, triton.cdiv(n, _BLOCK)),)](x, amax, codes, scale, n, FMAX=fmax, EPS=eps,
                                                   OUT=_TL_FORMAT[dtype], BLOCK=_BLOCK)
    return codes, scale
