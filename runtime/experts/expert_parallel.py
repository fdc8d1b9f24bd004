"""An expert-parallel MoE layer: tokens travel to the ranks holding their experts and back, autograd-correct.

As Megatron-Core's `MoEAlltoAllTokenDispatcher` and DeepSpeed-MoE, without a capacity (no token dropping:
`runtime.experts.dispatch`). Rank r of an ep group holds experts r*E/ep .. (r+1)*E/ep - 1 and its own
tokens x (T, H) with the router's choice for them, topk_idx and topk_weight (T, k). `ep_moe`:

1. permute: the (token, choice) pairs sorted by expert, x[order // k]            (T*k, H)
2. exchange counts: an all-to-all of the per-expert counts, E / ep to each rank  (ep, E/ep) received
3. dispatch: `all_to_all_single` with input splits = pairs per destination rank and output splits = pairs
   from each source rank (both vary step to step)                                 (N, H), N received
4. group by local expert (the received rows come by source rank, then expert) and run the local experts,
   one matmul chain per expert (`runtime.experts.grouped_experts`)               (N, H)
5. combine: the all-to-all back with the splits swapped                           (T*k, H)
6. un-permute to (token, choice) order, weight by topk_weight and sum over the k choices   (T, H)

Backward takes the same path: the gradient of an all-to-all with splits (in, out) is the all-to-all with
splits (out, in) (`_AllToAll`), so a backward issues two all-to-alls (combine's, then dispatch's), the
expert weights get their gradient on the rank that holds them, and topk_weight its gradient at home.
Per call the counting shim sees 3 all-to-alls forward (counts, dispatch, combine) and 2 backward.

Every rank of the group must call `ep_moe` (even with no tokens: T = 0) and backpropagate through its
output, in the same order as the others: the collectives pair up by order, not by name.

A group of None (or of one rank) runs every expert locally with no collective:

>>> from runtime.experts.grouped_experts import module_experts
>>> experts = [lambda t, s=s: t * s for s in (1.0, 10.0, 100.0)]      # expert e multiplies by 10^e
>>> x = torch.tensor([[1.0], [2.0]])                                   # T=2 tokens, H=1
>>> topk_idx, topk_weight = torch.tensor([[0, 2], [1, 0]]), torch.tensor([[0.5, 0.5], [1.0, 0.0]])
>>> ep_moe(x, topk_idx, topk_weight, module_experts(experts), 3, None, Collectives())   # 0.5*1 + 0.5*100, 1*20
tensor([[50.5000],
        [20.0000]])
"""

from __future__ import annotations

import torch

from runtime.comm.collectives import Collectives
from runtime.comm.groups import group_size
from runtime.experts.dispatch import experts_per_rank, route
from runtime.experts.grouped_experts import LocalExpertsFn

__all__ = ["all_to_all_splits", "ep_moe"]




def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                coll: Collectives) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    coll.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, coll):
        ctx.splits, ctx.group, ctx.coll = (out_splits, in_splits), group, coll
        return _all_to_all(x, out_splits, in_splits, group, coll)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        # the rows that arrived from rank i go back to rank i: the same exchange, splits swapped
        return _all_to_all(grad, in_splits, out_splits, ctx.group, ctx.coll), None, None, None, None


def all_to_all_splits(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                      collectives: Collectives) -> torch.Tensor:
    """Rows in_splits[j] of x (along dim 0) to rank j; the result holds out_splits[i] rows from rank i.
    Backward: the all-to-all with the splits swapped. Group None: x itself."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group, collectives)


def _exchange_counts(expert_counts: torch.Tensor, ep: int, group, coll: Collectives) -> torch.Tensor:
    """(ep, E/ep): row i holds how many pairs rank i sends to each of this rank's experts."""
    sent = expert_counts.view(ep, -1).contiguous()                   # (ep, E/ep) row j: rank j's experts
    got = torch.empty_like(sent)
    coll.all_to_all(got, sent, group)
    return got


def _check(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"ep_moe takes this rank's tokens as (T, H); got x of shape {tuple(x.shape)}: "
                         f"flatten batch and sequence first (x.view(-1, H))")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or topk_weight.shape != topk_idx.shape:
        raise ValueError(f"topk_idx {tuple(topk_idx.shape)} and topk_weight {tuple(topk_weight.shape)} must both "
                         f"be (T, k) with T = {x.shape[0]}, the rows of x: the router's top-k for these tokens")


def ep_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, local_experts_fn: LocalExpertsFn,
           num_experts: int, group, collectives: Collectives) -> torch.Tensor:
    """sum_j topk_weight[t, j] * expert_{topk_idx[t, j]}(x[t]) for this rank's tokens x (T, H), the experts
    spread over `group` (module docstring). local_experts_fn runs this rank's E/ep experts on tokens grouped
    by expert (`runtime.experts.grouped_experts`). Returns (T, H_out) in x's dtype."""
    _check(x, topk_idx, topk_weight)
    t, k = topk_idx.shape
    ep = group_size(group)
    n_local = experts_per_rank(num_experts, ep)
    routing = route(topk_idx, num_experts, ep)
    sent = x[routing.order // k]                                          # (T*k, H) by expert

    if ep == 1:
        out = local_experts_fn(sent, routing.expert_counts)               # (T*k, H_out)
    else:
        recv_counts = _exchange_counts(routing.expert_counts, ep, group, collectives)   # (ep, E/ep)
        in_splits = routing.send_counts.tolist()
        out_splits = recv_counts.sum(1).tolist()
        received = all_to_all_splits(sent, out_splits, in_splits, group, collectives)   # (N, H)
        # received rows come by source rank, then expert: regroup them by expert for one matmul per expert
        expert_of_row = torch.repeat_interleave(torch.arange(n_local, device=x.device).repeat(ep),
                                                recv_counts.reshape(-1))                   # (N,)
        by_expert = route(expert_of_row.unsqueeze(1), n_local, 1)
        done = local_experts_fn(received[by_expert.order], by_expert.expert_counts)     # (N, H_out)
        out = all_to_all_splits(done[by_expert.inverse], in_splits, out_splits, group, collectives)  # (T*k, H_out)

    pairs = out[routing.inverse].view(t, k, out.shape[-1])                        # (T, k, H_out) token, choice order
    return (pairs * topk_weight.to(pairs.dtype).unsqueeze(-1)).sum(1)     # (T, H_out)
