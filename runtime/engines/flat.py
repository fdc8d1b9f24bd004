"""Flat buffers: which parameters share one buffer, and which slice of it each rank holds.

Data-parallel sharding (ZeRO-1/2/3) lays parameters end to end in one 1-D
buffer, pads it to a multiple of the data-parallel degree ``world`` and gives
rank ``r`` the even slice ``[r * shard, (r + 1) * shard)``; a slice may start
or end inside a parameter (ZeRO shards elements, not whole parameters, unlike
torch's `ZeroRedundancyOptimizer`). Everything here is plain data: a layout
answers "which slice does rank r hold?" without devices or process groups.

>>> lay = FlatLayout(names=("w", "b"), shapes=((2, 3), (3,)), world=2)
>>> print(lay)
Flat[w(2, 3)@0 b(3,)@6] 9 -> 10 = 2 x 5
>>> lay.shard_range(1), lay.owned_pieces(1)
((5, 10), (('w', 5, 6), ('b', 0, 3)))

Grouping policies live here too: `bucket` cuts a parameter order into
communication buckets of at most ``bucket_bytes`` (DDP's rule), and
`resolve_units` picks ZeRO-3's gather units (one per repeated block).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from functools import cached_property

import torch
import torch.nn as nn

__all__ = ["FlatLayout", "bucket", "default_units", "resolve_units"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlatLayout:
    names: tuple[str, ...]
    """Parameter names (the first name of each unique parameter), in buffer order."""
    shapes: tuple[tuple[int, ...], ...]
    """Shape of each parameter, same order."""
    world: int
    """Number of ranks the buffer is sharded over (1: not sharded); the buffer is padded to a multiple of it."""

    def __post_init__(self) -> None:
        if len(self.names) != len(self.shapes):
            raise ValueError(f"FlatLayout: {len(self.names)} names but {len(self.shapes)} shapes")
        if self.world < 1:
            raise ValueError(f"FlatLayout: world must be >= 1, got {self.world}")

    @cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for n in self.numels:
            out.append(at)
            at += n
        return tuple(out)

    @property
    def numel(self) -> int:
        """Elements of the parameters, without padding."""
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        """Elements each rank holds: ceil(numel / world)."""
        return -(-self.numel // self.world)

    @property
    def padded_numel(self) -> int:
        """Elements of the padded buffer: world * shard_numel."""
        return self.shard_numel * self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of rank's slice in the padded buffer."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside 0..{self.world - 1}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def owned_pieces(self, rank: int) -> tuple[tuple[str, int, int], ...]:
        """(name, start, stop) element ranges of the flattened parameters that rank holds."""
        lo, hi = self.shard_range(rank)
        return tuple(
            (name, max(lo, off) - off, min(hi, off + n) - off)
            for name, off, n in zip(self.names, self.offsets, self.numels)
            if off < hi and off + n > lo
        )

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view (its shape) into a buffer of `padded_numel` elements."""
        assert flat.numel() == self.padded_numel, (flat.numel(), self.padded_numel)
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Like `views`, through one `torch.split`: autograd then builds a single
        backward node that writes every parameter's gradient into one flat gradient
        of `flat` (slicing each view separately would make one buffer-sized zero
        gradient per parameter)."""
        pieces = torch.split(flat, [*self.numels, self.padded_numel - self.numel])
        return [p.view(s) for p, s in zip(pieces, self.shapes)]

    def flatten(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A new padded buffer holding `tensors` (one per name) end to end, padding zero."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=tensors[0].device if tensors else None)
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t.detach())
        return flat

    def __str__(self) -> str:
        body = " ".join(f"{n}{tuple(s)}@{o}" for n, s, o in zip(self.names, self.shapes, self.offsets))
        return f"Flat[{body}] {self.numel} -> {self.padded_numel} = {self.world} x {self.shard_numel}"


def bucket(names: Sequence[str], numels: Sequence[int], bucket_bytes: int,
           element_size: int = 4) -> tuple[tuple[str, ...], ...]:
    """Cut `names` (in the order given) into consecutive buckets of at most
    `bucket_bytes`; a parameter larger than the cap gets a bucket of its own.

    DDP's rule (torch/csrc/distributed/c10d/reducer.cpp `compute_bucket_assignment_by_size`,
    less its small first bucket); callers pass the reverse registration order so
    the first bucket fills first during backward.

    >>> bucket(["a", "b", "c"], [3, 3, 5], bucket_bytes=24)
    (('a', 'b'), ('c',))
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out: list[tuple[str, ...]] = []
    cur: list[str] = []
    size = 0
    for name, n in zip(names, numels):
        nbytes = n * element_size
        if cur and size + nbytes > bucket_bytes:
            out.append(tuple(cur))
            cur, size = [], 0
        cur.append(name)
        size += nbytes
    if cur:
        out.append(tuple(cur))
    return tuple(out)


def _unique_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters())  # first name of each parameter, registration order


def default_units(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """ZeRO-3 gather units when the caller names none.

    One unit per module of the model's largest `nn.ModuleList` (the repeated
    blocks) plus a first unit with every other parameter; without a ModuleList,
    one unit per top-level child that owns parameters plus the root's own.
    Names are first names (tied parameters appear once), empty units dropped.
    """
    params = _unique_params(model)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    lists = [(name, m) for name, m in lists if any(True for _ in m.parameters())]
    if lists:
        prefix, blocks = max(lists, key=lambda nm: len(nm[1]))
        prefixes = [f"{prefix}.{i}." if prefix else f"{i}." for i in range(len(blocks))]
    else:
        prefixes = [f"{name}." for name, child in model.named_children() if any(True for _ in child.parameters())]
    units: list[list[str]] = [[] for _ in prefixes]
    rest: list[str] = []
    for name in params:
        at = next((i for i, p in enumerate(prefixes) if name.startswith(p)), None)
        (rest if at is None else units[at]).append(name)
    return tuple(tuple(u) for u in [rest, *units] if u)


def resolve_units(model: nn.Module, units: Sequence[Sequence[str]] | None,
                  skip: frozenset[str] = frozenset()) -> tuple[tuple[str, ...], ...]:
    """Validate caller-given units (any alias of a tied parameter may be used),
    map names to first names, and collect parameters no unit names into a last
    unit, except those in `skip` (first names: frozen parameters, held outside the units). ValueError on
    unknown names or a parameter in two units."""
    if units is None:
        return default_units(model)
    first_name = {id(p): n for n, p in model.named_parameters()}
    alias = {n: first_name[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    seen: dict[str, int] = {}
    out: list[tuple[str, ...]] = []
    for i, unit in enumerate(units):
        names = []
        for n in unit:
            if n not in alias:
                raise ValueError(f"units[{i}] names {n!r}, which is not a parameter of the model; "
                                 f"names come from model.named_parameters(), e.g. {next(iter(alias), '?')!r}")
            n = alias[n]
            if n in seen:
                raise ValueError(f"parameter {n!r} is in units[{seen[n]}] and units[{i}]: each parameter "
                                 f"(tied ones count once) belongs to exactly one unit")
            seen[n] = i
            names.append(n)
        if names:
            out.append(tuple(names))
    rest = tuple(n for n in first_name.values() if n not in seen and n not in skip)
    return tuple(out) + ((rest,) if rest else ())


@dataclasses.dataclass(eq=False)
class FlatTensors:
    """One flat buffer's tensors on this rank."""

    layout: FlatLayout
    # compute dtype; ZeRO-1/2: replicated, the model's parameters view it; ZeRO-3: gathered on demand
    params: torch.Tensor | None = None
    grad: torch.Tensor | None = None  # fp32 local gradient; DDP/ZeRO-1 persistent, ZeRO-2 one per microbatch
    shard: nn.Parameter | None = None  # fp32 master slice this rank steps (ZeRO-1/2/3)
    pending: list = dataclasses.field(default_factory=list)  # in-flight reduce-scatters: (work, out, inp)
    fresh: bool = True  # the next reduction folded in overwrites shard.grad


def grad_key(names: Sequence[str]) -> str:
    """A stable name for the gradients of these parameters (residuals survive restarts and re-bucketing
    that keeps the same parameters together, unlike a bucket index)."""
    return f"{names[0]}..{names[-1]}[{len(names)}]"
