"""Megatron sequence parallelism in the planner: what the token split covers, what it costs, what it refuses.

The runtime side (programs that train like one process) is in test_3d_equivalence.py, the memory
the ranks hold in test_memory_prediction.py, the faults plan.verify names in test_verify.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cost_models.errors import DeclarationError
from cost_models.topology import Topology
from examples.gpt import example_batch, gpt3_175b, gpt_small, gpt_tiny
from partitioner import compile, trace
from partitioner.planner.tensor_split import find_splits
from partitioner.planner.unit_costs import CostContext

S, B, H, A, T = 2048, 1, 12288, 96, 8  # GPT-3 175B at Korthikanti et al.'s tensor degree


@pytest.fixture(scope="module")
def small_graph():
    m = gpt_small()
    return trace(m, example_batch(m, 2))


def test_the_token_split_runs_from_each_row_output_to_the_next_column_input(small_graph):
    seq = find_splits(small_graph).sequence
    rows = {n.name for n in small_graph.nodes if n.op == "linear"} & {n for n, _ in seq.scatters}
    assert len(rows) == 2 * len(small_graph.blocks)  # attention and MLP output of every block
    assert {d for _, d in seq.dims} == {1}  # (b, s, h): the tokens are dim 1
    norms = [n.name for n in small_graph.nodes if n.op == "layer_norm"]
    assert set(norms) <= seq.nodes  # every layer norm, the final one included, sees 1/tp of the tokens
    assert all(kind == "tp" for *_, kind in seq.gathers)  # only column-parallel matmuls gather
    assert [str(e) for e in seq.extents] == ["s"]


def _layer_activations(*, sp: bool, rewrite_attention: bool) -> float:
    """Bytes one GPT-3 175B layer keeps per microbatch under tp 8 (bf16 mixed, no recomputation)."""
    with torch.device("meta"):
        model = gpt3_175b(n_layer=4, dropout=0.1)  # Korthikanti et al. count dropout masks
    idx = torch.empty(B, S, dtype=torch.long, device="meta")
    g = trace(model, (idx, idx), rewrite_attention=rewrite_attention)
    ctx = CostContext(g, Topology.parse("8x8xA100-80GB"), find_splits(g), precision="bf16-mixed", optimizer="adam",
                      seq_len=S, memory_cap=72e9)
    return ctx.unit_cost(2, tp=T, mb=B, recompute="none", sp=sp).activation_bytes  # a middle block


def test_layer_activations_follow_korthikanti_et_al():
    """Section 4.2.2, the traced eager attention (its s x s scores kept): s b h (10 + 24/t + 5 a s / (h t)) bytes
    per layer without sequence parallelism, s b h (34/t + 5 a s / (h t)) with it."""
    without = S * B * H * (10 + 24 / T + 5 * A * S / (H * T))
    with_sp = S * B * H * (34 / T + 5 * A * S / (H * T))
    assert _layer_activations(sp=False, rewrite_attention=False) == pytest.approx(without, rel=0.05)
    assert _layer_activations(sp=True, rewrite_attention=False) == pytest.approx(with_sp, rel=0.05)
    # a fused attention keeps O(s) per row, as the paper's selective recomputation does: s b h 34/t
    assert _layer_activations(sp=True, rewrite_attention=True) == pytest.approx(S * B * H * 34 / T, rel=0.08)


def test_gpt3_175b_at_the_published_configuration_fits():
    """Korthikanti et al. Table 3: t8 p8 on 64 A100-80GB, microbatch 1, interleaved, selective recomputation."""
    with torch.device("meta"):
        model = gpt3_175b()
    idx = torch.empty(1, S, dtype=torch.long, device="meta")
    plan = compile(model, "8x8xA100-80GB", example_inputs=(idx, idx), global_batch_size=64, tp=8, pp=8,
                   microbatch_size=1, schedule="interleaved-1f1b", recompute="selective", sp=True, alternatives=0)
    assert plan.config.sp and "sp: the ops between tensor-split regions" in str(plan)
    assert plan.predicted.peak_memory_bytes < 80e9 * 0.9
    assert "sequence parallelism in each tensor group (as declared)" in plan.explain()


def test_declarations_that_cannot_hold_are_refused():
    m = gpt_tiny()
    x = example_batch(m, 2)
    with pytest.raises(DeclarationError, match="sp=True with tp=1: .* needs tp > 1"):
        compile(m, "local:2", example_inputs=x, global_batch_size=4, tp=1, sp=True)
    with pytest.raises(DeclarationError, match="sp=.yes.: must be True"):
        compile(m, "local:2", example_inputs=x, global_batch_size=4, sp="yes")
    odd = (x[0][:, :15].contiguous(), x[1][:, :15].contiguous())  # 15 tokens do not split over 2 ranks
    with pytest.raises(DeclarationError, match="does not divide it: pick a sequence length that tp divides"):
        compile(m, "local:2", example_inputs=odd, global_batch_size=4, tp=2, sp=True)


def test_sp_false_keeps_the_all_reduces(small_graph):
    plan = compile(small_graph, "local:2", global_batch_size=4, tp=2, sp=False, precision="fp32")
    assert not plan.config.sp and plan.code.sp_dim is None
    src = plan.code.block.source
    assert "tp_reduce" in src and "sp_scatter" not in src
    assert "no sequence parallelism, as declared" in plan.explain()


def test_a_recomputed_block_keeps_its_input_once_per_stage():
    """Full recomputation keeps each block's input. What the blocks all read from before them (Llama's causal
    mask and rotary tables, made once in the prefix) is one tensor per stage: held at the stage's first
    unit (stage_start_bytes), not again in every block's checkpoint, where only the hidden state is new."""
    s, b, h = 128, 2, 64
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=h, intermediate_size=128, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=s,
                                             use_cache=False))
    g = trace(model, (torch.empty(b, s, dtype=torch.long, device="meta"),))
    ctx = CostContext(g, Topology.parse("8xA100-80GB"), find_splits(g), precision="bf16-mixed", optimizer="adam",
                      seq_len=s, memory_cap=72e9)
    first, middle = (ctx.unit_cost(u, tp=1, mb=b, recompute="full") for u in (1, 2))
    hidden = s * b * h * 2  # the block input, bf16
    assert middle.activation_bytes == hidden
    assert first.activation_bytes - hidden == middle.stage_start_bytes > b * s * s / 2  # the s x s mask among them
    assert ctx.unit_cost(2, tp=1, mb=b, recompute="none").stage_start_bytes == 0.0


def test_readers_of_one_value_share_its_gathers():
    """Llama's q, k and v projections read one normed input, its gate and up projections another: each value
    is gathered once per block forward, its gradient reduce-scattered once and gathered again once, as the
    generated code runs them (runtime.pipeline.tensor_parallel.sp_gather), not once per reader."""
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    g = trace(LlamaForCausalLM(cfg), (torch.randint(0, 128, (2, 16)),))
    ctx = CostContext(g, Topology.parse("local:2"), find_splits(g), precision="fp32", optimizer="adam", seq_len=16,
                      memory_cap=1e12)
    a, b = ctx.units[1]
    block = [n for n in g.nodes[a:b] if n.block == g.nodes[a].block]  # the last unit also holds the LM head
    colls = [c for n in block for c in ctx._sp_collectives.get(n.name, ())]
    gathers = [c for c in colls if c.phase == "forward" and c.kind == "all_gather"]
    assert len([n for n in block if n.op == "linear"]) == 7
    assert len(gathers) == 2 and len({c.what for c in gathers}) == 2  # the attention's input, the MLP's
    assert sum(c.phase == "backward" and c.kind == "reduce_scatter" for c in colls) == 2
    assert sum(c.phase == "backward" and c.kind == "all_gather" for c in colls) == 2 + 2  # re-gathers, row grads


def test_a_split_value_without_a_sequence_dim_is_refused_naming_the_microbatch():
    """A value whose dims before its features hold no sequence length (a Mamba convolution keeps its tokens last) is
    split along dim 0, the batch: where tp does not divide it the refusal asks for another microbatch size, not
    another sequence length (it used to call the batch "a token dim")."""
    from partitioner.planner.sequence_split import SequenceSplits
    from partitioner.tracer.symbolic import Poly

    tokens, batch = Poly.from_terms({(1, 1): 1.0}), Poly.from_terms({(1, 0): 1.0})  # b * s, b
    assert SequenceSplits(extents=(tokens, batch)).divides(2, 2, 16) == ""
    assert "pick a sequence length" in SequenceSplits(extents=(tokens,)).divides(2, 1, 15)
    why = SequenceSplits(extents=(tokens, batch)).divides(2, 1, 16)
    assert "hold no sequence length" in why and "dim 0, 1 (= b at microbatch 1)" in why
    assert "pick a microbatch size that tp divides" in why


class _ShiftedMLPs(torch.nn.Module):
    """Two tensor-parallel MLPs with a time shift between them (RWKV's token shift: each token mixed with the one
    before it, by a pad of one token in front and one dropped at the end), in the sequence-split region."""

    def __init__(self, vocab: int = 64, h: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, h)
        self.up1, self.down1 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)
        self.norm = torch.nn.LayerNorm(h)
        self.up2, self.down2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)
        self.head = torch.nn.Linear(h, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.down1(torch.relu(self.up1(x)))
        y = self.norm(x)
        y = y + torch.nn.functional.pad(y, (0, 0, 1, -1))  # (b, s, h): the token before, zeros for the first
        return self.head(y + self.down2(torch.relu(self.up2(y))))


def _shifted_mlps():
    torch.manual_seed(0)
    return _ShiftedMLPs()


def test_a_shift_along_the_tokens_reads_them_all():
    """The pad keeps the token dim's extent, but each token's value comes from its neighbour: on a rank's slice of
    the tokens it would take the slice's edge for the sequence's. It reads the tokens gathered, and the programs
    compute the module (they did not when the pad was taken for a token-local op)."""
    ids = torch.randint(0, 64, (2, 16))
    g = trace(_shifted_mlps(), (ids,))
    seq = find_splits(g).sequence
    pad = next(n.name for n in g.nodes if n.op in ("pad", "constant_pad_nd"))
    assert pad not in seq.nodes and any(node == pad and kind == "rep" for node, _, _, kind in seq.gathers)
    plan = compile(g, "local:2", global_batch_size=2, microbatch_size=2, precision="fp32", tp=2, sp=True)
    plan.verify(_shifted_mlps, (ids,))


def test_rwkv_writes_its_recurrence_into_split_tokens_and_computes_the_module():
    """RWKV's recurrence copies each token's state in place into a buffer of the block's tokens; the copy is a
    token-local op on split tokens (it was read gathered, so the write landed in the gathered copy and the buffer
    stayed zeros)."""
    from examples.hf_families import from_config
    from examples.training import hf_loss

    build = functools.partial(from_config, "RwkvConfig", "RwkvForCausalLM", context_length=64,
                              attention_hidden_size=64, num_hidden_layers=2)
    ids, targets = torch.randint(1, 512, (2, 16)), torch.randint(1, 512, (2, 16))
    plan = compile(trace(build(), (ids,)), "local:2", global_batch_size=2, microbatch_size=2, precision="fp32",
                   tp=2, sp=True)
    plan.verify(build, (ids,), hf_loss, targets=targets)


class _Layer(torch.nn.Module):
    def __init__(self, d: int, mean: bool):
        super().__init__()
        self.fc, self.mean = torch.nn.Linear(d, d), mean

    def forward(self, x):
        y = x + torch.tanh(self.fc(x))
        return y + y.mean(1, keepdim=True) if self.mean else y  # a mean over every token, added to each


class _NoFinalNorm(torch.nn.Module):
    """Blocks too narrow to split (their weights replicated), the LM head reading the last block's output itself,
    with no final norm between (GPT-1's post-norm blocks end so)."""

    def __init__(self, mean: bool = False, d: int = 16, vocab: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(_Layer(d, mean) for _ in range(4))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _no_final_norm(mean: bool = False):
    torch.manual_seed(0)
    return _NoFinalNorm(mean)


@pytest.mark.parametrize("mean", [False, True])
def test_values_after_the_stack_and_broadcast_over_the_tokens_compute_the_module(mean):
    """Two rules the programs missed under sp (both failed plan.verify, so a launch refused them):

    - the LM head reads the last block's output all-gathered: the splits name it by the traced graph's copy of the
      last block (`name__3`), the code by the last traced block's node; it was read through f, on this rank's
      tokens alone, so the logits held 1/tp of them;
    - a per-row mean over every token (read gathered, whole on every rank) added back to each rank's tokens: its
      gradient, made from this rank's tokens alone, is summed over the tensor group (SequenceSplits.reduces),
      where the block's weight gradients were 26 % off."""
    ids, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    g = trace(_no_final_norm(mean), (ids,))
    seq = find_splits(g).sequence
    assert bool(seq.reduces) == mean
    plan = compile(g, "local:2", global_batch_size=2, microbatch_size=2, precision="fp32", tp=2, sp=True)
    assert plan.config.sp and "sp_gather" in plan.program(0).source
    loss = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    plan.verify(functools.partial(_no_final_norm, mean), (ids,), loss, targets=targets)
