"""Peak memory of a training step on any device, CUDA or not: what autotune checks predictions against.

CPU tensors have no allocator statistics (nothing like torch.cuda.max_memory_allocated),
and a process's resident set holds torch itself, freed pages malloc keeps and
shared libraries. So the probe counts what the memory model predicts: the bytes
of tensor storages. A TorchDispatchMode sees every op's outputs; a storage
that none of the op's inputs holds is a new allocation, counted until Python
frees it (a weakref finalizer). Storages that existed before the probe
(parameters, optimizer state, persistent gradient buffers) are the `baseline`
the caller passes, e.g. the runner's held_bytes().

>>> with PeakMemory(baseline=held) as probe:    # doctest: +SKIP
...     runner.step(batch)
>>> probe.peak_bytes                             # doctest: +SKIP
152706264

With `limit_bytes`, an allocation that takes baseline + live bytes past the
limit raises torch.OutOfMemoryError, as a GPU's allocator would at its
capacity: a trial planned for a device's memory fails like on that device.
Overhead: one Python call per op (tens of percent): time steps without it.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["PeakMemory"]


def _storages(tree) -> dict[int, torch.UntypedStorage]:
    out = {}
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            if s.data_ptr():
                out[s.data_ptr()] = s
    return out


class PeakMemory(TorchDispatchMode):
    """Track live bytes of storages allocated inside the `with` block, and their peak plus `baseline`."""

    def __init__(self, *, baseline: int = 0, limit_bytes: float | None = None):
        super().__init__()
        self.baseline = int(baseline)
        self.limit_bytes = limit_bytes
        self.live: dict[int, int] = {}
        self.current = 0  # live bytes allocated inside the block
        self.peak = 0

    @property
    def peak_bytes(self) -> int:
        return self.baseline + self.peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = _storages((args, kwargs))
        for ptr, s in _storages(out).items():
            # in-place ops and views return their inputs' storages: nothing new
            if ptr in inputs or ptr in self.live:
                continue
            n = s.nbytes()
            self.live[ptr] = n
            self.current += n
            weakref.finalize(s, self._free, ptr)
            if self.current > self.peak:
                self.peak = self.current
                if self.limit_bytes is not None and self.peak_bytes > self.limit_bytes:
                    raise torch.OutOfMemoryError(
                        f"{func}: {self.peak_bytes / 2**20:.1f} MiB would be live, over the "
                        f"{self.limit_bytes / 2**20:.1f} MiB this rank may use ({self.baseline / 2**20:.1f} MiB "
                        "of state held before the step)")
        return out

    def _free(self, ptr: int) -> None:
        self.current -= self.live.pop(ptr, 0)
