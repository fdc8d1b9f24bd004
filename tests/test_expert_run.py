"""Expert-parallel plans train the same as one process (the truth test for ep > 1).

Each case compiles a plan for a tiny Hugging Face MoE model (2 layers, hidden 32, 4 experts, top-2, the
router's load-balancing loss on) with ep pinned, generates the per-rank programs (each MoE layer's experts
run as `runtime.experts`' all-to-alls over the ep group, each rank holding its slice of the batched expert
weights), runs them on real Gloo processes for 3 steps, and compares each step's loss (cross entropy plus
the load-balancing loss) and the final parameters with one process training on the whole batch (fp32,
rtol 1e-5, SGD with momentum). The quick tests read the generated source and the refusals.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from cost_models.errors import DeclarationError
from examples.hf_families import MORE_FAMILIES, from_config
from examples.training import hf_loss, sgd, train_one_process
from partitioner import compile, trace
from partitioner.codegen.program import CodegenError
from ranks import assert_plan_trains_like_one_process

VOCAB, SEQ, BATCH, STEPS, AUX = 128, 16, 8, 3, 0.1


def mixtral_seeded(aux: bool = True, layers: int = 2):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, use_cache=False,
                                     router_jitter_noise=0.0, output_router_logits=aux, router_aux_loss_coef=AUX,
                                     tie_word_embeddings=False)
    return transformers.MixtralForCausalLM(cfg)


def qwen3_moe_seeded():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                      norm_topk_prob=True, max_position_embeddings=64, use_cache=False,
                                      output_router_logits=True, router_aux_loss_coef=AUX, tie_word_embeddings=False)
    return transformers.Qwen3MoeForCausalLM(cfg)


def moe_loss(output, targets) -> torch.Tensor:
    """Next-token cross entropy plus the router's load-balancing loss, as Hugging Face adds it."""
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1)) + AUX * output.aux_loss


def mixtral_no_aux_seeded():
    return mixtral_seeded(aux=False)


def mixtral4_seeded():
    """Four layers, for schedules with two stages per pipeline rank."""
    return mixtral_seeded(layers=4)


def deepseek_v3_seeded():
    """DeepSeek-V3's shape (examples.hf_families): the first layer dense, then MoE layers with a shared expert
    beside 4 routed ones (top-2, a sigmoid router with grouped top-k and a bias correction; no auxiliary loss)."""
    from examples.hf_families import deepseek_v3_seeded as build

    return build()


MODELS = {"mixtral": mixtral_seeded, "qwen3_moe": qwen3_moe_seeded}
OTHERS = {"mixtral_no_aux": mixtral_no_aux_seeded, "deepseek_v3": deepseek_v3_seeded, "mixtral4": mixtral4_seeded}
LOSSES = {"deepseek_v3": hf_loss, "mixtral_no_aux": hf_loss}


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


@functools.cache
def traced(name: str):
    """The model traced once per session (an OpGraph is frozen data; compiling one is compiling the model)."""
    return trace({**MODELS, **OTHERS}[name](), (torch.randint(0, VOCAB, (2, SEQ)),))


def plan_for(name: str = "mixtral", *, dp: int = 2, ep: int = 2, zero: int = 0, pp: int = 1, tp: int = 1, cp: int = 1,
             mb: int | None = None, precision: str = "fp32", **kw):
    # one microbatch per rank by default: the load-balancing loss of a batch is not the mean of its microbatches'
    # (with several, the plan says it is computed per microbatch, and one process accumulates the same ones)
    # verify=True runs the module's weights, which an OpGraph does not carry
    model = {**MODELS, **OTHERS}[name]() if kw.get("verify") else traced(name)
    return compile(model, f"local:{dp * pp * tp * cp}", example_inputs=(torch.randint(0, VOCAB, (2, SEQ)),),
                   global_batch_size=BATCH, precision=precision,
                   dp=dp, ep=ep, pp=pp, tp=tp, cp=cp, zero_stage=zero,
                   microbatch_size=mb or BATCH // dp, alternatives=0, **kw)


def test_the_program_holds_its_experts_and_runs_them_over_the_ep_group():
    src = plan_for().program(1).source
    assert "# This rank holds experts 2..3 of 4 in each of the 2 MoE layers (index 1 of its ep group)" in src
    assert "'model.layers.1.mlp.experts.gate_up_proj': (2, 4)," in src
    assert "EP_GROUPS = ((0, 1),)" in src and "EDP_GROUPS = ((0,), (1,))" in src
    block = src.split("def block", 1)[1].split("def suffix", 1)[0]
    # the experts region is one call; the router and its top-k stay as traced
    assert ("ep_experts(view_8, getitem_7, div__1, mlp_experts_gate_up_proj, mlp_experts_down_proj, linear_9, ep)"
            in block)
    assert "grouped_mm" not in block and "aten.topk" in block
    suffix = src.split("def suffix", 1)[1]
    assert "= ep_aux_loss(ep)" in suffix and "ep_router_logits(ep, 1)" in suffix
    assert "engine = ExpertParallel(engine, stage.experts" in src
    assert "cuda" not in src and "'cpu'" not in src  # names no device


@pytest.mark.parametrize("pins, words", [
    (dict(name="mixtral_no_aux", dp=2, ep=2, tp=2, sp=True), "tp=2 and sequence parallelism: each tensor slice"),
    (dict(dp=2, ep=2, precision="bf16"), "precision=.bf16.: the expert slices are kept outside"),
])
def test_what_does_not_run_yet_is_refused_before_anything_runs(pins, words):
    plan = plan_for(**pins)
    with pytest.raises(CodegenError, match=words):
        plan.program(0)


@pytest.mark.parametrize("name, ep", [("mixtral", 1), ("mixtral_no_aux", 1), ("mixtral_no_aux", 2)])
def test_context_parallelism_with_moe_layers_is_refused_and_never_chosen(name, ep):
    """Under cp each rank runs its share of the sequence, and the MoE layers' code is not rewritten for it (at
    ep=1 without the aux loss the program failed at run time: the whole sequence's (token, choice) pairs
    put into the rank's): refused when pinned, before anything runs, and left out of the search."""
    from cost_models.errors import DeclarationError

    with pytest.raises(DeclarationError, match="cp=2 with mixture-of-experts layers .*pin cp=1"):
        plan_for(name, dp=ep, ep=ep, cp=2, mb=8 // ep)
    from partitioner.planner.declarations import Declarations
    from partitioner.planner.expert_split import check_context, experts_of

    assert check_context(Declarations(global_batch_size=8), experts_of(traced(name)))  # unpinned: the search pins cp=1


def test_the_load_balancing_loss_is_not_sequence_parallel():
    """Under sp each tensor slice routes its share of the tokens, and the loss is summed over dp only (a 5e-6 error
    in the loss here, under the equivalence tests' tolerance): sp pinned is refused, and never chosen."""
    from cost_models.errors import DeclarationError

    with pytest.raises(DeclarationError, match="sp=True: .*load-balancing loss is summed over the data-parallel"):
        plan_for(dp=2, ep=1, tp=2, sp=True)
    assert not plan_for(dp=2, ep=1, tp=2).config.sp


@pytest.mark.parametrize("ep", [1, 2])
def test_a_pipelined_load_balancing_loss_carries_each_stages_sums_to_the_last(ep):
    """Each stage hands its MoE layers' sums on with the activation (runtime.experts.pipeline_aux): the programs
    link the stages, the last stage's suffix forms the loss; plan.verify, which builds the pipeline ranks apart,
    is refused before anything runs."""
    from cost_models.errors import DeclarationError

    plan = plan_for(dp=2, ep=ep, pp=2, mb=2)
    for rank in (0, 3):
        src = plan.program(rank).source
        assert ("ep.pipeline = AuxPipeline(stage_ranks=STAGE_RANKS, rank=RANK, collectives=collectives, "
                "group=groups.pp)") in src
    assert "= ep_aux_loss(ep)" in src.split("def suffix", 1)[1]
    with pytest.raises(DeclarationError, match="verify=True with pp=2 and the model's load-balancing loss"):
        plan_for(dp=1, ep=1, pp=2, mb=4, verify=True)


def test_replicated_experts_compute_the_load_balancing_loss_over_the_data_parallel_ranks():
    """ep=1 over dp2: the module's own forward would compute each rank's load-balancing loss (and the mean of
    two ranks' is not the batch's), so the program runs the model's code, each MoE block recording its router
    logits and the suffix's loss summed over groups.dp."""
    plan = plan_for(dp=2, ep=1)
    assert plan.load_balancing_loss and plan.code is not None
    src = plan.program(1).source
    block = src.split("def block", 1)[1].split("def suffix", 1)[0]
    assert "ep_record_router_logits(" in block and "ep_experts(" not in block and "grouped_mm" in block
    assert "= ep_aux_loss(ep)" in src.split("def suffix", 1)[1]
    assert "world=1, num_experts=4,\n                   top_k=2, layers=2, token_group=groups.dp)" in src
    assert "make_stage(model, None, ep).run_as_model()" in src and "ExpertParallel" not in src
    from partitioner.codegen.program import expected_collectives

    assert expected_collectives(plan) == {"all_reduce": 3}  # gradients, the reported loss, the loss's sums


def test_a_pipeline_rank_holds_its_stages_experts():
    src = plan_for("mixtral_no_aux", dp=2, ep=2, pp=2, mb=2).program(3).source  # pipeline rank 1, replica 1
    assert "# This rank holds experts 2..3 of 4 in each of its 1 MoE layers (index 1 of its ep group)" in src
    experts = src.split("EXPERTS = {", 1)[1].split("}", 1)[0]
    assert "'model.layers.1.mlp.experts.down_proj': (2, 4)," in experts and "model.layers.0." not in experts
    assert "EP_GROUPS = ((0, 1), (2, 3))" in src
    assert "ep_experts(" in src and "ep_aux_loss" not in src.split("def suffix", 1)[1]


def test_verify_is_refused_with_ep():
    from cost_models.errors import DeclarationError

    with pytest.raises(DeclarationError, match="verify=True with ep=2"):
        plan_for(verify=True)


def assert_same_training(plan, name: str):
    model_fn, loss_fn = {**MODELS, **OTHERS}[name], LOSSES.get(name, moe_loss)
    return assert_plan_trains_like_one_process(plan, model_fn, sgd, loss_fn, batches(), timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dp, ep, zero", [(2, 2, 0), (2, 2, 1), (2, 2, 3)])
def test_expert_parallel_trains_like_one_process(name, dp, ep, zero):
    out = assert_same_training(plan_for(name, dp=dp, ep=ep, zero=zero), name)
    # per MoE layer and microbatch: 3 all-to-alls forward (counts, dispatch, combine), 2 backward
    assert all(c["all_to_all"] == STEPS * 2 * 5 for c in out.collective_counts), out.collective_counts
    if zero == 0:  # the plan's count of all-reduces (buckets, the loss, the load-balancing loss's sums), every step
        from partitioner.codegen.program import expected_collectives

        want = expected_collectives(plan_for(name, dp=dp, ep=ep, zero=zero))
        assert want["all_to_all"] == 2 * 5
        assert all(c["all_reduce"] == STEPS * want["all_reduce"] for c in out.collective_counts), (want, out.collective_counts)


@pytest.mark.slow
@pytest.mark.parametrize("name, pins", [("mixtral", dict(zero=0)), ("qwen3_moe", dict(zero=3)),
                                        ("mixtral", dict(tp=2, sp=False))])
def test_replicated_experts_train_like_one_process(name, pins):
    """ep=1, dp2 (DDP, ZeRO-3, and tp2 x dp2, whose tensor slices hold the same tokens): the load-balancing loss
    over both replicas' tokens, as one process computes it on the batch (the model's own forward on each rank's
    half differs by ~3e-5 in the loss)."""
    out = assert_same_training(plan_for(name, dp=2, ep=1, **pins), name)
    if pins == dict(zero=0):
        assert all(c["all_reduce"] == STEPS * 3 for c in out.collective_counts), out.collective_counts


def test_the_code_computes_the_models_loss_and_refuses_a_batch_it_was_not_traced_with():
    """make_stage's default ep context is this process alone (what plan.verify runs): the code's load-balancing
    loss is the module's own. A batch with other inputs cannot fall back to the module's forward."""
    ns = plan_for(dp=2, ep=1).program(0).namespace()
    model, reference = mixtral_seeded(), mixtral_seeded()
    ns["make_stage"](model, None).run_as_model()
    x = torch.randint(0, VOCAB, (2, SEQ))
    torch.testing.assert_close(model(x).aux_loss, reference(x).aux_loss, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="own forward cannot stand in"):
        model(x, torch.ones_like(x))


def test_the_plan_says_the_load_balancing_loss_is_per_microbatch():
    """Its expert counts are known only after every forward of a step, so with gradient accumulation the programs
    compute it per microbatch (as Megatron-Core does), and the plan says so where anyone reads it."""
    plan = plan_for(dp=2, ep=1, mb=2)
    for text in (str(plan), plan.explain()):
        assert "load-balancing loss over the 2 data-parallel ranks' tokens" in text
        assert "mean of its 2 microbatches' losses" in " ".join(text.split())
    whole = str(plan_for(dp=2, ep=2))
    assert "on the step's whole batch, as one process computes it" in " ".join(whole.split())
    assert "aux loss" not in str(plan_for("mixtral_no_aux", dp=2, ep=1))


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_several_microbatches_train_like_one_process_accumulating_them(ep):
    """dp2, 2 microbatches of 2 rows per rank: the load-balancing loss of each global microbatch (both ranks'
    i-th), as one process computes it running the same microbatches with gradient accumulation
    (examples.training.global_microbatches; the whole batch's loss differs by ~2e-5)."""
    assert_same_training(plan_for(dp=2, ep=ep, mb=2), "mixtral")


@pytest.mark.slow
@pytest.mark.parametrize("name, dp, ep, zero", [
    ("mixtral", 4, 4, 0),  # one expert per rank
    ("qwen3_moe", 4, 4, 1),
    ("mixtral", 4, 2, 0),  # two ep groups: expert gradients summed over the ranks holding the same experts
    ("mixtral", 4, 2, 1),  # ...and their optimizer state sharded over those 2 ranks
    ("qwen3_moe", 4, 2, 3),
    ("deepseek_v3", 2, 2, 0),
    ("deepseek_v3", 2, 2, 3),
])
def test_more_ranks_and_deepseek_v3_train_like_one_process(name, dp, ep, zero):
    out = assert_same_training(plan_for(name, dp=dp, ep=ep, zero=zero), name)
    assert out.losses[0] != out.losses[-1]


@pytest.mark.slow
@pytest.mark.parametrize("name, zero", [("mixtral_no_aux", 0), ("mixtral_no_aux", 1), ("deepseek_v3", 0)])
def test_pipeline_and_expert_parallel_train_like_one_process(name, zero):
    """pp2 x dp2 x ep2 (world 4), 2 microbatches of 2 rows per replica: each pipeline rank's MoE layers run over
    its own ep group, in the schedule's order on both ranks of the group."""
    assert_same_training(plan_for(name, dp=2, ep=2, pp=2, zero=zero, mb=2), name)


@pytest.mark.slow
@pytest.mark.parametrize("name, pins", [
    ("mixtral", dict(dp=2, ep=2, mb=2)),           # pp2 x dp2 x ep2, world 4
    ("qwen3_moe", dict(dp=2, ep=2, mb=2)),
    ("mixtral", dict(dp=1, ep=1, mb=4)),           # pp2 alone, world 2
    ("qwen3_moe", dict(dp=1, ep=1, mb=4)),
    ("mixtral", dict(dp=1, ep=1, mb=4, schedule="1f1b")),
    ("mixtral4", dict(dp=1, ep=1, mb=4, schedule="zb-v")),  # stages 1 and 2 on one rank: sums handed in memory
    ("mixtral4", dict(dp=1, ep=1, mb=2, schedule="interleaved-1f1b")),
    ("mixtral", dict(dp=2, ep=2, mb=2, zero=1, recompute="full")),  # recomputed blocks record their logits again
    ("qwen3_moe", dict(dp=2, ep=1, mb=2, zero=3, schedule="gpipe")),
    ("mixtral", dict(dp=1, ep=1, tp=2, mb=4)),     # each tensor slice's stages carry their own (equal) sums
])
def test_a_pipelined_load_balancing_loss_trains_like_one_process(name, pins):
    """pp2: each stage's MoE layers' sums (top-k picks, probabilities, rows) reach the last stage with the
    activations, the gradient of the loss back to every stage's routers: losses (cross entropy plus the
    load-balancing loss of each microbatch) and parameters as one process accumulating the same microbatches."""
    out = assert_same_training(plan_for(name, pp=2, **pins), name)
    assert out.losses[0] != out.losses[-1]


def router_logits_loss(output, targets):
    """A loss that reads the model's router logits itself: Hugging Face's load-balancing function over them."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return hf_loss(output, targets) + AUX * load_balancing_loss_func(output.router_logits, 4, 2)


def test_an_earlier_stages_router_logits_refuse_to_be_computed_with():
    """Their place in the last stage's output: moved or cast it stays one (the traced code casts what it returns);
    computed with, it raises, naming the layer."""
    from runtime.experts.program import RouterLogitsElsewhere

    held = RouterLogitsElsewhere.of(3, 4, torch.device("cpu"))
    moved = torch.ops.aten.to.dtype_layout(held, dtype=torch.float32, layout=torch.strided, device=held.device)
    assert isinstance(moved, RouterLogitsElsewhere) and moved.shape == (0, 4) and moved.layer == 3
    with pytest.raises(ValueError, match=r"MoE layer 3 \(cat\), which stayed on an earlier pipeline stage"):
        torch.cat([torch.ones(2, 4), moved])
    with pytest.raises(ValueError, match="MoE layer 3"):
        held.softmax(-1)


@pytest.mark.slow
def test_a_loss_that_reads_an_earlier_stages_router_logits_stops_the_first_step():
    """pp2: the last stage's output holds its own layers' router logits, the first stage's stayed there. A loss
    that concatenates them all (load_balancing_loss_func) ran on the last stage's layers alone, the first's empty
    and gone in the concatenation: another loss than one process's, silently. Now the first step stops, naming
    the layer, before anything is updated."""
    from runtime import launch_local
    from runtime.launch.env import LaunchError

    with pytest.raises(LaunchError, match=r"router logits of MoE layer 0 \(.*\), which stayed on an earlier pipe"):
        launch_local(plan_for("mixtral", pp=2, dp=1, ep=1, mb=4), mixtral_seeded, sgd, router_logits_loss,
                     batches(1), timeout_s=180)


def test_a_list_of_expert_modules_is_refused_by_name():
    """test_experts' CapacityMoE keeps its experts as a ModuleList of MLPs, which no expert-parallel program runs:
    a pinned ep=2 is refused when compiling (not when the program is generated), naming the experts module and
    what runs."""
    from test_experts import Net

    torch.manual_seed(0)
    with pytest.raises(DeclarationError, match=r"ep=2: no expert-parallel program .*runs batched gated experts "
                                               r".* but the experts of layers.1.mlp.experts read .*a list of expert "
                                               r"modules"):
        compile(Net(moe_every=1), "local:2", example_inputs=(torch.zeros(2, 16, dtype=torch.long),),
                global_batch_size=8, dp=2, ep=2, alternatives=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "mixtral_no_aux"])
def test_tensor_and_expert_parallel_train_like_one_process(name):
    """tp2 x dp2 x ep2 (world 4): attention split over the tensor group, the MoE layers replicated over it; each
    tensor slice's ranks form their own ep group (the same tokens and experts on every slice), and the
    load-balancing loss is summed over the data-parallel ranks of each slice."""
    assert_same_training(plan_for(name, dp=2, ep=2, tp=2, sp=False), name)


@pytest.mark.slow
def test_bf16_mixed_trains_close_to_one_process():
    """bf16-mixed: the expert slices are fp32 masters outside the engine, cast to bf16 as the code reads them.
    The losses stay within bf16's rounding of the fp32 one-process run, and so does each parameter's update
    (its change over the 3 steps, to 30 % of its norm: the experts' updates are tiny and bf16 moves them by
    up to ~15 % here, a wrong gradient scale by ~100 %)."""
    from runtime import launch_local

    data = batches()
    plan = plan_for("mixtral", dp=2, ep=2, precision="bf16-mixed")
    assert "stage.cast = engine.precision.param_dtype" in plan.program(0).source
    out = launch_local(plan, mixtral_seeded, sgd, moe_loss, data, timeout_s=240)
    trained = train_one_process(mixtral_seeded, sgd, moe_loss, data)
    torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(trained.losses), rtol=1e-3, atol=0)
    start = mixtral_seeded().state_dict()
    for k, v in trained.model.state_dict().items():
        want, got = v - start[k], out.state_dict[k] - start[k]
        assert float((got - want).norm()) <= 0.3 * float(want.norm()), (k, float((got - want).norm() / want.norm()))


@pytest.mark.slow
@pytest.mark.parametrize("name, saved, resumed", [
    # expert shards of a flat buffer -> whole experts under plain data parallelism, where each rank's
    # load-balancing loss is its own tokens' (as the model computes it), not one process's: no aux loss here
    ("mixtral_no_aux", dict(dp=4, ep=2, zero=1), dict(dp=2, ep=1, zero=0)),
    ("mixtral", dict(dp=2, ep=2, zero=0), dict(dp=4, ep=2, zero=3)),  # slices -> shards of other ranks' slices
])
def test_a_checkpoint_saved_under_ep_resumes_under_another_plan(tmp_path, name, saved, resumed):
    """Steps 1-2 under one plan, checkpointed (parameters and SGD momentum as boxes of the full [E, ...] expert
    tensors), steps 3-4 under another: the same losses and parameters as one process training steps 1-4."""
    from ranks import assert_trains_like
    from runtime import launch_local

    model_fn, loss_fn, data = {**MODELS, **OTHERS}[name], LOSSES.get(name, moe_loss), batches(4)
    a = launch_local(plan_for(name, **saved), model_fn, sgd, loss_fn, data[:2], save_dir=tmp_path, save_every=2,
                     timeout_s=240)
    assert a.checkpoints
    b = launch_local(plan_for(name, **resumed), model_fn, sgd, loss_fn, data, resume_from=tmp_path, timeout_s=240)
    assert b.start_step == 2
    trained = train_one_process(model_fn, sgd, loss_fn, data)
    torch.testing.assert_close(torch.tensor(a.losses), torch.tensor(trained.losses[:2]), rtol=1e-5, atol=1e-6)
    assert_trains_like(b, trained.losses[2:], trained.model.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("name, pins", [
    ("mixtral", dict(dp=2, ep=2, zero=0)),        # the data-parallel runner; expert squares summed over ep
    ("mixtral", dict(dp=4, ep=2, zero=1)),        # expert shards: every rank's squares summed over dp
    ("mixtral", dict(dp=2, ep=2, tp=2, zero=0)),  # the tensor-parallel runner: experts counted once per slice
])
def test_clipping_counts_every_expert_once(name, pins):
    """clip_grad_norm at a norm the gradients exceed: the global norm over the dense parameters and every
    expert (each held by one ep rank, or sharded, or replicated over the tensor group), as torch's
    clip_grad_norm_ computes it over one process's whole model."""
    from ranks import assert_trains_like
    from runtime import launch_local

    clip, data = 0.5, batches()
    out = launch_local(plan_for(name, clip_grad_norm=clip, **pins), mixtral_seeded, sgd, moe_loss, data,
                       timeout_s=240)
    trained = train_one_process(mixtral_seeded, sgd, moe_loss, data, clip_grad_norm=clip)
    assert min(trained.grad_norms) > clip, trained.grad_norms  # it does clip
    assert_trains_like(out, trained.losses, trained.model.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("name, recompute, pins", [
    ("mixtral", "full", dict(dp=2, ep=2)),
    ("mixtral", "selective", dict(dp=2, ep=2)),
    ("qwen3_moe", "full", dict(dp=4, ep=2, zero=3)),
])
def test_recomputed_moe_layers_train_like_one_process(name, recompute, pins):
    """A recomputed MoE layer runs its all-to-alls again in backward (every rank of the ep group recomputes in
    the same order; selective keeps no collective's output, as the planner costs it) and records its router
    logits again, after the load-balancing loss has read the forward's: losses and parameters as one process."""
    out = assert_same_training(plan_for(name, recompute=recompute, **pins), name)
    # per MoE layer and microbatch: 3 all-to-alls forward, 3 more in the recomputed forward, 2 backward
    assert all(c["all_to_all"] == STEPS * 2 * 8 for c in out.collective_counts), out.collective_counts


def _with_score_bias(build):
    """`build()` with its routers' score-correction biases drawn at random: they start at zero, where a router
    that lost them would choose the same experts."""
    model = build()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g))
    return model


def _moe_family(config: str, model: str, **kw):
    return functools.partial(from_config, config, model, num_key_value_heads=2, **kw)


# More Hugging Face MoE families, each routing or holding its experts its own way: a softmax over every expert
# before the top-k (OLMoE), the experts as two ParallelExperts modules behind a top-k then softmax (GraniteMoE), a
# shared expert behind a sigmoid gate (Qwen2-MoE), a softmax router whose choice (not its weights) reads a
# correction bias (ERNIE 4.5 MoE), a sigmoid router with grouped top-k and a correction bias beside shared experts,
# the first layer dense (GLM-4.5 MoE), a router one module deeper (`mlp.gate.wg`) beside a shared MLP (HunYuan),
# multi-head latent attention, whose blocks reuse a product of sizes the experts region computes (DeepSeek-V2)
MORE_MOE = {
    "olmoe": _moe_family("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2),
    "granitemoe": _moe_family("GraniteMoeConfig", "GraniteMoeForCausalLM", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": MORE_FAMILIES["qwen2_moe"],
    "ernie4_5_moe": functools.partial(_with_score_bias, _moe_family(
        "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
        moe_layer_start_index=0)),
    "glm4_moe": functools.partial(_with_score_bias, _moe_family(
        "Glm4MoeConfig", "Glm4MoeForCausalLM", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=2, topk_group=1, head_dim=16)),
    "hunyuan_moe": MORE_FAMILIES["hunyuan_moe"],
    "deepseek_v2": functools.partial(
        from_config, "DeepseekV2Config", "DeepseekV2ForCausalLM", n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, n_group=1, topk_group=1),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MORE_MOE))
def test_more_moe_families_train_like_one_process(family):
    build = MORE_MOE[family]
    plan = compile(trace(build(), (torch.randint(0, VOCAB, (2, SEQ)),)), "local:2", global_batch_size=BATCH,
                   precision="fp32", dp=2, ep=2, microbatch_size=BATCH // 2, alternatives=0)
    assert plan.config.ep == 2
    assert_plan_trains_like_one_process(plan, build, sgd, hf_loss, batches(), timeout_s=240)
