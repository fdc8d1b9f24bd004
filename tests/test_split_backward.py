"""runtime.pipeline.split_backward: I then W computes the full backward's gradients, through AccumulateGrad.

Tier (a): one process. The spawned pipelines (test_pipeline_executor, test_3d_equivalence) run it under
zb-h1 against one process and against torch's ScheduleInterleavedZeroBubble.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from examples.gpt import GPT, GPTConfig
from runtime.pipeline.split_backward import backward_input, backward_weight


class Tied(nn.Module):
    """A residual block and one weight read twice (as a tied embedding and LM head are)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.ln = nn.LayerNorm(8)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x):
        h = x + self.mlp(self.ln(x))
        return (h @ self.w) @ self.w.t() + h


def _gpt_blocks() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.0)).transformer.h


@pytest.mark.parametrize("build", [Tied, _gpt_blocks], ids=["tied-residual", "gpt-blocks"])
def test_input_then_weight_gradients_equal_the_full_backward(build):
    torch.manual_seed(1)
    ref = build()
    split = copy.deepcopy(ref)
    fired = []
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    x = torch.randn(2, 8, 8 if build is Tied else 16)
    run = (lambda m, x: m(x)) if build is Tied else (lambda m, x: m[1](m[0](x)))
    g = torch.randn_like(run(ref, x))

    x_ref = x.clone().requires_grad_()
    run(ref, x_ref).backward(g)

    x_split = x.clone().requires_grad_()
    (dx,), pending = backward_input([run(split, x_split)], [g], [x_split])
    torch.testing.assert_close(dx, x_ref.grad, rtol=0, atol=0)
    assert fired == [] and all(p.grad is None for p in split.parameters())   # I leaves the weights to W
    backward_weight(pending)
    for (name, a), b in zip(ref.named_parameters(), split.parameters()):
        if a.grad is None:
            assert b.grad is None, name
        else:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)
    # each parameter's gradient went through AccumulateGrad once: the data-parallel hooks see it as in B
    assert sorted(fired) == sorted(n for n, p in ref.named_parameters() if p.grad is not None)


def test_a_stage_without_input_gradient_runs_its_whole_backward_at_w():
    lin = nn.Linear(4, 1)
    tokens = torch.ones(3, 4)   # the first stage's input: no gradient wanted
    (dx,), pending = backward_input([lin(tokens).sum()], [None], [tokens])
    assert dx is None and lin.weight.grad is None
    backward_weight(pending)
    assert lin.weight.grad.tolist() == [[3.0] * 4] and lin.bias.grad.item() == 3.0
