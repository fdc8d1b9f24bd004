"""Activations written out as elementwise ops, found by what they compute and rewritten to the one fused ATen op.

Many models spell the tanh GELU in Python (Hugging Face's `gelu_new` for GPT-2, GPT-J, GPT-Neo, CodeGen...;
BLOOM's `bloom_gelu_forward`, whose custom backward export does not keep), some the erf one:

    0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))
    x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
    x * 0.5 * (1 + erf(x / sqrt(2)))

Run as traced, autograd keeps four or more tensors of the MLP's width for backward (GPT-2's: x, 0.5 x, the
tanh and 1 + tanh; BLOOM's: seven), where `aten.gelu(x, approximate=...)` keeps x alone: 24 more bytes per
token and hidden unit per layer in 16-bit for GPT-2 (Megatron-LM's whole layer keeps 34 with its fused
bias-GeLU), 48 for BLOOM, and each op reads and writes the MLP's width again. SiLU written `x * sigmoid(x)`
keeps two tensors where `aten.silu` keeps one. `fuse_activations` rewrites such a chain to the fused op, in the
graph that costs and generated code both read, so the runtime runs what the cost model counts.

Nothing is matched by module name or by the spelling of the formula. A region is the elementwise ops
(arithmetic with Python numbers, powers, tanh, erf, sigmoid, casts) computed from one tensor x alone, around
a tanh, erf or sigmoid, ending in one value y that nothing outside reads an intermediate of; it is rewritten
when y equals GELU(x) (the tanh form around a tanh, the erf form around an erf) or SiLU(x) (around a sigmoid)
on test values spanning both tails, evaluated in float64, and has x's dtype and shape. A chain that feeds an
intermediate elsewhere, reads a second tensor, or computes anything else is left as traced.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = ["fuse_activations", "FUSED_NAME"]

FUSED_NAME = "fused_"  # fused nodes (here and tracer.norms) are named so: the OpGraph counts them (OpGraph.fused)

_aten = torch.ops.aten
# what each anchor's region may compute: (the fused op, its keyword arguments); the op itself, run in float64 on
# the test values, is the function the region must equal
_FUSED = {
    _aten.tanh.default: ((_aten.gelu.default, {"approximate": "tanh"}),),
    _aten.erf.default: ((_aten.gelu.default, {"approximate": "none"}),),
    _aten.sigmoid.default: ((_aten.silu.default, {}),),
}
_CASTS = {_aten._to_copy.default, _aten.to.dtype, _aten.to.dtype_layout, _aten.type_as.default}
_ARITHMETIC = {_aten.add.Tensor, _aten.add.Scalar, _aten.sub.Tensor, _aten.sub.Scalar, _aten.rsub.Scalar,
               _aten.rsub.Tensor, _aten.mul.Tensor, _aten.mul.Scalar, _aten.div.Tensor, _aten.div.Scalar,
               _aten.pow.Tensor_Scalar, _aten.neg.default, *_FUSED}
_ELEMENTWISE = _ARITHMETIC | _CASTS
# both tails (tanh, erf and sigmoid saturate past |x| ~ 5 to 10), the bend near 0, and values no constant can
# fit by chance
_TEST_X = torch.cat([torch.linspace(-8.0, 8.0, 321, dtype=torch.float64),
                     torch.tensor([-30.0, -12.5, -1e-3, 1e-3, 12.5, 30.0], dtype=torch.float64)])


def fuse_activations(gm: fx.GraphModule) -> int:
    """Rewrite every GELU or SiLU spelled as elementwise ops in `gm`'s graph to `aten.gelu` / `aten.silu`, in
    place; returns how many were rewritten."""
    count = 0
    erased: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node in erased or node.op != "call_function" or node.target not in _FUSED:
            continue
        found = _match(node)
        if found is not None:
            x, y, region, (op, kwargs) = found
            with gm.graph.inserting_before(y):
                fused = gm.graph.call_function(op, (x,), dict(kwargs), name=FUSED_NAME + op.__name__.split(".")[0])
            fused.meta = dict(y.meta)
            y.replace_all_uses_with(fused)
            for n in sorted(region, key=_order(gm.graph), reverse=True):
                gm.graph.erase_node(n)
            erased |= region
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _order(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def _tensor_args(n: fx.Node) -> list[fx.Node]:
    return [a for a in (*n.args, *n.kwargs.values()) if isinstance(a, fx.Node)]


def _elementwise(n: fx.Node) -> bool:
    if n.op != "call_function" or n.target not in _ELEMENTWISE:
        return False
    if n.target in _CASTS:  # a cast that moves the tensor elsewhere is not elementwise arithmetic
        return set(n.kwargs) <= {"dtype", "copy", "non_blocking", "layout"} and len(n.args) <= 2
    return not any(isinstance(a, (list, tuple)) for a in n.args)


def _root(anchor: fx.Node) -> fx.Node | None:
    """The one tensor the elementwise ops before `anchor` read, or None if they read more than one."""
    leaves, todo, seen = set(), [anchor], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for a in _tensor_args(n):
            if _elementwise(a):
                todo.append(a)
            else:
                leaves.add(a)
    return next(iter(leaves)) if len(leaves) == 1 else None


def _match(anchor: fx.Node) -> tuple[fx.Node, fx.Node, set[fx.Node], tuple[Any, dict]] | None:
    x = _root(anchor)
    if x is None or not isinstance(x.meta.get("val"), torch.Tensor) or not x.meta["val"].is_floating_point():
        return None
    # every elementwise op computed from x alone (and numbers), in graph order
    pure: list[fx.Node] = []
    members = {x}
    for n in _after(x):
        if _elementwise(n) and _tensor_args(n) and all(a in members for a in _tensor_args(n)):
            pure.append(n)
            members.add(n)
    if anchor not in members:
        return None
    for y in pure:
        region = _ancestors(y, members) - {x}
        if anchor not in region or not _closed(region, y):
            continue
        got = _evaluate(x, region, y) if _same_tensor_type(x, y) else None
        for op, kwargs in _FUSED[anchor.target] if got is not None else ():
            want = op(_TEST_X, **kwargs)
            if torch.allclose(got, want, rtol=1e-6, atol=1e-9):
                return x, y, region, (op, kwargs)
    return None


def _after(x: fx.Node):
    n = x.next
    while n.op != "root":
        yield n
        n = n.next


def _ancestors(y: fx.Node, members: set[fx.Node]) -> set[fx.Node]:
    out, todo = set(), [y]
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        todo.extend(a for a in _tensor_args(n) if a in members)
    return out


def _closed(region: set[fx.Node], y: fx.Node) -> bool:
    """Nothing outside the region reads a value of it but y."""
    return all(u in region for n in region if n is not y for u in n.users)


def _evaluate(x: fx.Node, region: set[fx.Node], y: fx.Node) -> torch.Tensor | None:
    """y as a function of x, evaluated in float64 on `_TEST_X` (None if an op does not evaluate elementwise)."""
    values: dict[fx.Node, torch.Tensor] = {x: _TEST_X}
    try:
        for n in sorted(region, key=_order(y.graph)):
            if n.target in _CASTS:
                values[n] = values[n.args[0]]
                continue
            args = [values[a] if isinstance(a, fx.Node) else a for a in n.args]
            kwargs = {k: values[v] if isinstance(v, fx.Node) else v for k, v in n.kwargs.items()}
            out = n.target(*args, **kwargs)
            if not isinstance(out, torch.Tensor) or out.shape != _TEST_X.shape:
                return None
            values[n] = out.to(torch.float64)
    except (RuntimeError, TypeError, KeyError):
        return None
    return values[y]


def _same_tensor_type(x: fx.Node, y: fx.Node) -> bool:
    a, b = x.meta.get("val"), y.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.dim() != b.dim():
        return False
    return all(statically_known_true(p == q) for p, q in zip(a.shape, b.shape))
