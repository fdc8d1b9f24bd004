"""Token routing for expert parallelism, as plain tensor functions (no process group).

E experts are divided over ep ranks in contiguous blocks: rank r holds experts r*E/ep .. (r+1)*E/ep - 1
(`local_experts`), so the experts of one rank are the rows r*E/ep:(r+1)*E/ep of batched `[E, ...]` weights.

A rank's router picks k experts per token: `topk_idx` (T, k). The T*k (token, choice) pairs, flattened
row-major (pair i is token i // k, choice i % k), are sorted by expert with a stable sort (`route`): the
pairs bound for rank 0's experts come first, then rank 1's, ..., and within a rank's block they are grouped
by expert, so a send buffer is `x[routing.order // k]` and `send_counts[j]` of its rows go to rank j.
`routing.inverse` undoes the sort on the way back.

Policy: no token dropping. Capacity is unbounded: every routed (token, choice) pair is sent to its expert
and processed, however unbalanced the routing (an expert may receive no tokens, or all of them). The
split sizes of the all-to-alls therefore vary from step to step.

>>> idx = torch.tensor([[3, 0], [1, 3], [2, 0]])          # T=3 tokens, top-2 of E=4 experts
>>> r = route(idx, num_experts=4, ep=2)                  # rank 0 holds experts 0, 1; rank 1 holds 2, 3
>>> r.order                                               # pairs sorted by expert: 0, 0, 1, 2, 3, 3
tensor([1, 5, 2, 4, 0, 3])
>>> r.order // 2                                          # ...the tokens they carry
tensor([0, 2, 1, 2, 0, 1])
>>> r.expert_counts, r.send_counts
(tensor([2, 1, 1, 2]), tensor([3, 3]))
>>> torch.equal(idx.reshape(-1)[r.order][r.inverse], idx.reshape(-1))
True
>>> local_experts(rank=1, ep=2, num_experts=4)
range(2, 4)
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["Routing", "experts_per_rank", "local_experts", "route"]


def experts_per_rank(num_experts: int, ep: int) -> int:
    """E / ep; a clear error when ep does not divide E."""
    if ep < 1:
        raise ValueError(f"expert parallelism over ep={ep} ranks: ep must be at least 1")
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts cannot be divided over ep={ep} ranks: every rank holds the same "
                         f"number of experts, so ep must divide the number of experts; choose ep among "
                         f"{[d for d in range(1, num_experts + 1) if num_experts % d == 0]}")
    return num_experts // ep


def local_experts(rank: int, ep: int, num_experts: int) -> range:
    """The experts rank `rank` of ep holds (a contiguous block of E / ep)."""
    n = experts_per_rank(num_experts, ep)
    if not 0 <= rank < ep:
        raise ValueError(f"rank {rank} is not a rank of an ep group of {ep}: ranks are 0 .. {ep - 1}")
    return range(rank * n, (rank + 1) * n)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Routing:
    """Where a rank's (token, choice) pairs go.

    order: (T*k,) the pair indices sorted by expert (stable: by token within an expert); `order // k` are
    their tokens. inverse: (T*k,) the permutation undoing it (`sorted[inverse]` is in pair order).
    expert_counts: (E,) pairs per expert, summing to T*k. send_counts: (ep,) pairs per destination rank
    (expert_counts summed over each rank's block of experts).
    """

    order: torch.Tensor
    inverse: torch.Tensor
    expert_counts: torch.Tensor
    send_counts: torch.Tensor


def route(topk_idx: torch.Tensor, num_experts: int, ep: int) -> Routing:
    """The permutation sorting topk_idx's (token, choice) pairs by expert, its inverse, and the counts per
    expert and per destination rank (module docstring)."""
    n_local = experts_per_rank(num_experts, ep)
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be (tokens, k), the router's top-k expert indices; got shape "
                         f"{tuple(topk_idx.shape)}: flatten batch and sequence first (x.view(-1, H))")
    flat = topk_idx.reshape(-1).long()                                   # (T*k,)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"topk_idx holds expert {int(flat.min()) if int(flat.min()) < 0 else int(flat.max())}, "
                         f"outside 0 .. {num_experts - 1}: num_experts must be the router's number of experts")
    order = torch.sort(flat, stable=True).indices                         # (T*k,)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    expert_counts = torch.bincount(flat, minlength=num_experts)          # (E,)
    return Routing(order=order, inverse=inverse, expert_counts=expert_counts,
                   send_counts=expert_counts.view(ep, n_local).sum(1))
