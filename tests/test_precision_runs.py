"""Precision recipes run for real over Gloo (2 spawned ranks), each against one process running the same recipe:
pure bf16 (runtime.engines.mixed_precision's "bf16"), the bf16 gradient reduction of grad_reduce_dtype="bf16"
under bf16-mixed, Megatron's distributed optimizer (optimizer_layout="distributed"). Their costs:
test_precision_recipes.py.

Tolerances, and why:

- Pure bf16 against one process holding the model in bf16 with the same AdamW (its state bf16 too). The two
  differ only by rounding: each rank's gradient of its half of the batch is rounded to bf16, averaged in bf16,
  where one process rounds the gradient of the whole batch once. AdamW normalises its step (m / sqrt(v) is
  about +-1 per element whatever the gradient's size), so a gradient that differs in its last bit moves a
  parameter by at most 2 lr more per step where the rounding flips the sign of a near-zero gradient, and the
  step itself lands on the bf16 grid: after k steps a parameter is within k (2 lr + ulp) of the reference,
  ulp = 2^-7 |p| (bf16 keeps 8 significant bits); measured, a quarter of that bound at most (8e-4). Losses
  are bf16 (2^-8 relative each: the ranks' mean of two rounded halves against one rounded whole, then
  parameters that differ as above): within 2^-6 relative (measured 2.3e-3, 2^-8.8, from the first step).
- The bf16 reduction is checked bit for bit: with 2 ranks the engine's fp32 gradient must be exactly
  bf16(bf16(g0 / 2) + bf16(g1 / 2)) of the ranks' own fp32 gradients (one rounding of each half, one of the
  sum), and within 2^-8 of their fp32 mean, relative to the larger half.
- The distributed optimizer is ZeRO-1: its programs are ZeRO-1's, and in fp32 it trains like one process to
  the tolerance of every data-parallel equivalence test (ranks.assert_trains_like).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from examples import training
from examples.gpt import example_batch, gpt_tiny
from partitioner import compile, trace
from ranks import assert_trains_like, gloo_group, pattern_batches
from runtime.comm.collectives import Collectives
from runtime.engines.data_parallel import DataParallel
from runtime.launch.env import LaunchError
from runtime.launch.local import launch_local

pytestmark = pytest.mark.slow

STEPS = 3
LR = training.ADAMW_LR
BATCHES = [(x.contiguous(), y.contiguous()) for x, y in pattern_batches(seed=3, steps=STEPS, batch=8, seq=16)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt_tiny(n_layer=2)


def _loss(model, x, y) -> torch.Tensor:
    return model(x, y)[1].float()


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=training.ADAMW_EPS)


# ---- one process: the recipes' truth -------------------------------------------------------------
@functools.cache
def _pure_bf16_reference() -> dict:
    model = _model().to(torch.bfloat16)
    opt = _adamw(model.parameters())
    losses = []
    for x, y in BATCHES:
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().float() for k, v in model.named_parameters()}}


# ---- the ranks -----------------------------------------------------------------------------------
def _pure_bf16(stage: int, rank: int, world: int, compression: str = "none") -> dict:
    coll = Collectives()
    dp = DataParallel(_model(), group=None, ranks=tuple(range(world)), zero_stage=stage, collectives=coll,
                      precision="bf16", compression=compression)
    opt = _adamw(dp.optimizer_params())
    out = {"losses": [], "dtypes": {p.dtype for p in dp.optimizer_params()}}
    for x, y in BATCHES:
        n = x.shape[0] // world
        loss = _loss(dp.module, x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        loss.backward()
        dp.finish_gradients()
        opt.step()
        dp.after_step()
        out["held"] = dp.held_bytes(opt)
        dp.zero_grad()
        t = loss.detach().reshape(1)
        dist.all_reduce(t)  # test bookkeeping
        out["losses"].append(t.item() / world)
    out["state"] = dp.full_state_dict()
    return out


def _bf16_reduction(stage: int, rank: int, world: int) -> dict:
    """One backward of bf16-mixed reduced with the "bf16" compressor (what grad_reduce_dtype="bf16" runs), the
    engine's fp32 gradients beside every rank's own fp32 gradient of its rows (a bf16 copy of the broadcast
    model: the engine's local gradient, before any reduction)."""
    dp = DataParallel(_model(), group=None, ranks=tuple(range(world)), zero_stage=stage, collectives=Collectives(),
                      precision="bf16-mixed", compression="bf16")
    x, y = BATCHES[0]
    n = x.shape[0] // world
    rows = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    copy = _model()
    copy.load_state_dict(_broadcast_state(copy))
    copy = copy.to(torch.bfloat16)
    _loss(copy, *rows).backward()
    local = torch.cat([p.grad.float().flatten() for p in copy.parameters()])
    halves = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(halves, local)  # test bookkeeping
    inputs = []  # the dtype of each gradient a ZeRO-3 unit's reduce-scatter was handed (test bookkeeping)
    if stage == 3:
        reduce = dp._reduce
        dp._reduce = lambda u, g: (inputs.append(g.dtype), reduce(u, g))[1]
    _loss(dp.module, *rows).backward()
    dp.finish_gradients()
    if stage == 0:
        reduced = torch.cat([p.grad.flatten() for p in dp.optimizer_params()])
    else:  # ZeRO-2/3: this rank's shard of each flat gradient, in layout order; gather the shards back
        by_name = {}
        for f in dp._flats:
            full = torch.empty(f.layout.padded_numel)
            dist.all_gather_into_tensor(full, f.shard.grad)
            by_name.update(zip(f.layout.names, f.layout.views(full)))
        reduced = torch.cat([by_name[k].flatten() for k, _ in copy.named_parameters()])
    return {"halves": halves, "reduced": reduced, "inputs": inputs}


def _mixed_held(stage: int, rank: int, world: int) -> dict:
    """What bf16-mixed holds after a step (before zero_grad), by DataParallel.held_bytes."""
    dp = DataParallel(_model(), group=None, ranks=tuple(range(world)), zero_stage=stage, collectives=Collectives(),
                      precision="bf16-mixed")
    opt = _adamw(dp.optimizer_params())
    x, y = BATCHES[0]
    _loss(dp.module, x[:2], y[:2]).backward()
    dp.finish_gradients()
    opt.step()
    dp.after_step()
    return dp.held_bytes(opt)


@torch.no_grad()
def _broadcast_state(model: torch.nn.Module) -> dict:
    """Rank 0's parameters (the engine broadcasts them; every rank here builds the same seeded model anyway)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for v in state.values():
        dist.broadcast(v, 0)
    return state


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, world, store_path):
        results = {("pure", s): _pure_bf16(s, rank, world) for s in (0, 1, 2, 3)}
        results.update({("reduce", s): _bf16_reduction(s, rank, world) for s in (0, 2, 3)})
        results.update({("mixed-held", s): _mixed_held(s, rank, world) for s in (0, 1, 2, 3)})
        results.update({("pure", s, c): _pure_bf16(s, rank, world, c) for s, c in ((0, "powersgd"), (2, "int8"))})
        if rank == 0:
            torch.save(results, Path(out_dir) / "rank0.pt")


@pytest.fixture(scope="module")
def ranks2(spawned):
    return spawned(_worker, 2)[0]


# ---- pure bf16 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pure_bf16_trains_like_one_bf16_process(ranks2, stage):
    got, want = ranks2["pure", stage], _pure_bf16_reference()
    assert got["dtypes"] == {torch.bfloat16}  # no fp32 masters: the optimizer steps bf16
    torch.testing.assert_close(got["losses"], want["losses"], rtol=2**-6, atol=0)
    for k, w in want["state"].items():
        bound = STEPS * (2 * LR + 2**-7 * w.abs())
        diff = (got["state"][k] - w).abs()
        assert (diff <= bound).all(), f"{k}: {diff.max().item():.3g} past {STEPS} x (2 lr + ulp)"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pure_bf16_holds_what_the_plan_charges(ranks2, stage):
    """2 + 2 + 4 bytes per parameter (AdamW's m and v in bf16), sharded as ZeRO says (cost_models.memory)."""
    from cost_models.memory import model_state_bytes

    held = ranks2["pure", stage]["held"]
    want = model_state_bytes(sum(p.numel() for p in _model().parameters()), precision="bf16", optimizer="adam",
                             zero_stage=stage, dp=2)
    for k in ("params", "grads", "optimizer"):
        v = getattr(want, k)
        assert abs(held[k] - v) <= 0.1 * v, f"{k}: held {held[k]}, charged {v:.0f}"


@pytest.mark.parametrize("stage,per_param", [
    (0, 2 + 4 + 4 + 8),            # bf16 parameters, fp32 gradient buffers, fp32 master, Adam's m and v
    (1, 2 + 4 + (4 + 8) / 2),      # the distributed optimizer: master and state sharded (Megatron: 6 + 12/d)
    (2, 2 + (4 + 4 + 8) / 2),      # + the fp32 gradient shard
    (3, (4 + 4 + 8) / 2)])         # no bf16 shard at rest: units are gathered from the fp32 master shard
def test_bf16_mixed_holds_fp32_gradients_as_the_plan_charges(ranks2, stage, per_param):
    """The mixed recipe's gradients accumulate in fp32 (4 B, not the ZeRO paper's 16-bit 2): what
    partitioner.planner.stage_costs charges at ZeRO 0-2; ZeRO-3's total is the paper's 16/dp."""
    held = ranks2["mixed-held", stage]
    P = sum(p.numel() for p in _model().parameters())
    assert abs(held["total"] - P * per_param) <= 0.01 * P * per_param, (held, P * per_param)


@pytest.mark.parametrize("stage,compression", [(0, "powersgd"), (2, "int8")])
def test_pure_bf16_gradients_go_through_the_compressors(ranks2, stage, compression):
    """The planner may compress pure bf16's reduction too (int8 codes of bf16 gradients; PowerSGD factors them
    in fp32): it runs, and trains as near the uncompressed run as compression allows on 3 steps."""
    got, plain = ranks2["pure", stage, compression], ranks2["pure", stage]
    assert got["dtypes"] == {torch.bfloat16}
    torch.testing.assert_close(got["losses"], plain["losses"], rtol=2**-5, atol=0)


# ---- bf16 gradient reduction ----------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_reduction_is_one_rounding_of_each_half_and_of_their_sum(ranks2, stage):
    """ZeRO-3 hands the reduce-scatter its units' bf16 gradients as they are (runtime.engines.zero3), ZeRO-0/2 their
    fp32 buffers: the same roundings on 2 ranks, where halving is exact."""
    got = ranks2["reduce", stage]
    assert set(got["inputs"]) == ({torch.bfloat16} if stage == 3 else set())  # no fp32 copy of a unit's gradient
    g0, g1 = got["halves"]
    bf = torch.bfloat16
    exact = ((g0 / 2).to(bf).float() + (g1 / 2).to(bf).float()).to(bf).float()
    torch.testing.assert_close(got["reduced"], exact, rtol=0, atol=0)
    mean = (g0 + g1) / 2
    assert ((got["reduced"] - mean).abs() <= 2**-8 * torch.maximum(g0.abs(), g1.abs())).all()


def test_zero3_bf16_reduction_trains_as_zero2s():
    """The compiled programs: ZeRO-3 sends each unit's bf16 gradient as it is, in the background; ZeRO-2 rounds its
    fp32 buckets to bf16 for the same wire. On 2 ranks (halving is exact), one microbatch a step, the same sums:
    the two plans train alike, bit for bit."""
    model = training.gpt_tiny_seeded()
    graph = trace(model, example_batch(model, 2, seq_len=32))
    kw = dict(global_batch_size=8, precision="bf16-mixed", microbatch_size=4, pp=1, tp=1, dp=2, compression="bf16")
    batches = [example_batch(model, 8, seq_len=32, seed=s) for s in range(STEPS)]
    zero2, zero3 = (launch_local(compile(graph, "local:2", zero_stage=z, **kw), training.gpt_tiny_seeded,
                                 training.adamw, training.gpt_loss, batches, timeout_s=120) for z in (2, 3))
    assert zero3.losses == zero2.losses
    for k, v in zero2.state_dict.items():
        assert torch.equal(zero3.state_dict[k], v), k


# ---- the distributed optimizer ----------------------------------------------------------------------
def test_distributed_optimizer_is_zero_1_and_trains_like_one_process():
    model = training.gpt_tiny_seeded()
    graph = trace(model, example_batch(model, 2, seq_len=32))
    kw = dict(global_batch_size=8, precision="fp32", microbatch_size=2, pp=1, tp=1)
    plan = compile(graph, "local:2", optimizer_layout="distributed", **kw)
    zero1 = compile(graph, "local:2", zero_stage=1, **kw)
    assert plan.config == zero1.config and plan.config.zero_stage == 1
    assert plan.declarations["optimizer_layout"] == "distributed"

    def body(p, rank: int) -> str:  # but for the plan's hash, which covers the declarations
        source = p.program(rank).source
        h = re.search(r"PROGRAM_HASH = '(\w+)'", source).group(1)
        return source.replace(h, "HASH").replace(h[:12], "HASH")

    assert all(body(plan, r) == body(zero1, r) for r in range(2))
    batches = [example_batch(model, 8, seq_len=32, seed=s) for s in range(STEPS)]
    out = launch_local(plan, training.gpt_tiny_seeded, training.adamw, training.gpt_loss, batches, timeout_s=120)
    ref = training.train_one_process(training.gpt_tiny_seeded, training.adamw, training.gpt_loss, batches)
    assert_trains_like(out, ref.losses, {k: v.detach() for k, v in ref.model.named_parameters()},
                       adam_steps=STEPS)


@pytest.mark.parametrize("mesh", [dict(dp=2, zero_stage=1), dict(pp=2), dict(tp=2)], ids=["zero1", "pp2", "tp2"])
def test_a_pure_bf16_plan_runs_its_generated_programs(mesh):
    """The compiled plan's programs (not the engine alone) run pure bf16, as the one process does: data
    parallel, and pipeline and tensor parallel (their stages step through the same engine, bf16 activations
    and gradients between ranks). Measured on a 4-layer GPT: about half of the parameters' bound (tp2: 0.55)."""
    model = training.gpt_tiny_seeded()
    graph = trace(model, (example_batch(model, 2, seq_len=32)[0],))
    plan = compile(graph, "local:2", global_batch_size=8, precision="bf16", microbatch_size=2,
                   **{"dp": 1, "pp": 1, "tp": 1, **mesh})
    assert "precision='bf16'" in plan.program(0).source
    batches = [example_batch(model, 8, seq_len=32, seed=s) for s in range(STEPS)]
    out = launch_local(plan, training.gpt_tiny_seeded, _adamw, training.gpt_loss, batches, timeout_s=120)

    def bf16_model():
        return training.gpt_tiny_seeded().to(torch.bfloat16)

    ref = training.train_one_process(bf16_model, _adamw, training.gpt_loss, batches)
    torch.testing.assert_close(out.losses, ref.losses, rtol=2**-6, atol=0)
    for k, w in ref.model.named_parameters():
        w = w.detach().float()
        assert ((out.state_dict[k] - w).abs() <= STEPS * (2 * LR + 2**-7 * w.abs())).all(), k


def test_pure_bf16_resumes_from_a_checkpoint_exactly(tmp_path):
    """Checkpoints hold fp32 boxes (runtime.checkpoint): bf16 parameters and AdamW state go there and back
    exactly, and the state is recreated in the parameters' dtype, so two steps, a save and two more are the
    four steps of one run, bit for bit."""
    model = training.gpt_tiny_seeded()
    graph = trace(model, (example_batch(model, 2, seq_len=32)[0],))
    plan = compile(graph, "local:2", global_batch_size=8, precision="bf16", microbatch_size=2, dp=2, zero_stage=1)
    batches = [example_batch(model, 8, seq_len=32, seed=s) for s in range(4)]
    run = functools.partial(launch_local, plan, training.gpt_tiny_seeded, _adamw, training.gpt_loss, timeout_s=120)
    whole = run(batches)
    first = run(batches[:2], save_dir=tmp_path, save_every=2)
    rest = run(batches, resume_from=tmp_path)
    assert first.losses + rest.losses == whole.losses
    for k, v in whole.state_dict.items():
        assert torch.equal(rest.state_dict[k], v), k


@pytest.mark.slow
@pytest.mark.parametrize("mesh, topology", [(dict(pp=2), "1x2xV100-32GB"),
                                            (dict(pp=2, dp=2, zero_stage=1), "1x4xV100-32GB")], ids=["pp2", "pp2-dp2"])
def test_fp16_pipeline_stages_scale_the_loss_once_and_skip_together(mesh, topology):
    """fp16-mixed under a pipeline (compiled for a GPU with fp16, run on CPU ranks): the loss scale enters once, at
    the model's output, not again at each stage's (each stage's call is the module's: an intermediate stage's
    gradient was scaled twice, overflowed, and that stage alone skipped its step while the others stepped, then
    the tied embedding went to NaN); the tied copies are unscaled with the rest; an overflow on any rank skips
    the step on every rank. Against the same recipe in one process (the one-rank plan: the engine scales the
    module's output): fp16 losses within 2^-7, and each parameter's update within 10 % of the one process's."""
    model = training.gpt_tiny_seeded()
    graph = trace(model, (example_batch(model, 2, seq_len=32)[0],))
    batches = [example_batch(model, 8, seq_len=32, seed=s) for s in range(STEPS)]
    runs = {}
    for name, pins, topo in (("one", dict(dp=1), "1x1xV100-32GB"), ("plan", mesh, topology)):
        plan = compile(graph, topo, global_batch_size=8, precision="fp16-mixed", microbatch_size=2,
                       **{"dp": 1, "pp": 1, "tp": 1, **pins})
        runs[name] = launch_local(plan, training.gpt_tiny_seeded, training.sgd, training.gpt_loss, batches,
                                  timeout_s=120, verify=False)
    one, got = runs["one"], runs["plan"]
    assert all(torch.isfinite(torch.tensor(got.losses))), got.losses
    torch.testing.assert_close(got.losses, one.losses, rtol=2**-7, atol=0)
    start = training.gpt_tiny_seeded().state_dict()
    for k, w0 in start.items():
        if w0.is_floating_point():
            want, moved = (one.state_dict[k] - w0).abs().sum(), (got.state_dict[k] - w0).abs().sum()
            assert abs(moved - want) <= 0.1 * want, (k, float(moved), float(want))


def overflowing_loss(output, targets):
    """The example loss times 1e8: its gradient at the fp16 logits (about 1e8 / tokens) overflows fp16 at any
    loss scale, so every fp16 step overflows."""
    return 1e8 * training.gpt_loss(output, targets)


@pytest.mark.slow
def test_an_fp16_overflow_skips_the_step_on_every_pipeline_rank_with_clipping():
    """An overflow skips the step everywhere, as in one process: no stage, replica or tied copy moves, and gradient
    clipping over the pipeline (which reads every gradient) has nothing to clip (its norm is inf)."""
    model = training.gpt_tiny_seeded()
    graph = trace(model, (example_batch(model, 2, seq_len=32)[0],))
    batches = [example_batch(model, 8, seq_len=32, seed=s) for s in range(2)]
    start = training.gpt_tiny_seeded().state_dict()
    for pins, topo in ((dict(dp=1), "1x1xV100-32GB"), (dict(pp=2, dp=2, zero_stage=1), "1x4xV100-32GB")):
        plan = compile(graph, topo, global_batch_size=8, precision="fp16-mixed", microbatch_size=2, clip_grad_norm=1.0,
                       **{"dp": 1, "pp": 1, "tp": 1, **pins})
        out = launch_local(plan, training.gpt_tiny_seeded, training.sgd, overflowing_loss, batches, timeout_s=120,
                           verify=False)
        assert all(torch.isfinite(torch.tensor(out.losses))), out.losses
        for k, w0 in start.items():
            assert torch.equal(out.state_dict[k], w0), (topo, k)


@pytest.mark.slow
def test_fp16_gradients_that_overflow_at_any_scale_stop_the_run_saying_why():
    """Skipping steps while the loss looks normal is training nothing: once the loss scale has backed off below 1
    (16 overflows from 2^15) and the gradients still overflow, every rank stops with the cause, under a pipeline
    as in one process."""
    model = training.gpt_tiny_seeded()
    graph = trace(model, (example_batch(model, 2, seq_len=32)[0],))
    batches = [example_batch(model, 8, seq_len=32, seed=s) for s in range(17)]
    for pins, topo in ((dict(dp=1), "1x1xV100-32GB"), (dict(pp=2), "1x2xV100-32GB")):
        plan = compile(graph, topo, global_batch_size=8, precision="fp16-mixed", microbatch_size=2,
                       **{"dp": 1, "pp": 1, "tp": 1, **pins})
        with pytest.raises(LaunchError, match=r"Fp16OverflowError.* not finite even at a loss scale of 0\.5 \(17 steps "
                                              r"skipped so far\).*bf16-mixed"):
            launch_local(plan, training.gpt_tiny_seeded, training.sgd, overflowing_loss, batches, timeout_s=120,
                         verify=False)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(pp=2), dict(tp=2)], ids=["pp2", "tp2"])
def test_fp16_llama_stage_code_keeps_the_norms_upcasts_and_trains_like_one_process(mesh):
    """Hugging Face's RMSNorm upcasts to fp32 around its variance. Traced with fp32 parameters the upcast and the
    cast back are one op; before the tracer told them apart (tracer.upcasts), stage code ran both in fp16, whose
    rsqrt backward overflows at a variance of 4e-4 on CPU ranks: every step skipped, no parameter moved. Against
    the one-rank plan (the model's own code): fp16 losses within 2^-7, each parameter's update within 10 %."""
    with torch.device("meta"):
        model = training.hf_llama_seeded()
    graph = trace(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 512, (8, 16), generator=g), torch.randint(0, 512, (8, 16), generator=g))
               for _ in range(STEPS)]
    runs = {}
    for name, pins, topo in (("one", dict(dp=1), "1x1xV100-32GB"), ("plan", mesh, "1x2xV100-32GB")):
        plan = compile(graph, topo, global_batch_size=8, precision="fp16-mixed", microbatch_size=2,
                       **{"dp": 1, "pp": 1, "tp": 1, **pins})
        runs[name] = launch_local(plan, training.hf_llama_seeded, training.sgd, training.hf_loss, batches,
                                  timeout_s=120, verify=False)
    one, got = runs["one"], runs["plan"]
    torch.testing.assert_close(got.losses, one.losses, rtol=2**-7, atol=0)
    start = training.hf_llama_seeded().state_dict()
    for k, w0 in start.items():
        want, moved = (one.state_dict[k] - w0).abs().sum(), (got.state_dict[k] - w0).abs().sum()
        assert want > 0 and abs(moved - want) <= 0.1 * want, (k, float(moved), float(want))
