"""One training step of a data-parallel rank: slice, microbatch, reduce, update.

The generated program builds a `StepRunner` with the plan's numbers and its
instruction list, one stage's (`0F0 0B0 0F1 0B1 0GRAD_SYNC 0OPTIM 0UNSHARD`
for ZeRO-1 over 2 microbatches); the runner takes this replica's rows of the
global batch and runs the list on them with the pipeline executor: the
microbatches' gradients accumulate without communication until the last B,
which launches the engine's reductions, GRAD_SYNC waits for them, OPTIM
clips and steps the optimizer, UNSHARD / RESHARD gather and free the ZeRO
parameters; the step reports the global mean loss. Together these equal
one process training on the whole batch with a mean loss.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

# cost_models imports nothing of the project, so the runtime may share its base error and the action grammar
# (one direction holds).
from cost_models.actions import Action, Op
from cost_models.errors import PartitionerError
from runtime.comm.collectives import Collectives
from runtime.device import place, rank_device
from runtime.engines.evaluation import evaluating
from runtime.engines.token_loss import microbatch_weights
from runtime.pipeline.executor import PipelineExecutor, forward_actions

__all__ = ["StepRunner", "check_parameters", "ModelMismatchError", "replica_microbatches", "step_weights",
           "row_losses", "reduction_over_rows", "PeakHeld", "implicit_after_step", "batch_size"]


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
    actions: the step's instruction list, one stage's (module docstring); None, as in programs
    generated before the lists held UNSHARD / RESHARD: forwards and backwards in microbatch order,
    GRAD_SYNC, OPTIM, and the engine's after_step inside OPTIM.
    """

    def __init__(self, *, engine, optimizer: torch.optim.Optimizer, loss_fn: Callable, collectives: Collectives,
                 dp_group, dp_rank: int, dp_size: int, microbatch_size: int, num_microbatches: int,
                 clip_grad_norm: float | None, program_hash: str, actions: Sequence[str] | None = None,
                 cp_rank: int = 0, cp_size: int = 1):
        self.engine, self.optimizer, self.loss_fn = engine, optimizer, loss_fn
        # context parallelism: this rank's tokens of each row (dim 1, the load-balanced layout); dp_group then
        # holds the dp x cp ranks, over which the loss is averaged as the gradients are
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.collectives, self.dp_group = collectives, dp_group
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.microbatch_size, self.num_microbatches = microbatch_size, num_microbatches
        self.clip_grad_norm, self.program_hash = clip_grad_norm, program_hash
        self.last_grad_norm: float | None = None
        self.lr_schedule = None  # runtime.engines.lr_schedule: stepped after each optimizer step
        self._peak = PeakHeld()
        m = num_microbatches
        if actions is None:
            actions = [f"0{op}{i}" for i in range(m) for op in "FB"] + ["0GRAD_SYNC", "0OPTIM"]
        self.executor = PipelineExecutor(
            actions=actions, stages={0: engine.module}, num_stages=1, stage_to_rank=lambda s: 0, collectives=None,
            loss_fn=loss_fn, num_microbatches=m, grad_sync=lambda s: engine.finish_gradients(), optim=self._optim,
            unshard=lambda s: engine.unshard(), reshard=lambda s: engine.reshard(), no_sync=engine.no_sync)
        self._after_optim = implicit_after_step(engine, self.executor.actions)
        self._evaluator: PipelineExecutor | None = None  # the list's forwards (evaluate), built on first use
        self._eval_code_ops = True  # whether an evaluation runs the code's ops under EvalOps

    def step(self, batch: tuple[Any, Any]) -> float:
        return self._global_mean(self.executor.run(*self._microbatches(batch)))

    def evaluate(self, batch: tuple[Any, Any]) -> float:
        """The global mean loss on `batch` (a global batch, as `step` takes) as one process computes it under
        `model.eval()` and `torch.no_grad()`: no dropout, nothing trained, no random number drawn
        (runtime.engines.evaluation). A collective: every rank of the plan calls it."""
        if self._evaluator is None:
            self._evaluator = PipelineExecutor(
                actions=forward_actions(self.executor.actions), stages={0: self.engine.module}, num_stages=1,
                stage_to_rank=lambda s: 0, collectives=None, loss_fn=self.loss_fn,
                num_microbatches=self.num_microbatches, unshard=lambda s: self.engine.unshard(),
                reshard=lambda s: self.engine.reshard(), forward_only=True)
        work = self._microbatches(batch)
        with evaluating([self.engine.module], code_ops=self._eval_code_ops) as ops:
            loss = self._evaluator.run(*work)
        self._eval_code_ops = ops is not None and ops.changed  # straight-line code: the next one meets the same
        return self._global_mean(loss)

    def _microbatches(self, batch: tuple[Any, Any]) -> tuple[list[Any], list[Any], Sequence[float] | None]:
        """This replica's (inputs per microbatch, targets per microbatch, loss weights) of a global batch."""
        pairs = [place(pair) for pair in  # only this replica's rows travel to the device
                 replica_microbatches(batch, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                      microbatch_size=self.microbatch_size, num_microbatches=self.num_microbatches,
                                      cp_rank=self.cp_rank, cp_size=self.cp_size)]
        # this replica's mean over its microbatches (the executor sums loss / m), or its share of the mean over
        # every token of the batch (a per_token loss)
        weights = step_weights(self.loss_fn, batch, dp_rank=self.dp_rank, dp_size=self.dp_size,
                               microbatch_size=self.microbatch_size, num_microbatches=self.num_microbatches,
                               cp_rank=self.cp_rank, cp_size=self.cp_size)
        return [x for x, _ in pairs], [y for _, y in pairs], weights

    def _global_mean(self, loss: float) -> float:
        """The mean over replicas (and context slices, each as many tokens) of each one's mean over its
        microbatches."""
        mean = torch.tensor([loss], dtype=torch.float32, device=rank_device())  # NCCL reduces device tensors
        if self.dp_size * self.cp_size > 1:
            self.collectives.all_reduce(mean, self.dp_group, op="avg")
        return float(mean.item())

    def _optim(self, s: int) -> None:
        if self.clip_grad_norm is not None:
            self.last_grad_norm = self.engine.clip_grad_norm_(self.clip_grad_norm)
        self.optimizer.step()
        if self.lr_schedule is not None:
            self.lr_schedule.step()
        # The peak of model state: gradients still held, optimizer state just created or updated.
        self._peak.note(self.engine.held_bytes(self.optimizer))
        self._after_optim()
        self.engine.zero_grad()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """Inference under the plan: this replica's forward on `inputs` (no slicing) in eval mode, no gradients."""
        if self.cp_size > 1:
            raise NotImplementedError(no_predict_under_cp(self.cp_size))
        with evaluating([self.engine.module], code_ops=self._eval_code_ops):
            return _call(self.engine.module, place(inputs))

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        full = self.engine.full_state_dict()  # host copies: what a launcher saves or returns
        return None if full is None else {k: v.cpu() for k, v in full.items()}

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state at this rank's peak so far."""
        return self._peak.note(self.engine.held_bytes(self.optimizer))


def no_predict_under_cp(cp: int) -> str:
    """Why predict() refuses a context-parallel plan."""
    # the code reads this rank's positions: whole sequences would attend wrong
    return (f"predict() under context parallelism (cp={cp}): the model's code runs each rank's tokens of every "
            "sequence, with attention over the cp group, and gathers no output; run inference on the trained "
            "state_dict or with a plan of cp=1 (evaluate(batch) gives the loss under cp)")


def replica_microbatches(batch: tuple[Any, Any], *, dp_rank: int, dp_size: int, microbatch_size: int,
                         num_microbatches: int, cp_rank: int = 0, cp_size: int = 1) -> list[tuple[Any, Any]]:
    """This replica's rows of a global (inputs, targets) batch, as (inputs, targets) per microbatch; under
    context parallelism (cp_size > 1) only this rank's tokens of each row: chunks cp_rank and
    2*cp_size-1-cp_rank of dim 1 (`runtime.context.sequence.shard_sequence`), inputs and targets alike.

    Refuses a batch that is not dp_size x num_microbatches x microbatch_size samples.

    >>> x = torch.arange(16).view(2, 8)
    >>> [mb[0].tolist() for mb in replica_microbatches((x, x), dp_rank=1, dp_size=2, microbatch_size=1,
    ...                                               num_microbatches=1, cp_rank=1, cp_size=2)]
    [[[10, 11, 12, 13]]]
    """
    inputs, targets = batch
    per = microbatch_size * num_microbatches
    n = batch_size(targets if targets is not None else inputs)
    if n != per * dp_size:
        raise ValueError(f"global batch of {n} samples, but the plan steps {dp_size} replicas x "
                         f"{num_microbatches} microbatches x {microbatch_size} = {per * dp_size}; "
                         "pass batches of the plan's global_batch_size")
    a = dp_rank * per
    out = [(_rows(inputs, a + i * microbatch_size, a + (i + 1) * microbatch_size),
            _rows(targets, a + i * microbatch_size, a + (i + 1) * microbatch_size)) for i in range(num_microbatches)]
    if cp_size == 1:
        return out
    return [(_tokens(x, cp_rank, cp_size), _tokens(y, cp_rank, cp_size)) for x, y in out]


@torch.no_grad()
def row_losses(model: nn.Module, loss_fn: Callable, batch: tuple[Any, Any],
               rows: int) -> tuple[float, tuple[float, ...]] | None:
    """(`loss_fn(model(x), y)` on the first `rows` rows of `batch` together, the same on each of those rows alone);
    None where the batch has fewer than two rows, the model or loss fails on one row, or a loss is not finite (a
    row with no token that counts). The model runs in eval mode (no dropout), and is put back as it was."""
    inputs, targets = batch
    first = next((t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)), None)
    n = 0 if first is None or first.dim() == 0 else min(rows, first.shape[0])
    if n < 2:
        return None
    was = model.training
    model.eval()
    try:
        whole = float(loss_fn(_call(model, _rows(inputs, 0, n)), _rows(targets, 0, n)))
        parts = tuple(float(loss_fn(_call(model, _rows(inputs, i, i + 1)), _rows(targets, i, i + 1)))
                      for i in range(n))
    except Exception:  # noqa: BLE001 (a model that cannot take one row: nothing to tell)
        return None
    finally:
        model.train(was)
    if not all(math.isfinite(v) for v in (whole, *parts)):
        return None
    return whole, parts


def reduction_over_rows(model: nn.Module, loss_fn: Callable, batch: tuple[Any, Any],
                        rows: int = 8) -> tuple[str, float, tuple[float, ...]] | None:
    """How `loss_fn(model(x), y)` reduces over the rows of a batch, told on the first `rows` rows of `batch`
    (`row_losses`): ("mean", ...) where the loss of the rows together is the mean of their own losses, ("sum", ...)
    where it is their sum (`reduction="sum"`), ("weighted", ...) where it is neither: a mean over something rows
    hold unequally (the tokens that count, with labels of -100 falling unevenly), or a loss that couples the
    rows. Then (kind, loss of the rows together, each row's loss); None where it cannot be told.

    A plan weighs each of its pieces (microbatches, replicas) alike, which is one process's loss only for a mean.
    Equal within the rounding of the model's dtype: batching rows changes the order of a matmul's sums."""
    found = row_losses(model, loss_fn, batch, rows)
    if found is None:
        return None
    whole, parts = found
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    rtol = 50 * torch.finfo(dtype).eps
    total = sum(parts)
    scale = max(abs(whole), abs(total) / len(parts), 1e-12)
    if abs(whole - total / len(parts)) <= rtol * scale:
        return "mean", whole, parts
    if abs(whole - total) <= 1e-4 * max(abs(whole), abs(total), 1e-12):
        return "sum", whole, parts
    return "weighted", whole, parts


def step_weights(loss_fn: Any, batch: tuple[Any, Any], *, dp_rank: int, dp_size: int, microbatch_size: int,
                 num_microbatches: int, cp_rank: int = 0, cp_size: int = 1) -> tuple[float, ...] | None:
    """This rank's loss weight per microbatch of `batch` (runtime.engines.token_loss), every rank's microbatches
    sliced as `replica_microbatches` slices this one's; None unless `loss_fn` is a per_token loss."""
    return microbatch_weights(
        loss_fn, lambda r, c: replica_microbatches(batch, dp_rank=r, dp_size=dp_size, microbatch_size=microbatch_size,
                                                   num_microbatches=num_microbatches, cp_rank=c, cp_size=cp_size),
        dp_rank=dp_rank, dp_size=dp_size, cp_rank=cp_rank, cp_size=cp_size)


def _tokens(x: Any, cp_rank: int, cp_size: int) -> Any:
    """This context slice's tokens (dim 1) of every tensor in a (nested) batch; other values pass through."""
    from runtime.context.sequence import shard_sequence

    if isinstance(x, torch.Tensor):
        if x.dim() < 2:
            raise ValueError(f"context parallelism splits every batch tensor along its tokens (dim 1), but one has "
                             f"shape {tuple(x.shape)}: pass (batch, sequence, ...) tensors, or compile with cp=1")
        return shard_sequence(x, 1, cp_rank, cp_size)
    if isinstance(x, (tuple, list)):
        return type(x)(_tokens(v, cp_rank, cp_size) for v in x)
    if isinstance(x, dict):
        return {k: _tokens(v, cp_rank, cp_size) for k, v in x.items()}
    return x


def implicit_after_step(engine, actions: Sequence[Action]) -> Callable[[], None]:
    """What OPTIM runs on the engine after the optimizer step: `copy_masters` (local) when the list carries
    the engine's parameter collectives as UNSHARD / RESHARD actions; the whole `after_step`, with a warning,
    for a list from before they were actions (an old generated program), which would otherwise leave ZeRO-1/2's
    replicated parameters stale."""
    needed = {1: Op.UNSHARD, 2: Op.UNSHARD, 3: Op.RESHARD}.get(getattr(engine, "zero_stage", 0))
    if needed is None or any(Action.of(a).op is needed for a in actions):
        return engine.copy_masters
    warnings.warn(f"this instruction list has no {needed.value} action, which ZeRO-{engine.zero_stage} needs after "
                  "the optimizer step: the engine runs it inside OPTIM, as programs generated before the ZeRO "
                  "collectives were actions did; regenerate the program (plan.write_programs) to list it",
                  DeprecationWarning, stacklevel=3)
    return engine.after_step


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


def batch_size(x: Any) -> int:
    """The samples of a (nested) batch: dim 0 of its first tensor."""
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    if isinstance(x, (tuple, list)) and x:
        return batch_size(x[0])
    if isinstance(x, dict) and x:
        return batch_size(next(iter(x.values())))
    raise ValueError(f"cannot tell the batch size of {type(x).__name__}: pass tensors with the batch in dim 0")
