"""Ops a layer loop runs between its blocks for one block alone: they run in that block.

A loop over the layers may do a little work of its own for each layer before calling it. Gemma 4 slices
each layer's input out of a tensor the prefix made, `per_layer_inputs[:, :, i, :]`, in the root's loop. In the exported graph those ops sit at the stack's level between the blocks, so no block held
them and the stack could not be cut. Such ops (the first block's too, which export puts in the prefix) now run
in the block they feed, and that block reads the prefix's tensor across its cuts instead
(`partitioner.codegen.segment_carry`: a prefix value read past the first block).

One function runs every block of a kind, so what a block takes this way must be every block's. The ops of
each traced block are compared: the same ops, on the same outside values, with each integer argument either
one number for all blocks or the block's own index (the loop's `i`), which the block function then takes as
its argument `block_index`. Anything else is refused, as is such work where the trace holds one block only
(nothing shows what another block's would be).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Mapping, Sequence
from typing import Any

from torch import fx

from partitioner.planner.model_code import SegmentError, describe

__all__ = ["Glue", "find_glue"]


@dataclasses.dataclass(frozen=True)
class Glue:
    """owner: each op between the blocks and the block it runs in; indexed: per such op, the positions of its
    arguments that take the block's index."""

    owner: Mapping[fx.Node, int]
    indexed: Mapping[fx.Node, tuple[int, ...]]


NONE = Glue({}, {})


def find_glue(nodes: Sequence[fx.Node], segment: Mapping[fx.Node, Any], recomputed: Container[fx.Node],
              num_blocks: int, stack: str) -> Glue:
    """The ops between the traced blocks of `stack` (in `nodes`, the graph's order; `segment`: "prefix", a block
    index or "suffix" per op) that feed one block alone and read no block's value, and the block each runs in;
    `num_blocks`: the blocks of the whole stack. Not values each reader computes again from the model's inputs
    (`recomputed`: segments._Source.input_only), which cross no cut. Raises SegmentError where the blocks' ops
    differ."""
    pos = {n: i for i, n in enumerate(nodes)}
    blocks = sorted({s for s in segment.values() if isinstance(s, int)})
    if not blocks:
        return NONE
    end = max(pos[n] for n, s in segment.items() if s == blocks[-1])
    owner: dict[fx.Node, int] = {}
    for n in reversed(nodes):  # users first: a chain of such ops joins its block from the block back
        if segment.get(n) != "suffix" or pos[n] > end or n in recomputed:
            continue
        users = {owner.get(u, segment.get(u)) for u in n.users}
        if len(users) == 1 and isinstance(b := next(iter(users)), int) and \
                not any(isinstance(segment.get(a), int) for a in n.all_input_nodes):
            owner[n] = b
    if not owner:
        return NONE
    chains = {b: [n for n in nodes if owner.get(n) == b] for b in sorted(set(owner.values()))}
    first = _first_block_chain(chains[min(chains)], blocks[0], segment) if blocks[0] not in chains else None
    if first:
        chains = {blocks[0]: first, **chains}
        owner.update({n: blocks[0] for n in first})
    missing = [b for b in blocks if b not in chains]
    if missing:
        b = min(chains)
        raise SegmentError(f"the loop over {stack} runs ops of its own for block {b} ({describe(chains[b][-1])}) and "
                           f"for {len(chains) - 1} more, but not alike for block(s) {missing}: one function runs "
                           "every block, so a pipeline or tensor-parallel plan cannot hold them; pin pp=1, tp=1")
    if len(chains) < 2 and num_blocks > 1:
        b = blocks[0]
        raise SegmentError(f"the loop over {stack} runs ops of its own for block {b} ({describe(chains[b][-1])}), "
                           "and the trace holds no other block to show what they are for the rest; trace the model "
                           "with at least two of its blocks")
    return Glue(owner, _indexed(chains, stack))


def _first_block_chain(ref: list[fx.Node], first: int, segment: Mapping[fx.Node, Any]) -> list[fx.Node] | None:
    """The prefix's ops that do for block `first` what `ref` does for a later block (export puts the loop's work
    before the first block among the prefix's ops): matched op by op on the same outside values, reading and
    read by nothing else. None where there are none."""
    match: dict[fx.Node, fx.Node] = {}
    for r in ref:
        args = [match.get(a, a) if isinstance(a, fx.Node) else a for a in r.args]
        anchor = next((a for a in args if isinstance(a, fx.Node)), None)
        if anchor is None:
            return None
        found = [u for u in anchor.users if segment.get(u) == "prefix" and u.target == r.target and
                 len(u.args) == len(args) and u.kwargs == r.kwargs and
                 all(x is y if isinstance(y, fx.Node) else _alike(x, y) for x, y in zip(u.args, args))]
        if len(found) != 1:
            return None
        match[r] = found[0]
    mine = set(match.values())
    for r, n in match.items():
        readers = {segment.get(u) if u not in mine else first for u in n.users}
        if readers != {first}:
            return None
    return [match[r] for r in ref]


def _alike(x: Any, y: Any) -> bool:
    """Arguments that may stand in one op of two blocks' work: equal, or both integers (maybe the index)."""
    return x == y or (_is_int(x) and _is_int(y))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _indexed(chains: Mapping[int, list[fx.Node]], stack: str) -> dict[fx.Node, tuple[int, ...]]:
    """Per op of the blocks' work, the positions of its integer arguments that are each block's own index;
    SegmentError where the blocks' work differs in any other way."""
    (b0, ref), *rest = chains.items()
    where = {n: j for j, n in enumerate(ref)}

    def form(chain: list[fx.Node]) -> list[tuple]:
        at = {n: j for j, n in enumerate(chain)}
        return [(n.target, tuple(("op", at[a]) if a in at else ("in", a) if isinstance(a, fx.Node) else
                                 "int" if _is_int(a) else ("is", a) for a in n.args), tuple(n.kwargs.items()))
                for n in chain]

    for b, chain in rest:
        if form(chain) != form(ref):
            raise SegmentError(f"the loop over {stack} runs ops of its own for each block, but block {b}'s "
                               f"({', '.join(n.name for n in chain)}) are not block {b0}'s "
                               f"({', '.join(n.name for n in ref)}): one function runs every block; pin pp=1, tp=1")
    out: dict[fx.Node, tuple[int, ...]] = {}
    for n in ref:
        positions = []
        for k, a in enumerate(n.args):
            if not _is_int(a):
                continue
            values = {b: chain[where[n]].args[k] for b, chain in chains.items()}
            if all(v == b for b, v in values.items()):
                positions.append(k)
            elif len(set(values.values())) > 1:
                raise SegmentError(f"the loop over {stack} runs {describe(n)} for each block with argument {k} "
                                   f"{values[b0]} for block {b0} and {sorted(values.items())} in all: neither one "
                                   "number nor the block's index, which one function for every block cannot hold; "
                                   "pin pp=1, tp=1")
        if positions:
            for chain in chains.values():
                out[chain[where[n]]] = tuple(positions)
    return out
