"""Evaluation under every kind of plan: the mean loss on held-out global batches as one process computes it under
model.eval() and torch.no_grad() (runtime.engines.evaluation), and a run that evaluates trains exactly as one
that does not (no random number drawn, nothing of the training state moved)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples import gpt
from examples.training import (evaluate_one_process, gpt_loss, gpt_tiny_seeded, hf_gpt2_dropout_seeded,
                               hf_llama_seeded, hf_loss, sgd, train_one_process)
from partitioner import compile
from runtime import launch_local
from runtime.engines.evaluation import EvaluationError, evaluating
from runtime.launch.env import LaunchError
from runtime.launch.evaluation import check_eval_batches, check_eval_mode
from runtime.pipeline.executor import PipelineExecutor, forward_actions
from runtime.pipeline.tensor_parallel import TPContext, tp_forked
from ranks import free_port, group_teardown, spawn
from test_3d_equivalence import BATCH, SEQ, VOCAB, batches

_aten = torch.ops.aten


def test_the_traced_draws_run_as_eval_mode_runs_them():
    x, q = torch.randn(64), torch.randn(1, 2, 8, 4)
    with evaluating(()) as ops:
        assert torch.equal(_aten.dropout.default(x, 0.5, True), x)
        out, mask = _aten.native_dropout.default(x, 0.5, True)
        assert torch.equal(out, x) and bool(mask.all())
        assert torch.equal(F.dropout(x, 0.5), x)
        fused = _aten.scaled_dot_product_attention.default(q, q, q, None, 0.5, True)
        assert torch.equal(fused, F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.0))
    assert ops.changed
    with evaluating(()) as ops:
        torch.relu(x) + _aten.dropout.default(x, 0.5, False)
    assert not ops.changed  # code without draws: a runner's later evaluations skip the mode


def test_modes_come_back_and_no_random_number_is_drawn():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    model[0].eval()  # a submodule the user keeps in eval mode stays so
    torch.manual_seed(3)
    with evaluating([model]):
        assert not model.training and not torch.is_grad_enabled()
        tp_forked(TPContext(None, None, 1, 2), "dropout", torch.ones(8), 0.5, True)
    assert model.training and not model[0].training and torch.is_grad_enabled()
    after = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(1))  # tp_forked drew no seed from the shared stream


def test_a_batch_norm_traced_in_training_mode_is_refused():
    x = torch.randn(4, 3)
    with pytest.raises(EvaluationError, match="batch norm in training mode.*data-parallel plan"):
        with evaluating(()):
            _aten.batch_norm.default(x, None, None, torch.zeros(3), torch.ones(3), True, 0.1, 1e-5, False)


def test_a_forward_only_list_runs_the_forwards_and_takes_the_loss_at_the_last_f():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    stages = {0: model[:2], 1: model[2:]}  # two virtual stages on one rank: handed over in memory
    actions = "0F0 0F1 1F0 1B0 0B0 1F1 1B1 0B1 0GRAD_SYNC 1GRAD_SYNC".split()
    assert [str(a) for a in forward_actions(actions)] == ["0F0", "0F1", "1F0", "1F1"]
    ex = PipelineExecutor(actions=forward_actions(actions), stages=stages, num_stages=2, stage_to_rank=lambda s: 0,
                          collectives=None, loss_fn=F.mse_loss, num_microbatches=2, forward_only=True)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    with torch.no_grad():
        got = ex.run([x[:2], x[2:]], [y[:2], y[2:]])
        want = (F.mse_loss(model(x[:2]), y[:2]) + F.mse_loss(model(x[2:]), y[2:])) / 2
    assert got == pytest.approx(float(want), rel=1e-6)
    with pytest.raises(ValueError, match="forward_actions"):
        PipelineExecutor(actions=actions, stages=stages, num_stages=2, stage_to_rank=lambda s: 0, collectives=None,
                         loss_fn=F.mse_loss, num_microbatches=2, forward_only=True)


class _Plan:
    global_batch_size = 8


@pytest.mark.parametrize("given, every, words", [
    ([(torch.zeros(4, 2), torch.zeros(4))], None, "holds 4 samples, but the plan steps global batches of 8"),
    (None, 2, "eval_every without eval_batches"),
    ([(torch.zeros(8, 2), torch.zeros(8))], 0, "eval_every=0: must be a positive number of steps"),
    ([torch.zeros(8, 2)], None, r"eval_batches\[0\] is a Tensor: pass \(inputs, targets\) pairs"),
])
def test_evaluation_batches_are_checked_before_any_rank_starts(given, every, words):
    with pytest.raises(LaunchError, match=words):
        check_eval_batches(_Plan(), given, every)


def _held_out(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(n)]


def _plan(model_fn, world: int, **pins):
    x = torch.randint(0, VOCAB, (2, SEQ))
    return compile(model_fn(), f"local:{world}", example_inputs=(x,), global_batch_size=BATCH, precision="fp32",
                   microbatch_size=2, **pins)


@pytest.mark.slow
@pytest.mark.parametrize("world, pins", [
    (2, dict(dp=2, zero_stage=3)),
    (2, dict(dp=1, cp=2)),
    (2, dict(pp=2, dp=1, tp=1, schedule="interleaved-zb", interleave=2)),
    (4, dict(pp=2, dp=1, tp=2, sp=True, zero_stage=1)),
], ids=["dp2-zero3", "cp2", "pp2-interleaved-zb", "pp2tp2sp"])
def test_evaluations_equal_one_process_in_eval_mode(world, pins):
    data, held_out = batches(2), _held_out()
    out = launch_local(_plan(hf_llama_seeded, world, **pins), hf_llama_seeded, sgd, hf_loss, data,
                       eval_batches=held_out, eval_every=1, timeout_s=180)
    want = [train_one_process(hf_llama_seeded, sgd, hf_loss, data[:k]) for k in (1, 2)]  # trained k steps
    assert [k for k, _ in out.eval_losses] == [1, 2]
    assert [v for _, v in out.eval_losses] == \
        pytest.approx([evaluate_one_process(t.model, hf_loss, held_out) for t in want], rel=1e-5)
    assert out.losses == pytest.approx(want[-1].losses, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("model_fn, world, pins", [
    (hf_gpt2_dropout_seeded, 4, dict(pp=2, dp=1, tp=2, sp=True)),
    (hf_llama_seeded, 2, dict(dp=2, async_sgd={"every": 2})),
], ids=["gpt2-dropout-pp2tp2sp", "async-dp2"])
def test_an_evaluating_run_trains_as_one_that_does_not(model_fn, world, pins):
    """GPT-2 with dropout 0.1: evaluated with dropout on, the loss would be another draw's; with a draw from the
    shared stream (tp_forked), the next step's masks would move. Async SGD evaluates the replicas' average."""
    plan, data, held_out = _plan(model_fn, world, **pins), batches(2), _held_out()
    evaluated = launch_local(plan, model_fn, sgd, hf_loss, data, eval_batches=held_out, eval_every=1,
                             timeout_s=180)
    plain = launch_local(plan, model_fn, sgd, hf_loss, data, timeout_s=180)
    assert evaluated.losses == plain.losses
    for k, v in plain.state_dict.items():
        assert torch.equal(evaluated.state_dict[k], v), k
    model = model_fn()  # the trained model (async: the replicas' average), evaluated in one process
    model.load_state_dict(plain.state_dict)
    assert [k for k, _ in evaluated.eval_losses] == [1, 2]
    assert evaluated.eval_losses[-1][1] == pytest.approx(evaluate_one_process(model, hf_loss, held_out), rel=1e-5)


class _TrainingOnlyBranch(gpt.GPT):
    """The example GPT with a branch of its own code that runs in training only (logits halved)."""

    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        return (logits * 0.5 if self.training else logits), loss


def training_only_branch() -> gpt.GPT:
    torch.manual_seed(0)
    return _TrainingOnlyBranch(gpt.CONFIGS["gpt_tiny"])


def test_a_model_whose_eval_mode_the_traced_code_cannot_run_is_refused_before_any_rank_starts():
    """Traced in training mode, the code halves the logits; eval mode does not: an evaluation of the code would
    be another model's. Dropout alone (GPT-2's 0.1) is what an evaluation turns off, and passes."""
    x = torch.randint(0, 64, (8, 16))
    plan = compile(training_only_branch(), "local:2", example_inputs=(x[:4],), global_batch_size=8, tp=2)
    with pytest.raises(LaunchError, match="computes otherwise in eval mode than in training mode.*data-parallel plan"):
        launch_local(plan, training_only_branch, sgd, gpt_loss, [(x, x)], eval_batches=[(x, x)])
    check_eval_mode(plan, gpt_tiny_seeded, (x, x))  # the same code without the branch
    gpt2 = _plan(hf_gpt2_dropout_seeded, 2, tp=2, dp=1)
    check_eval_mode(gpt2, hf_gpt2_dropout_seeded, _held_out(1)[0])


def _predicting(rank: int, world: int, _store: str, out_dir: str, port: int, programs: str, x) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from runtime import Trainer

    trainer = Trainer(programs, hf_gpt2_dropout_seeded, sgd, hf_loss, timeout_s=60)
    with group_teardown():
        logits = [trainer.predict((x[:n],)).logits for n in (3, 1)]  # any number of rows, on every rank
        torch.save(logits, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_predict_under_a_pipeline_and_tensor_plan_is_the_models_eval_mode_output_on_every_rank(tmp_path):
    """GPT-2 with dropout 0.1 under pp2 x tp2 + sp: the whole logits (vocab-split on the last stage, gathered) on
    all 4 ranks, as the module computes them in eval mode."""
    plan = _plan(hf_gpt2_dropout_seeded, 4, pp=2, dp=1, tp=2, sp=True)
    x = _held_out(1)[0][0]
    got = spawn(_predicting, 4, tmp_path, free_port(), str(plan.write_programs(tmp_path / "programs")), x)
    model = hf_gpt2_dropout_seeded().eval()
    with torch.no_grad():
        want = [model(x[:n]).logits for n in (3, 1)]
    for rank, logits in enumerate(got):
        for g, w in zip(logits, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, r=rank: f"rank {r}: {m}")
