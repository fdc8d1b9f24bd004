"""What a context-parallel program's generated code calls: attention over the cp group, and the rank's
positions of a value computed at the whole sequence length.

The code generator (`partitioner.codegen.segment_cp`) rewrites the traced graph of a cp > 1 plan: each
`scaled_dot_product_attention` becomes `cp_attention` (ring or Ulysses, as the plan's `cp_kind` says), and
a value computed from shapes alone (an `arange` of positions, rotary cos/sin tables) is computed at the
whole length and read through `cp_positions`: this rank's tokens in the load-balanced layout
(`runtime.context.sequence`), as its activations hold them.

>>> ctx = CPContext(group=None, collectives=None, rank=1, world=2, kind="ring")
>>> cp_positions(torch.arange(8) * 10, 0, ctx)
tensor([20, 30, 40, 50])
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from runtime.comm.collectives import Collectives
from runtime.context.ring_attention import ring_attention
from runtime.context.sequence import positions
from runtime.context.ulysses import ulysses_attention

__all__ = ["CPContext", "cp_attention", "cp_positions", "mask_pattern"]


class CPContext(NamedTuple):
    """The context-parallel group as generated code sees it (the `cp` argument of every segment function
    of a cp > 1 plan). rank: this rank's context slice (its index in the group); world: cp."""

    group: object
    collectives: Collectives | None
    rank: int
    world: int
    kind: Literal["ring", "all-to-all"] = "ring"


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                 is_causal: bool, scale: float | None, cp: CPContext) -> torch.Tensor:
    """`aten.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=..., scale=...)` over the whole
    sequence, each rank holding its tokens (B, H, S/cp, D): a ring attention or Ulysses' all-to-alls over
    the cp group. attn_mask: None, or the whole (..., S, S) mask the model computed from shapes alone,
    which must be causal or full (`mask_kind`)."""
    if attn_mask is not None:
        is_causal = mask_kind(attn_mask, q.shape[2] * cp.world) == "causal"
    fn = ring_attention if cp.kind == "ring" else ulysses_attention
    return fn(q, k, v, cp.group, cp.collectives, causal=bool(is_causal), scale=scale)


def mask_kind(mask: torch.Tensor, seq_len: int) -> str:
    """"causal" or "full" for an attention mask over the whole sequence (bool: True attends; float: added to
    the scores, 0 attends); ValueError for any other, which context parallelism cannot split.

    >>> mask_kind(torch.ones(4, 4, dtype=torch.bool).tril().view(1, 1, 4, 4), 4)
    'causal'
    """
    if tuple(mask.shape[-2:]) != (seq_len, seq_len):
        raise ValueError(f"context parallelism: an attention mask of shape {tuple(mask.shape)} for a sequence of "
                         f"{seq_len} tokens; the ring and Ulysses kernels take a causal mask or none")
    kind = mask_pattern(mask)
    if kind != "other":
        return kind
    raise ValueError("context parallelism: the model's attention mask is neither causal nor full (a sliding "
                     "window, a prefix or block mask, an additive bias such as ALiBi), which the ring and Ulysses "
                     "kernels cannot split over the sequence; compile with cp=1")


def mask_pattern(mask: torch.Tensor) -> str:
    """"causal" where every (L, S) slice of `mask` is `torch.ones(L, S).tril()` (top-left aligned, as
    `is_causal=True` attends), "full" where it attends everywhere, "other" otherwise (bool: True attends;
    float: added to the scores, 0 attends).

    >>> mask_pattern(torch.ones(3, 5, dtype=torch.bool)), mask_pattern(torch.zeros(2, 2).fill_(-1e9).triu(1))
    ('full', 'causal')
    """
    keep = mask if mask.dtype == torch.bool else mask == 0
    tri = torch.ones(*keep.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    if bool((keep == tri).all()):
        return "causal"
    return "full" if bool(keep.all()) else "other"


def cp_positions(full: torch.Tensor, dim: int, cp: CPContext) -> torch.Tensor:
    """This rank's rows along `dim` of a value computed at the whole sequence length (positions, a
    position embedding's ids, rotary tables): the positions its tokens hold."""
    idx = positions(full.shape[dim], cp.rank, cp.world).to(full.device)
    return full.index_select(dim, idx)
