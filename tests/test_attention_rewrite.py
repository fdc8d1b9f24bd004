"""Eager attention rewritten to one scaled_dot_product_attention (partitioner.tracer.attention).

BLOOM's and MPT's ALiBi attention (baddbmm / matmul, scale, bias, causal mask, fp32 softmax, dropout, bmm),
GPT-2 and Llama built with attn_implementation="eager", each from a tiny config (no download): the
rewritten graph computes what the module computes (outputs, loss and every gradient, fp32), its cost
keeps O(s) bytes per attention where the eager one keeps s x s, the generated programs verify and train
like one process, and rewrite_attention=False keeps the traced ops.
"""

from __future__ import annotations

import functools

import pytest
import torch
from ranks import assert_trains_like
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MptConfig,
    MptForCausalLM,
)

from cost_models.errors import DeclarationError
from examples.training import hf_loss, hf_model_loss, sgd, train_one_process
from partitioner import compile, trace
from runtime import launch_local

VOCAB, SEQ, BATCH, STEPS = 128, 16, 8, 2


def bloom(layers: int = 2):
    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=layers, n_head=4, use_cache=False))


def mpt(layers: int = 2):
    torch.manual_seed(0)
    return MptForCausalLM(MptConfig(vocab_size=VOCAB, d_model=64, n_layers=layers, n_heads=4, max_seq_len=64,
                                    use_cache=False))


def gpt2(layers: int = 2, attn_pdrop: float = 0.0):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=64, use_cache=False,
                     attn_pdrop=attn_pdrop, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")


def llama(layers: int = 2):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="eager")


FAMILIES = {"bloom": bloom, "mpt": mpt, "gpt2": gpt2, "llama": llama}


def tokens(n: int = 2, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


@functools.cache
def graph(family: str, rewrite: bool = True, layers: int = 4):
    return trace(FAMILIES[family](layers), (tokens(),), rewrite_attention=rewrite)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rewritten_graph_computes_what_the_module_computes(family):
    """Two blocks (traced whole): the exported program after the rewrite against the module, forward and
    backward in training mode, fp32."""
    g = trace(FAMILIES[family](), (tokens(),))
    assert g.attention_rewrites == 2
    assert not any(n.op in ("softmax", "baddbmm", "bmm") for n in g.nodes)
    assert_computes_the_module(g, FAMILIES[family]())


def assert_computes_the_module(g, model) -> None:
    """The traced (rewritten) program against `model` in training mode: logits, loss and every gradient, fp32."""
    x, y = tokens(seed=1), tokens(seed=2)
    rewritten = g.graph_module.module()
    model.train()
    want, got = model(x), rewritten(x)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    hf_loss(want, y).backward()
    hf_loss(got, y).backward()
    grads = dict(rewritten.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _s_squared(g, b: int = 1) -> float:
    """The s^2 coefficient of one block's saved bytes at batch b (a second difference: exact for a quadratic)."""
    saved = [sum(n.cost.activation_bytes(b, s) for n in g.block_nodes(1)) for s in (256, 128, 0)]
    return (saved[0] - 2 * saved[1] + saved[2]) / (2 * 128 ** 2)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_rewritten_block_keeps_bytes_linear_in_s(family):
    """The causal mask is made once, before the blocks: a rewritten block keeps O(s) bytes, the eager one
    the s x s probabilities of every head."""
    assert _s_squared(graph(family)) == 0
    assert _s_squared(graph(family, rewrite=False)) >= 4 * 4  # 4 heads of fp32 probabilities, at least
    assert max(j for n in graph(family).block_nodes(1) for (_, j), _ in n.cost.activation_bytes.terms) == 1


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_an_alibi_bias_is_folded_into_the_products(family):
    """ALiBi is a bias per head and key, the same for every query: the rewrite folds it into the products (q takes
    two columns of a power of two near 1 / scale, k the bias over both in two parts, padded with zeros to a
    multiple of 8 columns, v too), so the fused op is left with the causal mask alone, which it runs as its causal
    path: a block keeps no s x s bytes (the eager one keeps at least the fp32 probabilities and their copy, 4
    heads), and the products are costed at half."""
    g = graph(family)
    assert _s_squared(g) == 0 and _s_squared(g, b=2) == 0
    assert _s_squared(graph(family, rewrite=False)) >= 2 * 4 * 4
    sdpa = [n for n in g.graph_module.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert sdpa and g.attention_rewrites == 4  # the graph holds the blocks traced, the OpGraph all four
    for n in sdpa:
        q, k, v = (x.meta["val"] for x in n.args[:3])
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] == 24  # head dim 16, + 2 columns, padded to 24
        assert n.kwargs["attn_mask"].meta["val"].dtype == torch.bool  # the causal mask, from shapes alone
    assert [n.cost.causal for n in g.nodes if n.op == "scaled_dot_product_attention"] == [True] * 4


def test_alibi_is_folded_at_any_length():
    """MPT's ALiBi positions start at 1 - s, below -1e4 past 10K tokens: a position, not a fill value such as
    finfo.min, so its bias is still folded (traced on meta at 16K tokens)."""
    with torch.device("meta"):
        model = MptForCausalLM(MptConfig(vocab_size=VOCAB, d_model=64, n_layers=1, n_heads=4, max_seq_len=16384,
                                         use_cache=False))
    g = trace(model, (torch.zeros(1, 16384, dtype=torch.long, device="meta"),))
    sdpa = [n for n in g.graph_module.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert sdpa and all(n.args[0].meta["val"].shape[-1] == 24 for n in sdpa)
    assert all(n.kwargs["attn_mask"].meta["val"].dtype == torch.bool for n in sdpa)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_the_folded_bias_runs_in_16_bits_as_close_as_eager(family, dtype):
    """The generated code in bf16 or fp16 (its casts follow the parameters' dtype): the extra columns take the
    queries' dtype, and the bias keeps its two parts, so the logits are as close to fp32 as the eager model's."""
    plan = compile(graph(family), "local:2", global_batch_size=8, precision="fp32", pp=1, tp=1, dp=2)
    x = tokens(seed=5, seq=64)
    want = FAMILIES[family](4)(x).logits
    eager = FAMILIES[family](4).to(dtype)(x).logits.float()
    model = FAMILIES[family](4).to(dtype)
    plan.program(0).namespace()["make_stage"](model, None).run_as_model()
    got = model(x).logits.float()
    assert (got - want).abs().max() <= 1.5 * (eager - want).abs().max() + 1e-3


def test_dropout_and_a_read_probability_matrix():
    """Attention dropout becomes the fused op's dropout_p (0 in eval mode: the traced flag); probabilities the
    model returns (output_attentions) are read elsewhere, so that attention stays as traced."""
    model = gpt2(attn_pdrop=0.1)
    sdpa = [n for n in trace(model, (tokens(),)).graph_module.graph.nodes if n.name.startswith("attention_sdpa")]
    assert [n.kwargs["dropout_p"] for n in sdpa] == [0.1, 0.1]
    model.eval()
    sdpa = [n for n in trace(model, (tokens(),)).graph_module.graph.nodes if n.name.startswith("attention_sdpa")]
    assert [n.kwargs["dropout_p"] for n in sdpa] == [0.0, 0.0]
    assert trace(Attention(), (tokens(),)).attention_rewrites == 1
    for other in (dict(returns_probs=True), dict(dim=-2), dict(bias_scale=True)):
        assert trace(Attention(**other), (tokens(),)).attention_rewrites == 0, other


class Attention(torch.nn.Module):
    """One head of hand-written attention; `returns_probs`, a softmax over `dim` -2 or a bias that scales the
    scores instead of adding to them are not what the fused op computes."""

    def __init__(self, returns_probs: bool = False, dim: int = -1, bias_scale: bool = False):
        super().__init__()
        self.embed, self.qkv = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 48)
        self.returns_probs, self.dim, self.bias_scale = returns_probs, dim, bias_scale

    def forward(self, idx):
        q, k, v = self.qkv(self.embed(idx)).split(16, dim=-1)
        scores = q @ k.transpose(-2, -1) / 4.0
        causal = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool, device=idx.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        if self.bias_scale:
            scores = scores * torch.arange(idx.shape[1], device=idx.device)
        probs = torch.softmax(scores, dim=self.dim)
        return (probs @ v, probs) if self.returns_probs else probs @ v


def test_rewrite_attention_false_keeps_the_eager_costs():
    eager = graph("bloom", rewrite=False)
    assert eager.attention_rewrites == 0 and sum(n.op == "softmax" for n in eager.nodes) == 4
    kw = dict(global_batch_size=8, precision="fp32", dp=2, tp=1, pp=1, zero_stage=0, microbatch_size=4)
    x = (tokens(seq=128),)  # at 16 tokens the products' two extra columns (16 -> 24) weigh more than s x s
    plan = compile(bloom(4), "local:2", x, rewrite_attention=False, **kw)
    assert plan.attention_rewrites == 0 and plan.declarations["rewrite_attention"] is False
    assert plan.code is None and "attention" not in str(plan)  # the module runs as it is
    fused = compile(bloom(4), "local:2", x, **kw)
    assert fused.attention_rewrites == 4 and "rewrite_attention" not in fused.declarations
    assert "4 eager attentions rewritten to fused scaled_dot_product_attention" in str(fused)
    assert fused.predicted.memory.activations < plan.predicted.memory.activations
    with pytest.raises(DeclarationError, match="rewrite_attention=False: trace the model with"):
        compile(graph("bloom"), "local:2", rewrite_attention=False, **kw)
    with pytest.raises(DeclarationError, match="rewrite_attention=1: must be True"):
        compile(bloom(4), "local:2", (tokens(),), rewrite_attention=1, **kw)


@pytest.mark.parametrize("family", ["bloom", "mpt"])
@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2), (2, 2)])
def test_rewritten_programs_verify(family, pp, tp):
    """The generated stage code (the heads of ALiBi and mask cut with the heads under tp) against the module."""
    plan = compile(graph(family), "local:4", global_batch_size=8, precision="fp32", pp=pp, tp=tp)
    assert "shape_mask_attention(" in plan.program(0).source  # the causal mask left after ALiBi is folded
    report = plan.verify(functools.partial(FAMILIES[family], 4))
    assert report.checked


def test_a_data_parallel_plan_runs_the_rewritten_code():
    """The module's own forward would run its eager attention: a data-parallel plan whose costs assume the
    fused kernel runs the generated code instead, and plan.verify checks it. A batch without the traced inputs
    runs the module's own forward, saying so."""
    plan = compile(graph("bloom"), "local:2", global_batch_size=8, precision="fp32", pp=1, tp=1, dp=2)
    src = plan.program(0).source
    assert "make_stage(model, None).run_as_model()" in src and "shape_mask_attention(" in src
    assert plan.verify(functools.partial(bloom, 4)).checked
    ns = plan.program(0).namespace()
    model, x = bloom(4), tokens(seed=3)
    want = bloom(4)(x).logits
    ns["make_stage"](model, None).run_as_model()
    torch.testing.assert_close(model(x).logits, want, rtol=1e-5, atol=1e-5)  # the code
    with pytest.warns(RuntimeWarning, match="the model runs its own forward"):
        eager = model(x, None).logits  # not the traced inputs (past_key_values=None too): the module's own forward
    torch.testing.assert_close(eager, want, rtol=1e-5, atol=1e-5)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(tokens(BATCH, seed=2 * i + 1), tokens(BATCH, seed=2 * i + 2)) for i in range(STEPS)]


@pytest.mark.slow
@pytest.mark.parametrize("pp,dp,tp,zero,recompute", [(1, 2, 1, 3, "none"), (1, 2, 1, 3, "full"), (1, 2, 1, 1, "selective"),
                                                     (1, 1, 2, 0, "none"), (2, 1, 1, 0, "none")])
def test_rewritten_bloom_trains_like_one_process(pp, dp, tp, zero, recompute):
    """Data-parallel plans run the rewritten code (recomputed by the engine, ZeRO-3 gathering per block), tensor
    and pipeline plans their stage code."""
    plan = compile(graph("bloom"), f"local:{pp * dp * tp}", global_batch_size=BATCH, precision="fp32", pp=pp, dp=dp,
                   tp=tp, zero_stage=zero, microbatch_size=2, recompute=recompute)
    model_fn = functools.partial(bloom, 4)
    out = launch_local(plan, model_fn, sgd, hf_loss, batches(), timeout_s=180)
    trained = train_one_process(model_fn, sgd, hf_loss, batches())
    assert_trains_like(out, trained.losses, trained.model.state_dict())


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_a_padding_mask_read_from_the_inputs_keeps_attention_as_traced(family):
    """A left-padded row's pads see no key. Eager attention spreads such a row evenly over the keys; the fused
    kernel's forward does too, but not its backward (gradients up to 2x off, torch 2.13 on CPU). So a chain whose
    mask reads the attention_mask input is left as traced, and the programs of a left-padded batch compute the
    module at pp2 x tp2 with the model's own loss; without that input the same attention is rewritten."""
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    g = trace(FAMILIES[family](2), (), batch)
    assert g.attention_rewrites == 0 and graph(family).attention_rewrites == 4
    plan = compile(g, "local:4", global_batch_size=2, microbatch_size=2, precision="fp32", pp=2, tp=2, dp=1, sp=False)
    plan.verify(functools.partial(FAMILIES[family], 2), batch, hf_model_loss)


class _KeyMaskAttention(torch.nn.Module):
    """Eager attention under a bias per key made from shapes that removes the last key (finfo.min there): a mask
    term, not a bias to fold (over the scale it would be -inf in k's columns, and NaN in its low part)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)

    def forward(self, ids):
        x = self.emb(ids).view(ids.shape[0], ids.shape[1], 2, 8).transpose(1, 2)  # (b, h, s, d)
        pos = torch.arange(ids.shape[1], device=ids.device)
        bias = torch.where(pos == ids.shape[1] - 1, torch.finfo(x.dtype).min, pos * 0.1).view(1, 1, 1, -1)
        scores = x @ x.transpose(-1, -2) / 8 ** 0.5 + bias
        return (scores.softmax(-1) @ x).sum()


def test_a_bias_per_key_that_removes_a_key_is_not_folded():
    torch.manual_seed(0)
    model = _KeyMaskAttention()
    g = trace(model, (tokens(),))
    assert g.attention_rewrites == 1
    sdpa = next(n for n in g.graph_module.graph.nodes
                if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    assert sdpa.args[0].meta["val"].shape[-1] == 8 and sdpa.kwargs["attn_mask"] is not None  # left as a mask
    x = tokens(seed=4)
    got = g.graph_module.module()(x)
    assert torch.isfinite(got)
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
