"""plan.verify: the generated stage code against the unmodified module, in one process (runtime.verify.check).

Good plans of the example GPT, Hugging Face GPT-2 and Llama pass under tp2,
pp2, pp2 tp2 and interleaved pp2 x2, comparing outputs, loss and every
gradient. Programs broken on purpose (a row-parallel all-reduce dropped, a
column input's f dropped, one parameter read in place of another, the tie
forgotten) are caught, and the error names the block, the sub-module and the
parameter. Every broken case first checks that the edit changed the program,
and passes only when verify raises: a verifier that compared nothing fails it.
No process is spawned here (tensor slices run as threads).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import multiprocessing
import threading
import time

import pytest
import torch

import runtime.verify.check
from cost_models.errors import DeclarationError
from examples.training import adamw, gpt_4l_seeded, gpt_loss, hf_gpt2_4l_seeded, hf_llama_seeded, hf_loss
from partitioner import compile, trace
from runtime import launch_local
from runtime.verify.local_collectives import LocalCollectiveError, LocalCollectives, LocalGroup
from runtime.verify.check import VerifyError, verify_plan, verify_skip_reason

MODELS = {"gpt": (gpt_4l_seeded, gpt_loss), "hf": (hf_gpt2_4l_seeded, hf_loss), "llama": (hf_llama_seeded, hf_loss)}
CONFIGS = {"tp2": {"pp": 1, "tp": 2, "sp": False}, "pp2": {"pp": 2, "tp": 1}, "pp2tp2": {"pp": 2, "tp": 2, "sp": False},
           "pp2x2": {"pp": 2, "tp": 1, "schedule": "interleaved-1f1b", "interleave": 2},
           "tp2sp": {"pp": 1, "tp": 2, "sp": True}, "pp2tp2sp": {"pp": 2, "tp": 2, "sp": True}}
VOCAB, SEQ, BATCH = 512, 16, 8


@functools.cache
def graph(name: str):
    """Each model traced once; its plans compile from the graph (the exported program carries the code)."""
    return trace(MODELS[name][0](), (torch.randint(0, VOCAB, (2, SEQ)),))


@functools.cache
def plan_for(name: str, config: str):
    c = {"schedule": "1f1b", "interleave": 1, **CONFIGS[config]}
    return compile(graph(name), f"local:{c['pp'] * c['tp']}", global_batch_size=BATCH, precision="fp32", dp=1,
                   microbatch_size=2, alternatives=0, **c)


def microbatch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g)


def plain(src: str) -> str:
    """Generated code without the shape annotations beside each value (strings: they change nothing that runs)."""
    return re.sub(r'^(    \w+): "[^"]*" = ', r"\1 = ", src, flags=re.M)


def edited(plan, old: str, new: str, pp_rank: int, tp_slices: tuple[int, ...] | None = None) -> dict[int, str]:
    """Every rank's program, those of pipeline rank `pp_rank` (and tensor slices `tp_slices`) with the first
    `old` replaced by `new`."""
    out = {}
    for m in plan.mesh:
        src = plan.program(m.rank).source
        if m.pp == pp_rank and (tp_slices is None or m.tp in tp_slices):
            src = plain(src)
            assert old in src, f"the generated code changed: {old!r} is not in rank {m.rank}'s program"
            src = src.replace(old, new, 1)
        out[m.rank] = src
    return out


# ---- good plans pass, comparing everything ------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", MODELS)
def test_generated_code_computes_what_the_module_computes(name, config):
    plan = plan_for(name, config)
    model_fn, loss_fn = MODELS[name]
    x, y = microbatch()
    report = plan.verify(model_fn, (x,), loss_fn, targets=y)
    assert report.checked, report
    assert (report.pp, report.tp, report.stages, report.programs) == \
        (plan.pp, plan.tp, plan.pp * plan.interleave, plan.pp * plan.tp)
    assert report.outputs == 1 and report.parameters == len(list(model_fn().parameters()))  # every gradient
    assert report.max_abs_error < 1e-5


def test_default_inputs_and_loss():
    """No inputs: token ids below the smallest embedding table (the GPT's 64 positions); no loss: a fixed
    random weighting of the outputs."""
    report = plan_for("gpt", "pp2tp2").verify(gpt_4l_seeded)
    assert report.checked and report.parameters == len(list(gpt_4l_seeded().parameters()))


def test_a_data_parallel_plan_has_no_model_code_to_verify():
    plan = {"config": {"pp": 1, "tp": 1, "dp": 2, "microbatch_size": 2}, "seq_len": SEQ,
            "mesh": [{"rank": r, "pp": 0, "dp": r, "tp": 0} for r in range(2)]}
    report = verify_plan(plan, gpt_4l_seeded)
    assert not report.checked and "pp = tp = 1" in report.note
    assert verify_skip_reason(plan).startswith("pp = tp = 1")


def test_launchers_skip_models_over_the_size_threshold():
    plan = plan_for("gpt", "pp2tp2")
    assert verify_skip_reason(plan) == ""
    assert "parameter elements > 10" in verify_skip_reason(plan, max_elements=10)


# ---- broken programs are caught, and the place named ----------------------------------------------


@pytest.mark.parametrize("name,old,new,block,sub", [
    ("gpt", "g = tp_reduce(linear_default, tp)", "g = linear_default", "transformer.h.2", "attn.c_proj"),
    ("llama", "g = tp_reduce(linear_default, tp)", "g = linear_default", "model.layers.2", "self_attn.o_proj"),
    ("hf", "g_1 = tp_reduce(mm_default_1, tp)", "g_1 = mm_default_1", "transformer.h.2", "mlp.c_proj"),
])
def test_a_dropped_row_parallel_reduce_is_caught_in_its_block(name, old, new, block, sub):
    plan = plan_for(name, "pp2tp2")  # pipeline rank 1 runs blocks 2 and 3
    x, y = microbatch()
    with pytest.raises(VerifyError) as err:
        plan.verify(MODELS[name][0], (x,), MODELS[name][1], targets=y, sources=edited(plan, old, new, pp_rank=1))
    first = str(err.value).splitlines()[0]  # the line the CLI shows
    assert f"first in the forward of block {block} " in first and f"at sub-module {sub} " in first, first


def test_a_dropped_sequence_parallel_reduce_scatter_is_caught_in_its_block():
    """Under sequence parallelism the row-parallel partial sums are reduce-scattered over the tokens; a program
    that slices its own partial sums instead computes a wrong sum."""
    plan = plan_for("gpt", "pp2tp2sp")
    x, y = microbatch()
    sources = edited(plan, "scattered = sp_scatter(linear_default, 1, tp)", "scattered = tp_chunk(linear_default, 1, tp)",
                     pp_rank=1)
    with pytest.raises(VerifyError) as err:
        plan.verify(gpt_4l_seeded, (x,), gpt_loss, targets=y, sources=sources)
    first = str(err.value).splitlines()[0]
    assert "first in the forward of block transformer.h.2 " in first and "at sub-module attn.c_proj " in first, first


def test_a_layer_norm_weight_on_a_token_slice_needs_its_gradient_summed():
    """Under sequence parallelism ln_1 sees 1/tp of the tokens: without f on its weight, each slice keeps only
    its own tokens' share of the gradient."""
    plan = plan_for("gpt", "pp2tp2sp")
    sources = edited(plan, "ln_1_weight_f = tp_copy(ln_1_weight, tp)", "ln_1_weight_f = ln_1_weight", pp_rank=1)
    with pytest.raises(VerifyError) as err:
        plan.verify(gpt_4l_seeded, sources=sources)
    msg = str(err.value)
    assert "first in the backward of block transformer.h.2 " in msg.splitlines()[0], msg
    assert "transformer.h.2.ln_1.weight" in msg, msg


def test_a_parameter_read_in_place_of_another_is_caught_with_its_gradient():
    """Block 2 normalises with ln_2's weight instead of ln_1's: both start as ones, so only gradients tell."""
    plan = plan_for("gpt", "pp2tp2")
    sources = edited(plan, "layer_norm.default(x, [64], ln_1_weight", "layer_norm.default(x, [64], ln_2_weight", 1)
    with pytest.raises(VerifyError) as err:
        plan.verify(gpt_4l_seeded, sources=sources)
    first = str(err.value).splitlines()[0]
    assert "first in the backward of block transformer.h.2 " in first, first
    assert "gradient of transformer.h.2.ln_1.weight:" in first and "the generated code gives none" in first, first


def test_a_dropped_column_input_copy_is_caught_in_backward():
    """Without f the input gradient misses the other slice's share, and the replicated layer norm's gradient
    differs between slices."""
    plan = plan_for("gpt", "pp2tp2")
    sources = edited(plan, "f = tp_copy(layer_norm_2, tp)", "f = layer_norm_2", pp_rank=1)
    with pytest.raises(VerifyError) as err:
        plan.verify(gpt_4l_seeded, sources=sources)
    msg = str(err.value)
    assert "first in the backward of block transformer.h.2 " in msg.splitlines()[0], msg
    assert "gradient of replicated transformer.h.2.ln_1.weight, tensor slice 1 vs slice 0" in msg, msg


def test_a_broken_block_template_in_the_plan_is_caught_in_block_0():
    """The plan's own code edited (a Segment replaced): every block runs it, so block 0 is the first to differ."""
    plan = plan_for("gpt", "tp2")
    block = plan.code.block
    assert "g_1 = tp_reduce(linear_default_1, tp)" in plain(block.source)
    broken = dataclasses.replace(plan, code=dataclasses.replace(plan.code, block=dataclasses.replace(
        block, source=plain(block.source).replace("g_1 = tp_reduce(linear_default_1, tp)", "g_1 = linear_default_1"))))
    with pytest.raises(VerifyError, match=r"first in the forward of block transformer\.h\.0 .*at sub-module "
                                          r"mlp\.c_proj"):
        broken.verify(gpt_4l_seeded)


def test_a_forgotten_tie_is_refused():
    """Both pipeline ranks read the embedding (prefix and LM head); programs that do not list it as tied would
    let the two copies drift apart."""
    plan = plan_for("gpt", "pp2")
    tied = "TIED = ('transformer.wte.weight',)"
    sources = {m.rank: plan.program(m.rank).source for m in plan.mesh}
    assert all(tied in src for src in sources.values())
    sources = {r: src.replace(tied, "TIED = ()") for r, src in sources.items()}
    with pytest.raises(VerifyError, match=r"transformer\.wte\.weight is read by pipeline ranks \[0, 1\] but is not "
                                          r"in their programs' TIED"):
        plan.verify(gpt_4l_seeded, sources=sources)


def test_slices_that_issue_different_collectives_are_refused():
    plan = plan_for("gpt", "pp2tp2")  # only tensor slice 0 of pipeline rank 1 drops its all-reduce
    sources = edited(plan, "g = tp_reduce(linear_default, tp)", "g = linear_default", pp_rank=1, tp_slices=(0,))
    with pytest.raises(VerifyError, match="do not issue the same collectives|issued different collectives"):
        plan.verify(gpt_4l_seeded, sources=sources)


# ---- compile(verify=True) and launchers ---------------------------------------------------------------


def test_compile_verifies_the_chosen_plan_on_a_copy(monkeypatch):
    reports = []
    real = runtime.verify.check.verify_plan
    monkeypatch.setattr(runtime.verify.check, "verify_plan", lambda *a, **k: reports.append(real(*a, **k)) or reports[-1])
    model = gpt_4l_seeded()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, _ = microbatch()
    compile(model, "local:4", example_inputs=(x,), global_batch_size=BATCH, precision="fp32", pp=2, tp=2, dp=1,
            microbatch_size=2, verify=True)
    assert len(reports) == 1 and reports[0].checked and reports[0].parameters > 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    torch.testing.assert_close(model(x)[0], gpt_4l_seeded()(x)[0])  # the user's module still runs itself


def test_compile_verify_refuses_a_meta_model():
    with torch.device("meta"):
        model = gpt_4l_seeded()
    with pytest.raises(DeclarationError, match=r"meta device.*plan\.verify\(model_fn\)"):
        compile(model, "local:4", example_inputs=(torch.randint(0, VOCAB, (2, SEQ)),), global_batch_size=BATCH,
                pp=2, tp=2, verify=True)


def test_launch_local_stops_a_broken_program_before_spawning():
    plan = plan_for("gpt", "pp2tp2")
    sources = edited(plan, "g = tp_reduce(linear_default, tp)", "g = linear_default", pp_rank=1)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))]
    start = time.perf_counter()
    with pytest.raises(VerifyError, match=r"block transformer\.h\.2"):  # a worker's failure would be a LaunchError
        launch_local(plan, gpt_4l_seeded, adamw, gpt_loss, batches, programs=sources, timeout_s=30)
    assert time.perf_counter() - start < 20 and not multiprocessing.active_children()


@pytest.mark.slow
def test_a_resume_verifies_programs_other_than_those_that_wrote_the_checkpoint(tmp_path):
    """An elastic restart resumes under a new plan: its programs are checked before spawning. Resuming the
    programs that wrote the checkpoint (verified at that run's start) checks nothing again."""
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
               for _ in range(2)]
    a = plan_for("gpt", "pp2")
    launch_local(a, gpt_4l_seeded, adamw, gpt_loss, batches[:1], save_dir=tmp_path, save_every=1, timeout_s=60)
    b = plan_for("gpt", "pp2tp2")
    broken = edited(b, "g = tp_reduce(linear_default, tp)", "g = linear_default", pp_rank=1)
    with pytest.raises(VerifyError, match=r"block transformer\.h\.2"):
        launch_local(b, gpt_4l_seeded, adamw, gpt_loss, batches, programs=broken, resume_from=tmp_path, timeout_s=60)
    assert not multiprocessing.active_children()
    calls = []
    real = runtime.verify.check.verify_plan
    try:
        runtime.verify.check.verify_plan = lambda *args, **kw: calls.append(1) or real(*args, **kw)
        out = launch_local(a, gpt_4l_seeded, adamw, gpt_loss, batches, resume_from=tmp_path, timeout_s=60)
    finally:
        runtime.verify.check.verify_plan = real
    assert out.start_step == 1 and calls == []


# ---- the in-process tensor group -------------------------------------------------------------------


def on_threads(world: int, fn):
    group, out, errors = LocalGroup(world, timeout_s=10), [None] * world, [None] * world

    def run(t):
        try:
            out[t] = fn(t, group, LocalCollectives(t))
        except BaseException as exc:
            errors[t] = exc
        finally:
            group.leave(t, errors[t])

    threads = [threading.Thread(target=run, args=(t,)) for t in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return out, errors


def test_local_collectives_reduce_gather_and_scatter_in_rank_order():
    def fn(t, group, coll):
        a = torch.full((4,), float(t + 1))
        coll.all_reduce(a, group)
        m = torch.tensor([float(t)])
        coll.all_reduce(m, group, op="max")
        v = torch.tensor([float(t)])
        coll.all_reduce(v, group, op="avg")
        gathered = torch.empty(3 * 2)
        coll.all_gather(gathered, torch.tensor([t, 10.0 + t]), group)
        part = torch.empty(2)
        coll.reduce_scatter(part, torch.arange(6.0) * (t + 1), group)
        return a, m, v, gathered, part, dict(coll.counts)

    out, errors = on_threads(3, fn)
    assert errors == [None] * 3
    for t, (a, m, v, gathered, part, counts) in enumerate(out):
        assert torch.equal(a, torch.full((4,), 6.0)) and m.item() == 2.0 and v.item() == 1.0
        assert gathered.tolist() == [0, 10, 1, 11, 2, 12]
        assert part.tolist() == (torch.arange(6.0) * 6)[2 * t:2 * t + 2].tolist()
        assert counts == {"all_reduce": 3, "all_gather": 1, "reduce_scatter": 1}


def test_local_collectives_refuse_mismatched_calls_without_hanging():
    def different(t, group, coll):
        coll.all_reduce(torch.zeros(2 + t), group)  # slice 1 reduces 3 numbers, slice 0 two

    def early_exit(t, group, coll):
        for _ in range(1 + t):  # slice 1 waits in a second all-reduce that slice 0 never joins
            coll.all_reduce(torch.zeros(2), group)

    start = time.perf_counter()
    _, errors = on_threads(2, different)
    assert all(isinstance(e, LocalCollectiveError) and "different collectives" in str(e) for e in errors), errors
    _, errors = on_threads(2, early_exit)
    assert errors[0] is None and isinstance(errors[1], LocalCollectiveError), errors
    assert "slice 0 finished" in str(errors[1]) or "after slices [0] finished" in str(errors[1]), errors[1]
    assert time.perf_counter() - start < 5  # broken at once, not at the 10 s timeout


def test_randomness_off_fixes_every_draw_in_eager_and_aten_forms():
    """verify runs the module and the generated code with each random draw fixed (runtime.verify.no_randomness):
    the eager methods a module calls and the aten ops its generated code calls give the same values."""
    from runtime.verify.no_randomness import NoRandomness

    aten = torch.ops.aten
    x = torch.empty(2, 3)
    probs = torch.tensor([[0.1, 0.7, 0.2]])
    with NoRandomness():
        cases = {
            "uniform_": (x.clone().uniform_(2.0, 4.0), 3.0),
            "aten.uniform": (aten.uniform.default(x, 2.0, 4.0), 3.0),
            "exponential_": (x.clone().exponential_(4.0), 0.25),
            "aten.exponential": (aten.exponential.default(x, 4.0), 0.25),
            "normal_": (x.clone().normal_(1.5, 2.0), 1.5),
            "normal": (torch.normal(torch.full((2, 3), -1.0), 1.0), -1.0),
            "rand_like": (torch.rand_like(x), 0.5),
            "randn": (torch.randn(2, 3), 0.0),
            "bernoulli_": (x.clone().bernoulli_(0.25), 0.25),
            "bernoulli": (torch.bernoulli(torch.full((2, 3), 0.75)), 0.75),
            "geometric_": (x.clone().geometric_(0.5), 2.0),
            "cauchy_": (x.clone().cauchy_(0.5, 1.0), 0.5),
            "randint": (torch.randint(3, 9, (2, 3)), 3),
            "random_": (torch.empty(2, 3, dtype=torch.long).random_(5), 0),
        }
        perm = torch.randperm(5)
        picks = torch.multinomial(probs, 2)
        dropped = torch.nn.functional.dropout(torch.ones(4), 0.5, training=True)
    for what, (got, want) in cases.items():
        assert torch.equal(got, torch.full_like(got, want)), what
    assert perm.tolist() == [0, 1, 2, 3, 4] and picks.tolist() == [[1, 2]] and dropped.tolist() == [1.0] * 4
    assert not torch.equal(torch.rand(4), torch.rand(4))  # outside the mode, draws are random again
    with NoRandomness():  # a seeded generator of the caller's (verify's own inputs and loss weights) is kept
        seeded = torch.rand(4, generator=torch.Generator().manual_seed(5))
    assert torch.equal(seeded, torch.rand(4, generator=torch.Generator().manual_seed(5)))
    assert seeded.unique().numel() == 4


def test_randomness_stays_off_in_a_checkpointed_regions_recomputation():
    """torch.utils.checkpoint runs the region's forward again inside the backward: there too dropout is the
    identity, whether the backward is called as a method, as torch.autograd.backward or torch.autograd.grad."""
    from runtime.verify.no_randomness import NoRandomness

    w = torch.nn.Parameter(torch.arange(6.0).view(2, 3))

    def region(x):  # the matmul saves the dropout's output for w's gradient: recomputed, it must be x again
        return (torch.nn.functional.dropout(x, 0.5, training=True) @ w).sum(-1)

    x = torch.ones(4, 2, requires_grad=True)
    for run in (lambda y: y.sum().backward(), lambda y: torch.autograd.backward([y], [torch.ones_like(y)]),
                lambda y: (w.grad.add_(torch.autograd.grad(y.sum(), [w])[0]) if w.grad is not None else
                           setattr(w, "grad", torch.autograd.grad(y.sum(), [w])[0]))):
        w.grad = None
        with NoRandomness():
            run(torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False))
        assert torch.equal(w.grad, torch.full((2, 3), 4.0)), w.grad  # d/dw sum(x @ w), x all ones, 4 rows


def test_a_model_with_dropout_verifies_under_its_own_checkpointing_and_the_plans_recomputation():
    """GPT-2's configuration drops out 0.1 by default. Its gradient checkpointing (Hugging Face's) and a plan's
    recomputation both run a block's forward again in the backward; verify used to see dropout on there and
    fail with torch's CheckpointError, blaming the generated code."""
    import transformers

    def gpt2():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16, use_cache=False,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
        model.gradient_checkpointing_enable()
        return model

    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = compile(trace(gpt2(), (x,)), "local:2", global_batch_size=2, microbatch_size=2, precision="fp32", pp=2,
                   tp=1, dp=1, recompute="full")
    report = plan.verify(gpt2, (x,), hf_loss, targets=torch.roll(x, -1, 1))
    assert "match the module" in str(report)
