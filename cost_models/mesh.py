"""The device mesh: which rank is which (pipeline stage, data-parallel replica, tensor slice).

rank = pp_index * (dp * tp) + dp_index * tp + tp_index: a tensor group is consecutive ranks (inside a
node, on the fastest links), pipeline neighbours are furthest apart (across nodes). The planner lays
plans out by it and costs their groups' links by it; a plan stores every rank's coordinates, which the
code generator and runtime read, so this formula is written here only.

>>> m = Mesh(pp=2, dp=2, tp=2)
>>> m.coords(5), m.rank(1, 0, 1), m.tp_ranks(pp=1, dp=1), m.dp_ranks(pp=1), m.pp_ranks(dp=1, tp=1)
((1, 0, 1), 5, (6, 7), (4, 6), (3, 7))
>>> m.formula()
'rank = pp*4 + dp*2 + tp'
"""

from __future__ import annotations

import dataclasses

__all__ = ["Mesh"]


@dataclasses.dataclass(frozen=True)
class Mesh:
    pp: int
    dp: int
    tp: int

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.tp

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    # the ranks of a group are an arithmetic run (the planner asks for them in its inner loop)
    def tp_ranks(self, pp: int = 0, dp: int = 0) -> tuple[int, ...]:
        first = self.rank(pp, dp, 0)
        return tuple(range(first, first + self.tp))

    def dp_ranks(self, pp: int = 0, tp: int = 0) -> tuple[int, ...]:
        first = self.rank(pp, 0, tp)
        return tuple(range(first, first + self.dp * self.tp, self.tp))

    def pp_ranks(self, dp: int = 0, tp: int = 0) -> tuple[int, ...]:
        return tuple(range(self.rank(0, dp, tp), self.size, self.dp * self.tp))

    def formula(self) -> str:
        return f"rank = pp*{self.dp * self.tp} + dp*{self.tp} + tp"
