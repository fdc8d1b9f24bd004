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


# ---- batch norm: one op normalising with the statistics of the batch it sees ------------------------------------
class _NormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(16, 16), nn.BatchNorm1d(16)

    def forward(self, x):
        return x + torch.relu(self.bn(self.lin(x)))


class _NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(8, 16), nn.Linear(16, 3)
        self.layers = nn.ModuleList(_NormBlock() for _ in range(4))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def norm_net_seeded() -> _NormNet:
    torch.manual_seed(0)
    return _NormNet()


def _norm_graph(train: bool = True):
    model = norm_net_seeded().train(train)
    return trace(model, (torch.randn(4, 8),))


def test_a_plan_splitting_the_batch_of_a_training_batch_norm_says_it_differs_from_one_process():
    """DDP-style batch norm: each replica or microbatch normalises its own share. Allowed, as torch's DDP does it,
    but never silently: compile warns where the plan splits the batch, naming the layers and how to keep it whole;
    not where it keeps the batch whole, nor for a model in eval mode (its statistics frozen)."""
    import warnings

    from partitioner.tracer.batch_statistics import training_batch_norms

    assert training_batch_norms(_norm_graph().graph_module)
    assert not training_batch_norms(_norm_graph(False).graph_module)
    for train, pins, warned in ((True, dict(dp=2, pp=1, microbatch_size=4), True),
                                (True, dict(dp=1, pp=2, microbatch_size=4), True),
                                (True, dict(dp=1, pp=2, microbatch_size=8), False),
                                (False, dict(dp=2, pp=1, microbatch_size=4), False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compile(_norm_graph(train), "local:2", global_batch_size=8, precision="fp32", tp=1, alternatives=0,
                    **pins)
        said = [str(w.message) for w in caught if "batch norm in training mode" in str(w.message)]
        assert bool(said) == warned, (train, pins)
        if said:
            assert "layers.0.bn" in said[0] and "microbatch_size=8" in said[0]


@pytest.mark.slow
@pytest.mark.parametrize("pp, tp", [(2, 1), (1, 2)])
def test_batch_norm_on_whole_batches_trains_like_one_process_buffers_included(pp, tp):
    """Its running statistics and num_batches_tracked too: the count's += 1 reads buffers alone, and the
    generated code dropped it with the values computed from shapes (it stayed 0)."""
    from examples.training import sgd
    from ranks import assert_plan_trains_like_one_process

    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)) for _ in range(2)]
    plan = compile(_norm_graph(), "local:2", global_batch_size=8, microbatch_size=8, precision="fp32", dp=1,
                   pp=pp, tp=tp)
    out = assert_plan_trains_like_one_process(plan, norm_net_seeded, sgd, F.mse_loss, data)
    assert int(out.state_dict["layers.3.bn.num_batches_tracked"]) == 2
