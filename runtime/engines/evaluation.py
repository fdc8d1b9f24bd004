"""Evaluation: a plan's forward as one process runs `model.eval()` under `torch.no_grad()`.

A program's model code was traced in training mode, so its random draws are in the code as constants
(`aten.dropout.default(x, 0.1, True)`, attention's `dropout_p=0.1`). `evaluating(modules)` runs the code
with them off, as eval mode runs the module: inside it

- every module given is in eval mode (its own forward, where a data-parallel plan runs the user's module),
  and goes back to each submodule's own mode after;
- the generated code's dropouts (aten dropout, native_dropout, feature and alpha dropouts, and
  `torch.nn.functional`'s) return their input, and attention runs with dropout_p = 0;
- `runtime.pipeline.tensor_parallel.tp_forked` draws no seed from the shared stream (`evaluating_now()`),
  so a step after an evaluation draws the masks it would have drawn without it.

Nothing of the training state moves: no random number is drawn, parameters, buffers and the optimizer are not
touched. A batch norm the code runs in training mode is refused (evaluating it would need its running
statistics, which the traced code updates in place): evaluate such a model under a data-parallel plan, whose
ranks run the module itself.

The mode costs a Python call per op, so a runner turns it off for code that holds none of these
(`EvalOps.changed` after the first evaluation: the code is straight-line, every evaluation runs the same ops).

>>> x = torch.ones(4)
>>> with evaluating(()):
...     torch.ops.aten.dropout.default(x, 0.5, True).tolist()
[1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["EvalOps", "evaluating", "evaluating_now", "EvaluationError"]

_aten = torch.ops.aten
# op -> (index, name, default) of its argument that differs in training: set to the eval value (False, 0.0)
_DRAWS = {**{op: (2, "train", None) for op in (_aten.dropout.default, _aten.native_dropout.default,
                                              _aten.feature_dropout.default, _aten.alpha_dropout.default,
                                              _aten.feature_alpha_dropout.default, torch.dropout,
                                              torch.feature_dropout, torch.alpha_dropout,
                                              torch.feature_alpha_dropout)},
          **{fn: (2, "training", True) for fn in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                                                  F.feature_alpha_dropout)},
          _aten.scaled_dot_product_attention.default: (4, "dropout_p", 0.0),
          F.scaled_dot_product_attention: (4, "dropout_p", 0.0)}
_BATCH_NORMS = {_aten.batch_norm.default: (5, "training", None), _aten.native_batch_norm.default: (5, "training", None),
                _aten._native_batch_norm_legit_functional.default: (5, "training", None),
                _aten._native_batch_norm_legit.default: (5, "training", None), F.batch_norm: (5, "training", False)}

_depth = 0


class EvaluationError(RuntimeError):
    """The model code cannot be evaluated as eval mode would run it."""


def evaluating_now() -> bool:
    """Whether an evaluation is running in this process (`evaluating`)."""
    return _depth > 0


def _get(args: tuple, kwargs: dict, where: tuple):
    index, name, default = where
    return args[index] if len(args) > index else kwargs.get(name, default)


def _set(args: tuple, kwargs: dict, where: tuple, value) -> tuple[tuple, dict]:
    index, name, _ = where
    if len(args) > index:
        return (*args[:index], value, *args[index + 1:]), kwargs
    return args, {**kwargs, name: value}


class EvalOps(TorchFunctionMode):
    """The ops that behave differently in training, run as in eval mode; `changed`: whether any was met."""

    def __init__(self):
        super().__init__()
        self.changed = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = _DRAWS.get(func)
        if where is not None and _get(args, kwargs, where):
            self.changed = True
            args, kwargs = _set(args, kwargs, where, 0.0 if where[1] == "dropout_p" else False)
        elif func in _BATCH_NORMS and _get(args, kwargs, _BATCH_NORMS[func]):
            raise EvaluationError(
                f"evaluate: the plan's code runs a batch norm in training mode ({func}), whose running statistics "
                "the traced code updates in place; evaluating it as eval mode does is not supported: evaluate "
                "under a data-parallel plan (pp=1, tp=1, cp=1), whose ranks run the module itself")
        return func(*args, **kwargs)


@contextlib.contextmanager
def evaluating(modules: Iterable[nn.Module], *, code_ops: bool = True) -> Iterator[EvalOps | None]:
    """Inside: `modules` (and their submodules) in eval mode, no gradients, and with `code_ops` the traced
    training ops run as eval mode runs them; yields the EvalOps (its `changed` says whether the code held any of
    them), None without `code_ops`."""
    global _depth
    modes = [(m, m.training) for root in modules for m in root.modules()]
    mode = EvalOps() if code_ops else None
    try:
        for m, _ in modes:
            m.training = False
        _depth += 1
        with torch.no_grad(), (mode if mode is not None else contextlib.nullcontext()):
            yield mode
    finally:
        _depth -= 1
        for m, was in modes:
            m.training = was
