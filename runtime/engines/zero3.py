"""ZeRO-3 (FSDP): parameters sharded at rest, each unit gathered just in time for its forward and backward.

Part of `runtime.engines.data_parallel.DataParallel` (a mixin of it: it uses the engine's group,
collectives, reducer and its reduce-scatter queue). A unit is gathered in the forward pre-hook of the
smallest module holding all its parameters, freed after that module's forward, and gathered again when
the gradient of the module's output arrives; prefetch: the next unit in the previous forward's order,
the previous one in backward. A unit on the root module stays gathered from forward to its backward
(FSDP2's root behaviour: it is needed first in backward). At rest the model's sharded attributes are meta
tensors (reading freed storage would crash). Recomputation inside backward (activation checkpointing)
neither re-gathers nor frees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from runtime.compression.quantized_gather import quantized_all_gather
from runtime.engines.flat import FlatLayout, FlatTensors

__all__ = ["ShardedUnits"]

_FREE, _GATHERING, _GATHERED = "free", "gathering", "gathered"


@dataclasses.dataclass(eq=False)
class Unit:
    index: int
    flat: FlatTensors
    module: nn.Module  # smallest module holding all the unit's parameters
    slots: list  # (module, attribute, index in the layout) for every alias
    keep: bool  # on the root: stays gathered from forward to backward
    state: str = _FREE
    work: object = None
    gather_inp: torch.Tensor | None = None
    views_for: int = -1  # forward pass whose views are installed
    views: list | None = None  # the views of that forward (one torch.split of the gathered buffer)
    installed: bool = False  # the module attributes are those views (not meta placeholders)
    reduced: bool = False  # in the current backward


class ShardedUnits:
    """Stage 3 of DataParallel: build the units, gather and free them around each use, reduce their gradients."""

    @torch.no_grad()
    def _build_sharded(self, units: tuple[tuple[str, ...], ...], unit_modules: Sequence[str] | None) -> None:
        if unit_modules is not None and len(unit_modules) != len(units):
            raise ValueError(f"unit_modules names {len(unit_modules)} modules for {len(units)} units; give one each")
        aliases: dict[str, list[str]] = {}
        for a, n in self._alias.items():
            aliases.setdefault(n, []).append(a)
        self._fwd_order: list[int] = []
        self._fwd_order_prev: list[int] = list(range(len(units)))  # before the first forward: declared order
        self._forward_id = 0
        for i, names in enumerate(units):
            lay = FlatLayout(names=names, shapes=tuple(tuple(self._params[n].shape) for n in names), world=self.world)
            master = lay.flatten([self._params[n] for n in names], self._master)
            lo, hi = lay.shard_range(self.rank)
            full = torch.empty(lay.padded_numel, dtype=self._dtype, device=master.device)
            full.untyped_storage().resize_(0)
            full.requires_grad_(True)
            f = FlatTensors(lay, params=full, shard=nn.Parameter(master[lo:hi].clone()))
            self._flats.append(f)
            paths = [a.split(".") for n in names for a in aliases[n]]
            common = []
            for parts in zip(*(p[:-1] for p in paths)):
                if len(set(parts)) > 1:
                    break
                common.append(parts[0])
            # the module whose forward gathers the unit: by default the smallest holding all its
            # parameters; generated stage code, which reads them from its root, names the root ("")
            module = self.module.get_submodule(".".join(common) if unit_modules is None else unit_modules[i])
            slots, owners = [], []
            for k, n in enumerate(names):
                for a in aliases[n]:
                    mod_path, _, attr = a.rpartition(".")
                    mod = self.module.get_submodule(mod_path)
                    del mod._parameters[attr]
                    slots.append((mod, attr, k))
                    owners.append(mod)
            u = Unit(i, f, module, slots, keep=module is self.module)
            self._units.append(u)
            self._install_placeholders(u)
            self._handles.append(full.register_post_accumulate_grad_hook(functools.partial(self._after_backward, u)))
            for mod in {id(m): m for m in [module, *owners]}.values():
                self._handles.append(mod.register_forward_pre_hook(functools.partial(self._use, u)))
            self._handles.append(module.register_forward_hook(functools.partial(self._after_forward, u)))
        # The unsharded originals are no longer the model's (their shards are): keeping them here would
        # hold every parameter whole on every rank, ZeRO-3's saving undone. Shapes are all that is left.
        self._params = {n: nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                        for n, p in self._params.items()}

    def _gather(self, u: Unit, *, async_op: bool) -> None:
        if u.state != _FREE:
            return
        full = u.flat.params
        full.untyped_storage().resize_(full.numel() * full.element_size())
        if self.reducer.quantized_weights:  # int8 codes and scales on the wire, decoded on wait
            u.gather_inp = None
            u.work = quantized_all_gather(full.data, u.flat.shard.detach(), self.group, self.collectives,
                                          async_op=async_op)
        else:
            u.gather_inp = u.flat.shard.detach().to(self._dtype)  # 16-bit: gather half the bytes
            # .data: the saved views of this buffer must not see a version bump from the refill
            u.work = self.collectives.all_gather(full.data, u.gather_inp, self.group, async_op=async_op)
        u.state = _GATHERING if async_op else _GATHERED
        if not async_op:
            u.work, u.gather_inp = None, None

    def _prefetch_first(self) -> None:
        """Start gathering the unit the next forward uses first (the last forward's order; before any, the
        declared one): its pre-hook then waits for it instead of gathering it, so no collective is added."""
        order = self._fwd_order or self._fwd_order_prev
        if order and self._units[order[0]].state == _FREE:
            self._gather(self._units[order[0]], async_op=True)

    def _wait_gather(self, u: Unit) -> None:
        if u.state == _GATHERING:
            u.work.wait()
            u.work, u.gather_inp, u.state = None, None, _GATHERED

    def _reshard(self, u: Unit) -> None:
        if u.state == _FREE:
            return
        self._wait_gather(u)
        u.flat.params.untyped_storage().resize_(0)
        u.state = _FREE
        self._install_placeholders(u)

    def _install_placeholders(self, u: Unit) -> None:
        for mod, attr, k in u.slots:
            mod.__dict__[attr] = torch.empty(u.flat.layout.shapes[k], dtype=self._dtype, device="meta")
        u.installed = False

    def _use(self, u: Unit, module=None, args=None) -> None:
        """Forward pre-hook: make u gathered, install its views, prefetch the next unit."""
        if u.state != _GATHERED:
            self._gather(u, async_op=False)
            self._wait_gather(u)
        if u.views_for != self._forward_id:
            u.views_for = self._forward_id
            self._fwd_order.append(u.index)
            order = self._fwd_order_prev
            if u.index in order and order.index(u.index) + 1 < len(order):
                self._gather(self._units[order[order.index(u.index) + 1]], async_op=True)
            u.views = u.flat.layout.split(u.flat.params)  # one split: one flat gradient for the unit
        elif u.installed:
            return
        for mod, attr, k in u.slots:  # also when recomputed in backward (activation checkpointing)
            mod.__dict__[attr] = u.views[k]
        u.installed = True

    def _after_forward(self, u: Unit, module, args, output) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation inside backward (activation checkpointing): its backward follows
        needs_grad = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        if torch.is_grad_enabled() and needs_grad:
            for t in needs_grad:
                t.register_hook(functools.partial(self._before_backward, u))
            if u.keep:
                return
        self._reshard(u)

    def _before_backward(self, u: Unit, grad=None) -> None:
        """Hook on the gradient of u's module output: gather u for its backward, prefetch the previous unit."""
        self._begin_backward()
        if u.state == _FREE:
            self._gather(u, async_op=False)
        self._wait_gather(u)
        # prefetch the unit whose backward comes next: the last one before u in forward order
        # (for a root unit, which starts backward first: the last one of the forward)
        order = self._fwd_order
        if not u.keep and u.index in order:
            order = order[:order.index(u.index)]
        for j in reversed(order):
            if j != u.index and self._units[j].state == _FREE and not self._units[j].reduced:
                self._gather(self._units[j], async_op=True)
                break

    @torch.no_grad()
    def _after_backward(self, u: Unit, full: torch.Tensor) -> None:
        """Post-accumulate-grad hook of u's gathered buffer: reduce-scatter its gradient (fp32; pure bf16: bf16),
        free it."""
        self._begin_backward()
        if self._split_part == "W":
            return  # W's passes may all add to this buffer's gradient: split_backward reduces it once, at the end
        g, full.grad = full.grad, None
        self._reduce(u, g.to(self._master))
        self._reshard(u)

    def _reduce(self, u: Unit, g: torch.Tensor) -> None:
        self._drain_all()  # at most one reduce-scatter in flight
        self._reduce_scatter(u.flat, g)
        u.reduced = True

    @contextlib.contextmanager
    def split_backward(self, part: str, params: Sequence[torch.Tensor] = ()) -> Iterator[None]:
        """Run one half of a zero-bubble schedule's split backward (`runtime.pipeline.split_backward`) as one
        backward of the units.

        part "I": the input gradient only; no unit's gradient accumulates, so nothing is reduce-scattered
            (a backward's end would reduce-scatter zeros for every unit); the units its module-output hooks
            gathered are freed at the end.
        part "W": the weight gradients, run from the gradients I saved at the matmuls, below the module
            outputs whose hooks gather a unit in a backward, and in several autograd passes (one per
            parameter group). So the units it reaches (`params`: the gathered buffers W accumulates into) are
            gathered first, since the graph's saved views of them are read again; their gradients accumulate
            over all the passes and each is reduce-scattered once at the end (a unit's whole gradient held
            until then), then every unit is freed.
        Every replica runs the same lists over the same graphs, so the collectives match across the group.
        Stages 0-2 keep replicated parameters: nothing to do.
        """
        if self.zero_stage != 3:
            yield
            return
        reached = [u for u in self._units if any(u.flat.params is p for p in params)] if part == "W" else []
        for u in reached:
            self._gather(u, async_op=True)
        for u in reached:
            self._wait_gather(u)
        self._split_part = part
        try:
            yield
        finally:
            self._split_part = None
        if reached and not self._cycle_open:
            self._open_cycle()  # the step's gradients start here (W ran no hook: none reached a unit)
        for u in reached:
            full = u.flat.params
            g, full.grad = full.grad, None
            if g is None:  # reached but given no gradient: every replica still issues its reduce-scatter
                g = torch.zeros(u.flat.layout.padded_numel, dtype=self._master, device=full.device)
            self._reduce(u, g.to(self._master))
        for u in self._units:
            u.reduced = False
            self._reshard(u)
