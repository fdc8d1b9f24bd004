"""What `precision="fp8-mixed"` changes in the costs: the linear layers' GEMMs at the FP8 rate, plus their casts.

The recipe (runtime.engines.fp8; torchao's Float8Linear default, Megatron/TransformerEngine FP8 current
scaling): before each GEMM of a linear layer (`aten.linear`: nn.Linear, F.linear) every operand is cast to
float8 with a per-tensor scale from its amax; the GEMM multiplies fp8 codes and accumulates in fp32.
Everything else -- attention's softmax core (a fused SDPA kernel in bf16), norms, elementwise ops, the
optimizer -- runs as bf16-mixed.

Time of one linear under fp8-mixed (per microbatch, per tensor rank):

    forward  = roofline(F_fwd at the fp8 peak, B_fwd) + cast(x, W)
    backward = roofline(F_bwd at the fp8 peak, B_bwd) + cast(dY) + cast(x, W)

- the fp8 peak is the device's `peak_flops["fp8"]` (H100/H200 SXM: 1,979 TFLOP/s dense, 2x bf16;
  NVIDIA H100 whitepaper). A device without one runs the GEMMs at the bf16 rate: CPU ("local:N"), where
  the runtime emulates fp8 by quantize-dequantize around an fp32 matmul. A GPU without FP8 tensor cores
  (V100, A100) is refused (`check_fp8`).
- B (the GEMM's HBM traffic) is charged as bf16-mixed's: an upper bound (the fp8 operands are half the
  bytes), immaterial where GEMMs are compute bound.
- cast(t, ...): memory-bound work moving `cast_bytes` per element of each operand, as the runtime casts
  (runtime.engines.fp8.quantize), on the roofline's HBM term with one launch. Where the GEMMs run on FP8 tensor
  cores the cast is one Triton kernel (runtime.engines.fp8_cast) after the amax reduction: read the bf16
  tensor twice, write the codes, FUSED_CAST_BYTES = 5. Emulated (CPU) it is the torch ops: the amax read
  (2 B), an fp32 copy (2 + 4), scaled and saturated in place (8 + 8), rounded into the codes (4 + 1):
  TORCH_CAST_BYTES = 29. torchao's compiled cast fuses the amax into the read (3 B). Backward casts the output gradient (e5m2) and casts x and W again: like torchao, the recipe keeps
  the bf16 input and the weight for backward, not their fp8 codes (`ctx.save_for_backward(input_hp,
  weight_hp_t)` in torchao/float8/float8_linear.py), so activation memory is exactly bf16-mixed's and the
  second cast is paid in time instead. TransformerEngine keeps the fp8 input instead (half of the linear's
  saved input); this model does not assume that.
- Only `linear` ops: batched matmuls elsewhere (eager attention's scores) stay bf16, as in both libraries;
  so do Hugging Face GPT-2's `Conv1D` layers (an `addmm`), which torchao's nn.Linear swap leaves alone too.

>>> from cost_models.devices import PRESETS
>>> gemm_dtype("fp8-mixed", PRESETS["H100-80GB"]), gemm_dtype("fp8-mixed", PRESETS["CPU"])
('fp8', 'bf16')
>>> cast_bytes(1024, fused=True), cast_bytes(1024, fused=False)  # 1024 elements: 5 B each, 29 B each
(5120, 29696)
"""

from __future__ import annotations

from cost_models.compute import dtype_for
from cost_models.errors import PartitionerError
from cost_models.specs import DeviceSpec

__all__ = ["FP8_GEMM_OPS", "FUSED_CAST_BYTES", "TORCH_CAST_BYTES", "cast_bytes", "check_fp8", "gemm_dtype"]

FP8_PRECISIONS = ("fp8-mixed",)
FP8_GEMM_OPS = ("linear",)  # OpNode.op names whose GEMMs the runtime runs in fp8 (runtime.engines.fp8)
FUSED_CAST_BYTES = 5  # amax read (2 B), the kernel's read (2 B) and write (1 B)
TORCH_CAST_BYTES = 29  # amax read (2), fp32 copy (2 + 4), scale (8) and saturate (8) in place, round (4 + 1)


def cast_bytes(elements: float, *, fused: bool) -> float:
    """HBM bytes of casting `elements` bf16 values to fp8 with current scaling: by the fused kernel (a GPU with
    FP8 tensor cores) or by torch ops (emulated fp8)."""
    return (FUSED_CAST_BYTES if fused else TORCH_CAST_BYTES) * elements


def check_fp8(precision: str, device: DeviceSpec, *, emulated: bool) -> None:
    """Refuse an fp8 precision on a device without FP8 tensor cores (no "fp8" peak), unless it runs emulated
    (a CPU / local topology: runtime.engines.fp8 quantizes and dequantizes around an fp32 matmul)."""
    if precision in FP8_PRECISIONS and "fp8" not in device.peak_flops and not emulated:
        raise PartitionerError(
            f"precision={precision!r} needs FP8 tensor cores, and device {device.name!r} has none (its peak "
            f"FLOP/s cover {sorted(device.peak_flops)}; FP8 GEMMs came with Hopper/Ada: H100, H200); "
            f"use precision='bf16-mixed' on {device.name}, or a device with an 'fp8' peak")


def gemm_dtype(precision: str, device: DeviceSpec) -> str:
    """The dtype whose peak the fp8 linears' GEMMs run at: "fp8" where the device has FP8 tensor cores, the
    precision's compute dtype otherwise (emulated fp8 on CPU is a bf16/fp32 matmul)."""
    if precision in FP8_PRECISIONS and "fp8" in device.peak_flops:
        return "fp8"
    return dtype_for(precision)
