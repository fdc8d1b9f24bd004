"""The router's load-balancing loss across pipeline stages: each stage's sums carried to the last.

Hugging Face's loss (`runtime.experts.aux_loss`) is E * sum_e (C_e / N) * (S_e / N) over the concatenation of
every MoE layer's router logits: C_e the top-k picks of expert e, S_e its softmax probabilities, N the rows,
each summed over all layers and tokens. It is not a sum of per-layer terms, but it is a function of sums,
and sums of disjoint layers add. So under pp > 1 each stage adds its layers' sums (`router_sums`: C, S, N and
its layer count, 2E + 2 numbers) to those it received from the stage before and hands the total on with the
activation; the last stage adds its own and forms the loss (all-reduced over the data-parallel ranks there,
as without pipelining).

The gradient. dLoss/dS_e = E C_e / N^2 times the loss's own gradient: one vector for every layer of every
stage, which depends on the global C and N and on how the model's loss uses the term (its coefficient, the
1/m of the microbatches), known only on the last stage. So the sums travel as a tensor of the autograd graph,
and their gradient travels back as an activation's does: stage s's output is tied to the sums it sent
(`_Leave`, identity on the activation), whose gradient it receives from s + 1 in its backward; stage s + 1's
input is tied to the sums it received (`_Enter`), whose gradient it sends back to s once its backward has
summed it. A stage's backward runs after the next stage's (the executor waits for the activation gradient
the next stage sends after its backward), so each receive finds its message posted.

Messages: one (2E + 2,) fp32 tensor each way per stage boundary and microbatch, beside the executor's, on the
pipeline group (not the executor's world group) and on tags of their own (`_TAG_BASE`, per sending stage and
direction). Every schedule runs a stage's forwards, and its
backwards, in microbatch order, so the n-th message of a (sender, tag) is microbatch n's (Gloo delivers one
(source, tag)'s messages in order). Neighbouring stages on one rank (ZB-V's turn) hand the sums over in memory.

>>> pipe = AuxPipeline(stage_ranks=(0, 0), rank=0, collectives=None)   # two stages on this rank
>>> x = torch.ones(2, requires_grad=True)
>>> sums = torch.tensor([1.0, 2.0], requires_grad=True)
>>> y = pipe.leave(0, x * 1, sums)                                     # stage 0 hands its sums on
>>> x1, carried = pipe.enter(1, y.detach().requires_grad_())          # stage 1 takes them
>>> (x1.sum() + (3 * carried).sum()).backward()                        # stage 1's backward sends their gradient
>>> y.sum().backward(); sums.grad                                      # stage 0's backward receives it
tensor([3., 3.])
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from runtime.comm.collectives import Collectives
from runtime.device import rank_device

__all__ = ["AuxPipeline"]

# Far above the executor's tags (3 * microbatches * stages + 3) and the tied gradients' after them, and apart
# from context parallelism's ring (1 << 20 + ...).
_TAG_BASE = 1 << 22
_FORWARD, _BACKWARD = 0, 1


@dataclasses.dataclass(kw_only=True)
class AuxPipeline:
    """The sums' links between this rank's stages and their neighbours. stage_ranks: the global rank of every
    virtual stage of this replica and tensor slice (the program's STAGE_RANKS); rank: this process's; group:
    the pipeline group holding them (its own communicator: where a backend matches messages by order rather
    than tag, as NCCL does, the sums do not pair with the executor's activations; None: the world)."""

    stage_ranks: tuple[int, ...]
    rank: int
    collectives: Collectives | None
    group: object = None
    _local: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(collections.deque))
    _sends: list = dataclasses.field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def enter(self, stage: int, x: torch.Tensor, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage `stage` (> 0) starts a forward on input x: the sums stage - 1 handed on, tied to x (their
        gradient goes back to stage - 1 when this stage's backward reaches x). size: the sums' length, for a
        receive (2E + 2)."""
        carried = self._take(stage - 1, _FORWARD, size, x.device)
        return _Enter.apply(x, carried, self, stage)

    def leave(self, stage: int, x: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        """Stage `stage` (not the last) ends a forward with output x and its running sums: hand them to
        stage + 1; the returned x is tied to them (their gradient comes back from stage + 1 in this backward)."""
        self._give(sums.detach(), stage, _FORWARD)
        return _Leave.apply(x, sums, self, stage)

    # ---- messages ---------------------------------------------------------------------------------
    def _give(self, t: torch.Tensor, sender: int, direction: int) -> None:
        peer = sender + 1 if direction == _FORWARD else sender - 1
        if self.stage_ranks[peer] == self.rank:
            self._local[(sender, direction)].append(t.clone())
            return
        t = t.contiguous()
        work = self.collectives.send(t, self.stage_ranks[peer], tag=_TAG_BASE + 2 * sender + direction,
                                     group=self.group)
        self._sends = [(w, b) for w, b in self._sends if not w.is_completed()] + [(work, t)]

    def _take(self, sender: int, direction: int, size: int | None, device: torch.device) -> torch.Tensor:
        if self.stage_ranks[sender] == self.rank:
            held = self._local[(sender, direction)]
            if not held:
                way = "forward" if direction == _FORWARD else "backward"
                raise RuntimeError(f"the load-balancing loss's sums from stage {sender} ({way}) were never handed "
                                   "over on this rank: a stage ran out of microbatch order")
            return held.popleft()
        buf = torch.zeros(size, dtype=torch.float32, device=device if device is not None else rank_device())
        self.collectives.recv(buf, self.stage_ranks[sender], tag=_TAG_BASE + 2 * sender + direction,
                             group=self.group).wait()
        return buf


class _Enter(torch.autograd.Function):
    """(x, the received sums) as they are; backward: send the sums' gradient to the stage before."""

    @staticmethod
    def forward(ctx, x, carried, pipe, stage):
        ctx.pipe, ctx.stage, ctx.done = pipe, stage, False
        return x.view_as(x), carried.clone()

    @staticmethod
    def backward(ctx, grad_x, grad_carried):
        if not ctx.done:  # once, should autograd reach this node again (a split backward's W)
            ctx.done = True
            ctx.pipe._give(grad_carried.float(), ctx.stage, _BACKWARD)
        return grad_x, None, None, None


class _Leave(torch.autograd.Function):
    """x as it is, tied to the sums handed on; backward: the sums' gradient from the stage after."""

    @staticmethod
    def forward(ctx, x, sums, pipe, stage):
        ctx.pipe, ctx.stage, ctx.size, ctx.grad = pipe, stage, sums.numel(), None
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        if ctx.grad is None:
            ctx.grad = ctx.pipe._take(ctx.stage + 1, _BACKWARD, ctx.size, grad_x.device)
        return grad_x, ctx.grad, None, None
