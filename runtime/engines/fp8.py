"""FP8 GEMMs with per-tensor current scaling: what `precision="fp8-mixed"` runs for every linear layer.

The recipe (torchao's `Float8Linear` default, Megatron/TransformerEngine's FP8 current scaling): right
before each GEMM, every operand is cast to float8 with a scale taken from its own absolute maximum,

    scale = FP8_MAX / max(amax(t), EPS)          t_fp8 = saturate(t * scale)     (one fp32 scalar per tensor)

e4m3 (max 448, 3 mantissa bits) for the forward's activations and weights, e5m2 (max 57344, 2 bits, a wider
range) for the output gradient in backward. The GEMM multiplies the fp8 codes, accumulates in fp32 and
divides both scales out: ``y = (x_fp8 @ w_fp8.T) / (scale_x * scale_w)``, written in the compute dtype (bf16
under fp8-mixed). Backward runs its two GEMMs the same way: ``dx = dy_fp8 @ w_fp8``, ``dw = dy_fp8.T @ x_fp8``;
the bias gradient is a plain sum. Everything else (norms, softmax, attention, the optimizer) stays as
bf16-mixed runs it.

What backward keeps: the high-precision input and the weight (the parameter itself, no copy), cast again in
backward, as torchao's `matmul_with_hp_or_float8_args` does (`ctx.save_for_backward(input_hp, weight_hp_t)`).
Current scaling is a pure function of the tensor, so the second cast gives the codes the forward used; the
memory kept is bf16-mixed's (cost_models.fp8 charges the second cast's bytes instead).

Where the GEMM runs: `torch._scaled_mm` on a CUDA device with FP8 tensor cores (compute capability >= 8.9)
when every dimension is a multiple of 16 (its layout rule); elsewhere (CPU, smaller shapes) the same codes
are dequantized and multiplied in fp32 -- the products of two fp8 values are exact in fp32. The two differ in
the sums: Hopper's FP8 tensor cores keep about 14 bits of the running sum (DeepSeek-V3 report, Sec. 3.3.2;
tests/test_fp8.py bounds it on CUDA), the emulation all of fp32's.

>>> x, w = torch.randn(4, 32), torch.randn(8, 32)
>>> q, scale = quantize(x, E4M3)
>>> q.dtype, torch.equal(scale, 448.0 / x.abs().max())
(torch.float8_e4m3fn, True)
>>> y = fp8_linear(x, w)
>>> bool(((y - x @ w.T).abs() <= 0.15 * (x.abs() @ w.abs().T)).all())   # within two e4m3 roundings
True
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["E4M3", "E5M2", "FP8_LINEAR_OP", "Fp8Linear", "convert_linears", "exact_gemms", "fp8_linear", "quantize",
           "reference_quantize"]

E4M3 = torch.float8_e4m3fn  # forward operands: activations and weights
E5M2 = torch.float8_e5m2  # backward: the output gradient
EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale (torchao's EPS)
_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448, 57344

_exact = [False]  # set by `exact_gemms` (plan.verify): run the plain GEMM instead


@contextlib.contextmanager
def exact_gemms() -> Iterator[None]:
    """Run `fp8_linear` as the plain linear inside this block: plan.verify compares the generated code with the
    unmodified module in fp32, where the parallel rewrite (not the fp8 recipe) is what is checked."""
    before, _exact[0] = _exact[0], True
    try:
        yield
    finally:
        _exact[0] = before


def quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale): `t` cast to the float8 `dtype` with the per-tensor current scale FP8_MAX / amax(t).
    The scale is an fp32 scalar tensor; ``codes.float() / scale`` is the value the GEMM sees. On CUDA one
    Triton kernel writes the same codes (runtime.engines.fp8_cast, checked against `reference_quantize`)."""
    if t.is_cuda:
        from runtime.engines.fp8_cast import cast_to_fp8  # Triton: imported where a GPU runs it

        return cast_to_fp8(t, dtype, _MAX[dtype], EPS, reference_quantize)
    return reference_quantize(t, dtype)


def reference_quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` as torch ops (the definition): one fp32 copy, scaled and saturated in place (no inf from
    rounding up), then rounded to nearest-even into the format."""
    fmax = _MAX[dtype]
    x = t.detach()
    amax = torch.linalg.vector_norm(x, float("inf")).float()  # max |t| in one pass, exact
    scale = fmax / torch.clamp(amax, min=EPS)
    y = x * scale if x.dtype == torch.float32 else x.float().mul_(scale)
    return y.clamp_(-fmax, fmax).to(dtype), scale


@functools.cache
def _fp8_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _tensor_cores(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch._scaled_mm runs a (M, K) @ b (K, N) here: CUDA with FP8 tensor cores, dims % 16 == 0."""
    return a.is_cuda and _fp8_capable(a.device) and all(d % 16 == 0 for d in (*a.shape, b.shape[1]))


def _gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """(a / sa) @ (b / sb) for fp8 codes a (M, K), b (K, N): fp32 accumulation, written in `out`."""
    if _tensor_cores(a, b):
        # _scaled_mm wants a row-major and b column-major; its scales are the dequantizing ones
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=sa.reciprocal(),
                                scale_b=sb.reciprocal(), out_dtype=out)
    with torch.autocast(a.device.type, enabled=False):  # a region's autocast must not round the fp32 GEMM
        return ((a.float() / sa) @ (b.float() / sb)).to(out)  # emulated: exact products, fp32 sums


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """What the linear writes: the autocast dtype inside an autocast region (as F.linear), else x's dtype."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


# One operator, not a Python autograd.Function: activation checkpointing's selective policy
# (runtime.engines.recompute) sees it as one op and keeps its output, as it keeps a linear's, where it would
# otherwise see (and keep) the emulation's fp32 matmul, or recompute a _scaled_mm.
@torch.library.custom_op("fp8_gemms::linear", mutates_args=())
def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """y = x @ w.T + b with both GEMM operands in e4m3 (backward: `_linear_backward`)."""
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    xq, sx = quantize(x2, E4M3)
    wq, sw = quantize(w, E4M3)  # (N, K)
    y = _gemm(xq, sx, wq.t(), sw, _out_dtype(x))  # (M, N)
    if b is not None:
        y = y + b.to(y.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


@_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=_out_dtype(x))


def _keep(ctx, inputs, output) -> None:
    x, w, b = inputs
    ctx.save_for_backward(x, w)  # the high-precision tensors, cast again in backward (torchao's choice)
    ctx.has_bias = b is not None


# Backward's GEMMs are an operator too: register_autograd's function is traced by torch.compile (AOTAutograd),
# and the casts inside it (a Triton kernel checked once per device, with a data-dependent branch) cannot be;
# as one opaque op the compiled backward calls it like the eager one. Unwanted gradients come back empty.
@torch.library.custom_op("fp8_gemms::linear_backward", mutates_args=())
def _linear_grads(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, want_dx: bool,
                  want_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of y = x @ w.T, with the output gradient in e5m2 and x, w cast to e4m3 again."""
    dy2 = dy.reshape(-1, dy.shape[-1])  # (M, N)
    gq, sg = quantize(dy2, E5M2)
    dx = dw = x.new_empty(0)
    if want_dx:
        wq, sw = quantize(w, E4M3)
        dx = _gemm(gq, sg, wq, sw, x.dtype).reshape(x.shape)  # (M, N) @ (N, K)
    if want_dw:
        xq, sx = quantize(x.reshape(-1, x.shape[-1]), E4M3)
        dw = _gemm(gq.t(), sg, xq, sx, w.dtype)  # (N, M) @ (M, K)
    return dx, dw


@_linear_grads.register_fake
def _(dy, x, w, want_dx, want_dw):
    return (torch.empty_like(x) if want_dx else x.new_empty(0)), (torch.empty_like(w) if want_dw else x.new_empty(0))


def _linear_backward(ctx, dy: torch.Tensor):
    """Both backward GEMMs in fp8 (`_linear_grads`); the bias gradient a plain sum."""
    x, w = ctx.saved_tensors
    want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = torch.ops.fp8_gemms.linear_backward.default(dy, x, w, want_dx, want_dw)
    db = dy.reshape(-1, dy.shape[-1]).float().sum(0).to(dy.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return (dx if want_dx else None), (dw if want_dw else None), db


_linear.register_autograd(_linear_backward, setup_context=_keep)
FP8_LINEAR_OP = torch.ops.fp8_gemms.linear.default  # what dispatch (and a checkpoint policy) sees


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear` with fp8 GEMMs (module docstring); the generated programs of fp8-mixed
    plans call it where the traced code called `aten.linear`."""
    if _exact[0] or not x.is_floating_point():
        return F.linear(x, weight, bias)
    return FP8_LINEAR_OP(x, weight, bias)  # the dispatcher's op: the custom_op wrapper's Python costs ~2x more


class Fp8Linear(nn.Linear):
    """An `nn.Linear` whose forward is `fp8_linear`; `convert_linears` puts one in place of each linear,
    holding the same Parameter objects (names, state dict and optimizer see no difference)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)


def convert_linears(model: nn.Module) -> int:
    """Put an `Fp8Linear` in place of every `nn.Linear` of `model` (in place; torchao's module swap), sharing
    its parameters; the number converted. For models run by their own forward (data-parallel programs
    without generated code); generated code calls `fp8_linear` itself."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, lin in swaps:
        new = Fp8Linear.__new__(Fp8Linear)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight, new.bias = lin.weight, lin.bias
        new.train(lin.training)
        setattr(parent, name, new)
    return len(swaps)
