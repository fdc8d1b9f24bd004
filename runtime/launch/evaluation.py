"""Evaluation in a run: the mean loss over held-out batches, every k steps (`launch_local`, `runtime.run`).

A runner's `evaluate(batch)` is a collective returning the global mean loss on one global batch, as one process
computes it in eval mode (runtime.engines.evaluation); a run's evaluation is the mean of it over the evaluation
batches, each weighing the same (as Megatron averages its eval iterations).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from runtime.engines.step import batch_size
from runtime.launch.env import LaunchError

__all__ = ["EVAL_SEED", "check_eval_batches", "check_eval_mode", "eval_mode_check_applies", "evaluate_batches"]

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


def eval_mode_check_applies(plan: Any) -> bool:
    """Whether the plan's ranks run its traced code (pipeline, tensor or context parallelism, or attention
    rewritten to a fused kernel) on a model small enough to build here: what `check_eval_mode` looks at."""
    from runtime.verify.check import MAX_VERIFY_ELEMENTS, num_parameters
    from runtime.verify.run import plan_facts

    try:
        facts = plan_facts(plan)
    except (AttributeError, KeyError, TypeError):
        return False
    n = num_parameters(plan)
    return facts.has_code and n is not None and n <= MAX_VERIFY_ELEMENTS


def check_eval_mode(plan: Any, model_fn: Callable, batch: Any, *, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Where the ranks run the plan's traced code, an evaluation runs the training code with its random draws off
    (runtime.engines.evaluation): eval mode only for a module whose eval mode changes nothing else. Checked on the
    first microbatch of `batch` in this process: the module's outputs in eval mode against those in training mode
    with every random draw fixed (runtime.verify.no_randomness); a difference (a batch norm, a training-only branch
    of the model's own code) raises LaunchError before any rank starts."""
    from runtime.verify.check import first_microbatch
    from runtime.verify.compare import leaves
    from runtime.verify.no_randomness import NoRandomness
    from runtime.verify.run import call_module

    if not eval_mode_check_applies(plan):
        return
    inputs, _ = first_microbatch(plan, batch)
    inputs = inputs if isinstance(inputs, (tuple, list, Mapping)) else (inputs,)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = model_fn()
    outs = {}
    for mode in ("training", "eval"):
        model.train(mode == "training")
        with NoRandomness(), torch.no_grad():
            outs[mode] = leaves(call_module(model, inputs))
    for k, (a, b) in enumerate(zip(outs["training"], outs["eval"])):
        if a.shape != b.shape or not torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol):
            gap = float((a.float() - b.float()).abs().max()) if a.shape == b.shape else float("inf")
            raise LaunchError(
                f"{type(model).__name__} computes otherwise in eval mode than in training mode beyond its random "
                f"draws (output {k} differs by {gap:.3g} on the first microbatch): a batch norm, or a branch of its "
                "own code that runs in training only. Under this plan the ranks evaluate the code traced in training "
                "mode with its draws off, which is not the model's eval mode: evaluate under a data-parallel plan "
                "(pp = tp = cp = 1), whose ranks run the module itself, or the trained state_dict in one process")
