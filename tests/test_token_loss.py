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
