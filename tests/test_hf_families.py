"""Hugging Face families whose layers are not all alike train under every kind of plan like one process.

The families of examples/hf_families.py, each built from a small config (no
download): per-head q/k norms on head-sharded activations (Qwen3, Qwen3-MoE,
Gemma3), alternating sliding-window and full attention (Gemma3, GPT-OSS), a
dense layer before MoE layers (DeepSeek-V3), constants made inside forward
(Falcon); an ALiBi bias per head made inside forward (MPT, BLOOM: tensor plans). Each model is traced once *on the meta device* (the 175B-on-a-laptop
flow; Falcon on CPU, see ON_CPU) and every plan is compiled from that trace; the programs run on real
Gloo processes for 2 steps of SGD with momentum, compared with one process
(losses and every parameter, fp32).
"""

from __future__ import annotations

import functools

import pytest
import torch

from examples.hf_families import ALIBI_FAMILIES, FAMILIES, from_config
from examples.training import evaluate_one_process, hf_loss, hf_model_loss, sgd, train_one_process
from partitioner import compile, trace
from partitioner.planner.tensor_split import find_splits
from runtime import launch_local
from ranks import assert_trains_like

VOCAB, SEQ, BATCH, STEPS = 512, 16, 8, 2

PLANS = {  # name: (pp, dp, tp, zero, schedule, interleave)
    "dp2-zero3": (1, 2, 1, 3, "1f1b", 1),
    "tp2": (1, 1, 2, 0, "1f1b", 1),
    "pp2-1f1b": (2, 1, 1, 0, "1f1b", 1),
    "dp2-tp2-pp2-zero1": (2, 2, 2, 1, "1f1b", 1),
    "pp2-interleaved": (2, 1, 1, 0, "interleaved-1f1b", 2),  # 4 virtual stages of one block each
    "pp2-zb-h1": (2, 1, 1, 0, "zb-h1", 1),  # the backward split into I and W (experts' routing in I)
}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


# Traced on the CPU instead: Falcon indexes with a Python list (qkv[..., [-2], :]), an index tensor made on the
# activations' device, so traced on meta its value is unknown and stage code could not carry it (pp/tp are
# refused, saying why). Transformers' MoE layers branch on the device type (`.float()` for histc on CPU,
# `.int()` elsewhere): traced on meta they take the GPU branch, which fails on CPU (plan.verify stops it).
ON_CPU = {"falcon", "qwen3_moe", "gpt_oss", "deepseek_v3"}


BUILDERS = {**FAMILIES, **ALIBI_FAMILIES}


@functools.cache
def meta_graph(family: str):
    """The trace plans are compiled from: on the meta device, but for the families in ON_CPU."""
    if family in ON_CPU:
        return trace(BUILDERS[family](), (torch.randint(0, VOCAB, (2, SEQ)),))
    with torch.device("meta"):
        model = BUILDERS[family]()
    return trace(model, (torch.randint(0, VOCAB, (2, SEQ), device="meta"),))


@functools.cache
def reference(family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    trained = train_one_process(BUILDERS[family], sgd, hf_loss, batches())
    return trained.losses, trained.model.state_dict()


def test_block_kinds_are_found_from_what_blocks_compute():
    """Alternating attention and a dense head are kinds; Qwen3's per-layer `layer_idx` (set, never read without
    a cache) is not, so its stack is still traced as three blocks and copied."""
    kinds = {f: tuple(b.kind for b in meta_graph(f).blocks) for f in FAMILIES}
    assert kinds["gemma3"] == kinds["gpt_oss"] == (0, 1, 0, 1)
    assert kinds["deepseek_v3"] == (0, 1, 1, 1)
    for f in ("qwen3", "qwen3_moe", "falcon"):
        assert kinds[f] == (0, 0, 0, 0), f
        assert meta_graph(f).expanded_from == 3, f


def test_a_mixed_stack_plan_runs_one_template_per_kind_and_says_so():
    plan = compile(meta_graph("deepseek_v3"), "local:2", global_batch_size=BATCH, precision="fp32", pp=2, dp=1, tp=1,
                   microbatch_size=2)
    assert plan.block_kinds == (0, 1, 1, 1)
    assert "4 blocks of model.layers in 2 kinds" in str(plan) and "kind 1 = 1-3" in str(plan)
    src = plan.program(1).source
    assert "BLOCK_KINDS = (0, 1, 1, 1)" in src and "def block_1(tp, x," in src
    assert "mlp_experts" not in src.split("def block(")[1].split("def block_1(")[0]  # kind 0 is the dense layer


def test_generated_code_names_no_trace_device_and_carries_forward_made_constants():
    """Compiled on meta, the code takes every factory's device from its input. Falcon's index constants travel
    as literals when traced on CPU; traced on meta their values are unknown and pp/tp are refused, saying why."""
    plan = compile(meta_graph("qwen3"), "local:4", global_batch_size=BATCH, precision="fp32", pp=2, dp=1, tp=2,
                   microbatch_size=2)
    assert all("meta" not in plan.program(r).source for r in range(4))
    plan = compile(meta_graph("falcon"), "local:4", global_batch_size=BATCH, precision="fp32", pp=2, dp=1, tp=2,
                   microbatch_size=2)
    for r in range(4):
        assert "lifted_tensor" not in plan.program(r).source
    assert "torch.tensor([-2], dtype = torch.int64, device = getattr_" in plan.program(2).source
    with torch.device("meta"):
        falcon = FAMILIES["falcon"]()
    with pytest.raises(ValueError, match=r"pp=2: .* makes on the activations' device .* compile from the model built "
                                         r"on CPU, or pin pp=1"):
        compile(falcon, "local:2", example_inputs=(torch.randint(0, VOCAB, (2, SEQ), device="meta"),),
                global_batch_size=BATCH, precision="fp32", pp=2, dp=1, tp=1)


@pytest.mark.parametrize("family, qkv, heads_dim",
                         [("mpt", "transformer.blocks.0.attn.Wqkv.weight", 0),
                          ("bloom", "transformer.h.0.self_attention.query_key_value.weight", 1)])
def test_an_alibi_bias_per_head_is_read_by_heads_under_tensor_parallelism(family, qkv, heads_dim):
    """The ALiBi bias of every head, folded into the keys' extra columns (MPT's (nh, s, 1), BLOOM's (b, nh, s, 1)),
    needs no gradient: each tensor rank reads its own heads' chunk of it and the attention is split by heads (not
    kept whole). BLOOM's (b*nh, s, hs) baddbmm is lifted to heads as a dim by the attention rewrite first."""
    splits = find_splits(meta_graph(family))
    assert splits.placement(qkv).role == "column"
    assert len(splits.chunks) == 4 and all(d == heads_dim for _, _, d in splits.chunks)  # one bias per block
    plan = compile(meta_graph(family), "local:2", global_batch_size=BATCH, precision="fp32", pp=1, dp=1, tp=2,
                   microbatch_size=2)
    assert "tp_chunk(" in plan.program(0).source


@pytest.mark.slow
@pytest.mark.parametrize("plan_name", ["tp2", "dp2-tp2-pp2-zero1"])
@pytest.mark.parametrize("family", list(ALIBI_FAMILIES))
def test_alibi_family_trains_like_one_process(family, plan_name):
    test_family_trains_like_one_process(family, plan_name)


@pytest.mark.slow
@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_like_one_process(family, plan_name):
    pp, dp, tp, zero, schedule, interleave = PLANS[plan_name]
    plan = compile(meta_graph(family), f"local:{pp * dp * tp}", global_batch_size=BATCH, precision="fp32", pp=pp,
                   dp=dp, tp=tp, zero_stage=zero, schedule=schedule, interleave=interleave, microbatch_size=2)
    assert (plan.pp, plan.dp, plan.tp, plan.zero_stage) == (pp, dp, tp, zero)
    out = launch_local(plan, BUILDERS[family], sgd, hf_loss, batches(), timeout_s=180)
    want_losses, want = reference(family)
    assert sorted(out.state_dict) == sorted(want)
    assert_trains_like(out, want_losses, want)


@pytest.mark.slow
@pytest.mark.parametrize("plan_name", ["tp2", "pp2-1f1b"])
def test_rotary_family_trains_under_bf16_mixed(plan_name):
    """Traced in fp32, the code held the model's casts that were no-ops then (Qwen3's rotary tables `.to(x.dtype)`)
    as casts to fp32: run in bf16, a fp32 table met bf16 activations and SDPA refused q/k in fp32 beside a bf16 v.
    They cast to the parameters' dtype, the norms' upcasts stay fp32 (partitioner.tracer.upcasts), and the code
    runs without autocast. Losses against the fp32 run within 0.1 %: bf16 roundings (2^-8
    relative each) of activations that the loss averages over 128 tokens; measured 2-4e-5."""
    pp, dp, tp, zero, schedule, interleave = PLANS[plan_name]
    plan = compile(meta_graph("qwen3"), f"local:{pp * dp * tp}", global_batch_size=BATCH, precision="bf16-mixed",
                   pp=pp, dp=dp, tp=tp, zero_stage=zero, schedule=schedule, interleave=interleave, microbatch_size=2)
    out = launch_local(plan, BUILDERS["qwen3"], sgd, hf_loss, batches(), timeout_s=180)
    want_losses, _ = reference("qwen3")
    assert out.losses == pytest.approx(want_losses, rel=1e-3)


@pytest.mark.slow
def test_bf16_stage_code_computes_in_the_modules_own_dtypes():
    """Stage code that casts as the model does runs without autocast, in the dtypes the module's own forward
    computes in with bf16 parameters (the one-rank plan runs that forward): DeepSeek-V3 under pp2 then trains
    exactly as the one-rank plan, where under autocast (which casts the fp32 values its linears and attention
    meet to bf16, and on a GPU runs norms on fp32 copies) its losses differed by 5e-5."""
    runs = {}
    for name, pp in (("one", 1), ("pp2", 2)):
        plan = compile(meta_graph("deepseek_v3"), f"local:{pp}", global_batch_size=BATCH, precision="bf16-mixed",
                       pp=pp, dp=1, tp=1, microbatch_size=2)
        if pp > 1:  # the one-rank plan runs the module's own forward
            assert plan.code.exact_casts and "stage.autocast = False" in plan.program(0).source
        runs[name] = launch_local(plan, BUILDERS["deepseek_v3"], sgd, hf_loss, batches(), timeout_s=180)
    assert runs["pp2"].losses == runs["one"].losses
    for k, v in runs["one"].state_dict.items():
        torch.testing.assert_close(runs["pp2"].state_dict[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_rotary_family_trains_with_sequence_parallelism(precision):
    """Qwen3 (per-head q/k norms, rotary tables from a no_grad region) under tp2 with sequence parallelism: the
    RMSNorms between the regions see half the tokens, the rotary positions apply to the gathered ones. fp32 as
    one process; bf16-mixed (its autocast and the shards kept for backward) within the bf16 tolerance above."""
    plan = compile(meta_graph("qwen3"), "local:2", global_batch_size=BATCH, precision=precision, tp=2, sp=True,
                   microbatch_size=2)
    assert plan.config.sp
    out = launch_local(plan, BUILDERS["qwen3"], sgd, hf_loss, batches(), timeout_s=180)
    want_losses, want = reference("qwen3")
    if precision == "fp32":
        assert_trains_like(out, want_losses, want)
    else:
        assert out.losses == pytest.approx(want_losses, rel=1e-3)


# As a new user builds it: the config's defaults, use_cache=True among them (every Hugging Face causal LM's default)
_CACHED_LLAMA = functools.partial(from_config, "LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, use_cache=True)


@pytest.mark.slow
def test_a_model_that_returns_a_kv_cache_traces_and_trains_like_one_process():
    """Its forward returns a DynamicCache unless told not to, which export cannot hold: the tracer passes
    use_cache=False (training never reads the cache), the generated code takes the tokens alone, and a tp2
    program trains like one process; pp2 x tp2 programs compute the module (plan.verify). An explicit
    use_cache=True is the caller's: kept, and the trace fails."""
    model = _CACHED_LLAMA()
    assert model.config.use_cache is True
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    g = trace(model, (tokens,))
    assert len(g.inputs) == 1
    assert model.config.use_cache is True  # the caller's module is not changed
    x, y = batches()[0]
    compile(g, "local:4", global_batch_size=2, microbatch_size=2, precision="fp32", pp=2, tp=2, dp=1,
            sp=False).verify(_CACHED_LLAMA, (x,), hf_loss, targets=y)
    plan = compile(g, "local:2", global_batch_size=BATCH, precision="fp32", tp=2, dp=1, pp=1, microbatch_size=4)
    assert "use_cache" not in plan.program(0).source
    out = launch_local(plan, _CACHED_LLAMA, sgd, hf_loss, batches(), timeout_s=180)
    trained = train_one_process(_CACHED_LLAMA, sgd, hf_loss, batches())
    assert_trains_like(out, trained.losses, trained.model.state_dict())
    with pytest.raises(Exception, match="DynamicCache"):
        trace(model, (tokens,), dict(use_cache=True))


# Forwards that take use_cache only through **kwargs: BERT's (an encoder: it ignores the flag, which its config
# still sets) and GraniteMoE's causal LM (which returns a cache unless its config says not)
_KWARGS_CACHE = {
    "bert": functools.partial(from_config, "BertConfig", "BertForMaskedLM", use_cache=True),
    "granitemoe": functools.partial(from_config, "GraniteMoeConfig", "GraniteMoeForCausalLM", use_cache=True,
                                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
}


@pytest.mark.parametrize("family", sorted(_KWARGS_CACHE))
def test_a_forward_that_takes_use_cache_through_kwargs_traces_from_its_default_config(family):
    """Export cannot take a bool among **kwargs, so passing use_cache=False there made every BERT-like encoder
    fail to trace, for a flag it ignores: the tracer turns the config's flag off while it traces instead, and
    restores it. The pp2 x tp2 programs compute the module."""
    build = _KWARGS_CACHE[family]
    model = build()
    assert model.config.use_cache is True
    g = trace(model, (torch.randint(0, VOCAB, (2, SEQ)),))
    assert model.config.use_cache is True  # the caller's module is not changed
    x, y = batches()[0]
    compile(g, "local:4", global_batch_size=2, microbatch_size=2, precision="fp32", pp=2, tp=2, dp=1,
            sp=False).verify(build, (x,), hf_loss, targets=y)


def _padded_batches(steps: int = STEPS) -> list[tuple[dict[str, torch.Tensor], None]]:
    """Fine-tuning batches as users make them: left padding (rows of 16 with 0-7 pads), labels -100 on the pads."""
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        for row, pads in enumerate(torch.randint(0, 8, (BATCH,), generator=g).tolist()):
            mask[row, :pads] = 0
        out.append((dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)), None))
    return out


_LLAMA = functools.partial(from_config, "LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2)


@pytest.mark.slow
def test_padded_batches_with_the_models_own_loss_train_like_one_process():
    """The mask Hugging Face builds from the padding, and the shifted labels, are computed from the model's
    inputs alone: every stage that reads them computes them again from the inputs it takes, so only the hidden
    state crosses a cut (these plans were refused: "the prefix hands 2 values"). pp2 x tp2 and tp2+sp programs
    compute the module (plan.verify); pp2 trains like one process on 2 Gloo ranks."""
    batches = _padded_batches()
    x, _ = batches[0]
    first = {k: v[:2] for k, v in x.items()}
    g = trace(_LLAMA(), (), first)
    for pins in (dict(pp=2, tp=2, sp=False), dict(pp=1, tp=2, sp=True)):
        plan = compile(g, f"local:{pins['pp'] * 2}", global_batch_size=2, microbatch_size=2, precision="fp32", dp=1,
                       **pins)
        plan.verify(_LLAMA, first)
    plan = compile(g, "local:2", global_batch_size=BATCH, precision="fp32", pp=2, tp=1, dp=1, microbatch_size=2)
    assert "input_attention_mask" in plan.program(1).source  # the last stage computes the mask from the input
    with pytest.warns(UserWarning, match=r"not a mean over the rows.*4 pieces of 2 row.*per_token"):
        out = launch_local(plan, _LLAMA, sgd, hf_model_loss, batches, timeout_s=180)
    # one process as the plan runs each step: the mean of its 4 microbatches' losses, each the model's own mean
    # over that microbatch's labelled tokens (not over the step's: the pads fall unevenly)
    model = _LLAMA()
    opt = sgd(model.parameters())
    losses = []
    for inputs, _ in batches:
        loss = 0.0
        for i in range(0, BATCH, 2):
            part = model(**{k: v[i:i + 2] for k, v in inputs.items()}).loss / (BATCH // 2)
            part.backward()
            loss += part.item()
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    assert_trains_like(out, losses, model.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("pins", [dict(pp=2, dp=1, microbatch_size=2), dict(pp=1, dp=2, microbatch_size=2)],
                         ids=["pp2-4-microbatches", "dp2-2-microbatches-each"])
def test_a_per_token_loss_trains_like_one_process_over_the_whole_padded_batch(pins):
    """With the pads falling unevenly, the mean of the microbatches' means is not the batch's mean over its
    labelled tokens (6.2669 vs 6.2674 at step 0 here). `per_token(hf_model_loss, labelled_tokens)` weighs each
    microbatch by its share of the batch's tokens, in a pipeline (PipelineRunner) and over replicas
    (StepRunner) alike: then the plan trains like one process calling the model on the whole batch."""
    from examples.training import labelled_tokens
    from runtime import per_token

    batches = _padded_batches()
    first = {k: v[:2] for k, v in batches[0][0].items()}
    plan = compile(trace(_LLAMA(), (), first), "local:2", global_batch_size=BATCH, precision="fp32", tp=1, **pins)
    trained = train_one_process(_LLAMA, sgd, hf_model_loss, batches)  # the model's own loss over all 8 rows
    model, inputs = _LLAMA(), batches[0][0]
    means = sum(model(**{k: v[i:i + 2] for k, v in inputs.items()}).loss.item() for i in range(0, BATCH, 2)) / 4
    with pytest.raises(AssertionError):  # the default, the mean of the means, would not match it
        torch.testing.assert_close(torch.tensor(means), torch.tensor(trained.losses[0]), rtol=1e-5, atol=1e-6)
    out = launch_local(plan, _LLAMA, sgd, per_token(hf_model_loss, labelled_tokens), batches, timeout_s=180,
                       eval_batches=batches[:1])  # an evaluation weighs the microbatches by their tokens too
    assert_trains_like(out, trained.losses, trained.model.state_dict())
    want = evaluate_one_process(trained.model, hf_model_loss, batches[:1])
    assert out.eval_losses == [(len(batches), pytest.approx(want, rel=1e-5))]
