"""The device mesh: which rank is which (pipeline stage, data-parallel replica, context slice, tensor slice).

rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index, axes from outer to inner
pp, dp, cp, tp. Why this order: the tensor group talks most (collectives inside every layer, on the
critical path) so it is innermost, consecutive ranks inside a node on the fastest links; the context
group comes next (a ring attention sends key/value blocks to its neighbour in every attention layer,
a Ulysses all-to-all runs four times per layer), so ring neighbours sit tp ranks apart, inside a node
where tp * cp fits in one; data-parallel replicas reduce gradients once per step and pipeline
neighbours send one activation per microbatch, so they are furthest apart (across nodes). Megatron-Core
orders its groups the same way (tp, cp, dp, pp from inner to outer). The data-parallel gradient reduction
and ZeRO's sharding run over dp x cp ranks (`replica_ranks`): a context slice holds the same parameters
as its replica, and its gradients are one part of the batch's. The planner lays plans out by this
formula and costs their groups' links by it; a plan stores every rank's coordinates, which the code
generator and runtime read, so this formula is written here only.

>>> m = Mesh(pp=2, dp=2, tp=2)
>>> m.coords(5), m.rank(1, 0, 1), m.tp_ranks(pp=1, dp=1), m.dp_ranks(pp=1), m.pp_ranks(dp=1, tp=1)
((1, 0, 1), 5, (6, 7), (4, 6), (3, 7))
>>> m.formula()
'rank = pp*4 + dp*2 + tp'
>>> c = Mesh(pp=2, dp=2, tp=2, cp=2)
>>> c.coords4(14), c.rank(1, 1, 0, cp=1), c.cp_ranks(pp=1, dp=1), c.replica_ranks(pp=1, tp=1)
((1, 1, 0, 1), 14, (12, 14), (9, 11, 13, 15))
>>> c.formula()
'rank = pp*8 + dp*4 + cp*2 + tp'
"""

from __future__ import annotations

import dataclasses

__all__ = ["Mesh"]


@dataclasses.dataclass(frozen=True)
class Mesh:
    pp: int
    dp: int
    tp: int
    cp: int = 1

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a rank (its cp index: `coords4`)."""
        pp, dp, tp, _ = self.coords4(rank)
        return pp, dp, tp

    def coords4(self, rank: int) -> tuple[int, int, int, int]:
        """(pp, dp, tp, cp) of a rank."""
        inner = self.dp * self.cp * self.tp
        return rank // inner, (rank // (self.cp * self.tp)) % self.dp, rank % self.tp, (rank // self.tp) % self.cp

    # the ranks of a group are an arithmetic run (the planner asks for them in its inner loop)
    def tp_ranks(self, pp: int = 0, dp: int = 0, cp: int = 0) -> tuple[int, ...]:
        first = self.rank(pp, dp, 0, cp)
        return tuple(range(first, first + self.tp))

    def cp_ranks(self, pp: int = 0, dp: int = 0, tp: int = 0) -> tuple[int, ...]:
        """A context group, in ring order: ring neighbours are tp ranks apart."""
        first = self.rank(pp, dp, tp, 0)
        return tuple(range(first, first + self.cp * self.tp, self.tp))

    def dp_ranks(self, pp: int = 0, tp: int = 0, cp: int = 0) -> tuple[int, ...]:
        first = self.rank(pp, 0, tp, cp)
        return tuple(range(first, first + self.dp * self.cp * self.tp, self.cp * self.tp))

    def replica_ranks(self, pp: int = 0, tp: int = 0) -> tuple[int, ...]:
        """The dp x cp ranks that reduce gradients together and share ZeRO's shards (dp_ranks when cp = 1)."""
        first = self.rank(pp, 0, tp, 0)
        return tuple(range(first, first + self.dp * self.cp * self.tp, self.tp))

    def pp_ranks(self, dp: int = 0, tp: int = 0, cp: int = 0) -> tuple[int, ...]:
        return tuple(range(self.rank(0, dp, tp, cp), self.size, self.dp * self.cp * self.tp))

    def formula(self) -> str:
        if self.cp == 1:
            return f"rank = pp*{self.dp * self.tp} + dp*{self.tp} + tp"
        return f"rank = pp*{self.dp * self.cp * self.tp} + dp*{self.cp * self.tp} + cp*{self.tp} + tp"
