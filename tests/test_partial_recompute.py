"""Full recomputation of part of the blocks (`recompute_blocks`, Megatron-LM's recompute_num_layers and
torchtitan's every-N-th-block AC): declared, costed between none and full, chosen by the planner where keeping
every activation does not fit, and run by every program on exactly the blocks the plan names."""

from __future__ import annotations

import pytest
import torch

from cost_models.choices import RECOMPUTE_POLICIES
from examples import gpt as gpt_mod
from examples import training
from partitioner import DeclarationError, compile, trace
from partitioner.planner.declarations import Declarations, recompute_blocks_pin
from partitioner.planner.plan import Plan
from partitioner.planner.search import PARTIAL_RECOMPUTE
from runtime.engines.recompute import run_recomputed
from runtime.launch.local import launch_local

GB = 8


@pytest.fixture(scope="module")
def graph8():
    """The example GPT with 8 blocks, traced on the meta device."""
    with torch.device("meta"):
        model = training.gpt_8l_seeded()
    return trace(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))


def _pinned(g, **pins):
    return compile(g, "local:2", global_batch_size=64, precision="fp32", pp=2, dp=1, microbatch_size=8,
                   schedule="1f1b", **pins)


def test_declared_as_k_of_n_and_pins_full_recomputation():
    assert recompute_blocks_pin("1/2") == (1, 2) and recompute_blocks_pin((2, 3)) == (2, 3)
    assert recompute_blocks_pin("4/4") == (1, 1)  # every block
    d = Declarations.declare(global_batch_size=8, recompute_blocks="1/2")
    assert (d.recompute, d.recompute_blocks) == ("full", (1, 2))
    for bad in ("0/2", "3/2", "half", 2, (1,)):
        with pytest.raises(DeclarationError, match="recompute_blocks=.*1 <= k <= n"):
            Declarations.declare(global_batch_size=8, recompute_blocks=bad)
    with pytest.raises(DeclarationError, match="recompute='selective'.*pin recompute='full'"):
        Declarations.declare(global_batch_size=8, recompute="selective", recompute_blocks="1/2")


def test_costs_lie_between_none_and_full_and_fall_with_the_share(graph8):
    """Each block that keeps its activations saves a forward in the backward and holds more: time rises and
    memory falls from none through 1/4, 1/2, 3/4 of the blocks to all of them."""
    plans = [_pinned(graph8, recompute="none")] + [_pinned(graph8, recompute_blocks=s) for s in ("1/4", "1/2", "3/4")] \
        + [_pinned(graph8, recompute="full")]
    times = [p.predicted.step_time_s for p in plans]
    acts = [p.predicted.memory.activations for p in plans]
    assert times == sorted(times) and len(set(times)) == len(times), times
    assert acts == sorted(acts, reverse=True) and len(set(acts)) == len(acts), acts
    # half the blocks recompute: half of each block's forward again, against full recomputation's whole
    extra = {p.config.recompute_text: p.predicted.step_time_s - times[0] for p in plans}
    assert extra["full:1/2"] == pytest.approx(extra["full"] / 2, rel=0.1), extra


def test_the_planner_recomputes_the_fewest_blocks_that_fit(graph8):
    """With room between what full recomputation needs and what every lighter policy does (selective-op, the
    least of them, just over the cap), the plan recomputes part of the blocks, fits, and is faster than
    recomputing all of them; pinned recompute='full' still recomputes every block."""
    none, full = _pinned(graph8, recompute="none"), _pinned(graph8, recompute="full")
    cap = 0.99 * _pinned(graph8, recompute="selective-op").predicted.peak_memory_bytes
    assert full.predicted.peak_memory_bytes < cap
    fraction = cap / none.predicted.memory_capacity_bytes
    plan = _pinned(graph8, max_memory_fraction=fraction)
    k, n = plan.config.recompute_blocks
    assert plan.config.recompute == "full" and 1 <= k < n, plan.config
    assert plan.predicted.peak_memory_bytes <= cap
    assert none.predicted.step_time_s < plan.predicted.step_time_s < full.predicted.step_time_s
    assert f"recompute=full:{k}/{n}" in str(plan) and "keep their activations" in str(plan)
    assert _pinned(graph8, recompute="full", max_memory_fraction=fraction).config.recompute_blocks == (1, 1)
    # one share fewer does not fit (the shares are tried least first)
    fewer = PARTIAL_RECOMPUTE[PARTIAL_RECOMPUTE.index((k, n)) - 1] if (k, n) != PARTIAL_RECOMPUTE[0] else None
    if fewer is not None:
        less = _pinned(graph8, recompute_blocks=fewer)
        assert less.predicted.peak_memory_bytes > cap
    again = Plan.from_json(plan.to_json())
    assert again.config == plan.config and again.config.recompute_blocks == (k, n)


def test_programs_recompute_exactly_the_blocks_the_plan_names(graph8):
    """Data-parallel programs checkpoint the chosen blocks by name; pipeline and tensor-parallel stages pass
    the share to their StageModel, which runs block i under full recomputation where i % n < k."""
    dp = compile(graph8, "local:2", global_batch_size=GB, precision="fp32", dp=2, microbatch_size=4,
                 recompute_blocks="1/2")
    assert "for i in range(8) if i % 2 < 1), 'full')" in dp.program(0).source
    pp = _pinned(graph8, recompute_blocks="2/3")
    assert "recompute='full', recompute_blocks=(2, 3)" in pp.program(1).source


def test_a_stage_recomputes_the_blocks_its_share_picks(monkeypatch):
    """runtime.pipeline.stage: block i runs under full recomputation where i % n < k, the others as they are."""
    from runtime.pipeline import stage as stage_mod
    calls = []

    def spy(mode, fn, *args, **kwargs):
        calls.append(mode)
        return run_recomputed(mode, fn, *args, **kwargs)

    monkeypatch.setattr(stage_mod, "run_recomputed", spy)
    model = training.gpt_8l_seeded()
    plan = compile(model, "local:2", example_inputs=gpt_mod.example_batch(model, 2, seq_len=16),
                   global_batch_size=GB, precision="fp32", pp=2, dp=1, microbatch_size=4, recompute_blocks="1/4")
    plan.verify(training.gpt_8l_seeded)
    per_block = calls[:8]  # the verify's first forward of stages 0 and 1: blocks 0-7 in order
    assert per_block == ["full", "none", "none", "none", "full", "none", "none", "none"], calls


@pytest.mark.slow
def test_data_parallel_partial_recompute_trains_like_one_process_and_holds_between():
    """ZeRO-3 on 2 Gloo ranks recomputing 1 of 2 blocks: the same training as one process, and a step peak
    between what recomputing none and every block hold (4 blocks: at the end of the forward the two kept blocks'
    activations are all held, where full recomputation holds four inputs)."""
    model = training.gpt_4l_seeded()
    g = trace(model, gpt_mod.example_batch(model, 2, seq_len=32))
    batches = [gpt_mod.example_batch(training.gpt_4l_seeded(), GB, seq_len=32, seed=s) for s in range(3)]
    ref = training.train_one_process(training.gpt_4l_seeded, training.adamw, training.gpt_loss, batches)
    peaks = {}
    for pins in (dict(recompute="none"), dict(recompute_blocks="1/2"), dict(recompute="full")):
        plan = compile(g, "local:2", global_batch_size=GB, pp=1, tp=1, zero_stage=3, microbatch_size=4,
                       precision="fp32", **pins)
        out = launch_local(plan, training.gpt_4l_seeded, training.adamw, training.gpt_loss, batches, probe_step=1,
                           timeout_s=120)
        assert out.losses == pytest.approx(ref.losses, rel=1e-5, abs=1e-6)
        for name, want in ref.model.named_parameters():
            torch.testing.assert_close(out.state_dict[name], want.detach(), rtol=1e-5, atol=1e-6)
        peaks[plan.config.recompute_text] = min(out.peak_step_bytes)
    assert peaks["none"] > peaks["full:1/2"] > peaks["full"], peaks


@pytest.mark.slow
@pytest.mark.parametrize("name,pins,opt", [("gpt", dict(pp=2, dp=1, tp=2), "sgd"),
                                           ("llama", dict(pp=2, dp=2, tp=1, zero_stage=1), "adamw")])
def test_pipeline_partial_recompute_trains_like_one_process(name, pins, opt):
    """Recomputing 1 of 2 blocks in pipeline stages: pp 2 x tp 2 (tensor-parallel collectives re-run in the
    recomputed blocks), and HF Llama at pp 2 x dp 2 with ZeRO-1."""
    from test_3d_equivalence import MODELS, VOCAB, assert_same_training

    with torch.device("meta"):
        model = MODELS[name][0]()
    world = pins["pp"] * pins["dp"] * pins["tp"]
    plan = compile(model, f"local:{world}", example_inputs=(torch.randint(0, VOCAB, (2, 16), device="meta"),),
                   global_batch_size=GB, precision="fp32", microbatch_size=2, recompute_blocks="1/2", **pins)
    assert plan.config.recompute_text == "full:1/2"
    assert_same_training(plan, name, optimizer=getattr(training, opt))

def test_the_cli_pins_it():
    """`partitioner compile --recompute-blocks K/N`; a bad share is refused before anything is planned."""
    from test_cli import TINY, cli_all

    runs = cli_all({"ok": ("compile", TINY, "--topology", "local:2", "--global-batch-size", "8", "--pp", "2",
                           "--recompute-blocks", "1/2"),
                    "bad": ("compile", TINY, "--topology", "local:2", "--global-batch-size", "8",
                            "--recompute-blocks", "3/2")})
    assert runs["ok"].returncode == 0, runs["ok"].stderr
    assert "recompute=full:1/2" in runs["ok"].stdout
    assert runs["bad"].returncode != 0 and "recompute_blocks='3/2'" in runs["bad"].stderr


def test_the_plan_is_never_slower_than_a_recomputation_that_fits(graph8):
    """Under a memory cap at each option's own peak, the plan is at least as fast as every recompute option that
    fits there (each mode, each share of the blocks): a leader under a lighter policy (selective-op) does not end
    the search for shares, since part of the blocks recomputed fully may fit and run faster."""
    pinned = [_pinned(graph8, recompute=r) for r in RECOMPUTE_POLICIES] + \
        [_pinned(graph8, recompute_blocks=share) for share in PARTIAL_RECOMPUTE]
    capacity = pinned[0].predicted.memory_capacity_bytes
    for cap in sorted({p.predicted.peak_memory_bytes for p in pinned})[:-1]:
        fits = [p for p in pinned if p.predicted.peak_memory_bytes <= cap]
        plan = _pinned(graph8, max_memory_fraction=cap / capacity)
        best = min(fits, key=lambda p: p.predicted.search_step_time_s)  # the search's objective
        assert plan.predicted.search_step_time_s <= best.predicted.search_step_time_s * (1 + 1e-9), \
            (cap, plan.config, best.config)
