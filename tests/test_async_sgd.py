"""Async SGD (issue 8): `compile(..., async_sgd=dict(every=k) | dict(staleness=s))`, its plan and its runtime.

Fast: the declarations refused and why, the plan's JSON, row and cost. Slow (real Gloo processes):
every=1 and staleness=0 train exactly like synchronous DDP; on a small regression task every=4 and
staleness=2 end within 2 % of synchronous training's loss; local SGD matches torch's PostLocalSGDOptimizer
(the oracle) in the same worker processes; staleness=s matches its definition simulated in one process,
and the replicas differ between averagings and agree after sync_now().
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from examples.mlp import MLP
from examples.training import adamw
from partitioner import OpGraph, Plan, compile, trace
from partitioner.planner.declarations import async_sgd_pin
from runtime.launch.local import launch_local
from ranks import gloo_group

IN, HIDDEN, OUT = 8, 32, 4
# the regression target y = A x + noise: A fixed, noise std 0.1 (the best achievable mean squared error is 0.01)
A = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1234)) / IN ** 0.5


# ---- module-level pieces, importable by the spawned workers ------------------------------------------------
def regression_mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(in_features=IN, hidden=(HIDDEN,), out=OUT)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def mse(output, targets) -> torch.Tensor:
    return F.mse_loss(output, targets)


def regression_batches(n: int, gb: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(gb, IN, generator=g)
        out.append((x, x @ A.T + 0.1 * torch.randn(gb, OUT, generator=g)))
    return out


@functools.cache
def regression_graph() -> OpGraph:
    """Traced once per process: the workers compile several plans of it."""
    return trace(regression_mlp(), (torch.zeros(2, IN),))


def regression_plan(world: int, async_sgd, *, gb: int = 32, mb: int | None = None, **pins) -> Plan:
    return compile(regression_graph(), f"local:{world}", global_batch_size=gb, precision="fp32", optimizer="sgd",
                   microbatch_size=mb or gb // world, async_sgd=async_sgd, **pins)


# ---- declarations (fast) ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,message", [
    ({"every": 0}, "async_sgd['every']=0: must be an integer >= 1"),
    ({"staleness": -1}, "async_sgd['staleness']=-1: must be an integer >= 0"),
    ({"every": 2.0}, "async_sgd['every']=2.0: must be an integer"),
    ({"every": True}, "async_sgd['every']=True: must be an integer"),
    ({"every": 2, "staleness": 1}, "exactly one key, 'every' or 'staleness'"),
    ({"period": 2}, "exactly one key, 'every' or 'staleness', not ['period']"),
    ({}, "exactly one key"),
    ("every=2", "async_sgd='every=2': async_sgd must be None (synchronous), dict(every=k)"),
])
def test_malformed_values_are_refused(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        async_sgd_pin(value)


def test_well_formed_values_normalise():
    assert async_sgd_pin(None) is None
    assert async_sgd_pin({"every": 4}) == {"every": 4} and async_sgd_pin({"staleness": 0}) == {"staleness": 0}


@pytest.mark.parametrize("pins,message", [
    ({"pp": 2}, "with pp=2: each replica steps its own whole copy of the model, but a pipeline splits the model"),
    ({"tp": 2}, "with tp=2: each replica steps its own whole copy of the model, but tensor slices of one layer"),
    ({"zero_stage": 1}, ("ZeRO shards the optimizer state (from stage 1; gradients from 2, parameters at 3) over "
                         "the replicas, so no replica can step alone; pin zero_stage=0")),
    ({"compression": "int8"}, ("gradient compression compresses the gradient all-reduce, which async SGD "
                               "replaces by averaging parameters")),
    ({"dp": 1}, "with dp=1: asynchronous SGD averages data-parallel replicas"),
    ({"dp": 2}, "with dp=2: async SGD plans are pure data parallel (tp = pp = 1), so dp must be the world size 4"),
    ({"precision": "bf16-mixed"}, "precision='bf16-mixed': the async SGD runtime steps the model's own parameters"),
])
def test_declarations_that_cannot_run_async_are_refused_saying_why(meta_gpt_graph, pins, message):
    kw = {"precision": "fp32", **pins}
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        compile(meta_gpt_graph, "local:4", global_batch_size=8, async_sgd={"every": 2}, **kw)
    assert "drop async_sgd" in str(err.value) or "pin" in str(err.value)


def test_one_device_has_nothing_to_average(meta_gpt_graph):
    with pytest.raises(ValueError, match="with one device: asynchronous SGD averages data-parallel replicas"):
        compile(meta_gpt_graph, "local:1", global_batch_size=8, precision="fp32", async_sgd={"staleness": 1})


# ---- the plan (fast) -----------------------------------------------------------------------------------------
def test_the_planner_never_chooses_it_and_a_pinned_plan_is_pure_data_parallel(meta_gpt_graph):
    free = compile(meta_gpt_graph, "local:4", global_batch_size=8, precision="fp32")
    assert free.async_sgd is None and "async sgd" not in str(free)
    plan = compile(meta_gpt_graph, "local:4", global_batch_size=8, precision="fp32", async_sgd={"every": 4})
    c = plan.config
    assert plan.async_sgd == {"every": 4} and (c.dp, c.tp, c.pp, c.zero_stage) == (4, 1, 1, 0)
    assert plan.declarations == {"async_sgd": {"every": 4}}  # what the user pinned, not what it implies


def test_plan_json_round_trips_and_older_plans_load(meta_gpt_graph):
    plan = compile(meta_gpt_graph, "local:4", global_batch_size=8, precision="fp32", async_sgd={"staleness": 2})
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["async_sgd"] == {"staleness": 2}
    older = json.loads(plan.to_json())
    del older["async_sgd"]  # a plan saved before the field existed
    assert Plan.from_json(json.dumps(older)).async_sgd is None


def test_print_and_explain_show_one_row(meta_gpt_graph):
    sync = compile(meta_gpt_graph, "local:4", global_batch_size=8, precision="fp32", zero_stage=0)
    local = compile(meta_gpt_graph, "local:4", global_batch_size=8, precision="fp32", async_sgd={"every": 4})
    stale = compile(meta_gpt_graph, "local:4", global_batch_size=8, precision="fp32", async_sgd={"staleness": 2})

    def keys(plan):  # the rows of the table's head, by key (a long value continues on indented lines)
        return [line.split()[0] + (" sgd" if line.startswith("  async sgd") else "")
                for line in str(plan).split("\n\n")[0].splitlines()[1:] if line[2] != " "]

    assert keys(local) == [*keys(sync)[:7], "async sgd", *keys(sync)[7:]]
    text = " ".join(str(local).split())
    assert "async sgd local SGD, every=4: each replica steps on its own gradients" in text
    assert "averaged by an fp32 all-reduce after every 4th step, 1/4 of it counted per step" in text
    assert "async sgd bounded staleness 2:" in " ".join(str(stale).split())
    why = " ".join(stale.explain().split())
    assert "asynchronous SGD {'staleness': 2}, as declared (the planner never chooses it" in why
    assert "The hand configurations below train synchronously" in why


def test_cost_model_amortises_or_hides_the_averaging(meta_gpt_graph):
    def plan(a):
        return compile(meta_gpt_graph, "local:4", global_batch_size=8, precision="fp32", zero_stage=0,
                       microbatch_size=2, async_sgd=a)

    sync, every1, every4, stale0, stale2 = (plan(a) for a in (None, {"every": 1}, {"every": 4},
                                                               {"staleness": 0}, {"staleness": 2}))
    exposed = {k: p.predicted.exposed_comm_s for k, p in
               (("every1", every1), ("every4", every4), ("stale0", stale0), ("stale2", stale2))}
    assert exposed["every1"] == exposed["stale0"] > 0
    assert exposed["every4"] == pytest.approx(exposed["every1"] / 4)
    assert exposed["stale2"] <= exposed["every4"]
    # every=1 averages after the step: nothing of it hides behind the backward, unlike DDP's gradient buckets
    assert sync.predicted.exposed_comm_s <= exposed["every1"]
    traffic = sum(every4.predicted.bytes_per_link.values())
    assert traffic == pytest.approx(sum(sync.predicted.bytes_per_link.values()) / 4)
    # one flat copy of the parameters to average through; staleness=2 also keeps the agreed parameters and,
    # per step in flight, an update and its all-reduce buffer
    assert stale2.predicted.memory.buffers > every4.predicted.memory.buffers == stale0.predicted.memory.buffers
    # the hand baselines stay synchronous: the async plan's pure data-parallel baseline is the synchronous plan
    ddp = compile(meta_gpt_graph, "local:4", global_batch_size=8, precision="fp32", zero_stage=0, tp=1, pp=1)
    dp_baseline = every4.baselines[0]
    assert dp_baseline.config == ddp.config and dp_baseline.step_time_s == pytest.approx(ddp.predicted.step_time_s)


def test_the_program_builds_the_async_runner_and_its_hash_tracks_the_field(meta_gpt_graph):
    sync = compile(meta_gpt_graph, "local:4", global_batch_size=8, precision="fp32", zero_stage=0,
                   microbatch_size=2)
    local = compile(meta_gpt_graph, "local:4", global_batch_size=8, precision="fp32", microbatch_size=2,
                    async_sgd={"every": 4})
    assert local.config == sync.config and local.program(0).program_hash != sync.program(0).program_hash
    src = local.program(3).source
    assert "from runtime.engines.async_sgd import AsyncSGDRunner" in src and "DataParallel" not in src
    assert "ASYNC_SGD = {'every': 4}" in src and "dp_rank=3" in src
    assert "# Local SGD (every=4): each replica steps its optimizer on its own gradients" in src
    assert callable(local.program(3).namespace()["build"])


# ---- real processes ------------------------------------------------------------------------------------------
def _eval_loss(state_dict) -> float:
    model = regression_mlp()
    model.load_state_dict(state_dict)
    x, y = regression_batches(1, 4096, seed=99)[0]
    with torch.no_grad():
        return mse(model(x), y).item()


@pytest.mark.slow
def test_every_1_trains_exactly_like_synchronous_ddp_through_the_launcher():
    """Plain SGD with momentum (linear in the gradient): averaging the parameters after every step is averaging
    the updates, which is what DDP's averaged gradient gives. Two microbatches per replica."""
    batches = regression_batches(6, 32)
    out = {}
    for name, a in (("ddp", None), ("every1", {"every": 1})):
        plan = regression_plan(2, a, mb=8, zero_stage=0)
        assert plan.num_microbatches == 2
        out[name] = launch_local(plan, regression_mlp, sgd, mse, batches, timeout_s=60)
    assert out["every1"].losses == pytest.approx(out["ddp"].losses, rel=1e-5, abs=1e-7)
    for k, want in out["ddp"].state_dict.items():
        torch.testing.assert_close(out["every1"].state_dict[k], want, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, k=k: f"{k}: {m}")
    # start-up: 1 broadcast; each step: 1 average + 1 loss all-reduce; full_state_dict(): 1 more
    assert out["every1"].collective_counts == [{"broadcast": 1, "all_reduce": 2 * 6 + 1}] * 2


# ---- in worker processes: one launch per world size (starting processes is what costs here) ---------------------
def _build(plan: Plan, rank: int, optimizer_fn=sgd):
    """The runner rank's generated program builds, as runtime.launch.local's worker does."""
    torch.manual_seed(0)
    return plan.program(rank).namespace()["build"](regression_mlp, optimizer_fn, mse)


def _convergence_worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    with gloo_group(rank, world, store_path):
        out = {}
        for name, a in (("sync", None), ("every4", {"every": 4}), ("stale2", {"staleness": 2})):
            runner = _build(regression_plan(world, a, gb=64, zero_stage=0), rank)
            losses = [runner.step(b) for b in regression_batches(CONVERGENCE_STEPS, 64)]
            out[name] = {"losses": losses, "state": runner.full_state_dict(), "counts": dict(runner.collectives.counts)}
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")


CONVERGENCE_STEPS = 150


@pytest.mark.slow
def test_every_4_and_staleness_2_converge_within_2_percent_of_synchronous(spawned):
    """4 replicas, a 2-layer MLP on y = A x + noise, 150 steps of 64 samples: the trained models (averaged over
    the replicas) reach a held-out loss within 2 % of synchronous training's (they differ by < 1 % here)."""
    runs = spawned(_convergence_worker, 4)[0]
    base = _eval_loss(runs["sync"]["state"])
    assert base < 0.05 * runs["sync"]["losses"][0]  # it learns (the noise floor is 0.01)
    for name in ("every4", "stale2"):
        got = _eval_loss(runs[name]["state"])
        assert abs(got - base) <= 0.02 * base, f"{name}: held-out loss {got:.5f} vs synchronous {base:.5f}"
    # every=4 averages 150 // 4 = 37 times; staleness=2 all-reduces every step's update; + losses, full state
    steps = CONVERGENCE_STEPS
    assert runs["every4"]["counts"] == {"broadcast": 1, "all_reduce": steps + steps // 4 + 1}
    assert runs["stale2"]["counts"] == {"broadcast": 1, "all_reduce": 2 * steps + 1}


# ---- the oracle and the definition, in the same worker processes -------------------------------------------------
K, S, STEPS, WORLD, GB = 3, 2, 7, 2, 16  # 7 steps: averaged after steps 3 and 6, local again at 7


def _rows(batch, rank: int):
    x, y = batch
    per = x.shape[0] // WORLD
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _oracle_worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    from torch.distributed.algorithms.model_averaging.averagers import (
        PeriodicModelAverager,
    )
    from torch.distributed.optim import PostLocalSGDOptimizer

    with gloo_group(rank, world, store_path):
        batches = regression_batches(STEPS, GB)
        out: dict = {}
        # ours, local SGD every=K with AdamW (its state must stay local, as torch's)
        runner = _build(regression_plan(world, {"every": K}, gb=GB), rank, adamw)
        out["ours"] = []
        for b in batches:
            runner.step(b)
            out["ours"].append(_params(runner.engine.module))
        # torch's: PeriodicModelAverager counts from 0 and first averages at step warmup_steps
        model = regression_mlp()
        opt = PostLocalSGDOptimizer(optim=adamw(model.parameters()),
                                    averager=PeriodicModelAverager(period=K, warmup_steps=K - 1))
        out["torch"] = []
        for b in batches:
            x, y = _rows(b, rank)
            mse(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            out["torch"].append(_params(model))
        # staleness=S with SGD: every step's parameters, then the averaged state before and after sync_now()
        runner = _build(regression_plan(world, {"staleness": S}, gb=GB), rank)
        out["stale"] = []
        for b in batches:
            runner.step(b)
            out["stale"].append(_params(runner.engine.module))
        out["stale_in_flight"] = len(runner._pending)
        out["stale_full_before"] = runner.full_state_dict()
        runner.sync_now()
        out["stale_synced"] = _params(runner.engine.module)
        out["stale_full_after"] = runner.full_state_dict()
        with torch.no_grad():  # as runtime.checkpoint.load_checkpoint does: other parameters, then after_load()
            for q in runner.engine.module.parameters():
                q.add_(1.0)
        runner.after_load()
        runner.sync_now()  # installs the agreed parameters: the loaded ones, not those from before the load
        out["stale_after_load"] = _params(runner.engine.module)
        # staleness=0 and the synchronous DDP program, two microbatches per replica: losses and parameters
        for name, a in (("ddp", None), ("stale0", {"staleness": 0})):
            runner = _build(regression_plan(world, a, mb=8, zero_stage=0), rank)
            losses = [runner.step(b) for b in regression_batches(6, 32)]
            out[name] = {"losses": losses, "params": _params(runner.engine.module)}
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def oracle_runs(spawned):
    return spawned(_oracle_worker, WORLD)


@pytest.mark.slow
def test_staleness_0_trains_exactly_like_synchronous_ddp(oracle_runs):
    """staleness=0 waits for each step's averaged update at once: the parameters after every step are the
    agreed ones, as with every=1, and the same as the DDP program's (SGD with momentum, 2 microbatches)."""
    for rank, run in enumerate(oracle_runs):
        assert run["stale0"]["losses"] == pytest.approx(run["ddp"]["losses"], rel=1e-5, abs=1e-7)
        for n, want in run["ddp"]["params"].items():
            torch.testing.assert_close(run["stale0"]["params"][n], want, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, where=(rank, n): f"rank, parameter {where}: {m}")
    a, b = oracle_runs
    assert all(torch.equal(a["stale0"]["params"][n], b["stale0"]["params"][n]) for n in a["stale0"]["params"])


@pytest.mark.slow
def test_local_sgd_matches_torchs_post_local_sgd_optimizer(oracle_runs):
    for rank, run in enumerate(oracle_runs):
        for t, (ours, theirs) in enumerate(zip(run["ours"], run["torch"]), 1):
            for n in theirs:
                torch.testing.assert_close(ours[n], theirs[n], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, where=(rank, t, n): f"rank, step, parameter {where}: {m}")
    # averaged after steps 3 and 6 (bitwise equal replicas), each replica its own between
    a, b = (run["ours"] for run in oracle_runs)
    for t in range(STEPS):
        same = all(torch.equal(a[t][n], b[t][n]) for n in a[t])
        assert same == ((t + 1) % K == 0), f"step {t + 1}"


def _simulate_staleness(batches, s: int) -> list[list[dict[str, torch.Tensor]]]:
    """The definition, in one process: replicas step alone; step t's updates, averaged, join the agreed
    parameters at step t + s; each replica trains on the agreed parameters plus its own updates in flight."""
    models = [regression_mlp() for _ in range(WORLD)]
    opts = [sgd(m.parameters()) for m in models]
    flat = [lambda m=m: torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
    agreed = flat[0]()
    pending: list[list[torch.Tensor]] = []
    history = []
    for batch in batches:
        updates = []
        for r, (m, opt) in enumerate(zip(models, opts)):
            x, y = _rows(batch, r)
            mse(m(x), y).backward()
            before = flat[r]()
            opt.step()
            opt.zero_grad()
            updates.append(flat[r]() - before)
        pending.append(updates)
        if len(pending) > s:
            agreed = agreed + torch.stack(pending.pop(0)).mean(0)
        for r, m in enumerate(models):
            mine = agreed + sum((u[r] for u in pending), torch.zeros_like(agreed))
            torch.nn.utils.vector_to_parameters(mine, m.parameters())
        history.append([_params(m) for m in models])
    return history


@pytest.mark.slow
def test_staleness_follows_its_definition_is_bounded_and_sync_now_agrees(oracle_runs):
    want = _simulate_staleness(regression_batches(STEPS, GB), S)
    for rank, run in enumerate(oracle_runs):
        for t in range(STEPS):
            for n, v in want[t][rank].items():
                torch.testing.assert_close(run["stale"][t][n], v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, where=(rank, t + 1, n): f"rank, step, parameter {where}: {m}")
        assert run["stale_in_flight"] == S  # bounded: at most s updates wait, then the oldest is waited for
    a, b = oracle_runs
    # between averagings the replicas differ (each holds its own last S updates) ...
    assert not all(torch.equal(a["stale"][-1][n], b["stale"][-1][n]) for n in a["stale"][-1])
    # ... full_state_dict() is their mean without changing them, on rank 0 only ...
    assert b["stale_full_before"] is None and b["stale_full_after"] is None
    for n in a["stale_synced"]:
        mean = (a["stale"][-1][n] + b["stale"][-1][n]) / 2
        torch.testing.assert_close(a["stale_full_before"][n], mean, rtol=1e-6, atol=1e-7)
        # ... and sync_now() makes them agree, bitwise, on that mean
        assert torch.equal(a["stale_synced"][n], b["stale_synced"][n])
        torch.testing.assert_close(a["stale_synced"][n], mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a["stale_full_after"][n], a["stale_synced"][n], rtol=0, atol=1e-7)
    # after_load(): loaded parameters become the agreed ones (a later averaging does not revert them)
    for run in oracle_runs:
        for n, synced in a["stale_synced"].items():
            assert torch.equal(run["stale_after_load"][n], synced + 1.0), n


# ---- checkpoints: each replica is saved as it is ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", [{"every": 3}, {"staleness": 2}])
def test_a_checkpoint_resumes_every_replica_exactly_and_saving_changes_nothing(tmp_path, mode):
    """Saves at steps 2, 4, 6 fall between averagings (every=3) or with updates in flight (staleness=2), with
    AdamW's moments differing per replica. Saving must not average anything (the run with checkpoints equals
    the run without, bit for bit), and resuming from step 4 under the same plan restores every replica's own
    parameters, moments and averaging state: the last 3 steps end bit for bit where the uninterrupted run does.
    Another plan loads the replicas' common model (their mean, or the agreed parameters plus the updates in
    flight)."""
    from runtime.checkpoint import load_full_state_dict

    plan, batches = regression_plan(2, mode, zero_stage=0), regression_batches(7, 32)
    plain = launch_local(plan, regression_mlp, adamw, mse, batches, timeout_s=90)
    saved = launch_local(plan, regression_mlp, adamw, mse, batches, save_dir=tmp_path, save_every=2, timeout_s=90)
    assert saved.losses == plain.losses
    assert all(torch.equal(saved.state_dict[k], v) for k, v in plain.state_dict.items())
    step4 = tmp_path / "step_00000004"
    resumed = launch_local(plan, regression_mlp, adamw, mse, batches, resume_from=step4, timeout_s=90)
    assert resumed.start_step == 4 and resumed.losses == plain.losses[4:]
    for k, want in plain.state_dict.items():
        assert torch.equal(resumed.state_dict[k], want), k
    # the common model at step 4, which other plans load: the replicas' mean after 4 steps
    four = launch_local(plan, regression_mlp, adamw, mse, batches[:4], timeout_s=90)
    common = load_full_state_dict(step4)
    for k, want in four.state_dict.items():
        torch.testing.assert_close(common[k], want, rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")


def _all_rows(inputs, targets) -> int:
    return targets.numel()


@pytest.mark.slow
def test_a_per_token_loss_is_refused_before_the_first_step():
    """Each replica steps on its own rows: a loss averaged over every token of the global batch has no meaning
    there (runtime.engines.token_loss), and the program's build() says so before anything is updated."""
    from runtime import per_token
    from runtime.launch.env import LaunchError

    with pytest.raises(LaunchError, match="per_token loss averages over every token"):
        launch_local(regression_plan(2, {"every": 2}), regression_mlp, sgd, per_token(mse, _all_rows),
                     regression_batches(2, 32), timeout_s=60)
