"""DeepSpeed-Ulysses: swap the sequence split for a head split around attention, by all-to-all.

Jacobs et al. 2023 ("DeepSpeed Ulysses"). Rank r of cp holds q, k, v for its tokens (B, H, S/cp, D); one
all-to-all per tensor gives it heads r*H/cp .. (r+1)*H/cp - 1 for the whole sequence (B, H/cp, S, D), it
runs plain SDPA there, and one all-to-all takes the output back to (B, H, S/cp, D). Each all-to-all
moves (cp - 1)/cp of the tensor; the backward of an all-to-all is the reverse all-to-all.

The tokens come in the same load-balanced layout as ring attention's (`runtime.context.sequence`), so a
model can switch between the two without resharding. After the all-to-all the sequence is the ranks'
shards in rank order; under a causal mask it is put back in true order first (an index_select by
`positions`) and the output taken back to the shards' order after, since `is_causal` reads the order.
Without a mask attention does not depend on the order of the keys and each output row follows its
query, so nothing is reordered.

The query heads must divide by cp: there is no part-head split. Under GQA with fewer k/v heads than
cp can split, k and v are repeated to one head per query head before the all-to-all (as DeepSpeed
does), at cp's share of the extra traffic.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.comm.collectives import Collectives
from runtime.comm.groups import group_size
from runtime.context.ring_attention import check_heads
from runtime.context.sequence import check_divisible, positions

__all__ = ["ulysses_attention"]


def _seq_to_heads(x: torch.Tensor, group, coll: Collectives) -> torch.Tensor:
    """(B, H, S/cp, D) this rank's tokens -> (B, H/cp, S, D) this rank's heads, tokens in rank order."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).movedim(1, 0).contiguous()    # (cp, B, H/cp, S/cp, D): chunk j to rank j
    recv = torch.empty_like(send)                                        # chunk i: rank i's tokens
    coll.all_to_all(recv, send, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group, coll: Collectives) -> torch.Tensor:
    """(B, H/cp, S, D) this rank's heads -> (B, H, S/cp, D) this rank's tokens: the inverse of _seq_to_heads."""
    cp = dist.get_world_size(group)
    b, hl, seq, d = x.shape
    send = x.reshape(b, hl, cp, seq // cp, d).movedim(2, 0).contiguous()  # (cp, B, H/cp, S/cp, D): rank j's tokens
    recv = torch.empty_like(send)                                         # chunk i: head group i
    coll.all_to_all(recv, send, group)
    return recv.movedim(0, 1).reshape(b, cp * hl, seq // cp, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, coll):
        ctx.group, ctx.coll = group, coll
        return _seq_to_heads(x, group, coll)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.coll), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, coll):
        ctx.group, ctx.coll = group, coll
        return _heads_to_seq(x, group, coll)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.coll), None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, collectives: Collectives, *,
                      causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's tokens over the whole sequence by a head split over the cp `group`.

    q (B, H, S/cp, D), k and v (B, H_kv, S/cp, D) in the load-balanced layout, H and H_kv divisible by
    cp. Returns (B, H, S/cp, D), this rank's rows of `F.scaled_dot_product_attention` on the full
    sequence, differentiable in q, k and v. A group of None or of one rank is plain SDPA.
    """
    groups = check_heads(q, k, v)
    cp = group_size(group)
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=groups > 1)
    if q.shape[1] % cp:
        raise ValueError(f"Ulysses splits the heads over the context-parallel ranks: {q.shape[1]} query heads do "
                         f"not divide by cp={cp}; choose a cp dividing {q.shape[1]}, or use ring_attention, which "
                         f"splits no heads")
    if k.shape[1] % cp:
        # too few k/v heads to split: each rank needs the k/v heads its query heads use, so send them repeated
        k, v, groups = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), 1
    seq = q.shape[2] * cp
    check_divisible(seq, cp)
    qh, kh, vh = (_SeqToHeads.apply(t, group, collectives) for t in (q, k, v))   # (B, H/cp, S, D)
    if causal:
        held = torch.cat([positions(seq, r, cp) for r in range(cp)]).to(q.device)  # position of each row
        order = torch.argsort(held)                                               # rows in true order
        qh, kh, vh = (t.index_select(2, order) for t in (qh, kh, vh))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale, enable_gqa=groups > 1)
    if causal:
        out = out.index_select(2, held)                                           # back to the shards' order
    return _HeadsToSeq.apply(out, group, collectives)
