"""Attention under a mask the model computes from shapes alone: the fused kernel's causal path where the mask is
the causal one.

Hugging Face's models build their attention mask from positions (`create_causal_mask`: `kv_idx <= q_idx` over
aranges, a sliding window, packed documents from the position ids), and a traced graph passes it to
`scaled_dot_product_attention` as a boolean tensor. With a mask, the fused kernels fall back from
FlashAttention to a masked kernel, and the mask is turned into an additive one and kept for backward, an
(L, S) tensor per layer and microbatch. Where the code generator sees a mask computed from shapes alone
(partitioner.codegen.segments), the generated code calls `shape_mask_attention` instead: a mask that is
exactly the causal one (`torch.ones(L, S).tril()`, top-left aligned, as `is_causal=True` applies it) is
dropped for `is_causal=True`, an all-true one for no mask, and any other is passed as it is. Same math, so the
same values up to the kernel's rounding.

The mask's values depend only on its shape and on the code that computes it (that is what "from shapes alone"
means), so the verdict is made once per call site (`site`, the generated code's name for the call), shape and
device, and cached: one comparison per shape, not per call. Two sites may compute different masks of one
shape (a model whose layers alternate sliding-window and full attention): each has its own verdict. The code
generator's site names the call and carries a digest of the mask's computation, so the programs of two models
run in one process never share a verdict.

A mask made from a buffer the graph never writes as well (nanoGPT's registered tril `bias`, sliced to the
sequence) is a function of the shape and of that buffer's values: the generated code passes the buffer
(`sources`), and the verdict is cached per buffer (held weakly, so another model's buffer that comes to live
at the same address starts afresh) and per its version counter and storage, so a buffer written in place or
given new storage since is read again.

>>> q = k = v = torch.randn(1, 2, 4, 8)
>>> tri = torch.ones(4, 4, dtype=torch.bool).tril().view(1, 1, 4, 4)
>>> out = shape_mask_attention(q, k, v, tri, site="doc")
>>> torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, tri))
True
>>> mask_verdict(tri, "doc")
'causal'
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from runtime.context.program import mask_pattern

__all__ = ["mask_verdict", "shape_mask_attention"]

_VERDICTS: dict[tuple, str] = {}  # (site, mask shape, device) -> "causal" | "full" | "other"
# masks made from buffers: per first buffer (held weakly: a tensor's address and version may come back on another
# buffer, its identity may not), (site, mask shape, device, the buffers' versions and storages) -> verdict
_SOURCE_VERDICTS = WeakIdKeyDictionary()


@torch.compiler.disable  # a verdict is a Python value read off the mask: torch.compile runs it as it is
def mask_verdict(mask: torch.Tensor, site: str, sources: tuple[torch.Tensor, ...] = ()) -> str:
    """"causal", "full" or "other" for a boolean mask computed from shapes alone at call site `site` (cached
    per site, shape and device), or from shapes and the buffers `sources` (cached per buffer object too, and per
    its version counter and storage, so a buffer written in place or given new storage since is read again;
    a write through `.data`, which no version counter sees, is not)."""
    key = (site, tuple(mask.shape), mask.device)
    if sources:
        cache = _SOURCE_VERDICTS.setdefault(sources[0], {})
        key = (*key, *((s.data_ptr(), s._version) for s in sources), *(id(s) for s in sources[1:]))
    else:
        cache = _VERDICTS
    verdict = cache.get(key)
    if verdict is None:
        verdict = cache[key] = mask_pattern(mask)
    return verdict


def shape_mask_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                         *, scale: float | None = None, enable_gqa: bool = False, site: str,
                         sources: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """`aten.scaled_dot_product_attention` for a mask computed from shapes alone by the code at `site` (and from
    the buffers `sources`): a causal mask runs as `is_causal=True`, an all-true one as none, any other as it is."""
    if attn_mask is not None and attn_mask.dtype == torch.bool and attn_mask.dim() >= 2:
        verdict = mask_verdict(attn_mask, site, tuple(sources))
        if verdict != "other":
            attn_mask, is_causal = None, verdict == "causal"
    return torch.ops.aten.scaled_dot_product_attention.default(query, key, value, attn_mask, dropout_p, is_causal,
                                                               scale=scale, enable_gqa=enable_gqa)
