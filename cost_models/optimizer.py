"""The optimizer step: the bytes it must move per parameter, and the rate torch's optimizers move them at.

A step is elementwise over every parameter it steps: memory bound, so its time is bytes over bandwidth,

    t = params x optimizer_step_bytes(optimizer, precision) / optimizer_bytes_per_s(optimizer, device, cal)

The bytes are the least the update can move (each tensor it reads once, each it writes once). torch's
default Adam moves more (one elementwise kernel per term of the update): its rate at those bytes is
`Calibration.optimizer_eff` of the device's bandwidth, measured by `partitioner probe`; plain SGD's one kernel
moves just those bytes, at the elementwise ops' `mem_eff`.

>>> optimizer_step_bytes("adamw", "fp32"), optimizer_step_bytes("sgd", "fp32"), optimizer_step_bytes("adam", "bf16")
(28, 12, 14)
"""

from __future__ import annotations

from cost_models.calibration import Calibration
from cost_models.choices import PRECISIONS
from cost_models.errors import PartitionerError
from cost_models.memory import OPTIMIZERS as STATE_KINDS, model_state_bytes
from cost_models.specs import DeviceSpec

__all__ = ["gradient_buffer_bytes", "optimizer_step_bytes", "optimizer_bytes_per_s"]


def optimizer_step_bytes(optimizer: str, precision: str) -> int:
    """Bytes one optimizer step moves per parameter it steps (B/param).

    bytes = (2 + k) reads + (1 + k) writes of one element each: the parameter and its gradient read, the
    parameter written, and each of its k state tensors read and written. k is the optimizer state the memory
    model holds (cost_models.memory, fp32 state bytes / 4): Adam (and AdamW, the same state) m and v, k = 2,
    7 tensors, 28 B in fp32; plain SGD (what a plan's "sgd" runs: torch.optim.SGD without momentum) k = 0, 12 B;
    SGD with momentum one buffer, 20 B. The element is 4 B where the step runs in fp32: fp32 plans, and the
    mixed precisions, whose optimizer steps fp32 masters with fp32 gradients (the engine accumulates them in
    fp32); pure bf16 ("bf16") steps bf16 parameters with bf16 gradients and state, 2 B. The mixed precisions'
    copy of the masters into the 16-bit parameters after the step is not counted here.

    >>> [optimizer_step_bytes(o, "bf16-mixed") for o in ("adam", "sgd-momentum", "sgd")]
    [28, 20, 12]
    >>> optimizer_step_bytes("lion", "fp32")
    Traceback (most recent call last):
    ...
    cost_models.errors.PartitionerError: optimizer='lion' is not one of ['adam', 'adamw', 'sgd', 'sgd-momentum']
    """
    kind = "adam" if optimizer == "adamw" else optimizer  # AdamW keeps Adam's state; only its update differs
    if kind not in STATE_KINDS:
        raise PartitionerError(f"optimizer={optimizer!r} is not one of {sorted({'adamw', *STATE_KINDS})}")
    if precision not in PRECISIONS:
        raise PartitionerError(f"precision={precision!r} is not one of {list(PRECISIONS)}")
    k = int(model_state_bytes(1, precision="fp32", optimizer=kind, zero_stage=0, dp=1).optimizer) // 4
    element = 2 if precision == "bf16" else 4
    return (3 + 2 * k) * element


def optimizer_bytes_per_s(optimizer: str, device: DeviceSpec, cal: Calibration) -> float:
    """Bytes/s at which the optimizer step moves `optimizer_step_bytes`: HBM x device_speed x the step's efficiency.

    Adam and AdamW: `optimizer_eff`, what torch's multi-kernel implementation reaches (calibration.py: ~0.26 of
    HBM on an H200, measured). Plain SGD: `mem_eff`, the elementwise ops' rate: torch's step is one kernel
    (p -= lr g) that moves exactly the 12 B counted (measured on this project's CPU, one thread, gpt_small:
    37 GB/s at 12 B against AdamW's 6.2 GB/s at 28 B). SGD with momentum (3 kernels, 32 B for its 20) is
    priced as Adam.

    >>> from cost_models.devices import get_device
    >>> optimizer_bytes_per_s("adamw", get_device("H200-141GB"), Calibration(optimizer_eff=0.25)) / 1e12  # TB/s
    1.2
    >>> optimizer_bytes_per_s("sgd", get_device("H200-141GB"), Calibration(mem_eff=0.8)) / 1e12
    3.84
    """
    eff = cal.mem_eff if optimizer == "sgd" else cal.optimizer_eff
    return device.hbm_bytes_per_s * cal.device_speed * eff


def gradient_buffer_bytes(precision: str, zero_stage: int) -> tuple[int, int]:
    """(bytes per parameter per microbatch, per step) the data-parallel engine moves around its gradient
    buffers, beyond the model's ops and the optimizer step: elementwise, at the memory rate.

    Per microbatch, each parameter's gradient (the compute dtype, e_c bytes an element) is added into its
    flat buffer in the gradients' dtype (e_m: fp32, or the compute dtype under pure bf16), in the hook of its
    accumulation (runtime.engines.dp_buckets): e_c read, e_m read and written. ZeRO-2 also zeroes a fresh
    buffer each microbatch (its reduce-scatter takes the last one); ZeRO-3 casts each unit's gradient to
    e_m for its reduce-scatter (runtime.engines.zero3) and adds nothing. Per step, DDP and ZeRO-1 zero their
    buffers, and mixed-precision DDP copies the fp32 masters into the 16-bit parameters (e_m read, e_c
    written; at ZeRO >= 1 the updated shards reach the parameters through the all-gather). On an H200 these
    were about a third of what one Llama layer took beyond the plan (docs/benchmarks.md, "The third lent
    H200").

    >>> gradient_buffer_bytes("bf16-mixed", 0), gradient_buffer_bytes("fp32", 0), gradient_buffer_bytes("bf16", 0)
    ((10, 10), (12, 4), (6, 2))
    >>> gradient_buffer_bytes("bf16-mixed", 2), gradient_buffer_bytes("bf16-mixed", 3)
    ((14, 0), (6, 0))
    """
    if precision not in PRECISIONS:
        raise PartitionerError(f"precision={precision!r} is not one of {list(PRECISIONS)}")
    e_c = 4 if precision == "fp32" else 2
    e_m = 2 if precision == "bf16" else 4
    if zero_stage == 3:
        return e_c + e_m, 0
    if zero_stage == 2:
        return e_c + 3 * e_m, 0
    mixed = e_c != e_m
    return e_c + 2 * e_m, e_m + ((e_m + e_c) if zero_stage == 0 and mixed else 0)
