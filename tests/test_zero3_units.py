"""ZeRO-3 units finer than a block (zero3_unit="module": one unit per module holding parameters, DeepSpeed's
granularity): planned, costed and run.

- the memory rule (partitioner/planner/stage_costs.py): two units' parameters gathered (the one in use and
  the one prefetched; three under recomputation) and their gradients, a unit being a block or a module;
- the runtime (runtime/engines/zero3.py): at most that many units whole at once, with and without
  recomputation, where the recomputed forward gathers each unit and frees it again;
- the truth test: 2 (and 4) Gloo ranks train as one process, for the example GPT (running its own forward,
  and as generated code), HF Llama from a tiny config, and a pp2 x dp2 pipeline program.
"""

from __future__ import annotations

import pytest
import torch

from cost_models.errors import DeclarationError
from examples import gpt as gpt_mod
from examples import training
from partitioner import compile, trace
from partitioner.planner.stage_costs import StageEvaluator
from partitioner.planner.unit_costs import CostContext

GB = 8


@pytest.fixture(scope="module")
def graph():
    model = training.gpt_tiny_seeded()
    return trace(model, (gpt_mod.example_batch(model, 2, seq_len=32)[0],))


def _plan(graph, unit, recompute="none", **pins):
    return compile(graph, "local:2", global_batch_size=GB, pp=1, tp=1, zero_stage=3, zero3_unit=unit,
                   microbatch_size=4, precision="fp32", recompute=recompute, **pins)


# ---- the plan ----------------------------------------------------------------------------------
def test_zero3_unit_is_pinned_printed_and_saved(graph, tmp_path):
    plan = _plan(graph, "module")
    assert plan.zero3_unit == "module" and "zero3/module" in str(plan.config)
    assert "zero3/module" in str(plan) and "per module" in plan.explain()
    path = tmp_path / "p.json"
    plan.save(path)
    assert '"zero3_unit": "module"' in path.read_text()
    from partitioner.planner.plan import Plan
    assert Plan.load(path).zero3_unit == "module"
    block = _plan(graph, "block")
    block.save(path)
    import json
    # the default is not written: older plans read the same
    assert "zero3_unit" not in json.loads(path.read_text())["config"]
    assert Plan.load(path).zero3_unit == "block" and "/module" not in str(block.config)


def test_zero3_unit_module_pins_zero3_and_contradictions_are_refused(graph):
    plan = compile(graph, "local:2", global_batch_size=GB, pp=1, tp=1, zero3_unit="module", precision="fp32")
    assert plan.zero_stage == 3 and plan.zero3_unit == "module"
    with pytest.raises(DeclarationError, match="zero3_unit='module' with zero_stage=2"):
        compile(graph, "local:2", global_batch_size=GB, zero_stage=2, zero3_unit="module")
    with pytest.raises(DeclarationError, match="zero3_unit='bogus'"):
        compile(graph, "local:2", global_batch_size=GB, zero3_unit="bogus")
    with pytest.raises(DeclarationError, match="tp=2"):
        compile(graph, "local:4", global_batch_size=GB, tp=2, zero3_unit="module")


def test_the_search_weighs_both_granularities(graph):
    """Unpinned, ZeRO-3 candidates come with both units; block is the simpler on a tie."""
    plan = compile(graph, "local:2", global_batch_size=GB, pp=1, tp=1, zero_stage=3, precision="fp32",
                   alternatives=20)
    seen = {a.config.zero3_unit for a in plan.alternatives} | {plan.zero3_unit}
    assert seen == {"block", "module"}


def test_program_units_are_modules(graph):
    src = _plan(graph, "module").program(0).source
    assert "unit_granularity='module'" in src
    assert "    ('transformer.h.0.attn.c_attn.weight', 'transformer.h.0.attn.c_attn.bias')," in src
    assert "unit_granularity" not in _plan(graph, "block").program(0).source


# ---- the memory rule -----------------------------------------------------------------------------
def _moments(graph, unit, recompute):
    """(gathered parameter bytes of the block moment, largest unit's parameters) of the one-stage plan."""
    plan = _plan(graph, unit, recompute)
    ctx = CostContext(graph, plan_topology(plan), _splits(graph), precision="fp32", optimizer="adam",
                      seq_len=graph.traced_seq_len, memory_cap=1e12)
    ev = StageEvaluator(ctx, plan.config)
    return ev, plan


def plan_topology(plan):
    from cost_models.topology import Topology
    return Topology.parse(plan.topology_name)


def _splits(graph):
    from partitioner.planner.tensor_split import find_splits
    return find_splits(graph)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_memory_rule_charges_two_units_gathered_block_or_module(graph, recompute):
    """Block: two blocks' parameters gathered (4 B each, fp32) and their gradients; module: two modules'
    (three under recomputation: the recomputed forward gathers one more) and their gradients. The
    difference between the two plans' buffers is exactly that."""
    ev_b, plan_b = _moments(graph, "block", recompute)
    ev_m, plan_m = _moments(graph, "module", recompute)
    arr = ev_b.arrays
    n = len(arr.costs)
    block = max(arr.block_par)
    module = max(arr.max_module)
    per_module: dict[str, int] = {}
    for p in graph.params:
        if not p.aliases:  # the tied embedding / LM head: on the root, kept from forward to backward
            per_module[p.name.rpartition(".")[0]] = per_module.get(p.name.rpartition(".")[0], 0) + p.numel
    assert module == max(per_module.values()) == 128 * 512 + 512  # the MLP's h -> 4h Linear
    assert module < block + ev_b._rest[-1]
    live = 3 if recompute == "full" else 2
    mem_b = ev_b._peak_memory(0, n, 0, params=ev_b._par[-1], tied=0.0, rest=ev_b._rest[-1], inflight=1)
    mem_m = ev_m._peak_memory(0, n, 0, params=ev_m._par[-1], tied=0.0, rest=ev_m._rest[-1], inflight=1,
                              root=_tied_outside(ev_m))
    option = ev_b.options[0]
    b, m = mem_b(option), mem_m(option)
    # parameters gathered (buffers): the rest (kept) and the units; the engine's own rest unit at block level
    rest = ev_b._rest[-1]
    assert b.buffers - m.buffers == pytest.approx(
        (rest + 2 * block) * 4 - (_tied_outside(ev_m) + live * module) * 4, rel=1e-9)


def _tied_outside(ev):
    return sum(users[0][1] for users, in_block in zip(ev._shared, ev._shared_in_block) if not in_block)


# ---- the runtime: how many units are whole at once -------------------------------------------------
def _peak_worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    """Per-module units on the example GPT (its own forward, module hooks), blocks recomputed or not: the most
    units gathered at once in forward, and in backward, on this rank."""
    from pathlib import Path

    from ranks import gloo_group
    from runtime.comm.collectives import Collectives
    from runtime.engines.data_parallel import DataParallel

    out = {}
    with gloo_group(rank, world, store_path):
        for recompute in ("none", "full", "selective"):
            model = training.gpt_tiny_seeded()
            x, y = gpt_mod.example_batch(model, 4, seq_len=32, seed=rank)
            names = [n for n, _ in model.named_parameters()]
            units: dict[str, list[str]] = {}
            for n in names:
                units.setdefault(n.rpartition(".")[0], []).append(n)
            dp = DataParallel(model, group=None, ranks=tuple(range(world)), zero_stage=3, collectives=Collectives(),
                              units=list(units.values()), unit_granularity="module")
            dp.checkpoint_blocks([f"transformer.h.{i}" for i in range(len(model.transformer.h))], recompute)
            peak = {"forward": 0, "backward": 0}
            phase = ["forward"]
            gather = dp._gather

            def count():
                live = sum(u.state != "free" and not u.keep for u in dp._units)
                peak[phase[0]] = max(peak[phase[0]], live)

            def counted_gather(u, *, async_op):
                gather(u, async_op=async_op)
                count()

            dp._gather = counted_gather
            for _ in range(2):
                phase[0] = "forward"
                logits, _ = dp.module(x)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
                phase[0] = "backward"
                loss.backward()
                dp.finish_gradients()
                dp.zero_grad()
            out[recompute] = (peak, len(dp._units), sum(u.keep for u in dp._units))
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_units_whole_at_once_are_a_few_modules_not_a_block(spawned):
    """Forward: the unit in use and the one prefetched. Backward: the unit in backward and the one prefetched,
    plus under recomputation the unit being recomputed (gathered and freed again): never a block's six."""
    results = spawned(_peak_worker, 2)
    for out in results:
        for recompute, (peak, n, keep) in out.items():
            assert n == 2 * 6 + 3 and keep == 1  # per block: 2 norms, 2 attention and 2 MLP Linears; wpe, ln_f, wte
            assert peak["forward"] <= 2, (recompute, peak)
            assert peak["backward"] <= (3 if recompute != "none" else 2), (recompute, peak)
        assert out["full"][0]["backward"] == 3  # the recomputation does gather a third


# ---- the truth test: programs on 2 and 4 Gloo ranks train as one process -------------------------
def _gpt_batches(n=3):
    return [gpt_mod.example_batch(training.gpt_tiny_seeded(), GB, seq_len=32, seed=s) for s in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("code", ["generated", "module"])
def test_example_gpt_per_module_trains_like_one_process(recompute, opt, code):
    """`generated`: traced with the tokens alone, the program runs the plan's code (its attention fused), and
    units are gathered by the first op reading them; `module`: traced with the targets too, trained without,
    the module runs its own forward (the ranks warn so) and module hooks gather."""
    from ranks import assert_trains_like
    from runtime.launch.local import launch_local

    model = training.gpt_tiny_seeded()
    ex = gpt_mod.example_batch(model, 2, seq_len=32)
    g = trace(model, ex[:1] if code == "generated" else ex)
    plan = compile(g, "local:2", global_batch_size=GB, pp=1, tp=1, zero_stage=3, zero3_unit="module",
                   microbatch_size=2, precision="fp32", recompute=recompute)
    assert (plan.config.zero3_unit, plan.num_microbatches, plan.recompute) == ("module", 2, recompute)
    batches = _gpt_batches()
    optimizer = getattr(training, opt)
    out = launch_local(plan, training.gpt_tiny_seeded, optimizer, training.gpt_loss, batches, timeout_s=180)
    trained = training.train_one_process(training.gpt_tiny_seeded, optimizer, training.gpt_loss, batches)
    assert_trains_like(out, trained.losses, trained.model.state_dict(),
                       adam_steps=len(batches) if opt == "adamw" else 0)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_hf_llama_per_module_trains_like_one_process(recompute):
    from test_3d_equivalence import assert_same_training, plan_for

    plan = plan_for("llama", pp=1, dp=2, tp=1, zero=3, recompute=recompute, unit="module")
    assert plan.config.zero3_unit == "module"
    assert_same_training(plan, "llama")


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_pipeline_pp2_dp2_per_module_trains_like_one_process(recompute):
    from test_3d_equivalence import assert_same_training, plan_for

    plan = plan_for("gpt", pp=2, dp=2, tp=1, zero=3, recompute=recompute, unit="module")
    assert (plan.pp, plan.dp, plan.config.zero3_unit) == (2, 2, "module")
    src = plan.program(0).source
    assert "unit_granularity='module'" in src and "UNIT_MODULES = (" in src
    out = assert_same_training(plan, "gpt", optimizer=training.sgd)
    # rank 0 (stage 0: wpe and blocks 0-1, the tied wte outside the units): 13 module units, each gathered
    # for every microbatch's forward and backward (blocks would be 2 units and 4 gathers per microbatch)
    units = 2 * 6 + 1
    assert out.collective_counts[0].get("all_gather", 0) >= 2 * units * plan.num_microbatches


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full", "1/2"])
@pytest.mark.parametrize("code", ["generated", "module"])
def test_collectives_per_step_match_the_plan(recompute, code):
    """expected_collectives' count for per-module units: U reduce-scatters and 2U - R all-gathers per
    microbatch (R = 1: the tied embedding on the root), plus k - 2 per block of k modules when recomputed
    ("1/2": the first of the two blocks only, recompute_blocks)."""
    from partitioner.codegen.program import expected_collectives
    from runtime.launch.local import launch_local

    model = training.gpt_tiny_seeded()
    ex = gpt_mod.example_batch(model, 2, seq_len=32)
    g = trace(model, ex[:1] if code == "generated" else ex)
    pins = dict(recompute_blocks=recompute) if "/" in recompute else dict(recompute=recompute)
    plan = compile(g, "local:2", global_batch_size=GB, pp=1, tp=1, zero_stage=3, zero3_unit="module",
                   microbatch_size=2, precision="fp32", **pins)
    per_step = expected_collectives(plan)
    units, m = 2 * 6 + 3, plan.num_microbatches
    recomputed = {"none": 0, "full": 2, "1/2": 1}[recompute]  # of the 2 blocks
    assert per_step["reduce_scatter"] == m * units
    assert per_step["all_gather"] == m * (2 * units - 1 + recomputed * (6 - 2))
    steps = 2
    out = launch_local(plan, training.gpt_tiny_seeded, training.sgd, training.gpt_loss, _gpt_batches(steps),
                       timeout_s=180)
    # besides the steps: the start-up broadcast, and full_state_dict's one all-gather per unit at the end
    want = {"broadcast": 1, **{op: steps * n for op, n in per_step.items()}}
    want["all_gather"] += units
    for counts in out.collective_counts:
        assert counts == want


def test_command_line_pins_the_unit(tmp_path):
    """`partitioner compile --zero3-unit module` pins it (and ZeRO-3); the plan file carries it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "partitioner", "compile", "examples/gpt.py:gpt_tiny", "--topology",
                        "local:2", "--global-batch-size", "8", "--zero3-unit", "module", "--pp", "1", "--tp", "1",
                        "-o", str(path)], capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert "zero3/module" in r.stdout and "gathered per module" in r.stdout
    config = json.loads(path.read_text())["config"]
    assert (config["zero_stage"], config["zero3_unit"]) == (3, "module")


@pytest.mark.slow
def test_bf16_mixed_per_module_is_bit_identical_to_per_block():
    """The same arithmetic in the same order, gathered in other pieces: under bf16-mixed with recomputation,
    per-module and per-block ZeRO-3 give the very same losses and parameters."""
    from runtime.launch.local import launch_local

    model = training.gpt_tiny_seeded()
    g = trace(model, gpt_mod.example_batch(model, 2, seq_len=32)[:1])
    batches = _gpt_batches()
    out = {}
    for unit in ("block", "module"):
        plan = compile(g, "local:2", global_batch_size=GB, pp=1, tp=1, zero_stage=3, zero3_unit=unit,
                       microbatch_size=2, precision="bf16-mixed", recompute="full")
        out[unit] = launch_local(plan, training.gpt_tiny_seeded, training.adamw, training.gpt_loss, batches,
                                 timeout_s=180)
    assert out["module"].losses == out["block"].losses
    for name, value in out["block"].state_dict.items():
        assert torch.equal(out["module"].state_dict[name], value), name


def test_a_split_backward_is_charged_ws_gather_of_every_unit(graph):
    """Under a zero-bubble schedule each W gathers its units again (runtime.engines.zero3's split_backward): with
    nothing hidden (dp_overlap 0) a microbatch's ZeRO-3 traffic is 3 gathers and a reduce-scatter of each unit,
    not 1F1B's 2 and 1, so the exposed time is about 4/3 of 1F1B's (the same gathers and reduce-scatters)."""
    from cost_models.calibration import Calibration

    def exposed(schedule):
        return compile(graph, "2x2xA100-80GB", global_batch_size=8, pp=2, dp=2, zero_stage=3, schedule=schedule,
                       microbatch_size=2, alternatives=0,
                       calibration=Calibration(dp_overlap=0.0)).predicted.exposed_comm_s

    # 4/3 exactly if a gather and a reduce-scatter of a unit cost the same; they differ by their bytes and
    # latency (measured 1.32). The band excludes 1.0 (W's gather not charged) and 5/3 (charged twice).
    ratio = exposed("zb-h1") / exposed("1f1b")
    assert 1.25 < ratio < 1.4, ratio
