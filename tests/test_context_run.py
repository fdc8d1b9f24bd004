"""Context-parallel plans train the same as one process (the truth test for cp > 1).

Each case compiles a plan for the example GPT with cp pinned, generates the per-rank programs (the
attention runs as `runtime.context`'s ring or Ulysses kernel over the cp group, each rank holds its tokens
of every sequence in the load-balanced layout and reads the positions of those tokens), runs them on real
Gloo processes for 3 steps, and compares each step's loss and the final parameters with one process
training on the whole batch (fp32, rtol 1e-5, SGD with momentum). The quick tests read the generated
source and the refusals.
"""

from __future__ import annotations

import functools

import pytest
import torch

from examples.hf_families import MORE_FAMILIES, bloom_seeded, from_config, gemma3_seeded, mpt_seeded, qwen3_seeded
from examples.training import gpt_4l_seeded, gpt_loss, hf_llama_seeded, hf_loss, sgd, train_one_process
from partitioner import compile, trace
from partitioner.planner.context_split import LONG_SEQUENCE
from cost_models.errors import DeclarationError
from ranks import assert_plan_trains_like_one_process, assert_trains_like

VOCAB, SEQ, BATCH, STEPS = 512, 16, 8, 3
MODELS = {"gpt": (gpt_4l_seeded, gpt_loss), "llama": (hf_llama_seeded, hf_loss), "qwen3": (qwen3_seeded, hf_loss),
          "gemma3": (gemma3_seeded, hf_loss), "mpt": (mpt_seeded, hf_loss), "bloom": (bloom_seeded, hf_loss)}


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


@functools.cache
def traced(name: str):
    """The model traced once per session (an OpGraph is frozen data; compiling one is compiling the model)."""
    return trace(MODELS[name][0](), (torch.randint(0, VOCAB, (2, SEQ)),))


def plan_for(*, dp: int = 1, cp: int = 2, cp_kind: str = "ring", zero: int = 0, tp: int = 1, pp: int = 1,
             mb: int = 2, sp: bool = False, name: str = "gpt", recompute: str = "none", precision: str = "fp32"):
    return compile(traced(name), f"local:{dp * cp * tp * pp}", global_batch_size=BATCH, precision=precision,
                   dp=dp, cp=cp, cp_kind=cp_kind if cp > 1 else None, tp=tp, pp=pp, sp=sp if tp > 1 else None,
                   zero_stage=zero, microbatch_size=mb, recompute=recompute, alternatives=0)


def test_the_program_splits_tokens_and_runs_attention_over_the_context_group():
    plan = plan_for(dp=2, cp=2)
    src = plan.program(3).source  # dp 1, cp 1
    assert "grid(pp=1, dp=2, tp=1, cp=2)" in src
    assert "cp = CPContext(groups.cp, collectives, rank=1, world=2, kind='ring')" in src
    assert "cp_rank=1, cp_size=2" in src and "dp_rank=1, dp_size=2" in src
    assert "chunks 1 and 2 of 4" in src
    assert "def block(tp, cp, x," in src and "cp_attention(" in src
    assert "scaled_dot_product_attention" not in src.split("def block", 1)[1].split("def suffix", 1)[0]
    # the position embedding reads this rank's positions of an arange over the whole length
    assert 'arange: "i64[idx.1*2]"' in src and 'arange_here: "i64[idx.1]" = cp_positions(arange, 0, cp)' in src
    assert "Data parallelism over dp 2 x cp 2 ranks (replicas and their context slices) (0, 1, 2, 3) (this rank is 3 of 4)" in src


def test_sequence_parallelism_splits_each_ranks_tokens_again():
    src = plan_for(cp=2, tp=2, sp=True).program(1).source
    assert "cp = CPContext(groups.cp" in src and "cp_attention(" in src and "sp_gather(" in src
    # the position embedding: this rank's cp positions of the whole length, then its tensor slice of them
    assert "cp_positions(arange, 0, cp)" in src and "tp_chunk(" in src


def test_a_model_that_mixes_tokens_outside_attention_is_refused():
    model = gpt_4l_seeded()
    with pytest.raises(DeclarationError, match="cp=2: no context-parallel program can be generated .*eager attention"):
        compile(model, "local:2", example_inputs=(torch.randint(0, VOCAB, (2, SEQ)),), global_batch_size=BATCH,
                precision="fp32", dp=1, cp=2, rewrite_attention=False, alternatives=0)


class _Pooled(torch.nn.Module):
    """Token embeddings, a running mean along the tokens (cumsum over dim 1), a head: mixes tokens without
    attention."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)                                       # (B, T, 16)
        return self.head(x.cumsum(1) / idx.shape[1])            # (B, T, V)


def test_a_model_that_scans_along_the_tokens_is_refused():
    with pytest.raises(DeclarationError, match="a cumsum along the token dim; each rank holds only its tokens"):
        compile(_Pooled(), "local:2", example_inputs=(torch.randint(0, VOCAB, (2, SEQ)),),
                global_batch_size=BATCH, precision="fp32", dp=1, cp=2, alternatives=0)


def test_a_model_that_shifts_its_labels_along_the_tokens_is_refused():
    """A Hugging Face causal LM called with labels computes its own loss, its targets the labels shifted by one
    token (pad by one, drop the first). On a rank's tokens (chunks r and 2cp-1-r) the last token of a chunk then
    took the first label of the other chunk, or none, where one process has the next chunk's: a few tokens a
    sequence trained on wrong targets, silently. The shift is refused like any op along the tokens."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   use_cache=False)
    x = torch.randint(0, VOCAB, (2, SEQ))
    g = trace(transformers.LlamaForCausalLM(cfg), (), dict(input_ids=x, labels=x))
    with pytest.raises(DeclarationError,
                       match=r"a pad along the token dim \(a shift of the tokens\).*compile with cp=1"):
        compile(g, "local:2", global_batch_size=BATCH, precision="fp32", dp=1, cp=2, alternatives=0)


def _bert_classifier(positions: int = 64):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, max_position_embeddings=positions, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def test_a_classifier_pooling_one_token_is_refused_when_compiling():
    """A sequence classifier reads one token's hidden state (BERT's pooler the first; Llama's and GPT-2's the last
    one not padded, an argmax over the tokens), which under cp is on one rank only. Pinned, cp is refused by
    compile() naming the op, before any program exists; unpinned, a long sequence's search, which would otherwise
    weigh cp, keeps cp = 1 (it used to find a cp plan whose programs failed when generated)."""
    with pytest.raises(DeclarationError, match=r"cp=2: no context-parallel program .*computes select "
                                               r"\(aten.select.int in bert.pooler\), a select along the token dim"):
        compile(_bert_classifier(), "local:2", example_inputs=(torch.randint(1, VOCAB, (2, SEQ)),),
                global_batch_size=BATCH, precision="fp32", dp=1, cp=2, alternatives=0)
    with torch.device("meta"):  # one sequence of LONG_SEQUENCE tokens on two devices: dp = 1, so cp is weighed
        model = _bert_classifier(positions=LONG_SEQUENCE)
    tokens = torch.zeros(1, LONG_SEQUENCE, dtype=torch.long, device="meta")
    plan = compile(model, "2xA100-80GB", example_inputs=(tokens,), global_batch_size=1, alternatives=3)
    assert all(c.cp == 1 for c in [plan.config, *(a.config for a in plan.alternatives)])
    plan.program(0)  # was cp2, whose programs raised CodegenError here


class _Scaled(torch.nn.Module):
    """Token embeddings divided by the sequence length, a head: reads the length as a number."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB)

    def forward(self, idx):
        return self.head(self.emb(idx) / idx.shape[1])          # (B, T, V)


def scaled_seeded() -> _Scaled:
    torch.manual_seed(0)
    return _Scaled()


def logits_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


MODELS["scaled"] = (scaled_seeded, logits_loss)


def assert_same_training(plan, name: str = "gpt", optimizer=sgd):
    model_fn, loss_fn = MODELS[name]
    return assert_plan_trains_like_one_process(plan, model_fn, optimizer, loss_fn, batches())


@pytest.mark.slow
@pytest.mark.parametrize("name, pp, dp, cp, tp, kind, zero", [
    ("gpt", 1, 1, 2, 1, "ring", 0),
    ("gpt", 1, 1, 4, 1, "ring", 0),
    ("gpt", 1, 2, 2, 1, "ring", 0),
    ("gpt", 1, 1, 2, 1, "all-to-all", 0),
    ("gpt", 1, 2, 2, 1, "ring", 3),
    # with the tensor-parallel rewrite (heads split over tp, attention over cp on each rank's heads), and
    # pipeline stages sending each rank's tokens
    ("gpt", 1, 1, 2, 2, "ring", 0),
    ("gpt", 1, 1, 2, 2, "ring", 1),  # ZeRO-1 over the cp group (dp = 1: the gradient group is the context group)
    ("gpt", 2, 1, 2, 1, "ring", 0),
    ("gpt", 2, 1, 2, 2, "ring", 0),  # pp2 x cp2 x tp2: 8 ranks
    # with Megatron sequence parallelism in the tensor group: each rank's tokens split again over tp
    ("gpt+sp", 1, 1, 2, 2, "ring", 0),
    ("gpt+sp", 2, 1, 2, 2, "ring", 0),
    ("gpt+sp", 1, 2, 2, 2, "ring", 3),
    ("llama+sp", 1, 1, 2, 2, "ring", 0),
    # HF Llama: rotary tables and the causal mask built from the length (whole, checked causal at run time),
    # grouped-query attention
    ("llama", 1, 1, 2, 1, "ring", 0),
    ("llama", 1, 1, 2, 1, "all-to-all", 0),
    ("llama", 1, 1, 4, 1, "ring", 0),
    ("llama", 1, 1, 4, 1, "all-to-all", 0),  # 2 k/v heads over 4 ranks: sent repeated
    # Qwen3: rotary, per-head q/k RMSNorm
    ("qwen3", 1, 1, 2, 1, "ring", 0),
    ("qwen3", 1, 1, 4, 1, "ring", 0),
    # ALiBi folded into q and k (partitioner.tracer.attention): each rank's keys carry their own positions' bias
    # columns around the ring or through the all-to-all, under the causal mask alone
    ("mpt", 1, 1, 2, 1, "ring", 0),
    ("mpt", 1, 1, 2, 1, "all-to-all", 0),
    ("mpt", 1, 1, 2, 2, "ring", 0),
    ("bloom", 1, 1, 2, 1, "ring", 0),
])
def test_context_parallel_trains_like_one_process(name, pp, dp, cp, tp, kind, zero):
    name, sp = name.removesuffix("+sp"), name.endswith("+sp")
    assert_same_training(plan_for(pp=pp, dp=dp, cp=cp, tp=tp, sp=sp, cp_kind=kind, zero=zero, name=name), name)


# OPT with its dropout off: its residual dropout draws other masks on a rank's share of the tokens than one process
# on the whole sequence (as under dp), so only the dropout-free model can match one process
CP_FAMILIES = {**MORE_FAMILIES, "opt_no_dropout": functools.partial(
    from_config, "OPTConfig", "OPTForCausalLM", ffn_dim=128, word_embed_proj_dim=64, dropout=0.0,
    attention_dropout=0.0)}


# More families' attention layouts under both kinds: a fused qkv laid out per head (GPT-NeoX), a fused qkv and
# gate_up with grouped-query attention (Phi3), scalar multipliers on the scores and the residuals (Granite), q/k
# layer norms per head with partial rotary (Persimmon), attention and MLP in parallel (Cohere), rotary on interleaved
# pairs of half of each head (GLM); rotary on interleaved pairs of the first dims (GPT-J), partial rotary with
# attention and MLP in parallel (Phi), q/k RMSNorm over all heads' width (OLMo 2), learned positions indexed by the
# attention mask's cumulative sum, offset by 2 (OPT)
@pytest.mark.slow
@pytest.mark.parametrize("family, kind", [("gpt_neox", "ring"), ("phi3", "all-to-all"), ("granite", "ring"),
                                          ("persimmon", "all-to-all"), ("cohere", "ring"), ("glm", "all-to-all"),
                                          ("gptj", "ring"), ("phi", "all-to-all"), ("olmo2", "ring"),
                                          ("opt_no_dropout", "ring")])
def test_more_families_train_like_one_process(family, kind):
    build = CP_FAMILIES[family]
    g = trace(build(), (torch.randint(0, VOCAB, (2, SEQ)),))
    plan = compile(g, "local:2", global_batch_size=BATCH, precision="fp32", dp=1, cp=2, cp_kind=kind,
                   microbatch_size=2, alternatives=0)
    assert_plan_trains_like_one_process(plan, build, sgd, hf_loss, batches())


# bf16-mixed: the ring computes its blocks and their merge in fp32 (runtime.context.ring_attention) where one
# bf16 process runs bf16 SDPA, so the two differ by bf16 attention rounding, the order of bf16 against fp32
# training. Measured on the example GPT, 3 SGD steps: cp2 against one bf16 process 1.4e-4 (losses) and 1.5e-4
# (parameters); one bf16 process against fp32 7.3e-5 and 1.9e-4. A wrong position split (each rank reading the
# first S/cp positions) moves them by 9.5e-3 and 1.1e-2. 1e-3 is ~7x the rounding and ~10x under that error.
BF16_ATOL = 1e-3


@pytest.mark.slow
def test_bf16_mixed_ring_trains_like_one_bf16_process():
    """cp2 ring in bf16-mixed: losses and fp32 master parameters within BF16_ATOL of one bf16-mixed process
    (a world-1 plan of the same model); the same run with each rank reading the wrong positions is not."""
    from runtime import launch_local

    model_fn, loss_fn = MODELS["gpt"]
    data, plan = batches(), plan_for(cp=2, precision="bf16-mixed")
    one = launch_local(plan_for(cp=1, precision="bf16-mixed"), model_fn, sgd, loss_fn, data, timeout_s=180)

    def gap(out) -> float:
        params = max((out.state_dict[k] - v).abs().max().item() for k, v in one.state_dict.items())
        return max((torch.tensor(out.losses) - torch.tensor(one.losses)).abs().max().item(), params)

    assert gap(launch_local(plan, model_fn, sgd, loss_fn, data, timeout_s=180)) < BF16_ATOL
    wrong = "arange[:arange.shape[0] // 2]"  # the contiguous split's positions, not the load-balanced chunks'
    programs = {r: plan.program(r).source.replace("cp_positions(arange, 0, cp)", wrong) for r in range(2)}
    assert all(wrong in src for src in programs.values())
    assert gap(launch_local(plan, model_fn, sgd, loss_fn, data, timeout_s=180, programs=programs)) > 5 * BF16_ATOL


@pytest.mark.slow
def test_a_length_read_as_a_number_is_the_whole_length():
    """x / T: each rank holds T/cp tokens, but the code divides by the whole T, as one process does."""
    plan = plan_for(dp=1, cp=2, name="scaled")
    assert "mul = sym_size_int_2 * 2" in plan.program(0).source
    assert_same_training(plan, "scaled")


@pytest.mark.slow
def test_context_parallel_with_full_recomputation_trains_like_one_process():
    """Each block runs again in backward: its ring attention's forward too, on every rank in the same order."""
    assert_same_training(plan_for(dp=1, cp=2, recompute="full"))


def test_a_mask_the_kernels_cannot_split_is_refused_when_compiling():
    """Gemma3's sliding-window layers (a window of 4, shorter than the 16 traced tokens) build their mask from
    shapes alone: compile computes it at the traced length and refuses cp, naming the attention, before any rank
    starts (it used to stop the first step). Unpinned, a 16K-token Mistral (window 4096) keeps cp = 1: the search
    used to choose cp2 there, a plan whose first step would have stopped."""
    with pytest.raises(DeclarationError, match=r"cp=2: .*attention .* in model.layers.0.self_attn\) takes the mask "
                                               r".*at 16 tokens is neither causal nor full"):
        plan_for(dp=1, cp=2, name="gemma3")
    import transformers

    with torch.device("meta"):
        model = transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=LONG_SEQUENCE, sliding_window=4096, use_cache=False))
    tokens = torch.zeros(1, LONG_SEQUENCE, dtype=torch.long, device="meta")
    plan = compile(model, "2xA100-80GB", example_inputs=(tokens,), global_batch_size=1, alternatives=3)
    assert all(c.cp == 1 for c in [plan.config, *(a.config for a in plan.alternatives)])


@pytest.mark.slow
def test_a_window_longer_than_the_traced_sequence_stops_the_first_step():
    """Traced at 8 tokens, a window of 8 is a causal mask, so compile lets cp through; at the 16 tokens of the
    batches it is not, and the runtime refuses it before anything is updated."""
    from examples.hf_families import MORE_FAMILIES
    from runtime.launch.env import LaunchError

    model_fn = MORE_FAMILIES["mistral"]  # sliding_window=8
    plan = compile(trace(model_fn(), (torch.randint(0, VOCAB, (2, 8)),)), "local:2", global_batch_size=BATCH,
                   precision="fp32", dp=1, cp=2, microbatch_size=2, alternatives=0)
    with pytest.raises(LaunchError, match=r"neither causal nor full.*\(in step 1 of 3\)"):
        assert_plan_trains_like_one_process(plan, model_fn, sgd, hf_loss, batches())


@pytest.mark.slow
def test_a_checkpoint_saved_under_cp_resumes_under_another_plan(tmp_path):
    """cp2 x tp2 with ZeRO-1 over the context group trains steps 1-2 and checkpoints; dp 2 without cp resumes
    for steps 3-4: the same losses and parameters as one process training steps 1-4."""
    from runtime import launch_local

    model_fn, loss_fn = MODELS["gpt"]
    data = batches(4)
    a = launch_local(plan_for(dp=1, cp=2, tp=2, zero=1), model_fn, sgd, loss_fn, data[:2], save_dir=tmp_path,
                     save_every=2, timeout_s=180)
    assert a.checkpoints
    b = launch_local(plan_for(dp=2, cp=1, zero=0), model_fn, sgd, loss_fn, data, resume_from=tmp_path, timeout_s=180)
    assert b.start_step == 2
    trained = train_one_process(model_fn, sgd, loss_fn, data)
    torch.testing.assert_close(torch.tensor(a.losses), torch.tensor(trained.losses[:2]), rtol=1e-5, atol=1e-6)
    assert_trains_like(b, trained.losses[2:], trained.model.state_dict())
