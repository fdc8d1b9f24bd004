"""A loss averaged over every token of the global batch, however the plan splits it.

A plan's step runs each replica's microbatches separately; by default each microbatch's loss (a mean over
its own tokens) counts 1 / m, and the replicas' results are averaged. With equal microbatches that is one
process's mean over the whole batch. With padded batches it is not: a microbatch of 10 labelled tokens
weighs as much as one of 100, so the step trains on another loss than one process does on the same batch
(transformers' gradient accumulation fix, `num_items_in_batch`; Megatron-Core's `calculate_per_token_loss`).

`per_token(loss_fn, count)` says how many tokens `loss_fn` averages over on a microbatch. The runners
(runtime.engines.step, runtime.pipeline.runner) then weigh microbatch i of a rank by R * n_i / N, with n_i
its tokens, N those of the whole global batch (every replica's and context slice's microbatches, counted on
every rank from the global batch it loads: no message) and R the replicas the gradients and the loss are
averaged over (dp x cp). Summed and averaged so, the step's loss and gradients are those of the mean over
all N tokens: what one process computes over the whole batch.

>>> import torch
>>> loss = per_token(lambda out, y: (out - y).abs().mean(), count=lambda x, y: int((y != -100).sum()))
>>> rows = [(None, torch.tensor([[1, 2, 3]])), (None, torch.tensor([[-100, 2, 3]]))]   # 3 and 2 tokens
>>> microbatch_weights(loss, lambda dp_rank, cp_rank: rows, dp_rank=0, dp_size=1)
(0.6, 0.4)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PerToken", "Summed", "per_token", "summed", "microbatch_weights"]


@dataclasses.dataclass(frozen=True)
class PerToken:
    """`loss_fn` (output, targets) -> its mean over a microbatch's tokens, and `count` (inputs, targets) -> how
    many tokens that mean is over. Called, it is `loss_fn`; picklable where both functions are (module-level),
    so spawned ranks can take it."""

    loss_fn: Callable[[Any, Any], Any]
    count: Callable[[Any, Any], Any]

    def __call__(self, output: Any, targets: Any = None) -> Any:
        return self.loss_fn(output, targets)


def per_token(loss_fn: Callable[[Any, Any], Any], count: Callable[[Any, Any], Any]) -> PerToken:
    """`loss_fn` averaged over every token of the global batch (module docstring); `count(inputs, targets)`: the
    tokens `loss_fn` averages over on one microbatch (an int or a 0-d tensor), e.g.
    `examples.training.labelled_tokens` for a Hugging Face causal LM's own loss."""
    for name, fn in (("loss_fn", loss_fn), ("count", count)):
        if not callable(fn):
            raise TypeError(f"per_token: {name} must be callable, got {type(fn).__name__}")
    return PerToken(loss_fn, count)


@dataclasses.dataclass(frozen=True)
class Summed:
    """`loss_fn` (output, targets) -> the sum of its rows' (or tokens') losses over a microbatch, not their mean.
    Called, it is `loss_fn`."""

    loss_fn: Callable[[Any, Any], Any]

    def __call__(self, output: Any, targets: Any = None) -> Any:
        return self.loss_fn(output, targets)


def summed(loss_fn: Callable[[Any, Any], Any]) -> Summed:
    """A loss that sums over its batch (`reduction="sum"`), kept a sum over the whole global batch however the
    plan splits it: each microbatch counts whole (weight R, the replicas the loss and gradients are averaged
    over), not 1 / m, so the step's loss and gradients are one process's sum over the batch."""
    if not callable(loss_fn):
        raise TypeError(f"summed: loss_fn must be callable, got {type(loss_fn).__name__}")
    return Summed(loss_fn)


def microbatch_weights(loss_fn: Any, microbatches: Callable[[int, int], Sequence[tuple[Any, Any]]], *, dp_rank: int,
                       dp_size: int, cp_rank: int = 0, cp_size: int = 1) -> tuple[float, ...] | None:
    """This rank's weight per microbatch, R * n_i / N, where `loss_fn` is a PerToken; R where it is Summed; None
    otherwise (each microbatch then counts 1 / m). `microbatches(dp_rank, cp_rank)`: that rank's (inputs,
    targets) pairs of the
    global batch, as the runners slice it (runtime.engines.step.step_weights). A global batch with no token to
    count weighs nothing."""
    if isinstance(loss_fn, Summed):
        return (float(dp_size * cp_size),) * len(microbatches(dp_rank, cp_rank))
    if not isinstance(loss_fn, PerToken):
        return None

    def counts(r: int, c: int) -> list[int]:
        return [_tokens(loss_fn.count(x, y)) for x, y in microbatches(r, c)]

    every = {(r, c): counts(r, c) for r in range(dp_size) for c in range(cp_size)}
    mine, total = every[(dp_rank, cp_rank)], sum(sum(n) for n in every.values())
    replicas = dp_size * cp_size
    return tuple(replicas * n / total if total else 0.0 for n in mine)


def _tokens(n: Any) -> int:
    value = int(n.item()) if hasattr(n, "item") else n
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"per_token: count(inputs, targets) must give a number of tokens >= 0, got {n!r}")
    return value
