"""A model whose own forward combines batch statistics non-linearly is never split over ranks silently.

A user-written mixture of experts computing Switch Transformer's load-balancing loss inside its forward
(E * sum_e f_e * P_e: a product of two means over the tokens) computes, on each data-parallel rank, its own
tokens' loss, whose mean over the ranks is not the batch's (under dp2 the losses differed from one process
by 5e-4 relative before this check). The tracer finds such values from the dataflow
(partitioner.tracer.batch_statistics) and the planner refuses dp or cp > 1 pinned, and keeps them at 1
unpinned. Hugging Face's router loss (output_router_logits=True) is computed over every rank's tokens by
the programs, so it is left alone (tests/test_expert_run.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cost_models.errors import DeclarationError
from partitioner import compile, trace
from partitioner.tracer.batch_statistics import nonlinear_batch_statistics

VOCAB, H, E, K, SEQ = 64, 16, 4, 2, 8


class MoE(nn.Module):
    """A router, E SiLU experts, top-k weighting, and its own load-balancing loss."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, 2 * H, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, H, 2 * H) * 0.1)

    def forward(self, x):
        b, t, h = x.shape
        flat = x.reshape(-1, h)                                 # (N, H)
        probs = torch.softmax(self.router(flat), dim=-1)        # (N, E)
        w, idx = torch.topk(probs, K, dim=-1)                   # (N, K)
        out = torch.zeros_like(flat)
        for e in range(E):
            gate = (w * (idx == e)).sum(-1, keepdim=True)       # (N, 1)
            out = out + gate * (F.silu(flat @ self.w1[e].t()) @ self.w2[e].t())
        f = F.one_hot(idx, E).float().sum(1).mean(0)            # (E,) picks per token
        return out.reshape(b, t, h), E * (f * probs.mean(0)).sum()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.moe = MoE()

    def forward(self, x):
        y, aux = self.moe(self.norm(x))
        return x + y, aux


class Net(nn.Module):
    def __init__(self, aux: bool = True):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(H, VOCAB, bias=False)
        self.aux = aux

    def forward(self, idx):
        x = self.emb(idx)
        aux = 0.0
        for b in self.blocks:
            x, a = b(x)
            aux = aux + a
        return (self.head(x), aux) if self.aux else self.head(x)


def net(aux: bool = True) -> Net:
    torch.manual_seed(0)
    return Net(aux)


TOKENS = (torch.zeros(2, SEQ, dtype=torch.long),)


def test_the_tracer_finds_a_load_balancing_loss_computed_inside_the_model():
    found = nonlinear_batch_statistics(trace(net(), TOKENS).graph_module)
    where = [list(n.meta["nn_module_stack"].values())[-1][0] for n in found]
    assert where == ["blocks.0.moe", "blocks.1.moe"]  # f * P, once per layer
    assert not nonlinear_batch_statistics(trace(net(aux=False), TOKENS).graph_module)  # routing alone is per token


@pytest.mark.parametrize("pins", [dict(dp=2), dict(cp=2)])
def test_splitting_the_batch_is_refused_before_anything_runs(pins):
    axis = next(iter(pins))
    with pytest.raises(DeclarationError, match=f"{axis}=2: the model's forward combines statistics of the whole batch "
                                               r"non-linearly \(mul_\d+ \(aten.mul.Tensor in blocks.0.moe\)"):
        compile(net(), "local:2", example_inputs=TOKENS, global_batch_size=8, precision="fp32", alternatives=0, **pins)


def test_unpinned_the_batch_stays_whole():
    plan = compile(net(), "local:1", example_inputs=TOKENS, global_batch_size=8, precision="fp32", alternatives=0)
    assert plan.config.replicas == 1
    with pytest.raises(DeclarationError, match="no configuration with dp = cp = 1 runs on 2 devices"):
        compile(net(), "local:2", example_inputs=TOKENS, global_batch_size=8, precision="fp32", alternatives=0)
    # without the loss the same model splits its batch as any other
    assert compile(net(aux=False), "local:2", example_inputs=TOKENS, global_batch_size=8, precision="fp32",
                   alternatives=0).config.replicas == 2
