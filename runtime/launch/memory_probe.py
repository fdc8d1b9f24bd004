"""Peak memory of a training step on any device, CUDA or not: what autotune checks predictions against.

CPU tensors have no allocator statistics (nothing like torch.cuda.max_memory_allocated),
and a process's resident set holds torch itself, freed pages malloc keeps and
shared libraries. So the probe counts what the memory model predicts: the bytes
of the tensor storages a training step works with.

- Held before the block: every storage live on entry (a walk over the
  garbage collector's tensors, their `.grad` included) that the block reads
  or writes: parameters, optimizer state, persistent gradient buffers, module
  buffers, the batch. What the step never touches (a launcher's copy of the
  model for making data, the other steps' batches) is not the step's memory.
- Allocated inside: a TorchDispatchMode sees every op's outputs; a storage
  that none of the op's inputs holds is a new allocation, counted until Python
  frees it (a weakref finalizer). A storage held before the block and freed
  inside it comes off the count the same way.
- Resized in place: a storage that was empty on entry and grows
  (`untyped_storage().resize_(n)`, how ZeRO-3/FSDP gather a unit; resize_ is
  no op the mode sees) is re-read after every op, so its gathered bytes count
  while they are held.

`peak_bytes` = bytes held before the block (as defined above) + the most the
block added on top at any op.

>>> import torch
>>> model = torch.nn.Linear(256, 256)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
>>> def step(batch):                   # one training step, as a program's runner.step(batch)
...     model(batch).square().mean().backward()
...     opt.step()
...     opt.zero_grad()
>>> batch = torch.randn(32, 256)
>>> with PeakMemory() as probe:
...     step(batch)
>>> probe.peak_bytes
822272

With `limit_bytes`, an allocation that takes the live bytes past the limit
raises torch.OutOfMemoryError, as a GPU's allocator would at its capacity: a
trial planned for a device's memory fails like on that device.

>>> with PeakMemory(limit_bytes=500_000):
...     step(batch)
Traceback (most recent call last):
...
torch.OutOfMemoryError: aten.mm.default: 0.6 MiB would be live, over the 0.5 MiB this rank may use (0.3 MiB held ...)

Overhead: one Python call per op (tens of percent), and the walk on entry
(about 0.1 s): time steps without it.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["PeakMemory", "live_storages"]


def _storages(tree) -> dict[int, torch.UntypedStorage]:
    """The storages of the tensors in `tree`, by StorageImpl identity (stable across resize_, unlike data_ptr)."""
    out = {}
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            out[s._cdata] = s
    return out


def live_storages() -> dict[int, torch.UntypedStorage]:
    """Every tensor storage live in this process now (plain tensors and parameters, and their .grad).

    Tensors only C++ holds (an autograd graph's saved tensors) are not found: call it between steps.
    """
    out: dict[int, torch.UntypedStorage] = {}
    for o in gc.get_objects():
        # plain tensors only: a wrapper subclass (DTensor, FakeTensor) has no storage of its own
        if type(o) not in (torch.Tensor, torch.nn.Parameter) or o.layout != torch.strided or o.is_meta:
            continue
        for t in (o, o.grad if o.is_leaf and o.requires_grad else None):
            if t is not None and t.layout == torch.strided and not t.is_meta:
                s = t.untyped_storage()
                out[s._cdata] = s
    return out


class PeakMemory(TorchDispatchMode):
    """The bytes of tensor storages the `with` block works with: `peak_bytes` is their most at any op.

    baseline: what the caller counts as held before the block (e.g. a runner's held_bytes()), kept as
        `claimed_baseline` for comparison only. The probe counts what is held itself (`baseline`, the
        storages live on entry that the block touched): a runner's held_bytes() is its peak so far,
        gradients included, which ZeRO-2/3 and a pipeline's tied parameters free between steps (they
        would count twice, held and reallocated), and it sees only parameters, gradients and
        optimizer state.
    """

    def __init__(self, *, baseline: int | None = None, limit_bytes: float | None = None):
        super().__init__()
        self.claimed_baseline = baseline
        self.baseline = 0  # bytes of the storages live on entry that the block touched
        self.limit_bytes = limit_bytes
        self.live: dict[int, int] = {}  # storages allocated inside the block -> bytes
        self.current = 0  # bytes live now beyond `baseline`
        self.peak = 0
        self._entry: dict[int, tuple[weakref.ref, int]] = {}  # live on entry, untouched so far
        self._held: dict[int, int] = {}  # live on entry, touched, not freed -> bytes now
        self._resizable: list[tuple[weakref.ref, int]] = []  # empty on entry: re-read after every op
        self._finalizers: list[weakref.finalize] = []

    @property
    def peak_bytes(self) -> int:
        return self.baseline + self.peak

    def __enter__(self):
        for key, s in live_storages().items():
            self._entry[key] = (weakref.ref(s), s.nbytes())
            self._finalizers.append(weakref.finalize(s, self._free_entry, key))
            if s.nbytes() == 0:
                self._resizable.append((weakref.ref(s), key))
        return super().__enter__()

    def __exit__(self, *exc):
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = _storages((args, kwargs))
        outputs = _storages(out)
        for key in (*inputs, *outputs):
            self._touch(key, func)
        self._reread_resized()
        for key, s in outputs.items():
            # in-place ops and views return their inputs' storages: nothing new
            if key in inputs or key in self.live or key in self._held:
                continue
            n = s.nbytes()
            self.live[key] = n
            self._finalizers.append(weakref.finalize(s, self._free, key))
            self._grow(n, func)
        return out

    def _touch(self, key: int, what) -> None:
        """A storage live on entry is used: it is part of what the block holds from the start."""
        hit = self._entry.pop(key, None)
        if hit is None:
            return
        n = hit[1]
        self._held[key] = n
        self.baseline += n
        self._grow(0, what)

    def _reread_resized(self) -> None:
        for ref, key in self._resizable:
            s = ref()
            if s is None or key not in self._held:
                continue
            n = s.nbytes()
            if n != self._held[key]:
                delta, self._held[key] = n - self._held[key], n
                self._grow(delta, "untyped_storage().resize_")

    def _grow(self, n: int, what) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)
        if self.limit_bytes is not None and self.peak_bytes > self.limit_bytes:
            raise torch.OutOfMemoryError(
                f"{what}: {self.peak_bytes / 2**20:.1f} MiB would be live, over the "
                f"{self.limit_bytes / 2**20:.1f} MiB this rank may use ({self.baseline / 2**20:.1f} MiB "
                "held before the step)")

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def _free_entry(self, key: int) -> None:
        self._entry.pop(key, None)
        self.current -= self._held.pop(key, 0)


class CudaPeakMemory:
    """The probe on a GPU: the caching allocator's own peak over the block (`torch.cuda.max_memory_allocated`,
    and `max_memory_reserved` beside it), with what was allocated on entry, since the CPU probe's walk would
    count host storages and miss the device's. With `limit_bytes`, the allocator is capped to that share of
    the device for the block (`set_per_process_memory_fraction`), so going past it raises
    torch.OutOfMemoryError as a smaller device would."""

    def __init__(self, device: torch.device, *, limit_bytes: float | None = None):
        self.device, self.limit_bytes = device, limit_bytes
        self.peak_bytes = 0
        self.reserved_bytes = 0

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        if self.limit_bytes is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.limit_bytes / total), self.device)
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize(self.device)
        if self.limit_bytes is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        self.reserved_bytes = torch.cuda.max_memory_reserved(self.device)
        return False
