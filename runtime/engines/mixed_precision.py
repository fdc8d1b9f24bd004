"""Precision policy for the data-parallel engine: 16-bit compute, fp32 masters (or none: pure bf16).

Mixed ("bf16-mixed", "fp16-mixed", "fp8-mixed"): the model's parameters are cast to the compute dtype; the
optimizer steps fp32 master copies; gradients are upcast to fp32 *before* they are reduced, so
the data-parallel average is taken in fp32 (the ZeRO / Megatron recipe, and FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``). A plan with grad_reduce_dtype="bf16"
reduces them with the "bf16" compressor (runtime.compression.grad_compression): divided by the group
size, summed in bf16, accumulated into the fp32 gradients again.

"fp8-mixed" is bf16-mixed whose linear layers run their GEMMs on float8 operands with per-tensor current
scaling (runtime.engines.fp8): the engine puts an `Fp8Linear` in place of each `nn.Linear` of a model run by
its own forward; generated code calls `fp8_linear` itself.

Pure ("bf16", Composer's PURE): parameters, gradients and the optimizer's state all in bf16; no
masters (``master_dtype`` is the compute dtype), the optimizer steps the bf16 parameters themselves,
gradients are accumulated and reduced in bf16.

fp16 additionally needs loss scaling (its exponent range is too small for raw
gradients). `LossScaler` is a dynamic scaler with torch's `GradScaler`
defaults except the start value: the engine multiplies the gradient flowing
into the model's outputs by ``scale`` (so the caller's ``loss.backward()``
needs no change), divides it out of the fp32 gradients, and when any rank saw
an inf/NaN it halves the scale and skips the step. The scaling sits on the
outputs the caller sees (`scale_grad` wraps each one), not on tensors inside the
model: an output computed from another (GPT's loss from its logits) must not be
scaled twice.

>>> policy("bf16-mixed").param_dtype, policy("bf16-mixed").loss_scaling
(torch.bfloat16, False)
>>> policy("bf16").master_dtype, policy("bf16").mixed, policy("bf16-mixed").mixed
(torch.bfloat16, False, True)
>>> s = LossScaler(); s.scale, s.update(found_inf=True), s.scale
(32768.0, None, 16384.0)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_map

from cost_models.choices import PRECISIONS
from cost_models.choices import Precision as PrecisionChoice

__all__ = ["Fp16OverflowError", "LossScaler", "Precision", "PrecisionName", "cast_floating", "policy", "scale_grad"]


class Fp16OverflowError(RuntimeError):
    """fp16 gradients that are not finite even at a loss scale below 1: no scale can make a step, so training
    would go on skipping every step while its loss looks normal."""


PrecisionName = PrecisionChoice  # cost_models.choices.Precision: this module's Precision is the policy


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    name: PrecisionName
    """The user's name for the policy."""
    param_dtype: torch.dtype
    """Dtype the model's parameters are cast to and the forward/backward compute in."""
    master_dtype: torch.dtype = torch.float32
    """Dtype of what the optimizer steps and of the gradient buffers gradients accumulate and are reduced in
    (fp32; the compute dtype under pure bf16, which keeps no masters)."""
    loss_scaling: bool = False
    """Whether gradients are scaled during backward (fp16 only) by a dynamic `LossScaler`."""
    fp8_gemms: bool = False
    """Whether the linear layers' GEMMs take float8 operands (fp8-mixed: runtime.engines.fp8); the rest is
    bf16-mixed."""

    @property
    def mixed(self) -> bool:
        """True when the model computes in 16-bit and separate fp32 masters exist."""
        return self.param_dtype != self.master_dtype

    @property
    def casts_inputs(self) -> bool:
        """True when the model computes in a 16-bit dtype, so floating inputs are cast to it."""
        return self.param_dtype != torch.float32


_POLICIES = {
    "fp32": Precision(name="fp32", param_dtype=torch.float32),
    "bf16-mixed": Precision(name="bf16-mixed", param_dtype=torch.bfloat16),
    "fp16-mixed": Precision(name="fp16-mixed", param_dtype=torch.float16, loss_scaling=True),
    "bf16": Precision(name="bf16", param_dtype=torch.bfloat16, master_dtype=torch.bfloat16),
    "fp8-mixed": Precision(name="fp8-mixed", param_dtype=torch.bfloat16, fp8_gemms=True),
}
assert tuple(_POLICIES) == PRECISIONS


def policy(name: str) -> Precision:
    """The `Precision` for a name; ValueError naming the choices otherwise."""
    if name not in _POLICIES:
        raise ValueError(f"precision={name!r} is not one of {sorted(_POLICIES)}")
    return _POLICIES[name]


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a pytree (a forward's args/kwargs) to `dtype`;
    integer tensors (token ids, targets) and non-tensors pass through."""
    return tree_map(lambda x: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x, tree)


@dataclasses.dataclass
class LossScaler:
    """Dynamic loss scale: x backoff on an overflow, x growth after `growth_interval` clean steps.

    Defaults from `torch.amp.GradScaler` (growth 2.0, backoff 0.5, interval 2000)
    except ``scale=2**15``: the engine scales the gradient *in* the 16-bit output
    (not an fp32 loss, as GradScaler does), and 2**16 overflows fp16 (max 65504)
    for any output gradient of magnitude >= 1, so GradScaler's start value would
    waste the first step.
    """

    scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0
    skipped_steps: int = 0

    def update(self, *, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by the scaler's current scale."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scaler: LossScaler) -> torch.Tensor:
        ctx.scaler = scaler
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scaler.scale, None


def scale_grad(tree: Any, scaler: LossScaler) -> Any:
    """Wrap every floating tensor that requires grad in a pytree (a forward's output) so the
    gradient entering it is multiplied by ``scaler.scale``."""
    return tree_map(lambda x: _ScaleGrad.apply(x, scaler)
                    if torch.is_tensor(x) and x.requires_grad and x.is_floating_point() else x, tree)
