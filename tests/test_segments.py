"""The model as code: prefix, block template and suffix cut from the exported graph, and rewritten for tp."""

from __future__ import annotations

import re

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from examples.training import gpt_4l_seeded, hf_gpt2_4l_seeded
from partitioner import compile, trace
from partitioner.planner.plan import Plan
from partitioner.codegen.segments import SegmentError, extract
from partitioner.planner.tensor_split import find_splits

HEADER = ("import torch\nfrom torch import device\nfrom runtime.pipeline.attention import shape_mask_attention\n"
          "inf, nan = float('inf'), float('nan')\n")


def _code(model, tp=1, rewrite_attention=True):
    g = trace(model, (torch.randint(0, 100, (2, 16)),), rewrite_attention=rewrite_attention)
    return extract(g.graph_module, g, splits=find_splits(g), tp=tp)


@pytest.mark.parametrize("model_fn", [gpt_4l_seeded, hf_gpt2_4l_seeded], ids=["gpt", "hf-gpt2"])
def test_prefix_blocks_suffix_compute_the_model_exactly(model_fn):
    """The cut copies the traced ops, so bitwise; as traced (a fused attention rounds differently from the
    module's eager one: tests/test_attention_rewrite.py compares those to fp32 tolerance)."""
    model = model_fn()
    code = _code(model, rewrite_attention=False)
    ns: dict = {}
    exec(HEADER + code.prefix.source + code.block.source + code.suffix.source, ns)

    def args(seg, i=None):
        get = lambda kind, n: getattr(model, kind)(n.format(i=i))
        return {a: get("get_parameter", n) for a, n in seg.params} | {a: get("get_buffer", n) for a, n in seg.buffers}

    x = torch.randint(0, 500, (3, 11))  # neither the traced batch nor the traced sequence length
    h = ns["prefix"](None, x, **args(code.prefix))
    for i in range(code.num_blocks):
        h = ns["block"](None, h, **args(code.block, i))
    out = pytree.tree_unflatten(list(ns["suffix"](None, h, **args(code.suffix))), pytree.treespec_loads(code.output_spec))
    want = model(x)
    assert type(out) is type(want)
    assert torch.equal(out[0], want[0])


def test_block_template_names_its_parameters_relative_to_the_block():
    code = _code(gpt_4l_seeded())
    assert code.stack == "transformer.h" and code.num_blocks == 4
    assert ("attn_c_attn_weight", "transformer.h.{i}.attn.c_attn.weight") in code.block.params
    assert code.block_params(3)[0] == "transformer.h.3.ln_1.weight"
    assert "transformer_h_1" not in code.block.source  # the template, not block 1
    # sizes the blocks need are read from their own input, never from the model's input
    assert code.block.inputs == ("x",) and "sym_size.int(x, 0)" in code.block.source


def test_tensor_parallel_rewrite_splits_heads_and_inserts_f_and_g():
    src = _code(gpt_4l_seeded(), tp=2).block.source
    assert src.count("tp_copy(") == 2 and src.count("tp_reduce(") == 2  # one f and one g per region
    assert "[sym_size_int, sym_size_int_1, 2, 16]" in src  # 4 heads of 16 -> 2 per rank
    assert "split.Tensor(linear_4, 32, 2)" in src  # the fused qkv: 3 x 64 features -> 3 x 32
    assert "[sym_size_int, sym_size_int_1, 32]" in src  # the attention output before the row-parallel proj
    hf = _code(hf_gpt2_4l_seeded(), tp=2).block.source
    assert "[sym_size_int, sym_size_int_1, 96]" in hf and "addmm" in hf  # Conv1D's 192 outputs -> 96


class _ReadsInput(nn.Module):
    """Every block reads the token ids again: no stage boundary can carry that."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList(_Gate() for _ in range(4))

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h, ids)
        return h.sum(-1)


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h, ids):
        return self.lin(h) * (ids > 3).unsqueeze(-1)


def test_blocks_may_read_model_inputs_which_every_stage_has():
    m = _ReadsInput()
    ids = torch.randint(0, 32, (3, 7))
    g = trace(m, (torch.randint(0, 32, (2, 5)),))
    code = extract(g.graph_module, g)
    assert code.block.model_inputs == ("ids",) and re.search(r"def block\(tp, x, .*input_ids", code.block.source)
    ns: dict = {}
    exec(HEADER + code.prefix.source + code.block.source + code.suffix.source, ns)
    h = ns["prefix"](None, ids, emb_weight=m.emb.weight)
    for i in range(4):
        h = ns["block"](None, h, input_ids=ids, lin_weight=m.blocks[i].lin.weight, lin_bias=m.blocks[i].lin.bias)
    assert torch.equal(ns["suffix"](None, h)[0], m(ids))


class _TwoOut(nn.Module):
    """Each block hands on two tensors of one shape: no cut can tell which is which."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(_TwoOutBlock() for _ in range(4))

    def forward(self, x):
        a = b = self.inp(x)  # (a value made from the input alone would be computed again by each reader)
        for blk in self.blocks:
            a, b = blk(a, b)
        return a + b


class _TwoOutBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, a, b):
        return self.lin(a) + b, a


def test_blocks_handing_on_two_tensors_of_one_shape_are_refused_by_name():
    """Values besides the hidden state may cross the cuts (segment_carry, tests/test_carry.py), but two of one dtype
    and shape cannot be told apart: refused, naming them."""
    g = trace(_TwoOut(), (torch.randn(2, 4),))
    with pytest.raises(SegmentError, match=r"add\w* and add\w* cross the cut after block \d of blocks as values of one "
                                           r"dtype and shape .*two residual streams"):
        extract(g.graph_module, g)


def test_a_model_that_returns_its_blocks_hidden_states_is_refused_saying_so():
    """A Hugging Face model whose config sets output_hidden_states returns each block's input as an output: the
    refusal says so, and how to train it, rather than naming a traced value alone."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                   use_cache=False, output_hidden_states=True)
    g = trace(transformers.LlamaForCausalLM(cfg), (torch.randint(0, 128, (2, 8)),))
    with pytest.raises(SegmentError, match=r"returned by the model itself: it returns a value from inside every block.*"
                                           r"output_hidden_states or output_attentions does; set them False"):
        extract(g.graph_module, g)


class _Residual(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _RootStack(nn.Module):
    """Residual blocks from the input on, a head after them: nothing before the blocks."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Residual() for _ in range(4))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def root_stack_seeded() -> _RootStack:
    torch.manual_seed(0)
    return _RootStack()


def sequential_stack_seeded() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(_Residual() for _ in range(4)))


@pytest.mark.parametrize("model_fn", [root_stack_seeded, sequential_stack_seeded], ids=["modulelist", "sequential"])
def test_blocks_that_start_at_the_input_are_handed_it_by_an_empty_prefix(model_fn):
    """A first toy model: residual blocks from the input on (a ModuleList, or an nn.Sequential of blocks at the
    root). Nothing runs before the blocks, so there was nothing to hand on, and every tp and pp plan was
    refused ("the prefix hands 0 values"): the prefix hands on the input the first block reads."""
    x = torch.randn(4, 32)
    g = trace(model_fn(), (x,))
    code = extract(g.graph_module, g)
    assert code.prefix.params == () and len(code.prefix.source.splitlines()) <= 3  # returns its input
    for pp, tp in ((2, 1), (1, 2), (2, 2), (4, 1)):
        plan = compile(g, f"local:{pp * tp}", global_batch_size=4, microbatch_size=4, precision="fp32", dp=1,
                       pp=pp, tp=tp)
        plan.verify(model_fn, (x,))


@pytest.mark.slow
def test_blocks_that_start_at_the_input_train_like_one_process():
    from examples.training import sgd
    from ranks import assert_plan_trains_like_one_process

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 32, generator=g), torch.randn(8, 10, generator=g)) for _ in range(2)]
    plan = compile(trace(root_stack_seeded(), (data[0][0][:2],)), "local:2", global_batch_size=8,
                   microbatch_size=2, precision="fp32", dp=1, pp=2, tp=1)
    assert_plan_trains_like_one_process(plan, root_stack_seeded, sgd, torch.nn.functional.mse_loss, data)


class _MaskedNormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(16, 16), nn.BatchNorm1d(16)

    def forward(self, x, keep):
        return x + torch.relu(self.bn(self.lin(x))) * keep


class _MaskedNormNet(nn.Module):
    """Batch norm in every block, and a mask made from an input that every block reads."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(8, 16), nn.Linear(16, 3)
        self.layers = nn.ModuleList(_MaskedNormBlock() for _ in range(4))

    def forward(self, x, valid):
        keep = (valid > 0).to(x.dtype).unsqueeze(-1)
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x, keep)
        return self.head(x)


def masked_norm_seeded() -> _MaskedNormNet:
    torch.manual_seed(0)
    return _MaskedNormNet()


def test_a_value_made_from_inputs_is_recomputed_though_the_model_writes_a_buffer_elsewhere():
    """The mask is made from an input alone, so every stage computes it again and only the hidden state crosses a
    cut. Batch norm's num_batches_tracked += 1 writes a buffer in place; that write took the rule away from every
    value of the graph, and the plans were refused ("the prefix hands 2 values"). Only what is made from a
    written tensor is kept from being recomputed now."""
    inputs = (torch.randn(4, 8), torch.tensor([1, 0, 2, 0]))
    g = trace(masked_norm_seeded(), inputs)
    for pp, tp in ((2, 1), (1, 2)):
        plan = compile(g, f"local:{pp * tp}", global_batch_size=4, microbatch_size=4, precision="fp32", dp=1,
                       pp=pp, tp=tp)
        plan.verify(masked_norm_seeded, inputs)


def test_plans_carry_code_only_when_they_need_it_and_round_trip():
    m = gpt_4l_seeded()
    g = trace(m, (torch.randint(0, 100, (2, 16)),))
    eager = trace(m, (torch.randint(0, 100, (2, 16)),), rewrite_attention=False)
    dp = compile(eager, "local:2", global_batch_size=8, precision="fp32", dp=2, tp=1, pp=1, rewrite_attention=False)
    assert dp.code is None  # a data-parallel program runs the module itself
    # ... unless the module's eager attention was rewritten to the fused kernel the plan is costed with
    fused = compile(g, "local:2", global_batch_size=8, precision="fp32", dp=2, tp=1, pp=1)
    assert fused.code is not None and fused.code.tp == 1
    plan = compile(g, "local:8", global_batch_size=8, precision="fp32", pp=2, dp=2, tp=2, zero_stage=1,
                   microbatch_size=2)
    assert plan.code is not None and plan.code.tp == 2
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.program(5).source == plan.program(5).source


def test_each_rank_program_holds_only_its_stage_and_shard():
    m = gpt_4l_seeded()
    g = trace(m, (torch.randint(0, 100, (2, 16)),))
    plan = compile(g, "local:8", global_batch_size=8, precision="fp32", pp=2, dp=2, tp=2, zero_stage=1,
                   microbatch_size=2, schedule="1f1b")
    for m_ in plan.mesh:
        src = plan.program(m_.rank).source
        first = m_.pp == 0
        assert ("0: (0, 2, True, False),  # prefix, blocks 0..1" in src) == first
        assert ("1: (2, 4, False, True),  # blocks 2..3, suffix" in src) == (not first)
        assert ("'transformer.h.0.attn.c_attn.weight': ('S(0)', 3),  # column" in src) == first
        assert ("'transformer.h.3.mlp.c_proj.weight': ('S(1)', 1),  # row" in src) == (not first)
        assert f"TPContext(groups.tp, collectives, {m_.tp}, 2)" in src
        assert "TIED = ('transformer.wte.weight',)" in src  # embedding on stage 0, LM head on stage 1


def test_an_in_model_loss_gets_the_vocab_parallel_cross_entropy_on_local_logits():
    m = gpt_4l_seeded()
    g = trace(m, (torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))))
    code = extract(g.graph_module, g, splits=find_splits(g), tp=2)
    assert "tp_vocab_embedding(transformer_wte_weight, idx, tp, -1)" in code.prefix.source
    src = code.suffix.source
    assert "view.default(linear_12, [-1, 256])" in src  # this rank's half of the 512 classes
    assert "tp_cross_entropy(view_12, view_13, -1, tp)" in src  # the loss from local logits
    # the returned logits stay split: the loss_fn reads them as the full logits (runtime.pipeline.vocab_logits)
    assert "tp_vocab_logits(linear_12, tp)" in src and "tp_gather" not in src


class _RunningScaleBlock(nn.Module):
    """A running statistic of its own output, updated under torch.no_grad() in training: export puts the update in
    a nested no_grad graph that returns nothing, which stage code dropped (the buffer never changed)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("scale", torch.ones(d))

    def forward(self, x):
        y = self.lin(x) * self.scale.clone()
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.9).add_(0.1 * y.abs().mean(dim=(0, 1)))
        return x + torch.tanh(y)


class _RunningScaleNet(nn.Module):
    def __init__(self, d: int = 16, vocab: int = 32):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(_RunningScaleBlock(d) for _ in range(4))

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def running_scale_seeded() -> _RunningScaleNet:
    torch.manual_seed(0)
    return _RunningScaleNet()


def _token_loss(out, y):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


@pytest.mark.slow
@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2)])
def test_a_buffer_written_under_no_grad_is_written_by_stage_code(pp, tp):
    from examples.training import sgd, train_one_process
    from ranks import assert_plan_trains_like_one_process

    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 32, (8, 8), generator=g), torch.randint(0, 32, (8, 8), generator=g)) for _ in range(2)]
    plan = compile(trace(running_scale_seeded(), (data[0][0][:2],)), f"local:{pp * tp}", global_batch_size=8,
                   microbatch_size=8, precision="fp32", dp=1, pp=pp, tp=tp)
    out = assert_plan_trains_like_one_process(plan, running_scale_seeded, sgd, _token_loss, data)
    ref = train_one_process(running_scale_seeded, sgd, _token_loss, data).model.state_dict()
    for i in range(4):
        key = f"blocks.{i}.scale"
        assert not torch.equal(ref[key], torch.ones(16))
        torch.testing.assert_close(out.state_dict[key], ref[key], rtol=1e-5, atol=1e-6)


def test_a_plan_that_splits_the_batch_of_a_model_writing_buffers_says_so():
    g = trace(running_scale_seeded(), (torch.randint(0, 32, (2, 8)),))
    with pytest.warns(UserWarning, match=r"writes buffer blocks\.0\.scale.*4 microbatches.*microbatch_size=8"):
        compile(g, "local:2", global_batch_size=8, microbatch_size=2, precision="fp32", dp=1, pp=2, tp=1)


class _RoundSTE(torch.autograd.Function):
    """Quantisation to quarters with a straight-through gradient: autograd of round() would be zero."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class _QuantBlock(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(_RoundSTE.apply(self.lin(x)))


class _QuantNet(_RunningScaleNet):
    def __init__(self, d: int = 16, vocab: int = 32):
        super().__init__(d, vocab)
        self.blocks = nn.ModuleList(_QuantBlock(d) for _ in range(4))


def quant_seeded() -> _QuantNet:
    torch.manual_seed(0)
    return _QuantNet()


def test_a_custom_autograd_function_keeps_plans_on_the_modules_own_forward():
    """torch.export keeps a Function's forward ops, not its backward: code cut from them would differentiate
    round() (gradient zero) where the model passes the gradient straight through. Pipeline, tensor and context
    plans, which run such code, are refused naming the Function; the search keeps to the module's own forward."""
    from cost_models.errors import DeclarationError

    g = trace(quant_seeded(), (torch.randint(0, 32, (2, 8)),))
    assert len(g.custom_functions) == 1 and "_RoundSTE" in g.custom_functions[0]
    for pins in (dict(pp=2), dict(tp=2), dict(cp=2)):
        with pytest.raises(DeclarationError, match=r"applies test_segments\._RoundSTE .*own backward"):
            compile(g, "local:2", global_batch_size=2, microbatch_size=1, precision="fp32", **pins)
    plan = compile(g, "local:2", global_batch_size=2, microbatch_size=1, precision="fp32")
    assert (plan.config.pp, plan.config.tp, plan.config.cp) == (1, 1, 1) and plan.code is None


@pytest.mark.slow
def test_a_custom_autograd_function_trains_like_one_process_under_data_parallelism():
    from examples.training import sgd
    from ranks import assert_plan_trains_like_one_process

    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 32, (8, 8), generator=g), torch.randint(0, 32, (8, 8), generator=g)) for _ in range(2)]
    plan = compile(trace(quant_seeded(), (data[0][0][:2],)), "local:2", global_batch_size=8, microbatch_size=4,
                   precision="fp32", dp=2, zero_stage=3)
    assert_plan_trains_like_one_process(plan, quant_seeded, sgd, _token_loss, data)


class _PlainBlock(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class _SharedNet(_RunningScaleNet):
    """ALBERT-like: one block's module used as every layer."""

    def __init__(self, d: int = 16, vocab: int = 32):
        super().__init__(d, vocab)
        self.blocks = nn.ModuleList([_PlainBlock(d)] * 4)


def shared_seeded() -> _SharedNet:
    torch.manual_seed(0)
    return _SharedNet()


def test_blocks_that_share_their_parameters_keep_to_plans_that_hold_them_whole():
    """Pipeline stages and ZeRO-3's per-block units failed on such a model (an attribute error blamed on the model,
    a KeyError in build): they are refused when pinned, saying why, and the search leaves them out."""
    from cost_models.errors import DeclarationError

    g = trace(shared_seeded(), (torch.randint(0, 32, (2, 8)),))
    for pins in (dict(pp=2), dict(dp=2, zero_stage=3)):
        with pytest.raises(DeclarationError, match=r"blocks blocks\.0, blocks\.1, \.\.\. share their parameters"):
            compile(g, "local:2", global_batch_size=8, microbatch_size=2, precision="fp32", **pins)
    plan = compile(g, "local:2", global_batch_size=8, microbatch_size=2, precision="fp32")
    assert plan.config.pp == 1 and plan.config.zero_stage != 3


class _LoopedNet(nn.Module):
    """Real ALBERT's layout: one layer module applied in a loop, no list of blocks for the trace to find."""

    def __init__(self, d: int = 16, vocab: int = 32):
        super().__init__()
        self.emb, self.layer, self.head = nn.Embedding(vocab, d), _PlainBlock(d), nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for _ in range(4):
            x = self.layer(x)
        return self.head(x)


def test_a_model_without_a_stack_of_blocks_is_never_pipelined():
    """Stage code cuts between blocks: a pinned pp=2 was accepted and failed when its programs were generated; it is
    refused when compiling, saying why, and the search keeps pp=1."""
    from cost_models.errors import DeclarationError

    torch.manual_seed(0)
    g = trace(_LoopedNet(), (torch.randint(0, 32, (2, 8)),))
    assert not g.blocks
    with pytest.raises(DeclarationError, match=r"pp=2: .*no stack of repeated blocks to cut into pipeline stages"):
        compile(g, "local:2", global_batch_size=8, microbatch_size=2, precision="fp32", pp=2)
    assert compile(g, "local:4", global_batch_size=8, precision="fp32").config.pp == 1
