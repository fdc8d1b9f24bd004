"""Replicated parameters (DDP, ZeRO-1, ZeRO-2): gradients gathered into buckets and reduced as they fill.

Part of `runtime.engines.data_parallel.DataParallel` (a mixin of it: it uses the engine's group,
collectives, reducer and its reduce-scatter queue). Buckets take parameters in reverse registration
order (DDP's: gradients become ready roughly back to front) up to ``bucket_bytes`` of fp32; ZeRO-1 lays
every parameter in one flat buffer padded to a multiple of dp, of which the buckets are ranges; ZeRO-2
gives every bucket its own padded flat buffer, reduce-scattered as soon as the bucket is ready. Buckets
launch in index order on every rank, so every rank issues the same sequence of collectives.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn

from runtime.device import rank_device
from runtime.engines.flat import FlatLayout, FlatTensors, bucket, grad_key

__all__ = ["GradientBuckets"]


@dataclasses.dataclass(eq=False)
class Bucket:
    names: tuple[str, ...]
    flat: FlatTensors
    lo: int
    hi: int  # range of flat.grad it reduces
    ready: set = dataclasses.field(default_factory=set)
    work: object = None  # DDP/ZeRO-1 all-reduce in flight
    dirty: bool = False  # DDP/ZeRO-1: gradient added since the last launch


class GradientBuckets:
    """Stages 0-2 of DataParallel: build the buckets, fill them from gradient hooks, launch their reductions."""

    @torch.no_grad()
    def _build_replicated(self, trainable: list[str], bucket_bytes: int) -> None:
        order = trainable[::-1]
        groups = bucket(order, [self._params[n].numel() for n in order], bucket_bytes)

        def shapes(names):
            return tuple(tuple(self._params[n].shape) for n in names)

        if self.zero_stage == 0:
            for names in groups:
                f = FlatTensors(FlatLayout(names=names, shapes=shapes(names), world=1))
                f.grad = torch.zeros(f.layout.padded_numel, dtype=self._master, device=rank_device())
                self._flats.append(f)
                self._buckets.append(Bucket(names, f, 0, f.layout.numel))
            for n, p in self._params.items():
                if self.precision.mixed and p.requires_grad:
                    self._masters[n] = nn.Parameter(p.detach().float().clone())
                if p.is_floating_point():
                    p.data = p.data.to(self._dtype)
        else:
            per_flat = [order] if self.zero_stage == 1 else list(groups)
            for names in per_flat:
                f = FlatTensors(FlatLayout(names=tuple(names), shapes=shapes(names), world=self.world))
                master = f.layout.flatten([self._params[n] for n in names], self._master)
                f.params = master if not self.precision.mixed else master.to(self._dtype)
                for n, view in zip(names, f.layout.views(f.params)):
                    self._params[n].data = view
                lo, hi = f.layout.shard_range(self.rank)
                # fp32: the master slice is a view of the replicated buffer (no second copy)
                f.shard = nn.Parameter(f.params[lo:hi] if not self.precision.mixed else master[lo:hi].clone())
                if self.zero_stage == 1:
                    f.grad = torch.zeros(f.layout.padded_numel, dtype=self._master, device=rank_device())
                self._flats.append(f)
            for names in groups:
                f = self._flats[0] if self.zero_stage == 1 else self._flats[len(self._buckets)]
                off = dict(zip(f.layout.names, f.layout.offsets))
                lo = off[names[0]]
                hi = f.layout.padded_numel if self.zero_stage == 2 else off[names[-1]] + self._params[names[-1]].numel()
                self._buckets.append(Bucket(names, f, lo, hi))
        self._bucket_of = {n: b for b in self._buckets for n in b.names}
        self._slot = {}
        for b in self._buckets:
            off = dict(zip(b.flat.layout.names, b.flat.layout.offsets))
            for n in b.names:
                self._slot[n] = (b.flat, off[n], self._params[n].numel())
        for n in trainable:
            hook = functools.partial(self._on_grad, n)
            self._handles.append(self._params[n].register_post_accumulate_grad_hook(hook))
        self._next = 0  # next bucket to launch in this backward (buckets launch in index order on every rank)

    @torch.no_grad()
    def _on_grad(self, name: str, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: move p.grad (upcast to fp32; pure bf16: bf16) into its bucket; launch ready
        buckets."""
        self._begin_backward()
        g, p.grad = p.grad, None
        f, off, numel = self._slot[name]
        b = self._bucket_of[name]
        if self.zero_stage == 2 and f.grad is None:
            f.grad = torch.zeros(f.layout.padded_numel, dtype=self._master, device=rank_device())
        self._wait_bucket(b)  # an earlier synced backward's all-reduce of this buffer (linear: safe to add after)
        f.grad[off:off + numel].add_(g.reshape(-1))
        b.dirty = True
        if self.zero_stage == 2 or self._require_sync:
            b.ready.add(name)
            buckets = self._buckets  # launched in index order, so every rank issues the same sequence
            while self._next < len(buckets) and buckets[self._next].ready == set(buckets[self._next].names):
                self._launch(buckets[self._next])
                self._next += 1

    def _launch(self, b: Bucket) -> None:
        f = b.flat
        b.dirty = False
        if self.zero_stage in (0, 1):
            if not self.reducer.compressing:
                b.work = self.collectives.all_reduce(f.grad[b.lo:b.hi], self.group, op="avg", async_op=True)
            else:  # synchronous: compressed reductions do not overlap backward yet
                shapes = [tuple(self._params[n].shape) for n in b.names]
                self.reducer.all_reduce_mean_(f.grad[b.lo:b.hi], grad_key(b.names), shapes)
            return
        self._drain_all()  # at most one reduce-scatter in flight
        inp = f.grad if f.grad is not None else torch.zeros(f.layout.padded_numel, dtype=self._master,
                                                            device=rank_device())
        f.grad = None
        self._reduce_scatter(f, inp)

    def _wait_bucket(self, b: Bucket) -> None:
        if b.work is not None:
            b.work.wait()
            b.work = None
