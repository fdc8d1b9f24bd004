"""One device per rank, and the one way the runtime puts tensors on it.

Each process trains on one device: `cuda:LOCAL_RANK` under NCCL, `cpu`
under Gloo (runtime.launch.env decides; `--device` overrides). The launcher
calls `set_rank_device` once, before the program's `build`; everything below
it (the stage model, the engines, the pipeline's receive buffers, checkpoints,
the memory probe) reads `rank_device()` or takes the device of a tensor it
already holds. Generated code names no device: its factories take the device
of their inputs (`arange(..., device=idx.device)`), so the batch's placement
decides theirs.

>>> set_rank_device("cpu")
device(type='cpu')
>>> x, y = place((torch.ones(2, 3), {"t": torch.zeros(2)}))
>>> x.device, y["t"].device
(device(type='cpu'), device(type='cpu'))
>>> check_device("cuda:99")
Traceback (most recent call last):
...
runtime.device.placement.DeviceError: device cuda:99 was asked for, but this machine has ...
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

# cost_models imports nothing of the project, so the runtime may share its base error (one direction holds).
from cost_models.errors import PartitionerError

__all__ = ["DeviceError", "check_device", "on_place", "place", "place_module", "placing_on", "rank_device", "set_rank_device",
           "synchronize"]


class DeviceError(PartitionerError):
    """A device this process cannot train on (no CUDA, an index past the GPUs there are)."""


_device = torch.device("cpu")  # the process's rank device: set once by the launcher, read by the runtime
_on_place: Callable[[Any], None] | None = None  # the device audit's hook (runtime.device.audit)


def rank_device() -> torch.device:
    """The device this rank trains on (cpu until a launcher sets it)."""
    return _device


def check_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device this process can use, or DeviceError saying why not and what to pass."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"device {device!r} is not a device name ({str(exc).split(' device type')[0]}): pass cpu, "
                          "cuda or cuda:N") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise DeviceError(f"device {device!r}: the runtime trains on cpu (Gloo) or cuda (NCCL), not {dev.type}")
    index = 0 if dev.index is None else dev.index
    if not torch.cuda.is_available():
        raise DeviceError(f"device cuda:{index} was asked for, but this machine has no CUDA (torch {torch.__version__}, "
                          f"torch.cuda.is_available() is False): run on a GPU node with a CUDA build of torch, "
                          "or pass --device cpu (Gloo)")
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"device cuda:{index} was asked for, but this machine has {count} GPU(s) "
                          f"(cuda:0..cuda:{count - 1}): start at most {count} processes per node, or set "
                          "CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", index)


def set_rank_device(device: str | torch.device) -> torch.device:
    """Make `device` this process's rank device (checked first); on CUDA also torch's current device, so
    NCCL and the caching allocator use it."""
    global _device
    dev = check_device(device)
    if dev.type == "cuda":
        # expandable segments unless the user configured the allocator: the planner's allocator slack
        # (cost_models.memory.ALLOCATOR_SLACK) was measured with them (torchtitan's launcher sets them too)
        if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        torch.cuda.set_device(dev)
    _device = dev
    return dev


@contextlib.contextmanager
def placing_on(device: str | torch.device) -> Iterator[torch.device]:
    """Inside, the runtime places on `device` instead of the rank's (plan.verify on the host of a GPU rank)."""
    global _device
    before, _device = _device, check_device(device)
    try:
        yield _device
    finally:
        _device = before


@contextlib.contextmanager
def on_place(hook: Callable[[Any], None]) -> Iterator[None]:
    """Inside, `hook(tensors)` sees every tensor `place` and `place_module` put on the device (the device
    audit's record of what was placed: on CPU a move to cpu is no op it could see)."""
    global _on_place
    before, _on_place = _on_place, hook
    try:
        yield
    finally:
        _on_place = before


def place(x: Any, device: torch.device | None = None) -> Any:
    """Every tensor of a (nested) batch on the rank's device; other values pass through.

    From CPU to a GPU the copy goes through pinned memory, non-blocking: the host returns at once and the
    copy is ordered before the kernels that read it on the current stream.
    """
    dev = rank_device() if device is None else device
    if isinstance(x, torch.Tensor):
        if x.device == dev:
            out = x
        elif dev.type == "cuda" and x.device.type == "cpu":
            out = x.pin_memory().to(dev, non_blocking=True)
        else:
            out = x.to(dev)
        if _on_place is not None:
            _on_place(out)
        return out
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(place(v, dev) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(place(v, dev) for v in x)
    if isinstance(x, Mapping):  # a dict, or a mapping such as Hugging Face's BatchEncoding: as a dict
        return {k: place(v, dev) for k, v in x.items()}
    return x


def place_module(module: nn.Module, device: torch.device | None = None) -> nn.Module:
    """`module`'s parameters and buffers on the rank's device, in place (what this rank keeps of the model:
    called after pipeline pruning and tensor slicing, so a GPU never holds the full model for them)."""
    dev = rank_device() if device is None else device
    module.to(dev)
    if _on_place is not None:
        _on_place([*module.parameters(), *module.buffers()])
    return module


def synchronize(device: torch.device | None = None) -> None:
    """Wait for the device's queued work (a no-op on CPU): before reading a clock or a peak."""
    dev = rank_device() if device is None else device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
