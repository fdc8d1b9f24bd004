"""Attention under a mask computed from shapes alone, in segment code: the fused kernel's causal path.

Used by `partitioner.codegen.segments` while it copies a segment's nodes (at cp = 1; context parallelism
has its own attention, `partitioner.codegen.segment_cp`). A traced Hugging Face model passes the mask it
builds from positions (`kv_idx <= q_idx` over aranges) to `scaled_dot_product_attention` as a boolean
tensor, which keeps the fused kernels off their causal path (FlashAttention) and is kept for backward. Such a
call becomes

    shape_mask_attention(q, k, v, mask, ..., site="<segment>: <node> <digest of the mask's computation>")

(runtime.pipeline.attention): the same arguments, the mask dropped for `is_causal=True` where it is exactly the
causal one, as the code runs (checked once per call site and mask shape). The cost rule counts no mask where
the tracer found it causal at the traced sizes (partitioner.tracer.attention.causal_shape_mask). A mask made
from a buffer the graph never writes as well (nanoGPT's registered tril `bias`, sliced to the sequence) is a
function of the shape and of that buffer's values: the call passes the buffer too (`sources=(bias,)`), and the
runtime checks the mask again whenever the buffer is another tensor or was written since (its version
counter). A mask read from the inputs (padding) is left to the plain call: its values are the batch's. The digest
(partitioner.tracer.attention.shape_mask_key) keeps the verdicts of two models apart where a process runs the
programs of both and their sites share a name (Llama's causal mask, Mistral's sliding window).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import fx

from partitioner.tracer.attention import from_shapes

__all__ = ["ATTENTION_FUNCTIONS", "attention_mask", "mask_sources", "shape_mask", "shape_mask_attention"]

_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default


def shape_mask_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                         enable_gqa=False, site, sources=()):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


ATTENTION_FUNCTIONS = ("shape_mask_attention",)


def attention_mask(n: fx.Node) -> Any:
    """The attn_mask argument of a scaled_dot_product_attention node (None where it has none)."""
    return n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)


def shape_mask(n: fx.Node, buffers: Collection[fx.Node] = ()) -> bool:
    """Whether `n` is a scaled_dot_product_attention whose boolean mask is computed from shapes alone, or from
    shapes and `buffers` (placeholders of buffers the graph never writes)."""
    if n.target is not _ATTENTION:
        return False
    mask = attention_mask(n)
    val = mask.meta.get("val") if isinstance(mask, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype == torch.bool and from_shapes(mask, buffers) is not None


def mask_sources(n: fx.Node, buffers: Collection[fx.Node]) -> tuple[fx.Node, ...]:
    """The buffers a `shape_mask` attention node's mask is made from (empty for a mask of shapes alone)."""
    return tuple(b for b in from_shapes(attention_mask(n), buffers) or () if b in buffers)
