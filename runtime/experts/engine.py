"""The data-parallel engine of an expert-parallel rank: dense parameters as ever, experts over their own group.

Under ep > 1 a rank holds E/ep experts of each MoE layer (its slice of the batched `[E, ...]` weights), and
the ranks of its ep group hold the others. Its other parameters are replicas like any data-parallel
rank's. So, as Megatron-Core's expert-data-parallel groups:

- the dense parameters go through `runtime.engines.data_parallel.DataParallel` over the dp x cp group
  (DDP or ZeRO-1/2/3, buckets, the initial broadcast), exactly as without experts;
- the expert slices stay outside it (`runtime.pipeline.stage.StageModel` keeps them apart, as it does tied
  parameters): no broadcast (each rank built its own experts from the same seed), and their gradients are
  summed over the expert-data-parallel group (the ranks holding the same experts: dp x cp / ep of them) and
  divided by dp x cp. Rank r's expert gradient already sums its ep group's tokens (the all-to-alls brought
  them), and each rank's loss is the mean over its own tokens, so that is one process's mean gradient;
- the optimizer steps both: `optimizer_params()` is the dense engine's plus the experts'. Under ZeRO
  (zero_stage >= 1) with more than one rank holding the same experts, the expert slices live in one flat
  buffer padded to a multiple of that group's size, and each rank steps only its shard of it (its
  gradients the all-reduced sum's shard: Gloo's all-reduce beats its reduce-scatter, docs/torch-notes.md),
  the updated shards all-gathered back at UNSHARD, as ZeRO-1 does for the dense parameters: the experts'
  optimizer state and gradients are divided over the group. At ZeRO-3 the flat buffer is freed at RESHARD
  (after the gradients are reduced) and gathered again at the next step's UNSHARD, so between steps a rank
  holds only its shard of its experts (during forward and backward all E/ep of them, one gather a step,
  not one per layer as the dense ZeRO-3 units are).

`full_state_dict()` gathers every expert slice over the ep group into the full `[E, ...]` tensors. A generated
program builds it as `ExpertParallel(DataParallel(model, ...), stage.experts, ep_group=..., ...)`, `stage` the
`StageModel` that cut the expert slices (tests/golden/program_mixtral_tiny_dp2_ep2_rank1.txt).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from runtime.comm.collectives import Collectives
from runtime.comm.groups import group_size
from runtime.engines.flat import FlatLayout

__all__ = ["ExpertParallel"]


class ExpertParallel:
    """`engine` (a DataParallel over the dense parameters) plus this rank's expert slices `experts` (name -> the
    slice it holds, dim 0 = its experts). ep_group: the ranks holding the other experts (this rank is index
    `ep_rank`); edp_group: the ranks holding the same experts; replicas: dp x cp (the loss's mean is over them)."""

    def __init__(self, engine, experts: Mapping[str, nn.Parameter], *, ep_group, ep_rank: int, ep: int, edp_group,
                 replicas: int, collectives: Collectives, zero_stage: int = 0):
        self.engine, self.experts = engine, dict(experts)
        self.ep_group, self.ep_rank, self.ep = ep_group, ep_rank, ep
        self.edp_group, self.replicas, self.collectives = edp_group, replicas, collectives
        if group_size(ep_group) != ep:
            raise ValueError(f"the ep group has {group_size(ep_group)} ranks, the plan's ep is {ep}")
        self.edp = group_size(edp_group)
        self.sharded = zero_stage > 0 and self.edp > 1 and bool(self.experts)
        self.free_at_rest = self.sharded and zero_stage == 3
        if self.sharded:
            self._build_flat()

    @torch.no_grad()
    def _build_flat(self) -> None:
        """The expert slices as views of one flat buffer (runtime.engines.flat.FlatLayout over the ranks holding
        the same experts); this rank's shard of it, what the optimizer steps."""
        params = list(self.experts.values())
        self._layout = FlatLayout(names=tuple(self.experts), shapes=tuple(tuple(p.shape) for p in params),
                                  world=self.edp)
        self._flat = self._layout.flatten(params, params[0].dtype)
        for p, view in zip(params, self._layout.views(self._flat)):
            p.data = view
        self._edp_rank = dist.get_rank(self.edp_group)
        self._lo, hi = self._layout.shard_range(self._edp_rank)
        self._shard = nn.Parameter(self._flat[self._lo:hi].clone())
        self._flat_bytes = self._flat.untyped_storage().nbytes()

    @torch.no_grad()
    def _gather(self) -> None:
        """Every rank's shard into the flat buffer the expert slices view (allocated again if freed)."""
        storage = self._flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._flat_bytes)
        self.collectives.all_gather(self._flat, self._shard.detach().clone(), self.edp_group)

    def __getattr__(self, name: str):  # module, unshard, reshard, checkpoint_blocks, ... : the dense engine's
        return getattr(self.engine, name)

    def optimizer_params(self) -> list[nn.Parameter]:
        return [*self.engine.optimizer_params(), *([self._shard] if self.sharded else self.experts.values())]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.engine.no_sync():  # expert gradients accumulate locally until finish_gradients
            yield

    @torch.no_grad()
    def finish_gradients(self) -> None:
        self.engine.finish_gradients()
        grads = []
        for p in self.experts.values():
            if p.grad is None:  # no token reached this rank's experts in any microbatch: zero, as in one process
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if self.edp == 1:
            for g in grads:
                g.div_(self.replicas)
            return
        flat = torch.zeros(self._flat.numel() if self.sharded else sum(g.numel() for g in grads),
                           dtype=grads[0].dtype, device=grads[0].device)
        torch.cat([g.reshape(-1) for g in grads], out=flat[:sum(g.numel() for g in grads)])
        self.collectives.all_reduce(flat, self.edp_group, op="sum")
        flat.div_(self.replicas)
        if self.sharded:  # only this rank's shard is stepped: the full gradients go
            self._shard.grad = flat[self._lo:self._lo + self._shard.numel()].clone()
            for p in self.experts.values():
                p.grad = None
            return
        for g, v in zip(grads, torch.split(flat, [g.numel() for g in grads])):
            g.copy_(v.view_as(g))

    @torch.no_grad()
    def unshard(self) -> None:
        """The UNSHARD action: the dense engine's, then (experts sharded) every rank's updated shard of the
        experts all-gathered over the ranks holding the same experts, into the slices the code reads."""
        self.engine.unshard()
        if self.sharded:
            self._gather()

    def reshard(self) -> None:
        """The RESHARD action (ZeRO-3): the dense engine's; the experts' flat buffer freed (no communication)."""
        self.engine.reshard()
        if self.free_at_rest:
            self._flat.untyped_storage().resize_(0)

    def after_step(self) -> None:
        """For a caller that runs no instruction list: the dense engine's after_step, the experts' gather."""
        self.engine.after_step()
        if self.sharded:
            self._gather()

    def _shard_ranges(self) -> list[tuple[str, tuple[int, ...], int, int, int]]:
        """(name, slice shape, start, stop, offset): elements [start, stop) of each expert slice's flattening
        that this rank's shard holds, at [offset, offset + stop - start) of the shard."""
        shape = dict(zip(self._layout.names, self._layout.shapes))
        offset = dict(zip(self._layout.names, self._layout.offsets))
        return [(n, shape[n], a, b, offset[n] + a - self._lo) for n, a, b in self._layout.owned_pieces(self._edp_rank)]

    @torch.no_grad()
    def grad_square_sum(self, weight) -> torch.Tensor:
        """The dense engine's sum of weight(name) * |g|^2 plus this rank's expert gradients', after
        finish_gradients, to be summed over the same groups as the dense engine's (PipelineRunner._clip):
        over dp x cp when the dense engine is ZeRO >= 1, where every rank holds other expert elements (other
        experts, or another shard of the same ones). Under ZeRO-0 the ranks holding the same experts hold the
        same gradients and the caller sums nothing over dp, so the ep group's are summed here."""
        sq = self.engine.grad_square_sum(weight)
        ex = torch.zeros_like(sq)
        if self.sharded:
            if self._shard.grad is not None:
                for n, _shape, a, b, at in self._shard_ranges():
                    ex += weight(n) * torch.linalg.vector_norm(self._shard.grad[at:at + b - a], dtype=torch.float64) ** 2
        else:
            for n, p in self.experts.items():
                if p.grad is not None:
                    ex += weight(n) * torch.linalg.vector_norm(p.grad, dtype=torch.float64) ** 2
        if self.engine.zero_stage == 0 and self.ep > 1:
            self.collectives.all_reduce(ex, self.ep_group, op="sum")
        return sq + ex

    @torch.no_grad()
    def scale_grads_(self, coef: torch.Tensor) -> None:
        """Every gradient the optimizer will step, dense and expert, times coef."""
        self.engine.scale_grads_(coef)
        for p in ([self._shard] if self.sharded else self.experts.values()):
            if p.grad is not None:
                p.grad.mul_(coef)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """torch's clip_grad_norm_ over the dense and the expert gradients together (DataParallel's, for a
        program with no tensor or pipeline group): the norm before clipping, the same on every rank."""
        sq = self.grad_square_sum(lambda name: 1.0)
        if self.engine.zero_stage > 0:
            self.collectives.all_reduce(sq, self.engine.group, op="sum")
        norm = sq.sqrt().float()
        self.scale_grads_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return float(norm.item())

    def zero_grad(self) -> None:
        self.engine.zero_grad()
        for p in self.experts.values():
            p.grad = None
        if self.sharded:
            self._shard.grad = None

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective over the dp x cp and ep groups: the dense engine's state dict with every expert parameter
        whole (its slices gathered over the ep group, in expert order), on the group's first rank."""
        full = self.engine.full_state_dict()
        if self.sharded:  # ZeRO-3's UNSHARD opens the next step: the last step's shards are not gathered yet
            self._gather()
        whole = {}
        for n, p in self.experts.items():
            out = p.new_empty((p.shape[0] * self.ep, *p.shape[1:]))
            if self.ep > 1:
                self.collectives.all_gather(out, p.detach().contiguous(), self.ep_group)
            else:
                out.copy_(p)
            whole[n] = out.float()
        if full is None:
            return None
        return {**full, **whole}

    def held_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        out = dict(self.engine.held_bytes(optimizer))
        extra = self._flat.untyped_storage().nbytes() + self._shard.numel() * self._shard.element_size() \
            if self.sharded else sum(p.numel() * p.element_size() for p in self.experts.values())
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.experts.values() if p.grad is not None)
        out["params"] += extra
        out["grads"] += grads
        out["total"] += extra + grads
        return out

    def master_pieces(self) -> list[tuple[torch.Tensor, tuple[tuple[str, tuple[int, ...], int, int, int], ...]]]:
        """What a checkpoint saves and loads (as DataParallel.master_pieces): the dense engine's pieces, then
        this rank's expert values, the slices themselves or (sharded) its shard of their flat buffer. The
        ranges are in each slice's shape; `expert_slices` says where a slice sits in the full [E, ...] tensor."""
        out = list(self.engine.master_pieces())
        if not self.sharded:
            return out + [(p, ((n, tuple(p.shape), 0, p.numel(), 0),)) for n, p in self.experts.items()]
        return out + [(self._shard, tuple(self._shard_ranges()))]

    def expert_slices(self) -> dict[str, tuple[int, int, int]]:
        """name -> (dim, index, count): each expert slice is block `ep_rank` of `ep` along dim 0 of its full
        tensor (the order `full_state_dict` gathers them in), whatever the tensor-parallel placements say."""
        return {n: (0, self.ep_rank, self.ep) for n in self.experts}

    @torch.no_grad()
    def refresh_params(self) -> None:
        """After a checkpoint was loaded into `master_pieces`: the dense engine's refresh, and (sharded) the
        expert shards gathered into the slices the code reads."""
        self.engine.refresh_params()
        if self.sharded:
            self._gather()

    def __str__(self) -> str:
        return f"ExpertParallel({self.engine}, ep={self.ep} rank {self.ep_rank}, {len(self.experts)} expert params)"
