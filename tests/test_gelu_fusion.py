"""GELU and SiLU spelled as elementwise ops rewritten to the fused ATen ops (partitioner.tracer.pointwise).

GPT-2's `gelu_new` and BLOOM's tanh GELU, and an erf GELU written out, each traced from a tiny model: the
rewritten graph computes what the module computes (forward and every gradient, fp32), keeps only the MLP's
input to the GELU for backward, and trains like one process under tensor parallelism; chains that compute
something else, read a second tensor or feed an intermediate elsewhere are left as traced; x * sigmoid(x) becomes
aten.silu.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from ranks import assert_trains_like
from test_attention_rewrite import BATCH, FAMILIES, SEQ, assert_computes_the_module, batches, tokens

from examples.training import hf_loss, sgd, train_one_process
from partitioner import compile, trace
from runtime import launch_local

_aten = torch.ops.aten


def _ops(g) -> list:
    return [n.target for n in g.graph_module.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("family,form_ops", [("gpt2", 8), ("bloom", 9)])
def test_tanh_gelu_of_hugging_face_models_is_fused(family, form_ops):
    """GPT-2's gelu_new and BLOOM's GELU become aten.gelu(x, approximate="tanh"): no tanh is left, the graph has
    form_ops - 1 fewer ops per block, and the program computes what the module computes, forward and backward."""
    g, eager = trace(FAMILIES[family](2), (tokens(),)), trace(FAMILIES[family](2), (tokens(),), rewrite_attention=False)
    gelus = [n for n in g.graph_module.graph.nodes if n.target is _aten.gelu.default]
    assert len(gelus) == 2 and all(n.kwargs["approximate"] == "tanh" for n in gelus)
    assert _aten.tanh.default not in _ops(g) and _ops(eager).count(_aten.tanh.default) == 2
    mlp_ops = [sum(".mlp" in n.module_path for n in graph.block_nodes(1)) for graph in (eager, g)]
    assert mlp_ops[0] - mlp_ops[1] == form_ops - 1
    assert_computes_the_module(g, FAMILIES[family](2))


def _mlp_saved(g) -> list[tuple[str, float]]:
    """What block 1's MLP keeps for backward: (op, MLP-width tensors of fp32 per token)."""
    return [(n.op, n.cost.activation_bytes(1, SEQ) / (4 * 256 * SEQ)) for n in g.block_nodes(1)
            if ".mlp" in n.module_path and n.cost.activation_bytes(1, SEQ)]


@pytest.mark.parametrize("family,eager", [("gpt2", 5), ("bloom", 8)])
def test_a_fused_gelu_keeps_its_input_alone(family, eager):
    """The MLP keeps the first linear's output (the GELU's input) and the GELU's output (the second linear's
    input), as Megatron-LM's fused bias-GeLU; the traced chain kept `eager` tensors of the MLP's width."""
    fused = [(op, k) for op, k in _mlp_saved(trace(FAMILIES[family](2), (tokens(),))) if k == 1]
    assert [op for op, _ in fused] == [("addmm" if family == "gpt2" else "linear"), "gelu"]
    chain = [k for _, k in _mlp_saved(trace(FAMILIES[family](2), (tokens(),), rewrite_attention=False)) if k == 1]
    assert len(chain) == eager


class ErfGelu(torch.nn.Module):
    """An MLP whose GELU is written out with erf (as BERT's first implementations), or something close to it."""

    def __init__(self, scale: float = 1 / math.sqrt(2.0), leak: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        self.scale, self.leak = scale, leak

    def forward(self, x):
        h = self.up(x)
        e = torch.erf(h * self.scale)
        out = self.down(h * 0.5 * (1.0 + e))
        return out + e.sum() if self.leak else out


def test_an_erf_gelu_is_fused_and_trains_the_same():
    g = trace(ErfGelu(), (torch.randn(4, 16),))
    gelus = [n for n in g.graph_module.graph.nodes if n.target is _aten.gelu.default]
    assert len(gelus) == 1 and gelus[0].kwargs["approximate"] == "none"
    x = torch.randn(4, 16)
    model, rewritten = ErfGelu(), g.graph_module.module()
    model(x).square().sum().backward()
    rewritten(x).square().sum().backward()
    torch.testing.assert_close(rewritten(x), model(x))
    grads = dict(rewritten.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad)


@pytest.mark.parametrize("kw", [dict(scale=0.75), dict(leak=True)], ids=["another-function", "intermediate-read"])
def test_what_is_not_a_gelu_region_stays_as_traced(kw):
    """A chain that computes another function (erf of 0.75 x), or whose erf is read outside it, keeps its ops."""
    g = trace(ErfGelu(**kw), (torch.randn(4, 16),))
    assert _aten.gelu.default not in _ops(g) and _aten.erf.default in _ops(g)


def test_rewrite_attention_false_keeps_the_chain():
    g = trace(FAMILIES["gpt2"](2), (tokens(),), rewrite_attention=False)
    assert _aten.gelu.default not in _ops(g) and _aten.tanh.default in _ops(g)


@pytest.mark.slow
def test_fused_gelu_trains_like_one_process_under_tensor_parallelism():
    """GPT-2 at tp2: the fused GELU runs on each rank's columns of the MLP (BLOOM's tp2 and pp2 runs are in
    test_attention_rewrite.py, with its GELU fused too)."""
    model_fn = functools.partial(FAMILIES["gpt2"], 2)
    plan = compile(model_fn(), "local:2", (tokens(),), global_batch_size=BATCH, precision="fp32", pp=1, dp=1, tp=2,
                   microbatch_size=2)
    src = plan.program(0).source
    assert "aten.gelu.default" in src and "aten.tanh" not in src
    out = launch_local(plan, model_fn, sgd, hf_loss, batches(), timeout_s=180)
    trained = train_one_process(model_fn, sgd, hf_loss, batches())
    assert_trains_like(out, trained.losses, trained.model.state_dict())


class SiluGate(torch.nn.Module):
    """A gated MLP whose SiLU is written x * sigmoid(x) (the gate's product with the up projection reads a second
    tensor, so it stays outside the region)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gate, self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        g = self.gate(x)
        return self.down(g * torch.sigmoid(g) * self.up(x))


def test_a_silu_written_out_is_fused():
    g = trace(SiluGate(), (torch.randn(4, 16),))
    assert _aten.silu.default in _ops(g) and _aten.sigmoid.default not in _ops(g)
    x = torch.randn(4, 16)
    torch.testing.assert_close(g.graph_module.module()(x), SiluGate()(x))
