"""The one-op rule of the splits: does op `n` keep a split local, and where does the split dim go.

Both passes that follow a split through the graph ask it of every op they
meet: the tensor-parallel pass (`tensor_split.py`, a split of the features
from a column-parallel matmul) and the sequence-parallel one
(`sequence_split.py`, a split of the tokens from a row-parallel output).
`_rule(ctx, n, state)` answers with a `_Step` (the output's split dim, and
what the step records: heads cut, fused chunks, operands read by chunk) or
with why `n` is not shard-local; the shape rules it applies are
`shard_dims.py`'s.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from partitioner.planner.shard_dims import (
    _BATCHED_MM,
    _CROSS_ENTROPY,
    _EW,
    _EXPANDS,
    _FIRST_ONLY,
    _NORMS,
    _ONE,
    _REDUCTIONS,
    _RESHAPES,
    _SAME_RANK,
    _SPLITS,
    _TRANSPOSES,
    _WEIGHTED,
    _broadcasts,
    _const,
    _drop_dim,
    _permute_dim,
    _prod,
    _reshape_dim,
    padded_dims,
)
from partitioner.tracer.opgraph import OpGraph, OpNode
from partitioner.tracer.symbolic import Poly

__all__: list[str] = []  # pass-internal: the two split passes import the underscored names


class _Weighted(NamedTuple):
    weight: str
    bias: tuple[str, ...]
    out_dim: int  # the weight dim holding output features: 0 for [out, in], 1 for [in, out]
    act: str  # the activation input


def _weighted(n: OpNode, pshape: dict[str, tuple[int, ...]]) -> _Weighted | None:
    """`n` as x @ W (+ b) with W a parameter, or None."""
    if n.op not in _WEIGHTED or len(n.inputs) != 1 or not n.params or n.output is None:
        return None
    mats = [p for p in n.params if len(pshape[p]) == 2]
    bias = tuple(p for p in n.params if p not in mats)
    if len(mats) != 1 or len(bias) > 1 or any(len(pshape[b]) != 1 for b in bias):
        return None
    w = mats[0]
    out_dim = 0 if n.op == "linear" else 1
    if n.op in ("mm", "matmul") and bias:
        return None
    if n.output.shape[-1] != Poly.const(pshape[w][out_dim]):
        return None
    return _Weighted(w, bias, out_dim, n.inputs[0])


class _Shard(NamedTuple):
    region: int
    dim: int  # the split dim of this tensor
    units: int  # indivisible blocks along it: tp must divide this
    producers: frozenset[str]


class _Step(NamedTuple):
    dim: int | None = None  # the output's split dim; None: the output is not split
    cap: int = 0  # units become gcd(units, cap)
    head_split: int = 0  # a view cut the split features into this many heads
    fused: int = 0  # a split cut the split dim into this many chunks
    sink: bool = False  # a cross entropy over the split classes
    attention: bool = False
    chunks: tuple[tuple[str, int], ...] = ()  # replicated operands read by chunk: (operand, its dim)


@dataclasses.dataclass(frozen=True)
class _Context:
    g: OpGraph
    node: dict[str, OpNode]
    consumers: dict[str, list[OpNode]]
    pshape: dict[str, tuple[int, ...]]
    weighted: dict[str, _Weighted]

    @staticmethod
    def of(g: OpGraph) -> _Context:
        pshape = {p.name: p.shape for p in g.params}
        consumers: dict[str, list[OpNode]] = {n.name: [] for n in g.nodes}
        for n in g.nodes:
            for i in dict.fromkeys(n.inputs):
                if i in consumers:
                    consumers[i].append(n)
        weighted = {n.name: w for n in g.nodes if (w := _weighted(n, pshape)) is not None}
        return _Context(g, {n.name: n for n in g.nodes}, consumers, pshape, weighted)

    def shape(self, name: str) -> tuple[Poly, ...] | None:
        n = self.node.get(name)
        return n.output.shape if n is not None and n.output is not None else None

    def label(self, name: str) -> str:
        n = self.node[name]
        return n.module_path or n.name


def _rule(ctx: _Context, n: OpNode, state: dict[str, _Shard], *, chunk_any: bool = False) -> _Step | str:
    """How `n` maps its inputs' split dim onto its output, or why it is not shard-local.

    chunk_any: a replicated operand spanning the split dim may be read by chunk even when it needs a
    gradient (sequence parallelism: the chunk's backward all-gathers it, `partitioner.planner.sequence_split`)."""
    op, osh = n.op, n.output.shape
    r = len(osh)
    ins = n.inputs[:1] if op in _FIRST_ONLY else n.inputs
    split = [(i, state[i]) for i in ins if i in state]
    if not split:  # the split input gives only a dtype or shape (x.type_as(split)): output not split
        return _Step()
    name, st = split[0]
    ish, d = ctx.shape(name), st.dim

    if op in _PADS and d in _padded_dims(ctx, n.name, len(ish)):
        # its extent may stay (RWKV's time shift pads one token before and drops the last): each rank's tokens
        # would be shifted by its own slice's edge, not the sequence's
        return "pads or shifts along the split dim"
    binary_extremum = op in ("max", "min") and len(n.inputs) > 1  # torch.max(a, b) is elementwise
    if op in _EW or binary_extremum or op in _EXPANDS or op in _SAME_RANK or op == "cat" or op == "concat":
        if (op in _SAME_RANK or op in ("cat", "concat")) and (len(ish) != r or osh[d] != ish[d]):
            return f"{'concatenates' if op in ('cat', 'concat') else 'slices'} along the split dim"
        od = None
        for i, s in split:
            x = s.dim + r - len(ctx.shape(i))
            if od is not None and x != od:
                return "combines tensors split on different dims"
            od = x
        if op in _EXPANDS and osh[od] != ish[d]:
            return "expands the split dim"
        chunks = []
        for i in ins:
            if i in state:
                continue
            sh = ctx.shape(i)
            if op in ("cat", "concat"):
                return f"concatenates with {i}, which is not split"
            if sh is None:
                return f"combines it with {i}, a model input that is not split"
            if not _broadcasts(sh, r, od):
                k = _chunk_dim(ctx, i, osh, od, chunk_any)
                if k is None:
                    return f"combines it with {i}, which is not split but spans the split dim"
                chunks.append((i, k))
        step = _step_with_params(ctx, n, od)
        return step._replace(chunks=tuple(chunks)) if chunks and isinstance(step, _Step) else step
    if op in _TRANSPOSES:
        od = _permute_dim(op, ish, osh, d)
        return "moves the split dim where shapes cannot tell" if od is None else _Step(dim=od)
    if op in _RESHAPES:
        if _prod(ish) == _prod(osh):
            m = _reshape_dim(ish, osh, d)
            if m is None:
                return "reshapes the split dim so a rank's slice is no longer one block"
            od, k = m
            e = _const(ish[d])
            return _Step(dim=od, cap=k, head_split=k if k < e and _prod(osh[od + 1:]) != _ONE else 0)
        od = _drop_dim(ish, osh, d)
        return _Step(dim=od) if isinstance(od, int) else "selects from the split dim"
    if op in _SPLITS or op == "unbind":
        if len(ish) != r:
            od = _drop_dim(ish, osh, d)
            return _Step(dim=od) if isinstance(od, int) else "unbinds the split dim"
        if osh[d] == ish[d]:
            return _Step(dim=d)
        e, c0 = _const(ish[d]), _const(osh[d])
        chunks = [_const(c.output.shape[d]) for c in ctx.consumers[n.name]
                  if c.op == "getitem" and c.output is not None and len(c.output.shape) == r]
        fused = len(chunks) if sum(x or 0 for x in chunks) == e else (e // c0 if c0 and e % c0 == 0 else 0)
        return _Step(dim=d, cap=c0 or 1, fused=fused) if fused > 1 else "splits the split dim unevenly"
    if op == "getitem":
        if len(ish) != r:
            return "indexes the split dim"
        return _Step(dim=d, cap=_const(osh[d]) or 0)
    if op == "scaled_dot_product_attention":
        chunks = []
        for i in n.inputs:
            sh = ctx.shape(i)
            if i in state and state[i].dim != len(sh) - 3:
                return "attends with the split dim not the head dim"
            if i not in state and (i in n.inputs[:3] or sh is None or not _broadcasts(sh, r, r - 3)):
                k = None if i in n.inputs[:3] else _chunk_dim(ctx, i, osh, r - 3)
                if k is None:
                    return f"attends with {i}, which is not split by heads"
                chunks.append((i, k))  # a mask or bias per head, (b, nh, s, s): each rank reads its heads
        return _Step(dim=r - 3, attention=True, chunks=tuple(chunks))
    if op in _BATCHED_MM and not n.params:
        od = None
        for i in n.inputs:
            sh = ctx.shape(i)
            if i in state:
                if state[i].dim >= len(sh) - 2:
                    return "contracts or splits a matrix dim of the split tensor (no parameter to split)"
                x = state[i].dim + r - len(sh)
                if od is not None and x != od:
                    return "multiplies tensors split on different dims"
                od = x
        for i in n.inputs:
            sh = ctx.shape(i)
            if i not in state and (sh is None or not _broadcasts(sh, r, od)):
                return f"multiplies by {i}, which is not split but spans the split (batch) dim"
        return _Step(dim=od, attention=True)
    if op in ("softmax", "log_softmax", "_softmax"):
        return "takes a softmax over the split dim" if d == len(ish) - 1 else _Step(dim=d)
    if op in _NORMS:
        nd = max((len(ctx.pshape[p]) for p in n.params), default=1)
        return "normalises over the split features" if d >= len(ish) - nd else _Step(dim=d)
    if op in _REDUCTIONS:
        od = _drop_dim(ish, osh, d)
        return _Step(dim=od) if isinstance(od, int) else "reduces over the split dim"
    if op in _CROSS_ENTROPY:
        if name == n.inputs[0] and len(split) == 1 and d == (1 if len(ish) >= 2 else 0):
            return _Step(sink=True)
        return "takes a cross entropy with the split dim not the class dim"
    return f"is not known to act independently per split feature ({op})"


_PADS = frozenset({"pad", "constant_pad_nd"})


def _padded_dims(ctx: _Context, name: str, ndim: int) -> set[int]:
    """The dims pad node `name` pads or trims (every dim where the traced graph does not say)."""
    gm = getattr(ctx.g.graph_module, "graph_module", ctx.g.graph_module)
    node = next((m for m in gm.graph.nodes if m.name == name), None) if gm is not None else None
    dims = padded_dims(node, ndim) if node is not None else None
    return set(range(ndim)) if dims is None else dims


def _chunk_dim(ctx: _Context, i: str, osh: tuple[Poly, ...], od: int, chunk_any: bool = False) -> int | None:
    """The dim of replicated operand `i` aligned with output split dim `od`, when each rank may read its own
    chunk of it there: `i` needs no gradient (so the chunk's backward has nothing to gather; `chunk_any`
    lifts this) and spans the split dim with its full extent. None otherwise."""
    sh, node = ctx.shape(i), ctx.node.get(i)
    if sh is None or node is None or (node.requires_grad and not chunk_any):
        return None
    k = od - (len(osh) - len(sh))
    return k if k >= 0 and sh[k] == osh[od] else None


def _step_with_params(ctx: _Context, n: OpNode, od: int) -> _Step | str:
    r = len(n.output.shape)
    for p in n.params:
        if not _broadcasts(tuple(Poly.const(x) for x in ctx.pshape[p]), r, od):
            return f"applies parameter {p} across the split dim"
    return _Step(dim=od)
