"""compile(..., torch_compile=...): the plan carries it, every program kind that can runs its model code
under torch.compile (runtime.engines.compiled), recomputation and engine hooks kept, and trains like one
process; tensor- and context-parallel plans are refused before anything runs."""

from __future__ import annotations

import collections
import dataclasses
import json

import pytest
import torch

from cost_models.errors import DeclarationError
from examples import gpt as gpt_mod
from examples import training
from partitioner import compile, trace
from partitioner.codegen.program import CodegenError
from partitioner.planner.plan import Plan
from runtime.engines.compiled import compile_blocks
from runtime.engines.recompute import recompute_blocks
from runtime.launch.local import LaunchError, launch_local

GB = 8
GRAPHS: list[torch.fx.GraphModule] = []  # what the "counting" backend was handed, in this process


def _counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    GRAPHS.append(gm)
    return gm.forward  # runs the captured graph as it is: this process's counts, eager's numbers


if "counting" not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(_counting, name="counting")


@pytest.fixture(scope="module")
def graph():
    """The tiny GPT traced on its tokens alone (as training calls it), eager attention kept as written: every
    program then runs the same ops as the one-process reference (the fused-attention rewrite would differ
    from it by float rounding, which is not torch.compile's doing)."""
    model = training.gpt_tiny_seeded()
    return trace(model, gpt_mod.example_batch(model, 2, seq_len=32)[:1], rewrite_attention=False)


def plan_for(graph, backend="aot_eager", world=2, **kw):
    kw = {"pp": 1, "zero_stage": 0, "microbatch_size": 2, **kw}
    return compile(graph, f"local:{world}", global_batch_size=GB, tp=1, precision="fp32", rewrite_attention=False,
                   torch_compile=backend, **kw)


# ---- the declaration -------------------------------------------------------------------------------------

def test_the_plan_carries_it_in_json_and_text_and_older_plans_load_as_eager(graph):
    plan = plan_for(graph, True)
    assert plan.torch_compile == "inductor"
    assert "compiled     torch.compile (inductor) of each block's code" in str(plan)
    again = Plan.from_json(plan.to_json())
    assert again.torch_compile == "inductor" and again == plan
    eager = plan_for(graph, False)
    assert eager.torch_compile == "" and "torch.compile" not in str(eager)
    doc = json.loads(eager.to_json())
    assert "torch_compile" not in doc  # eager plans are written as before, so their hashes do not change
    older = json.loads(plan.to_json())
    del older["torch_compile"]  # a plan written before the field existed
    assert Plan.from_json(json.dumps(older)).torch_compile == ""
    assert plan_for(graph, "aot_eager").torch_compile == "aot_eager"


def test_unknown_backends_and_tensor_or_context_parallel_plans_are_refused(graph):
    with pytest.raises(DeclarationError, match=r"torch_compile='nope': not a torch.compile backend.*aot_eager"):
        plan_for(graph, "nope")
    with pytest.raises(DeclarationError, match="torch_compile=3"):
        plan_for(graph, 3)
    with pytest.raises(DeclarationError, match=r"torch_compile='aot_eager' with tp=2: .*pin tp=1, cp=1 and ep=1"):
        compile(graph, "local:2", global_batch_size=GB, tp=2, precision="fp32", rewrite_attention=False,
                torch_compile="aot_eager")
    # a plan whose tp the planner chose (or edited by hand): its programs refuse, before anything runs
    tp2 = compile(graph, "local:2", global_batch_size=GB, tp=2, precision="fp32", rewrite_attention=False)
    with pytest.raises(CodegenError, match=r"torch_compile='inductor' with tp=2: the blocks of tensor-, context- and expert"):
        dataclasses.replace(tp2, torch_compile="inductor").program(0)


def test_programs_compile_blocks_before_recomputation_wraps_them(graph):
    dp = plan_for(graph, zero_stage=3, recompute="full").program(0).source
    assert "from runtime.engines.compiled import compile_blocks" in dp
    call = "compile_blocks(model, ('transformer.h.0', 'transformer.h.1'), 'aot_eager')"
    assert call in dp and dp.index(call) < dp.index("engine.checkpoint_blocks(")
    pp = plan_for(graph, pp=2).program(1).source
    assert "recompute='none', torch_compile='aot_eager'" in pp  # the StageModel compiles its segment functions
    assert "compile_blocks" not in plan_for(graph, False, zero_stage=3).program(0).source


def test_cli_flag_records_it_and_a_bad_backend_is_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "partitioner", "compile", "examples/gpt.py:gpt_tiny", "--topology",
                               "local:2", "--global-batch-size", "8", "--tp", "1", *args], capture_output=True,
                              text=True, cwd=root, timeout=120, check=False)

    r = cli("--torch-compile", "-o", tmp_path / "p.json")
    assert r.returncode == 0, r.stderr
    assert "torch.compile (inductor)" in r.stdout
    assert Plan.load(tmp_path / "p.json").torch_compile == "inductor"
    r = cli("--torch-compile", "aot_eager", "-o", tmp_path / "q.json")
    assert r.returncode == 0 and Plan.load(tmp_path / "q.json").torch_compile == "aot_eager", r.stderr
    r = cli("--torch-compile", "nope")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "torch_compile='nope': not a torch.compile backend" in r.stderr


# ---- what is compiled, in this process -------------------------------------------------------------------

def _saved_bytes(model, idx, targets) -> int:
    """Bytes autograd keeps for backward outside any checkpoint (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, targets)
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_every_block_runs_one_compiled_graph_inside_its_recomputation(recompute):
    """12 blocks, one captured graph (no graph break, no recompile per block); with recomputation the
    checkpoint still wraps the compiled block: what the forward keeps drops as in eager mode."""
    torch.manual_seed(0)
    model = gpt_mod.gpt_tiny(n_layer=12)
    names = [f"transformer.h.{i}" for i in range(12)]
    idx, targets = gpt_mod.example_batch(model, 2, seq_len=32)
    eager_kept = {}
    for mode in ("none", recompute):
        m = gpt_mod.gpt_tiny(n_layer=12)
        m.load_state_dict(model.state_dict())
        recompute_blocks(m, names, mode)
        eager_kept[mode] = _saved_bytes(m, idx, targets)
    compiled = gpt_mod.gpt_tiny(n_layer=12)
    compiled.load_state_dict(model.state_dict())
    GRAPHS.clear()
    torch._dynamo.reset()
    compile_blocks(compiled, names, "counting")
    recompute_blocks(compiled, names, recompute)
    kept = _saved_bytes(compiled, idx, targets)
    assert len(GRAPHS) == 1, [g.code for g in GRAPHS]
    # the whole block, not a fragment: its four linears, two layer norms, softmax and gelu (counted by kind: how
    # many other nodes a block becomes differs between torch releases, 2.11 folds the mask's comparison)
    kinds = collections.Counter(getattr(n.target, "__name__", str(n.target)) for n in GRAPHS[0].graph.nodes
                                if n.op == "call_function")
    assert (kinds["linear"], kinds["layer_norm"], kinds["softmax"], kinds["gelu"]) == (4, 2, 1, 1), kinds
    assert kept == eager_kept[recompute]
    if recompute == "full":
        assert kept < 0.2 * eager_kept["none"], (kept, eager_kept)
    # the same numbers as eager: "counting" runs the captured graph as it is
    ref = gpt_mod.gpt_tiny(n_layer=12)
    ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(compiled(idx, targets)[1], ref(idx, targets)[1], rtol=0, atol=0)


def test_compiled_twice_is_refused():
    model = gpt_mod.gpt_tiny()
    compile_blocks(model, ["transformer.h.0"], "counting")
    with pytest.raises(ValueError, match="already has its own forward"):
        compile_blocks(model, ["transformer.h.0"], "counting")


def test_a_pipeline_stage_runs_its_code_compiled(graph):
    """plan.verify runs rank 0's generated stage as the program does: its segment functions compiled."""
    GRAPHS.clear()
    torch._dynamo.reset()
    plan = plan_for(graph, "counting", pp=2)
    plan.verify(training.gpt_tiny_seeded)
    assert len(GRAPHS) >= 3, len(GRAPHS)  # prefix, block (one graph for both stages' blocks), suffix


# ---- the truth test: trains like one process, over 2 Gloo ranks -------------------------------------------

def _batches(n=2):
    model = training.gpt_tiny_seeded()
    return [gpt_mod.example_batch(model, GB, seq_len=32, seed=s) for s in range(n)]  # (tokens, targets)


def _reference(model_fn=training.gpt_tiny_seeded, optimizer_fn=training.adamw, batches=None):
    t = training.train_one_process(model_fn, optimizer_fn, training.gpt_loss, batches or _batches())
    return t.losses, {k: v.detach() for k, v in t.model.named_parameters()}


def _check(out, ref, rtol=1e-5, atol=1e-6):
    losses, params = ref
    assert out.losses == pytest.approx(losses, rel=rtol, abs=atol)
    for name, want in params.items():
        torch.testing.assert_close(out.state_dict[name], want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


CASES = {  # aot_eager runs the captured aten graphs as they are: eager's numbers, so the oracle is eager
    "dp2": dict(zero_stage=0, microbatch_size=2),
    "zero3-full-recompute": dict(zero_stage=3, microbatch_size=4, recompute="full"),
    "zero1-selective-recompute": dict(zero_stage=1, microbatch_size=2, recompute="selective"),
    "pp2-1f1b": dict(pp=2, microbatch_size=2, schedule="1f1b"),
    "async-every-1": dict(zero_stage=0, microbatch_size=4, async_sgd={"every": 1}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_programs_train_like_one_eager_process(graph, case):
    kw = CASES[case]
    opt = training.sgd if "async_sgd" in kw else training.adamw
    plan = plan_for(graph, "aot_eager", **kw)
    batches = _batches()
    out = launch_local(plan, training.gpt_tiny_seeded, opt, training.gpt_loss, batches, timeout_s=200)
    _check(out, _reference(optimizer_fn=opt, batches=batches))


@pytest.mark.slow
def test_zero3_compiled_recomputation_holds_less(graph):
    """The memory effect, measured: a ZeRO-3 rank compiled with recompute=full peaks lower than without."""
    peaks = {}
    for mode in ("none", "full"):
        plan = plan_for(graph, "aot_eager", zero_stage=3, microbatch_size=4, recompute=mode)
        out = launch_local(plan, training.gpt_tiny_seeded, training.adamw, training.gpt_loss, _batches(),
                           probe_step=1, timeout_s=200)
        # with recomputation, now and then one rank peaks one buffer higher (timing, not understood; measured
        # [8217108, 8999956] and [8217108, 8737812] bytes per rank, both 8217108 mostly; test_dp_equivalence
        # sees it too): the other rank shows what recomputation saves
        peaks[mode] = (max if mode == "none" else min)(out.peak_step_bytes)
    # what the plan says recomputation frees, from a trace with the targets: traced on the tokens alone the
    # planner counts no activation bytes for this model (0.0 for both), which says nothing about them
    model = training.gpt_tiny_seeded()
    with_targets = trace(model, gpt_mod.example_batch(model, 2, seq_len=32), rewrite_attention=False)
    saved = plan_for(with_targets, zero_stage=3, microbatch_size=4, recompute="none").predicted.memory.activations - \
        plan_for(with_targets, zero_stage=3, microbatch_size=4, recompute="full").predicted.memory.activations
    assert peaks["none"] - peaks["full"] >= 0.5 * saved > 0, (peaks, saved)


def _gpt_tiny_inductor():
    model = training.gpt_tiny_seeded()
    compile_blocks(model, [f"transformer.h.{i}" for i in range(len(model.transformer.h))], "inductor")
    return model


@pytest.mark.slow
def test_inductor_dp2_trains_like_one_inductor_process(graph):
    """Inductor fuses each block into its own kernels, summing in another order than eager and, for a
    microbatch of 4 rows, than for 8: the oracle is one process with its blocks compiled by inductor too, and
    parameters agree to atol 5e-6 (Adam divides by sqrt(v), so float-rounding differences in near-zero
    gradients show at about the learning rate's 1e-3 times 1e-3; measured up to 1.3e-6)."""
    plan = plan_for(graph, "inductor", zero_stage=0, microbatch_size=4)
    batches = _batches()
    out = launch_local(plan, training.gpt_tiny_seeded, training.adamw, training.gpt_loss, batches, timeout_s=400)
    _check(out, _reference(_gpt_tiny_inductor, batches=batches), rtol=1e-5, atol=5e-6)


@pytest.mark.slow
def test_the_ranks_really_compile(graph):
    """A backend that refuses any graph whose inputs are not leaves (a block's input is an activation) fails
    every rank of a dp2 plan: the programs hand their blocks to torch.compile, with errors not swallowed."""
    plan = plan_for(graph, "non_leaf_compile_error_TESTING_ONLY", zero_stage=0)
    assert "compile_blocks(model, ('transformer.h.0', 'transformer.h.1'), 'non_leaf_compile_error_TESTING_ONLY')" \
        in plan.program(0).source
    with pytest.raises(LaunchError, match="TestingOnlyCompileError"):
        launch_local(plan, training.gpt_tiny_seeded, training.adamw, training.gpt_loss, _batches(1), timeout_s=120,
                     verify=False)


def test_a_generated_program_is_an_importable_module():
    """torch 2.11's dynamo imports the module a compiled function's globals name (on an H200 it failed with
    "No module named 'rank_0'"): every executed program is a registered module of its own, under a unique name."""
    import importlib

    from runtime.pipeline.program_module import exec_program

    first = exec_program("def build():\n    return 'first'\n", "<rank_0.py>", rank=0)
    second = exec_program("def build():\n    return 'second'\n", "<rank_0.py>", rank=0)
    assert first["__name__"] != second["__name__"] and first["__name__"].startswith("rank_0")
    for ns in (first, second):
        assert importlib.import_module(ns["build"].__module__).__dict__ is ns
