"""A learning-rate schedule under every kind of plan: each rank steps its own scheduler after each optimizer step,
and the run trains as one process stepping the same scheduler (losses and parameters, SGD with momentum, fp32).
A resume under another plan replays the schedule to the checkpoint's step. The learning rate changes every step
(examples.training.warmup_cosine), so a step taken at another step's rate shows in the parameters."""
from __future__ import annotations

import pytest
import torch

from examples.training import sgd, train_one_process, warmup_cosine
from runtime import launch_local
from runtime.engines.lr_schedule import LRSchedule
from ranks import assert_trains_like
from test_3d_equivalence import MODELS, batches, plan_for


def _optimizer():
    return sgd([torch.nn.Parameter(torch.ones(3))])


def test_a_resumed_schedule_is_at_the_checkpoints_step():
    """Replayed on a fresh scheduler, from each group's step-0 rate, whatever rate a checkpoint's load set."""
    ran = LRSchedule(_optimizer(), warmup_cosine)
    rates = []
    for _ in range(5):
        rates.append(ran.last_lr()[0])
        ran.optimizer.step()
        ran.step()
    assert len(set(rates)) == 5
    resumed = LRSchedule(_optimizer(), warmup_cosine)
    resumed.optimizer.param_groups[0]["lr"] = 123.0  # as load_checkpoint sets the saved current rate
    resumed.resume(3)
    assert resumed.last_lr() == [rates[3]]


@pytest.mark.parametrize("make, words", [
    (lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "ReduceLROnPlateau, which steps on a metric"),
    (lambda opt: torch.optim.lr_scheduler.LambdaLR(_optimizer(), lambda s: 1.0), "not a learning-rate scheduler of "
                                                                              "that optimizer"),
    (lambda opt: 0.5, "returned float"),
])
def test_what_is_not_a_schedule_of_the_optimizer_is_refused(make, words):
    with pytest.raises(ValueError, match=words):
        LRSchedule(_optimizer(), make)


@pytest.mark.slow
@pytest.mark.parametrize("pins", [dict(pp=1, dp=2, tp=1, zero=1), dict(pp=2, dp=1, tp=2),
                                  dict(pp=1, dp=2, tp=1, zero=3)], ids=["dp2-zero1", "pp2tp2", "dp2-zero3"])
def test_a_scheduled_run_trains_as_one_process(pins):
    model_fn, loss_fn = MODELS["gpt"]
    data = batches(4)
    out = launch_local(plan_for("gpt", **pins), model_fn, sgd, loss_fn, data, scheduler_fn=warmup_cosine,
                       timeout_s=180)
    trained = train_one_process(model_fn, sgd, loss_fn, data, scheduler_fn=warmup_cosine)
    assert_trains_like(out, trained.losses, trained.model.state_dict())
    unscheduled = train_one_process(model_fn, sgd, loss_fn, data)  # the test can fail: the schedule moves the result
    assert not torch.allclose(unscheduled.model.state_dict()["lm_head.weight"],
                              trained.model.state_dict()["lm_head.weight"], atol=1e-4)


@pytest.mark.slow
def test_a_resumed_scheduled_run_trains_as_one_process(tmp_path):
    """Steps 1-2 under dp2 ZeRO-1, checkpointed; steps 3-4 under pp2 x tp2 from it: one process's 4 steps."""
    model_fn, loss_fn = MODELS["gpt"]
    data = batches(4)
    launch_local(plan_for("gpt", pp=1, dp=2, tp=1, zero=1), model_fn, sgd, loss_fn, data[:2], save_dir=tmp_path,
                 save_every=2, scheduler_fn=warmup_cosine, timeout_s=180)
    out = launch_local(plan_for("gpt", pp=2, dp=1, tp=2), model_fn, sgd, loss_fn, data, resume_from=tmp_path,
                       scheduler_fn=warmup_cosine, timeout_s=180)
    trained = train_one_process(model_fn, sgd, loss_fn, data, scheduler_fn=warmup_cosine)
    assert_trains_like(out, trained.losses[2:], trained.model.state_dict())


def test_a_runner_that_does_not_step_a_schedule_is_refused():
    """A hand-written program's runner without the contract's lr_schedule would train at a constant rate."""
    from runtime.engines.lr_schedule import attach_lr_schedule

    class Runner:
        optimizer = _optimizer()

    with pytest.raises(ValueError, match="Runner does not step a learning-rate schedule: .*runner.lr_schedule = None"):
        attach_lr_schedule(Runner(), warmup_cosine)
    attach_lr_schedule(Runner(), None)  # without a schedule any runner runs
