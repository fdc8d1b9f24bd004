"""torch.autograd.Function classes a model applies, and whether code cut from the traced graph keeps their backward.

torch.export traces through a Function's forward and keeps its ops, not its backward. Generated stage code then
differentiates those ops. That is the Function's own gradient where its backward is the derivative of its forward
(BLOOM's tanh GELU, written out by hand for speed), and another gradient where it is not: a straight-through
estimator (the derivative of a rounding is zero), PhiMoE's sparsemixer (an estimator for the router's scores,
which its forward does not read). While a model is exported, `recording` notes each Function applied outside
torch's own, with the shapes and dtypes of its arguments; `differs_from_its_forward` then steps it on random
values of those shapes (a small square for one whose tensors all share a shape, as an elementwise function's do)
and compares its backward with autograd of its forward. The Functions that differ, or cannot be tried, are the
ones stage code would train wrong (OpGraph.custom_functions).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["Applied", "differs_from_its_forward", "recording"]

_MAX_ELEMENTS = 1 << 22  # the largest argument tried at its traced shape


class Applied:
    """One Function class as the forward applied it first: the class, and each argument's (shape, dtype) if a
    tensor, else the value."""

    def __init__(self, cls: type, args: tuple):
        self.cls = cls
        self.args = tuple((_shape(a), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)

    @property
    def name(self) -> str:
        try:
            where = f"{inspect.getsourcefile(self.cls)}:{inspect.getsourcelines(self.cls)[1]}"
        except (OSError, TypeError):
            where = "source not found"
        return f"{self.cls.__module__}.{self.cls.__qualname__} ({where})"


@contextlib.contextmanager
def recording(found: dict[type, Applied]):
    """Record, into `found`, each torch.autograd.Function subclass applied while the block runs, outside torch's
    own, with its first call's arguments."""
    original = torch.autograd.Function.__dict__["apply"]
    call = original.__func__

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith("torch.") and cls not in found:
            found[cls] = Applied(cls, args)
        return call(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield found
    finally:
        torch.autograd.Function.apply = original


def differs_from_its_forward(applied: Applied) -> bool:
    """Whether the Function's backward is not autograd of its forward, on random arguments of the recorded shapes
    (index and mask arguments zeros, a valid index of any size); True where it cannot be tried."""
    shapes = [a[0] for a in applied.args if isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], torch.dtype)]
    if not shapes:
        return False  # no tensor in: nothing to differentiate
    alike = all(s == shapes[0] for s in shapes)
    if not alike and max(math.prod(s) for s in shapes) > _MAX_ELEMENTS:
        return True
    try:
        return not _agrees(applied, small=alike)
    except Exception:  # noqa: BLE001 (a Function that cannot run on made-up values: not tried, so kept apart)
        return True


def _agrees(applied: Applied, *, small: bool) -> bool:
    g = torch.Generator().manual_seed(0)

    def make(a: Any) -> Any:
        if not (isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], torch.dtype)):
            return a
        shape, dtype = ((16, 16) if small else a[0]), a[1]
        if dtype.is_floating_point:
            return torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_()
        return torch.zeros(shape, dtype=dtype)

    args = [make(a) for a in applied.args]
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    own = applied.cls.apply(*args)
    traced = _forward(applied.cls, args)
    outs = [(o, t) for o, t in zip(_tensors(own), _tensors(traced)) if o.requires_grad or t.requires_grad]
    if not outs:
        return True
    grads = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o, _ in outs]
    mine = torch.autograd.grad([o for o, _ in outs], inputs, grads, allow_unused=True)
    theirs = torch.autograd.grad([t for _, t in outs if t.requires_grad], inputs,
                                 [d for (_, t), d in zip(outs, grads) if t.requires_grad], allow_unused=True)
    for a, b in zip(mine, theirs):
        a = torch.zeros(()) if a is None else a
        b = torch.zeros(()) if b is None else b
        scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
        if float((a - b).abs().max()) > 1e-5 * scale:
            return False
    return True


def _forward(cls: type, args: list) -> Any:
    """The Function's forward as plain ops under autograd (what the trace keeps), its ctx a stand-in."""
    if cls.setup_context is not torch.autograd.Function.setup_context:  # forward(*args); setup_context apart
        return cls.forward(*args)
    return cls.forward(_Ctx(), *args)


class _Ctx:
    """What a forward may call on ctx, doing nothing (the backward never runs here)."""

    needs_input_grad: tuple = ()
    saved_tensors: tuple = ()

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def mark_dirty(self, *args: Any) -> None:
        pass

    def mark_non_differentiable(self, *args: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    """The tensor's sizes as ints: a symbolic size (a fake tensor's, during export) by its hint."""
    out = []
    for d in t.shape:
        if isinstance(d, int):
            out.append(d)
        else:
            hint = getattr(getattr(d, "node", None), "hint", None)
            out.append(int(hint) if hint is not None else 2)
    return tuple(out)
