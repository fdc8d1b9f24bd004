"""A per_token loss's weights: each microbatch's share of the global batch's tokens, on every kind of rank
(sliced as the runners slice the batch: runtime.engines.step.step_weights)."""

from __future__ import annotations

import pytest
import torch

from examples.training import labelled_tokens, target_tokens
from runtime import per_token
from runtime.engines.step import step_weights
from runtime.engines.token_loss import PerToken


def _batch():
    """4 rows of 4 targets, -100 marking 0, 1, 2 and 3 of each row's."""
    y = torch.arange(16).reshape(4, 4)
    for row in range(4):
        y[row, :row] = -100
    return torch.zeros(4, 4), y


LOSS = per_token(lambda out, y: out, target_tokens)


def test_weights_are_each_microbatchs_share_of_the_tokens_times_the_replicas():
    # rows hold 4, 3, 2, 1 tokens (10); dp 2 x 2 microbatches of 1 row: replica 0 holds rows 0, 1
    w0 = step_weights(LOSS, _batch(), dp_rank=0, dp_size=2, microbatch_size=1, num_microbatches=2)
    w1 = step_weights(LOSS, _batch(), dp_rank=1, dp_size=2, microbatch_size=1, num_microbatches=2)
    assert w0 == pytest.approx((2 * 4 / 10, 2 * 3 / 10)) and w1 == pytest.approx((2 * 2 / 10, 2 * 1 / 10))
    # averaged over the 2 replicas, the weights sum to 1: the step's loss is the mean over all 10 tokens
    assert (sum(w0) + sum(w1)) / 2 == pytest.approx(1.0)
    one = step_weights(LOSS, _batch(), dp_rank=0, dp_size=1, microbatch_size=2, num_microbatches=2)
    assert one == pytest.approx((7 / 10, 3 / 10))


def test_context_slices_count_their_own_tokens():
    """cp 2 splits each row's 4 tokens in the load-balanced layout (chunks 0, 3 | 1, 2 of 4): rank 0 holds
    targets 0 and 3 of every row."""
    w = [step_weights(LOSS, _batch(), dp_rank=0, dp_size=1, microbatch_size=4, num_microbatches=1,
                            cp_rank=c, cp_size=2) for c in (0, 1)]
    # row r masks its first r targets: rank 0 counts 2 + 1 + 1 + 1 = 5 of them, rank 1 (targets 1, 2)
    # 2 + 2 + 1 + 0 = 5
    assert w == [pytest.approx((2 * 5 / 10,)), pytest.approx((2 * 5 / 10,))]


def test_a_plain_loss_keeps_one_over_m_and_a_batch_without_tokens_weighs_nothing():
    assert step_weights(lambda o, y: o, _batch(), dp_rank=0, dp_size=1, microbatch_size=2,
                              num_microbatches=2) is None
    empty = (torch.zeros(2, 2), torch.full((2, 2), -100))
    assert step_weights(LOSS, empty, dp_rank=0, dp_size=1, microbatch_size=1, num_microbatches=2) == (0.0, 0.0)


def test_bad_counts_and_arguments_are_refused_saying_what():
    with pytest.raises(TypeError, match="count must be callable"):
        per_token(lambda o, y: o, 3)
    bad = per_token(lambda o, y: o, lambda x, y: -1)
    with pytest.raises(ValueError, match="number of tokens >= 0, got -1"):
        step_weights(bad, _batch(), dp_rank=0, dp_size=1, microbatch_size=4, num_microbatches=1)


def test_the_loss_is_called_as_the_wrapped_one_and_counts_hf_labels_after_the_shift():
    loss = per_token(lambda out, y: out + 1, labelled_tokens)
    assert isinstance(loss, PerToken) and loss(1, None) == 2
    labels = torch.tensor([[-100, -100, 5, 6], [1, 2, 3, -100]])
    assert int(labelled_tokens({"labels": labels})) == 2 + 2  # the first label of a row is never a target


def sum_loss(output, targets):
    """The example GPT's cross entropy summed over every token (reduction="sum"), scaled to a mean's size."""
    logits = output[0]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                             reduction="sum") / 1000.0


def test_a_summed_loss_counts_every_microbatch_whole_on_every_replica():
    from runtime import summed

    w = step_weights(summed(lambda o, y: o), _batch(), dp_rank=1, dp_size=2, microbatch_size=1, num_microbatches=2)
    assert w == (2.0, 2.0)  # averaged over the 2 replicas: each of the 4 rows' sums counts once


def test_a_loss_is_told_a_mean_a_sum_or_weighted_over_its_rows():
    from examples.gpt import example_batch
    from examples.training import gpt_loss, gpt_tiny_seeded
    from runtime.engines.step import reduction_over_rows

    model = gpt_tiny_seeded()
    batch = example_batch(model, 4)
    kind, whole, parts = reduction_over_rows(model, sum_loss, batch)
    assert kind == "sum" and len(parts) == 4 and whole == pytest.approx(sum(parts), rel=1e-5)
    assert reduction_over_rows(model, gpt_loss, batch)[0] == "mean" and model.training  # the mode put back
    kind, whole, parts = reduction_over_rows(model, gpt_loss, _padded(batch))
    assert kind == "weighted" and abs(whole - sum(parts) / 4) > 1e-5 * whole
    assert reduction_over_rows(model, gpt_loss, (batch[0][:1], batch[1][:1])) is None  # one row: nothing to tell


def _padded(batch):
    """Row r's first 2r targets -100: a token mean weighs the rows 8, 6, 4 and 2 (of the example's 8 tokens)."""
    x, y = batch
    y = y.clone()
    for row in range(y.shape[0]):
        y[row, :2 * row] = -100
    return x, y


def test_a_token_mean_over_uneven_pads_is_warned_before_any_rank_starts_and_per_token_is_not():
    """The plan weighs its 4 pieces alike, one process each token: another loss, said before anything runs."""
    from examples.gpt import example_batch
    from examples.training import gpt_loss, gpt_tiny_seeded
    from partitioner import compile, trace
    from runtime.launch.loss_check import check_loss_reduction

    model = gpt_tiny_seeded()
    batch = _padded(example_batch(model, 4))
    g = trace(model, (batch[0][:2],))
    plan = compile(g, "local:2", global_batch_size=4, microbatch_size=1, precision="fp32", dp=2, pp=1, tp=1)
    with pytest.warns(UserWarning, match=r"not a mean over the rows.*4 pieces of 1 row.*runtime\.per_token"):
        check_loss_reduction(plan, gpt_tiny_seeded, gpt_loss, batch)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_loss_reduction(plan, gpt_tiny_seeded, per_token(gpt_loss, target_tokens), batch)
        check_loss_reduction(plan, gpt_tiny_seeded, gpt_loss, example_batch(model, 4))  # no pads: a mean


@pytest.mark.slow
def test_a_summed_loss_is_refused_bare_and_trains_like_one_process_wrapped():
    """A plan averages its microbatches' and replicas' losses, which is one process's loss only for a mean: a sum
    (reduction="sum") trained on 1/4 of it, silently. It is refused before any rank starts, and runtime.summed
    keeps the sum."""
    from examples.gpt import example_batch
    from examples.training import gpt_small_seeded, sgd
    from partitioner import compile, trace
    from ranks import assert_plan_trains_like_one_process
    from runtime import launch_local, summed
    from runtime.launch.env import LaunchError

    model = gpt_small_seeded()
    data = [example_batch(model, 8, seed=s) for s in range(2)]
    g = trace(model, (data[0][0][:2],))
    for dp, pp in ((2, 1), (1, 2)):
        plan = compile(g, "local:2", global_batch_size=8, microbatch_size=2, precision="fp32", dp=dp, pp=pp, tp=1)
        with pytest.raises(LaunchError, match=r"sums over the rows of its batch.*1/4 of the loss.*runtime\.summed"):
            launch_local(plan, gpt_small_seeded, sgd, sum_loss, data, timeout_s=120)
        assert_plan_trains_like_one_process(plan, gpt_small_seeded, sgd, summed(sum_loss), data)


@pytest.mark.slow
def test_a_summed_loss_stops_a_torchrun_job_before_step_1(tmp_path):
    """The cluster launcher (runtime.run under torchrun) checks as launch_local does: rank 0 tells the loss on step
    1's batch while the other waits, and a sum stops the job with the fix, before any step trains."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from examples.gpt import example_batch, gpt_tiny
    from partitioner import compile, trace

    model = gpt_tiny()
    g = trace(model, (example_batch(model, 2)[0],))
    plan = compile(g, "local:2", global_batch_size=4, microbatch_size=2, precision="fp32", dp=2, pp=1, tp=1)
    plan.write_programs(tmp_path)
    (tmp_path / "summing.py").write_text("import torch\n\n\ndef loss(output, targets):\n"
                                         "    logits = output[0]\n"
                                         "    return torch.nn.functional.cross_entropy(logits.reshape(-1, "
                                         "logits.size(-1)), targets.reshape(-1), reduction='sum') / 1000.0\n")
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "runtime.run",
           "plan.json", "--model", f"{root}/examples/gpt.py:gpt_tiny", "--loss", "summing.py:loss", "--steps", "2",
           "--timeout-s", "60"]  # batches: the model module's example_batch
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "loss_fn sums over the rows of its batch" in out and "runtime.summed" in out, out
    assert "step 1/2" not in out
