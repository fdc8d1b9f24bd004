"""The load-balancing loss carried through pipeline stages equals the loss over all layers at once.

Three virtual stages on this one process (neighbours hand the sums over in memory, as ZB-V's turn does):
stage 0 holds MoE layer 0, stage 1 no MoE layer (DeepSeek-V3's first dense layers), stage 2 layer 1 and the
loss. Each stage's forward and backward run as the pipeline executor runs them (the hidden state detached
between stages, its gradient handed back): the loss and both layers' router-logit gradients match Hugging
Face's `load_balancing_loss_func` over both layers (runtime.experts.pipeline_aux). The multi-process runs
are in tests/test_expert_run.py.
"""

from __future__ import annotations

import torch

from runtime.comm.collectives import Collectives
from runtime.experts.aux_loss import load_balancing_loss
from runtime.experts.pipeline_aux import AuxPipeline
from runtime.experts.program import EPContext, ep_aux_loss, ep_record_router_logits, ep_router_logits

E, K, T = 4, 2, 6


def logits(seed: int) -> torch.Tensor:
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def test_three_stages_compute_the_loss_and_gradients_of_all_layers_at_once():
    import transformers.models.mixtral.modeling_mixtral as hf

    l0, l1 = logits(0), logits(1)
    ref = hf.load_balancing_loss_func((l0, l1), E, K)
    ref.backward()
    assert torch.allclose(load_balancing_loss([l0, l1], E, K, None, Collectives()), ref)
    want = (l0.grad.clone(), l1.grad.clone())
    l0.grad = l1.grad = None

    ep = EPContext(group=None, collectives=None, rank=0, world=1, num_experts=E, top_k=K, layers=2,
                   pipeline=AuxPipeline(stage_ranks=(0, 0, 0), rank=0, collectives=None))
    h = torch.ones(3, requires_grad=True)
    # forwards, stage by stage
    ep.enter_stage(0, None, first=True)
    ep_record_router_logits(l0, ep)
    out0 = ep.leave_stage(0, h * 2, last=False)
    in1 = out0.detach().requires_grad_()
    x = ep.enter_stage(1, in1, first=False)
    out1 = ep.leave_stage(1, x * 3, last=False)            # no MoE layer: the sums pass on
    in2 = out1.detach().requires_grad_()
    x = ep.enter_stage(2, in2, first=False)
    ep_record_router_logits(l1, ep)
    assert ep_router_logits(ep, 0).shape == (0, E) and ep_router_logits(ep, 1) is l1  # layer 0 stayed on stage 0
    loss = ep_aux_loss(ep) + x.sum()
    # backwards, last stage first
    loss.backward()
    out1.backward(in2.grad)
    out0.backward(in1.grad)
    torch.testing.assert_close(loss.detach() - 18.0, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close((l0.grad, l1.grad), want, rtol=1e-6, atol=1e-8)
    assert torch.equal(h.grad, torch.full((3,), 6.0))       # the hidden state's gradient untouched
