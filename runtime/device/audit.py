"""The device audit: fail on any op that mixes a tensor on the rank's device with one never put there.

On a CPU machine every tensor is on `cpu`, so comparing `tensor.device`s
sees nothing: a factory that forgot `device=` gives a CPU tensor that is
right by accident here and wrong on a GPU (where NCCL refuses it, or an op
raises "Expected all tensors to be on the same device" at step 1). The audit
tracks placement itself instead:

- placed: a storage is on the rank's device when the runtime put it there
  (`runtime.device.place`, `place_module`: the one way it moves tensors),
  when a factory was called with a device (`torch.zeros(n, device=x.device)`:
  the call's own source is read, since at the ATen level `torch.zeros(n)` is
  also given device=cpu), when torch made it inside an op (autograd's zero
  gradients: they take the op's device), or when an op made it from a placed
  input (`torch.empty_like(p)`, `x + 1`, a view). Storages, not tensor
  objects, carry the mark, so `.data`, views and flat-buffer re-pointing keep it.
- refused: an op whose inputs include a placed tensor and an unplaced one of
  one or more dimensions (0-dim CPU tensors are legal beside CUDA ones as
  inputs, but not as the tensor an op writes into), and any collective
  (`c10d.*`) given an unplaced tensor. `copy_` is exempt: copying between
  devices is what it is for.

What the rules rest on was measured on an H100 (docs/torch-notes.md#mixing-devices-on-cuda). Not seen: a
factory that names `device="cpu"` outright counts as placed on a CPU run (name the device of the tensors it
goes with instead); and `.to(device)` to where a tensor already is runs no op at all, so on CPU it marks
nothing (move with `runtime.device.place`, which marks what it moves). Index tensors of `x[idx]` and
`index_put_` may stay on the host, as CUDA allows.

The error names the ATen op, the unplaced tensor and the innermost line of
project or generated-program code (a rank's `rank_R.py` line included)::

    DeviceAuditError: aten.add.Tensor at rank_0.py:95 in prefix: an input of shape (2, 16, 128) ...

Opt in with `launch_local(..., device_audit=True)`, `python -m runtime.run ...
--device-audit`, or PARTITIONER_DEVICE_AUDIT=1 in the environment of either.
Overhead: a Python call per op; for tests, not training.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from runtime.device.placement import on_place, rank_device

__all__ = ["DeviceAuditError", "device_audit", "audit_requested", "AUDIT_ENV"]

AUDIT_ENV = "PARTITIONER_DEVICE_AUDIT"

_TORCH_DIR = str(Path(torch.__file__).parent)
_HERE = str(Path(__file__))
# What runs between an op's Python caller and __torch_dispatch__: the mode machinery, dynamo's disable wrapper.
_DISPATCH_FILES = frozenset(str(Path(torch.__file__).parent / f) for f in (
    "utils/_python_dispatch.py", "_dynamo/eval_frame.py", "_compile.py"))
# Ops that legitimately take tensors on two devices.
_CROSS_DEVICE = {"aten::copy_", "aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize",
                 "aten::lift_fresh", "aten::set_"}


# Ops whose index tensors may stay on the host beside CUDA data (measured: `cuda_tensor[cpu_index]` works; a
# Python list index becomes such a tensor, as in Hugging Face Falcon's `fused_qkv[..., [-2], :]`).
_HOST_INDICES = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})
_OBJECT_COLLECTIVES = frozenset({"gather_object", "all_gather_object", "broadcast_object_list", "scatter_object_list",
                                 "send_object_list", "recv_object_list"})


class DeviceAuditError(RuntimeError):
    """An op would mix devices on a GPU: the message names the op, the tensor and the line."""


def audit_requested(environ=os.environ) -> bool:
    """Whether PARTITIONER_DEVICE_AUDIT asks for the audit (1) or not (unset, 0)."""
    flag = environ.get(AUDIT_ENV, "")
    if flag not in ("", "0", "1"):
        raise ValueError(f"{AUDIT_ENV}={flag!r}: set it to 1 to audit device placement, or unset it")
    return flag == "1"


class _Placed:
    """The storages on the rank's device, by storage identity (weak: a freed storage leaves the set)."""

    def __init__(self) -> None:
        self._storages = WeakIdKeyDictionary()

    def mark(self, tree) -> None:
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._storages[t.untyped_storage()] = True

    def has(self, t: torch.Tensor) -> bool:
        return t.device.type == "meta" or t.untyped_storage() in self._storages


class _DispatchLevel(TorchDispatchMode):
    """Sees every ATen and c10d op (backward and its hooks included): checks its tensors, propagates the mark."""

    def __init__(self, placed: _Placed):
        super().__init__()
        self.placed = placed
        self._named: dict[tuple[str, int, int], bool] = {}  # call site -> whether the call names a device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.name not in _CROSS_DEVICE:
            self._check(func, schema, args, kwargs)
        out = func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and t.device.type != "meta"]
        if any(self.placed.has(t) for t in tensors) or \
                ((not tensors or schema.name == "aten::lift_fresh") and self._factory_placed()):
            self.placed.mark(out)
        return out

    def _factory_placed(self) -> bool:
        """A tensor made from no tensor (a factory): placed unless project code called the factory itself
        without naming a device. A factory torch runs inside an op (the autograd engine's zero gradients,
        a loss's buffers) takes the device of that op's tensors, which the check of that op covers."""
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename == _HERE or frame.f_code.co_filename in _DISPATCH_FILES):
            frame = frame.f_back
        if frame is None or frame.f_code.co_filename.startswith(_TORCH_DIR):
            return True
        key = (frame.f_code.co_filename, frame.f_lineno, frame.f_lasti)
        if key not in self._named:
            self._named[key] = _call_names_device(frame)
        return self._named[key]

    def _check(self, func, schema, args, kwargs) -> None:
        collective = schema.name.startswith("c10d::")
        written = _written(schema, args, kwargs)
        if schema.name in _HOST_INDICES:  # (self, indices, ...): the indices may be host tensors
            args = (args[0], *args[2:])
        inputs = [(t, id(t) in written) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"]
        if not inputs:
            return
        unplaced = [(t, w) for t, w in inputs if not self.placed.has(t)]
        if not unplaced:
            return
        if collective and not _in_object_collective():
            t, _ = unplaced[0]
            raise DeviceAuditError(f"{func} at {_where()}: a collective was given a tensor of shape {tuple(t.shape)} "
                                   f"({t.dtype}) the runtime never put on the rank's device ({rank_device()}): NCCL "
                                   "refuses it on a GPU. Make it with device= the device of the tensors it "
                                   "belongs with (or runtime.device.place it)")
        if collective or len(unplaced) == len(inputs):
            return
        bad = [(t, w) for t, w in unplaced if t.dim() > 0 or w]
        if bad:
            t, w = bad[0]
            role = "the output it writes into" if w else "an input"
            raise DeviceAuditError(f"{func} at {_where()}: {role}, of shape {tuple(t.shape)} ({t.dtype}), was never "
                                   f"put on the rank's device ({rank_device()}) while another tensor of the op was: "
                                   "on a GPU this op mixes devices. Make it with device= the device of its inputs "
                                   "(e.g. torch.zeros(n, device=x.device)), or move it with runtime.device.place")


def _in_object_collective() -> bool:
    """Inside torch's *_object collectives, which pickle to a byte tensor and move it to the device the
    backend needs themselves (torch.distributed's own code, not the runtime's)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _OBJECT_COLLECTIVES and frame.f_code.co_filename.startswith(_TORCH_DIR):
            return True
        frame = frame.f_back
    return False


def _call_names_device(frame) -> bool:
    """Whether the call the frame is executing passes a device (`device=...`), read from its source span."""
    positions = list(frame.f_code.co_positions())
    i = frame.f_lasti // 2
    if i >= len(positions) or None in positions[i]:
        return False
    lo, hi, c0, c1 = positions[i]  # the span of the call expression
    lines = [linecache.getline(frame.f_code.co_filename, n) for n in range(lo, hi + 1)]
    if not any(lines):
        return False
    text = lines[0][c0:c1] if lo == hi else lines[0][c0:] + "".join(lines[1:-1]) + lines[-1][:c1]
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return "device" in text
    return any(isinstance(n, ast.keyword) and n.arg == "device" for n in ast.walk(tree))


def _written(schema, args, kwargs) -> set[int]:
    """id()s of the tensors the op writes into (self of an in-place op, out=)."""
    out = set()
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            for t in pytree.tree_leaves(v):
                if isinstance(t, torch.Tensor):
                    out.add(id(t))
    return out


def _where(depth: int = 3) -> str:
    """The innermost frames outside torch and this module (project code, a rank's program, the user's), the
    innermost with its line of code: `collectives.py:94 in all_gather: `...` <- program_check.py:33 in ...`."""
    found = []
    for frame in reversed(traceback.extract_stack()):
        f = frame.filename
        if f == _HERE or f.startswith(_TORCH_DIR) or f.startswith("<frozen"):
            continue
        where = f"{Path(f).name}:{frame.lineno} in {frame.name}"
        if not found and frame.line:
            where += f": `{frame.line.strip()}`"
        found.append(where)
        if len(found) == depth:
            break
    return " <- ".join(found) or "an unknown line"


@contextlib.contextmanager
def device_audit() -> Iterator[None]:
    """Run the block under the audit (see the module docstring); the rank device must be set first."""
    placed = _Placed()
    with _DispatchLevel(placed), on_place(placed.mark):
        yield
