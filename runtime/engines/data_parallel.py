"""Data parallelism for the generated per-rank programs: DDP and ZeRO-1/2/3, collectives placed by us.

torch's DDP, `ZeroRedundancyOptimizer` and FSDP2 do all of this inside their
own hooks; the compiler must decide every collective itself (docs/architecture.md#rules-of-the-house),
and FSDP2 cannot keep parameters replicated (ZeRO-1/2), so the engine is
written here on c10d through `runtime.comm.collectives` -- the torch wrappers are
its oracles in the tests. This module holds the engine and what every stage shares (the backward's
bookkeeping, the reduce-scatter queue, clipping, mixed precision); `runtime.engines.dp_buckets` the
gradient buckets of stages 0-2, `runtime.engines.zero3` the units of stage 3.

One step (the caller divides each microbatch loss by the number of microbatches)::

    dp = DataParallel(model, group=None, ranks=(0, 1), zero_stage=2, collectives=Collectives())
    opt = torch.optim.AdamW(dp.optimizer_params(), lr=1e-3)
    for i, (x, y) in enumerate(microbatches):
        with dp.no_sync() if i < len(microbatches) - 1 else contextlib.nullcontext():
            (loss_fn(dp.module(x), y) / len(microbatches)).backward()
    dp.finish_gradients(); dp.clip_grad_norm_(1.0); opt.step(); dp.after_step(); dp.zero_grad()

What each stage keeps and sends (``P`` parameters, ``dp`` ranks, fp32; per step
with ``m`` microbatches, ``B`` buckets, ``U`` ZeRO-3 units, ``K`` of them on the
root module):

=========  ===================  ============================  ================================
stage      params/grads/optim   during backward               after the optimizer step
=========  ===================  ============================  ================================
0 (DDP)    4P / 4P / full       B all-reduces (last mb only)  --
1          4P / 4P / 1/dp       B all-reduces (last mb only)  1 all-gather of the flat buffer
2          4P / 4P/dp / 1/dp    B reduce-scatters per mb      B all-gathers (one per bucket)
3 (FSDP)   all 1/dp             forward: U all-gathers; backward: U-K all-gathers and U reduce-scatters, per mb
=========  ===================  ============================  ================================

plus one all-reduce for `clip_grad_norm_` at stages 1-3 and one (max) for the
overflow check under fp16. Construction broadcasts parameters and buffers from
the group's first rank (one broadcast per dtype).

Layouts. Buckets take parameters in reverse registration order (DDP's order:
gradients become ready roughly back to front) up to ``bucket_bytes`` of fp32.
ZeRO-1 lays every parameter, in that order, in one flat buffer padded to a
multiple of dp; rank i owns slice i and the buckets are ranges of it. ZeRO-2
gives every bucket its own padded flat buffer, so that each bucket can be
reduce-scattered as soon as it is ready; rank i owns slice i of each bucket
(one optimizer Parameter per bucket; with the default 25 MiB buckets a small
model has a single one). ZeRO-3 gives every unit its own flat buffer.

Choices worth knowing:

- `no_sync()` skips communication at stages 0 and 1 (gradients accumulate
  locally in fp32). Stages 2 and 3 reduce-scatter every microbatch into the
  fp32 shard gradient anyway, as DeepSpeed ZeRO-2 and FSDP2 do by default, so
  they never hold a full gradient: one reduce-scatter is in flight at a time
  (launching the next waits for it), so at most the bucket or unit being
  filled and the one being reduced are whole.
- ZeRO-3 gathers a unit in the forward pre-hook of the smallest module holding
  all its parameters, frees it after that module's forward, and gathers it again
  when the gradient of the module's output arrives; prefetch: the next unit in
  the previous forward's order, the previous one in backward. A unit on the
  root module stays gathered from forward to its backward (FSDP2's root
  behaviour: it is needed first in backward). At rest the model's sharded
  attributes are meta tensors (reading freed storage would crash); use
  `full_state_dict()`.
- A parameter without a gradient in some backward is fine: an end-of-backward
  callback reduces every bucket or unit no hook launched (zeros if need be), in
  index order. But every rank must run the same graph, since the order of the
  collectives follows it (DDP's rule too). Buffers are broadcast once at the
  start only (as DDP with ``broadcast_buffers=False``). Frozen parameters are
  supported at stage 0 only; ZeRO-3 supports activation checkpointing
  (a unit the backward has gathered serves its recomputation; a unit finer
  than the block is gathered for its recomputed forward and freed after it,
  runtime.engines.zero3) but not ``retain_graph`` double backward. The ZeRO-1/2 all-gather after the step is
  synchronous (not yet overlapped with the next forward).
- Compression (`compression=`, `nodes=`, `compression_warmup=`): every
  reduction goes through `runtime.compression.grad_compression.GradientReducer` (bf16,
  int8/int4 with error feedback, PowerSGD; hierarchical across nodes). A
  compressed reduction is synchronous (it does not overlap backward yet); at
  ZeRO-3 with int8/int4 the weight gathers are int8 too
  (`runtime.compression.quantized_gather`). `compression_state_dict()` is the residual
  state a checkpoint must carry.
- Mixed precision: see `runtime.engines.mixed_precision`; fp16 uses a dynamic loss
  scale applied to the gradient entering the model's outputs, and an overflow
  turns `optimizer.step()` into a no-op by leaving the gradients None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from cost_models.memory import DDP_BUCKET_BYTES
from cost_models.powersgd import POWERSGD_RANK
from runtime.comm.collectives import Collectives
from runtime.comm.groups import NodeGroups
from runtime.compression.grad_compression import GradientReducer
from runtime.device import place_module, rank_device
from runtime.engines.dp_buckets import Bucket, GradientBuckets
from runtime.engines.flat import FlatLayout, FlatTensors, default_units, grad_key, resolve_units
from runtime.engines.fp8 import convert_linears
from runtime.engines.mixed_precision import (
    Fp16OverflowError,
    LossScaler,
    PrecisionName,
    cast_floating,
    policy,
    scale_grad,
)
from runtime.engines.recompute import recompute_blocks
from runtime.engines.zero3 import ShardedUnits, Unit

__all__ = ["DataParallel"]









class DataParallel(GradientBuckets, ShardedUnits):
    """Data-parallel training of `model` over `group`: DDP (zero_stage 0) or ZeRO-1/2/3.

    Mutates `model` in place: parameters are re-pointed into flat buffers
    (ZeRO-1/2), cast to 16-bit (mixed precision) or replaced by gathered views
    (ZeRO-3), and hooks are registered; call `module` for the forward.

    `unit_granularity` (ZeRO-3): "block" when each unit is gathered by a module the forward calls (its
    forward pre-hook); "module" when the units are finer than what the code calls (per-module units of the
    plan's zero3_unit="module" under generated stage code, which reads a block's parameters at once): then a
    unit is gathered by the first op that reads it (runtime.engines.zero3).
    """

    def __init__(self, model: nn.Module, *, group, ranks: tuple[int, ...], zero_stage: int,
                 collectives: Collectives, bucket_bytes: int = DDP_BUCKET_BYTES,
                 precision: PrecisionName = "fp32", units: Sequence[Sequence[str]] | None = None,
                 unit_modules: Sequence[str] | None = None, unit_granularity: str = "block",
                 compression: str | Mapping[str, str] = "none",
                 nodes: NodeGroups | None = None, compression_warmup: int = 0, powersgd_rank: int = POWERSGD_RANK):
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0 (DDP), 1, 2 or 3 (FSDP), got {zero_stage}")
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if len(ranks) != self.world or ranks[self.rank] != dist.get_rank():
            raise ValueError(f"ranks={tuple(ranks)} does not describe the group: it has {self.world} ranks "
                             f"and this process (global rank {dist.get_rank()}) is its rank {self.rank}; pass the "
                             f"group's global ranks in group order")
        self.module, self.group, self.ranks = place_module(model), group, tuple(ranks)  # before the broadcast
        self.reducer = GradientReducer(group, collectives, compression=compression, nodes=nodes,
                                       zero_stage=zero_stage, warmup_steps=compression_warmup,
                                       powersgd_rank=powersgd_rank)
        self.compression = self.reducer.compression
        self.zero_stage, self.collectives = zero_stage, collectives
        self.precision = policy(precision)
        if self.precision.fp8_gemms:
            convert_linears(model)  # a forward the module runs itself: its linears' GEMMs in fp8 (same parameters)
        self.scaler = LossScaler() if self.precision.loss_scaling else None
        # fp16: the loss scale enters the backward at the module's output (_root_post_forward) and finish_gradients
        # unscales, unless the caller does both (caller_scales_loss: a pipeline, whose stages each call the module
        # and whose tied copies are gradients of the step too)
        self._caller_scales = False
        self._dtype = self.precision.param_dtype
        self._master = self.precision.master_dtype  # what the optimizer steps and gradients accumulate in
        self._params: dict[str, nn.Parameter] = dict(model.named_parameters())  # first names, registration order
        first = {id(p): n for n, p in self._params.items()}
        self._alias = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
        self._state_keys = list(model.state_dict().keys())
        trainable = [n for n, p in self._params.items() if p.requires_grad]
        # frozen parameters (requires_grad=False: LoRA's base weights, a fixed position table) have no gradient
        # to reduce and no state to step: at every stage they stay whole on each replica, outside the flat
        # buffers and units, in the compute dtype
        self._frozen = tuple(n for n, p in self._params.items() if not p.requires_grad)
        self._broadcast_state()

        self._require_sync = True
        self._in_backward = False
        self._split_part: str | None = None  # "I" or "W" inside ShardedUnits.split_backward
        self._cycle_open = False  # gradients of this step have started to accumulate
        self._skip_step = False  # fp16 overflow in the last finish_gradients
        self._flats: list[FlatTensors] = []
        self._buckets: list[Bucket] = []
        self._units: list[Unit] = []
        self._masters: dict[str, nn.Parameter] = {}
        self._handles = []
        self._handles.append(model.register_forward_pre_hook(self._root_pre_forward, prepend=True, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._root_post_forward))
        if zero_stage > 0:
            with torch.no_grad():
                for n in self._frozen:
                    if self._params[n].is_floating_point():
                        self._params[n].data = self._params[n].data.to(self._dtype)
        if zero_stage == 3:
            units, unit_modules = self._trainable_units(units if units is not None else default_units(model),
                                                        unit_modules)
            self._build_sharded(resolve_units(model, units, skip=frozenset(self._frozen)), unit_modules,
                                deferred=unit_granularity == "module")
        else:
            self._build_replicated(trainable, bucket_bytes)

    # ---- construction ---------------------------------------------------------------------
    def _trainable_units(self, units: Sequence[Sequence[str]], unit_modules: Sequence[str] | None
                         ) -> tuple[tuple[tuple[str, ...], ...], Sequence[str] | None]:
        """ZeRO-3's units (names or aliases) without the frozen parameters (held whole, never gathered: a stage
        that reads one in two places names it in two units); a unit left empty goes, with the module named to
        gather it."""
        frozen = set(self._frozen)
        if not frozen:
            return tuple(tuple(u) for u in units), unit_modules
        kept = [tuple(n for n in u if self._alias.get(n, n) not in frozen) for u in units]
        keep = [i for i, u in enumerate(kept) if u]
        out = tuple(kept[i] for i in keep)
        if unit_modules is not None and len(unit_modules) == len(units):
            unit_modules = [unit_modules[i] for i in keep]
        return out, unit_modules

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        """All replicas start from the group's first rank's parameters and buffers (DDP does the same)."""
        tensors = [*self._params.values(), *(b for _, b in self.module.named_buffers())]
        self.collectives.broadcast_tensors(tensors, src=self.ranks[0], group=self.group)



    # ---- public API -----------------------------------------------------------------------
    @property
    def buckets(self) -> tuple[tuple[str, ...], ...]:
        """Parameter names per gradient bucket, in launch order (stages 0-2)."""
        return tuple(b.names for b in self._buckets)

    @property
    def units(self) -> tuple[tuple[str, ...], ...]:
        """Parameter names per ZeRO-3 gather unit."""
        return tuple(u.flat.layout.names for u in self._units)

    @property
    def layouts(self) -> tuple[FlatLayout, ...]:
        """The flat buffers this rank shards (ZeRO-1: one; ZeRO-2: one per bucket; ZeRO-3: one per unit)."""
        return tuple(f.layout for f in self._flats) if self.zero_stage > 0 else ()

    def checkpoint_blocks(self, names: Sequence[str], mode: str = "full") -> None:
        """Activation recomputation of these submodules (the plan's blocks) as `mode` says
        (runtime.engines.recompute: "full" keeps only their inputs, "selective" their matrix products' outputs), as
        the pipeline's stages do. Under ZeRO-3 the recomputation installs the block's unit's views again first:
        the unit is gathered for its backward by then, and the block's own hooks do not run inside the checkpoint
        (its submodules' do: units finer than the block are gathered, and freed, by them)."""
        units = {id(u.module): u for u in self._units}

        def reinstall(mod: nn.Module) -> None:
            if id(mod) in units:
                self._use(units[id(mod)])

        recompute_blocks(self.module, names, mode, before=reinstall if units else None)

    def optimizer_params(self) -> list[nn.Parameter]:
        """What torch.optim steps: DDP the (master) parameters; ZeRO this rank's fp32 flat shards."""
        if self.zero_stage > 0:
            return [f.shard for f in self._flats]
        if self.precision.mixed:
            return list(self._masters.values())
        return [p for p in self._params.values() if p.requires_grad]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate this backward's gradients without communicating (stages 0 and 1; at stages
        2 and 3 each microbatch is still reduce-scattered into the shard)."""
        before, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = before

    def finish_gradients(self) -> None:
        """Wait for the reductions; optimizer_params()' .grad then hold the mean gradient of this rank's slice."""
        if not self._cycle_open:
            self._open_cycle()  # nothing backpropagated since the last step: zero gradient
        if self.zero_stage in (0, 1):
            for b in self._buckets:
                if b.dirty:
                    self._launch(b)
            for b in self._buckets:
                self._wait_bucket(b)
            if self.zero_stage == 0:
                for n, (f, off, numel) in self._slot.items():
                    target = self._masters[n] if self.precision.mixed else self._params[n]
                    target.grad = f.grad[off:off + numel].view(self._params[n].shape)
            else:
                f = self._flats[0]
                f.shard.grad = f.grad[slice(*f.layout.shard_range(self.rank))]
        else:
            for b in self._buckets:
                if b.flat.grad is not None:
                    self._launch(b)
            for f in self._flats:
                self._drain(f)
                if f.fresh:
                    f.shard.grad = torch.zeros_like(f.shard)
                    f.fresh = False
        self._skip_step = False
        if not self._caller_scales:
            self.unscale_()
        self._cycle_open = False
        self.reducer.step_done()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale gradients so their global L2 norm is at most max_norm; return the norm before
        clipping, the same on every rank (inf after an fp16 overflow, when nothing is stepped).
        torch.nn.utils.clip_grad_norm_'s formula: coefficient min(1, max_norm / (norm + 1e-6))."""
        if self._skip_step:
            return float("inf")
        grads = [p.grad for p in self.optimizer_params() if p.grad is not None]
        # float64 squares: a ZeRO-1 shard is one long vector, and fp32 summation over
        # 10^5+ elements drifts by ~1e-5 relative
        sq = torch.zeros((), dtype=torch.float64, device=rank_device())
        for g in grads:
            sq += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
        if self.zero_stage > 0:  # each rank holds a slice: sum the squares (DDP's grads are replicated)
            self.collectives.all_reduce(sq, self.group, op="sum")
        norm = sq.sqrt().float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return norm.item()

    @torch.no_grad()
    def grad_square_sum(self, weight: Callable[[str], float]) -> torch.Tensor:
        """Sum over this rank's gradients of weight(name) * |g|^2 (float64), after finish_gradients.

        For a global norm over more axes than dp (pipeline stages, tensor shards): ZeRO >= 1 ranks
        hold disjoint slices, so the caller sums this over dp; DDP replicas hold the same values.
        `weight` lets a caller count a parameter replicated over the tensor group once (1/tp)."""
        sq = torch.zeros((), dtype=torch.float64, device=rank_device())
        if self.zero_stage == 0:
            for n, p in self._params.items():
                g = (self._masters[n] if self.precision.mixed else p).grad
                if g is not None:
                    sq += weight(n) * torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
            return sq
        for f in self._flats:
            if f.shard.grad is None:
                continue
            lo, _ = f.layout.shard_range(self.rank)
            offsets = dict(zip(f.layout.names, f.layout.offsets))
            for n, a, b in f.layout.owned_pieces(self.rank):
                piece = f.shard.grad[offsets[n] + a - lo: offsets[n] + b - lo]
                sq += weight(n) * torch.linalg.vector_norm(piece, dtype=torch.float64) ** 2
        return sq

    @torch.no_grad()
    def scale_grads_(self, coef: torch.Tensor) -> None:
        """Multiply every gradient the optimizer will step by coef (clipping across groups)."""
        for p in self.optimizer_params():
            if p.grad is not None:
                p.grad.mul_(coef)

    @torch.no_grad()
    def after_step(self) -> None:
        """After optimizer.step(), for a caller that runs no instruction list: `copy_masters`, then
        ZeRO-1/2's `unshard` (the updated shards all-gathered) or ZeRO-3's `reshard`. A generated
        program runs these as its OPTIM, UNSHARD and RESHARD actions instead."""
        self.copy_masters()
        if self.zero_stage in (1, 2):
            self.unshard()
        elif self.zero_stage == 3:
            self.reshard()

    @torch.no_grad()
    def copy_masters(self) -> None:
        """After optimizer.step(): mixed-precision DDP copies the fp32 masters into the 16-bit parameters
        (local; at ZeRO >= 1 the shards reach the parameters through `unshard`)."""
        if self.zero_stage == 0 and self.precision.mixed:
            for n, m in self._masters.items():
                self._params[n].copy_(m)

    @torch.no_grad()
    def unshard(self) -> None:
        """The UNSHARD action. ZeRO-1/2: all-gather the shards the optimizer updated into the replicated
        parameters (synchronous: the next forward reads them). ZeRO-3: start the all-gather of the unit
        the forward uses first (in the last forward's order), so it overlaps what precedes that forward
        (a pipeline rank's wait for its input); the others are gathered as the forward reaches them.
        DDP: nothing."""
        if self.zero_stage in (1, 2):
            for f in self._flats:
                inp = f.shard.detach().to(self._dtype, copy=True)  # the fp32 shard views the output
                self.collectives.all_gather(f.params, inp, self.group)
        elif self.zero_stage == 3:
            self._prefetch_first()

    def reshard(self) -> None:
        """The RESHARD action (ZeRO-3): free every unit still gathered (none after a normal backward, which
        frees each unit once its gradient is reduced; a unit prefetched and never used, say). No communication."""
        for u in self._units:
            self._reshard(u)

    def zero_grad(self) -> None:
        """Drop gradients (waits for any reduction still in flight, so ranks stay in step)."""
        for b in self._buckets:
            self._wait_bucket(b)
        for f in self._flats:
            self._drain(f)
            if self.zero_stage == 2:
                f.grad = None
        for p in [*self.optimizer_params(), *self._params.values()]:
            p.grad = None
        self._cycle_open = False

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective. Full fp32 parameters and the buffers under model.state_dict()'s keys (tied
        names share one tensor) on the group's first rank; None on the others."""
        values: dict[str, torch.Tensor] = {}
        if self.zero_stage == 0:
            for n, p in self._params.items():
                values[n] = self._masters.get(n, p).detach().float().clone()
        else:
            for f in self._flats:
                full = torch.empty(f.layout.padded_numel, dtype=self._master, device=f.shard.device)
                self.collectives.all_gather(full, f.shard.detach(), self.group)
                values.update(zip(f.layout.names, f.layout.views(full.float())))
            for n in self._frozen:  # whole on every replica
                values[n] = self._params[n].detach().float().clone()
        if self.rank != 0:
            return None
        return {k: values[self._alias[k]] if k in self._alias else self.module.get_buffer(k).detach().clone()
                for k in self._state_keys}

    def master_pieces(self) -> list[tuple[torch.Tensor, tuple[tuple[str, tuple[int, ...], int, int, int], ...]]]:
        """What a checkpoint saves and loads: each tensor holding this rank's authoritative parameter values
        (what the optimizer steps: fp32 masters or flat shards; frozen parameters, whole, too), with the
        (name, parameter shape, start, stop, offset) ranges it holds: elements [start, stop) of the named
        parameter's flattening live at [offset, offset + stop - start) of the tensor's flattening."""
        if self.zero_stage > 0:
            out = []
            for f in self._flats:
                lo, _ = f.layout.shard_range(self.rank)
                shape, off = dict(zip(f.layout.names, f.layout.shapes)), dict(zip(f.layout.names, f.layout.offsets))
                out.append((f.shard, tuple((n, shape[n], a, b, off[n] + a - lo)
                                           for n, a, b in f.layout.owned_pieces(self.rank))))
            return out + [(p, ((n, tuple(p.shape), 0, p.numel(), 0),))
                          for n, p in ((n, self._params[n]) for n in self._frozen)]
        return [(self._masters.get(n, p), ((n, tuple(p.shape), 0, p.numel(), 0),)) for n, p in self._params.items()]

    def state_keys(self) -> dict[str, str]:
        """model.state_dict()'s keys (taken at construction, before ZeRO-3 removed the parameters) -> the name
        each one's tensor is saved under (tied aliases -> their first name; buffers -> themselves)."""
        return {k: self._alias.get(k, k) for k in self._state_keys}

    @torch.no_grad()
    def refresh_params(self) -> None:
        """After the tensors of `master_pieces` were overwritten (a checkpoint loaded): bring the parameters the
        forward reads up to date, as after an optimizer step (ZeRO-3 gathers from the shards on use anyway)."""
        if self.zero_stage in (0, 1, 2):
            self.after_step()

    def compression_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's gradient-compression state (step count, residuals, PowerSGD factors): tensors only."""
        return self.reducer.state_dict()

    def load_compression_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Restore `compression_state_dict()`; residuals saved under another group size are dropped
        with a warning."""
        self.reducer.load_state_dict(sd)

    def held_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds now: parameters (model, masters, flat buffers), gradients and
        optimizer state (pass the optimizer), each storage counted once, plus their total."""
        seen: set[int] = set()

        def total(tensors) -> int:
            out = 0
            for t in tensors:
                if t is None or t.device.type == "meta":
                    continue
                s = t.untyped_storage()
                if s.nbytes() and s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    out += s.nbytes()
            return out

        opt_params = self.optimizer_params()
        params = total([*self.module.parameters(), *opt_params, *(f.params for f in self._flats)])
        grads = total([*(p.grad for p in [*self.module.parameters(), *opt_params]),
                       *(f.grad for f in self._flats),
                       *(t for f in self._flats for _, out, inp in f.pending for t in (out, inp))])
        state = 0
        if optimizer is not None:
            state = total(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
        return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}

    def __str__(self) -> str:
        what = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[self.zero_stage]
        groups = self.units if self.zero_stage == 3 else self.buckets
        kind = "units" if self.zero_stage == 3 else "buckets"
        return (f"DataParallel({what}, dp={self.world}, rank {self.rank}, {self.precision.name}, "
                f"{len(groups)} {kind}: {[len(g) for g in groups]} params)")

    # ---- backward bookkeeping (all stages) ------------------------------------------------
    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        if not self._cycle_open:
            self._open_cycle()
        if self._split_part is not None:
            return  # half of a split backward: its region (ShardedUnits.split_backward) ends it, once
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _open_cycle(self) -> None:
        for f in self._flats:
            if self.zero_stage in (0, 1):
                f.grad.zero_()
            f.fresh = True
        self._cycle_open = True

    def _end_backward(self) -> None:
        """Runs once at the end of every backward: reduce what no hook launched, in index order."""
        self._in_backward = False
        if self.zero_stage == 3:
            for u in self._units:
                if not u.reduced:  # unused in this backward: every rank still issues its reduce-scatter
                    self._reduce(u, torch.zeros(u.flat.layout.padded_numel, dtype=self._master, device=rank_device()))
                u.reduced = False
                self._reshard(u)
            return
        if self.zero_stage == 2 or self._require_sync:
            while self._next < len(self._buckets):
                self._launch(self._buckets[self._next])
                self._next += 1
        self._next = 0
        for b in self._buckets:
            b.ready.clear()




    # ---- reduce-scatter into shards (stages 2 and 3) --------------------------------------
    def _reduce_scatter(self, f: FlatTensors, inp: torch.Tensor, sixteen_bit: bool = False) -> None:
        """Start reducing inp into f's shard. sixteen_bit: inp is a ZeRO-3 unit's bf16 gradient under a bf16
        reduction, the engine's own (runtime.engines.zero3): divided in place and reduced as a plain bf16 collective,
        in the background like the uncompressed one (the codecs and fp32 casts run in the hook)."""
        if sixteen_bit:
            out = torch.empty(f.layout.shard_numel, dtype=torch.bfloat16, device=inp.device)
            # the sum of the halves, as the compressor sends it (runtime.compression.grad_compression)
            work = self.collectives.reduce_scatter(out, inp.div_(self.reducer.world), self.group, op="sum",
                                                   async_op=True)
            f.pending.append((work, out, inp))
            return
        if self.reducer.compressing:
            f.pending.append((None, self.reducer.reduce_scatter_mean(inp, grad_key(f.layout.names)), inp))
            return
        out = torch.empty(f.layout.shard_numel, dtype=self._master, device=inp.device)
        work = self.collectives.reduce_scatter(out, inp, self.group, op="avg", async_op=True)
        f.pending.append((work, out, inp))

    def _drain_all(self) -> None:
        """Wait for every reduce-scatter in flight (FSDP2 keeps one in flight too): each holds its bucket's or
        unit's full fp32 gradient until waited for, so letting them pile up over a backward would hold the
        whole gradient, which ZeRO-2/3 exist not to do."""
        for f in self._flats:
            if f.pending:
                self._drain(f)

    def _drain(self, f: FlatTensors) -> None:
        """Wait for f's reduce-scatters and add them into the shard's gradient."""
        for work, out, _ in f.pending:
            if work is not None:
                work.wait()
            out = out.to(f.shard.dtype)  # a compressor's result is fp32, a background bf16 reduction's bf16
            if f.fresh or f.shard.grad is None:
                f.shard.grad, f.fresh = out, False
            else:
                f.shard.grad.add_(out)
        f.pending.clear()










    # ---- root hooks -----------------------------------------------------------------------
    def _root_pre_forward(self, module, args, kwargs):
        if self.zero_stage == 0:
            for p in self._params.values():
                p.grad = None  # DDP's exposed grads view the buckets: autograd must not accumulate into them
        if self.zero_stage == 3:
            self._forward_id += 1
            if self._fwd_order:
                self._fwd_order_prev = self._fwd_order
            self._fwd_order = []
            self._enter_forward()
        if self.precision.casts_inputs:
            return cast_floating(args, self._dtype), cast_floating(kwargs, self._dtype)
        return None

    def _root_post_forward(self, module, args, output):
        if self.zero_stage == 3:
            self._exit_forward()
        if self._caller_scales:
            return None
        return self.scale_output(output)

    # ---- fp16 -----------------------------------------------------------------------------
    @property
    def step_skipped(self) -> bool:
        """fp16: the last unscale_ met an overflow on some rank, so this step changes no parameter."""
        return self._skip_step

    def caller_scales_loss(self) -> None:
        """fp16: the caller applies the loss scale (scale_output, on the model's output only) and unscales
        (unscale_, with its own gradients) where it runs the module in pieces: a pipeline's stages."""
        self._caller_scales = True

    def scale_output(self, output: Any) -> Any:
        """fp16: the model's output with the loss scale entering the gradient that flows back into it (the loss's
        gradient at the caller's boundary, times the scale); else the output as it is."""
        if self.scaler is None or not torch.is_grad_enabled():
            return output
        return scale_grad(output, self.scaler)

    @torch.no_grad()
    def unscale_(self, extra: Sequence[torch.Tensor] = ()) -> bool:
        """fp16: divide this step's gradients, and those of the `extra` parameters the caller steps with them, by
        the loss scale. Where one is not finite on any rank, every rank skips the step (no gradient is kept, so
        torch.optim leaves every parameter and its state as they were): one process's GradScaler skips the whole
        step, so every replica, pipeline stage and tensor rank of the world does (all of them step together; a
        stage that stepped while another skipped would train a model no process trains). Then the scale is
        updated. Returns whether the step is skipped; without a scaler, False."""
        if self.scaler is None:
            return False
        params = [p for p in (*self.optimizer_params(), *extra) if p.grad is not None]
        found = torch.zeros((), device=rank_device())
        for p in params:
            p.grad.mul_(1.0 / self.scaler.scale)
            found = torch.maximum(found, (~torch.isfinite(p.grad)).any().float())
        self.collectives.all_reduce(found, None, op="max")  # the world
        self._skip_step = bool(found.item())
        if self._skip_step and self.scaler.scale < 1.0:
            # (every rank: the flag is the world's, and every rank's scaler has made the same updates)
            raise Fp16OverflowError(
                f"fp16-mixed: this step's gradients are not finite even at a loss scale of {self.scaler.scale:g} "
                f"({self.scaler.skipped_steps + 1} steps skipped so far): the overflow is in the model's fp16 "
                "arithmetic, not the scale, so no step would ever be taken; train with precision='bf16-mixed' or "
                "'fp32'")
        self.scaler.update(found_inf=self._skip_step)
        if self._skip_step:
            for p in params:
                p.grad = None  # torch.optim skips parameters without a gradient: the step is a no-op
        return self._skip_step


