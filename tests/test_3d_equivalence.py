"""Pipeline, tensor-parallel and 3D plans train the same as one process (the truth test).

Every case compiles a plan for the example GPT or Hugging Face GPT-2 (built
from a config) with its degrees pinned, generates the per-rank programs,
runs them on real Gloo processes (`launch_local`) for 3 steps, and compares
each step's loss and the final parameters with one process training on the
whole batch (fp32, rtol 1e-5 / atol 1e-6, widened by AdamW's noise step:
tests/ranks.py adam_atol). Also: the point-to-point messages each rank sends
and receives per step are those of its instruction list.
"""

from __future__ import annotations

import ast
import functools
import re

import pytest
import torch

from examples.training import (
    adamw,
    gpt_4l_seeded,
    gpt_8l_seeded,
    gpt_loss,
    hf_gpt2_4l_seeded,
    hf_llama_8l_seeded,
    hf_llama_seeded,
    hf_loss,
    in_model_loss,
    sgd,
    train_one_process,
)
from partitioner import compile, trace
from runtime import launch_local
from ranks import assert_trains_like

pytestmark = pytest.mark.slow

MODELS = {"gpt": (gpt_4l_seeded, gpt_loss), "gpt8": (gpt_8l_seeded, gpt_loss), "hf": (hf_gpt2_4l_seeded, hf_loss),
          "llama": (hf_llama_seeded, hf_loss), "llama8": (hf_llama_8l_seeded, hf_loss)}
VOCAB, SEQ, BATCH, STEPS = 512, 16, 8, 3


def batches(steps: int = STEPS, *, padding: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
           for _ in range(steps)]
    if padding:
        for x, _ in out:
            x[:, 0] = 0  # token 0 is HF Llama's padding_idx: its embedding row must get no gradient
    return out


def reference(model_fn, loss_fn, data) -> tuple[list[float], dict[str, torch.Tensor]]:
    trained = train_one_process(model_fn, adamw, loss_fn, data)
    return trained.losses, trained.model.state_dict()


def plan_for(name: str, *, pp: int, dp: int, tp: int, schedule: str = "1f1b", interleave: int = 1, zero: int = 0,
             mb: int = 2, recompute: str = "none", on: str = "cpu", sp: bool = False, unit: str | None = None):
    """The plan, compiled from the model built on `on` ("meta": the 175B-on-a-laptop flow, nothing allocated);
    without sequence parallelism unless `sp` (its own cases below)."""
    return compile(traced(name, on), f"local:{pp * dp * tp}",
                   global_batch_size=BATCH, precision="fp32", pp=pp, dp=dp, tp=tp, schedule=schedule,
                   interleave=interleave, zero_stage=zero, microbatch_size=mb, recompute=recompute,
                   sp=sp if tp > 1 else None, zero3_unit=unit)


@functools.cache
def traced(name: str, on: str = "cpu"):
    """The model traced once per session (an OpGraph is frozen data; compiling one is compiling the model)."""
    model_fn, _ = MODELS[name]
    with torch.device(on):
        model = model_fn()
    return trace(model, (torch.randint(0, VOCAB, (2, SEQ), device=on),))


def assert_same_training(plan, name: str, steps: int = STEPS, optimizer=adamw):
    model_fn, loss_fn = MODELS[name]
    data = batches(steps, padding=name.startswith("llama"))
    out = launch_local(plan, model_fn, optimizer, loss_fn, data, timeout_s=180)
    trained = train_one_process(model_fn, optimizer, loss_fn, data)
    want_losses, want = trained.losses, trained.model.state_dict()
    assert sorted(out.state_dict) == sorted(want)
    assert_trains_like(out, want_losses, want, adam_steps=steps if optimizer is adamw else 0)
    return out


CASES = [
    # model, pp, dp, tp, schedule, interleave, zero
    ("gpt", 2, 1, 1, "gpipe", 1, 0),
    ("gpt", 2, 1, 1, "1f1b", 1, 0),
    ("gpt", 2, 1, 1, "interleaved-1f1b", 2, 0),
    ("gpt", 4, 1, 1, "gpipe", 1, 0),
    ("gpt", 4, 1, 1, "1f1b", 1, 0),
    ("gpt8", 4, 1, 1, "interleaved-1f1b", 2, 0),
    ("gpt", 1, 1, 2, "1f1b", 1, 0),
    ("gpt", 1, 1, 4, "1f1b", 1, 0),
    ("gpt", 2, 1, 2, "1f1b", 1, 0),
    ("gpt", 2, 2, 2, "1f1b", 1, 1),
    ("gpt", 2, 2, 1, "1f1b", 1, 3),
    # DDP's bucket all-reduces launched by the rank's last B; ZeRO-2's UNSHARD once for two virtual stages
    ("gpt", 2, 2, 1, "1f1b", 1, 0),
    ("gpt", 2, 2, 1, "interleaved-1f1b", 2, 2),
    # ZB-H1: backward split into I and W; the last W launches the DDP buckets' all-reduces; tp's
    # collectives in I; the tied embedding / LM head's gradient complete after the last W
    ("gpt", 2, 1, 1, "zb-h1", 1, 0),
    ("gpt", 4, 1, 1, "zb-h1", 1, 0),
    ("gpt", 2, 2, 1, "zb-h1", 1, 0),
    ("gpt", 2, 2, 1, "zb-h1", 1, 1),
    ("gpt", 2, 2, 1, "zb-h1", 1, 2),
    ("gpt", 2, 1, 2, "zb-h1", 1, 0),
    ("hf", 2, 1, 1, "gpipe", 1, 0),
    ("hf", 2, 1, 1, "1f1b", 1, 0),
    ("hf", 2, 1, 1, "interleaved-1f1b", 2, 0),
    ("hf", 4, 1, 1, "gpipe", 1, 0),
    ("hf", 4, 1, 1, "1f1b", 1, 0),
    ("hf", 1, 1, 2, "1f1b", 1, 0),
    ("hf", 1, 1, 4, "1f1b", 1, 0),
    ("hf", 2, 1, 2, "1f1b", 1, 0),
    ("hf", 2, 2, 2, "1f1b", 1, 1),
    ("hf", 2, 2, 1, "1f1b", 1, 3),
    # HF Llama: vocab-parallel (untied) embedding, rotary tables from a no_grad region, grouped-query attention
    ("llama", 1, 1, 2, "1f1b", 1, 0),
    ("llama", 2, 1, 2, "1f1b", 1, 0),
    ("hf", 2, 1, 1, "zb-h1", 1, 0),
    ("llama", 2, 1, 1, "zb-h1", 1, 0),
    ("llama", 2, 2, 1, "zb-h1", 1, 1),
    # interleaved zero bubble (torch's ScheduleInterleavedZeroBubble order: two stages per rank, stage % pp, W
    # deferred into the bubble) and ZB-V (stage s and 2 pp - 1 - s on rank s: the V codegen places)
    ("gpt", 2, 1, 1, "interleaved-zb", 2, 0),
    ("gpt", 2, 2, 1, "interleaved-zb", 2, 0),
    ("gpt", 2, 2, 1, "interleaved-zb", 2, 1),
    ("gpt", 2, 1, 1, "zb-v", 2, 0),
    ("gpt", 2, 2, 1, "zb-v", 2, 0),
    ("gpt", 2, 2, 1, "zb-v", 2, 1),
    ("llama", 2, 1, 1, "interleaved-zb", 2, 0),
    ("llama", 2, 2, 1, "interleaved-zb", 2, 1),
    ("llama", 2, 1, 1, "zb-v", 2, 0),
    ("llama", 2, 2, 1, "zb-v", 2, 1),
    ("gpt", 2, 1, 2, "interleaved-zb", 2, 0),
    ("gpt", 2, 1, 2, "zb-v", 2, 0),
    # four pipeline ranks, eight virtual stages: interleaved-zb's rounds of pp microbatches; zb-v with m = 4 <
    # 2 pp - 1, its V not filled (the lists built for 2 pp - 1 microbatches, the missing ones dropped)
    ("gpt8", 4, 1, 1, "zb-h1", 1, 0),
    ("llama8", 4, 1, 1, "zb-h1", 1, 0),
    ("gpt8", 4, 1, 1, "interleaved-zb", 2, 0),
    ("gpt8", 4, 1, 1, "zb-v", 2, 0),
    ("llama8", 4, 1, 1, "interleaved-zb", 2, 0),
    ("llama8", 4, 1, 1, "zb-v", 2, 0),
    # ZeRO-3 under a split backward: I gathers a unit and leaves its gradient to W, whose AccumulateGrad
    # reduce-scatters it; ZeRO-2 for the two-stage-per-rank schedules
    ("gpt", 2, 2, 1, "zb-h1", 1, 3),
    ("gpt", 2, 2, 1, "interleaved-zb", 2, 3),
    ("gpt", 2, 2, 1, "zb-v", 2, 3),
    ("llama", 2, 2, 1, "zb-v", 2, 3),
    ("gpt", 2, 2, 1, "interleaved-zb", 2, 2),
    ("gpt", 2, 2, 1, "zb-v", 2, 2),
    # DualPipe-V (torch's ScheduleDualPipeV order, zb-v's V; each forward / backward pair run in turn): whole
    # backwards B in the steady state beside split ones (I, W) in the cool-down, on one rank; m = 4 = 2 pp
    ("gpt", 2, 1, 1, "dualpipe-v", 2, 0),
    ("gpt", 2, 1, 2, "dualpipe-v", 2, 0),
    ("llama", 2, 1, 1, "dualpipe-v", 2, 0),
]


# Also compiled from the model on the meta device: generated code must not bake in the trace's device
# (positions and masks made on meta would read uninitialised memory). What could bake it in is the model's
# code (its positions, masks, rotary tables) as each kind of program cuts and rewrites it: each model family
# under pipeline stages, tensor slices, both with ZeRO, a split backward and two stages a rank.
ON_META = [
    ("gpt", 2, 1, 1, "1f1b", 1, 0),
    ("gpt", 1, 1, 2, "1f1b", 1, 0),
    ("gpt", 2, 2, 2, "1f1b", 1, 1),
    ("gpt", 2, 2, 1, "1f1b", 1, 3),
    ("gpt8", 4, 1, 1, "interleaved-1f1b", 2, 0),
    ("gpt", 2, 2, 1, "zb-v", 2, 1),
    ("hf", 2, 1, 1, "1f1b", 1, 0),
    ("hf", 1, 1, 2, "1f1b", 1, 0),
    ("hf", 2, 2, 2, "1f1b", 1, 1),
    ("hf", 2, 1, 1, "zb-h1", 1, 0),
    ("llama", 2, 1, 2, "1f1b", 1, 0),
    ("llama", 2, 2, 1, "interleaved-zb", 2, 1),
    ("llama8", 4, 1, 1, "zb-v", 2, 0),
]
assert set(ON_META) <= set(CASES)


@pytest.mark.parametrize("name,pp,dp,tp,schedule,interleave,zero,on",
                         [(*c, "cpu") for c in CASES] + [(*c, "meta") for c in ON_META],
                         ids=[f"{c[0]}-pp{c[1]}-dp{c[2]}-tp{c[3]}-{c[4]}{'x2' if c[5] > 1 else ''}-zero{c[6]}-{on}"
                              for on, cases in (("cpu", CASES), ("meta", ON_META)) for c in cases])
def test_trains_like_one_process(name, pp, dp, tp, schedule, interleave, zero, on):
    """Compiled from the model on the CPU, and (ON_META) on the meta device."""
    plan = plan_for(name, pp=pp, dp=dp, tp=tp, schedule=schedule, interleave=interleave, zero=zero, on=on)
    assert (plan.pp, plan.dp, plan.tp, plan.zero_stage) == (pp, dp, tp, zero)
    out = assert_same_training(plan, name)
    if pp > 1:  # point-to-point messages per rank = its instruction list's, one per SEND/RECV: receivers
        assert plan.code.hidden_shape is not None  # size activations from their own inputs, no shape header
        sched = plan.instructions
        ends = {sched.rank_of(0), sched.rank_of(len(plan.stages) - 1)}
        for m in plan.mesh:
            ops = [a.op.value for a in plan.instructions.ranks[m.pp]]
            sends = ops.count("SEND_F") + ops.count("SEND_B")
            recvs = ops.count("RECV_F") + ops.count("RECV_B")
            # and a tied embedding / LM head on two pipeline ranks: its gradient one way, the sum back
            # (runtime.pipeline.runner), one send and one receive per tied parameter on each holder
            tied = re.search(r"^TIED = (.*)$", plan.program(m.rank).source, re.M)
            if len(ends) == 2 and m.pp in ends:
                sends, recvs = sends + len(ast.literal_eval(tied.group(1))), recvs + len(ast.literal_eval(tied.group(1)))
            counts = out.collective_counts[m.rank]
            assert (counts.get("send", 0), counts.get("recv", 0)) == (STEPS * sends, STEPS * recvs), m


def test_a_split_backward_under_zero3_reduce_scatters_no_more_than_1f1b():
    """ZeRO-3 under zb-h1: an I reduce-scatters nothing (a plain backward's end would reduce-scatter zeros for
    every unit), a W each unit it reaches once, so each rank issues 1F1B's reduce-scatters; W's all-gathers
    are the extra (the units I's end freed, gathered again), none on stage 0, whose W is the whole backward."""
    model_fn, loss_fn = MODELS["gpt"]
    data = batches(2)
    counts = {}
    for schedule in ("1f1b", "zb-h1"):
        plan = plan_for("gpt", pp=2, dp=2, tp=1, schedule=schedule, zero=3)
        counts[schedule] = launch_local(plan, model_fn, adamw, loss_fn, data, timeout_s=180).collective_counts
    for rank, (one, zb) in enumerate(zip(counts["1f1b"], counts["zb-h1"], strict=True)):
        assert zb["reduce_scatter"] == one["reduce_scatter"], rank
        assert zb["all_gather"] > one["all_gather"] if rank >= 2 else zb["all_gather"] >= one["all_gather"], rank


DUALPIPE_CASES = [
    # model, pp, dp, zero: microbatches of 1, so each replica has the 2 pp microbatches DualPipe-V needs
    ("gpt", 2, 2, 1),
    ("gpt", 2, 2, 3),
    ("gpt8", 4, 1, 0),
]


@pytest.mark.parametrize("name,pp,dp,zero", DUALPIPE_CASES,
                         ids=[f"{c[0]}-pp{c[1]}-dp{c[2]}-dualpipe-v-zero{c[3]}" for c in DUALPIPE_CASES])
def test_dualpipe_v_trains_like_one_process(name, pp, dp, zero):
    plan = plan_for(name, pp=pp, dp=dp, tp=1, schedule="dualpipe-v", interleave=2, zero=zero, mb=1, on="meta")
    assert (plan.config.schedule, plan.num_microbatches, plan.config.zero_stage) == ("dualpipe-v", 2 * pp, zero)
    ops = {a.op.value for actions in plan.instructions.ranks for a in actions}
    assert {"B", "I", "W"} <= ops  # whole and split backwards in one step
    assert_same_training(plan, name)


SP_CASES = [
    # model, pp, dp, tp, zero, optimizer: Megatron sequence parallelism in the tensor group
    ("gpt", 1, 1, 2, 0, "sgd"),    # vocab-parallel embedding reduce-scattered, position embedding cut by tokens
    ("gpt", 1, 1, 4, 0, "adamw"),
    ("gpt", 2, 2, 2, 1, "adamw"),  # the hidden state sent between stages is this rank's tokens
    ("gpt", 1, 2, 2, 3, "sgd"),    # ZeRO-3's gathered parameters under token-split layer norms
    ("hf", 1, 1, 2, 0, "sgd"),     # Conv1D's flattened rows: tokens gathered where a view merges them
    ("llama", 1, 1, 2, 0, "sgd"),  # RMSNorm, rotary positions on the gathered tokens, untied vocab head
    ("llama", 2, 1, 2, 0, "adamw"),
]


@pytest.mark.parametrize("name,pp,dp,tp,zero,opt", SP_CASES,
                         ids=[f"{c[0]}-pp{c[1]}-dp{c[2]}-tp{c[3]}-zero{c[4]}-{c[5]}" for c in SP_CASES])
def test_sequence_parallel_trains_like_one_process(name, pp, dp, tp, zero, opt):
    plan = plan_for(name, pp=pp, dp=dp, tp=tp, zero=zero, sp=True, on="meta" if pp > 1 else "cpu")
    assert plan.config.sp and plan.code.sp_dim is not None
    assert_same_training(plan, name, optimizer={"sgd": sgd, "adamw": adamw}[opt])


def test_sequence_parallel_under_zero_bubble_trains_like_one_process():
    """zb-h1 runs a block's backward twice (I, then W later): each unpacks the token shards the column matmuls
    kept and gathers them again, in the same order on every rank of the tensor group."""
    plan = plan_for("gpt", pp=2, dp=1, tp=2, schedule="zb-h1", sp=True)
    assert plan.config.sp and plan.config.schedule == "zb-h1"
    assert_same_training(plan, "gpt", optimizer=sgd)


@pytest.mark.parametrize("recompute", ["selective", "full", "selective-op"])
def test_sequence_parallel_recomputes_its_gathers_like_one_process(recompute):
    """Recomputation re-runs the token gathers in backward, under the saved-tensor hooks that keep them as
    shards: every rank issues the same collectives in the same order."""
    plan = plan_for("gpt", pp=2, dp=1, tp=2, recompute=recompute, sp=True)
    assert plan.config.sp and plan.config.recompute == recompute
    assert_same_training(plan, "gpt", optimizer=sgd)


@pytest.mark.parametrize("on", ["cpu", "meta"])
@pytest.mark.parametrize("name,pp,dp,tp,zero,recompute", [
    ("gpt", 2, 1, 2, 0, "selective"), ("gpt", 2, 1, 2, 0, "full"), ("hf", 2, 2, 1, 3, "selective"),
    ("llama", 1, 1, 2, 0, "selective"), ("gpt", 2, 1, 2, 0, "selective-op"), ("llama", 1, 1, 2, 0, "selective-op")])
def test_recomputing_stages_train_like_one_process(name, pp, dp, tp, zero, recompute, on):
    """runtime.engines.recompute inside pipeline and tensor-parallel stages: selective and selective-op re-run the ops
    they do not keep, tensor-parallel collectives included; full the whole block."""
    plan = plan_for(name, pp=pp, dp=dp, tp=tp, zero=zero, recompute=recompute, on=on)
    assert plan.config.recompute == recompute
    assert_same_training(plan, name)


def test_every_plan_compile_makes_runs_and_trains_like_one_process():
    """The chosen plan for 8 local processes and its top runners-up, each pinned and run for 2 steps."""
    example = (torch.randint(0, VOCAB, (2, SEQ)),)
    best = compile(gpt_4l_seeded(), "local:8", example_inputs=example, global_batch_size=BATCH, precision="fp32",
                   alternatives=4)
    configs = [best.config] + [a.config for a in best.alternatives[:3]]
    for c in configs:
        with torch.device("meta"):  # compiled from the meta device; the other cases compile from CPU too
            model = gpt_4l_seeded()
        plan = compile(model, "local:8", example_inputs=(example[0].to("meta"),), global_batch_size=BATCH,
                       precision="fp32",
                       dp=c.dp, tp=c.tp, pp=c.pp, zero_stage=c.zero_stage, microbatch_size=c.microbatch_size,
                       schedule=c.schedule, interleave=c.interleave, recompute=c.recompute,
                       sp=c.sp if c.tp > 1 else None)
        assert plan.config == c
        assert_same_training(plan, "gpt", steps=2)


@pytest.mark.parametrize("on", ["cpu", "meta"])
def test_clipping_counts_every_shard_of_every_stage_once(on):
    """pp 2 x dp 2 x tp 2, ZeRO-2, clip at a norm the gradients exceed: equal to torch's clip_grad_norm_."""
    model_fn, loss_fn = MODELS["gpt"]
    with torch.device(on):
        model = model_fn()
    plan = compile(model, "local:8", example_inputs=(torch.randint(0, VOCAB, (2, SEQ), device=on),),
                   global_batch_size=BATCH, precision="fp32", pp=2, dp=2, tp=2, zero_stage=2, microbatch_size=2,
                   schedule="1f1b", clip_grad_norm=0.05)
    data = batches(2)
    out = launch_local(plan, model_fn, adamw, loss_fn, data, timeout_s=180)
    losses, model, norms = train_one_process(model_fn, adamw, loss_fn, data, clip_grad_norm=0.05)
    assert min(norms) > 0.05  # it does clip
    assert_trains_like(out, losses, model.state_dict(), adam_steps=len(data))


@pytest.mark.parametrize("on", ["cpu", "meta"])
def test_bf16_mixed_precision_3d_follows_fp32_training(on):
    """pp 2 x tp 2 in bf16-mixed: fp32 masters, bf16 compute; the losses track fp32 training closely."""
    model_fn, loss_fn = MODELS["hf"]
    with torch.device(on):
        model = model_fn()
    plan = compile(model, "local:4", example_inputs=(torch.randint(0, VOCAB, (2, SEQ), device=on),),
                   global_batch_size=BATCH, precision="bf16-mixed", pp=2, dp=1, tp=2, microbatch_size=2,
                   schedule="1f1b")
    data = batches()
    out = launch_local(plan, model_fn, adamw, loss_fn, data, timeout_s=180)
    want, _ = reference(model_fn, loss_fn, data)
    torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(want), rtol=0, atol=2e-2)
    assert all(v.dtype == torch.float32 for v in out.state_dict.values() if v.is_floating_point())


@pytest.mark.parametrize("on", ["cpu", "meta"])
def test_a_loss_computed_inside_the_model_reads_the_labels_on_the_last_stage(on):
    """model(idx, targets) -> (logits, loss): the suffix reads the targets, a model input every rank has;
    with tp the tied embedding / LM head is vocab-parallel and the cross entropy is the parallel one."""
    model_fn = gpt_4l_seeded
    two = (torch.randint(0, VOCAB, (2, SEQ), device=on), torch.randint(0, VOCAB, (2, SEQ), device=on))  # distinct: export would alias one
    with torch.device(on):
        model = model_fn()
    plan = compile(model, "local:4", example_inputs=two, global_batch_size=BATCH, precision="fp32", pp=2, dp=1, tp=2, microbatch_size=2, schedule="1f1b")
    assert plan.code.suffix.model_inputs == ("targets",)
    data = [((x, y), y) for x, y in batches()]
    # SGD with momentum: every parameter element is compared at rtol 1e-5, and Adam would turn the rounding
    # noise of a gradient near zero (the vocab-parallel cross entropy sums in another order) into a full step
    out = launch_local(plan, model_fn, sgd, in_model_loss, data, timeout_s=180)
    # gpt_loss is the model's own cross entropy (its ignore_index -1 matches no target)
    losses, model, _ = train_one_process(model_fn, sgd, gpt_loss, batches())
    assert_trains_like(out, losses, model.state_dict())


def test_a_list_without_grad_sync_is_refused_where_a_tied_gradient_needs_it():
    """The tied embedding / LM-head gradient is summed over its two holders at GRAD_SYNC (the first holder posts
    its receive before its last backward); an edited list without it would train each holder on half the
    gradient. It is refused when the runner is built, naming the fix, before any step."""
    from runtime.launch.env import LaunchError

    plan = plan_for("gpt", pp=2, dp=1, tp=1)
    programs = {r: re.sub(rf"\b{r}GRAD_SYNC ?", "", plan.program(r).source) for r in range(2)}
    assert all(re.search(r"\dGRAD_SYNC", src) is None for src in programs.values())
    model_fn, loss_fn = MODELS["gpt"]
    with pytest.raises(LaunchError, match="has no GRAD_SYNC"):
        launch_local(plan, model_fn, sgd, loss_fn, batches(1), programs=programs, timeout_s=60)
