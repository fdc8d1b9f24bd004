"""Eager attention, found by its dataflow in an exported graph and rewritten to one fused op.

Hugging Face's eager attention (and nanoGPT's manual one) run as separate ATen ops:

    scores = q @ k^T  (matmul, bmm, or baddbmm(bias, q, k^T, alpha=scale))
    scores = scores * scale + bias / masked_fill(mask, -inf) / where(mask, scores, -inf)   (any order, optional)
    probs  = softmax(scores, -1)  (casts before and after allowed)
    probs  = dropout(probs, p)    (optional)
    out    = probs @ v

which keeps the s x s scores, the probabilities and the dropout mask for backward. `rewrite_attention`
replaces each such chain by `aten.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, scale=...)`:
the same math (softmax(q k^T * scale + mask) v), computed by a kernel that keeps O(s) per row.

An additive term that is a bias per key, the same for every query (ALiBi: a slope per head times the key's
position, MPT's and BLOOM's), is folded into the products (`_fold_key_bias`): q and k take two more columns
(a power of two near 1 / scale, and the bias over both split in two parts), padded with zeros to a multiple
of 8, so the fused op needs no s x s tensor for it (FlashAttention's ALiBi does the same inside its kernel).
A term that is 0 where a condition holds and a removing value elsewhere (BLOOM's `where(keep, 0, finfo.min)`)
is that condition (`_as_removal`). What is left is the mask: the terms gathered into one tensor in their broadcast
shape (a boolean keep-mask when the only term is a masked_fill / where with a value that removes the
position); it is computed inside the region and saved by the fused kernel, so the cost rule counts it. It
is made at the shape its inputs have before they are expanded over the batch (`_unbroadcast_masks`): the
fused op broadcasts the mask itself. A causal one made from shapes alone is then no tensor at all at run
time (runtime.pipeline.attention runs the kernel's causal path): before the fold, MPT's ALiBi with the
causal mask kept an (h, s, s) mask per layer (4 GiB per layer at 16 heads and 16K tokens, fp32), which put
long-sequence MPT runs that trained on 80 GB at hundreds of GiB.

`causal_shape_mask` says whether such a node's mask, computed from shapes alone (or from them and a buffer the
graph never writes, with the buffer's traced values: nanoGPT's tril `bias`), is exactly the causal one at the
traced sizes (evaluated there): generated code then attends with `is_causal=True` and no mask
(runtime.pipeline.attention), so the cost rule keeps no mask for it and counts half the products.

`causal_attention` reads whether a fused attention node attends causally: `is_causal=True`, or a mask the
graph computes from shapes alone through an ordering comparison of positions (Hugging Face's
create_causal_mask: `kv_idx <= q_idx` over aranges); the cost rule then counts half the products.

Nothing is matched by module or model name. A chain whose intermediate values are read elsewhere (the
attention probabilities returned as an output), whose softmax runs over another dim, whose bias is
not additive, or whose mask is read from a model input (a padding mask, which can remove a whole row:
`_reads_inputs`) is left as traced. A 3-d layout (BLOOM's (b*h, s, d) baddbmm, viewed to (b, h, s, s) for
the mask) is lifted to the 4-d layout the mask lives in, so the fused op sees heads as a dim (tensor
parallelism splits it).

The graph is the tracer's own fresh ExportedProgram, rewritten in place before anything reads it:
the user's module is never touched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Collection
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils import _pytree as pytree

__all__ = ["causal_attention", "causal_shape_mask", "from_shapes", "rewrite_attention", "SDPA_NAME"]

_aten = torch.ops.aten
SDPA_NAME = "attention_sdpa"  # rewritten nodes are named so; the OpGraph counts them
_SCORES = {_aten.matmul.default, _aten.bmm.default, _aten.baddbmm.default}
_CASTS = {_aten.to.dtype, _aten._to_copy.default, _aten.to.dtype_layout}
_VIEWS = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}
_SOFTMAX = {_aten.softmax.int, _aten._softmax.default}
_ASSERT = {_aten._assert_tensor_metadata.default}
# comparisons that order two positions (a causal mask's kv_idx <= q_idx); a size read that is not a value read
_ORDER = {_aten.le.Tensor, _aten.lt.Tensor, _aten.ge.Tensor, _aten.gt.Tensor}
_SIZE_READS = {_aten.sym_size.int, _aten.sym_size.default, _aten.size.default, _aten.sym_numel.default,
               _aten.numel.default}
# a masked value at or below this removes its position from the softmax in fp32, bf16 and fp16 alike
# (exp(-1e4) underflows to 0); HF fills with torch.finfo(dtype).min, nanoGPT with -inf
_MASKED = -1e4


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Match:
    """One eager attention: the nodes it spans and what the fused op needs."""

    scores: fx.Node  # the q @ k^T node
    unflatten: fx.Node | None  # a (b*h, l, s) -> (b, h, l, s) view of the scores before the softmax
    # ("add", t, factor) | ("fill", m, v) | ("keep", m, v), each with whether it is in the 3-d layout
    terms: tuple[tuple[str, Any, Any, bool], ...]
    scale: float
    dropout_p: float
    out: fx.Node  # the probs @ v node
    region: tuple[fx.Node, ...]  # every node replaced, in graph order


def rewrite_attention(gm: fx.GraphModule, inputs: frozenset[str] = frozenset()) -> int:
    """Rewrite every exact eager attention of `gm`'s graph to scaled_dot_product_attention, in place;
    returns how many were rewritten. `inputs`: the names of the graph's model-input placeholders."""
    count = 0
    erased: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _SCORES and node not in erased:
            m = _match(node)
            if m is not None and not _reads_inputs(m.terms, inputs) and _rewrite(gm.graph, m, erased):
                count += 1
    if count:
        _unbroadcast_masks(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return count


# elementwise ops that broadcast their tensor arguments (and one cast): a mask built from them out of an
# expanded tensor equals the same ops on the tensor before its expansion, broadcast later by the fused op
_BROADCASTING = {_aten.where.self, _aten.where.ScalarSelf, _aten.where.ScalarOther, _aten.where.Scalar,
                 _aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor, _aten.logical_not.default,
                 _aten.logical_and.default, _aten.logical_or.default, _aten.bitwise_not.default,
                 _aten.bitwise_and.Tensor, _aten.bitwise_or.Tensor, _aten.eq.Tensor, _aten.ne.Tensor,
                 _aten.le.Tensor, _aten.lt.Tensor, _aten.ge.Tensor, _aten.gt.Tensor, _aten.eq.Scalar, _aten.ne.Scalar,
                 _aten.masked_fill.Scalar, _aten.neg.default, *_CASTS}


def _reads_inputs(terms: tuple[tuple[str, Any, Any, bool], ...], inputs: frozenset[str]) -> bool:
    """Whether a mask term is computed from a model input's values (a padding mask), not only its sizes.

    Such a mask can remove every key of a row (a left-padded row's pads). Eager attention then fills the
    whole row with the same large negative and spreads it evenly over the keys; the fused kernel's forward
    does too, but its backward recomputes the row's probabilities from a log-sum-exp that the fill swamps,
    so its gradients differ (torch 2.13's CPU kernel: BLOOM and MPT with a left-padded batch, up to 2x on a
    layer norm's weight gradient; on an H200, torch 2.11: the math backend's gradients by 39 %, and the
    memory-efficient and cuDNN kernels zero such a row in the forward too, docs/compiling.md). A mask computed
    from shapes alone (causal, a sliding window) keeps each row's own position, so only such chains are
    rewritten; these stay as traced, and are costed so."""
    todo = [a for _, a, _, _ in terms if isinstance(a, fx.Node)]
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.name in inputs:
                return True
        elif n.target not in _SIZE_READS:  # a size read is not a value read
            todo += n.all_input_nodes
    return False


def _unbroadcast_masks(graph: fx.Graph) -> int:
    """Build each fused attention's mask at the shape its inputs have before any `expand` (a causal mask
    made for one sequence and expanded over the batch): scaled_dot_product_attention broadcasts the mask
    itself, so the (1, h, s, s) mask MPT's ALiBi and the causal mask make is kept instead of a (b, h, s, s)
    one. Only where every op from the expand to the fused attention broadcasts elementwise and nothing
    else reads them; returns how many expands went."""
    fused = [n for n in graph.nodes if n.target is _aten.scaled_dot_product_attention.default
             and n.name.startswith(SDPA_NAME) and isinstance(n.kwargs.get("attn_mask"), fx.Node)]
    masks = {n.kwargs["attn_mask"] for n in fused}
    reshaped: set[fx.Node] = set()
    gone = 0
    for e in [n for n in graph.nodes if n.target is _aten.expand.default]:
        src = e.args[0]
        down = _broadcast_readers(e, masks, fused) if isinstance(src, fx.Node) and _rank(src) == _rank(e) else None
        if down is None:
            continue
        e.replace_all_uses_with(src)
        graph.erase_node(e)
        reshaped |= down
        gone += 1
    if reshaped:
        fake = next((n.meta["val"].fake_mode for n in graph.nodes if hasattr(n.meta.get("val"), "fake_mode")), None)
        for n in graph.nodes:  # their shapes from their new inputs, in graph order
            if n in reshaped:
                n.meta["val"] = _value_of(n.target, n.args, n.kwargs, fake)
    return gone


def _broadcast_readers(e: fx.Node, masks: set[fx.Node], fused: list[fx.Node]) -> set[fx.Node] | None:
    """Everything that reads `e`, down to the fused attentions' masks, where all of it is broadcasting
    elementwise ops read by nothing else and the masks are only read as masks; None otherwise."""
    todo, seen = list(_users(e)), set()
    if not todo:
        return None
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.target not in _BROADCASTING:
            return None
        users = _users(n)
        if n in masks:
            if any(u not in fused or u.kwargs.get("attn_mask") is not n or n in u.args for u in users):
                return None
        elif not users:
            return None
        else:
            todo += users
    return seen


def _value_of(target: Any, args: tuple, kwargs: dict, fake: Any) -> Any:
    """The meta value `target` gives on its arguments' meta values (under the graph's fake mode, if any)."""
    vals = torch.utils._pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, (args, kwargs))
    if fake is None:
        return target(*vals[0], **vals[1])
    with fake:
        return target(*vals[0], **vals[1])


def _users(n: fx.Node) -> list[fx.Node]:
    return [u for u in n.users if u.target not in _ASSERT]


def _rank(n: Any) -> int:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else -1


def _shape(n: fx.Node) -> tuple[str, ...]:
    return tuple(str(d) for d in n.meta["val"].shape)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _match(scores: fx.Node) -> _Match | None:
    """Follow `scores` forward to a softmax and a matmul with v; None when the chain is not eager attention."""
    if scores.target is _aten.baddbmm.default:
        bias, q, kt = scores.args[:3]
        beta, alpha = scores.kwargs.get("beta", 1), scores.kwargs.get("alpha", 1)
        if len(scores.args) > 3 or not _number(beta) or not _number(alpha):
            return None
        terms: list[tuple[str, Any, Any, bool]] = [("add", bias, beta, True)] if beta != 0 else []
        scale = float(alpha)
    else:
        q, kt = scores.args[:2]
        terms, scale = [], 1.0
    if _rank(q) not in (3, 4) or _rank(q) != _rank(kt) or _rank(scores) != _rank(q):
        return None
    region = [scores]
    cur, unflatten = scores, None
    while True:  # scores -> softmax: scale, additive terms, casts, one unflattening view
        users = _users(cur)
        if len(users) != 1:
            return None
        u = users[0]
        rest = [a for a in (*u.args, *u.kwargs.values()) if a is not cur]
        if u.target in (_aten.mul.Tensor, _aten.div.Tensor) and len(u.args) == 2 and not u.kwargs and \
                len(rest) == 1 and _number(rest[0]) and (u.target is _aten.mul.Tensor or u.args[0] is cur):
            c = rest[0] if u.target is _aten.mul.Tensor else 1.0 / rest[0]
            if c <= 0:
                return None
            scale *= c
            terms = [(kind, a, b * c if kind == "add" else b, flat) for kind, a, b, flat in terms]
        elif u.target is _aten.add.Tensor and len(u.args) == 2 and u.kwargs.get("alpha", 1) == 1:
            other = rest[0]
            if isinstance(other, fx.Node):
                terms.append(("add", other, 1.0, unflatten is None))
            elif not _number(other):  # a number added to every score cannot change the softmax
                return None
        elif u.target is _aten.masked_fill.Scalar and u.args[0] is cur and _number(u.args[2]) and \
                u.args[2] <= _MASKED:
            terms.append(("fill", u.args[1], u.args[2], unflatten is None))
        elif u.target is _aten.where.ScalarOther and u.args[1] is cur and _number(u.args[2]) and \
                u.args[2] <= _MASKED:
            terms.append(("keep", u.args[0], u.args[2], unflatten is None))
        elif u.target in _CASTS and u.args[0] is cur and _float_cast(u):
            pass
        elif u.target in _VIEWS and unflatten is None and _rank(cur) == 3 and _rank(u) == 4 and \
                _shape(u)[-2:] == _shape(cur)[-2:] and -1 not in list(u.args[1])[:-2]:
            unflatten = u
        elif u.target in _SOFTMAX and u.args[0] is cur and u.args[1] in (-1, _rank(cur) - 1):
            region.append(u)
            cur = u
            break
        else:
            return None
        region.append(u)
        cur = u
    dropout_p = 0.0
    flattened = False
    while True:  # softmax -> probs @ v: casts, one dropout, the view back to the scores' layout
        users = _users(cur)
        if len(users) != 1:
            return None
        u = users[0]
        if u.target in _CASTS and u.args[0] is cur and _float_cast(u):
            pass
        elif u.target is _aten.dropout.default and u.args[0] is cur and dropout_p == 0.0:
            p, train = u.args[1], u.args[2] if len(u.args) > 2 else u.kwargs.get("train", True)
            dropout_p = float(p) if train else 0.0
        elif u.target in _VIEWS and unflatten is not None and not flattened and _rank(u) == 3:
            flattened = True
        elif u.target in (_aten.matmul.default, _aten.bmm.default) and u.args[0] is cur and u.args[1] is not cur:
            if (unflatten is not None) != flattened or _rank(u.args[1]) != _rank(scores):
                return None
            region.append(u)
            return _Match(scores=scores, unflatten=unflatten, terms=tuple(terms), scale=scale,
                          dropout_p=dropout_p, out=u, region=tuple(region))
        else:
            return None
        region.append(u)
        cur = u


def _float_cast(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.is_floating_point()


class _Emit:
    """Adds nodes before the attention's output, with fake values, in the region's module scope."""

    def __init__(self, graph: fx.Graph, m: _Match):
        self.graph, self.m = graph, m
        self.meta = {k: m.out.meta[k] for k in ("nn_module_stack", "stack_trace", "source_fn_stack")
                     if k in m.out.meta}
        self.fake = m.out.meta["val"].fake_mode if hasattr(m.out.meta["val"], "fake_mode") else None

    def __call__(self, target: Any, args: tuple, kwargs: dict | None = None, name: str | None = None) -> fx.Node:
        kwargs = kwargs or {}
        with self.graph.inserting_before(self.m.out):
            node = self.graph.create_node("call_function", target, args, kwargs, name=name)
        node.meta["val"] = _value_of(target, args, kwargs, self.fake)
        node.meta.update(self.meta)
        return node

    def size(self, n: fx.Node, dim: int) -> Any:
        """n.shape[dim] as an int, or read at run time where it is symbolic."""
        d = n.meta["val"].shape[dim]
        return int(d) if not isinstance(d, torch.SymInt) else self(_aten.sym_size.int, (n, dim))


def _lift(emit: _Emit, n: fx.Node, lead: list[Any], lead_shape: tuple[str, ...]) -> fx.Node | None:
    """A (b*h, x, y) operand in the 4-d (b, h, x, y) layout: the tensor it was flattened from when there
    is one, else a reshape; None when its first dim neither matches the flattened one nor broadcasts."""
    if n.target in _VIEWS and _rank(n.args[0]) == 4 and _shape(n.args[0])[:-2] == lead_shape and \
            _shape(n.args[0])[-2:] == _shape(n)[-2:]:
        return n.args[0]
    first = _shape(n)[0]
    if first == "1":
        lead = [1] * len(lead)
    elif first != str(emit.m.scores.meta["val"].shape[0]):
        return None
    return emit(_aten.reshape.default, (n, [*lead, emit.size(n, -2), emit.size(n, -1)]))


def _rewrite(graph: fx.Graph, m: _Match, erased: set[fx.Node]) -> bool:
    emit = _Emit(graph, m)
    if m.scores.target is _aten.baddbmm.default:
        q, kt = m.scores.args[1:3]
    else:
        q, kt = m.scores.args[:2]
    v = m.out.args[1]
    terms = list(m.terms)
    # k itself when k^T transposes the last two dims of it (else k^T transposed back, below)
    k = kt.args[0] if kt.target is _aten.transpose.int and _rank(kt) > 1 and \
        sorted(d % _rank(kt) for d in kt.args[1:3]) == [_rank(kt) - 2, _rank(kt) - 1] else None
    if m.unflatten is not None:  # lift q, k^T, v and the 3-d terms to the 4-d layout of the mask
        lead = list(m.unflatten.args[1])[:-2]
        lead_shape = _shape(m.unflatten)[:-2]
        lifted = [_lift(emit, x, lead, lead_shape) for x in (q, kt if k is None else k, v)]
        for i, (kind, a, b, flat) in enumerate(terms):
            if flat:
                a = _lift(emit, a, lead, lead_shape) if _rank(a) == 3 else None
                lifted.append(a)
                terms[i] = (kind, a, b, False)
        if any(x is None for x in lifted):
            return False  # leaves the dead reshapes, which nothing reads
        q, v = lifted[0], lifted[2]
        kt, k = (lifted[1], None) if k is None else (kt, lifted[1])
    if k is None:
        k = emit(_aten.transpose.int, (kt, -2, -1))
    dtype = q.meta["val"].dtype
    terms, q, k, v, width = _fold_key_bias(emit, [_as_removal(t) for t in terms], q, k, v, m.scale)
    mask = _mask(emit, terms, dtype)
    out = emit(_aten.scaled_dot_product_attention.default, (q, k, v),
               {"attn_mask": mask, "dropout_p": m.dropout_p, "scale": m.scale}, name=SDPA_NAME)
    if width is not None:  # the zero columns v was widened by
        out = emit(_aten.slice.Tensor, (out, -1, 0, width))
    if m.unflatten is not None:
        back = [u for u in m.out.users if u.target in _VIEWS and _shape(u) == _shape(out)]
        if len(m.out.users) == 1 and back:
            back[0].replace_all_uses_with(out)
            graph.erase_node(back[0])  # left reading the fused output, it would look like a model output
            erased.add(back[0])
        else:
            out = emit(_aten.reshape.default, (out, [-1, emit.size(out, -2), emit.size(out, -1)]))
    m.out.replace_all_uses_with(out)
    _erase(graph, m.region, erased)
    return True


_ZEROS = {_aten.zeros.default, _aten.zeros_like.default, _aten.new_zeros.default}


def _as_removal(term: tuple[str, Any, Any, bool]) -> tuple[str, Any, Any, bool]:
    """An additive term that is 0 where a condition holds and a removing value elsewhere (BLOOM's causal mask:
    `where(keep, zeros, finfo.min)`) as the removal it is: the fused op then takes the boolean condition,
    which runs as the kernel's causal path where it is the causal one."""
    kind, a, b, flat = term
    if kind != "add" or not isinstance(a, fx.Node) or b != 1 or \
            a.target not in (_aten.where.ScalarOther, _aten.where.Scalar, _aten.where.ScalarSelf):
        return term
    cond, x, y = a.args[:3]

    def zero(z: Any) -> bool:
        return (_number(z) and z == 0) or (isinstance(z, fx.Node) and z.target in _ZEROS)

    def removing(z: Any) -> bool:
        return _number(z) and z <= _MASKED

    if zero(x) and removing(y):
        return ("keep", cond, y, flat)
    if removing(x) and zero(y):
        return ("fill", cond, x, flat)
    return term


def _key_only(a: Any, k: fx.Node) -> bool:
    """Whether additive term `a` is a bias per key (and per head or sequence), the same for every query: its
    query dim is 1, its key dim k's, and its leading dims broadcast to k's (ALiBi: a slope per head times the
    key's position). Sizes are compared as the shape environment proves them equal (MPT slices its bias to
    `64 - Max(0, 64 - s)`, which is s for every length the trace allows)."""
    if not isinstance(a, fx.Node) or not 2 <= _rank(a) <= 4:
        return False
    shape, ks = a.meta["val"].shape, k.meta["val"].shape
    lead = list(zip(reversed(shape[:-2]), reversed(ks[:-2])))
    return _equal(shape[-2], 1) and _equal(shape[-1], ks[-2]) and all(_equal(d, 1) or _equal(d, e) for d, e in lead)


# ops that write a value they are given (a fill), as a masking computation writes finfo.min or -inf
_FILLS = frozenset("where masked_fill full full_like new_full fill scalar_tensor".split())


def _foldable(a: Any, k: fx.Node) -> bool:
    """A bias per key (`_key_only`) whose computation fills in no removing value (a float at or below -1e4, -inf,
    NaN: finfo.min written by a where or masked_fill): such a value over the scale is -inf in the products'
    columns, and its low part inf - inf (a NaN), where as a mask term it removes the key. Positions are not
    fills: ALiBi's `arange(1 - s, 1)` starts below -1e4 beyond 10K tokens."""
    if not _key_only(a, k):
        return False
    todo, seen = [a], set()
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if _op_name(n).rstrip("_") in _FILLS and any(
                isinstance(x, float) and (x <= _MASKED or x != x) for x in pytree.tree_leaves((n.args, n.kwargs))):
            return False
        todo += n.all_input_nodes
    return True


def _op_name(n: fx.Node) -> str:
    """The ATen op's name without its overload (`where` for aten.where.ScalarOther); "" for anything else."""
    return getattr(getattr(n.target, "overloadpacket", None), "__name__", "")


def _equal(a: Any, b: Any) -> bool:
    return bool(statically_known_true(a == b))


def _fold_key_bias(emit: _Emit, terms: list[tuple[str, Any, Any, bool]], q: fx.Node, k: fx.Node, v: fx.Node,
                   scale: float) -> tuple[list[tuple[str, Any, Any, bool]], fx.Node, fx.Node, fx.Node, Any]:
    """Fold the additive terms that are a bias per key (`_key_only`: ALiBi) into the products themselves, so the
    fused op takes no s x s mask for them (a causal mask left alone runs as the kernel's causal path):

        q' = [q, p, p, 0...]   k' = [k, hi, lo, 0...]   v' = [v, 0...]    with hi + lo = bias / (scale p)

    so q' k'^T * scale = q k^T * scale + bias, exactly where hi and lo hold bias / (scale p) (hi in the queries'
    dtype, lo the rest of it: bf16 queries keep the bias to ~2^-16 of its size, where one bf16 column would
    round ALiBi's large negative values by whole logits). p is the power of two nearest 1 / scale, exact in
    every dtype, so k's columns are as large as the bias itself within a factor of sqrt 2 (bias / scale would
    overflow fp16 at a few thousand tokens: ALiBi reaches slope x length). Zero columns pad the head dim to a
    multiple of 8 (what FlashAttention takes); v gets as many, and the output drops them (the width returned).
    Returns (the terms left, q', k', v', the output's width or None when nothing was folded)."""
    fold = [kind == "add" and _foldable(a, k) for kind, a, _, _ in terms]
    folded = [(a, b) for (_, a, b, _), f in zip(terms, fold) if f]
    if not folded or _rank(q) != 4 or _rank(v) != 4:
        return terms, q, k, v, None
    e, ev = _shape(q)[-1], _shape(v)[-1]
    if not (e.isdigit() and ev == e and _shape(k)[-1] == e):
        return terms, q, k, v, None
    rest = [t for t, f in zip(terms, fold) if not f]
    bias = None
    for a, b in folded:
        t = a if b == 1 else emit(_aten.mul.Tensor, (a, b))
        bias = t if bias is None else emit(_aten.add.Tensor, (bias, t))
    dtype = q.meta["val"].dtype
    p = 2.0 ** round(math.log2(1.0 / scale))
    col = emit(_aten.mul.Tensor, (emit(_aten.transpose.int, (bias, -2, -1)), 1.0 / (scale * p)))  # (.., s, 1)
    # broadcast to k's (b, h, s, 1) by adding it to zeros of that shape, not by an expand: under tensor
    # parallelism k holds this rank's heads, and the split analysis reads the bias's chunk of heads off the add
    col = emit(_aten.add.Tensor, (emit(_aten.full_like.default, (emit(_aten.slice.Tensor, (k, -1, 0, 1)), 0.0)), col))
    hi = emit(_aten._to_copy.default, (col,), {"dtype": dtype})
    lo = emit(_aten._to_copy.default, (emit(_aten.sub.Tensor, (col, hi)),), {"dtype": dtype})
    pad = -(int(e) + 2) % 8

    def wider(x: fx.Node, cols: list[fx.Node], value: float = 0.0) -> fx.Node:
        """x, the columns `cols`, then `value` in the columns up to the padded width. The new columns are made
        like x's first column (`full_like`), not from sizes: under tensor parallelism they hold this rank's
        heads, as x does."""
        first = emit(_aten.slice.Tensor, (x, -1, 0, 1))

        def columns(v: float, n: int) -> list[fx.Node]:
            if not n:
                return []
            return [emit(_aten.expand.default, (emit(_aten.full_like.default, (first, v)), [-1, -1, -1, n]))]

        fill = columns(value, 2) if value else []
        return emit(_aten.cat.default, ([x, *cols, *fill, *columns(0.0, pad + 2 - 2 * len(fill) - len(cols))], -1))

    return rest, wider(q, [], p), wider(k, [hi, lo]), wider(v, []), int(e)


def _mask(emit: _Emit, terms: list[tuple[str, Any, Any, bool]], dtype: torch.dtype) -> fx.Node | None:
    """The additive float mask of the terms (a boolean keep-mask for a single removal)."""
    if len(terms) == 1 and terms[0][0] in ("fill", "keep"):
        kind, cond, _, _ = terms[0]
        return emit(_aten.logical_not.default, (cond,)) if kind == "fill" else cond
    mask = None
    for kind, a, b, _ in terms:
        if kind == "add":
            t = a if b == 1 else emit(_aten.mul.Tensor, (a, b))
            mask = t if mask is None else emit(_aten.add.Tensor, (mask, t))
        elif kind == "fill":  # removed where a holds
            mask = emit(_aten.where.Scalar, (a, b, 0.0)) if mask is None else \
                emit(_aten.where.ScalarSelf, (a, b, mask))
        else:  # kept where a holds
            mask = emit(_aten.where.Scalar, (a, 0.0, b)) if mask is None else \
                emit(_aten.where.ScalarOther, (a, mask, b))
    # the fused op takes a bool, fp32 or the queries' dtype of mask (an fp32 mask beside bf16 queries
    # under mixed precision too): no copy of it per call unless it has another dtype
    if mask is None or mask.meta["val"].dtype in (torch.float32, dtype):
        return mask
    return emit(_aten.to.dtype, (mask, dtype))


def _erase(graph: fx.Graph, region: tuple[fx.Node, ...], erased: set[fx.Node]) -> None:
    """Remove the replaced nodes, their assertions, and views of q, k, v nothing reads any more."""
    todo = list(reversed(region))
    while todo:
        n = todo.pop(0)
        if n in erased:
            continue
        for u in [u for u in n.users if u.target in _ASSERT]:
            graph.erase_node(u)
            erased.add(u)
        if n.users:
            continue
        inputs = [a for a in n.all_input_nodes if a.op == "call_function"]
        graph.erase_node(n)
        erased.add(n)
        todo += [a for a in inputs if a.target in _VIEWS | {_aten.transpose.int} and not _users(a)]


def causal_attention(node: fx.Node) -> bool:
    """Whether a scaled_dot_product_attention node of an exported graph attends causally, as the graph shows.

    True for `is_causal=True`, and for an attn_mask computed from shapes alone (its ancestors read no graph
    input, parameter, buffer or constant but for their sizes) through an ordering comparison of two
    position tensors, as Hugging Face's create_causal_mask builds `kv_idx <= q_idx` from aranges (a sliding
    window adds a second comparison: fewer products still, counted as causal). False for no mask (full
    attention) and for a mask read from the inputs (a padding mask): its values are the data's, which the
    graph does not show. A tril buffer (nanoGPT's registered `bias`) is a buffer's values: False here;
    `causal_shape_mask` evaluates such a mask from the buffer's traced values where the trace has them.
    """
    causal = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
    if causal is True:
        return True
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    ancestors = from_shapes(mask) if isinstance(mask, fx.Node) else None
    return bool(ancestors) and any(n.target in _ORDER and all(isinstance(a, fx.Node) for a in n.args[:2])
                                   for n in ancestors)


def from_shapes(value: fx.Node, buffers: Collection[fx.Node] = ()) -> list[fx.Node] | None:
    """The nodes `value` is computed from, up to the size reads, where it is computed from shapes alone: its
    ancestors read no graph input, parameter, buffer or constant but for their sizes. None otherwise.

    `buffers`: placeholders of buffers the graph never writes, which may be read whole too (a registered tril
    buffer, nanoGPT's `bias`): they are among the nodes returned, and the value is then a function of theirs."""
    seen: dict[fx.Node, None] = {}  # ordered, and O(1) to look up
    todo = [value]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n.op == "placeholder" and n in buffers:
            seen[n] = None
            continue
        if n.op != "call_function":  # a placeholder (input, parameter, buffer, constant) or get_attr read whole
            return None
        seen[n] = None
        if n.target not in _SIZE_READS:
            todo += n.all_input_nodes
    return list(seen)


def shape_mask_key(value: fx.Node, buffers: Collection[fx.Node] = ()) -> str:
    """A digest of how `value` (computed from shapes alone, `from_shapes`) is computed: its ops in graph order,
    their constant arguments, which of them feeds which, and the tensors whose sizes they read (by name: masks
    made alike from different tensors' sizes need not agree). Equal for two traces of one model; a sliding
    window of 8 and of 16, or a causal mask, differ. The runtime's verdict for a mask is cached per call site
    (runtime.pipeline.attention), and a process may run the programs of two models whose sites share a name:
    the digest in the site keeps their verdicts apart."""
    nodes = from_shapes(value, buffers)
    if nodes is None:
        raise ValueError(f"{value.name} is not computed from shapes alone")
    where = {n: i for i, n in enumerate(value.graph.nodes)}
    order = {n: i for i, n in enumerate(sorted(nodes, key=where.__getitem__))}
    def ref(a: fx.Node) -> str:  # outside the computation: a tensor a size read reads
        return f"%{order[a]}" if a in order else f"sizes of {a.name}"

    lines = [f"{getattr(n.target, '__name__', n.target)}{fx.node.map_arg((n.args, n.kwargs), ref)!r}"
             for n in order]
    lines.append(f"out %{order[value]}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


# the most bytes any tensor of a mask's computation may take for `causal_shape_mask` to evaluate it when tracing
# (a (b, 1, s, s) bool mask: s = 16384 at b = 1). A longer sequence's mask is evaluated with the sequence's sizes
# divided by 2, 4, ... up to 64 until it fits: a mask made from shapes alone by position comparisons is causal at
# every length or at none, except through a window or an offset at least as long as the shorter sequence (a sliding
# window of 4K evaluated at 4K looks causal): a computation that reads a number that large is not shortened (charged
# as kept). Charging every long causal mask as kept would put every long-sequence plan over its memory (MPT at 64K
# tokens: 4 GiB of mask per layer); the runtime checks the mask it makes on the real sizes either way
# (runtime.pipeline.attention).
_EVALUATED_BYTES = 2 ** 28
_SHRINKS = (1, 2, 4, 8, 16, 32, 64)


def causal_shape_mask(node: fx.Node, examples: dict[fx.Node, Any],
                      verdicts: dict[fx.Node, bool] | None = None, buffers: Collection[fx.Node] = ()) -> bool:
    """Whether the attn_mask of a scaled_dot_product_attention node is computed from shapes alone and, evaluated
    at the traced sizes (`examples`: graph input -> example tensor, read for its sizes only), is exactly the
    causal mask `is_causal=True` applies (`torch.ones(L, S).tril()`, broadcast over batch and heads).

    Generated code attends through runtime.pipeline.attention.shape_mask_attention, which makes the same
    check on the mask it computes at run time, per call site and mask shape, so a sliding window longer than
    the traced sequence still runs as its mask says; this verdict only tells the cost rule that no mask is kept
    at the traced size. A mask whose computation makes a tensor of more than 256 MiB there is evaluated at shorter
    lengths (`_SHRINKS`), unless it reads a number as large as them (a window); if none fits, False: it is charged
    as kept. `verdicts`: mask node -> verdict, kept across the calls of one graph (a mask every
    layer reads is evaluated once).

    `buffers`: placeholders of buffers the graph never writes, with their traced values in `examples`: a mask
    made from one (a tril buffer sliced to the sequence) is evaluated from those values, which the runtime
    checks again whenever the buffer has changed. On the meta device there are no values: False.
    """
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    if not isinstance(mask, fx.Node):
        return False
    if verdicts is not None:
        if mask not in verdicts:
            verdicts[mask] = causal_shape_mask(node, examples, buffers=buffers)
        return verdicts[mask]
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or val.dim() < 2:
        return False
    order = from_shapes(mask, buffers)
    if order is None or not (causal_attention(node) or any(n in buffers for n in order)):
        return False
    index = {n: i for i, n in enumerate(node.graph.nodes)}
    order.sort(key=index.__getitem__)
    try:
        for shrink in _SHRINKS:  # the traced sizes, else the same sizes over 2, 4, ... (see the note above)
            at = _shrunk(examples, val.shape[-2:], shrink, buffers)
            shapes = _evaluate(order, at, torch.device("meta"))  # sizes first, at no cost
            if max((t.numel() * t.element_size() for t in shapes.values() if isinstance(t, torch.Tensor)),
                   default=0) <= _EVALUATED_BYTES:
                break
        else:
            return False
        if shrink > 1 and _largest_constant(order) >= min(int(d) for d in shapes[mask].shape[-2:]):
            return False  # a window or offset the shorter length may not reach: charged as kept
        keep = _evaluate(order, at, torch.device("cpu"))[mask]
    except Exception:  # noqa: BLE001 - a mask this evaluation cannot compute is charged as kept
        return False
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        return False
    L, S = keep.shape[-2:]
    return bool((keep == torch.ones(L, S, dtype=torch.bool).tril()).all())


# ops whose numbers are values positions are compared or shifted by (not dims, indices or slice bounds)
_VALUE_OPS = frozenset("add sub rsub mul div remainder fmod floor_divide le lt ge gt eq ne maximum minimum clamp "
                       "clamp_min clamp_max where masked_fill".split())


def _largest_constant(order: list[fx.Node]) -> float:
    """The largest magnitude of an integer the computation `order` computes with (a window's 4096, an offset's 1;
    positions are integers, a fill value such as finfo.min is not one)."""
    nums = [abs(a) for n in order if n.op == "call_function" and
            _op_name(n) in _VALUE_OPS
            for a in pytree.tree_leaves((n.args, n.kwargs)) if isinstance(a, int) and not isinstance(a, bool)]
    return max(nums, default=0.0)


def _shrunk(examples: dict[fx.Node, Any], sizes: Any, shrink: int, buffers: Collection[fx.Node]) -> dict[fx.Node, Any]:
    """`examples` with every dim of a model input that has one of the mask's traced sizes (the sequence) divided
    by `shrink` (as meta tensors: only sizes are read); buffers keep their values."""
    if shrink == 1:
        return examples
    seq = {int(d.node.hint) if isinstance(d, torch.SymInt) else int(d) for d in sizes
           if not isinstance(d, torch.SymInt) or d.node.hint is not None}
    out = dict(examples)
    for n, t in examples.items():
        if n in buffers or not isinstance(t, torch.Tensor):
            continue
        shape = [d // shrink if d in seq and d % shrink == 0 else d for d in t.shape]
        out[n] = torch.empty(shape, dtype=t.dtype, device="meta")
    return out


def _evaluate(order: list[fx.Node], examples: dict[fx.Node, Any], device: torch.device) -> dict[fx.Node, Any]:
    """The values of `order` (a shape-only computation, in graph order), every factory on `device`."""
    values: dict[fx.Node, Any] = {}
    for n in order:
        if n.op == "placeholder":  # a buffer the graph never writes: its traced values (sizes alone on meta)
            src = examples[n]
            values[n] = torch.empty(src.shape, dtype=src.dtype, device="meta") if device.type == "meta" else \
                src.detach().to(device)
            continue
        if n.target in _SIZE_READS:
            src = examples[n.args[0]]
            values[n] = n.target(torch.empty(src.shape, dtype=src.dtype, device="meta"), *n.args[1:])
            continue
        args, kwargs = pytree.tree_map(
            lambda a: values[a] if isinstance(a, fx.Node) else device if isinstance(a, torch.device) else a,
            (n.args, n.kwargs))
        values[n] = n.target(*args, **kwargs)
    return values
