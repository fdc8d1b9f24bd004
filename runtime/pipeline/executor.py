"""The pipeline executor: runs one rank's instruction list (a pipeline rank's; a data-parallel rank's is
one stage's, run by `runtime.engines.step.StepRunner`).

A schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1, interleaved ZB, ZB-V, DualPipe-V) arrives as data: this rank's
ordered actions, each with `.op`, `.stage`, `.microbatch` (the planner's
`Action`), or their compact strings ("2SEND_F0"). The runtime never imports
the planner: both take the grammar from `cost_models.actions`, below them
both, so what the planner writes is what this parses. Semantics, as in
`partitioner/planner/schedule.py`:

  sF i       forward of stage s on microbatch i; keeps input and output for B
  sB i       backward: the last stage backprops loss_fn(out, target) / m,
             other stages the received gradient of their output; the input
             gradient is kept for SEND_B; the microbatch's tensors are freed
  sI i       the input-gradient half of a split backward (zero-bubble schedules): as B, but only the
             gradient of the input (for SEND_B); what the weight gradients need is kept for W
  sW i       the weight-gradient half: the parameter gradients B would have added; frees the microbatch
             (`runtime.pipeline.split_backward`, torch's stage_backward_input / stage_backward_weight)
  sSEND_F i  send stage s's output to stage s + 1 (non-blocking)
  sRECV_F i  post the receive of stage s's input from stage s - 1
  sSEND_B i  send the gradient of stage s's input to stage s - 1 (non-blocking)
  sRECV_B i  post the receive of the gradient of stage s's output from s + 1
  sGRAD_SYNC  finish the data-parallel reduction of stage s's gradients: `grad_sync(s)`, which waits
             for the bucket reductions the rank's last B launched (below) and runs the rest
  sOPTIM     the optimizer step of stage s: `optim(s)`
  sUNSHARD   all-gather parameters from their shards: `unshard(s)` (ZeRO-1/2 after OPTIM: the
             updated shards; ZeRO-3 before the first F: the first unit, prefetched)
  sRESHARD   free gathered parameters (ZeRO-3): `reshard(s)`

Where the gradient reductions start. Overlapping them with the backward
means launching each bucket from inside autograd, as its gradients fill; so
the executor runs every B under `no_sync()` (gradients accumulate locally,
nothing is sent) except the rank's last B, which launches the reductions,
and the GRAD_SYNC after it is where the executor waits for them to
complete. The list shows both ends: the last B and the GRAD_SYNC. In a
split backward the weight gradients are W's, so the rank's last W launches
them (an I adds to no parameter gradient, so no_sync or not changes nothing). (ZeRO-2/3
reduce-scatter in every B regardless, one in flight at a time; ZeRO-3 also
gathers each unit inside F and B, one ahead, as its modules run.)

Forward only (`forward_only=True`, an evaluation: `runtime.engines.evaluation`): the list is a training
list's forwards and their messages (`forward_actions`); the last stage computes each microbatch's loss at
its F, and nothing is kept for a backward. A training list has no deadlock, and its forwards keep their
order and messages, so neither has the list of its forwards.

One action at a time: DualPipe-V's pairs (a forward of one stage beside a backward of the other) run as
the forward, then the backward, as torch's runtime runs an OVERLAP_F_B without an overlap function.

Receives are posted one compute early and waited right before the compute that needs them: a RECV
the list places after compute action c (and before the next compute) is posted right before c runs,
where it can be (a RECV_B once its stage's forward has run; a RECV_F when `activation_shape` sizes its
buffer, since a shape header is a blocking receive), else at its own place. Gloo moves a message only
once both ends are posted (its TCP pairs rendezvous: the sender announces, the receiver answers ready,
then the data goes), so a receive posted right before its compute made that compute wait for the whole
exchange, every message on the critical path; posted one compute early, it completes while that compute
runs, as torch's pipelining posts each receive when its sender sends (`_add_send_recv`). The list's RECV
is thus where the receive is posted at the latest, which is what `validate` and `simulate` assume
(a receive blocking at its place), and it holds one receive buffer one compute longer. Sends keep their
tensor and Work handle until completed (all are waited before `run` returns). Neighbouring stages on the
same rank (pp = 1 with several virtual stages) hand tensors over in memory, without messages.

Tags. Gloo matches point-to-point messages by (source, tag) only
(docs/torch-notes.md#gloo-matches-point-to-point-messages-by-source-and-tag-only), so every message
of a step has its own tag, named after the *sending* stage s, the microbatch i and the kind k:

    tag = 3 * (i * num_stages + s) + k,  k = 0 activation, 1 its shape header, 2 gradient

An activation goes from s to s + 1 and a gradient from s to s - 1, so
(s, i, k) names one edge, one microbatch, one direction. Tags repeat across
steps; messages with one (source, tag) arrive in order, and a step's
receives are posted after the previous step's, so step k never takes step
k + 1's message.

Shapes. A receive needs its buffer's shape and dtype. `activation_shape(s,
i)` gives those of stage s's input on microbatch i; without it each
activation is preceded by a small int64 header message (dtype code, ndim,
dims; tag kind 1), which the shim counts as one more send and receive. A
gradient has its output's shape and dtype, which this rank knows.

>>> ex = PipelineExecutor(actions=["0F0", "0B0", "0GRAD_SYNC", "0OPTIM"],  # one stage, one rank
...                       stages={0: torch.nn.Linear(2, 1)}, num_stages=1, stage_to_rank=lambda s: 0,
...                       collectives=None, loss_fn=torch.nn.functional.mse_loss, num_microbatches=1)
>>> isinstance(ex.run([torch.ones(1, 2)], [torch.zeros(1, 1)]), float)
True
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from cost_models.actions import COMPUTE_OPS, Action, Op
from runtime.device import rank_device
from runtime.pipeline.action_trace import log_action, recording_now
from runtime.pipeline.split_backward import PendingWeightGrad, backward_input, backward_weight

__all__ = ["PipelineError", "PipelineExecutor", "forward_actions", "message_tag", "parse_action", "split_sequential"]

_ACTIVATION, _HEADER, _GRADIENT = 0, 1, 2      # message kinds, the k of the tag formula
_MAX_DIMS = 8                                   # the shape header holds dtype code, ndim, 8 dims
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int8, torch.uint8, torch.bool)


class PipelineError(RuntimeError):
    """A pipeline step failed: a receive timed out, or the list asked for something not there."""


def parse_action(action: Any) -> Action:
    """The instruction an action names: its text ("2SEND_F0"), an Action, or any object with `.op`,
    `.stage`, `.microbatch` (cost_models.actions, the one grammar the planner writes and this runs).

    >>> parse_action("2SEND_F0")
    Action(op=<Op.SEND_F: 'SEND_F'>, stage=2, microbatch=0)
    >>> str(parse_action("1GRAD_SYNC"))
    '1GRAD_SYNC'
    """
    return Action.of(action)


def message_tag(sender_stage: int, microbatch: int, kind: int, num_stages: int) -> int:
    """The tag of a message from `sender_stage` (kind 0 activation, 1 its header, 2 gradient).

    >>> message_tag(2, 0, 0, num_stages=4), message_tag(3, 0, 2, num_stages=4), message_tag(0, 1, 0, 4)
    (6, 11, 12)
    """
    return 3 * (microbatch * num_stages + sender_stage) + kind


def forward_actions(actions: Sequence[Any]) -> tuple[Action, ...]:
    """A training list's forward pass alone, in its order: F, SEND_F and RECV_F; the UNSHARD before the first F
    (ZeRO-3's first gather: one after the optimizer, ZeRO-1/2's, would gather parameters no step changed) and
    RESHARD (free what the forward left gathered).

    >>> [str(a) for a in forward_actions("1UNSHARD 1RECV_F0 1F0 1B0 1SEND_B0 1GRAD_SYNC 1RESHARD 1OPTIM".split())]
    ['1UNSHARD', '1RECV_F0', '1F0', '1RESHARD']
    """
    parsed = [parse_action(a) for a in actions]
    first_f = next((i for i, a in enumerate(parsed) if a.op == Op.F), len(parsed))
    return tuple(a for i, a in enumerate(parsed) if a.op in (Op.F, Op.SEND_F, Op.RECV_F, Op.RESHARD)
                 or (a.op == Op.UNSHARD and i < first_f))


def split_sequential(model: nn.Sequential, bounds: Sequence[int]) -> list[nn.Sequential]:
    """Cut `model` into stages: stage j holds modules bounds[j] .. bounds[j + 1] - 1.

    `bounds` runs from 0 to len(model), strictly increasing (len(bounds) - 1
    stages). The stages share the model's submodules (no copies; the model
    is not changed) and keep their names, so a stage's state_dict keys are
    the model's.

    >>> m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    >>> [list(dict(s.named_children())) for s in split_sequential(m, [0, 2, 3])]
    [['0', '1'], ['2']]
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_sequential takes an nn.Sequential, got {type(model).__name__}")
    bounds, n = list(bounds), len(model)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != n or any(a >= b for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"bounds={bounds} must run from 0 to len(model)={n}, strictly increasing, e.g. "
                         f"[0, {n // 2}, {n}] for two stages")
    items = list(model.named_children())
    return [nn.Sequential(collections.OrderedDict(items[a:b])) for a, b in itertools.pairwise(bounds)]


def _call(module: Callable, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return module(**inputs)
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    return module(inputs)


class PipelineExecutor:
    """Runs this rank's instruction list once per `run` (one training step).

    actions: this rank's ordered actions (Action-like objects or strings).
    stages: this rank's virtual stages, stage index -> module (or callable)
        taking the previous stage's output tensor (stage 0: the microbatch
        input; a tuple/list is unpacked, a dict passed as keywords) and
        returning one tensor.
    num_stages: virtual stages of the whole pipeline.
    stage_to_rank: the global rank holding a virtual stage (in this replica).
    collectives: a `runtime.comm.collectives.Collectives`; every message goes
        through it (None only when no action sends or receives).
    loss_fn: loss_fn(last stage's output, target) -> scalar loss of one microbatch.
    num_microbatches: m; each microbatch's loss is divided by m.
    group: the process group of the messages (None: the world); ranks are global.
    grad_sync, optim, unshard, reshard: called with the stage index at
        GRAD_SYNC / OPTIM / UNSHARD / RESHARD. The executor never zeroes
        gradients: `optim` (or the caller) does.
    no_sync: a context manager factory (the data-parallel engine's
        `no_sync`); every B but the rank's last runs under it, so only the
        last launches gradient reductions (the module docstring).
    split_backward: split_backward(part, params) -> a context manager (ZeRO-3's
        `runtime.engines.zero3.ShardedUnits.split_backward`) around each I (part "I", no params) and
        each W that runs from I's saved gradients (part "W", the leaves it accumulates into); None:
        nothing around them.
    activation_shape: (stage, microbatch) -> (shape, dtype) of the stage's
        received input; None: a header message precedes each activation.
    timeout: how long a receive may wait before PipelineError (None: the
        process group's timeout).
    feed_inputs: call every stage as stage(x, model inputs of the microbatch)
        (stage 0 with x None), for stages that read the model's inputs (labels,
        masks); every rank then passes microbatches_in.
    before_last_backward: called right before the rank's last B or W (the one that launches the
        gradient reductions), e.g. to post the receive of a gradient summed after it
        (`runtime.pipeline.runner`'s tied gradient).
    forward_only: run `actions` (F, SEND_F, RECV_F, UNSHARD, RESHARD: `forward_actions`) as an evaluation:
        the last stage's loss is taken at its F, and no forward state is kept (the module docstring); with
        loss_fn None, an inference: the last stage's outputs are kept for `outputs()`.
    """

    def __init__(self, *, actions: Sequence[Any], stages: dict[int, Callable], num_stages: int,
                 stage_to_rank: Callable[[int], int], collectives, loss_fn: Callable,
                 num_microbatches: int, group=None, grad_sync: Callable[[int], None] | None = None,
                 optim: Callable[[int], None] | None = None, unshard: Callable[[int], None] | None = None,
                 reshard: Callable[[int], None] | None = None,
                 no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
                 split_backward: Callable[[str, Sequence[torch.Tensor]], contextlib.AbstractContextManager]
                 | None = None,
                 activation_shape: Callable[[int, int], tuple[tuple[int, ...], torch.dtype]] | None = None,
                 timeout: datetime.timedelta | None = None, feed_inputs: bool = False,
                 before_last_backward: Callable[[], None] | None = None, forward_only: bool = False):
        self.actions = tuple(parse_action(a) for a in actions)
        self.forward_only = forward_only
        if forward_only and any(a.op not in (Op.F, Op.SEND_F, Op.RECV_F, Op.UNSHARD, Op.RESHARD)
                                for a in self.actions):
            raise ValueError("forward_only runs forwards, their messages, UNSHARD and RESHARD; take the list's "
                             "forward pass with forward_actions(actions)")
        self.stages, self.num_stages, self.m = dict(stages), num_stages, num_microbatches
        self.stage_to_rank, self.collectives, self.loss_fn, self.group = stage_to_rank, collectives, loss_fn, group
        self.grad_sync, self.optim, self.activation_shape, self.timeout = grad_sync, optim, activation_shape, timeout
        self.unshard, self.reshard, self.no_sync, self.split_backward = unshard, reshard, no_sync, split_backward
        self._weights: tuple[float, ...] | None = None  # this run's loss weight per microbatch (None: 1 / m)
        self.feed_inputs, self.before_last_backward = feed_inputs, before_last_backward
        self._loss_total: torch.Tensor | None = None
        self._predicted: dict[int, Any] = {}  # forward_only without loss_fn: the last stage's output per microbatch
        # the one backward that launches the gradient reductions: the rank's last B or W, the last to add to
        # the weight gradients
        self._syncing_b = max((i for i, a in enumerate(self.actions) if a.op in ("B", "W")), default=-1)
        self._check()
        self._early_recvs = self._plan_early_recvs()
        self._reset()

    def _plan_early_recvs(self) -> dict[int, tuple[int, ...]]:
        """Compute action index -> the RECVs posted right before it: those the list places after it, before
        the next compute (the module docstring). A RECV_F only with `activation_shape` (no header to wait for)."""
        early: dict[int, list[int]] = {}
        last_compute = None
        for i, a in enumerate(self.actions):
            if a.op in COMPUTE_OPS:
                last_compute = i
            elif a.op in (Op.RECV_F, Op.RECV_B) and last_compute is not None and \
                    (a.op is Op.RECV_B or self.activation_shape is not None):
                early.setdefault(last_compute, []).append(i)
        return {c: tuple(rs) for c, rs in early.items()}

    def _check(self) -> None:
        S, m = self.num_stages, self.m
        for i, a in enumerate(self.actions):
            where = f"action {i} ({a})"
            if a.stage not in self.stages:
                raise ValueError(f"{where} runs stage {a.stage}, but this rank holds stages "
                                 f"{sorted(self.stages)}: pass its module in `stages` or fix the list")
            if a.stage >= S or (a.microbatch is not None and a.microbatch >= m):
                raise ValueError(f"{where} is out of range: stages 0..{S - 1}, microbatches 0..{m - 1}")
            peer = {"SEND_F": a.stage + 1, "RECV_F": a.stage - 1, "SEND_B": a.stage - 1,
                    "RECV_B": a.stage + 1}.get(a.op)
            if peer is not None:
                if not 0 <= peer < S:
                    raise ValueError(f"{where} has no peer: stage {peer} does not exist (stage 0 sends no "
                                     f"input gradient, the last stage no output)")
                if peer in self.stages:
                    raise ValueError(f"{where} names stage {peer}, which is on this rank: neighbouring "
                                     f"stages on one rank hand tensors over without messages; drop it")
                if self.collectives is None:
                    raise ValueError(f"{where} is a message, so pass collectives=runtime.comm.collectives.Collectives()")

    def _reset(self) -> None:
        self._inputs: dict[tuple[int, int], Any] = {}        # (stage, mb) -> forward input
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_out: dict[tuple[int, int], torch.Tensor] = {}   # gradient of a stage's output
        self._grad_in: dict[tuple[int, int], torch.Tensor | None] = {}  # gradient of its input, for SEND_B
        self._pending_w: dict[tuple[int, int], PendingWeightGrad] = {}   # after I, what W needs
        self._recvs: dict[tuple[str, int, int], tuple[Any, torch.Tensor, int]] = {}  # (op, s, mb) -> work, buf, step
        self._posted: set[int] = set()   # indices of the RECVs posted early this step
        self._sends: list[tuple[Any, torch.Tensor, int, int]] = []  # work, tensor kept alive, step, peer stage

    def held(self) -> list[tuple[int, int]]:
        """(stage, microbatch) pairs whose forward state is held: forward run and backward (or W) not yet."""
        return sorted(set(self._outputs) | set(self._pending_w))

    # ---- messages ---------------------------------------------------------------------------------
    def _wait(self, work, step: int, peer_stage: int, waiting_step: int | None = None) -> None:
        """Wait for the message of action `step`; `waiting_step` is the compute that needs it."""
        a = self.actions[step]
        at = f"pipeline action {step} ({a})" if waiting_step in (None, step) else \
            f"pipeline action {waiting_step} ({self.actions[waiting_step]}), waiting for action {step} ({a}),"
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(self.timeout)
        except RuntimeError as e:
            rank = self.stage_to_rank(peer_stage)
            raise PipelineError(
                f"{at} failed waiting on stage {peer_stage} (rank {rank}): {e}. "
                f"A timeout here means the ranks' instruction lists deadlock (each waits for a message "
                f"the other sends later; check them with partitioner.planner.schedule.validate) or the peer "
                f"died; after this error the process group is unusable") from e

    def _send(self, t: torch.Tensor, step: int, peer_stage: int, tag: int) -> None:
        t = t.detach().contiguous()
        work = self.collectives.send(t, self.stage_to_rank(peer_stage), tag=tag, group=self.group)
        self._sends.append((work, t, step, peer_stage))
        pending = []
        for entry in self._sends:   # release delivered buffers; wait() raises a failed send's error
            if entry[0].is_completed():
                self._wait(entry[0], entry[2], entry[3])
            else:
                pending.append(entry)
        self._sends = pending

    def _post_recv(self, a: Action, step: int) -> None:
        s, i = a.stage, a.microbatch
        if a.op == "RECV_F":
            if self.activation_shape is not None:
                shape, dtype = self.activation_shape(s, i)
            else:
                header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=rank_device())
                tag = message_tag(s - 1, i, _HEADER, self.num_stages)
                self._wait(self.collectives.recv(header, self.stage_to_rank(s - 1), tag=tag, group=self.group),
                           step, s - 1)
                ndim = int(header[1])
                shape, dtype = tuple(header[2:2 + ndim].tolist()), _DTYPES[int(header[0])]
            buf = torch.empty(shape, dtype=dtype, device=rank_device())  # where the activation's reader runs
            tag, peer = message_tag(s - 1, i, _ACTIVATION, self.num_stages), s - 1
        else:  # RECV_B: the gradient of this stage's output, shaped like it
            out = self._outputs.get((s, i))
            if out is None:
                raise PipelineError(f"pipeline action {step} ({a}) receives the gradient of {s}F{i}'s output, "
                                    f"but {s}F{i} has not run on this rank: put the forward first")
            buf = torch.empty_like(out, memory_format=torch.contiguous_format)
            tag, peer = message_tag(s + 1, i, _GRADIENT, self.num_stages), s + 1
        work = self.collectives.recv(buf, self.stage_to_rank(peer), tag=tag, group=self.group)
        self._recvs[(a.op, s, i)] = (work, buf, step)

    def _take_recv(self, op: str, s: int, i: int, peer: int, now: int) -> torch.Tensor | None:
        posted = self._recvs.pop((op, s, i), None)
        if posted is None:
            return None
        work, buf, step = posted
        self._wait(work, step, peer, now)
        return buf

    def _post_early(self, recvs: tuple[int, ...], logged: bool) -> None:
        """Post the receives `recvs` (indices of RECV actions) now, before the compute ahead of them; a RECV_B
        whose forward has not run yet waits for its own place."""
        for step in recvs:
            a = self.actions[step]
            if a.op is Op.RECV_B and (a.stage, a.microbatch) not in self._outputs:
                continue
            start = time.perf_counter() if logged else 0.0
            self._post_recv(a, step)
            self._posted.add(step)
            if logged:
                log_action(str(a), start, time.perf_counter())

    # ---- compute ----------------------------------------------------------------------------------
    def _forward(self, a: Action, step: int, microbatches_in, targets) -> torch.Tensor | None:
        """F; returns the microbatch's weighted loss when forward_only on the last stage."""
        s, i = a.stage, a.microbatch
        if s == 0:
            if microbatches_in is None:
                raise ValueError("this rank holds stage 0: pass run(microbatches_in=[...])")
            x = microbatches_in[i]
        else:
            x = self._take_recv("RECV_F", s, i, s - 1, step)
            if x is None:
                x = self._inputs.pop((s, i), None)   # handed over by stage s - 1 on this rank
            if x is None:
                raise PipelineError(f"pipeline action {step} ({a}) has no input: add {s}RECV_F{i} before it, "
                                    f"or run {s - 1}F{i} first when stage {s - 1} is on this rank")
            if not self.forward_only:
                x = x.detach().requires_grad_(x.is_floating_point())
        if self.feed_inputs:  # stage(x, the microbatch's model inputs); stage 0: x is None
            out = self.stages[s](None if s == 0 else x, microbatches_in[i])
        else:
            out = _call(self.stages[s], x)
        if s < self.num_stages - 1 and not isinstance(out, torch.Tensor):
            # the last stage's output goes to loss_fn, in whatever structure the model returns
            raise TypeError(f"stage {s} returned {type(out).__name__}; pipeline stages before the last must "
                            "return one tensor")
        if self.forward_only:
            if s == self.num_stages - 1 and self.loss_fn is None:
                self._predicted[i] = out
                return None
            if s == self.num_stages - 1:
                return self._loss(out, targets, s, i).detach()
            if s + 1 in self.stages:
                self._inputs[(s + 1, i)] = out
            else:
                self._outputs[(s, i)] = out  # until its SEND_F
            return None
        self._inputs[(s, i)], self._outputs[(s, i)] = x, out
        if s + 1 in self.stages:
            self._inputs[(s + 1, i)] = out.detach()
        return None

    def _loss(self, out: Any, targets, s: int, i: int) -> torch.Tensor:
        """Microbatch i's loss, weighted: / m, or its share of the batch's tokens."""
        if targets is None:
            raise ValueError(f"this rank holds the last stage {s}: pass run(targets=[...])")
        loss = self.loss_fn(out, targets[i])
        return loss / self.m if self._weights is None else loss * self._weights[i]

    def _backward(self, a: Action, step: int, targets) -> torch.Tensor | None:
        """B, or the I of a split backward (a.op == "I")."""
        s, i = a.stage, a.microbatch
        out, x = self._outputs.pop((s, i), None), self._inputs.pop((s, i), None)
        if out is None:
            raise PipelineError(f"pipeline action {step} ({a}) runs before its forward {s}F{i} on this rank")
        loss = None
        split = a.op == "I"
        if s == self.num_stages - 1:
            loss = self._loss(out, targets, s, i)
            # the loss keeps what its backward needs (a cross-entropy its log-softmax, not the logits):
            # holding the output through the backward would keep one more output-sized tensor at the peak
            del out
            if split:
                (g,), self._pending_w[(s, i)] = backward_input([loss], [None], [x])
            else:
                loss.backward()
        else:
            grad = self._take_recv("RECV_B", s, i, s + 1, step)
            if grad is None:
                grad = self._grad_out.pop((s, i), None)
            if grad is None:
                raise PipelineError(f"pipeline action {step} ({a}) has no output gradient: add {s}RECV_B{i} "
                                    f"before it, or run {s + 1}B{i} first when stage {s + 1} is on this rank")
            if split:
                (g,), self._pending_w[(s, i)] = backward_input([out], [grad], [x])
            else:
                torch.autograd.backward(out, grad)
        if s > 0:
            if not split:
                g = x.grad
            g = g if g is not None else torch.zeros_like(x)
            if s - 1 in self.stages:
                self._grad_out[(s - 1, i)] = g
            else:
                self._grad_in[(s, i)] = g
        return None if loss is None else loss.detach()

    def _backward_weight(self, a: Action, step: int) -> None:
        pending = self._pending_w.pop((a.stage, a.microbatch), None)
        if pending is None:
            raise PipelineError(f"pipeline action {step} ({a}) computes the weight gradients of "
                                f"{a.stage}I{a.microbatch}, which has not run on this rank: put the I first")
        if self.split_backward is None or pending.full is not None:
            backward_weight(pending)
        else:
            with self.split_backward("W", pending.params()):
                backward_weight(pending)

    def _send_output(self, a: Action, step: int) -> None:
        s, i = a.stage, a.microbatch
        out = self._outputs.pop((s, i), None) if self.forward_only else self._outputs.get((s, i))
        if out is None:
            raise PipelineError(f"pipeline action {step} ({a}) sends the output of {s}F{i}, "
                                f"which has not run (or was freed by {s}B{i}) on this rank")
        if self.activation_shape is None:
            if out.dim() > _MAX_DIMS or out.dtype not in _DTYPES:
                raise TypeError(f"stage {s}'s output ({out.dtype}, {out.dim()} dims) does not fit the "
                                f"shape header: pass activation_shape=")
            header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=out.device)  # dtype code, ndim, dims
            header[0], header[1] = _DTYPES.index(out.dtype), out.dim()
            header[2:2 + out.dim()] = torch.tensor(out.shape, dtype=torch.int64, device=out.device)
            self._send(header, step, s + 1, message_tag(s, i, _HEADER, self.num_stages))
        self._send(out, step, s + 1, message_tag(s, i, _ACTIVATION, self.num_stages))

    def _send_input_grad(self, a: Action, step: int) -> None:
        s, i = a.stage, a.microbatch
        if (s, i) not in self._grad_in:
            raise PipelineError(f"pipeline action {step} ({a}) sends the input gradient of {s}B{i}, "
                                f"which has not run on this rank")
        self._send(self._grad_in.pop((s, i)), step, s - 1, message_tag(s, i, _GRADIENT, self.num_stages))

    def _execute(self, a: Action, step: int, microbatches_in, targets) -> torch.Tensor | None:
        """Run one action; returns the microbatch loss (already / m) of a last-stage backward (of a last-stage
        forward, forward_only)."""
        if a.op == "F":
            return self._forward(a, step, microbatches_in, targets)
        elif a.op in ("B", "I"):
            with contextlib.ExitStack() as around:
                if self.no_sync is not None and step != self._syncing_b:
                    around.enter_context(self.no_sync())
                if a.op == "I" and self.split_backward is not None:
                    around.enter_context(self.split_backward("I", ()))
                return self._backward(a, step, targets)
        elif a.op == "W":
            if self.no_sync is None or step == self._syncing_b:
                self._backward_weight(a, step)
            else:
                with self.no_sync():
                    self._backward_weight(a, step)
        elif a.op in ("RECV_F", "RECV_B"):
            if step not in self._posted:
                self._post_recv(a, step)
        elif a.op == "SEND_F":
            self._send_output(a, step)
        elif a.op == "SEND_B":
            self._send_input_grad(a, step)
        elif a.op == "GRAD_SYNC" and self.grad_sync is not None:
            self.grad_sync(a.stage)
        elif a.op == "OPTIM" and self.optim is not None:
            self.optim(a.stage)
        elif a.op == "UNSHARD" and self.unshard is not None:
            self.unshard(a.stage)
        elif a.op == "RESHARD" and self.reshard is not None:
            self.reshard(a.stage)
        return None

    # ---- the step ---------------------------------------------------------------------------------
    def run(self, microbatches_in: list | None = None, targets: list | None = None,
            weights: Sequence[float] | None = None) -> float | None:
        """Run the instruction list once. Returns, on the rank holding the last
        stage, the sum over microbatches of loss_fn(output, target) / m (the
        mean microbatch loss: the full batch's mean loss for equal microbatches);
        None on other ranks. `weights`: one per microbatch, instead of 1 / m
        (runtime.engines.token_loss: each microbatch's share of the tokens)."""
        if weights is not None and len(weights) != self.m:
            raise ValueError(f"weights: one per microbatch, {self.m}, got {len(weights)}")
        self._weights = None if weights is None else tuple(float(w) for w in weights)
        for name, given, stage in (("microbatches_in", microbatches_in, 0),
                                   ("targets", targets, self.num_stages - 1)):
            if name == "targets" and self.loss_fn is None:
                continue  # an inference
            if (stage in self.stages or (self.feed_inputs and name == "microbatches_in")) and \
                    (given is None or len(given) != self.m):
                raise ValueError(f"this rank holds stage {stage}: pass {name} as a list of "
                                 f"num_microbatches={self.m} items, got {'None' if given is None else len(given)}")
        self._reset()
        self._loss_total, self._predicted = None, {}
        try:
            logged = recording_now()
            for step, a in enumerate(self.actions):
                if step in self._early_recvs:
                    self._post_early(self._early_recvs[step], logged)
                if step in self._posted:
                    continue   # a RECV posted before the compute ahead of it (logged then)
                start = time.perf_counter() if logged else 0.0
                if step == self._syncing_b and self.before_last_backward is not None:
                    self.before_last_backward()
                loss = self._execute(a, step, microbatches_in, targets)
                if logged:
                    log_action(str(a), start, time.perf_counter())
                if loss is not None:
                    self._loss_total = loss if self._loss_total is None else self._loss_total + loss
            for work, _, step, peer in self._sends:
                self._wait(work, step, peer)
            left = sorted(self._outputs) + sorted(k[1:] for k in self._recvs) + sorted(self._grad_in) + \
                sorted(self._pending_w)
            if left:
                raise PipelineError(f"the instruction list ended with work left for (stage, microbatch) "
                                    f"{left[:4]}: a forward without backward, a receive nobody used, "
                                    f"an input gradient never sent, or an I without its W")
        finally:
            self._reset()   # free every activation, also after an error
        total = self._loss_total
        return None if total is None else total.item()

    def outputs(self) -> list[Any]:
        """forward_only without loss_fn (an inference): the last stage's output of each microbatch of the last
        `run`, in order, on the rank holding the last stage; empty elsewhere."""
        return [self._predicted[i] for i in sorted(self._predicted)]

    def loss_sum(self) -> torch.Tensor | None:
        """The losses of the backwards run so far in this `run` (what `run` returns, as a tensor): on the
        rank holding the last stage, complete once its last B (or I) has run; None elsewhere."""
        return self._loss_total
