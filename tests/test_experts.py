"""Mixture-of-experts layers found in the traced dataflow (partitioner.tracer.experts): Hugging Face's batched
experts, a list of expert modules, shared experts, dense blocks among MoE ones, and what is not a MoE."""

import pytest
import torch
from torch import nn

from cost_models.errors import TraceError
from examples import hf_families
from partitioner import Plan, compile, trace
from partitioner.tracer.experts import experts_text, find_experts

TOKENS = (torch.zeros(2, 16, dtype=torch.long),)


class Expert(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.up, self.down = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Gate(nn.Module):
    """A router whose linear sits one module deeper (HunYuan's `mlp.gate.wg`)."""

    def __init__(self, h: int, e: int):
        super().__init__()
        self.wg = nn.Linear(h, e, bias=False)

    def forward(self, x):
        return self.wg(x)


class CapacityMoE(nn.Module):
    """A list of expert modules; each takes the `cap` tokens routed to it with the largest weight (static shapes)."""

    def __init__(self, h: int, widths: list[int], k: int, data_dependent: bool = False, deep_router: bool = False):
        super().__init__()
        self.k, self.data_dependent = k, data_dependent
        self.router = Gate(h, len(widths)) if deep_router else nn.Linear(h, len(widths), bias=False)
        self.experts = nn.ModuleList(Expert(h, f) for f in widths)

    def forward(self, x):
        b, s, h = x.shape
        x2 = x.reshape(-1, h)
        w, idx = self.router(x2).softmax(-1).topk(self.k, -1)
        out = torch.zeros_like(x2)
        cap = x2.shape[0] * self.k // len(self.experts)
        for i, ex in enumerate(self.experts):
            gate = (w * (idx == i)).sum(-1)
            tok = torch.where(gate > 0)[0] if self.data_dependent else gate.topk(cap).indices
            out = out.index_add(0, tok, ex(x2[tok]) * gate[tok, None])
        return out.reshape(b, s, h)


class SlotIndexer(nn.Module):
    """A sparse attention's indexer, as DeepSeek's: its heads' weights times relu(q . k) summed over the heads
    into scores over keys, then their top-k (4 learned key slots here: as many as its heads and the experts)."""

    def __init__(self, h: int, heads: int = 4, slots: int = 4, d: int = 8):
        super().__init__()
        self.heads, self.d = heads, d
        self.w, self.q = nn.Linear(h, heads, bias=False), nn.Linear(h, heads * d, bias=False)
        self.keys, self.values = nn.Parameter(torch.randn(slots, d)), nn.Parameter(torch.randn(slots, h))

    def forward(self, x):
        q = self.q(x).view(*x.shape[:-1], self.heads, self.d)
        scores = (self.w(x).unsqueeze(-1) * torch.relu(q @ self.keys.T)).sum(-2)   # (b, s, slots)
        return self.values[scores.topk(2, -1).indices].sum(-2)


class Net(nn.Module):
    """Dense and MoE blocks alternating, as mixed stacks do (moe_every=1: every block MoE)."""

    def __init__(self, widths=(32, 32, 32, 32), k=2, data_dependent=False, h=16, n=4, vocab=64, moe_every=2,
                 deep_router=False, indexer=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(h), "mlp": CapacityMoE(
            h, list(widths), k, data_dependent, deep_router) if i % moe_every == moe_every - 1 else Expert(h, 2 * h),
            **({"indexer": SlotIndexer(h)} if indexer else {})}) for i in range(n))
        self.head = nn.Linear(h, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            if "indexer" in layer:
                x = x + layer["indexer"](x)
            x = x + layer["mlp"](layer["norm"](x))
        return self.head(x)


def test_hf_batched_experts_router_and_shared_experts():
    g = trace(hf_families.deepseek_v3_seeded(), TOKENS)
    layers = find_experts(g)
    assert [m.block for m in layers] == [1, 2, 3]  # DeepSeek-V3's first layers are dense
    m = layers[0]
    assert (m.module, m.num_experts, m.top_k, m.style, m.uniform) == ("model.layers.1.mlp", 4, 2, "batched", True)
    assert m.router == "model.layers.1.mlp.gate.weight"
    assert set(m.experts) == {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}
    assert m.expert_params == sum(p.numel for p in g.params if p.name in m.experts)
    assert all(".shared_experts." in p for p in m.shared) and len(m.shared) == 3
    assert {"sort", "histc", "index"} <= set(m.dispatch)  # tokens sorted and counted by expert
    assert m.combine is not None and next(n for n in g.nodes if n.name == m.combine).op == "sum"
    assert "3 MoE layers (model.layers.1-3.mlp) of 4 experts, top-2" in str(g)
    assert "1 dense block (0)" in experts_text(g)


def test_expert_biases_are_experts_and_the_router_bias_is_the_router_s():
    g = trace(hf_families.gpt_oss_seeded(), TOKENS)
    m = find_experts(g)[0]
    assert set(m.experts) == {f"model.layers.0.mlp.experts.{n}" for n in
                              ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
    assert m.shared == ()  # the router's bias is neither an expert nor a shared expert


def test_a_list_of_expert_modules():
    g = trace(Net(), TOKENS)
    layers = find_experts(g)
    assert [(m.block, m.num_experts, m.top_k, m.style, m.uniform) for m in layers] == \
        [(1, 4, 2, "module_list", True), (3, 4, 2, "module_list", True)]
    assert layers[0].experts[:4] == tuple(f"layers.1.mlp.experts.0.{n}" for n in
                                          ("down.bias", "down.weight", "up.bias", "up.weight"))
    assert layers[0].expert_params == 4 * (16 * 32 + 32 + 32 * 16 + 16)
    assert next(n for n in g.nodes if n.name == layers[0].combine).op == "index_add"
    assert experts_text(g) == ("2 MoE layers (layers.{1, 3}.mlp) of 4 experts, top-2, a list of expert modules; "
                               "2 dense blocks (0, 2)")


def test_a_router_one_module_deeper_still_finds_its_layer():
    """The layer is the nearest module above the router's that holds the experts its choice reaches: `mlp` for
    `mlp.router.wg.weight` as for `mlp.router.weight` (HunYuan's MoE found none before)."""
    layers = find_experts(trace(Net(deep_router=True), TOKENS))
    assert [(m.module, m.router, m.num_experts, m.style) for m in layers] == [
        (f"layers.{i}.mlp", f"layers.{i}.mlp.router.wg.weight", 4, "module_list") for i in (1, 3)]
    assert layers[0].experts == find_experts(trace(Net(), TOKENS))[0].experts


def test_a_top_k_over_keys_summed_over_index_heads_is_no_router():
    """A sparse attention's indexer takes a top-k over scores that its heads' weights (a linear with as many rows
    as experts) make through a sum over the heads: no router's (DeepSeek-V4's MoE layer was found at the layer with
    the indexer's weights for its router, and the real router's weight for an expert)."""
    layers = find_experts(trace(Net(indexer=True), TOKENS))
    assert [(m.module, m.router) for m in layers] == [(f"layers.{i}.mlp", f"layers.{i}.mlp.router.weight")
                                                      for i in (1, 3)]


def test_experts_of_different_shapes_are_said():
    g = trace(Net(widths=(32, 32, 32, 48)), TOKENS)
    assert not find_experts(g)[0].uniform
    assert "experts of different shapes" in experts_text(g)


def test_dense_models_have_none():
    g = trace(hf_families.qwen3_seeded(), TOKENS)
    assert find_experts(g) == () and experts_text(g) == "" and "experts:" not in str(g)


def test_a_size_that_depends_on_the_data_is_refused_by_name():
    with pytest.raises(TraceError, match=r"in layers\.1\.mlp\): its size depends on the values of the data"):
        trace(Net(data_dependent=True), TOKENS)


def test_the_plan_says_what_it_found():
    # ep=1 pinned: the row for replicated experts (free, this tiny model takes ep2 on local:2: at ep=1 each
    # rank runs four tiny expert GEMMs per layer, each below the size that fills the device)
    plan = compile(hf_families.qwen3_moe_seeded(), "local:2", example_inputs=TOKENS, global_batch_size=4, ep=1)
    assert plan.experts.startswith("4 MoE layers (model.layers.0-3.mlp) of 4 experts, top-2")
    text = str(plan)
    assert "experts      4 MoE layers" in text and "ep=1: experts planned like every other parameter" in text
    assert Plan.from_json(plan.to_json()).experts == plan.experts


def test_experts_no_program_runs_divided_stay_whole_and_say_why():
    # a list of expert modules is found, but the code generator runs batched experts only: a pinned ep > 1 is
    # refused before anything is searched (not at program time), and the free choice keeps ep=1 and says why
    from cost_models.errors import DeclarationError

    with pytest.raises(DeclarationError, match=r"ep=2: no expert-parallel program can be generated .*a list of "
                                               r"expert modules"):
        compile(Net(), "local:2", example_inputs=TOKENS, global_batch_size=4, ep=2)
    plan = compile(Net(), "local:2", example_inputs=TOKENS, global_batch_size=4, alternatives=0)
    assert plan.config.ep == 1 and "ep=1 (no expert-parallel program can be generated" in plan.explain()
