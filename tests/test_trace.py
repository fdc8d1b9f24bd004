"""The tracer: parameters, FLOPs against Megatron's formula and hand counts, symbolic
costs, repeated-block expansion against a full trace, meta device, errors."""

from __future__ import annotations

import dataclasses
import resource
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers  # a test extra (pip install -e '.[test]'): missing, it must fail, not skip
from torch import nn

from examples import cnn as cnn_mod
from examples import gpt as gpt_mod
from examples import mlp as mlp_mod
from partitioner import OpGraph, PartitionerError, TraceError, trace


def unique_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def megatron_flops(B, s, l, h, V):
    """Narayanan et al. 2021, eq. (3): forward + backward FLOPs of a GPT step."""
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * h * l))


def hf_gpt2(L=4, h=128, heads=4, V=1000, n_pos=64):
    cfg = transformers.GPT2Config(n_layer=L, n_embd=h, n_head=heads, vocab_size=V, n_positions=n_pos,
                                  use_cache=False, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_llama(L=4, h=128, V=1000):
    cfg = transformers.LlamaConfig(num_hidden_layers=L, hidden_size=h, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=2 * h, vocab_size=V, max_position_embeddings=64, use_cache=False,
                                   bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def hf_trace(model, tokens, **kw) -> OpGraph:
    return trace(model, (), dict(input_ids=tokens, labels=tokens, use_cache=False), **kw)


def same_graph(a: OpGraph, b: OpGraph) -> None:
    """Node-by-node equality up to node names (wiring compared by position)."""
    assert len(a.nodes) == len(b.nodes)
    pa = {n.name: i for i, n in enumerate(a.nodes)}
    pb = {n.name: i for i, n in enumerate(b.nodes)}
    for x, y in zip(a.nodes, b.nodes):
        kx = (x.op, x.module_path, x.output, x.cost, x.params, x.block, x.param_count, x.requires_grad,
              [pa.get(i, i) for i in x.inputs])
        ky = (y.op, y.module_path, y.output, y.cost, y.params, y.block, y.param_count, y.requires_grad,
              [pb.get(i, i) for i in y.inputs])
        assert kx == ky, f"{x.name} != {y.name}"
    assert [dataclasses.replace(p, owner=pa.get(p.owner)) for p in a.params] == \
        [dataclasses.replace(p, owner=pb.get(p.owner)) for p in b.params]
    assert a.blocks == b.blocks


# ---------------------------------------------------------------- parameters


@pytest.mark.parametrize("make", [mlp_mod.mlp, cnn_mod.cnn, gpt_mod.gpt_tiny, gpt_mod.gpt_small])
def test_param_totals_equal_unique_parameters(make):
    model = make()
    mod = sys.modules[make.__module__]
    g = trace(model, mod.example_inputs(model))
    assert g.num_params == unique_params(model)
    assert sum(n.param_count for n in g.nodes) == g.num_params  # every used tensor owned exactly once


def test_tied_embedding_and_lm_head_counted_once():
    model = gpt_mod.gpt_tiny()
    g = trace(model, gpt_mod.example_batch(model, 2))
    tied = [p for p in g.params if p.aliases]
    assert [(p.name, p.aliases) for p in tied] == [("transformer.wte.weight", ("lm_head.weight",))]
    users = [n for n in g.nodes if "transformer.wte.weight" in n.params]
    assert len(users) == 2 and users[0].param_count == tied[0].numel and users[1].param_count == 0


@pytest.mark.parametrize("builder", [hf_gpt2, hf_llama])
def test_hugging_face_models_trace_with_exact_param_totals(builder):
    torch.manual_seed(0)
    model = builder()
    g = hf_trace(model, torch.randint(0, 1000, (2, 32)))
    assert g.num_params == unique_params(model)
    assert len(g.blocks) == 4 and g.method == "export"


# ---------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("L,h,heads,s,V", [(4, 512, 8, 512, 8192), (8, 768, 12, 1024, 50304), (2, 1024, 16, 256, 32000)])
def test_example_gpt_flops_match_megatron_formula(L, h, heads, s, V):
    cfg = gpt_mod.GPTConfig(n_layer=L, n_head=heads, n_embd=h, block_size=1024, vocab_size=V)
    with torch.device("meta"):
        model = gpt_mod.GPT(cfg)
    tokens = torch.empty(2, s, dtype=torch.long, device="meta")
    g = trace(model, (tokens, tokens))
    for B in (1, 8):
        assert g.flops(batch_size=B) == pytest.approx(megatron_flops(B, s, L, h, V), rel=0.02)


@pytest.mark.parametrize("L,h,heads,s,V", [(4, 256, 4, 128, 1000), (2, 768, 12, 256, 50257)])
def test_hf_gpt2_flops_match_megatron_formula(L, h, heads, s, V):
    with torch.device("meta"):
        model = hf_gpt2(L=L, h=h, heads=heads, V=V, n_pos=s)
    tokens = torch.empty(2, s, dtype=torch.long, device="meta")
    g = hf_trace(model, tokens)
    assert g.flops(batch_size=4) == pytest.approx(megatron_flops(4, s, L, h, V), rel=0.02)


def test_cnn_flops_equal_the_hand_count():
    model = cnn_mod.cnn()
    g = trace(model, cnn_mod.example_inputs(model, batch_size=8))
    B = 5
    convs_and_linear = sum(n.cost.forward_flops(B) for n in g.nodes if n.op in ("conv2d", "linear"))
    bias = 10  # the Linear's bias adds one FLOP per output
    assert convs_and_linear == cnn_mod.FORWARD_FLOPS_PER_IMAGE * B + bias * B
    # The rest, by op_rules' conventions: BatchNorm 8/element, ReLU 1/element, pooling 1 per input
    # element, plus BatchNorm's num_batches_tracked += 1 (5 of them, independent of batch).
    stem, block = 64 * 32 * 32, 64 * 16 * 16
    rest = 8 * (stem + 4 * block) + (stem + 4 * block) + stem + block
    assert g.forward_flops(B) == convs_and_linear + rest * B + 5
    # Backward: the stem's input needs no gradient, so its conv only computes the weight gradient.
    stem_conv = g.nodes[0]
    assert stem_conv.op == "conv2d" and stem_conv.cost.backward_flops(B) == stem_conv.cost.forward_flops(B)
    block_conv = next(n for n in g.nodes if n.module_path == "blocks.0.conv")
    assert block_conv.cost.backward_flops(B) == 2 * block_conv.cost.forward_flops(B)


def test_fx_and_export_agree_on_the_cnn_and_mlp():
    for mod, make in ((cnn_mod, cnn_mod.cnn), (mlp_mod, mlp_mod.mlp)):
        model = make()
        ex = trace(model, mod.example_inputs(model), method="export")
        fx = trace(model, mod.example_inputs(model), method="fx")
        assert fx.method == "fx" and ex.method == "export"
        assert fx.num_params == ex.num_params
        matmul = lambda g: sum(n.cost.forward_flops(16) for n in g.nodes if n.cost.op_class in ("conv", "matmul"))
        assert matmul(fx) == matmul(ex)
        assert fx.flops(16) == pytest.approx(ex.flops(16), rel=1e-3)


# ---------------------------------------------------------------- symbolic costs


def test_costs_are_functions_of_batch_and_sequence():
    model = gpt_mod.gpt_small()
    g2 = trace(model, (torch.randint(0, 100, (2, 64)), torch.randint(0, 100, (2, 64))))
    g6 = trace(model, (torch.randint(0, 100, (6, 32)), torch.randint(0, 100, (6, 32))))
    assert g2.batch_symbolic and g2.traced_seq_len == 64 and g6.traced_seq_len == 32
    # Traced at (2, 64) and (6, 32), the same polynomials come out.
    assert [n.cost for n in g2.nodes] == [n.cost for n in g6.nodes]
    assert g2.flops(batch_size=8, seq_len=100) == g6.flops(batch_size=8, seq_len=100)
    # the eager attention, traced as one fused op (partitioner.tracer.attention): q @ k^T and probs @ v, B*nh*T*T*hs
    # MACs each, and the softmax's 5 FLOPs per score
    attn = next(n for n in g2.nodes if n.op == "scaled_dot_product_attention")
    assert attn.cost.forward_flops(b=3, s=50) == 2 * 3 * 4 * 50 * 50 * (64 + 64) + 5 * 3 * 4 * 50 * 50
    assert g2.forward_flops(batch_size=1) == g2.forward_flops(batch_size=1, seq_len=64)


def test_a_model_traced_at_its_full_context_is_captured_once_at_half_the_sequence(monkeypatch):
    """gpt_small's causal mask buffer is as long as its context. Traced at that length, a capture would fix the
    sequence (the exporter proves the mask's slice is the whole buffer), so the tracer captures at half the
    length first, once, and the costs are those of a trace at half the length, reported at the user's."""
    import partitioner.tracer.trace as trace_mod
    lengths = []
    real = trace_mod.capture

    def counted(model, args, kwargs, **kw):
        lengths.append(int(args[0].shape[1]))
        return real(model, args, kwargs, **kw)

    model = gpt_mod.gpt_small()
    full = model.config.block_size
    monkeypatch.setattr(trace_mod, "capture", counted)
    g = trace(model, gpt_mod.example_batch(model, 2))
    assert lengths == [full // 2] and g.traced_seq_len == full and g.batch_symbolic
    half = trace(model, (torch.zeros(2, full // 2, dtype=torch.long),) * 2)
    assert [n.cost for n in g.nodes] == [n.cost for n in half.nodes]


def test_a_shorter_capture_is_refused_where_its_graph_does_not_hold_at_the_users_length():
    """A forward that takes another path past half its context: the capture at half the length holds only up
    to there (torch.export's range for the sequence), so the tracer keeps the capture at the user's length."""
    class Branchy(nn.Module):
        def __init__(self, context: int = 16):
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.register_buffer("mask", torch.tril(torch.ones(context, context)))
            self.fc = nn.Linear(8, 8)

        def forward(self, idx):
            x = self.emb(idx)
            t = idx.shape[1]
            if t > self.mask.shape[0] // 2:
                x = torch.tanh(x)
            return self.fc(self.mask[:t, :t] @ x)

    g = trace(Branchy(), (torch.zeros(2, 16, dtype=torch.long),))
    assert any(n.op == "tanh" for n in g.nodes) and g.traced_seq_len == 16
    short = trace(Branchy(), (torch.zeros(2, 8, dtype=torch.long),))
    assert not any(n.op == "tanh" for n in short.nodes)


def test_a_batch_of_one_still_traces_symbolically():
    model = gpt_mod.gpt_tiny()
    g = trace(model, gpt_mod.example_batch(model, 1))
    assert g.batch_symbolic and g.traced_batch_size == 2
    assert g.flops(batch_size=4) > g.flops(batch_size=2)


def test_hard_coded_batch_is_reported_when_asked_for_another():
    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc(x.view(8, 16))

    g = trace(Fixed(), (torch.randn(8, 16),))
    assert not g.batch_symbolic
    assert g.forward_flops(batch_size=8) == 2 * 8 * 16 * 4 + 8 * 4
    with pytest.raises(TraceError, match="batch_size=4.*fixed its batch size to 8"):
        g.forward_flops(batch_size=4)


def test_activation_bytes_count_a_viewed_tensor_once():
    model = gpt_mod.gpt_tiny()
    g = trace(model, gpt_mod.example_batch(model, 2))
    qkv = next(n for n in g.nodes if n.module_path.endswith("h.0.attn.c_attn"))
    # q, k and v are views of the fused projection: q @ k^T and att @ v keep all of it, counted here once.
    assert qkv.cost.activation_bytes(b=2, s=128) == 2 * 128 * 3 * 128 * 4
    assert all(n.cost.activation_bytes(b=2, s=128) == 0 for n in g.nodes if n.op in ("view", "transpose", "split"))


# ---------------------------------------------------------------- repeated blocks


@pytest.mark.parametrize("name", ["gpt_small", "hf_gpt2", "hf_llama", "cnn"])
def test_copied_blocks_equal_a_full_trace(name):
    torch.manual_seed(0)
    if name.startswith("hf_"):
        model = hf_gpt2() if name == "hf_gpt2" else hf_llama()
        tokens = torch.randint(0, 1000, (2, 32))
        fast, full = hf_trace(model, tokens), hf_trace(model, tokens, expand_repeated=False)
    else:
        mod = gpt_mod if name.startswith("gpt") else cnn_mod
        model = getattr(mod, name)()
        ins = gpt_mod.example_batch(model, 2) if mod is gpt_mod else mod.example_inputs(model)
        fast, full = trace(model, ins), trace(model, ins, expand_repeated=False)
    assert fast.expanded_from == 3 and full.expanded_from is None
    same_graph(fast, full)


def test_blocks_partition_the_stack():
    model = gpt_mod.gpt_small()
    g = trace(model, gpt_mod.example_batch(model, 2))
    assert [b.name for b in g.blocks] == [f"transformer.h.{i}" for i in range(4)]
    per_block = 12 * 256**2 + 13 * 256
    assert all(b.param_count == per_block for b in g.blocks)
    for b in g.blocks:
        assert all(n.block == b.index for n in g.block_nodes(b.index))
    labels = [label for label, _ in g.segments()]
    assert labels == ["prefix", *[b.name for b in g.blocks], "suffix"]


def test_trace_leaves_the_users_module_alone():
    model = gpt_mod.gpt_small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [n for n, _ in model.named_modules()]
    trace(model, gpt_mod.example_batch(model, 2))
    assert len(model.transformer.h) == 4 and [n for n, _ in model.named_modules()] == modules
    assert model.lm_head.weight is model.transformer.wte.weight
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("layers", [4, 6])
def test_trace_leaves_the_models_output_capture_as_it_was(layers):
    """transformers 5 installs its output-capturing hooks on the first forward that records (here the router
    logits a MoE model's load-balancing loss reads), and marks the model hooked. The tracer's forwards on shallow
    copies of the blocks put those hooks on the user's blocks and the mark on a copy, so the next forward put them
    on again: the traced graph returned some layers' router logits twice (7 for 4 layers), and so did the user's own
    model afterwards (9 for 6 layers), its load-balancing loss computed over them."""
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32, use_cache=False,
                                     output_router_logits=True)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    torch.manual_seed(0)
    fresh = transformers.MixtralForCausalLM(cfg)
    x = torch.randint(0, 128, (2, 8))
    g = trace(model, (x,))
    router_logits = g.graph_module.call_spec.out_spec.child(2)  # (aux_loss, logits, router_logits)
    assert router_logits.num_leaves == layers
    out, ref = model(x), fresh(x)
    assert len(out.router_logits) == len(ref.router_logits) == layers
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=0, atol=0)
    hooks = [(n, len(m._forward_hooks)) for n, m in model.named_modules()]
    assert hooks == [(n, len(m._forward_hooks)) for n, m in fresh.named_modules()]


def test_gpt3_175b_on_meta_traces_without_allocating_parameters():
    with torch.device("meta"):
        model = gpt_mod.gpt3_175b()
    tokens = torch.empty(1, 2048, dtype=torch.long, device="meta")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    g = trace(model, (tokens, tokens))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown_kib < 1024 * 1024  # peak grew by < 1 GiB; fp32 parameters alone would be 700 GB
    assert all(p.is_meta for p in model.parameters())
    assert g.num_params == unique_params(model) == 174_615_846_912
    assert len(g.blocks) == 96 and g.expanded_from == 3
    assert g.flops(batch_size=1536) == pytest.approx(megatron_flops(1536, 2048, 96, 12288, 51200), rel=0.02)


# ---------------------------------------------------------------- stacks of several kinds


class WindowAttention(nn.Module):
    """Causal self-attention; with `window` set, each position sees only the last `window` positions."""

    def __init__(self, d: int, window: int | None):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.window = window
        self._sharper = False  # a private attribute: not recorded (see test_a_difference_no_read_shows...)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # (B, T, C) each
        att = q @ k.transpose(-2, -1) / C**0.5  # (B, T, T)
        if self._sharper:
            att = att * 2.0
        i = torch.arange(T, device=x.device)
        keep = i[None, :] <= i[:, None]
        if self.window is not None:
            keep = keep & (i[:, None] - i[None, :] < self.window)
        return self.proj(att.masked_fill(~keep, float("-inf")).softmax(-1) @ v)


class Mixture(nn.Module):
    """A dense mixture of `n` experts (every expert runs, weighted by the router)."""

    def __init__(self, d: int, n: int):
        super().__init__()
        self.router = nn.Linear(d, n)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        w = self.router(x).softmax(-1)  # (B, T, n)
        return sum(w[..., e : e + 1] * f(x) for e, f in enumerate(self.experts))


class Layer(nn.Module):
    """One class for every layer: `window` (read by the attention) and `experts` (a different MLP)
    change what it computes; `tag` is set per layer and never read, like HF's layer_idx without a cache."""

    def __init__(self, d: int, window: int | None, experts: int, tag: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = WindowAttention(d, window)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) if not experts \
            else Mixture(d, experts)
        self.tag = tag

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)


class Stack(nn.Module):
    def __init__(self, windows: list[int | None], experts: list[int], d: int = 32, vocab: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, w, e, tag=i) for i, (w, e) in enumerate(zip(windows, experts)))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


STACKS = {  # name: (windows, experts, kinds, blocks traced by the fast trace; None: every block)
    "uniform, tag never read": ([None] * 5, [0] * 5, (0,) * 5, 3),
    "alternating windows": ([4, None] * 5, [0] * 10, (0, 1) * 5, 6),
    "dense head": ([None] * 6, [0] + [2] * 5, (0,) + (1,) * 5, 4),
    "dense head, alternating": ([None] + [4, None] * 5, [0] + [2] * 10, (0,) + (1, 2) * 5, 7),
    "window on the last block": ([None] * 5 + [4], [0] * 6, (0,) * 5 + (1,), None),
    "windows not a whole period": ([4, None] * 3 + [4], [0] * 7, (0, 1) * 3 + (0,), None),
}


@pytest.mark.parametrize("name", list(STACKS))
def test_stacks_of_several_kinds_copy_like_a_full_trace(name):
    """Periodic kinds are traced for three periods after the head and copied; the copy equals a full trace
    node by node, kinds included. Kinds that do not repeat (a window on the last block only) are traced whole."""
    windows, experts, kinds, traced = STACKS[name]
    torch.manual_seed(0)
    model = Stack(windows, experts)
    tokens = torch.randint(0, 64, (2, 8))
    fast, full = trace(model, (tokens,)), trace(model, (tokens,), expand_repeated=False)
    assert fast.expanded_from == traced and full.expanded_from is None
    assert tuple(b.kind for b in fast.blocks) == tuple(b.kind for b in full.blocks) == kinds
    same_graph(fast, full)
    if traced:  # copies are named after their block
        assert any(n.name.endswith(f"__{len(windows) - 1}") and n.block == len(windows) - 1 for n in fast.nodes)


def test_a_difference_no_read_shows_is_caught_by_comparing_super_blocks():
    """Block 4 differs only through a private attribute, which recording does not note: the kinds look
    periodic (0 1 0 1 ...), but super-block 2 (blocks 4, 5) computes another graph than super-block 1, so
    nothing is copied; the full trace finds block 4's kind from its graph."""
    torch.manual_seed(0)
    model = Stack([4, None] * 5, [0] * 10)
    model.layers[4].attn._sharper = True
    tokens = torch.randint(0, 64, (2, 8))
    fast, full = trace(model, (tokens,)), trace(model, (tokens,), expand_repeated=False)
    assert fast.expanded_from is None
    assert tuple(b.kind for b in fast.blocks) == (0, 1, 0, 1, 2, 1, 0, 1, 0, 1)
    same_graph(fast, full)


@pytest.mark.parametrize("kinds,repeat", [
    ((0, 0, 0, 0), (0, 1)),
    ((0, 0, 0), None),  # as many blocks as a trace of three
    ((0, 1) * 4, (0, 2)),
    ((0,) + (1,) * 4, (1, 1)),
    ((0,) + (1, 2) * 4, (1, 2)),
    ((0, 1) * 3 + (0,), None),  # 7 blocks: a head of one and three periods of two trace all of them
    ((0, 1) * 5 + (0,), (1, 2)),
    ((0,) * 6 + (1,), None),
    ((0, 1, 2) * 4, (0, 3)),
])
def test_find_repeat_traces_the_fewest_blocks(kinds, repeat):
    from partitioner.tracer.block_kinds import find_repeat

    found = find_repeat(kinds)
    assert (found.offset, found.period) == repeat if repeat else found is None


# ---------------------------------------------------------------- errors and printing


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor value: neither export nor fx can capture it
            return self.fc(x)
        return x


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = DataDependent()

    def forward(self, x):
        return self.inner(x) * 2


def test_untraceable_model_names_module_line_and_what_to_try():
    with pytest.raises(TraceError) as info:
        trace(Wrapper(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, PartitionerError)
    assert "inner (DataDependent)" in msg
    assert "test_trace.py" in msg and "if x.sum() > 0" in msg
    assert "example_kwargs" in msg and "method=" in msg and "leaf_modules" in msg


@pytest.mark.parametrize("args,match", [
    ((nn.Linear, (torch.randn(2, 2),)), "expected a torch.nn.Module"),
    ((nn.Linear(2, 2), [[1, 2]].__iter__()), "expected a tuple of inputs"),
    ((nn.Linear(2, 2), ()), "example_inputs: empty"),
])
def test_bad_arguments_are_refused_with_the_fix(args, match):
    with pytest.raises(TraceError, match=match):
        trace(*args)


def test_bad_method_is_refused():
    with pytest.raises(TraceError, match="method='jit'"):
        trace(nn.Linear(2, 2), (torch.randn(2, 2),), method="jit")


def test_table_prints_blocks_and_totals():
    model = gpt_mod.gpt_tiny()
    g = trace(model, gpt_mod.example_batch(model, 2))
    text = str(g)
    assert "prefix" in text and "transformer.h.1" in text and "suffix" in text and "total" in text
    assert f"{g.num_params:,} parameters" in text
    per_node = g.table(batch_size=4, per="node")
    assert len(per_node.splitlines()) == len(g.nodes) + 3 and "linear" in per_node


def test_cli_trace_prints_the_table_and_exits_cleanly():
    root = Path(__file__).resolve().parent.parent  # the example's path is the repository's, wherever pytest runs
    ok = subprocess.run([sys.executable, "-m", "partitioner", "trace", "examples/gpt.py:gpt_tiny"],
                        capture_output=True, text=True, timeout=300, cwd=root)
    assert ok.returncode == 0, ok.stderr
    assert "transformer.h.0" in ok.stdout and "traced in" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "partitioner", "trace", "examples/gpt.py:nope"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert bad.returncode == 2 and "has no 'nope'" in bad.stderr and "Traceback" not in bad.stderr


def test_a_model_traced_in_eval_mode_with_dropout_is_warned():
    """Export fixes the mode: a model in eval mode (as from_pretrained returns it) is traced with its dropout off,
    and code cut from the trace never drops out, where a training loop calling model.train() does. Warned, naming
    the rate; a model in training mode, or in eval mode without dropout, is not."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    model, x = transformers.GPT2LMHeadModel(cfg).eval(), torch.randint(0, 128, (2, 8))
    with pytest.warns(UserWarning, match=r"eval mode .* its dropout \(p = 0\.1\) was traced off.*model\.train\(\)"):
        trace(model, (x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace(model.train(), (x,))
        trace(transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**cfg.to_dict(), "resid_pdrop": 0.0,
                                                                      "embd_pdrop": 0.0, "attn_pdrop": 0.0})).eval(),
              (x,))


def test_einsum_is_costed_as_the_products_its_equation_names():
    """2 FLOPs per combination of the indices (an attention written with einsums costs what its bmm would), with no
    'no cost rule' warning; backward twice that where both operands need a gradient."""

    class EinsumAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(16, 16)

        def forward(self, x):  # x (b, s, 16): scores over 2 heads of 8, then the weighted values
            q = self.q(x).view(*x.shape[:2], 2, 8)
            scores = torch.einsum("bqhd,bkhd->bhqk", q, q)
            return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), q)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = trace(EinsumAttention(), (torch.randn(2, 6, 16),))
    einsums = [n for n in g.nodes if n.op == "einsum"]
    assert len(einsums) == 2
    for n in einsums:  # b s s h d at b=2, s=6: 2 x 2*6*6*2*8
        assert n.cost.op_class == "matmul"
        assert n.cost.forward_flops(2) == 2 * 2 * 6 * 6 * 2 * 8
        assert n.cost.backward_flops(2) == 2 * n.cost.forward_flops(2)


def test_softplus_is_costed_as_an_elementwise_op():
    """A router's softplus scores (DeepSeek-V4's sqrt-softplus): 4 FLOPs an element, no 'no cost rule' warning."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Softplus())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = trace(model, (torch.randn(2, 8),))
    softplus = next(n for n in g.nodes if n.op == "softplus")
    assert softplus.cost.forward_flops(2) == 4 * 2 * 4
