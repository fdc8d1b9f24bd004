"""Tensor-parallel splits found from traced graphs: Megatron column/row pairs, heads, fused qkv,
vocab-parallel embedding and head, what breaks a pair, collectives, divisors, speed on 175B."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from torch import nn

from examples import cnn as cnn_mod
from examples import gpt as gpt_mod
from examples import mlp as mlp_mod
from partitioner import OpGraph, trace
from partitioner.planner.tensor_split import Placement, TensorSplits, find_splits

B, S = 2, 16  # where byte sizes are checked


def hf_trace(model: nn.Module, vocab: int) -> OpGraph:
    ids = torch.randint(0, vocab, (B, S))
    return trace(model, (), {"input_ids": ids, "labels": ids, "use_cache": False})


def hf_gpt2(L=2, h=192, heads=12, V=1010) -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=L, n_embd=h, n_head=heads, vocab_size=V, n_positions=64,
                                  use_cache=False, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_llama(L=2, h=128, heads=4, kv=2, ffn=256, V=1000) -> nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=L, hidden_size=h, num_attention_heads=heads,
                                   num_key_value_heads=kv, intermediate_size=ffn, vocab_size=V,
                                   max_position_embeddings=64, use_cache=False, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def gpt_splits(**overrides) -> tuple[OpGraph, TensorSplits]:
    model = gpt_mod.gpt_small(**overrides)
    g = trace(model, gpt_mod.example_batch(model, B, S))
    return g, find_splits(g)


def specs(sp: TensorSplits) -> dict[str, tuple[str, str, int]]:
    return {p.param: (p.spec, p.role, p.fused) for p in sp.placements}


def per_block(sp: TensorSplits, g: OpGraph, block: int) -> list[tuple[str, str]]:
    names = {n.name for n in g.block_nodes(block)}
    return [(c.phase, c.what) for c in sp.collectives if c.node in names]


@pytest.fixture(scope="module")
def gpt():
    return gpt_splits()


@pytest.fixture(scope="module")
def gpt2():
    g = hf_trace(hf_gpt2(), 1010)
    return g, find_splits(g)


@pytest.fixture(scope="module")
def llama():
    g = hf_trace(hf_llama(), 1000)
    return g, find_splits(g)


# ---------------------------------------------------------------- nanoGPT


def test_example_gpt_every_parameter(gpt):
    g, sp = gpt
    assert [p.param for p in sp.placements] == [p.name for p in g.params]
    got = specs(sp)
    assert got["transformer.wte.weight"] == ("S(0)", "vocab_embedding", 1)  # tied with lm_head.weight
    assert got["transformer.wpe.weight"] == ("R", "replicated", 1)
    assert got["transformer.ln_f.weight"] == ("R", "replicated", 1)
    for i in range(4):
        h = f"transformer.h.{i}"
        assert got[f"{h}.attn.c_attn.weight"] == ("S(0)", "column", 3)
        assert got[f"{h}.attn.c_attn.bias"] == ("S(0)", "column", 3)
        assert got[f"{h}.attn.c_proj.weight"] == ("S(1)", "row", 1)
        assert got[f"{h}.attn.c_proj.bias"] == ("R", "replicated", 1)
        assert got[f"{h}.mlp.c_fc.weight"] == ("S(0)", "column", 1)
        assert got[f"{h}.mlp.c_fc.bias"] == ("S(0)", "column", 1)
        assert got[f"{h}.mlp.c_proj.weight"] == ("S(1)", "row", 1)
        assert got[f"{h}.mlp.c_proj.bias"] == ("R", "replicated", 1)
        for ln in ("ln_1", "ln_2"):
            assert got[f"{h}.{ln}.weight"] == ("R", "replicated", 1)
            assert "full hidden dim" in sp.placement(f"{h}.{ln}.weight").reason
    assert "added after the all-reduce" in sp.placement("transformer.h.0.mlp.c_proj.bias").reason
    assert "lm_head" in sp.placement("transformer.wte.weight").reason  # the tie is explained
    assert all(p.reason for p in sp.placements)


def test_example_gpt_collectives_per_block_and_bytes(gpt):
    g, sp = gpt
    for blk in range(len(g.blocks)):  # attention and MLP: one f (backward) and one g (forward) each
        assert sorted(per_block(sp, g, blk)) == sorted(2 * [("backward", "column input gradient (f)"),
                                                            ("forward", "row-parallel output (g)")])
    h = 256
    for c in sp.collectives:
        want = B * S * 4 if c.what.startswith("cross entropy") else B * S * h * 4  # fp32 stats, or (b, s, h)
        assert c.kind == "all_reduce" and c.bytes(B, S) == want, c
    kinds = [c.what for c in sp.collectives if g.node(c.node).block is None]
    assert kinds.count("vocab-parallel embedding output") == 1
    assert sum(k.startswith("cross entropy") for k in kinds) == 3  # max, sum of exp, target logit
    assert kinds.count("column input gradient (f)") == 1  # the LM head's input gradient
    assert len(sp.collectives) == 4 * 4 + 1 + 1 + 3


def test_example_gpt_divisors(gpt):
    _, sp = gpt
    d = dict(sp.divisors)
    assert d["heads of transformer.h.0.attn"] == 4
    assert d["ffn of transformer.h.0.mlp"] == 1024
    assert d["vocab of transformer.wte.weight"] == 8192
    assert sp.valid_tp() == (1, 2, 4)


def test_example_gpt_sharded_nodes(gpt):
    g, sp = gpt
    ops = {g.node(n).op for n in sp.sharded_nodes}
    # its eager attention is traced as one fused op (partitioner.tracer.attention), split by heads
    assert {"linear", "scaled_dot_product_attention", "split", "view", "gelu", "cross_entropy_loss"} <= ops
    assert not {"layer_norm", "embedding"} & ops
    assert not any(g.node(n).op == "add" and g.node(n).output.shape[-1](1, 1) == 256 for n in sp.sharded_nodes)


def test_example_gpt_without_bias():
    _, sp = gpt_splits(bias=False)
    got = specs(sp)
    assert got["transformer.h.1.attn.c_attn.weight"] == ("S(0)", "column", 3)
    assert got["transformer.h.1.mlp.c_proj.weight"] == ("S(1)", "row", 1)
    assert not any("bias" in p for p in got)
    assert len(sp.collectives) == 4 * 4 + 1 + 1 + 3


def test_logits_returned_without_a_loss_reach_the_callers_loss_from_a_vocab_parallel_head():
    """No loss in the graph: the LM head is column-parallel and its logits go to the caller's loss split over the
    vocab, where a cross entropy all-reduces three numbers per token (torch's loss_parallel; an all-gather of the
    logits only if the loss reads them otherwise), so the tied matrix is split by vocab in both uses instead of kept
    whole on every rank."""
    model = gpt_mod.gpt_tiny()
    g = trace(model, gpt_mod.example_inputs(model, 2, 16))  # no targets: the logits are the output
    sp = find_splits(g)
    wte = sp.placement("transformer.wte.weight")
    assert (wte.spec, wte.role) == ("S(0)", "vocab_embedding") and "lm_head" in wte.reason
    assert not [c for c in sp.collectives if c.kind == "all_gather"]  # the logits are never gathered
    stats = [c for c in sp.collectives if "split logits" in c.what]
    assert len(stats) == 3 and all(c.kind == "all_reduce" and c.bytes(2, 16) == 2 * 16 * 4 for c in stats)
    assert sp.placement("transformer.h.0.mlp.c_fc.weight").role == "column"  # the blocks still split
    assert 1024 % max(sp.valid_tp()) == 0


def test_a_vocab_that_would_narrow_the_tensor_degrees_keeps_the_tied_matrix_whole():
    """Vocab 1000 divides by 8 but not 16, while the 4 heads allow tp 4: fine. Vocab 1022 does not divide by 4:
    splitting its logits would forbid tp 4, so the head and the tied embedding stay whole, saying how to fix it."""
    for vocab, split in ((1000, True), (1022, False)):
        model = gpt_mod.GPT(dataclasses.replace(gpt_mod.CONFIGS["gpt_tiny"], vocab_size=vocab))
        sp = find_splits(trace(model, gpt_mod.example_inputs(model, 2, 16)))
        wte = sp.placement("transformer.wte.weight")
        assert (wte.spec == "S(0)") == split, vocab
        assert sp.valid_tp() == (1, 2, 4)
    assert "needs another split" in wte.reason and "lm_head" in wte.reason


def _vit(classes: int = 5) -> nn.Module:
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
        patch_size=8, num_labels=classes))


def test_a_classifier_whose_classes_would_narrow_the_tensor_degrees_stays_whole_with_its_loss_too():
    """5 classes divide by no tp, while the 4 heads allow tp 4. With its labels the model's cross entropy reads
    the logits inside the graph; the classifier must stay whole there as it does when the logits are the output,
    not refuse every tp > 1 ("tp=2 does not divide vocab of classifier.weight (5)"). Its tp2 programs compute
    the module, loss included."""
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labelled = dict(pixel_values=pixels, labels=torch.tensor([1, 4]))
    for inputs in (dict(pixel_values=pixels), labelled):
        sp = find_splits(trace(_vit(), (), inputs))
        assert sp.valid_tp() == (1, 2, 4), inputs.keys()
        assert sp.placement("classifier.weight").spec == "R"
        assert sp.placement("vit.layers.0.attention.q_proj.weight").role == "column"
    from partitioner import compile
    plan = compile(trace(_vit(), (), labelled), "local:2", global_batch_size=2, microbatch_size=2,
                   precision="fp32", tp=2, pp=1, dp=1)
    plan.verify(_vit, labelled, lambda output, targets=None: output.loss)


def test_an_odd_vocab_keeps_the_embedding_and_head_whole_and_narrows_no_degree():
    """Llama with 1001 tokens (untied): its embedding and LM head stay whole, saying to pad the vocabulary, and it
    allows the tensor degrees the heads allow, as with 1000 tokens; it refused every tp > 1 (Moshi's 513)."""
    odd, even = (find_splits(hf_trace(hf_llama(V=v), v)) for v in (1001, 1000))
    assert odd.valid_tp() == even.valid_tp() == (1, 2)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert odd.placement(name).spec == "R" and "pad the vocabulary" in odd.placement(name).reason
        assert even.placement(name).spec == "S(0)"


# ---------------------------------------------------------------- Hugging Face


def test_hf_gpt2_conv1d_is_split_on_the_other_dim(gpt2):
    g, sp = gpt2
    got = specs(sp)
    for i in range(2):
        h = f"transformer.h.{i}"
        assert got[f"{h}.attn.c_attn.weight"] == ("S(1)", "column", 3)  # Conv1D weight is [in, out]
        assert got[f"{h}.attn.c_attn.bias"] == ("S(0)", "column", 3)
        assert got[f"{h}.attn.c_proj.weight"] == ("S(0)", "row", 1)
        assert got[f"{h}.attn.c_proj.bias"] == ("R", "replicated", 1)
        assert got[f"{h}.mlp.c_fc.weight"] == ("S(1)", "column", 1)
        assert got[f"{h}.mlp.c_proj.weight"] == ("S(0)", "row", 1)
    # vocab 1010 would allow tp 2 alone, where the 12 heads allow 12: the tied head stays whole (next test)
    assert got["transformer.wte.weight"] == ("R", "replicated", 1)
    assert got["transformer.wpe.weight"] == ("R", "replicated", 1)
    for blk in range(2):
        assert len(per_block(sp, g, blk)) == 4


def test_hf_gpt2_valid_tp_needs_heads_and_a_vocab_that_narrows_nothing(gpt2):
    """The model's own loss reads the logits inside the graph. Vocab 1010 divides by 2 of the degrees the 12 heads
    allow: split, it would forbid tp 3, 4, 6 and 12, so the head stays whole, and with it the tied embedding (as
    the nanoGPT's above); vocab 1008 divides by them all and is split."""
    _, sp = gpt2
    d = dict(sp.divisors)
    assert d["heads of transformer.h.0.attn"] == 12 and "vocab of transformer.wte.weight" not in d
    assert 5 not in sp.valid_tp(range(1, 13))  # divides the vocab 1010, not the 12 heads
    assert sp.valid_tp(range(1, 13)) == (1, 2, 3, 4, 6, 12)
    assert "needs another split" in sp.placement("transformer.wte.weight").reason
    split = find_splits(hf_trace(hf_gpt2(V=1008), 1008))
    assert dict(split.divisors)["vocab of transformer.wte.weight"] == 1008
    assert split.placement("transformer.wte.weight").spec == "S(0)"
    assert split.valid_tp(range(1, 13)) == (1, 2, 3, 4, 6, 12)


def test_hf_llama_gqa_swiglu_untied_head(llama):
    g, sp = llama
    got = specs(sp)
    for i in range(2):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for x in ("q", "k", "v"):
            assert got[f"{a}.{x}_proj.weight"] == ("S(0)", "column", 1)
        assert got[f"{a}.o_proj.weight"] == ("S(1)", "row", 1)
        assert got[f"{m}.gate_proj.weight"] == ("S(0)", "column", 1)
        assert got[f"{m}.up_proj.weight"] == ("S(0)", "column", 1)
        assert got[f"{m}.down_proj.weight"] == ("S(1)", "row", 1)
        assert got[f"model.layers.{i}.input_layernorm.weight"] == ("R", "replicated", 1)
    assert got["model.embed_tokens.weight"] == ("S(0)", "vocab_embedding", 1)
    assert got["lm_head.weight"] == ("S(0)", "vocab_head", 1)
    d = dict(sp.divisors)
    assert d["heads of model.layers.0.self_attn"] == 4
    assert d["kv heads of model.layers.0.self_attn"] == 2
    assert d["ffn of model.layers.0.mlp"] == 256
    assert sp.valid_tp() == (1, 2)  # 2 kv heads, though 4 query heads and a vocab of 1000 allow 4
    for blk in range(2):  # q, k, v share one input: one f; gate and up too
        assert sorted(per_block(sp, g, blk)) == sorted(2 * [("backward", "column input gradient (f)"),
                                                            ("forward", "row-parallel output (g)")])
    h = 128
    assert {c.bytes(B, S) for c in sp.collectives if not c.what.startswith("cross")} == {B * S * h * 4}


def test_hf_llama_more_kv_heads_allows_more_tp():
    g = hf_trace(hf_llama(L=1, heads=8, kv=4, h=128, ffn=512, V=1024), 1024)
    sp = find_splits(g)
    assert dict(sp.divisors)["kv heads of model.layers.0.self_attn"] == 4
    assert sp.valid_tp() == (1, 2, 4)


# ---------------------------------------------------------------- small models


def test_mlp_first_pair_splits_last_layer_stays_whole():
    model = mlp_mod.mlp()
    g = trace(model, mlp_mod.example_inputs(model))
    sp = find_splits(g)
    got = specs(sp)
    assert got["net.0.weight"] == ("S(0)", "column", 1) and got["net.0.bias"] == ("S(0)", "column", 1)
    assert got["net.2.weight"] == ("S(1)", "row", 1) and got["net.2.bias"] == ("R", "replicated", 1)
    # net.4 reads net.2's all-reduced output: a column candidate with no matmul after it; splitting it
    # would need its 10 logits gathered, so it stays whole.
    assert got["net.4.weight"] == ("R", "replicated", 1)
    assert "model output" in sp.placement("net.4.weight").reason
    # the input is data, so no backward all-reduce of its gradient: one forward all-reduce only
    assert [(c.phase, c.bytes(8, 1)) for c in sp.collectives] == [("forward", 8 * 512 * 4)]
    assert sp.divisors == (("ffn of net", 512),)


def test_cnn_convolutions_stay_whole():
    model = cnn_mod.cnn()
    g = trace(model, cnn_mod.example_inputs(model))
    sp = find_splits(g)
    assert all(p.spec == "R" and p.role == "replicated" for p in sp.placements)
    assert "convolution" in sp.placement("stem.conv.weight").reason
    assert "batch norm" in sp.placement("blocks.0.bn.weight").reason
    assert "model output" in sp.placement("fc.weight").reason
    assert sp.collectives == () and sp.sharded_nodes == frozenset()


class LayerNormBetween(nn.Module):
    """a -> LayerNorm -> b -> GELU -> c: the norm breaks (a, b); b pairs with c instead."""

    def __init__(self, d=32):
        super().__init__()
        self.a, self.norm, self.b, self.c = nn.Linear(d, 4 * d), nn.LayerNorm(4 * d), nn.Linear(4 * d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c(nn.functional.gelu(self.b(self.norm(self.a(x))))).sum()


class ResidualBetween(nn.Module):
    """a -> (+ a replicated tensor spanning the features, which needs a gradient) -> b: the add breaks the pair."""

    def __init__(self, d=32):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = torch.tanh(x * self.w)  # (B, d), replicated, a function of a parameter
        return self.b(self.a(h) + h).sum()


class BiasBetween(nn.Module):
    """a -> (+ a replicated tensor spanning the features that needs no gradient) -> b: each rank adds its chunk."""

    def __init__(self, d=32):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        bias = torch.tanh(x).detach()  # (B, d), replicated, made from data alone
        return self.b(torch.relu(self.a(x)) + bias).sum()


def test_a_replicated_operand_that_needs_no_gradient_is_read_by_chunk():
    g = trace(BiasBetween(), (torch.randn(4, 32),))
    sp = find_splits(g)
    got = specs(sp)
    assert got["a.weight"] == ("S(0)", "column", 1) and got["b.weight"] == ("S(1)", "row", 1)
    (node, operand, dim), = sp.chunks
    assert g.node(node).op == "add" and g.node(operand).op in ("tanh", "detach", "alias") and dim == 1
    assert TensorSplits.from_json(sp.to_json()) == sp


class SoftmaxBetween(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.b(self.a(x).softmax(-1)).sum()


class PerHeadNorm(nn.Module):
    """q-norm over each head's dims (Qwen3/OLMo style) is shard-local; the heads still split."""

    def __init__(self, d=32, nh=4):
        super().__init__()
        self.nh = nh
        self.q, self.o, self.norm = nn.Linear(d, d), nn.Linear(d, d), nn.LayerNorm(d // nh)

    def forward(self, x):
        b, t, d = x.shape
        q = self.norm(self.q(x).view(b, t, self.nh, d // self.nh))  # (B, T, nh, hs)
        return self.o(torch.relu(q).reshape(b, t, d)).sum()


def test_layer_norm_between_two_linears_keeps_them_whole():
    g = trace(LayerNormBetween(), (torch.randn(4, 32),))
    sp = find_splits(g)
    got = specs(sp)
    assert got["a.weight"] == ("R", "replicated", 1)
    assert "normalises over the split features" in sp.placement("a.weight").reason
    assert got["norm.weight"] == ("R", "replicated", 1)
    assert got["b.weight"] == ("S(0)", "column", 1) and got["c.weight"] == ("S(1)", "row", 1)


@pytest.mark.parametrize("model, why", [(ResidualBetween(), "not split but spans the split dim"),
                                        (SoftmaxBetween(), "softmax over the split dim")])
def test_a_non_local_op_between_two_linears_keeps_them_whole(model, why):
    sp = find_splits(trace(model, (torch.randn(4, 32),)))
    assert specs(sp)["a.weight"] == ("R", "replicated", 1) and why in sp.placement("a.weight").reason
    assert specs(sp)["b.weight"][1] == "replicated"
    assert sp.collectives == ()


def test_a_norm_within_each_head_is_shard_local():
    sp = find_splits(trace(PerHeadNorm(), (torch.randn(2, 8, 32),)))
    got = specs(sp)
    assert got["q.weight"] == ("S(0)", "column", 1) and got["o.weight"] == ("S(1)", "row", 1)
    assert got["norm.weight"] == ("R", "replicated", 1)
    assert "within each head" in sp.placement("norm.weight").reason
    assert sp.divisors == (("groups of view", 4),)  # a head split, but no attention op: "groups"


# ---------------------------------------------------------------- API, printing, scale


def test_placement_lookup_json_and_table(gpt):
    _, sp = gpt
    assert sp.placement("transformer.h.0.attn.c_attn.weight").dim == 0
    assert sp.placement("transformer.h.0.attn.c_proj.bias").dim is None
    with pytest.raises(KeyError, match="no parameter"):
        sp.placement("lm_head.weight")  # tied: the canonical name is transformer.wte.weight
    assert TensorSplits.from_json(sp.to_json()) == sp
    text = str(sp)
    assert "S(0) x3" in text and "valid tp: (1, 2, 4)" in text
    assert isinstance(sp.placements[0], Placement)


def test_gpt3_175b_on_meta_finds_every_pair():
    with torch.device("meta"):
        model = gpt_mod.gpt3_175b()
    idx = torch.empty(1, 2048, dtype=torch.long, device="meta")
    g = trace(model, (idx, idx))
    sp = find_splits(g)
    assert sum(p.role == "row" for p in sp.placements) == 96 * 2
    assert sum(p.role == "column" and p.param.endswith("weight") for p in sp.placements) == 96 * 2
    assert len(sp.collectives) == 96 * 4 + 1 + 1 + 3
    assert sp.valid_tp() == (1, 2, 4, 8, 16, 32)  # 96 heads
