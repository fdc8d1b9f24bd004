"""Randomness off, for plan.verify: the module's forward and the generated code's draw the same numbers.

A module that draws random numbers in its forward (dropout; a router that samples its experts, as PhiMoE's
sparsemixer does with `exponential_` and `rand_like`; noisy gates) draws them in an order and with shapes the
per-rank programs cannot repeat: a pipeline stage starts from its own generator state, a tensor slice draws
for its own heads. Their outputs could then never agree, and verify would blame the split. So verify runs
both sides with every draw fixed, as dropout is fixed to the identity:

- dropout (and scaled_dot_product_attention's dropout_p) is the identity;
- a draw from a distribution is its mean (uniform, normal, exponential, geometric rounded, log-normal,
  Bernoulli, Poisson) or its median (Cauchy);
- integer draws take their lowest value (randint, random_), randperm is the identity permutation, and
  multinomial takes the most likely outcomes.

The same fixed value for the same call on both sides keeps the comparison exact wherever the math is the
same. A draw from a generator the caller passes (`generator=`, seeded) repeats on both sides and is left as
it is. Thread-local, as torch function modes are: every slice's thread enters it.

Backward keeps it on. torch.utils.checkpoint runs a region's forward again inside the backward (the module's own
gradient checkpointing, the plan's recomputation), and autograd runs with the torch function modes that were on
when the backward was called; a mode is off while its own handler runs, so `loss.backward()` would recompute with
dropout on and fresh draws where the forward had none, and torch then refuses the saved tensors (CheckpointError,
"Recomputed values ... have different metadata"). So `backward`, `torch.autograd.backward` and
`torch.autograd.grad` run their own steps here (`_held_backward`) with the mode on while the engine runs.

>>> with NoRandomness():
...     x = torch.empty(3).exponential_(2.0)
...     y = torch.rand(2)
>>> x.tolist(), y.tolist()
([0.5, 0.5, 0.5], [0.5, 0.5])
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["NoRandomness"]

_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             torch.dropout, torch.ops.aten.dropout.default}
_SDPA = {F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _fixed(name: str, out: Any, args: tuple, kwargs: dict) -> Any:
    """`out` (what the draw returned) overwritten with the draw's fixed value; `name` is the op's, without
    the in-place underscore. Arguments are read as the Tensor methods and aten ops take them (self first)."""
    if name == "uniform":
        lo, hi = _arg(args, kwargs, 1, "from", 0.0), _arg(args, kwargs, 2, "to", 1.0)
        return out.fill_((lo + hi) / 2)
    if name == "exponential":
        return out.fill_(1.0 / _arg(args, kwargs, 1, "lambd", 1.0))
    if name == "geometric":
        return out.fill_(round(1.0 / _arg(args, kwargs, 1, "p", 0.5)))
    if name == "log_normal":
        return out.fill_(math.exp(_arg(args, kwargs, 1, "mean", 1.0)))
    if name == "cauchy":
        return out.fill_(_arg(args, kwargs, 1, "median", 0.0))
    if name in ("rand", "rand_like"):
        return out.fill_(0.5)
    if name in ("randn", "randn_like"):
        return out.fill_(0.0)
    if name in ("randint", "randint_like", "random"):
        ints = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        low = kwargs.get("low", kwargs.get("from", ints[0] if len(ints) >= 2 else 0))
        return out.fill_(low)
    if name == "randperm":
        return out.copy_(torch.arange(out.numel(), dtype=out.dtype, device=out.device))
    if name == "multinomial":
        probs, k = args[0], _arg(args, kwargs, 1, "num_samples", 1)
        return out.copy_(torch.topk(probs, k, dim=-1).indices)
    if name == "poisson":
        return out.copy_(args[0])
    if name == "bernoulli":
        p = _arg(args, kwargs, 1, "p", None)
        if p is None:  # torch.bernoulli(probs): the probabilities are the input
            p = args[0]
        return out.copy_(p) if isinstance(p, torch.Tensor) else out.fill_(p)
    if name == "normal":
        mean = _arg(args, kwargs, 1, "mean", 0.0) if isinstance(args[0], torch.Tensor) and \
            out is args[0] else _arg(args, kwargs, 0, "mean", 0.0)  # Tensor.normal_(mean, std) / normal(mean, std)
        return out.copy_(mean) if isinstance(mean, torch.Tensor) else out.fill_(mean)
    return out


_NAMES = ("uniform", "exponential", "geometric", "log_normal", "cauchy", "rand", "rand_like", "randn", "randn_like",
          "randint", "randint_like", "random", "randperm", "multinomial", "poisson", "bernoulli", "normal")


def _draws() -> dict[Any, str]:
    """Every callable that draws, by the distribution's name: the torch functions and Tensor methods a module
    calls, and every overload of the aten ops generated code calls (in place or not). A table looked up by the
    callable, so that the mode stays a dictionary lookup where torch.compile traces through it."""
    table: dict[Any, str] = {}
    for name in _NAMES:
        for spelling in (name, name + "_"):
            for owner in (torch, torch.Tensor):
                f = getattr(owner, spelling, None)
                if callable(f):
                    table[f] = name
            packet = getattr(torch.ops.aten, spelling, None)
            if packet is not None:
                for overload in packet.overloads():
                    table[getattr(packet, overload)] = name
    return table


_DRAWS = _draws()


def _own_generator(args: tuple, kwargs: dict) -> bool:
    """A draw from a generator the caller passes (seeded by it: verify's own inputs and loss weights) repeats
    as it is; only the global generator's draws are the ones the two sides cannot share."""
    return kwargs.get("generator") is not None or any(isinstance(a, torch.Generator) for a in args)


_BACKWARDS = {torch.Tensor.backward: "backward", torch.autograd.backward: "backward", torch.autograd.grad: "grad"}


def _as_tuple(x: Any) -> tuple:
    from torch.autograd.graph import GradientEdge

    return (x,) if isinstance(x, (torch.Tensor, GradientEdge)) else tuple(x)


def _held_backward(mode: TorchFunctionMode, func: Any, args: tuple, kwargs: dict) -> Any:
    """`func` (one of `_BACKWARDS`) by torch.autograd's own steps, `mode` on while autograd's engine runs (so a
    checkpointed region recomputes with it); the forms this does not take (batched or materialized gradients, a
    dict of inputs) run as called."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if func is torch.Tensor.backward:
        a = {"tensors": a["self"], "grad_tensors": a["gradient"], "retain_graph": a["retain_graph"],
             "create_graph": a["create_graph"], "inputs": a["inputs"]}
    grad = _BACKWARDS[func] == "grad"
    if (a.get("grad_variables") is not None or a.get("is_grads_batched") or a.get("materialize_grads")
            or isinstance(a["inputs"], dict) or not a.get("only_inputs", True)):
        return func(*args, **kwargs)
    outputs = _as_tuple(a["outputs"] if grad else a["tensors"])
    inputs = () if a["inputs"] is None else _as_tuple(a["inputs"])
    given = _tensor_or_tensors_to_tuple(a["grad_outputs"] if grad else a["grad_tensors"], len(outputs))
    create = a["create_graph"]
    retain = create if a["retain_graph"] is None else a["retain_graph"]
    with mode:
        grads = _make_grads(outputs, given, is_grads_batched=False)
        if grad:
            return _engine_run_backward(outputs, grads, retain, create, inputs, bool(a["allow_unused"]),
                                        accumulate_grad=False)
        _engine_run_backward(outputs, grads, retain, create, inputs, allow_unreachable=True, accumulate_grad=True)
        return None


class NoRandomness(TorchFunctionMode):
    """Every random draw fixed (see the module's docstring), on the module and the generated code alike."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BACKWARDS:
            return _held_backward(self, func, args, kwargs)
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is torch.ops.aten.native_dropout.default:
            return args[0].clone(), torch.ones_like(args[0], dtype=torch.bool)
        if func in _SDPA:
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            elif "dropout_p" in kwargs:
                kwargs = {**kwargs, "dropout_p": 0.0}
        name = _DRAWS.get(func)
        out = func(*args, **kwargs)
        if name is None or not isinstance(out, torch.Tensor) or _own_generator(args, kwargs):
            return out
        with torch.no_grad():
            return _fixed(name, out, args, kwargs)
