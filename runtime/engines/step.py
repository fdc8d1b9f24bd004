"""One training step of a data-parallel rank: slice, microbatch, reduce, update.

The generated program builds a `StepRunner` with the plan's numbers; the
runner takes this replica's rows of the global batch, runs them as
microbatches with gradient accumulation (communication only after the
last), lets the data-parallel engine finish the reduction, clips, steps the
optimizer and reports the global mean loss. Together these equal one
process training on the whole batch with a mean loss.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

# cost_models imports nothing of the project, so the runtime may share its base error (one direction holds).
from cost_models.errors import PartitionerError
from runtime.comm.collectives import Collectives
from runtime.device import place, rank_device

__all__ = ["StepRunner", "check_parameters", "ModelMismatchError", "replica_microbatches", "PeakHeld"]


class ModelMismatchError(PartitionerError):
    """The model given to a program is not the one its plan was compiled for."""


def check_parameters(model: nn.Module, expected: Sequence[tuple[str, tuple[int, ...]]]) -> None:
    """Refuse a model whose parameters (names, shapes) differ from the plan's, before any collective."""
    # Tied parameters appear once, under their first name, as in the traced graph.
    have = {n: tuple(p.shape) for n, p in model.named_parameters()}
    want = dict(expected)
    missing = [n for n in want if n not in have]
    extra = [n for n in have if n not in want]
    shaped = [f"{n} {have[n]} != {want[n]}" for n in want if n in have and have[n] != tuple(want[n])]
    if missing or extra or shaped:
        parts = ([f"missing {missing[:3]}"] if missing else []) + ([f"unexpected {extra[:3]}"] if extra else []) \
            + ([f"shapes differ: {shaped[:3]}"] if shaped else [])
        raise ModelMismatchError(
            f"the model's parameters do not match the plan's ({'; '.join(parts)}): the plan was compiled for "
            "another model; compile a plan for this one")


def _rows(x: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of every tensor in a (nested) batch; other values pass through."""
    if isinstance(x, torch.Tensor):
        return x[start:stop]
    if isinstance(x, (tuple, list)):
        return type(x)(_rows(v, start, stop) for v in x)
    if isinstance(x, dict):
        return {k: _rows(v, start, stop) for k, v in x.items()}
    return x


def _call(module: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return module(**inputs)
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    return module(inputs)


class StepRunner:
    """The object a program's `build()` returns (the runtime's program contract).

    engine: a runtime.engines.data_parallel.DataParallel; optimizer steps
    engine.optimizer_params(); loss_fn(model_output, targets) -> mean loss.
    """

    def __init__(self, *, engine, optimizer: torch.optim.Optimizer, loss_fn: Callable, collectives: Collectives,
                 dp_group, dp_rank: int, dp_size: int, microbatch_size: int, num_microbatches: int,
                 clip_grad_norm: float | None, program_hash: str):
        self.engine, self.optimizer, self.loss_fn = engine, optimizer, loss_fn
        self.collectives, self.dp_group = collectives, dp_group
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.microbatch_size, self.num_microbatches = microbatch_size, num_microbatches
        self.clip_grad_norm, self.program_hash = clip_grad_norm, program_hash
        self.last_grad_norm: float | None = None
        self._peak = PeakHeld()

    def step(self, batch: tuple[Any, Any]) -> float:
        m = self.num_microbatches
        total = torch.zeros((), dtype=torch.float64, device=rank_device())
        for i, (x, y) in enumerate(replica_microbatches(batch, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                                        microbatch_size=self.microbatch_size,
                                                        num_microbatches=m)):
            x, y = place((x, y))  # only this replica's rows travel to the device
            ctx = self.engine.no_sync() if i < m - 1 else _nothing()
            with ctx:
                loss = self.loss_fn(_call(self.engine.module, x), y)
                (loss / m).backward()
            total += loss.detach().double()
        self.engine.finish_gradients()
        if self.clip_grad_norm is not None:
            self.last_grad_norm = self.engine.clip_grad_norm_(self.clip_grad_norm)
        self.optimizer.step()
        # The peak of model state: gradients still held, optimizer state just created or updated.
        self._peak.note(self.engine.held_bytes(self.optimizer))
        self.engine.after_step()
        self.engine.zero_grad()
        self.optimizer.zero_grad(set_to_none=True)
        # The global loss: the mean over replicas of each replica's mean over its microbatches.
        mean = (total / m).to(torch.float32).reshape(1)
        if self.dp_size > 1:
            self.collectives.all_reduce(mean, self.dp_group, op="avg")
        return float(mean.item())

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """Inference under the plan: this replica's forward on `inputs` (no slicing, no gradients)."""
        return _call(self.engine.module, place(inputs))

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        full = self.engine.full_state_dict()  # host copies: what a launcher saves or returns
        return None if full is None else {k: v.cpu() for k, v in full.items()}

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state at this rank's peak so far."""
        return self._peak.note(self.engine.held_bytes(self.optimizer))


def replica_microbatches(batch: tuple[Any, Any], *, dp_rank: int, dp_size: int, microbatch_size: int,
                         num_microbatches: int) -> list[tuple[Any, Any]]:
    """This replica's rows of a global (inputs, targets) batch, as (inputs, targets) per microbatch.

    Refuses a batch that is not dp_size x num_microbatches x microbatch_size samples."""
    inputs, targets = batch
    per = microbatch_size * num_microbatches
    n = _batch_size(targets if targets is not None else inputs)
    if n != per * dp_size:
        raise ValueError(f"global batch of {n} samples, but the plan steps {dp_size} replicas x "
                         f"{num_microbatches} microbatches x {microbatch_size} = {per * dp_size}; "
                         "pass batches of the plan's global_batch_size")
    a = dp_rank * per
    return [(_rows(inputs, a + i * microbatch_size, a + (i + 1) * microbatch_size),
             _rows(targets, a + i * microbatch_size, a + (i + 1) * microbatch_size)) for i in range(num_microbatches)]


class PeakHeld:
    """The largest params + grads + optimizer bytes a runner has held, with its breakdown."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}

    def note(self, now: dict[str, int]) -> dict[str, int]:
        """Record `now` if it is the new peak; returns the peak."""
        total = sum(now.get(k, 0) for k in ("params", "grads", "optimizer"))
        if total >= sum(self.peak.get(k, 0) for k in ("params", "grads", "optimizer")):
            self.peak = dict(now)
        return dict(self.peak)


def _batch_size(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    if isinstance(x, (tuple, list)) and x:
        return _batch_size(x[0])
    if isinstance(x, dict) and x:
        return _batch_size(next(iter(x.values())))
    raise ValueError(f"cannot tell the batch size of {type(x).__name__}: pass tensors with the batch in dim 0")


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
