"""The user's optimizer under plans that step parameters in pieces: its parameter groups kept, or refused.

ZeRO steps flat 1-D shards and tensor parallelism slices of parameters. An optimizer_fn with parameter groups
by shape (nanoGPT's: weight decay for p.dim() >= 2 only) saw only 1-D shards under ZeRO and trained with one
group, silently unlike one process; one whose update reads whole tensors (Adafactor, LAMB, Muon) stepped each
piece as a tensor. runtime.engines.optimizer_groups keeps the groups on the shards and refuses the second kind
where parameters are split, before any rank starts. The runs are real Gloo processes, compared with one process
(losses and every parameter, fp32).
"""

from __future__ import annotations

import functools

import pytest
import torch

from examples.gpt import example_batch
from examples.training import gpt_loss, gpt_small_seeded, sgd, train_one_process
from partitioner import compile, trace
from runtime import launch_local
from runtime.engines.optimizer_groups import OptimizerError, check_optimizer, differing_groups
from runtime.launch.env import LaunchError


def decay_matrices(params):
    """nanoGPT's groups: weight decay on matrices only, none on biases and norms (SGD with momentum)."""
    params = list(params)
    return torch.optim.SGD([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.5},
                            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=0.05, momentum=0.9)


def adamw_decay_matrices(params):
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3)


def matrices_only(params):
    """Biases and norms left out of the optimizer: they stay at their initial values."""
    return torch.optim.SGD([p for p in params if p.dim() >= 2], lr=0.05, momentum=0.9)


def adafactor(params):
    return torch.optim.Adafactor(params, lr=0.01)


class Lamb(torch.optim.Optimizer):
    """A minimal LAMB-like step: SGD scaled per tensor by ||p|| / ||g||, the trust ratio."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = p.norm() / p.grad.norm().clamp_min(1e-12)
                    p.add_(p.grad, alpha=-group["lr"] * float(ratio))


def lamb(params):
    return Lamb(params)


def muon(params):
    return torch.optim.Muon(params, lr=0.02)


@functools.cache
def _setup():
    model = gpt_small_seeded()
    batches = [example_batch(model, 8, seed=s) for s in range(2)]
    return trace(model, (batches[0][0][:2],)), batches


def _plan(world: int, **pins):
    g, _ = _setup()
    return compile(g, f"local:{world}", global_batch_size=8, microbatch_size=2, precision="fp32", **pins)


def _assert_same(result, reference, *, atol: float) -> None:
    assert result.losses == pytest.approx(reference.losses, rel=1e-5)
    ref = reference.model.state_dict()
    worst = max(float((result.state_dict[k].float() - ref[k].float()).abs().max()) for k in ref)
    assert worst <= atol, f"parameters differ from one process by up to {worst}"


@pytest.mark.parametrize("optimizer_fn", [sgd, decay_matrices, adamw_decay_matrices])
def test_elementwise_optimizers_pass_the_check(optimizer_fn):
    check_optimizer(optimizer_fn, zero_stage=3, sliced=True)


@pytest.mark.parametrize("optimizer_fn", [adafactor, lamb, muon])
def test_optimizers_that_read_whole_tensors_are_refused_where_parameters_are_split(optimizer_fn):
    for pins in (dict(zero_stage=1, sliced=False), dict(zero_stage=0, sliced=True)):
        with pytest.raises(OptimizerError, match="would train differently from one process. Use zero_stage=0 and tp=1"):
            check_optimizer(optimizer_fn, **pins)
    check_optimizer(optimizer_fn, zero_stage=0, sliced=False)  # whole parameters: nothing to check


def test_groups_that_differ_are_found_from_shapes():
    shapes = {"w": (4, 3), "b": (3,)}
    assert differing_groups(decay_matrices, shapes) and differing_groups(matrices_only, shapes)
    assert not differing_groups(sgd, shapes)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_fn,pins,world,atol", [
    (decay_matrices, dict(dp=2, zero_stage=1, pp=1, tp=1), 2, 1e-6),
    (decay_matrices, dict(dp=2, zero_stage=3, pp=1, tp=1), 2, 1e-6),
    (matrices_only, dict(dp=2, zero_stage=2, pp=1, tp=1), 2, 1e-6),
    (decay_matrices, dict(dp=2, zero_stage=1, pp=2, tp=1), 4, 1e-6),  # the tied wte / lm_head copies as well
    (adamw_decay_matrices, dict(dp=2, zero_stage=1, pp=1, tp=1), 2, 1e-4),
])
def test_parameter_groups_by_shape_train_like_one_process_under_zero(optimizer_fn, pins, world, atol):
    _, batches = _setup()
    reference = train_one_process(gpt_small_seeded, optimizer_fn, gpt_loss, batches)
    result = launch_local(_plan(world, **pins), gpt_small_seeded, optimizer_fn, gpt_loss, batches, timeout_s=300)
    _assert_same(result, reference, atol=atol)


@pytest.mark.slow
def test_an_optimizer_that_reads_whole_tensors_is_refused_before_ranks_start_and_trains_on_whole_parameters():
    _, batches = _setup()
    for pins in (dict(dp=2, zero_stage=1, pp=1, tp=1), dict(dp=1, pp=1, tp=2)):
        with pytest.raises(OptimizerError, match="Adafactor does not step a parameter's pieces"):
            launch_local(_plan(2, **pins), gpt_small_seeded, adafactor, gpt_loss, batches, timeout_s=300)
    reference = train_one_process(gpt_small_seeded, adafactor, gpt_loss, batches)
    result = launch_local(_plan(2, dp=1, pp=2, tp=1), gpt_small_seeded, adafactor, gpt_loss, batches, timeout_s=300)
    _assert_same(result, reference, atol=1e-4)


def test_a_checkpointed_run_with_groups_on_zero_shards_is_refused_before_ranks_start(tmp_path):
    _, batches = _setup()
    with pytest.raises(LaunchError, match="save_dir and resume_from are not supported with it yet"):
        launch_local(_plan(2, dp=2, zero_stage=1, pp=1, tp=1), gpt_small_seeded, decay_matrices, gpt_loss, batches,
                     save_dir=tmp_path, save_every=1, timeout_s=300)
