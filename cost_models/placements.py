"""How a parameter lies over its tensor group: `Shard(dim)` or `Replicate()`, as DTensor says it.

Their text form, "S(d)" and "R", is what a plan (and its JSON) stores and what generated programs pass
to the runtime; `parse` reads it back. The planner writes placements, the code generator and the runtime
read them: all through this module, so the spelling is decided once.

>>> parse("S(1)"), str(Shard(0)), parse("R") == Replicate()
(Shard(dim=1), 'S(0)', True)
>>> sharded_dim("S(2)"), sharded_dim("R"), is_sharded("R")
(2, None, False)
"""

from __future__ import annotations

import dataclasses
import re

from cost_models.errors import PartitionerError

__all__ = ["Shard", "Replicate", "REPLICATED", "parse", "sharded_dim", "is_sharded"]


@dataclasses.dataclass(frozen=True)
class Shard:
    """Split along tensor dim `dim`: tensor slice t holds the t-th of tp equal pieces (of each fused chunk)."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Every tensor slice holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


REPLICATED = str(Replicate())
_TEXT = re.compile(r"R|S\(([0-9]+)\)")


def parse(text: str) -> Shard | Replicate:
    """The placement a text form names; PartitionerError (a ValueError) for anything else."""
    m = _TEXT.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise PartitionerError(f"placement spec {text!r} is neither 'R' (replicated) nor 'S(d)' (sharded on "
                               "tensor dim d), e.g. 'S(0)' for a column-parallel nn.Linear weight")
    return Replicate() if m.group(1) is None else Shard(int(m.group(1)))


def sharded_dim(text: str) -> int | None:
    """The dim a spec shards, None when replicated."""
    p = parse(text)
    return p.dim if isinstance(p, Shard) else None


def is_sharded(text: str) -> bool:
    return sharded_dim(text) is not None
