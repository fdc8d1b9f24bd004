"""Compute time of one op: a roofline with size-dependent efficiency.

    t = max(F / (peak * eff_compute(op_class, F)),  B / (hbm * eff_mem)) + launch

F: FLOP of the op, B: bytes it reads and writes in HBM, peak: the device's
dense FLOP/s for the dtype (the fp32 CUDA-core peak for non-matmul ops),
hbm: HBM bytes/s, launch: kernel launch overhead (s). The roofline is Williams, Waterman & Patterson 2009 ("Roofline: an
insightful visual performance model", CACM); the efficiency factors and their
sources live in calibration.Calibration.

>>> from cost_models.specs import DeviceSpec, canonical_dtype
>>> a100 = DeviceSpec(name="A100", peak_flops={"bf16": 312e12}, memory_bytes=80 * 2**30,
...                   hbm_bytes_per_s=2.0e12, nvlink_bytes_per_s=300e9, nic_bytes_per_s=25e9)
>>> m = RooflineCompute(a100, "bf16", Calibration(launch_overhead_s=0.0))
>>> round(m.op_time(1e12, 0.0, "matmul") * 1e3, 3)     # 1 TFLOP GEMM, ms
4.278
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Protocol, runtime_checkable

from cost_models.calibration import Calibration, saturating_efficiency
from cost_models.choices import PRECISIONS
from cost_models.errors import PartitionerError
from cost_models.specs import DeviceSpec, canonical_dtype

__all__ = ["OP_CLASSES", "OpClass", "ComputeModel", "RooflineCompute", "dtype_for", "elementwise_bytes_per_s",
           "loss_times", "PRECISIONS"]

OpClass = Literal["matmul", "conv", "attention", "elementwise", "reduction",
                  "embedding", "other"]
OP_CLASSES: tuple[str, ...] = ("matmul", "conv", "attention", "elementwise",
                               "reduction", "embedding", "other")
_TENSOR_CORE_CLASSES = ("matmul", "conv", "attention")

# Training precision (what users declare) -> dtype of the compute kernels.
# fp8-mixed: bf16 for everything but its GEMMs, whose rate cost_models.fp8 picks.
_DTYPE_OF_PRECISION = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16": "bf16", "fp8-mixed": "bf16"}
assert tuple(_DTYPE_OF_PRECISION) == PRECISIONS


def dtype_for(precision: str) -> str:
    """The dtype whose peak FLOP/s the compute kernels run at.

    "fp32" -> "fp32", "bf16-mixed" -> "bf16", "fp16-mixed" -> "fp16", "bf16" (pure) -> "bf16",
    "fp8-mixed" -> "bf16" (the ops outside its fp8 GEMMs: `cost_models.fp8.gemm_dtype`).
    fp32 matmuls may run on TF32 tensor cores when the user enables
    `torch.backends.cuda.matmul.allow_tf32` (off by default since torch
    1.12); say so with `RooflineCompute(..., tf32_matmuls=True)`.

    >>> dtype_for("bf16-mixed")
    'bf16'
    """
    try:
        return _DTYPE_OF_PRECISION[precision]
    except KeyError:
        raise PartitionerError(
            f"precision={precision!r} is not one of {list(PRECISIONS)}") from None


@runtime_checkable
class ComputeModel(Protocol):
    """Anything that predicts the time of one op on one device."""

    def op_time(self, flops: float, bytes_moved: float, op_class: str) -> float:
        """Seconds for an op of `flops` FLOP moving `bytes_moved` bytes in HBM."""
        ...


@dataclasses.dataclass(frozen=True)
class RooflineCompute:
    """Roofline compute model of one device at one dtype (see module docstring).

    Compute efficiency per op class, as a fraction of `peak_flops(op_class)`:
      matmul / conv / attention: saturating_efficiency(F, eff_max=<class>_eff_max,
          half_flops=gemm_half_flops) -- small GEMMs cannot fill the GPU; a measured
          plateau for the dtype (`partitioner probe`) scales it (Calibration.plateau);
      elementwise / reduction / embedding / other: vector_eff of the device's
          fp32 peak (CUDA cores, not tensor cores; the dtype's peak on a device
          without an fp32 entry); these are bandwidth bound anyway.
    Memory efficiency: mem_eff of HBM bandwidth for every class.
    An op with no FLOP and no bytes still pays the launch overhead.
    tf32_matmuls: with dtype "fp32", run matmul/conv/attention at the
    device's "tf32" peak (if it has one), as torch does with
    `torch.backends.cuda.matmul.allow_tf32 = True`.
    """

    device: DeviceSpec
    dtype: str
    calibration: Calibration = Calibration()
    tf32_matmuls: bool = False

    def __post_init__(self) -> None:
        dtype = canonical_dtype(self.dtype)  # "bfloat16" -> "bf16"; unknown names raise
        if dtype not in self.device.peak_flops:
            raise PartitionerError(
                f"device {self.device.name!r} has no peak FLOP/s for dtype "
                f"{dtype!r}; it supports {sorted(self.device.peak_flops)} "
                f"(choose another precision or device)")
        object.__setattr__(self, "dtype", dtype)

    def peak_flops(self, op_class: str = "other") -> float:
        """Dense peak FLOP/s the ops of `op_class` run against (see class docstring)."""
        peaks = self.device.peak_flops
        if op_class not in _TENSOR_CORE_CLASSES:
            return peaks["fp32"] if "fp32" in peaks else peaks[self.dtype]
        if self.tf32_matmuls and self.dtype == "fp32" and "tf32" in peaks:
            return peaks["tf32"]
        return peaks[self.dtype]

    def compute_efficiency(self, op_class: str, flops: float) -> float:
        """Fraction of `peak_flops` an op of class `op_class` and `flops` FLOP reaches."""
        c = self.calibration
        if op_class in _TENSOR_CORE_CLASSES:
            # the probe's measured curve of this dtype where there is one (Calibration.plateau)
            return saturating_efficiency(flops, eff_max=c.plateau(op_class, self.dtype), half_flops=c.gemm_half_flops)
        if op_class in OP_CLASSES:
            return c.vector_eff
        raise PartitionerError(f"op_class={op_class!r} is not one of {list(OP_CLASSES)}")

    def op_time(self, flops: float, bytes_moved: float, op_class: str) -> float:
        """Seconds for one op: max(compute time, memory time) + launch overhead.

        flops: FLOP (a multiply-add is 2); bytes_moved: HBM bytes read + written.
        """
        if flops < 0 or bytes_moved < 0:
            raise PartitionerError(
                f"op_time needs flops >= 0 and bytes_moved >= 0, got "
                f"flops={flops}, bytes_moved={bytes_moved}")
        eff = self.compute_efficiency(op_class, flops)
        c = self.calibration
        t_compute = flops / (self.peak_flops(op_class) * c.device_speed * eff) if flops > 0 else 0.0
        t_memory = bytes_moved / elementwise_bytes_per_s(self.device, c)
        return max(t_compute, t_memory) + c.launch_overhead_s


def elementwise_bytes_per_s(device: DeviceSpec, cal: Calibration) -> float:
    """Bytes/s the device's elementwise kernels stream: HBM x device_speed x mem_eff (the roofline's memory side,
    PowerSGD's elementwise passes, the engine's gradient buffers)."""
    return device.hbm_bytes_per_s * cal.device_speed * cal.mem_eff


# A cross entropy's passes over its fp32 logits: forward, the log-softmax reads them and writes its output (the
# gather of the targets' entries is small); backward, a zeroed gradient is written, the log-softmax's output read and
# the logits' gradient written.
LOSS_PASSES = (2, 3)


def loss_times(elements: float, device: DeviceSpec, cal: Calibration) -> tuple[float, float]:
    """Seconds of the loss's forward and backward on one microbatch whose output has `elements` elements.

    The loss is not in the traced graph (the caller's loss_fn takes the model's output), and the planner cannot see
    it; a language model's is a cross entropy over its logits, in fp32 (Megatron's, Hugging Face's upcast), which
    for a large vocabulary is the step's largest elementwise work: LOSS_PASSES fp32 passes over the logits at the
    elementwise rate times `loss_eff`. An output that is the loss itself (labels passed to the model) has one
    element, and costs nothing here.

    >>> from cost_models.devices import get_device
    >>> f, b = loss_times(4096 * 50257, get_device("H100-80GB"), Calibration())
    >>> round(f * 1e3, 3), round(b * 1e3, 3)          # 4096 tokens of GPT-2's vocabulary, ms
    (0.614, 0.922)
    """
    per_pass = 4 * elements / (elementwise_bytes_per_s(device, cal) * cal.loss_eff)
    return LOSS_PASSES[0] * per_pass, LOSS_PASSES[1] * per_pass
