"""The router's auxiliary load-balancing loss from each rank's tokens, equal to the one-process value.

Switch Transformer's loss (Fedus et al. 2021, equations 4-6) as Hugging Face computes it
(`load_balancing_loss_func` in the Mixtral and Qwen3-MoE modeling files, no attention mask):

    loss = E * sum_e f_e * P_e,   f_e = (top-k picks of expert e) / N,   P_e = (sum_t softmax(logits_t)_e) / N

over the N rows of every layer's router logits. Both factors are means over all tokens, so the loss of the
whole batch is not a mean of per-rank losses. Each rank sums what it has (its top-k counts per expert, its
softmax probabilities per expert, its row count), one all-reduce (sum) of those 2E + 1 numbers over the
group that split the tokens (the data-parallel group, or any group whose ranks hold different tokens of
one batch) gives the global sums, and every rank computes the same global loss from them.

The all-reduce's backward is the identity (Megatron's "g", `runtime.pipeline.tensor_parallel.reduce_from_tp`):
every rank holds the same loss, so the gradient of the global sums is the same everywhere and reaches each
rank's own logits unchanged; rank r's logits get exactly the one-process gradient of their rows. An engine
that averages gradients over the ranks (data parallelism's mean) would divide that by the group's size:
scale this loss by the size of the group before backward there, or sum its gradients instead.

>>> from runtime.comm.collectives import Collectives
>>> logits = torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]])   # two tokens, E=4
>>> round(float(load_balancing_loss(logits, num_experts=4, top_k=1, group=None, collectives=Collectives())), 4)
1.615
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.comm.collectives import Collectives
from runtime.pipeline.tensor_parallel import reduce_from_tp

__all__ = ["load_balancing_loss", "loss_from_sums", "router_sums"]


def router_sums(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                device: torch.device | None = None) -> torch.Tensor:
    """What the loss needs of some layers' router logits (each (T, E), this rank's rows), summed over the layers:
    (2E + 2,) = top-k picks per expert (E), softmax probabilities per expert (E), rows, layers. Only the
    probabilities carry a gradient. Hugging Face sums picks, probabilities and rows over the concatenation of
    every layer's logits, so the sums of disjoint sets of layers (pipeline stages) or rows (ranks) add up to
    the whole model's. No layers: zeros (on `device`).

    >>> router_sums([torch.tensor([[2.0, 0.0]])], num_experts=2, top_k=1)
    tensor([1.0000, 0.0000, 0.8808, 0.1192, 1.0000, 1.0000])
    """
    sums = []
    for logits in router_logits:
        if logits.dim() != 2 or logits.shape[1] != num_experts:
            raise ValueError(f"router logits of shape {tuple(logits.shape)}: expected (tokens, {num_experts}), "
                             f"one row per token of this rank and one column per expert")
        probs = torch.softmax(logits.float(), dim=-1)                               # (T, E)
        picks = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)                # (T*k,)
        counts = torch.bincount(picks, minlength=num_experts).to(probs.dtype)      # (E,) not differentiable
        sums.append(torch.cat([counts, probs.sum(0), probs.new_tensor([float(logits.shape[0]), 1.0])]))
    if not sums:
        return torch.zeros(2 * num_experts + 2, device=device)
    return torch.stack(sums).sum(0)                                                 # (2E + 2,)


def loss_from_sums(total: torch.Tensor, num_experts: int) -> torch.Tensor:
    """E * sum_e f_e * P_e from the global sums (picks (E), probabilities (E), rows: `router_sums`' first 2E + 1)."""
    n = total[2 * num_experts]
    if float(n.detach()) == 0:
        raise ValueError("load_balancing_loss over no tokens at all: no rank of the group passed a router row")
    tokens_per_expert = total[:num_experts] / n                                     # f_e
    prob_per_expert = total[num_experts:2 * num_experts] / n                       # P_e
    return num_experts * torch.sum(tokens_per_expert * prob_per_expert)


def load_balancing_loss(router_logits: torch.Tensor | Sequence[torch.Tensor], num_experts: int, top_k: int,
                        group, collectives: Collectives, carried: torch.Tensor | None = None) -> torch.Tensor:
    """E * sum_e f_e * P_e over every token of the group (module docstring). router_logits: this rank's
    (T, E) logits of one layer, or a sequence of layers' (as the model's `router_logits` output). Group None:
    this rank's tokens are the whole batch. carried: the `router_sums` of the layers earlier pipeline stages
    ran on this rank's rows (runtime.experts.pipeline_aux), added before the all-reduce."""
    layers = [router_logits] if isinstance(router_logits, torch.Tensor) else list(router_logits)
    if not layers and carried is None:
        raise ValueError("load_balancing_loss got no router logits: pass a (T, E) tensor or one per MoE layer")
    sums = router_sums(layers, num_experts, top_k, device=carried.device if carried is not None else None)
    if carried is not None:
        sums = sums + carried
    total = reduce_from_tp(sums[:2 * num_experts + 1], group, collectives)         # (2E + 1,) global sums
    return loss_from_sums(total, num_experts)
