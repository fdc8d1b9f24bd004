"""Each rank's random number generators in a checkpoint, so dropout draws the same masks after a resume.

Two generators feed a rank's random ops: the CPU one (`torch.get_rng_state`, saved as "rng/RANK" since
the first format) and, when the rank's device has a generator of its own (CUDA, or any accelerator
whose torch module has `get_rng_state(device)`), that device's: dropout on a GPU draws from it, not from
the CPU's. It is saved as "rng_TYPE/RANK" ("rng_cuda/3"), a byte tensor on the CPU like the CPU state.
A checkpoint without it (saved on a CPU, or before this key existed) loads as before: the device
generator keeps its seed, and a warning says the draws after the resume are not those of an unbroken run.

>>> device_rng_key(3, torch.device("cpu")) is None, device_rng_key(3, torch.device("cuda", 1))
(True, 'rng_cuda/3')
"""

from __future__ import annotations

import torch

__all__ = ["device_rng_key", "device_rng_state", "set_device_rng_state"]


def _generator_module(device: torch.device):
    """torch.cuda (torch.xpu, ...) when `device` has a generator of its own; None for the CPU and meta."""
    if device.type in ("cpu", "meta"):
        return None
    module = torch.get_device_module(device.type)
    return module if hasattr(module, "get_rng_state") and hasattr(module, "set_rng_state") else None


def device_rng_key(rank: int, device: torch.device) -> str | None:
    """The checkpoint key of `rank`'s device generator; None when its device has none apart from the CPU's."""
    return None if _generator_module(device) is None else f"rng_{device.type}/{rank}"


def device_rng_state(device: torch.device) -> torch.Tensor | None:
    """The state of `device`'s generator (a CPU byte tensor), None for a device without one."""
    module = _generator_module(device)
    return None if module is None else module.get_rng_state(device).clone()


def set_device_rng_state(device: torch.device, state: torch.Tensor) -> None:
    """Restore `device`'s generator to `state` (what `device_rng_state` returned on the same kind of device)."""
    module = _generator_module(device)
    if module is None:
        raise ValueError(f"device {device} has no generator of its own: its random ops draw from the CPU's")
    module.set_rng_state(state.to("cpu", torch.uint8), device)
