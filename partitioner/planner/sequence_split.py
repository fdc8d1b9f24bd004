"""Megatron sequence parallelism, found from the graph's dataflow: `find_sequence_splits(...) -> SequenceSplits`.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4.2.2): outside the tensor-parallel regions a
transformer layer runs ops that act on each token alone (layer norms,
dropouts, residual adds), so each rank of the tensor group can run them on
1/tp of the tokens. The all-reduce after a row-parallel matmul becomes a
reduce-scatter along the token dim, and the input of the next column-parallel
matmul is all-gathered along it: the same bytes, activations divided by tp.

The sequence-split region starts where a tensor-parallel all-reduce was
(row-parallel outputs, the vocab-parallel embedding's output) and is
followed forward with the same shard-local rules as the tensor splits
(`tensor_split._rule`), the token dim taking the place of the features:

- a tensor-split op (a column-parallel matmul, anything inside a region)
  reading a sequence-split value reads it all-gathered; the gradient is
  reduce-scattered back, since each rank's is a partial sum ("tp" gather);
- a replicated value meeting a sequence-split one (the position embedding,
  a residual made before the first split) is read by chunk along the token
  dim; its gradient is all-gathered, whole on every rank as it was;
- a replicated parameter applied to sequence-split values (a layer norm's
  weight) sees 1/tp of the tokens: its gradient is summed over the group,
  as Megatron does for the layer norms under sequence parallelism;
- a replicated value broadcast over the split dim (a per-row mean over the tokens, a conditioning vector
  (b, 1, h) added to every token) is read whole by each rank, which computes its gradient from its own
  tokens alone: that partial gradient is summed over the group (Megatron's f, `tp_copy`: identity forward,
  all-reduce backward; "reduces");
- an op that is not token-local (a loss over every token, an attention
  that is not tensor-split, a reshape merging tokens across the split) reads
  the value all-gathered; the gradient is this rank's slice of the
  replicated op's ("rep" gather), and so is a model output.

Every op is thus either tensor-split, sequence-split, or replicated with
its inputs whole, so the program computes what one process does. The token
dim of a tensor is the first dim holding the sequence length s (the first
dim when none does: then the rows are split). tp must divide its extent.

>>> from partitioner import trace
>>> from partitioner.planner.tensor_split import find_splits
>>> from examples.gpt import gpt_small, example_batch
>>> model = gpt_small()
>>> seq = find_splits(trace(model, example_batch(model, 2))).sequence
>>> len(seq.scatters), sorted({k for *_, k in seq.gathers})   # the embedding and 2 rows a block; gathers by matmuls
(9, ['tp'])
>>> seq.chunks                                                 # the position embedding, cut to this rank's tokens
(('add', 'embedding_1', 0),)
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from partitioner.planner.shard_dims import _CROSS_ENTROPY, _FIRST_ONLY, _NEW, _RESHAPES
from partitioner.planner.shard_rule import _Context, _rule, _Shard
from partitioner.tracer.opgraph import OpNode
from partitioner.tracer.symbolic import Poly

__all__ = ["SequenceSplits", "find_sequence_splits", "token_dim"]

Gather = Literal["tp", "rep"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceSplits:
    """Where the tokens are split under sequence parallelism, independent of the degree tp.

    dims: (node, dim) for every node whose output is split along its token dim `dim`.
    scatters: (node, dim): tensor-parallel all-reduces that become reduce-scatters along `dim`
        (row-parallel outputs, the vocab-parallel embedding's).
    gathers: (node, operand, dim, kind): `node` reads sequence-split `operand` all-gathered along
        `dim`; kind "tp" (a tensor-split reader: the gradient is reduce-scattered) or "rep" (a
        replicated reader: the gradient is this rank's slice).
    chunks: (node, operand, dim): `node` reads this rank's chunk of replicated `operand` along
        `dim` (its gradient all-gathered).
    extents: the token dims' extents (Poly in b, s) tp must divide.
    param_grads: (node, param bytes): replicated parameters applied to sequence-split values,
        their gradients summed over the tensor group.
    reduces: (node, operand): `node` reads replicated `operand`, which needs a gradient, broadcast over the
        split dim: its gradient, summed over this rank's tokens only, is summed over the tensor group.
    """

    dims: tuple[tuple[str, int], ...] = ()
    scatters: tuple[tuple[str, int], ...] = ()
    gathers: tuple[tuple[str, str, int, Gather], ...] = ()
    chunks: tuple[tuple[str, str, int], ...] = ()
    extents: tuple[Poly, ...] = ()
    param_grads: tuple[tuple[str, int], ...] = ()
    reduces: tuple[tuple[str, str], ...] = ()

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(n for n, _ in self.dims)

    def divides(self, tp: int, microbatch: int, seq_len: int) -> str:
        """"" when tp divides every token dim at this microbatch and sequence length, else why not."""
        for e in self.extents:
            x = round(e(microbatch, seq_len))
            if x % tp and not any(s > 0 for (_, s), _ in e.terms):  # token_dim's fallback: no dim holds s
                return (f"sequence parallelism splits a value whose dims before its features hold no sequence "
                        f"length (its tokens last, as a convolution over them keeps them) along dim 0, {x} (= {e} at "
                        f"microbatch {microbatch}), over tp={tp}, which does not divide it: pick a microbatch size "
                        f"that tp divides, or pin sp=False")
            if x % tp:
                return (f"sequence parallelism splits a token dim of {x} (= {e} at microbatch {microbatch}, "
                        f"sequence {seq_len}) over tp={tp}, which does not divide it: pick a sequence length "
                        f"that tp divides, or pin sp=False")
        return ""

    def to_json(self) -> dict:
        return {"dims": [list(d) for d in self.dims], "scatters": [list(d) for d in self.scatters],
                "gathers": [list(g) for g in self.gathers], "chunks": [list(c) for c in self.chunks],
                "extents": [e.to_json() for e in self.extents],
                "param_grads": [list(p) for p in self.param_grads],
                **({"reduces": [list(r) for r in self.reduces]} if self.reduces else {})}

    @staticmethod
    def from_json(data: dict) -> SequenceSplits:
        return SequenceSplits(dims=tuple((str(n), int(d)) for n, d in data["dims"]),
                              scatters=tuple((str(n), int(d)) for n, d in data["scatters"]),
                              gathers=tuple((str(n), str(x), int(d), k) for n, x, d, k in data["gathers"]),
                              chunks=tuple((str(n), str(x), int(d)) for n, x, d in data["chunks"]),
                              extents=tuple(Poly.from_json(e) for e in data["extents"]),
                              param_grads=tuple((str(n), int(b)) for n, b in data["param_grads"]),
                              reduces=tuple((str(n), str(x)) for n, x in data.get("reduces", ())))


def token_dim(shape: tuple[Poly, ...]) -> int:
    """The dim a sequence split cuts: the first (before the features) whose extent holds s, else 0."""
    for j, x in enumerate(shape[:-1]):
        if any(s > 0 for (_, s), _ in x.terms):
            return j
    return 0


def find_sequence_splits(ctx: _Context, sharded: frozenset[str], rows: frozenset[str],
                         vocab_embeddings: frozenset[str]) -> SequenceSplits:
    """Follow the token split from every row-parallel output and vocab-parallel embedding.

    `ctx`: the graph as the split passes read it; `sharded`: the tensor-split nodes (rows included).
    """
    state: dict[str, _Shard] = {}
    dims: list[tuple[str, int]] = []
    scatters: list[tuple[str, int]] = []
    gathers: dict[tuple[str, str], tuple[str, str, int, Gather]] = {}
    chunks: list[tuple[str, str, int]] = []
    extents: dict[Poly, None] = {}
    param_grads: list[tuple[str, int]] = []
    reduces: list[tuple[str, str]] = []
    pbytes = {p.name: p.nbytes for p in ctx.g.params}

    def split(n: OpNode, d: int) -> None:
        state[n.name] = _Shard(0, d, 0, frozenset())
        dims.append((n.name, d))
        extents[n.output.shape[d]] = None

    def gather_inputs(n: OpNode, kind: Gather) -> None:
        for i in dict.fromkeys(n.inputs):
            if i in state:
                gathers.setdefault((n.name, i), (n.name, i, state[i].dim, kind))

    for n in ctx.g.nodes:
        if n.output is None:
            continue
        if n.name in rows or n.name in vocab_embeddings:
            # a row's input is tensor-split, not sequence-split: nothing of it to gather
            gather_inputs(n, "tp")
            if len(n.output.shape) >= 2:
                d = token_dim(n.output.shape)
                scatters.append((n.name, d))
                split(n, d)
                w = ctx.weighted.get(n.name)  # a row's bias is added after the reduce-scatter, to 1/tp of the tokens
                param_grads.extend((n.name, pbytes[b]) for b in (w.bias if w is not None and n.name in rows else ()))
            continue
        if not any(i in state for i in n.inputs):
            continue
        if n.name in sharded:
            gather_inputs(n, "tp")
            continue
        w = ctx.weighted.get(n.name)
        if w is not None:  # a replicated matmul over the features: token-local unless the tokens are contracted
            s = state.get(w.act)
            if s is not None and s.dim < len(ctx.shape(w.act)) - 1:
                split(n, s.dim + len(n.output.shape) - len(ctx.shape(w.act)))
                param_grads.extend((n.name, pbytes[p]) for p in n.params)
                continue
            gather_inputs(n, "rep")
            continue
        if n.op in _NEW:
            continue
        ish = ctx.shape(n.inputs[0]) if n.inputs else None
        if n.op in _RESHAPES and n.inputs[0] in state and ish == n.output.shape:  # a view to the same shape
            split(n, state[n.inputs[0]].dim)
            continue
        step = "is a loss over every token" if n.op in _CROSS_ENTROPY else _rule(ctx, n, state, chunk_any=True)
        if isinstance(step, str) or step.sink or step.attention:
            gather_inputs(n, "rep")
            continue
        if step.dim is None:
            continue
        split(n, step.dim)
        chunks.extend((n.name, i, k) for i, k in step.chunks)
        param_grads.extend((n.name, pbytes[p]) for p in n.params)
        chunked = {i for i, _ in step.chunks}
        read = n.inputs[:1] if n.op in _FIRST_ONLY else n.inputs  # the others give a dtype or shape
        reduces.extend((n.name, i) for i in dict.fromkeys(read) if i not in state and i not in chunked
                       and getattr(ctx.node.get(i), "requires_grad", False))

    return SequenceSplits(dims=tuple(dims), scatters=tuple(scatters), gathers=tuple(gathers.values()),
                          chunks=tuple(chunks), extents=tuple(extents),
                          param_grads=tuple(param_grads), reduces=tuple(reduces))
