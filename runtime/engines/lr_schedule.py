"""The user's learning-rate schedule on a rank's optimizer: `scheduler_fn(optimizer)` -> a torch LRScheduler.

Every rank builds its own scheduler over its own optimizer (its pipeline stages' parameters, its tensor slices,
its ZeRO shards) and steps it once after each optimizer step, as a one-process loop calls `scheduler.step()`
after `optimizer.step()`. A schedule is a function of the step count and the optimizer's base learning rates, so
every rank's groups follow the same learning rate at every step, whatever the plan holds where.

On a resume the schedule is replayed to the checkpoint's step (`LRSchedule.resume`), not loaded from a state dict:
the step count is the one thing a schedule carries that does not depend on the plan, while a rank's parameter
groups (how many, which learning rates) differ between the plan that saved and the one that resumes.

    runner = build(model_fn, optimizer_fn, loss_fn)
    attach_lr_schedule(runner, scheduler_fn)     # after build, before a checkpoint is loaded
    start = load_checkpoint(runner, path).step
    resume_lr_schedule(runner, start)            # the learning rate of step `start`
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

__all__ = ["LRSchedule", "attach_lr_schedule", "resume_lr_schedule"]


class LRSchedule:
    def __init__(self, optimizer: torch.optim.Optimizer, scheduler_fn: Callable[[torch.optim.Optimizer], Any]):
        self.optimizer = optimizer
        scheduler = scheduler_fn(optimizer)
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError("scheduler_fn returned ReduceLROnPlateau, which steps on a metric the runtime does not "
                             "have: use a schedule of the step count (LambdaLR, CosineAnnealingLR, OneCycleLR, "
                             "SequentialLR, ...)")
        if not callable(getattr(scheduler, "step", None)) or getattr(scheduler, "optimizer", None) is not optimizer:
            raise ValueError(f"scheduler_fn(optimizer) returned {type(scheduler).__name__}, not a learning-rate "
                             "scheduler of that optimizer: return e.g. torch.optim.lr_scheduler.LambdaLR(optimizer, "
                             "lambda step: ...) built on the optimizer it is given")
        self.scheduler = scheduler
        self._first = [g["lr"] for g in optimizer.param_groups]  # each group's learning rate at step 0

    def step(self) -> None:
        """After the optimizer's step: the learning rate of the next one."""
        self.scheduler.step()

    def resume(self, steps: int) -> None:
        """The learning rate of step `steps`, on a scheduler built and not yet stepped: each group back at its step-0
        rate (a checkpoint's load sets the saved current one, which a chained schedule would decay again), then
        `steps` scheduler steps."""
        if steps <= 0:
            return
        for g, lr in zip(self.optimizer.param_groups, self._first):
            g["lr"] = lr
        with warnings.catch_warnings():  # torch warns of a scheduler stepped before its optimizer: on purpose here
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(steps):
                self.scheduler.step()

    def last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]


def attach_lr_schedule(runner: Any, scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None) -> None:
    """Give a program's runner (runtime.engines.step.StepRunner, runtime.pipeline.runner.PipelineRunner,
    runtime.engines.async_sgd.AsyncSGDRunner) the schedule it steps after each optimizer step; None: none."""
    if scheduler_fn is None:
        if hasattr(runner, "lr_schedule"):
            runner.lr_schedule = None
        return
    optimizer = getattr(runner, "optimizer", None)
    if not hasattr(runner, "lr_schedule") or optimizer is None:  # a hand-written program's runner, say
        raise ValueError(f"{type(runner).__name__} does not step a learning-rate schedule: a program's runner that "
                         "does sets runner.lr_schedule = None in its __init__, steps it after its optimizer's step "
                         "(runtime.engines.lr_schedule), and keeps that optimizer as runner.optimizer; run it "
                         "without scheduler_fn, or add those to the program")
    runner.lr_schedule = LRSchedule(optimizer, scheduler_fn)


def resume_lr_schedule(runner: Any, steps: int) -> None:
    """After a checkpoint's load: the runner's schedule (if it has one) at the checkpoint's step."""
    schedule = getattr(runner, "lr_schedule", None)  # a hand-written program's runner may have none
    if schedule is not None:
        schedule.resume(steps)
