"""Ring attention over a context-parallel group: each rank keeps its queries, the keys and values go round.

Liu et al. 2023 ("Ring Attention with Blockwise Transformers"), in the form of Megatron-Core's
`AttnFuncWithCPAndKVP2P` and zhuzilin's ring-flash-attention. Rank r of cp holds its tokens in the
load-balanced layout (`runtime.context.sequence`): q, k, v of shape (B, H, S/cp, D).

Forward, cp steps. At step i rank r holds the k/v block of rank src = (r - i) mod cp; it attends its
queries to that block while the block moves on to rank r + 1 (and the next arrives from r - 1), and merges
the block's result into a running (out, lse) by the online softmax, in fp32:

    lse' = logaddexp(lse, lse_b),   out' = out * exp(lse - lse') + out_b * exp(lse_b - lse')

Causal masking compares global positions (`sequence.positions`) of the queries and of the block's keys; a
block wholly in the future is skipped, and only the rows and columns that see something are computed. In
the load-balanced layout that is: the own block (step 0) in full with the mask, then each other block
either all queries against the head half of its keys (src < r) or the tail half of the queries against
all its keys (src > r), unmasked: the same work on every rank at every step.

Backward, the ring again (as ring-flash-attention): the k/v blocks go round once more, each rank
recomputes the block's probabilities p = exp(s - lse) from the saved q, k, v and final lse, adds its
dq locally, and passes the block's dk/dv accumulator to rank r + 1 along with it, one step behind; after
cp steps each accumulator has every rank's share and arrives back at the block's owner.

    dv_b = p^T do,   ds = p * (do v_b^T - rowsum(do * out)),   dq += ds k_b * scale,   dk_b = ds^T q * scale

Point to point: Gloo runs isend/irecv (docs: TORCH-NOTES "Collectives over Gloo"), through
`Collectives.send/recv`, so the shim counts the ring's traffic: per call, cp - 1 sends of a k/v block
forward, cp - 1 of k/v plus cp of dk/dv backward. Gloo matches messages by (source, tag) only, so each
step and direction has its own tag (`_tag`), every receive names its peer, and every rank posts in the
same order. A block is computed in fp32 by a kernel that returns its log-sum-exp and whose backward
takes the final one (`block_forward`, `block_backward`): on CPU torch's flash kernel
(`aten._scaled_dot_product_flash_attention_for_cpu`, private, so looked up with a fallback), elsewhere
plain matmuls holding one (S/cp)^2 block of probabilities at a time; on a GPU the CUDA flash kernel's
pair would be the body for the same ring.

GQA (fewer k/v heads than q heads, H % H_kv == 0): the blocks travel with H_kv heads, each q head uses
k/v head h // (H / H_kv) as SDPA's `enable_gqa`, and dk/dv are summed back over each group.

A group of None or of one rank is plain `F.scaled_dot_product_attention` on the local (whole) sequence.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.comm.collectives import Collectives
from runtime.comm.groups import group_size
from runtime.context.sequence import check_divisible, positions

__all__ = ["ring_attention"]

# Tags of the ring's messages: far from the small tags pipeline stages use on a group they might share.
_TAG_BASE = 1 << 20
_KV_FORWARD, _KV_BACKWARD, _DKV_BACKWARD = 0, 1, 2


def _tag(kind: int, step: int) -> int:
    return _TAG_BASE + kind * 4096 + step




def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """The number of q heads per k/v head; a clear error for shapes attention cannot take."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise ValueError(f"attention takes q, k, v of shape (B, H, S, D); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}: move the heads to dim 1 (x.view(B, S, H, D).transpose(1, 2))")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must match, and "
                         f"share batch, sequence and head size with q")
    h, h_kv = q.shape[1], k.shape[1]
    if h % h_kv:
        raise ValueError(f"{h} query heads cannot share {h_kv} key/value heads: grouped-query attention needs the "
                         f"query heads a multiple of the key/value heads; choose H_kv dividing {h}")
    return h // h_kv


# ---------------------------------------------------------------- one block, fp32

def _span(flags: torch.Tensor) -> slice | torch.Tensor:
    """The indices where flags holds, as a slice when they are consecutive (a view, not a copy)."""
    idx = flags.nonzero().squeeze(1)
    lo, hi = int(idx[0]), int(idx[-1]) + 1
    return slice(lo, hi) if hi - lo == idx.numel() else idx


def _take(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    return x[:, :, rows] if isinstance(rows, slice) else x.index_select(2, rows)


def _block_plan(q_pos: torch.Tensor | None, k_pos: torch.Tensor | None):
    """(query rows, key columns, mask or None) that a block needs, or None when it is wholly in the future.
    No positions: no causal mask, everything."""
    if q_pos is None:
        return slice(None), slice(None), None
    seen = q_pos.unsqueeze(1) >= k_pos.unsqueeze(0)                  # (m, n) query i sees key j
    if not seen.any():
        return None
    rows, cols = _span(seen.any(1)), _span(seen.any(0))
    sub = seen[rows][:, cols]
    return rows, cols, (None if sub.all() else sub)


def _scores(q, k, scale, mask):
    s = torch.matmul(q, k.transpose(-2, -1)) * scale                 # (B, H, m, n)
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _fused(q: torch.Tensor) -> bool:
    # torch's CPU flash kernel returns the log-sum-exp and takes it back in its backward: the fused body
    # for a block (SDPA forward+backward, B=1 H=8 S=1024 D=64, 2 threads: flash 27 ms, matmuls 92 ms;
    # bench/long_context.py). Elsewhere, the matmuls.
    return q.device.type == "cpu" and _CPU_FLASH is not None


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _additive(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The CPU flash kernel takes a mask in the query's dtype, added to the scores."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))


def block_forward(q, k, v, scale: float, mask: torch.Tensor | None, *, fused: bool | None = None):
    """(out, lse) of fp32 q (B, H, m, D) over k, v (B, H, n, D) where mask (m, n) holds (None: all):
    out (B, H, m, D) normalised within the block, lse (B, H, m). Every row must see a key."""
    if _fused(q) if fused is None else fused:
        return _CPU_FLASH(q, k, v, 0.0, False, attn_mask=_additive(mask), scale=scale)
    s = _scores(q, k, scale, mask)                                   # (B, H, m, n)
    lse = torch.logsumexp(s, -1)                                     # (B, H, m)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def block_backward(do, q, k, v, out, lse, scale: float, mask: torch.Tensor | None, *, fused: bool | None = None):
    """(dq, dk, dv) of one block, given the rows' final out and lse over the whole sequence (fp32):
    p = exp(s - lse) are then the true probabilities, and the blocks' shares sum to the gradient."""
    if _fused(q) if fused is None else fused:
        return _CPU_FLASH_BACKWARD(do, q, k, v, out, lse, 0.0, False, attn_mask=_additive(mask), scale=scale)
    p = torch.exp(_scores(q, k, scale, mask) - lse.unsqueeze(-1))   # (B, H, m, n)
    dv = torch.matmul(p.transpose(-2, -1), do)
    ds = p * (torch.matmul(do, v.transpose(-2, -1)) - (do * out).sum(-1, keepdim=True))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


def _repeat(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(dkv: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_repeat`: each k/v head's share summed over the q heads that used it."""
    if groups == 1:
        return dkv
    b, h, n, d = dkv.shape
    return dkv.view(b, h // groups, groups, n, d).sum(2)


# ---------------------------------------------------------------- the ring

class _Ring:
    """This rank's place on the ring: isend to the next rank, irecv from the previous (global ranks)."""

    def __init__(self, group, coll: Collectives):
        self.group, self.coll = group, coll
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.cp)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.cp)

    def shift(self, t: torch.Tensor, tag: int):
        """Post: send t on, receive the previous rank's. (the buffer that will hold it, [works])."""
        out = torch.empty_like(t)
        works = [self.coll.send(t, self.next, tag=tag, group=self.group),
                 self.coll.recv(out, self.prev, tag=tag, group=self.group)]
        return out, works


def _wait(works) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, coll, causal, scale):
        ring = _Ring(group, coll)
        groups = q.shape[1] // k.shape[1]
        seq = q.shape[2] * ring.cp
        q_pos = positions(seq, ring.rank, ring.cp) if causal else None
        qf = q.float()
        kv = torch.stack([k, v]).float()                                 # (2, B, H_kv, S/cp, D), one message
        out = torch.zeros_like(qf)                                       # (B, H, S/cp, D)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)  # (B, H, S/cp)
        for step in range(ring.cp):
            works = []
            if step + 1 < ring.cp:
                nxt, works = ring.shift(kv, _tag(_KV_FORWARD, step))
            src = (ring.rank - step) % ring.cp
            plan = _block_plan(q_pos, positions(seq, src, ring.cp) if causal else None)
            if plan is not None:
                rows, cols, mask = plan
                kb, vb = (_repeat(_take(t, cols), groups) for t in kv)
                out_b, lse_b = block_forward(_take(qf, rows), kb, vb, scale, mask)   # (B, H, m, D), (B, H, m)
                lse_old, out_old = _take(lse.unsqueeze(-1), rows).squeeze(-1), _take(out, rows)
                # merged in fp64, so the lse is the blocks' sum correctly rounded, however fp32 logaddexp would
                # round it (it rounds by its operands' layout, and the CPU flash kernel's lse is a (B, m, H)
                # buffer): the backward recomputes p from this lse and subtracts rowsum(do * out), which cancels
                # where attention is near uniform, so an ulp between lse and out shows in the gradients (OPT's
                # small config under cp2: 9e-6 in its parameters after 3 SGD steps, 1e-8 merged in fp64)
                lse_new = torch.logaddexp(lse_old.double(), lse_b.double())
                merged = (out_old * torch.exp(lse_old - lse_new).float().unsqueeze(-1)
                          + out_b * torch.exp(lse_b - lse_new).float().unsqueeze(-1))
                out[:, :, rows], lse[:, :, rows] = merged, lse_new.float()
            _wait(works)
            if works:
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.coll, ctx.causal, ctx.scale = group, coll, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group, ctx.coll)
        groups = q.shape[1] // k.shape[1]
        seq = q.shape[2] * ring.cp
        q_pos = positions(seq, ring.rank, ring.cp) if ctx.causal else None
        qf, do, outf = q.float(), grad_out.float().contiguous(), out.float()
        kv = torch.stack([k, v]).float()                                  # (2, B, H_kv, S/cp, D)
        dq = torch.zeros_like(qf)
        dkv, dkv_works = None, []                                         # the accumulator that travels
        for step in range(ring.cp):
            kv_works = []
            if step + 1 < ring.cp:
                nxt, kv_works = ring.shift(kv, _tag(_KV_BACKWARD, step))
            src = (ring.rank - step) % ring.cp
            plan = _block_plan(q_pos, positions(seq, src, ring.cp) if ctx.causal else None)
            mine = torch.zeros_like(kv)                                   # this rank's share of src's dk, dv
            if plan is not None:
                rows, cols, mask = plan
                kb, vb = (_repeat(_take(t, cols), groups) for t in kv)
                dq_b, dk, dv = block_backward(_take(do, rows), _take(qf, rows), kb, vb, _take(outf, rows),
                                              _take(lse.unsqueeze(-1), rows).squeeze(-1), ctx.scale, mask)
                dq[:, :, rows] += dq_b
                mine[0][:, :, cols] = _fold(dk, groups)
                mine[1][:, :, cols] = _fold(dv, groups)
            # src's accumulator comes from rank r - 1, which held the block one step earlier
            _wait(dkv_works)
            dkv = mine if dkv is None else dkv + mine
            dkv, dkv_works = ring.shift(dkv, _tag(_DKV_BACKWARD, step))
            _wait(kv_works)
            if kv_works:
                kv = nxt
        _wait(dkv_works)                                                  # after cp hops: this rank's own block
        dk, dv = dkv.to(k.dtype).unbind(0)
        return dq.to(q.dtype), dk, dv, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, collectives: Collectives, *,
                   causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, k/v passed round the cp `group`.

    q (B, H, S/cp, D), k and v (B, H_kv, S/cp, D): this rank's tokens in the load-balanced layout
    (`runtime.context.sequence.shard_sequence`). Returns (B, H, S/cp, D), this rank's rows of
    `F.scaled_dot_product_attention` on the full sequence (`is_causal=causal`, `enable_gqa` when
    H_kv < H), differentiable in q, k and v. `scale` defaults to 1/sqrt(D).
    """
    groups = check_heads(q, k, v)
    cp = group_size(group)
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=groups > 1)
    check_divisible(q.shape[2] * cp, cp)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, collectives, causal, scale)
