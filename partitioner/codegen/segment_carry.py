"""What crosses the cuts between a layer stack's blocks, where it is more than the hidden state.

Most stacks hand one tensor from block to block. Some hand more:

- Zamba's hybrid layers read the input embeddings again, so a value of the prefix crosses every cut up to
  its last reader;
- HunYuan v4's attention layers (and GLM-5's, with shared indexers) hand their top-k key indices to the
  layers after them, which reuse them instead of running an indexer of their own.

Such a stack runs as a state of named values that the blocks read and write: the hidden state "x", and
"x_1", "x_2", ... (`runtime.pipeline.stage` keeps it; a pipeline cut sends all of it). Each value that
crosses a traced cut takes a slot:

- a value of the prefix that is read past the first block: a slot of its own, which nothing writes again;
- any other: the slot of its dtype and shape, so that a block's new hidden state takes the previous one's
  slot, and a full indexer layer's top-k indices the slot of the last such layer's.

Two values of one dtype and shape that cross one cut (two residual streams) cannot be told apart so, and
are refused, as is a stack where no one slot crosses every cut (the hidden state). Every traced block of
a kind must read and write the same slots, and over the whole stack, in the order of its block kinds,
each slot a block reads must have been written before it: else refused. A slot nothing has written yet
crosses as None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from partitioner.planner.model_code import SegmentError

__all__ = ["Carry", "carry"]

Slot = tuple[fx.Node, str]  # a value of the traced graph, and the name of the slot it crosses in


@dataclasses.dataclass(frozen=True)
class Carry:
    """The slots of a stack that hands more than one value across its cuts."""

    prefix_writes: tuple[Slot, ...]  # what the prefix returns, the hidden state first
    reads: dict[int, tuple[Slot, ...]]  # per traced block: what it reads across its cut, the hidden state first
    writes: dict[int, tuple[Slot, ...]]  # per traced block: what it returns, the hidden state first
    suffix_reads: tuple[Slot, ...]

    def side_names(self) -> str:
        """The values besides the hidden state that cross the cuts, for a message: "x_1 (embedding), ..."."""
        named = {n: v.name for slots in (self.prefix_writes, *self.writes.values()) for v, n in slots if n != "x"}
        return ", ".join(f"{n} ({named[n]})" for n in sorted(named))

    def check_token_split(self, seq_dims: dict[str, int], cut_dim: int) -> None:
        """Under sequence parallelism (partitioner.planner.sequence_split): each value besides the hidden state
        crosses its cuts as the values of its slot all are, split along the cut's token dim or whole, so every
        reader holds it as its writer made it; refused otherwise."""
        dims: dict[str, dict[str, int | None]] = {}
        for slots in (self.prefix_writes, *self.reads.values(), *self.writes.values(), self.suffix_reads):
            for v, n in slots:
                if n != "x":
                    dims.setdefault(n, {})[v.name] = seq_dims.get(v.name)
        for n, by_value in sorted(dims.items()):
            if len(set(by_value.values())) > 1 or set(by_value.values()) - {None, cut_dim}:
                split = ", ".join(f"{v}: {'whole' if d is None else f'dim {d}'}" for v, d in sorted(by_value.items()))
                raise SegmentError(f"sequence parallelism: {n}, a value besides the hidden state that crosses the "
                                   f"cuts, is split along the tokens in some places and not in others ({split}); "
                                   "pin sp=False")

    def hidden(self, block: int | str) -> tuple[fx.Node, fx.Node]:
        """(the hidden state a traced block, or the suffix, reads; the one it returns: None for the suffix)."""
        if block == "suffix":
            return self.suffix_reads[0][0], None
        return self.reads[block][0][0], self.writes[block][0][0]


def carry(src: Any, blocks: Sequence[int], kinds: Sequence[int], routers: Callable[[set], set],
          stack: str) -> Carry | None:
    """The slots of the values crossing the cuts of `src` (partitioner.codegen.segments._Source) between its
    prefix, traced `blocks` and suffix; `kinds`: the kind of every block of the whole stack (() when all are
    alike), `routers`: the router logits among a set of values (they reach the suffix another way). None
    where one value crosses each cut (then the hidden state alone is handed on); raises SegmentError where
    the values crossing cannot be told apart or a block would read a value before one is written."""
    order: list[Any] = ["prefix", *blocks, "suffix"]
    pos = {seg: i for i, seg in enumerate(order)}
    members = {seg: src.members(seg) for seg in order}
    where = {n: i for i, n in enumerate(src.gm.graph.nodes)}
    if members["suffix"] and min(map(where.get, members["suffix"])) < max(map(where.get, members[blocks[-1]])):
        return None  # ops outside the blocks between them (a residual add in the root's forward): no stack to cut
    live: list[list[fx.Node]] = []  # per cut c (after order[c]): what is made before it and read after it
    for c in range(len(order) - 1):
        made = [m for seg in order[:c + 1] for m in members[seg] if m not in src.input_only]
        crossing = [m for m in made if any(u.op == "output" or pos.get(src.segment.get(u), -1) > c for u in m.users)]
        live.append([m for m in crossing if m not in routers(set(crossing))])
    returned = any(u.op == "output" for values in live for v in values for u in v.users)
    if not live[0] or all(len(values) == 1 for values in live) or returned:
        return None  # one value crosses each cut, or the model returns a value from inside its blocks (refused)
    passing = {v for values in live[1:] for v in values if src.segment[v] == "prefix"}

    def key(v: fx.Node) -> Any:
        if v in passing:
            return ("prefix", v.name)
        val = v.meta.get("val")
        return ("stream", str(getattr(val, "dtype", type(val))), tuple(str(d) for d in getattr(val, "shape", ())))

    keyed: list[dict[Any, fx.Node]] = []
    for c, values in enumerate(live):
        at: dict[Any, fx.Node] = {}
        for v in values:
            if key(v) in at:
                raise SegmentError(f"{at[key(v)].name} and {v.name} cross the cut after {_where(order[c], stack)} "
                                   f"as values of one dtype and shape ({key(v)[1]}, {list(key(v)[2])}): a pipeline "
                                   "cut cannot tell which of them the next block reads as which (two residual "
                                   "streams, or a layer applied in a loop)")
            at[key(v)] = v
        keyed.append(at)
    hidden = [k for k in keyed[0] if k[0] == "stream" and all(k in at for at in keyed)]
    if len(hidden) != 1:
        raise SegmentError(f"no one value crosses every cut of {stack} as its hidden state (the prefix hands on "
                           f"{sorted(v.name for v in live[0])}, the last block {sorted(v.name for v in live[-1])})")
    names = {hidden[0]: "x"}
    for at in keyed:
        for k in at:
            names.setdefault(k, f"x_{len(names)}")

    def slots(values: Sequence[fx.Node], at: dict[Any, fx.Node]) -> tuple[Slot, ...]:
        got = [(v, names[key(v)]) for v in values if at.get(key(v)) is v]
        return tuple(sorted(got, key=lambda s: _order(s[1])))

    reads: dict[int, tuple[Slot, ...]] = {}
    writes: dict[int, tuple[Slot, ...]] = {}
    for b in blocks:
        c = pos[b]
        inside = set(members[b])
        read = {a for m in members[b] for a in m.all_input_nodes if a not in inside and a in set(live[c - 1])}
        reads[b] = slots(read, keyed[c - 1])
        writes[b] = slots([v for v in live[c] if src.segment[v] == b], keyed[c])
        for what, got in (("read", reads[b]), ("hand on", writes[b])):
            if not got or got[0][1] != "x":
                raise SegmentError(f"block {b} of {stack} does not {what} the hidden state that crosses every cut "
                                   f"(it reads {[v.name for v, _ in reads[b]]}, hands on "
                                   f"{[v.name for v, _ in writes[b]]})")
    inside = set(members["suffix"])
    last = len(order) - 2
    read = {a for m in members["suffix"] for a in m.all_input_nodes if a not in inside and a in set(live[last])}
    suffix = slots(read, keyed[last])
    out = Carry(prefix_writes=slots(live[0], keyed[0]), reads=reads, writes=writes, suffix_reads=suffix)
    _check_order(out, blocks, kinds, stack)
    return out


def _check_order(c: Carry, blocks: Sequence[int], kinds: Sequence[int], stack: str) -> None:
    """Every traced block of a kind reads and writes the same slots; over the whole stack each slot a block (and
    the suffix) reads has been written before it."""
    kind_of = (lambda i: kinds[i]) if kinds else (lambda i: 0)
    names = lambda got: tuple(n for _, n in got)  # noqa: E731
    by_kind: dict[int, tuple[int, tuple, tuple]] = {}
    for b in blocks:
        seen = by_kind.setdefault(kind_of(b), (b, names(c.reads[b]), names(c.writes[b])))
        if seen[1:] != (names(c.reads[b]), names(c.writes[b])):
            raise SegmentError(f"blocks {seen[0]} and {b} of {stack} are of one kind but take {seen[1]} and "
                               f"{names(c.reads[b])}, hand on {seen[2]} and {names(c.writes[b])} across their cuts: "
                               "one function cannot run both")
    written = set(names(c.prefix_writes))
    for i in range(len(kinds) if kinds else max(blocks) + 1):
        if kind_of(i) not in by_kind:
            continue  # no traced block of this kind: extract refuses it
        _, read, write = by_kind[kind_of(i)]
        missing = [n for n in read if n not in written]
        if missing:
            raise SegmentError(f"block {i} of {stack} reads {missing}, which no block before it hands on")
        written |= set(write)
    missing = [n for n in names(c.suffix_reads) if n not in written]
    if missing:
        raise SegmentError(f"the suffix after {stack} reads {missing}, which no block hands on")


def _order(name: str) -> int:
    """x first, then x_1, x_2, ..., x_10 by number."""
    return 0 if name == "x" else int(name.rpartition("_")[2])


def _where(seg: Any, stack: str) -> str:
    return "the prefix" if seg == "prefix" else f"block {seg} of {stack}"
