"""Vocab-split logits handed to the user's loss_fn as they are, so that its cross entropy runs vocab-parallel.

Why: a tensor-parallel plan splits the LM head over the vocabulary (placement role "vocab_head"), so each
rank of the tensor group computes (..., V/tp) of the logits. Gathering them for a loss computed outside the
model costs the whole (..., V) on every rank: for a Llama-3 vocabulary (128K) at microbatch 16 x 8192
tokens, ~17 GB of bf16 logits a rank, and the loss's fp32 work on top. Megatron-LM and torchtitan
(`loss_parallel`) never gather: the cross entropy all-reduces three numbers per token (the max logit, the
sum of exp, the target logit) with `runtime.pipeline.tensor_parallel.vocab_parallel_cross_entropy`, and the
plan's memory assumes it does.

`VocabSplitLogits` does what torch's DTensor `loss_parallel()` does, without DTensor. Generated code returns
this rank's slice wrapped (`tp_vocab_logits`); to the loss_fn it looks like the full logits:

- `size()`, `.shape`, `numel()`, `len()` are the full tensor's; `dim()`, dtype, device, requires_grad,
  grad_fn are the slice's (the same);
- ops that keep the vocabulary dim whole and last run on the slice and stay wrapped: `view`/`reshape` with
  sizes in full terms (the last one V, or a -1 that works out to V), `view_as`/`reshape_as`, `flatten` that
  leaves the last dim alone, indexing by ints and slices that leaves the last dim untouched
  (`out[:, :-1]`, `out[..., :-1, :]`), `contiguous`, `detach`, `clone`, `float()` (`half`, `bfloat16`,
  `double`), `to(dtype)`, `type_as`;
- `F.cross_entropy(logits, targets)` (so `nn.CrossEntropyLoss`) on 2-d (N, V) logits with class-index
  targets, no class weights, the mean or sum reduction and no label smoothing (`ignore_index` kept): the
  vocab-parallel cross entropy on the slice, never the logits gathered;
- anything else reads the full logits: every wrapped argument is all-gathered (autograd-aware: the gradient
  keeps this rank's slice), the function runs on plain tensors and returns plain tensors, so results and
  gradients are those of the gathered logits; a `VocabLogitsGatheredWarning` says so once a process, since
  the plan's memory assumed no gather;
- in-place ops on the logits are refused (the gathered copy is not what the caller holds).

Every rank of the tensor group must run the same loss_fn on its slice: the cross entropy and the gathers are
collectives over the group. `repr()` shows the slice without a collective (printing on one rank must not
hang); `logits.full_tensor()` gathers on purpose, without the warning, and `logits.to_local()` is the slice.

>>> from runtime.comm.collectives import Collectives
>>> z, y = torch.randn(2, 3, 8), torch.randint(0, 8, (2, 3))
>>> out = tp_vocab_logits(z, TPContext(None, Collectives(), 0, 1))      # one rank holds the whole vocabulary
>>> out.shape, type(F.cross_entropy(out.flatten(0, 1), y.flatten())).__name__
(torch.Size([2, 3, 8]), 'Tensor')
>>> torch.allclose(F.cross_entropy(out[:, :-1].reshape(-1, 8), y[:, 1:].reshape(-1)),
...                F.cross_entropy(z[:, :-1].reshape(-1, 8), y[:, 1:].reshape(-1)))
True
"""

from __future__ import annotations

import inspect
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import resolve_name

from runtime.pipeline.tensor_parallel import TPContext, tp_gather, vocab_parallel_cross_entropy

__all__ = ["VocabLogitsGatheredWarning", "VocabSplitLogits", "full_logits", "tp_vocab_logits"]

_Tensor = torch.Tensor


class VocabLogitsGatheredWarning(UserWarning):
    """A loss_fn read vocab-split logits through something other than the vocab-parallel cross entropy."""


_warned = False  # once a process: a loss_fn runs every microbatch


def _warn_gathered(func: Callable) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(f"{_name(func)} read the model's vocab-split logits, so they were all-gathered (V/tp -> V per "
                  "rank): the loss_fn reads them through something other than a cross entropy. The plan's memory "
                  "assumes a vocab-parallel cross entropy: F.cross_entropy(logits.view(-1, V), targets.view(-1)) "
                  "with no class weights, the mean or sum reduction and no label smoothing. Results are exact "
                  "either way",
                  VocabLogitsGatheredWarning, stacklevel=_callers_level())


def _callers_level() -> int:
    """The stacklevel of the first frame outside this module and torch (the loss_fn's line), for the warning
    that _warn_gathered issues: a method reaches __torch_function__ straight from C, F.* through torch.overrides."""
    torch_dir = str(Path(torch.__file__).parent)
    frame, level = sys._getframe(2), 2  # _warn_gathered's caller
    while frame is not None and (frame.f_code.co_filename == __file__ or
                                 frame.f_code.co_filename.startswith(torch_dir)):
        frame, level = frame.f_back, level + 1
    return level


def _name(func: Callable) -> str:
    try:
        return resolve_name(func) or repr(func)
    except Exception:  # resolve_name reads attributes some callables lack
        return repr(func)


def _getters(*names: str) -> set:
    return {getattr(_Tensor, n).__get__ for n in names if hasattr(_Tensor, n)}


# Read off the slice as it is: the same for the full logits.
_METADATA = _getters("dtype", "device", "layout", "requires_grad", "is_leaf", "grad_fn", "ndim", "is_cuda", "is_cpu",
                     "is_meta", "is_sparse", "is_quantized", "is_nested", "itemsize") | {
    _Tensor.dim, _Tensor.ndimension, _Tensor.is_floating_point, _Tensor.is_complex, _Tensor.is_signed,
    _Tensor.element_size, _Tensor.get_device, _Tensor.is_contiguous, _Tensor.requires_grad_}
# Keep every element where it is (or cast it): run on the slice, still this rank's slice.
_ELEMENTWISE = {_Tensor.contiguous, _Tensor.detach, _Tensor.clone, _Tensor.float, _Tensor.half, _Tensor.bfloat16,
                _Tensor.double, _Tensor.type_as}
_VIEWS = {_Tensor.view, _Tensor.reshape, torch.reshape}
_VIEWS_AS = {_Tensor.view_as, _Tensor.reshape_as}
_FLATTENS = {_Tensor.flatten, torch.flatten}
_IN_PLACE_DUNDERS = {"__setitem__", "__set__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                     "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                     "__imatmul__"}
_CE_SIGNATURE = inspect.signature(F.cross_entropy)


class VocabSplitLogits(torch.Tensor):
    """This rank's vocabulary slice (..., V/tp) of a model's logits, seen by user code as the full (..., V).

    The tensor itself is the slice (made by `as_subclass`, so it stays in the autograd graph); `_tp` is the
    tensor group it is split over, rank r holding vocabulary ids [r * V/tp, (r + 1) * V/tp). See the module
    docstring for what runs on the slice and what reads the logits gathered."""

    _tp: TPContext

    @staticmethod
    def wrap(local: torch.Tensor, tp: TPContext) -> VocabSplitLogits:
        """`local`, this rank's slice, wrapped (an alias of it in the autograd graph)."""
        with torch._C.DisableTorchFunctionSubclass():
            out = local.as_subclass(VocabSplitLogits)
        out._tp = tp
        return out

    def to_local(self) -> torch.Tensor:
        """This rank's slice (..., V/tp) as a plain tensor, in the autograd graph (DTensor's name). No collective."""
        with torch._C.DisableTorchFunctionSubclass():
            return _plain(self)

    def full_tensor(self) -> torch.Tensor:
        """The full logits, all-gathered over the tensor group (the gradient keeps this rank's slice): a plain
        tensor. A collective: every rank of the group calls it."""
        with torch._C.DisableTorchFunctionSubclass():
            return _gather(self)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        # no collective: a debugger or a log line on one rank would wait for ever for the others
        with torch._C.DisableTorchFunctionSubclass():
            local = _Tensor.__repr__(_plain(self).detach())
            return (f"VocabSplitLogits(full shape {tuple(_full_shape(self))}, vocabulary slice {self._tp.rank} of "
                    f"{self._tp.world}:\n{local})")

    def __format__(self, spec: str) -> str:
        return object.__format__(self, spec)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            self = args[0] if args else None
            if not isinstance(self, VocabSplitLogits):
                if func is F.cross_entropy:
                    return _cross_entropy(args, kwargs)
                if isinstance(kwargs.get("out"), VocabSplitLogits):
                    _refuse_in_place(func)
                return _fallback(func, args, kwargs)
            if func in _METADATA:
                return func(*args, **kwargs)
            if func is _Tensor.__hash__:  # identity, as a plain tensor's: no collective
                return id(self)
            if func in (_Tensor.size, _Tensor.shape.__get__, _Tensor.numel, _Tensor.nelement, _Tensor.__len__):
                return _full_metadata(func, self, args[1:], kwargs)
            handler = _HANDLERS.get(func)
            out = handler(self, args[1:], kwargs) if handler is not None else NotImplemented
            if out is not NotImplemented:
                return out
            if _in_place(func) or isinstance(kwargs.get("out"), VocabSplitLogits):
                _refuse_in_place(func)
            return _fallback(func, args, kwargs)


def tp_vocab_logits(local: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """A model output split over the tensor group along its last dim (vocab-parallel logits), returned as
    `VocabSplitLogits`: a loss_fn's cross entropy runs on the slice, anything else reads it gathered."""
    return VocabSplitLogits.wrap(local, tp)


def full_logits(tree: Any) -> Any:
    """`tree` (a model's output) with every `VocabSplitLogits` all-gathered into a plain tensor, no warning
    (the gradient keeps each rank's slice): for code that reads the whole output on purpose. A collective."""
    return pytree.tree_map(lambda x: x.full_tensor() if isinstance(x, VocabSplitLogits) else x, tree)


# ---------------------------------------------------------------- the slice and the full tensor

def _plain(x: VocabSplitLogits) -> torch.Tensor:
    """This rank's slice as a plain tensor (an alias in the autograd graph). Under DisableTorchFunctionSubclass."""
    return x.as_subclass(_Tensor)


def _full_shape(x: VocabSplitLogits) -> torch.Size:
    local = _Tensor.size(x)
    return torch.Size((*local[:-1], local[-1] * x._tp.world)) if len(local) else local


def _gather(x: VocabSplitLogits) -> torch.Tensor:
    """The full logits: every rank's slice along the last dim; backward keeps this rank's slice of the gradient,
    which every rank computes alike (the same loss of the same full logits)."""
    return tp_gather(_plain(x), -1, x._tp)


def _fallback(func: Callable, args: tuple, kwargs: dict) -> Any:
    """func on the full logits: each wrapped argument gathered, plain tensors in and out."""
    _warn_gathered(func)
    args, kwargs = pytree.tree_map(lambda a: _gather(a) if isinstance(a, VocabSplitLogits) else a, (args, kwargs))
    return func(*args, **kwargs)


def _in_place(func: Callable) -> bool:
    name = getattr(func, "__name__", "")
    # retain_grad: the gathered copy would hold the gradient, not the tensor the caller reads .grad of
    return name in _IN_PLACE_DUNDERS or name == "retain_grad" or (name.endswith("_") and not name.startswith("_"))


def _refuse_in_place(func: Callable) -> None:
    what = "keep the gradient on a gathered copy, not on" if getattr(func, "__name__", "") == "retain_grad" else \
        "modify in place"
    raise RuntimeError(f"{_name(func)} would {what} the model's vocab-split logits: each rank holds only its slice "
                       "of the vocabulary (tensor parallelism), and the full logits the op needs are a gathered "
                       "copy; compute out of place (logits = logits.masked_fill(mask, v), not "
                       "logits.masked_fill_(mask, v)), or gather them first with logits.full_tensor()")


def _full_metadata(func: Callable, self: VocabSplitLogits, args: tuple, kwargs: dict) -> Any:
    shape = _full_shape(self)
    if func is _Tensor.size:
        dim = args[0] if args else kwargs.get("dim")
        if dim is None:
            return shape
        if not isinstance(dim, int):
            raise TypeError(f"size({dim!r}) of vocab-split logits: give the dim as an int (named dims are not kept)")
        return shape[dim]
    if func == _Tensor.shape.__get__:  # a getter's method-wrapper is made anew at each access: equal, not the same
        return shape
    if func is _Tensor.__len__:
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]
    return math.prod(shape)  # numel, nelement


# ---------------------------------------------------------------- ops that run on the slice

def _elementwise(self: VocabSplitLogits, args: tuple, kwargs: dict, func: Callable) -> Any:
    return VocabSplitLogits.wrap(func(_plain(self), *args, **kwargs), self._tp)


def _to(self: VocabSplitLogits, args: tuple, kwargs: dict) -> Any:
    """to(dtype), to(the slice's own device, dtype), to(device=..., dtype=...) (non_blocking and copy allowed) on
    the slice; to another device, like a tensor, or with a memory format: NotImplemented (read gathered)."""
    kw = dict(kwargs)
    device, dtype = kw.pop("device", None), kw.pop("dtype", None)
    if set(kw) - {"non_blocking", "copy"}:
        return NotImplemented
    for a in args:
        if isinstance(a, torch.dtype) and dtype is None:
            dtype = a
        elif isinstance(a, (str, torch.device)) and device is None:
            device = a
        else:
            return NotImplemented
    if device is not None and not _same_device(torch.device(device), self.device):
        return NotImplemented  # another device: its tensor group's collectives would not run there
    return VocabSplitLogits.wrap(_plain(self).to(dtype=dtype, **kw) if dtype is not None else _plain(self), self._tp)


def _same_device(want: torch.device, have: torch.device) -> bool:
    return want.type == have.type and want.index in (None, have.index)


def _local_sizes(self: VocabSplitLogits, sizes: Any) -> list[int] | None:
    """View sizes given in the full tensor's terms as the slice's, when the result keeps the vocabulary dim whole
    as its last: its last size is V (given, or a -1 that works out to V). Rows of V consecutive elements of a
    row-major tensor whose last dim is V are its vocabulary rows, so any such view keeps them whole; then
    the slice views to the same leading sizes. None otherwise."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    if not sizes or not all(type(s) is int for s in sizes) or sizes.count(-1) > 1:
        return None
    full = _full_shape(self)
    vocab, local_vocab = full[-1], _Tensor.size(self, -1)
    last = sizes[-1]
    if last == -1:
        known = math.prod(sizes[:-1])
        last = math.prod(full) // known if known > 0 and math.prod(full) % known == 0 else None
    if last != vocab:
        return None
    rows, lead = math.prod(full) // vocab, [s for s in sizes[:-1] if s != -1]
    if any(s < 0 for s in lead) or (math.prod(lead) != rows if len(lead) == len(sizes) - 1 else
                                    math.prod(lead) == 0 or rows % math.prod(lead)):
        return None  # not a view of these logits: the full tensor's op raises the error that says so
    return [*sizes[:-1], local_vocab]


def _view(self: VocabSplitLogits, args: tuple, kwargs: dict, func: Callable) -> Any:
    """view(*sizes) / view(sizes), reshape likewise, torch.reshape(x, shape): on the slice when the result keeps
    the vocabulary dim whole and last (`_local_sizes`); a view as a dtype, or any other: NotImplemented."""
    if kwargs:
        if args or set(kwargs) - {"shape", "size"}:
            return NotImplemented
        args = (next(iter(kwargs.values())),)
    local = _local_sizes(self, args)
    if local is None:
        return NotImplemented
    op = _Tensor.view if func is _Tensor.view else _Tensor.reshape
    return VocabSplitLogits.wrap(op(_plain(self), local), self._tp)


def _view_as(self: VocabSplitLogits, args: tuple, kwargs: dict, func: Callable) -> Any:
    other = args[0] if args else kwargs.get("other")
    if not isinstance(other, torch.Tensor):
        return NotImplemented
    shape = _full_shape(other) if isinstance(other, VocabSplitLogits) else _Tensor.size(other)
    return _view(self, tuple(shape), {}, _Tensor.view if func is _Tensor.view_as else _Tensor.reshape)


def _flatten(self: VocabSplitLogits, args: tuple, kwargs: dict, func: Callable) -> Any:
    bound = dict(zip(("start_dim", "end_dim"), args), **kwargs)
    start, end = bound.pop("start_dim", 0), bound.pop("end_dim", -1)
    nd = self.dim()
    if bound or type(start) is not int or type(end) is not int or nd == 0:
        return NotImplemented
    start, end = start % nd, end % nd
    if end == nd - 1 and start < end:  # merges the vocabulary dim with others
        return NotImplemented
    return VocabSplitLogits.wrap(_Tensor.flatten(_plain(self), start, end), self._tp)


def _getitem(self: VocabSplitLogits, args: tuple, kwargs: dict) -> Any:
    """Indexing by ints, slices, None and ... that leaves the last dim whole and last: on the slice. A tensor,
    list or bool index, or one that touches the last dim: NotImplemented (read gathered)."""
    index = args[0] if len(args) == 1 and not kwargs else None
    items = index if isinstance(index, tuple) else (index,)
    if not all(i is None or i is Ellipsis or type(i) in (int, slice) for i in items) or items.count(Ellipsis) > 1:
        return NotImplemented
    if any(type(i) is slice and not all(type(b) in (int, type(None)) for b in (i.start, i.stop, i.step))
           for i in items):
        return NotImplemented
    nd = self.dim()
    if nd == 0:
        return NotImplemented
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if consumed > nd:
        return NotImplemented  # gathered, the full tensor's indexing raises its own error
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = (*items[:at], *(slice(None),) * (nd - consumed), *items[at + 1:])
    else:
        items = (*items, *(slice(None),) * (nd - consumed))
    last = max(k for k, i in enumerate(items) if i is not None)  # the item that takes the vocabulary dim
    if items[last] != slice(None) or any(i is None for i in items[last + 1:]):
        return NotImplemented
    return VocabSplitLogits.wrap(_plain(self)[items], self._tp)


_HANDLERS: dict[Callable, Callable[[VocabSplitLogits, tuple, dict], Any]] = {
    **{f: (lambda s, a, k, f=f: _elementwise(s, a, k, f)) for f in _ELEMENTWISE},
    **{f: (lambda s, a, k, f=f: _view(s, a, k, f)) for f in _VIEWS},
    **{f: (lambda s, a, k, f=f: _view_as(s, a, k, f)) for f in _VIEWS_AS},
    **{f: (lambda s, a, k, f=f: _flatten(s, a, k, f)) for f in _FLATTENS},
    _Tensor.__getitem__: _getitem,
    _Tensor.to: _to,
    F.cross_entropy: lambda s, a, k: _cross_entropy((s, *a), k),
}


# ---------------------------------------------------------------- the cross entropy

def _cross_entropy(args: tuple, kwargs: dict) -> Any:
    """F.cross_entropy: vocab-parallel on the slice where it computes exactly what the full logits would give;
    on the gathered logits otherwise."""
    try:
        bound = _CE_SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return _fallback(F.cross_entropy, args, kwargs)  # F.cross_entropy raises its own error
    a = {**{k: p.default for k, p in _CE_SIGNATURE.parameters.items()}, **bound.arguments}
    logits, target = a["input"], a["target"]
    fast = (isinstance(logits, VocabSplitLogits) and not isinstance(target, VocabSplitLogits)
            and logits.dim() == 2 and isinstance(target, torch.Tensor) and target.dtype == torch.long
            and target.dim() == 1 and target.shape[0] == _Tensor.size(logits, 0)
            and a["weight"] is None and a["size_average"] is None and a["reduce"] is None
            and a["reduction"] in ("mean", "sum") and a["label_smoothing"] == 0.0 and type(a["ignore_index"]) is int)
    if not fast:
        return _fallback(F.cross_entropy, args, kwargs)
    tp = logits._tp
    local = _plain(logits)
    vocab, ignore = _full_shape(logits)[-1], a["ignore_index"]
    # F.cross_entropy refuses a class id outside 0..V-1 (on a GPU by a device-side assert): so does this, without
    # waiting for the device; the slices alone would take it for another rank's class and compute a wrong loss
    torch._assert_async(((target >= 0) & (target < vocab) | (target == ignore)).all(),
                        f"cross_entropy: a target is outside the classes 0..{vocab - 1} and is not ignore_index")
    return vocab_parallel_cross_entropy(local, target, tp.rank * local.shape[-1], tp.group, tp.collectives,
                                        ignore_index=ignore, reduction=a["reduction"])
