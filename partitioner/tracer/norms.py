"""RMSNorms written out as ops, found by what they compute and rewritten to the one fused `aten.rms_norm`.

Hugging Face's Llama-style RMSNorm (Llama, Mistral, Qwen2/3 and their q/k norms, DeepSeek, OLMo2, Phi3 ...)

    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)

runs six kernels, and under a 16-bit recipe autograd keeps the fp32 copy of x (4 bytes an element, which the cost
model charges: tracer.upcasts.stays_fp32) and the normalised x in the compute dtype for the weight's gradient:
6 bytes an element per norm, two norms a layer. `aten.rms_norm(x, [h], weight, eps)` computes the statistics in
fp32 inside one kernel (CUDA: torch's fused kernel; CPU: the composite, the same arithmetic) and keeps x alone, as
Megatron-LM's and TransformerEngine's fused norms do and torchtitan's `nn.RMSNorm`. `fuse_norms` rewrites the
chain in the graph that costs and generated code both read, so the runtime runs what the cost model counts.

Matched by structure, never by module name: a `rsqrt` of (the mean over the last dim, kept, of x squared) plus a
number, multiplied by that same x (or its upcast), then a cast back to x's dtype and a product with a
one-dimensional tensor of the normalised width (the weight), in either order (OLMo2 applies the weight before the
cast), or one of them, or neither. Every intermediate must be read by the chain alone. In fp32 the
fused op is equal to the chain, forward and backward (tests/test_norms.py); under 16-bit recipes it rounds once
where the chain rounds the normalised x before the weight (one unit in the last place, as any fused norm).
A norm that computes anything else (Gemma's `1 + weight` in fp32, a mean over other dims, a cast back to a dtype
that is not x's) is left as traced.
"""

from __future__ import annotations

import torch
from torch import fx

from partitioner.tracer.pointwise import FUSED_NAME
from partitioner.tracer.upcasts import CASTS, cast_dtype, casts_known, is_upcast, stays_fp32

__all__ = ["fuse_norms"]

_aten = torch.ops.aten
_ADDS = {_aten.add.Tensor, _aten.add.Scalar}
_ASSERT = _aten._assert_tensor_metadata.default


def fuse_norms(gm: fx.GraphModule) -> int:
    """Rewrite every RMSNorm spelled as ops in `gm`'s graph to `aten.rms_norm`, in place; returns how many."""
    count = 0
    known = casts_known(gm.graph)
    for r in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _aten.rsqrt.default]:
        found = _match(r, known)
        if found is None:
            continue
        x, h, weight, eps, out, region = found
        with gm.graph.inserting_before(out):
            fused = gm.graph.call_function(_aten.rms_norm.default, (x, [h], weight, eps), name=FUSED_NAME + "rms_norm")
        fused.meta = {k: v for k, v in out.meta.items() if k != "custom"}
        out.replace_all_uses_with(fused)
        while region:  # each once nothing reads it (export's dtype assertions go with their cast)
            n = next(n for n in region if not _readers(n))
            for a in list(n.users):
                gm.graph.erase_node(a)
            gm.graph.erase_node(n)
            region.discard(n)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _readers(n: fx.Node) -> list[fx.Node]:
    """Who reads `n`, without export's dtype assertions (they check a cast's result, and go with it)."""
    return [u for u in n.users if u.target is not _ASSERT]


def _only(n: fx.Node, target) -> fx.Node | None:
    """The one reader of `n`, if there is exactly one and it calls `target` (a set of them, or one)."""
    users = _readers(n)
    if len(users) != 1 or users[0].op != "call_function":
        return None
    u = users[0]
    return u if (u.target in target if isinstance(target, (set, frozenset)) else u.target is target) else None


def _val(n) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _other(n: fx.Node, one: fx.Node):
    """The operand of binary `n` that is not `one` (None if `one` is not an operand, or both are)."""
    a, b = n.args[:2]
    return b if a is one and b is not one else a if b is one and a is not one else None


def _match(r: fx.Node, known: bool):
    """(x, width, weight or None, eps, the node the fused op replaces, the nodes it replaces) for the RMSNorm whose
    rsqrt is `r`, or None."""
    add = r.args[0]
    if not isinstance(add, fx.Node) or add.target not in _ADDS or _only(add, _aten.rsqrt.default) is not r:
        return None
    mean = next((a for a in add.args[:2] if isinstance(a, fx.Node)), None)
    eps = _other(add, mean) if mean is not None else None
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or mean.target is not _aten.mean.dim:
        return None
    sq = mean.args[0]
    if not isinstance(sq, fx.Node) or _only(sq, _aten.mean.dim) is not mean or _only(mean, _ADDS) is not add:
        return None
    rank = _val(sq).dim() if _val(sq) is not None else 0
    dims, keep = mean.args[1], mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if not keep or rank == 0 or list(dims) not in ([-1], [rank - 1]) or mean.kwargs.get("dtype") is not None:
        return None
    if sq.target is _aten.pow.Tensor_Scalar and sq.args[1] == 2:
        u = sq.args[0]
    elif sq.target is _aten.mul.Tensor and sq.args[0] is sq.args[1]:
        u = sq.args[0]
    else:
        return None
    x = u.args[0] if cast_dtype(u) == torch.float32 and isinstance(u.args[0], fx.Node) else u
    xv = _val(x)
    if xv is None or not xv.is_floating_point() or xv.dim() != rank or not isinstance(xv.shape[-1], int):
        return None
    normed = _only(r, _aten.mul.Tensor)
    if normed is None or _other(normed, r) not in (u, x):
        return None
    region = {add, mean, sq, r, normed}

    def back_to_x(n: fx.Node) -> fx.Node | None:
        # a cast back must give x's dtype at run time, as aten.rms_norm's output has: both follow the parameters'
        # dtype (the casts were told apart, tracer.upcasts)
        c = _only(n, CASTS)
        ok = c is not None and known and not is_upcast(c) and not stays_fp32(x) and "memory_format" not in c.kwargs
        return c if ok else None

    def weighted(n: fx.Node) -> tuple[fx.Node, fx.Node] | tuple[None, None]:
        scale = _only(n, _aten.mul.Tensor)
        w = _other(scale, n) if scale is not None else None
        wv = _val(w)
        ok = wv is not None and w.op == "placeholder" and wv.dim() == 1 and wv.shape[0] == xv.shape[-1] and \
            wv.dtype == xv.dtype
        return (scale, w) if ok else (None, None)

    # what follows the normalised x: a cast back then the weight (Llama), the weight then a cast back (OLMo2), one
    # of them, or neither
    chain = [normed]
    back = back_to_x(normed)
    chain += [back] if back is not None else []
    scale, weight = weighted(chain[-1])
    chain += [scale] if scale is not None else []
    if back is None and scale is not None:
        back = back_to_x(scale)
        chain += [back] if back is not None else []
    region.update(chain)
    out = chain[-1]
    if back is None and u is not x and (not known or is_upcast(u) != stays_fp32(x)):
        return None  # the chain's output has u's dtype, aten.rms_norm's x's: only where they agree at run time
    if u is not x and all(v in region for v in _readers(u)):
        region.add(u)
    if not all(v in region for n in region if n is not out for v in _readers(n)):
        return None
    return x, int(xv.shape[-1]), weight, float(eps), out, region
