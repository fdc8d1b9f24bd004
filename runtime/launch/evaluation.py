"""Evaluation in a run: the mean loss over held-out batches, every k steps (`launch_local`, `runtime.run`).

A runner's `evaluate(batch)` is a collective returning the global mean loss on one global batch, as one process
computes it in eval mode (runtime.pipeline.evaluation); a run's evaluation is the mean of it over the evaluation
batches, each weighing the same (as Megatron averages its eval iterations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.engines.step import batch_size
from runtime.launch.env import LaunchError

__all__ = ["EVAL_SEED", "check_eval_batches", "evaluate_batches"]

# an example module's held-out batches: example_batch at seeds EVAL_SEED + k, which no training step reaches
EVAL_SEED = 1_000_000


def check_eval_batches(plan: Any, eval_batches: Sequence[Any] | None, eval_every: int | None) -> list[Any]:
    """The evaluation batches as a list, checked before any rank starts: each a global batch of the plan's
    size (runners slice it as a training batch), `eval_every` a positive number of steps, and only with batches."""
    if eval_every is not None and (isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1):
        raise LaunchError(f"eval_every={eval_every!r}: must be a positive number of steps")
    batches = [] if eval_batches is None else list(eval_batches)
    if eval_every is not None and not batches:
        raise LaunchError("eval_every without eval_batches: pass the held-out global batches to evaluate on")
    want = getattr(plan, "global_batch_size", None)
    for i, b in enumerate(batches):
        if not isinstance(b, (tuple, list)) or len(b) != 2:
            raise LaunchError(f"eval_batches[{i}] is a {type(b).__name__}: pass (inputs, targets) pairs, as the "
                              "training batches")
        try:
            n = batch_size(b[1] if b[1] is not None else b[0])
        except ValueError as exc:
            raise LaunchError(f"eval_batches[{i}]: {exc}") from None
        if want is not None and n != want:
            raise LaunchError(f"eval_batches[{i}] holds {n} samples, but the plan steps global batches of {want} "
                              "(each replica's microbatches): pass evaluation batches of the plan's global_batch_size")
    return batches


def evaluate_batches(runner: Any, batches: Sequence[Any]) -> float:
    """The mean of `runner.evaluate` over `batches` (a collective: every rank calls it with the same batches)."""
    if not callable(getattr(runner, "evaluate", None)):
        raise LaunchError(f"the program's runner ({type(runner).__name__}) has no evaluate(batch): a generated "
                          "program's runner has one; a hand-written one must return the global mean loss of a "
                          "forward in eval mode, on every rank, to be evaluated")
    return sum(runner.evaluate(b) for b in batches) / len(batches)
