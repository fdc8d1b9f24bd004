"""One training step of a pipeline / tensor-parallel / 3D rank.

The generated program builds a `PipelineRunner` from the plan's numbers.
A step takes this replica's rows of the global batch, cuts them into
microbatches and runs this rank's instruction list (`PipelineExecutor`).
Gradients accumulate over the microbatches without communication (the
engine's `no_sync`, as in Megatron's pipeline) until the rank's last B
(under a zero-bubble schedule its last W, which adds the last weight
gradients), which launches the data-parallel reductions bucket by bucket; at the rank's
last GRAD_SYNC they complete, and the tied parameters (embedding and LM
head on the first and last stage) are summed over their holders; at its
last OPTIM the gradients are clipped by the global norm over every shard of
every stage and slice, and the optimizer steps; UNSHARD and RESHARD are the
engine's ZeRO parameter gathers and frees. The reported loss is the last
stage's mean over microbatches, averaged over replicas, on every rank: its sum over the pipeline is launched
at the last GRAD_SYNC (the last stage knows it then) and waited for after the optimizer step, so no rank
waits at the end of its step for another's optimizer.

The tied gradient with two holders (the usual embedding / LM head pair) is summed by two messages rather
than an all-reduce, so that its transfer overlaps the first stage's last backward: the holder of the
later pipeline rank (the last stage, whose backwards end first) sends its gradient at its GRAD_SYNC into a
receive the first holder posts right before its last backward; the first holder adds it when that backward
is done and sends the sum back (the all-reduce made both wait for the later of the two backwards, then
moved the gradient both ways). With two holders the sum is a + b either way (IEEE addition commutes), so
the result is bit-identical to the all-reduce's; three or more holders all-reduce as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cost_models.placements import REPLICATED, is_sharded
from runtime.comm.collectives import Collectives
from runtime.device import place, rank_device
from runtime.engines.evaluation import evaluating
from runtime.engines.step import PeakHeld, implicit_after_step, no_predict_under_cp, replica_microbatches, step_weights
from runtime.pipeline.executor import PipelineError, PipelineExecutor, forward_actions
from runtime.pipeline.stage import StageModel
from runtime.pipeline.tensor_parallel import unshard_parameter
from runtime.pipeline.vocab_logits import full_logits

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """What a pipeline or tensor-parallel program's `build()` returns (the same contract as StepRunner)."""

    def __init__(self, *, stage: StageModel, engine, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                 collectives: Collectives, groups, tie_group, tie_first: bool, actions: Sequence[str],
                 num_stages: int, stage_ranks: Sequence[int], dp_rank: int, dp_size: int, tp_size: int,
                 microbatch_size: int, num_microbatches: int, clip_grad_norm: float | None,
                 placements: Mapping[str, tuple[str, int]], full_keys: Sequence[tuple[str, str]],
                 mesh: Sequence[tuple[int, int, int, int]], program_hash: str,
                 hidden_shape: Sequence[int | tuple[str, int] | tuple[str, int, int]] | None = None, hidden_dtype: torch.dtype | None = None,
                 cp_rank: int = 0, cp_size: int = 1):
        self.stage, self.engine, self.optimizer, self.loss_fn = stage, engine, optimizer, loss_fn
        self.collectives, self.groups, self.tie_group, self.tie_first = collectives, groups, tie_group, tie_first
        self.dp_rank, self.dp_size, self.tp_size = dp_rank, dp_size, tp_size
        # context parallelism: this rank's tokens of each row; groups.dp holds the dp x cp ranks, over which
        # gradients and the loss are averaged
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self._replicas = dp_size * cp_size
        self.microbatch_size, self.num_microbatches = microbatch_size, num_microbatches
        self.clip_grad_norm, self.program_hash = clip_grad_norm, program_hash
        self.placements, self.full_keys, self.mesh = dict(placements), tuple(full_keys), tuple(mesh)
        self.num_stages, self._stage_ranks = num_stages, tuple(stage_ranks)
        mine = sorted(s for s in stage.stages)
        self._local_stages = len(mine)
        self.executor = PipelineExecutor(
            actions=actions, stages={s: stage.stage_callable(s) for s in mine}, num_stages=num_stages,
            stage_to_rank=lambda s: stage_ranks[s], collectives=collectives, loss_fn=loss_fn,
            num_microbatches=num_microbatches, group=None, grad_sync=self._grad_sync, optim=self._optim,
            unshard=lambda s: engine.unshard(), reshard=lambda s: engine.reshard(), no_sync=engine.no_sync,
            feed_inputs=True, activation_shape=self._activation_shape if hidden_shape is not None else None,
            # ZeRO-3 frees a unit after each backward, and a split backward's W still reads its gathered views
            split_backward=engine.split_backward if getattr(engine, "zero_stage", 0) == 3 else None,
            before_last_backward=self._post_tied_recvs)
        self._after_optim = implicit_after_step(engine, self.executor.actions)
        # fp16: each stage's call is the module's, whose output the engine would scale: the loss scale enters once,
        # at the model's output on the last stage, and the step is unscaled (and skipped on every rank at an
        # overflow on any) once the tied gradients are summed (DataParallel.unscale_)
        self._loss_scaled = getattr(engine, "scaler", None) is not None
        if self._loss_scaled:
            engine.caller_scales_loss()
            stage.on_output = engine.scale_output
        if stage.tied and tie_group is not None and not any(a.op == "GRAD_SYNC" for a in self.executor.actions):
            raise PipelineError(f"rank {dist.get_rank()} holds tied parameters {sorted(stage.tied)} shared with another "
                                "pipeline rank, and its instruction list has no GRAD_SYNC, where their gradients are "
                                "summed over both holders: add sGRAD_SYNC after the rank's last backward")
        self.hidden_shape, self.hidden_dtype = hidden_shape, hidden_dtype or torch.float32
        self._xs: list[Any] = []
        # the tied gradient's two-message sum: the other holder's global rank, the step's receive buffers
        # (one per tied parameter) and pending Work handles
        holders = dist.get_process_group_ranks(tie_group) if tie_group is not None and stage.tied else []
        self._tie_peer = next((r for r in holders if r != dist.get_rank()), None) if len(holders) == 2 else None
        self._tie_tag = 3 * num_microbatches * num_stages  # above every executor message's (executor.message_tag)
        self._tie_bufs: dict[str, torch.Tensor] = {}
        self._tie_recvs: dict[str, Any] = {}
        self._tie_sends: list[Any] = []
        self._loss_work: Any = None
        self.last_grad_norm: float | None = None
        self.lr_schedule = None  # runtime.engines.lr_schedule: stepped after each optimizer step
        self._peak = PeakHeld()
        self._evaluator: PipelineExecutor | None = None  # the list's forwards (evaluate), built on first use
        self._predictor: PipelineExecutor | None = None  # its first microbatch's forwards (predict)
        self._eval_code_ops = True  # whether an evaluation runs the code's ops under EvalOps

    # ---- the step -----------------------------------------------------------------------------
    def step(self, batch: tuple[Any, Any]) -> float:
        self._synced = self._stepped = 0
        self._loss_work, self._mean = None, None
        self.executor.run(*self._microbatches(batch))
        self._finish_tied_sends()
        if self._mean is None:  # an instruction list without GRAD_SYNC: the loss is reduced here
            self._reduce_loss()
        if self._loss_work is not None:
            self._loss_work.wait()
        mean = self._mean
        if self._replicas > 1:
            self.collectives.all_reduce(mean, self.groups.dp, op="avg")
        return float(mean.item())

    def evaluate(self, batch: tuple[Any, Any]) -> float:
        """The global mean loss on `batch` (a global batch, as `step` takes) as one process computes it under
        `model.eval()` and `torch.no_grad()`: the schedule's forwards alone, no dropout, nothing trained, no random
        number drawn (runtime.engines.evaluation). A collective: every rank of the plan calls it."""
        if self._evaluator is None:
            self._evaluator = self._forwards(forward_actions(self.executor.actions), self.loss_fn,
                                             self.num_microbatches)
        work = self._microbatches(batch)
        with evaluating([self.engine.module], code_ops=self._eval_code_ops) as ops:
            loss = self._evaluator.run(*work)
        self._eval_code_ops = ops is not None and ops.changed  # straight-line code: the next one meets the same
        mean = torch.tensor([0.0 if loss is None else loss], dtype=torch.float32, device=rank_device())
        if self.groups.pp is not None:  # only the last stage knows it
            self.collectives.all_reduce(mean, self.groups.pp, op="sum")
        if self._replicas > 1:
            self.collectives.all_reduce(mean, self.groups.dp, op="avg")
        return float(mean.item())

    def _forwards(self, actions: Sequence[Any], loss_fn: Callable | None, m: int) -> PipelineExecutor:
        """A forward-only executor over the training executor's stages and messages (evaluate, predict)."""
        e = self.executor
        return PipelineExecutor(actions=actions, stages=e.stages, num_stages=e.num_stages,
                                stage_to_rank=e.stage_to_rank, collectives=e.collectives, loss_fn=loss_fn,
                                num_microbatches=m, group=e.group, unshard=e.unshard, reshard=e.reshard,
                                activation_shape=e.activation_shape, timeout=e.timeout, feed_inputs=e.feed_inputs,
                                forward_only=True)

    def _microbatches(self, batch: tuple[Any, Any]) -> tuple[list[Any], list[Any] | None, Sequence[float] | None]:
        """This replica's (inputs per microbatch, targets per microbatch, loss weights) of a global batch;
        targets and weights on the last stage only, which computes the loss."""
        pairs = replica_microbatches(batch, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                     microbatch_size=self.microbatch_size, num_microbatches=self.num_microbatches,
                                     cp_rank=self.cp_rank, cp_size=self.cp_size)
        pairs = place(pairs)  # only this replica's rows travel to the device
        xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
        self._xs = xs  # the receives' buffer shapes (_activation_shape)
        if self.num_stages - 1 not in self.stage.stages:
            return xs, None, None
        weights = step_weights(self.loss_fn, batch, dp_rank=self.dp_rank, dp_size=self.dp_size,
                               microbatch_size=self.microbatch_size, num_microbatches=self.num_microbatches,
                               cp_rank=self.cp_rank, cp_size=self.cp_size)
        return xs, ys, weights

    def _reduce_loss(self) -> None:
        """Launch the sum of the loss over the pipeline (only the last stage knows it; zero elsewhere)."""
        loss = self.executor.loss_sum()
        self._mean = torch.zeros(1, device=rank_device()) if loss is None else \
            loss.detach().reshape(1).to(device=rank_device(), dtype=torch.float32)
        if self.groups.pp is not None:
            self._loss_work = self.collectives.all_reduce(self._mean, self.groups.pp, op="sum", async_op=True)

    def _activation_shape(self, s: int, i: int) -> tuple[tuple[int, ...], torch.dtype]:
        """The hidden state's shape on microbatch i, from its inputs' sizes: no shape message needed."""
        named = self.stage.named_inputs(self._xs[i])
        # (input, dim, k): the tokens split k ways under sequence parallelism
        shape = tuple(d if isinstance(d, int) else named[d[0]].shape[d[1]] // (d[2] if len(d) > 2 else 1)
                      for d in self.hidden_shape)
        return shape, self.hidden_dtype

    def _grad_sync(self, s: int) -> None:
        self._synced += 1
        if self._synced < self._local_stages:
            return  # one reduction for all of this rank's virtual stages, at the last one's GRAD_SYNC
        self._reduce_loss()  # every backward of this rank has run: the last stage's loss is complete
        self.engine.finish_gradients()
        for p in self.stage.tied.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self._tie_peer is not None:
            self._sum_tied()
        elif self.tie_group is not None:
            for p in self.stage.tied.values():
                self.collectives.all_reduce(p.grad, self.tie_group, op="sum")
        if self._replicas > 1:
            for p in self.stage.tied.values():
                self.collectives.all_reduce(p.grad, self.groups.dp, op="avg")
        if self._loss_scaled:  # fp16: every gradient of the step is complete, the tied ones summed
            self.engine.unscale_(extra=list(self.stage.tied.values()))

    # ---- the tied gradient's sum over its two holders -------------------------------------------
    def _tied_buf(self, name: str, p: torch.Tensor) -> torch.Tensor:
        buf = self._tie_bufs.get(name)
        if buf is None:  # for this step only: held from the last backward to the optimizer step
            buf = self._tie_bufs[name] = torch.empty_like(p, memory_format=torch.contiguous_format)
        return buf

    def _post_tied_recvs(self) -> None:
        """First holder, right before its last backward: post the receive of the other holder's tied
        gradients, which then arrive while that backward runs."""
        if self._tie_peer is None or not self.tie_first:
            return
        for j, (name, p) in enumerate(sorted(self.stage.tied.items())):
            self._tie_recvs[name] = self.collectives.recv(self._tied_buf(name, p), self._tie_peer,
                                                          tag=self._tie_tag + 2 * j)

    def _sum_tied(self) -> None:
        """p.grad = the sum of both holders' gradients, on both (module docstring)."""
        tied = sorted(self.stage.tied.items())
        if self.tie_first:  # received (mostly during the last backward): add, send the sum back
            for j, (name, p) in enumerate(tied):
                buf = self._tied_buf(name, p)
                self._tie_recvs.pop(name).wait()
                buf.add_(p.grad)  # other + mine == mine + other, bit for bit
                self._tie_sends.append(self.collectives.send(buf, self._tie_peer, tag=self._tie_tag + 2 * j + 1))
                p.grad.copy_(buf)  # the optimizer may write p.grad; buf stays as sent
            return
        works = []
        for j, (name, p) in enumerate(tied):
            g = p.grad.contiguous()
            works.append((self.collectives.send(g, self._tie_peer, tag=self._tie_tag + 2 * j), g))
            buf = self._tied_buf(name, p)
            works.append((self.collectives.recv(buf, self._tie_peer, tag=self._tie_tag + 2 * j + 1), buf))
        for work, _ in works:
            work.wait()
        for name, p in tied:
            p.grad.copy_(self._tie_bufs[name])

    def _finish_tied_sends(self) -> None:
        """Wait for the sums sent back and any receive left posted; free the step's buffers."""
        for work in self._tie_sends:
            work.wait()
        for work in self._tie_recvs.values():
            work.wait()
        self._tie_sends, self._tie_recvs, self._tie_bufs = [], {}, {}

    def _optim(self, s: int) -> None:
        self._stepped += 1
        if self._stepped < self._local_stages:
            return
        if self.clip_grad_norm is not None:
            self.last_grad_norm = self._clip(self.clip_grad_norm)
        self.optimizer.step()
        if self.lr_schedule is not None:
            self.lr_schedule.step()
        self._peak.note(self.held_bytes_now())
        self._after_optim()
        self.engine.zero_grad()
        for p in self.stage.tied.values():
            p.grad = None
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def _clip(self, max_norm: float) -> float:
        """torch's clip_grad_norm_ over the whole model: every parameter counted once, wherever it lives. inf
        where an fp16 overflow skips the step (every rank agreed on it: DataParallel.unscale_): nothing to clip."""
        if getattr(self.engine, "step_skipped", False):
            return math.inf
        def weight(name: str) -> float:  # a parameter replicated over the tensor group is counted once
            return 1.0 if is_sharded(self.placements.get(name, (REPLICATED, 1))[0]) else 1.0 / self.tp_size

        sq = self.engine.grad_square_sum(weight)
        if self.engine.zero_stage > 0 and self._replicas > 1:
            self.collectives.all_reduce(sq, self.groups.dp, op="sum")
        if self.tie_first:  # a tied parameter is counted on its first holder only
            for name, p in self.stage.tied.items():
                sq += weight(name) * torch.linalg.vector_norm(p.grad, dtype=torch.float64) ** 2
        for g in (self.groups.tp, self.groups.pp):
            if g is not None:
                self.collectives.all_reduce(sq, g, op="sum")
        norm = sq.sqrt().float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        self.engine.scale_grads_(coef)
        for p in self.stage.tied.values():
            p.grad.mul_(coef)
        return float(norm.item())

    # ---- the program contract ------------------------------------------------------------------
    def predict(self, inputs: Any) -> Any:
        """Inference under the plan: the model's output on `inputs` (one batch of model inputs, any number of
        rows, the same on every rank) as one process computes it in eval mode under no_grad, on every rank, with
        vocab-split logits gathered whole. The schedule's forwards of its first microbatch, run on the whole
        batch: each replica computes it all. A collective: every rank of the plan calls it."""
        if self.cp_size > 1:
            raise NotImplementedError(no_predict_under_cp(self.cp_size))
        if self._predictor is None:
            first = [a for a in forward_actions(self.executor.actions) if a.microbatch in (None, 0)]
            self._predictor = self._forwards(first, None, 1)
        self._xs = [place(inputs)]  # the receives' buffer shapes (_activation_shape)
        with evaluating([self.engine.module], code_ops=self._eval_code_ops):
            self._predictor.run(self._xs)
            outs = self._predictor.outputs()
            # the last stage's tensor slices gather the vocab-split logits together
            out = full_logits(outs[0]) if outs else None
        if self.groups.pp is not None:  # from the last stage to the rest of its pipeline
            box = [out]
            dist.broadcast_object_list(box, src=self._stage_ranks[-1], group=self.groups.pp)
            out = box[0]
        return out

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective over the world: the full model's parameters and buffers on global rank 0."""
        mine = self.engine.full_state_dict()
        if mine is not None:
            mine = {k: v.cpu() for k, v in mine.items()}  # gathered as objects: host copies, on any backend
            for n, p in self.stage.tied.items():
                mine[n] = p.detach().float().cpu().clone()
        parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(None if mine is None else (mine, self.placements), parts, dst=0)
        if dist.get_rank() != 0:
            return None
        # (pp, dp, tp, cp): replica 0's first context slice holds every parameter of its tensor slices
        coord = {m[0]: (*m[1:4], m[4] if len(m) > 4 else 0) for m in self.mesh}
        pieces: dict[str, dict[int, torch.Tensor]] = {}
        placements: dict[str, tuple[str, int]] = {}  # each stage knows its own shards
        for r, part in enumerate(parts):
            if part is None or coord[r][1] != 0 or coord[r][3] != 0:
                continue
            for k, v in part[0].items():
                pieces.setdefault(k, {})[coord[r][2]] = v
            placements.update(part[1])
        full: dict[str, torch.Tensor] = {}
        for k, by_tp in pieces.items():
            spec, fused = placements.get(k, (REPLICATED, 1))
            shards = [by_tp[t] for t in sorted(by_tp)]
            full[k] = unshard_parameter(shards, spec, fused) if is_sharded(spec) and len(shards) > 1 else shards[0]
        missing = [k for k, canon in self.full_keys if canon not in full]
        if missing:
            raise RuntimeError(f"full_state_dict: no rank returned {missing[:3]}")
        return {k: full[canon] for k, canon in self.full_keys}

    def held_bytes_now(self) -> dict[str, int]:
        now = dict(self.engine.held_bytes(self.optimizer))
        tied = sum(p.numel() * p.element_size() for p in self.stage.tied.values())
        now["params"] = now.get("params", 0) + tied
        now["grads"] = now.get("grads", 0) + sum(p.grad.numel() * p.grad.element_size()
                                                 for p in self.stage.tied.values() if p.grad is not None)
        return now

    def held_bytes(self) -> dict[str, int]:
        return self._peak.note(self.held_bytes_now())
