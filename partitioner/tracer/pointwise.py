"""GELU written out as elementwise ops, found by what it computes and rewritten to the one fused ATen op.

Many models spell the tanh GELU in Python (Hugging Face's `gelu_new` for GPT-2, GPT-J, GPT-Neo, CodeGen...;
BLOOM's `bloom_gelu_forward`, whose custom backward export does not keep), some the erf one:

    0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))
    x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
    x * 0.5 * (1 + erf(x / sqrt(2)))

Run as traced, autograd keeps four or more tensors of the MLP's width for backward (GPT-2's: x, 0.5 x, the
tanh and 1 + tanh; BLOOM's: seven), where `aten.gelu(x, approximate=...)` keeps x alone: 24 more bytes per
token and hidden unit per layer in 16-bit for GPT-2 (Megatron-LM's whole layer keeps 34 with its fused
bias-GeLU), 48 for BLOOM, and each op reads and writes the MLP's width again. `fuse_gelu` rewrites such a
chain to the fused op, in the graph that costs and generated code both read, so the runtime runs what
the cost model counts.

Nothing is matched by module name or by the spelling of the formula. A region is the elementwise ops
(arithmetic with Python numbers, powers, tanh, erf, casts) computed from one tensor x alone, around a
tanh or erf, ending in one value y that nothing outside reads an intermediate of; it is rewritten when y
equals GELU(x) (tanh or erf form) on test values spanning both tails, evaluated in float64, and has x's
dtype and shape. A chain that feeds an intermediate elsewhere, reads a second tensor, or computes
anything else is left as traced.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = ["fuse_gelu"]

_aten = torch.ops.aten
_ANCHORS = {_aten.tanh.default: "tanh", _aten.erf.default: "none"}
_CASTS = {_aten._to_copy.default, _aten.to.dtype, _aten.to.dtype_layout, _aten.type_as.default}
_ARITHMETIC = {_aten.add.Tensor, _aten.add.Scalar, _aten.sub.Tensor, _aten.sub.Scalar, _aten.rsub.Scalar,
               _aten.rsub.Tensor, _aten.mul.Tensor, _aten.mul.Scalar, _aten.div.Tensor, _aten.div.Scalar,
               _aten.pow.Tensor_Scalar, _aten.neg.default, _aten.tanh.default, _aten.erf.default}
_ELEMENTWISE = _ARITHMETIC | _CASTS
# both tails (tanh and erf saturate past |x| ~ 5), the bend near 0, and values no constant can fit by chance
_TEST_X = torch.cat([torch.linspace(-8.0, 8.0, 321, dtype=torch.float64),
                     torch.tensor([-30.0, -12.5, -1e-3, 1e-3, 12.5, 30.0], dtype=torch.float64)])


def fuse_gelu(gm: fx.GraphModule) -> int:
    """Rewrite every GELU spelled as elementwise ops in `gm`'s graph to `aten.gelu`, in place; returns how
    many were rewritten."""
    count = 0
    erased: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node in erased or node.op != "call_function" or node.target not in _ANCHORS:
            continue
        found = _match(node)
        if found is not None:
            x, y, region, approximate = found
            with gm.graph.inserting_before(y):
                fused = gm.graph.call_function(_aten.gelu.default, (x,), {"approximate": approximate})
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


def _match(anchor: fx.Node) -> tuple[fx.Node, fx.Node, set[fx.Node], str] | None:
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
        approximate = _gelu_form(x, region, y)
        if approximate is not None and _same_tensor_type(x, y) and _ANCHORS[anchor.target] == approximate:
            return x, y, region, approximate
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


def _gelu_form(x: fx.Node, region: set[fx.Node], y: fx.Node) -> str | None:
    """"tanh" or "none" if the region computes that GELU of x (in float64 on `_TEST_X`), else None."""
    values: dict[fx.Node, torch.Tensor] = {x: _TEST_X}
    order = sorted(region, key=_order(y.graph))
    try:
        for n in order:
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
    got = values[y]
    for approximate in ("tanh", "none"):
        want = torch.nn.functional.gelu(_TEST_X, approximate=approximate)
        if torch.allclose(got, want, rtol=1e-6, atol=1e-9):
            return approximate
    return None


def _same_tensor_type(x: fx.Node, y: fx.Node) -> bool:
    a, b = x.meta.get("val"), y.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.dim() != b.dim():
        return False
    return all(statically_known_true(p == q) for p, q in zip(a.shape, b.shape))
