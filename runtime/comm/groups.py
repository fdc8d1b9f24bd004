"""Process groups from the plan's device mesh: one per data, context, tensor and pipeline line.

Every rank sits at (pp, dp, tp), and under context parallelism at (pp, dp, tp, cp). Its data-parallel
group holds the ranks that share its pp and tp (the replicas of its shard, and under cp > 1 every
context slice of them too: gradients are reduced and ZeRO shards over dp x cp, as Megatron's do), its
context group those that differ in cp only (the other slices of its sequences), its tensor group those
that share pp, dp and cp (the other slices of its layer), its pipeline group those that share dp, cp and
tp (the other stages of its replica).

c10d requires every rank to call `new_group` for every group, in the same
order, even for groups it is not in; `make_groups` walks all groups of all
axes in one fixed order (axis dp, tp, pp; groups sorted by their ranks) on
every rank. `group_ranks` is that walk without torch.distributed.
Inside an initialised process group, on rank 2 of a dp 2 x tp 2 mesh (here torch's fake backend
stands in for the other three processes: it creates groups and runs no collective):

>>> mesh = [(0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 1, 0), (3, 0, 1, 1)]   # (rank, pp, dp, tp): dp 2 x tp 2
>>> group_ranks(mesh)
{'dp': [(0, 2), (1, 3)], 'tp': [(0, 1), (2, 3)], 'pp': [(0,), (1,), (2,), (3,)], 'cp': [(0,), (1,), (2,), (3,)]}
>>> group_ranks([(r, *c) for r, *c in grid(pp=1, dp=2, tp=1, cp=2)])['cp']   # (rank, pp, dp, tp, cp)
[(0, 1), (2, 3)]
>>> import torch.distributed as dist
>>> from torch.testing._internal.distributed.fake_pg import FakeStore
>>> dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
>>> g = make_groups(2, mesh)
>>> g.dp_ranks, g.tp_ranks, g.pp_ranks, g.pp
((0, 2), (2, 3), (2,), None)
>>> dist.destroy_process_group()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from cost_models.mesh import Mesh

__all__ = ["ProcessGroups", "Axis", "AXES", "NodeGroups", "grid", "nodes_of", "make_groups", "group_ranks",
           "make_group_among", "make_self_group", "make_node_groups", "node_split", "stage_peers", "group_size"]

Axis = Literal["dp", "tp", "pp", "cp"]
# cp last: with cp = 1 its groups are single ranks, created by no one, so plans without cp create the same
# groups in the same order as before the axis existed.
AXES: tuple[Axis, ...] = ("dp", "tp", "pp", "cp")
# The coordinates a group's members share: dp groups vary dp (and cp) only, and so on.
_SHARED = {"dp": ("pp", "tp"), "tp": ("pp", "dp", "cp"), "pp": ("dp", "tp", "cp"), "cp": ("pp", "dp", "tp")}
_COORDS = ("pp", "dp", "tp", "cp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessGroups:
    """This rank's groups, one per mesh axis.

    A group is None when this rank is alone on that axis (degree 1): skip the
    collective then, since c10d reads `group=None` as the *world* group. A group
    spanning every rank is `dist.group.WORLD` rather than a copy of it.
    `*_ranks` are the global ranks of each group in group-rank order (c10d
    orders a group's members by global rank), so `dp_ranks.index(rank)` is this
    rank's index in its dp group. coord: this rank's (pp, dp, tp) coordinates;
    cp_index its context slice (0 without context parallelism). Under cp > 1 the
    dp group holds dp x cp ranks (the gradient reduction's and ZeRO's group).
    """

    rank: int
    coord: tuple[int, int, int]
    dp: Any
    tp: Any
    pp: Any
    dp_ranks: tuple[int, ...]
    tp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    cp: Any = None
    cp_ranks: tuple[int, ...] = ()
    cp_index: int = 0

    def group(self, axis: Axis):
        return getattr(self, axis)

    def ranks(self, axis: Axis) -> tuple[int, ...]:
        return getattr(self, f"{axis}_ranks")


def group_ranks(mesh: Sequence[Any]) -> dict[Axis, list[tuple[int, ...]]]:
    """All groups of each axis as sorted rank tuples, in the order `make_groups` creates them.

    mesh: (rank, pp, dp, tp) or (rank, pp, dp, tp, cp) tuples or objects with those attributes (the
    plan's MeshCoord). Raises ValueError unless ranks are 0..n-1 once each and
    the coordinates form a full pp x dp x cp x tp grid.
    """
    coords = [_coord(m) for m in mesh]
    ranks = sorted(c[0] for c in coords)
    if ranks != list(range(len(coords))):
        raise ValueError(f"mesh ranks {ranks} are not 0..{len(coords) - 1} once each: "
                         "the mesh must list every rank of the world exactly once")
    degree = {a: len({c[1 + _COORDS.index(a)] for c in coords}) for a in _COORDS}
    points = {c[1:] for c in coords}
    if len(points) != len(coords) or degree["pp"] * degree["dp"] * degree["tp"] * degree["cp"] != len(coords):
        raise ValueError(f"mesh of {len(coords)} ranks is not a full pp x dp x cp x tp grid "
                         f"(pp {degree['pp']}, dp {degree['dp']}, cp {degree['cp']}, tp {degree['tp']}, "
                         f"{len(points)} distinct coordinates): two ranks share coordinates or some are missing")
    out: dict[Axis, list[tuple[int, ...]]] = {}
    for axis in AXES:
        lines: dict[tuple[int, ...], list[int]] = {}
        for r, *xyz in coords:
            key = tuple(xyz[_COORDS.index(a)] for a in _SHARED[axis])
            lines.setdefault(key, []).append(r)
        out[axis] = sorted(tuple(sorted(v)) for v in lines.values())
    return out


def make_groups(rank: int, mesh: Sequence[Any]) -> ProcessGroups:
    """Create every group of the mesh (a collective: all ranks call it) and return this rank's.

    Singleton groups are not created (every rank skips the same ones); a group of
    all ranks is the world group.
    """
    import torch.distributed as dist

    world = len(mesh)
    if dist.is_initialized() and dist.get_world_size() != world:
        raise ValueError(f"mesh has {world} ranks but the default process group has {dist.get_world_size()}: "
                         "launch as many processes as the plan's world size")
    mine = next((c for c in map(_coord, mesh) if c[0] == rank), None)
    if mine is None:
        raise ValueError(f"rank {rank} is not in the mesh (ranks 0..{world - 1})")
    fields: dict[str, Any] = {"rank": rank, "coord": mine[1:4], "cp_index": mine[4]}
    for axis, groups in group_ranks(mesh).items():
        for ranks in groups:
            if len(ranks) == 1:
                pg = None
            elif len(ranks) == world:
                pg = dist.group.WORLD
            else:
                pg = dist.new_group(list(ranks))
            if rank in ranks:
                fields[axis], fields[f"{axis}_ranks"] = pg, ranks
    return ProcessGroups(**fields)


def grid(pp: int, dp: int, tp: int, cp: int = 1) -> tuple[tuple[int, ...], ...]:
    """(rank, pp, dp, tp) of every rank of a pp x dp x tp mesh laid out as cost_models.mesh says, and
    (rank, pp, dp, tp, cp) under context parallelism: what a program's MESH is when its plan uses that
    layout (a formula, not a table of every rank).

    >>> grid(pp=1, dp=2, tp=2)
    ((0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 1, 0), (3, 0, 1, 1))
    >>> grid(pp=1, dp=1, tp=2, cp=2)
    ((0, 0, 0, 0, 0), (1, 0, 0, 1, 0), (2, 0, 0, 0, 1), (3, 0, 0, 1, 1))
    """
    mesh = Mesh(pp, dp, tp, cp)
    if cp == 1:
        return tuple((r, *mesh.coords(r)) for r in range(mesh.size))
    return tuple((r, *mesh.coords4(r)) for r in range(mesh.size))


def nodes_of(world: int, per_node: int) -> tuple[int, ...]:
    """Rank -> node when every node holds `per_node` consecutive ranks.

    >>> nodes_of(4, per_node=2)
    (0, 0, 1, 1)
    """
    return tuple(r // per_node for r in range(world))


def stage_peers(mesh: Sequence[Any], stages: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """For each (replica, tensor slice) of the mesh, its ranks at pipeline ranks `stages`, sorted: the groups
    over which a parameter held by those stages (a tied embedding and LM head) sums its gradient.

    >>> stage_peers(grid(pp=2, dp=2, tp=1), (0, 1))
    ((0, 2), (1, 3))
    """
    coords = [_coord(m) for m in mesh]
    by_coord = {(pp, dp, tp, cp): r for r, pp, dp, tp, cp in coords}
    dps, tps, cps = (sorted({c[i] for c in coords}) for i in (2, 3, 4))
    return tuple(sorted({tuple(sorted(by_coord[(p, d, t, c)] for p in stages)) for d in dps for t in tps
                         for c in cps}))


def _coord(m: Any) -> tuple[int, int, int, int, int]:
    """(rank, pp, dp, tp, cp) from a tuple (cp 0 when it has four entries) or an object with those attributes."""
    if hasattr(m, "rank"):
        return int(m.rank), int(m.pp), int(m.dp), int(m.tp), int(getattr(m, "cp", 0))
    rank, pp, dp, tp = m[:4]
    return int(rank), int(pp), int(dp), int(tp), int(m[4]) if len(m) > 4 else 0


def group_size(group) -> int:
    """Ranks in `group`: 1 for None (this rank alone on an axis, as ProcessGroups holds it; c10d would read
    None as the world), an in-process group's own count (runtime.verify.local_collectives.LocalGroup, where
    torch.distributed is not initialised), else c10d's."""
    if group is None:
        return 1
    local = getattr(group, "local_world_size", None)
    if local is not None:
        return local
    import torch.distributed as dist

    return dist.get_world_size(group)


def make_group_among(rank: int, groups: Sequence[Sequence[int]]):
    """Create every group of `groups` (a collective: all ranks call it with the same list, in the same
    order) and return the one holding `rank`: None when it holds none or only this rank.

    For groups outside the mesh axes, such as the first and last pipeline stages that hold a tied
    embedding and LM head (Megatron's embedding group)."""
    import torch.distributed as dist

    mine = None
    for ranks in groups:
        ranks = sorted(ranks)
        pg = None if len(ranks) == 1 else (dist.group.WORLD if len(ranks) == dist.get_world_size()
                                           else dist.new_group(ranks))
        if rank in ranks:
            mine = pg
    return mine


def make_self_group(rank: int, world: int):
    """A one-rank group per rank (all ranks create all, in order), for engines that need a real group
    when this rank has no data-parallel peers (c10d reads group=None as the world)."""
    import torch.distributed as dist

    mine = None
    for r in range(world):
        pg = dist.new_group([r])
        if r == rank:
            mine = pg
    return mine


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeGroups:
    """A data-parallel group that spans N nodes with k > 1 of its ranks on each, split in two for a
    hierarchical reduction: `intra` holds this rank's node's members, `cross` the members at this
    rank's local index on every node (global ranks in group order in the *_ranks fields)."""

    intra: Any
    intra_ranks: tuple[int, ...]
    cross: Any
    cross_ranks: tuple[int, ...]


def node_split(ranks: Sequence[int], node_of: Sequence[int]) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]] | None:
    """(per-node groups, per-local-index groups) of `ranks`, or None unless they span several nodes
    with the same number k > 1 on each (a ragged or one-per-node group reduces flat).

    >>> node_split((0, 1, 2, 3), node_of=(0, 0, 1, 1))
    ([(0, 1), (2, 3)], [(0, 2), (1, 3)])
    >>> node_split((0, 2), node_of=(0, 0, 1, 1)) is None
    True
    """
    by_node: dict[int, list[int]] = {}
    for r in sorted(ranks):
        by_node.setdefault(node_of[r], []).append(r)
    sizes = {len(v) for v in by_node.values()}
    if len(by_node) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    intra = [tuple(v) for _, v in sorted(by_node.items())]
    cross = [tuple(col) for col in zip(*intra)]
    return intra, cross


def make_node_groups(rank: int, dp_groups: Sequence[Sequence[int]], node_of: Sequence[int]) -> NodeGroups | None:
    """Create the intra- and cross-node groups of every data-parallel group that `node_split` splits (a
    collective: all ranks call it with the same arguments) and return this rank's, or None when its
    group is not split. `node_of[r]` is global rank r's node."""
    mine = None
    for ranks in dp_groups:
        split = node_split(ranks, node_of)
        if split is None:
            continue
        intra, cross = split
        ig = make_group_among(rank, intra)
        cg = make_group_among(rank, cross)
        if rank in ranks:
            mine = NodeGroups(intra=ig, intra_ranks=next(g for g in intra if rank in g),
                              cross=cg, cross_ranks=next(g for g in cross if rank in g))
    return mine
