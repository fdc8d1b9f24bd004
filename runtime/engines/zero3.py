"""ZeRO-3 (FSDP): parameters sharded at rest, each unit gathered just in time for its forward and backward.

Part of `runtime.engines.data_parallel.DataParallel` (a mixin of it: it uses the engine's group,
collectives, reducer and its reduce-scatter queue). A unit is gathered in the forward pre-hook of the
smallest module holding all its parameters, freed after that module's forward, and gathered again when
the gradient of the module's output arrives; prefetch: the next unit in the previous forward's order,
the previous one in backward. A unit on the root module stays gathered from forward to its backward
(FSDP2's root behaviour: it is needed first in backward). At rest the model's sharded attributes are meta
tensors (reading freed storage would crash).

Recomputation inside backward (activation checkpointing of a block, runtime.engines.recompute) runs the
block's forward again, module hooks included. A unit the backward has already gathered (the unit whose
backward is running, the one prefetched for the next) is used as it is and kept; any other unit is gathered
for its recomputed forward and freed after it, as in the first forward (DeepSpeed's ZeRO-3 re-fetches
during recomputation too). Its recomputed activations keep views of its flat buffer, as the first forward's
do; they are read only by its own backward, which gathers it again first. So with units finer than the
block (one per module holding parameters) at most three are whole at once during a block's backward: the
unit in backward, the one prefetched, the one being recomputed; each unit is gathered three times per
microbatch (forward, recomputation, backward) instead of two. A unit that is the whole block is gathered
for its backward before the recomputation starts and serves it: two gathers, the whole block resident.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from runtime.compression.quantized_gather import quantized_all_gather
from runtime.engines.flat import FlatLayout, FlatTensors

__all__ = ["ShardedUnits"]

_FREE, _GATHERING, _GATHERED = "free", "gathering", "gathered"
# what a placeholder answers itself: metadata reads, which must not gather
_METADATA = frozenset({torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride,
                       torch.Tensor.is_floating_point, torch.Tensor.element_size, torch.Tensor.__repr__,
                       torch.Tensor.is_complex, torch.Tensor.__len__})


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
    for_backward: bool = False  # gathered (or being gathered) for its backward: a recomputation keeps it


class _Deferred(torch.Tensor):
    """A sharded parameter at rest when units are finer than the module that runs them: generated stage code
    (runtime.pipeline.stage) takes a block's parameters as arguments when the block starts, and no module
    hook of theirs runs. The first op that reads the placeholder gathers its unit (and ends the forward of
    the unit used before it); the op then runs on the gathered view. A recomputation's ops, which read the
    same arguments again, gather again. Metadata reads (shape, dtype) answer from the meta tensor."""

    @staticmethod
    def of(meta: torch.Tensor, engine, unit: Unit, k: int) -> "_Deferred":
        t = torch.Tensor._make_subclass(_Deferred, meta)
        t._engine, t._unit, t._k = engine, unit, k
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA or getattr(func, "__name__", "") == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map(lambda x: x._engine._resolve(x._unit, x._k) if isinstance(x, _Deferred) else x,
                                (args, kwargs))
        return func(*args, **kwargs)


class _HookOps(TorchFunctionMode):
    """Active through a first forward with per-module units under generated code: `_hooked_op` on every op."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.engine._hooked_op(out, (args, kwargs))
        return out


class ShardedUnits:
    """Stage 3 of DataParallel: build the units, gather and free them around each use, reduce their gradients."""

    @torch.no_grad()
    def _build_sharded(self, units: tuple[tuple[str, ...], ...], unit_modules: Sequence[str] | None,
                       deferred: bool = False) -> None:
        """`deferred`: units finer than the modules the code calls (per-module units under generated stage
        code): placeholders at rest gather on first use (`_Deferred`), and each first forward's ops that read
        a unit hook its backward (`_HookOps`)."""
        self._deferred, self._current, self._hook_mode = deferred, None, None
        self._live: dict[int, Unit] = {}  # storage address -> gathered unit (deferred units only)
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
        # hold every parameter whole on every rank, ZeRO-3's saving undone. Shapes are all that is left
        # (frozen parameters stay: the model reads them as they are).
        self._params = {n: p if n in self._frozen else
                        nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                        for n, p in self._params.items()}

    def _gather(self, u: Unit, *, async_op: bool) -> None:
        if u.state != _FREE:
            return
        full = u.flat.params
        full.untyped_storage().resize_(full.numel() * full.element_size())
        if self._deferred and not u.keep:  # where `_hooked_op` looks storages up
            self._live[full.untyped_storage().data_ptr()] = u
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
        self._live.pop(u.flat.params.untyped_storage().data_ptr(), None)
        u.flat.params.untyped_storage().resize_(0)
        u.state, u.for_backward = _FREE, False
        if self._current is u:  # (deferred units) freed by its backward: no forward of it is open
            self._current = None
        self._install_placeholders(u)

    def _install_placeholders(self, u: Unit) -> None:
        for mod, attr, k in u.slots:
            meta = torch.empty(u.flat.layout.shapes[k], dtype=self._dtype, device="meta")
            mod.__dict__[attr] = _Deferred.of(meta, self, u, k) if self._deferred and not u.keep else meta
        u.installed = False

    # ---- per-module units under generated code (deferred placeholders) ---------------------------------
    def _resolve(self, u: Unit, k: int) -> torch.Tensor:
        """A deferred placeholder of u met an op: u's view k, u gathered; the unit in use before it is done."""
        if self._current is not None and self._current is not u:
            self._leave(self._current)
        self._current = u
        self._ready(u)
        return u.views[k]

    def _leave(self, u: Unit) -> None:
        """u's forward is over (the next unit's first op, or the end of the forward): free it, unless a
        recomputation meets it gathered for its backward (`_after_forward`'s rule)."""
        if self._current is u:
            self._current = None
        if torch._C._current_graph_task_id() != -1 and (u.for_backward or u.keep):
            return
        if not u.keep:
            self._reshard(u)

    def _enter_forward(self) -> None:
        """Root pre-forward (deferred units): hook the ops of a first forward with grad."""
        if self._deferred and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self._hook_mode = _HookOps(self)
            self._hook_mode.__enter__()

    def _exit_forward(self) -> None:
        """Root post-forward (deferred units): the last unit used is done; stop hooking ops."""
        if self._hook_mode is not None:
            mode, self._hook_mode = self._hook_mode, None
            mode.__exit__(None, None, None)
        if self._current is not None:
            self._leave(self._current)

    def _hooked_op(self, out, args) -> None:
        """First forward, grad on: an op read a gathered unit's storage (a parameter, or a view of one: the
        transpose a matmul reads): its output's gradient gathers that unit before the op's backward."""
        live = self._live
        used = {}
        for t in tree_flatten(args)[0]:
            if isinstance(t, _Deferred):
                used[id(t._unit)] = t._unit
            elif torch.is_tensor(t) and t.device.type != "meta":
                u = live.get(t.untyped_storage().data_ptr())
                if u is not None:
                    used[id(u)] = u
        if not used:
            return
        outs = [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.requires_grad]
        for u in used.values():
            for t in outs:
                t.register_hook(functools.partial(self._before_backward, u))

    def _ready(self, u: Unit) -> bool:
        """Make u gathered and its views this forward's (recording the forward's order and prefetching the
        next unit on first use); whether the views were new."""
        if u.state != _GATHERED:
            self._gather(u, async_op=False)
            self._wait_gather(u)
        if u.views_for == self._forward_id:
            return False
        u.views_for = self._forward_id
        self._fwd_order.append(u.index)
        order = self._fwd_order_prev
        if u.index in order and order.index(u.index) + 1 < len(order):
            self._gather(self._units[order[order.index(u.index) + 1]], async_op=True)
        u.views = u.flat.layout.split(u.flat.params)  # one split: one flat gradient for the unit
        return True

    def _use(self, u: Unit, module=None, args=None) -> None:
        """Forward pre-hook: make u gathered, install its views, prefetch the next unit."""
        if not self._ready(u) and u.installed:
            return
        for mod, attr, k in u.slots:  # also when recomputed in backward (activation checkpointing)
            mod.__dict__[attr] = u.views[k]
        u.installed = True

    def _after_forward(self, u: Unit, module, args, output) -> None:
        if torch._C._current_graph_task_id() != -1:
            # a recomputation inside backward (activation checkpointing): a unit gathered for its backward
            # (running or prefetched) stays; any other was gathered for this forward alone and goes again
            if not (u.for_backward or u.keep):
                self._reshard(u)
            return
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
        u.for_backward = True
        # prefetch the unit whose backward comes next: the last one before u in forward order
        # (for a root unit, which starts backward first: the last one of the forward)
        order = self._fwd_order
        if not u.keep and u.index in order:
            order = order[:order.index(u.index)]
        # (the nearest not yet reduced: if it is gathered already, as when this hook runs again for another
        # output of u's, nothing more; going further back would gather a unit per call)
        for j in reversed(order):
            w = self._units[j]
            if j == u.index or w.reduced or w.keep:
                continue
            if w.state == _FREE:
                self._gather(w, async_op=True)
                w.for_backward = True
            break

    @torch.no_grad()
    def _after_backward(self, u: Unit, full: torch.Tensor) -> None:
        """Post-accumulate-grad hook of u's gathered buffer: reduce-scatter its gradient (`_reduction_input`), free
        it."""
        self._begin_backward()
        if self._split_part == "W":
            return  # W's passes may all add to this buffer's gradient: split_backward reduces it once, at the end
        g, full.grad = full.grad, None
        g = self._reduction_input(g)  # (rebound: a 16-bit original is not held beside its copy)
        self._reduce(u, g)
        self._reshard(u)

    def _reduction_input(self, g: torch.Tensor) -> torch.Tensor:
        """A unit's gradient as its reduce-scatter takes it: in the master dtype (fp32; pure bf16: bf16), except
        where this step reduces at bf16 (compression 'bf16', grad_reduce_dtype='bf16') and the gradient is 16-bit:
        then in bf16 as it is (fp16: cast), not copied to fp32 only to be rounded to bf16 for the wire. The
        reduction holds 2 bytes per element instead of 4 (FSDP2 with reduce_dtype=bf16 does the same), divides it by
        the group size in place and runs in the background like an uncompressed one
        (DataParallel._reduce_scatter); the division then rounds in bf16, once, where the fp32 copy rounded twice
        (exact, and so the same, for a group of a power of two)."""
        if self._sixteen_bit_reduction(g):
            return g.to(torch.bfloat16)
        return g.to(self._master)

    def _sixteen_bit_reduction(self, g: torch.Tensor) -> bool:
        return self.reducer.compressing and self.reducer.flat == "bf16" and g.dtype in (torch.bfloat16, torch.float16)

    def _reduce(self, u: Unit, g: torch.Tensor) -> None:
        """Reduce-scatter u's gradient g, the engine's own (taken off the gathered buffer, or a copy of it)."""
        self._drain_all()  # at most one reduce-scatter in flight
        self._reduce_scatter(u.flat, g, sixteen_bit=self._sixteen_bit_reduction(g))
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
            g = self._reduction_input(g)
            self._reduce(u, g)
        for u in self._units:
            u.reduced = False
            self._reshard(u)
