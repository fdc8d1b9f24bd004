"""Megatron tensor-parallel splits, found from the graph's dataflow: `find_splits(g) -> TensorSplits`.

The rules are those of Megatron-LM (Shoeybi et al. 2019, "Megatron-LM:
Training Multi-Billion Parameter Language Models Using Model Parallelism",
section 3), discovered from what flows where, never from module names:

Column then row. A parameterised matmul-like node A (`linear`, `addmm` or
`mm`/`matmul` with a parameter weight) whose input is replicated can split
its output features across the tensor group ("column-parallel", weight
S(0) for nn.Linear's [out, in], S(1) for HF Conv1D's [in, out]). Its output
is then followed forward through *shard-local* ops, those that compute
each output element from the same split features of their inputs, so each
rank can run them on its slice alone:

- elementwise ops, activations, dropout, casts and copies: per element;
- a product or sum of two tensors both split the same way (SwiGLU
  `silu(gate) * up`, rotary `q*cos + rotate_half(q)*sin`): per element;
  one split and one replicated is shard-local only if the replicated one
  broadcasts along the split dim (a causal mask (1, 1, s, s), rotary
  cos/sin (1, 1, s, hs)), or needs no gradient: then each rank reads its
  own chunk of it along the split dim (an ALiBi bias or a mask with a heads
  dim, (b, nh, s, s): `tp_chunk`, no communication); one that spans it and
  needs a gradient (a residual) breaks the pattern;
- views, reshapes, transposes, slices, split/getitem, cat, expand that keep
  the split dim whole: they only rename dims. Reshaping features F into
  (nh, hs) moves the split onto the head dim (F/tp features are nh/tp whole
  heads iff tp divides nh: a recorded divisor). Splitting F itself into
  chunks (a fused qkv) is shard-local only if each rank's slice holds its
  own part of every chunk: the weight's output rows (columns for Conv1D)
  must be reordered, recorded as `Placement.fused`
  (docs/torch-notes.md#a-fused-qkv-linear-cannot-be-column-split-as-it-is);
- batched matmul, softmax, masked_fill and scaled_dot_product_attention
  where the split dim is a batch dim (heads): each head is independent;
- softmax over the last dim and layer norm over trailing dims not holding
  the split (e.g. a per-head q/k norm); reductions over other dims.

Anything else reading a split activation breaks the pattern (a layer norm,
softmax or reduction over the split features, an add with a tensor that
is not split, an unknown op, a model output that would need a gather):
then every column producer feeding it and its row consumers stay
replicated, and the next candidates are looked for again. The pattern ends
at a parameterised matmul B contracting over the split dim: B is
row-parallel (weight S(1) for [out, in], S(0) for [in, out]); each rank
holds partial sums, all-reduced in forward ("g"), and the column input's
gradient is all-reduced in backward ("f"): one pair per region, whatever
the number of column producers (q, k, v -> o; gate, up -> down).

Vocabulary (Megatron section 3, last paragraphs). An embedding indexed by
token ids (a graph input, through views) whose table has at least as many
rows as columns is vocab-parallel: each rank looks up its rows, zeros the
rest, and the output is all-reduced. A matmul whose split output reaches a
cross entropy as the class dim is a vocab-parallel LM head: logits stay
split over the vocab, and the parallel cross entropy all-reduces three
per-token fp32 numbers (max logit, sum of exp, target logit). A matmul
that widens (output features >= input features, as vocab >= hidden) whose
split output is a model output itself (logits returned, the loss computed
outside the model) is an output LM head: column-parallel, its logits handed
to the caller's loss split over the vocab, where a cross entropy runs
vocab-parallel as above and any other op gathers them first
(runtime.pipeline.vocab_logits; torch's `loss_parallel`), when the vocab
divides by every degree the rest of the model allows. A tied embedding / LM head is one parameter, S(0) in both
uses; uses that need different splits of one parameter replicate it.

Limitations, from what an OpGraph records (shapes, not an op's dim
arguments): softmax is assumed over the last dim; a permute between equal
extents is ambiguous and breaks; buffers read directly by an op are not
seen; a reshape that merges the head dim into the batch (Bloom's
`baddbmm` on (b*nh, s, hs)) breaks, since the shard is then strided.

Dropout inside a split region must draw different masks on each rank
(Megatron's model-parallel RNG tracker); outside it, the same mask.

>>> from partitioner import trace
>>> from examples.gpt import gpt_small, example_batch
>>> model = gpt_small()
>>> splits = find_splits(trace(model, example_batch(model, 2)))
>>> p = splits.placement("transformer.h.0.attn.c_attn.weight")
>>> p.spec, p.role, p.fused
('S(0)', 'column', 3)
>>> splits.divisors[:2], splits.valid_tp()
((('heads of transformer.h.0.attn', 4), ('ffn of transformer.h.0.mlp', 1024)), (1, 2, 4))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from functools import reduce
from typing import Literal, NamedTuple

from cost_models.placements import REPLICATED, Shard, sharded_dim
from partitioner.planner.sequence_split import SequenceSplits, find_sequence_splits
from partitioner.planner.shard_dims import _EW, _INDEX_PATH, _NEW, _NORMS, _prod
from partitioner.planner.shard_rule import _Context, _rule, _Shard, _Weighted
from partitioner.tracer.opgraph import OpGraph, OpNode
from partitioner.tracer.symbolic import Poly

__all__ = ["Placement", "TPCollective", "TensorSplits", "find_splits"]

TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)  # the tensor degrees the planner considers

Role = Literal["column", "row", "vocab_embedding", "vocab_head", "replicated"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """How one parameter lies across the tensor group.

    spec: "S(d)" sharded on tensor dim d, "R" replicated.
    role: why it is split ("column", "row", "vocab_embedding", "vocab_head") or not.
    reason: one line a person can check against the model.
    fused: chunks fused along the split dim (3 for a fused qkv): the rows
        (columns for an [in, out] weight) are reordered so that rank r holds
        its slice of every chunk, not one contiguous block.
    """

    param: str
    spec: str
    role: Role
    reason: str
    fused: int = 1

    @property
    def dim(self) -> int | None:
        """The sharded tensor dim, None when replicated."""
        return sharded_dim(self.spec)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPCollective:
    """One tensor-parallel collective per microbatch, bytes at the traced dtype (Poly in b, s)."""

    node: str
    phase: Literal["forward", "backward"]
    kind: Literal["all_reduce", "all_gather"]
    bytes: Poly
    what: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorSplits:
    """The tensor-parallel decision for every parameter, independent of the degree tp.

    placements: one per OpGraph.params entry, same order.
    sharded_nodes: nodes whose compute, bytes and activations divide by tp.
    collectives: Megatron's f/g all-reduces and the parallel cross entropy's.
    divisors: (what, n) pairs tp must divide (heads, kv heads, ffn width, vocab).
    shard_dims: (node, dim) for every sharded node: the dim of its output that is
        split, which the code generator divides by tp in views and splits.
    chunks: (node, operand, dim): a replicated operand of a sharded node that spans the
        split dim and needs no gradient (an attention bias with a heads dim); the node reads
        this rank's chunk of it along the operand's dim `dim`.
    sequence: where the tokens split outside the tensor-split regions under sequence
        parallelism (`partitioner.planner.sequence_split`), used when the plan's sp is on.
    """

    placements: tuple[Placement, ...]
    sharded_nodes: frozenset[str]
    collectives: tuple[TPCollective, ...]
    divisors: tuple[tuple[str, int], ...]
    shard_dims: tuple[tuple[str, int], ...] = ()
    chunks: tuple[tuple[str, str, int], ...] = ()
    sequence: SequenceSplits = SequenceSplits()

    def valid_tp(self, candidates: Iterable[int] = TP_CANDIDATES) -> tuple[int, ...]:
        """The degrees among `candidates` that divide every divisor."""
        g = reduce(math.gcd, (n for _, n in self.divisors), 0)
        return tuple(t for t in candidates if g == 0 or g % t == 0)

    def placement(self, param: str) -> Placement:
        if param in self._by_param:
            return self._by_param[param]
        near = [p.param for p in self.placements if param.rsplit(".", 1)[-1] in p.param][:3]
        raise KeyError(f"placement: no parameter {param!r} in this graph (tied names use the first name); "
                       f"similar: {near}")

    @functools.cached_property
    def _by_param(self) -> dict[str, Placement]:
        return {p.param: p for p in self.placements}

    def table(self) -> str:
        w = max((len(p.param) for p in self.placements), default=5)
        lines = [f"{'param':{w}}  {'spec':7}  {'role':15}  reason"]
        for p in self.placements:
            spec = p.spec + (f" x{p.fused}" if p.fused > 1 else "")  # x3: fused chunks reordered
            lines.append(f"{p.param:{w}}  {spec:7}  {p.role:15}  {p.reason}")
        lines.append(f"valid tp: {self.valid_tp()}; collectives per microbatch: {len(self.collectives)}")
        return "\n".join(lines)

    __str__ = table

    def to_json(self) -> dict:
        return {"placements": [dataclasses.asdict(p) for p in self.placements],
                "sharded_nodes": sorted(self.sharded_nodes),
                "collectives": [{**dataclasses.asdict(c), "bytes": c.bytes.to_json()} for c in self.collectives],
                "divisors": [list(d) for d in self.divisors],
                "shard_dims": [list(d) for d in self.shard_dims],
                "chunks": [list(c) for c in self.chunks], "sequence": self.sequence.to_json()}

    @staticmethod
    def from_json(data: dict) -> TensorSplits:
        return TensorSplits(placements=tuple(Placement(**p) for p in data["placements"]),
                            sharded_nodes=frozenset(data["sharded_nodes"]),
                            collectives=tuple(TPCollective(**{**c, "bytes": Poly.from_json(c["bytes"])})
                                              for c in data["collectives"]),
                            divisors=tuple((str(k), int(n)) for k, n in data["divisors"]),
                            shard_dims=tuple((str(k), int(d)) for k, d in data.get("shard_dims", ())),
                            chunks=tuple((str(n), str(x), int(d)) for n, x, d in data.get("chunks", ())),
                            sequence=SequenceSplits.from_json(data["sequence"]) if "sequence" in data else
                            SequenceSplits())


# ---------------------------------------------------------------- one pass


@dataclasses.dataclass
class _Region:
    """Bookkeeping for one connected split region during one pass (mutable, pass-local)."""

    producers: list[str] = dataclasses.field(default_factory=list)
    rows: list[str] = dataclasses.field(default_factory=list)
    sinks: list[str] = dataclasses.field(default_factory=list)
    nodes: list[str] = dataclasses.field(default_factory=list)
    splits: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    row_units: list[int] = dataclasses.field(default_factory=list)
    fused: dict[str, int] = dataclasses.field(default_factory=dict)
    chunks: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)
    outputs: list[str] = dataclasses.field(default_factory=list)  # split nodes that are model outputs
    attention: bool = False
    failure: str | None = None


class _Pass(NamedTuple):
    state: dict[str, _Shard]
    regions: list[_Region]  # roots only
    vocab_embeddings: dict[str, str]  # embedding node -> its table
    embedding_reasons: dict[str, str]  # why the others stay whole


def _propagate(ctx: _Context, forbidden: dict[str, str], no_vocab: dict[str, str]) -> _Pass:
    """One topological sweep: start a region at every allowed column candidate, follow it."""
    state: dict[str, _Shard] = {}
    regions: list[_Region] = []
    parent: list[int] = []

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def merge(ids: set[int]) -> int:
        root, *rest = sorted(ids)
        for i in rest:
            parent[i] = root
            a, b = regions[root], regions[i]
            for f in ("producers", "rows", "sinks", "nodes", "splits", "row_units", "chunks", "outputs"):
                getattr(a, f).extend(getattr(b, f))
            a.fused.update(b.fused)
            a.attention |= b.attention
            a.failure = a.failure or b.failure
        return root

    def fail(reg: _Region, n: OpNode, why: str) -> None:
        if reg.failure is None:
            reg.failure = f"its split output reaches {n.name} ({n.op}), which {why}"

    vocab: dict[str, str] = {}
    emb_reason: dict[str, str] = {}
    for n in ctx.g.nodes:
        split = [state[i] for i in n.inputs if i in state]
        w = ctx.weighted.get(n.name)
        if not split:
            if w is not None and n.name not in forbidden:
                regions.append(_Region(producers=[n.name], nodes=[n.name]))
                parent.append(len(regions) - 1)
                state[n.name] = _Shard(len(regions) - 1, len(n.output.shape) - 1,
                                       ctx.pshape[w.weight][w.out_dim], frozenset({n.name}))
            elif n.op == "embedding" and len(n.params) == 1:
                why = no_vocab.get(n.name) or _embedding_reason(ctx, n)
                if why:
                    emb_reason[n.name] = why
                else:
                    vocab[n.name] = n.params[0]
            continue
        root = merge({find(s.region) for s in split})
        reg = regions[root]
        if w is not None:
            s = state[w.act]
            if s.dim != len(ctx.shape(w.act)) - 1:
                fail(reg, n, "multiplies by a weight along a dim that is not split")
            else:
                reg.rows.append(n.name)
                reg.row_units.append(s.units)
                reg.nodes.append(n.name)
            continue
        if n.op in _NEW:
            continue
        step = _rule(ctx, n, state)
        if isinstance(step, str):
            fail(reg, n, step)
            continue
        if step.dim is None and not step.sink:
            continue
        reg.nodes.append(n.name)
        if step.sink:
            reg.sinks.append(n.name)
            continue
        units = reduce(math.gcd, (s.units for s in split))
        units = math.gcd(units, step.cap) if step.cap else units
        producers = frozenset().union(*(s.producers for s in split))
        if step.head_split:
            reg.splits.append((n.module_path or n.name, step.head_split))
        if step.fused:
            for p in producers:
                reg.fused[p] = step.fused
        reg.attention |= step.attention
        reg.chunks.extend((n.name, i, k) for i, k in step.chunks)
        state[n.name] = _Shard(root, step.dim, units, producers)

    for name, s in state.items():
        n = ctx.node[name]
        if not ctx.consumers[name] and n.op != "getitem":
            regions[find(s.region)].outputs.append(name)
    roots = [regions[i] for i in sorted({find(i) for i in range(len(regions))})]
    for reg in roots:
        if reg.failure is None and reg.outputs and (reg.rows or reg.sinks or not _gathered_head(ctx, reg)):
            reg.failure = (f"its output reaches the model output at {reg.outputs[0]} with no matmul contracting "
                           f"over it (a split output would have to be gathered)")
        if reg.failure is None and reg.rows and reg.sinks:
            reg.failure = "its split output reaches both a row-parallel matmul and a cross entropy"
        if reg.failure is None and not reg.rows and not reg.sinks and not reg.outputs:
            reg.failure = "no matmul contracts over its split output (no row-parallel partner)"
    return _Pass(state, roots, vocab, emb_reason)


def _gathered_head(ctx: _Context, reg: _Region) -> bool:
    """Whether a region ending at model outputs is an LM head worth splitting: outputs made after every block
    (logits, not a block's value), by matmuls that widen (split logits handed to the loss, which a cross entropy
    reduces with three numbers per token and anything else gathers, b*s*V bytes at worst, are then cheaper than
    keeping the weight whole on every rank: V*h parameters, their gradients and optimizer state)."""
    if any(ctx.node[o].block is not None for o in reg.outputs):
        return False
    for a in reg.producers:
        w = ctx.weighted[a]
        shape = ctx.pshape[w.weight]
        if shape[w.out_dim] < shape[1 - w.out_dim]:
            return False
    return True


def _embedding_reason(ctx: _Context, n: OpNode) -> str:
    """Why this embedding is not vocab-parallel ("" if it is)."""
    rows, cols = (ctx.pshape[n.params[0]] + (0, 0))[:2]
    src = n.inputs[0] if n.inputs else None
    while src in ctx.node and ctx.node[src].op in _INDEX_PATH and ctx.node[src].inputs:
        src = ctx.node[src].inputs[0]
    if src is None or src in ctx.node:
        return "embedding indexed by computed positions, not token ids: every rank needs every row"
    if rows < cols:
        return (f"embedding of {rows} rows < width {cols}: a vocab split would all-reduce b*s*{cols} values "
                f"to save less than {cols}x{cols} parameters")
    return ""


# ---------------------------------------------------------------- the pass


def find_splits(g: OpGraph) -> TensorSplits:
    """Megatron column/row pairs, vocab-parallel embedding and head, everything else replicated.

    Sweeps the graph once per round: every parameterised matmul with a
    replicated input starts a column candidate, followed through shard-local
    ops to the matmul that contracts over it. Candidates whose split meets an
    op that is not shard-local (or a parameter needed two ways) are kept
    whole and the sweep runs again, since their partners may now pair with
    something else; a transformer settles in one round.
    """
    ctx = _Context.of(g)
    forbidden: dict[str, str] = {}  # column candidates kept whole -> why
    no_vocab: dict[str, str] = {}  # embeddings kept whole -> why
    while True:
        res = _propagate(ctx, forbidden, no_vocab)
        narrowing = _check_gathered_vocab(ctx, res)
        uses = _uses(ctx, res, forbidden)
        new = {p: reg.failure for reg in res.regions if reg.failure for p in reg.producers}
        shared, new_vocab = _conflicts(ctx, res, uses)
        new_vocab = {**narrowing, **new_vocab}
        new = {k: v for k, v in {**shared, **new}.items() if k not in forbidden}
        new_vocab = {k: v for k, v in new_vocab.items() if k not in no_vocab}
        if not new and not new_vocab:
            break
        forbidden.update(new)
        no_vocab.update(new_vocab)
    return TensorSplits(placements=tuple(_placement(ctx, p.name, uses.get(p.name, [])) for p in g.params),
                        sharded_nodes=frozenset(x for reg in res.regions for x in reg.nodes),
                        collectives=_collectives(ctx, res), divisors=_divisors(ctx, res),
                        shard_dims=tuple(sorted((x, res.state[x].dim) for reg in res.regions for x in reg.nodes
                                               if x in res.state)),
                        chunks=tuple(c for reg in res.regions for c in reg.chunks),
                        sequence=find_sequence_splits(
                            ctx, frozenset(x for reg in res.regions for x in reg.nodes),
                            frozenset(x for reg in res.regions for x in reg.rows), frozenset(res.vocab_embeddings)))


def _check_gathered_vocab(ctx: _Context, res: _Pass) -> dict[str, str]:
    """An LM or classifier head, or an input embedding, must not narrow the tensor degrees the rest of the model
    allows: its vocab (or class count) must divide by the gcd of the other divisors (heads, ffn widths), else it
    stays whole (with why). A head whose logits go to the model output or to a cross entropy inside the graph
    alike: a ViT's 5 classes with its labels must not refuse tp=2, when the same model without labels runs it;
    nor Moshi's embedding of 513 tokens. Marks the heads failed; returns the embeddings to keep whole."""
    heads = [reg for reg in res.regions if reg.failure is None and (reg.outputs or reg.sinks)]
    if not heads and not res.vocab_embeddings:
        return {}
    rest = [reg for reg in res.regions if reg.failure is None and not (reg.outputs or reg.sinks)]
    g = reduce(math.gcd, (n for _, n in _divisors(ctx, res._replace(regions=rest, vocab_embeddings={}))), 0)
    allowed = [t for t in TP_CANDIDATES if g == 0 or g % t == 0]

    def why(vocab: int, where: str) -> str:
        return (f"{where}, and splitting it splits the vocab {vocab} over tp, which the other splits allow up to "
                f"{max(allowed)}: pad the vocabulary to a multiple of {max(allowed)} to split it")

    for reg in heads:
        for a in reg.producers:
            w = ctx.weighted[a]
            vocab = ctx.pshape[w.weight][w.out_dim]
            if any(vocab % t for t in allowed):
                reg.failure = why(vocab, f"its output reaches the model output at {reg.outputs[0]}" if reg.outputs
                                  else f"its logits reach the cross entropy at {reg.sinks[0]}")
    return {e: why(ctx.pshape[p][0], f"embedding {p} looks tokens up in its rows")
            for e, p in res.vocab_embeddings.items() if any(ctx.pshape[p][0] % t for t in allowed)}


def _conflicts(ctx: _Context, res: _Pass,
               uses: dict[str, list[tuple[str, Placement]]]) -> tuple[dict[str, str], dict[str, str]]:
    """Parameters read by nodes that need different splits of them: those uses go whole.
    Returns (column candidates to give up, embeddings to keep whole), each with why."""
    region_of = {x: reg for reg in res.regions for x in reg.producers + reg.rows}
    forbid: dict[str, str] = {}
    no_vocab: dict[str, str] = {}
    for p, lst in uses.items():
        specs = {(pl.spec, pl.fused) for _, pl in lst}
        roles = {pl.role for _, pl in lst}
        if len(specs) == 1 and (len(roles) == 1 or roles == {"vocab_embedding", "vocab_head"}):
            continue
        why = (f"parameter {p} is also read where it needs another split ("
               + ", ".join(f"{ctx.label(node)}: {pl.spec}" for node, pl in lst) + "); kept whole in every use")
        for node, pl in lst:
            if pl.role == "vocab_embedding":
                no_vocab[node] = why
            elif node in region_of:
                for a in region_of[node].producers:
                    forbid.setdefault(a, why)
    return forbid, no_vocab


def _placement(ctx: _Context, param: str, lst: list[tuple[str, Placement]]) -> Placement:
    if not lst:
        return Placement(param=param, spec=REPLICATED, role="replicated", reason="not read by the traced forward")
    first = lst[0][1]
    roles = {pl.role for _, pl in lst}
    if roles == {"vocab_embedding", "vocab_head"}:
        heads = ", ".join(dict.fromkeys(ctx.label(n) for n, pl in lst if pl.role == "vocab_head"))
        return dataclasses.replace(first, reason=f"{first.reason}; tied with the vocab-parallel LM head "
                                                 f"({heads}): one {first.spec} split serves both uses")
    return first


def _uses(ctx: _Context, res: _Pass, forbidden: dict[str, str]) -> dict[str, list[tuple[str, Placement]]]:
    """What each node reading a parameter wants for it: param -> [(node, placement)]."""
    col = {p: reg for reg in res.regions for p in reg.producers}
    row = {b: reg for reg in res.regions for b in reg.rows}
    out: dict[str, list[tuple[str, Placement]]] = {}
    for n in ctx.g.nodes:
        w = ctx.weighted.get(n.name)
        for k, p in enumerate(n.params):
            pl = _want(ctx, res, n, w, p, col.get(n.name), row.get(n.name), forbidden, k)
            out.setdefault(p, []).append((n.name, pl))
    return out


def _want(ctx: _Context, res: _Pass, n: OpNode, w: _Weighted | None, p: str,
          col: _Region | None, row: _Region | None, forbidden: dict[str, str], k: int) -> Placement:
    if w is not None and col is not None and col.failure is None:
        wspec, fused = str(Shard(w.out_dim)), col.fused.get(n.name, 1)
        if col.sinks or col.outputs:
            if p != w.weight:
                return Placement(param=p, spec=str(Shard(0)), role="vocab_head",
                                 reason="bias of the vocab-parallel LM head: split with the vocab")
            where = ("into a parallel cross entropy, never gathered" if col.sinks else
                     "into the caller's loss (a cross entropy there runs vocab-parallel; other ops gather them)")
            return Placement(param=p, spec=wspec, role="vocab_head",
                             reason=f"vocab-parallel LM head: logits split over the vocab {where}")
        if p != w.weight:
            return Placement(param=p, spec=str(Shard(0)), role="column", fused=fused,
                             reason="bias of a column-parallel linear: split with its output features")
        partners = ", ".join(dict.fromkeys(ctx.label(b) for b in col.rows))
        extra = (f"; its {fused} fused chunks (q, k, v) are reordered so each rank holds its own heads' "
                 f"slice of each") if fused > 1 else ""
        return Placement(param=p, spec=wspec, role="column", fused=fused,
                         reason=f"column-parallel: output features split, shard-local up to row-parallel "
                                f"{partners}{extra}")
    if w is not None and row is not None and row.failure is None:
        if p != w.weight:
            return Placement(param=p, spec=REPLICATED, role="replicated",
                             reason="bias of a row-parallel linear: added after the all-reduce")
        partners = ", ".join(dict.fromkeys(ctx.label(a) for a in row.producers))
        return Placement(param=p, spec=str(Shard(1 - w.out_dim)), role="row",
                         reason=f"row-parallel: contracts over the split features of {partners}; output "
                                f"all-reduced in forward")
    if n.name in res.vocab_embeddings:
        return Placement(param=p, spec=str(Shard(0)), role="vocab_embedding",
                         reason="vocab-parallel embedding: each rank looks up its vocab rows, output all-reduced")
    return Placement(param=p, spec=REPLICATED, role="replicated", reason=_replicated_reason(ctx, res, n, w, forbidden, k))


def _replicated_reason(ctx: _Context, res: _Pass, n: OpNode, w: _Weighted | None, forbidden: dict[str, str],
                       k: int) -> str:
    """Why a parameter read (as the k-th parameter) by `n` stays whole."""
    if n.name in res.embedding_reasons:
        return res.embedding_reasons[n.name]
    if w is not None:
        return f"{ctx.label(n.name)} kept whole: {forbidden.get(n.name, 'not part of a column/row pair')}"
    split_in = any(i in res.state for i in n.inputs)
    if n.op in _NORMS or n.op in ("group_norm", "instance_norm"):
        what = f"{n.op} {'weight' if k == 0 else 'bias'}"
        return (f"{what}: normalises within each head, the same for every head" if split_in else
                f"{what}: normalises over the full hidden dim")
    if n.op in ("batch_norm", "native_batch_norm"):
        return "batch norm: per-channel statistics of activations that are not tensor-split"
    if "conv" in n.op:
        return "convolution: Megatron splits matmuls; conv channels are kept whole (data-parallel)"
    if n.op in _EW:
        where = n.module_type or n.module_path or n.name
        return (f"scale in {where} (elementwise {n.op}) on a {'split activation, broadcast along the split' if split_in else 'replicated activation'}: "
                f"every rank applies it in full")
    return f"read by {n.op} ({n.name}), which is not split"


# ---------------------------------------------------------------- collectives and divisors

# The parallel cross entropy all-reduces three fp32 numbers per token (Megatron's
# vocab_parallel_cross_entropy: the max logit, the sum of exp, the target logit).
# What the collectives that sequence parallelism replaces are called (unit_costs swaps them by these names)
WHAT_F = "column input gradient (f)"
WHAT_G = "row-parallel output (g)"
WHAT_VOCAB_EMBEDDING = "vocab-parallel embedding output"
_CE_STATS = ("max logit per token", "sum of exp per token", "target logit per token")
_CE_STAT_BYTES = 4  # fp32


def _nbytes(n: OpNode) -> Poly:
    return _prod(n.output.shape) * n.output.itemsize


def _collectives(ctx: _Context, res: _Pass) -> tuple[TPCollective, ...]:
    """Megatron's f (identity forward, all-reduce backward) before each region's column matmuls
    and on each replicated parameter used inside the region, g (all-reduce forward) after each row
    matmul; the vocab embedding's and head's."""
    out: list[tuple[int, TPCollective]] = []
    pos = {n.name: i for i, n in enumerate(ctx.g.nodes)}
    pbytes = {p.name: p.nbytes for p in ctx.g.params}
    from_params = _parameter_values(ctx)
    for reg in res.regions:
        seen: set[str] = set()
        for a in reg.producers:
            act = ctx.weighted[a].act
            if act in seen or act not in ctx.node or not ctx.node[act].requires_grad:
                continue  # one f per distinct input; none for data that needs no gradient
            seen.add(act)
            out.append((pos[a], TPCollective(node=a, phase="backward", kind="all_reduce",
                                             bytes=_nbytes(ctx.node[act]), what=WHAT_F)))
        for x in reg.nodes:  # replicated parameters applied to split activations: their gradient is summed
            if x in reg.producers or x in reg.rows:
                continue
            derived = [p for i in ctx.node[x].inputs if i not in res.state for p in from_params.get(i, ())]
            for p in dict.fromkeys([*ctx.node[x].params, *derived]):
                out.append((pos[x], TPCollective(node=x, phase="backward", kind="all_reduce",
                                                 bytes=Poly.const(pbytes[p]),
                                                 what=f"gradient of replicated {p} on split activations (f)")))
        for b in reg.rows:
            out.append((pos[b], TPCollective(node=b, phase="forward", kind="all_reduce",
                                             bytes=_nbytes(ctx.node[b]), what=WHAT_G)))
        for o in reg.outputs:
            # the logits go to the caller's loss split over the vocab (runtime.pipeline.vocab_logits); a cross
            # entropy there, the loss of a model that returns logits, runs vocab-parallel: its three statistics
            tokens = _prod(ctx.shape(o)[:-1])
            for what in _CE_STATS:
                out.append((pos[o], TPCollective(node=o, phase="forward", kind="all_reduce",
                                                 bytes=tokens * _CE_STAT_BYTES,
                                                 what=f"cross entropy over split logits: {what}")))
        for c in reg.sinks:
            logits = ctx.shape(ctx.node[c].inputs[0])
            tokens = _prod(x for i, x in enumerate(logits) if i != (1 if len(logits) >= 2 else 0))
            for what in _CE_STATS:
                out.append((pos[c], TPCollective(node=c, phase="forward", kind="all_reduce",
                                                 bytes=tokens * _CE_STAT_BYTES, what=f"cross entropy: {what}")))
    for e in res.vocab_embeddings:
        out.append((pos[e], TPCollective(node=e, phase="forward", kind="all_reduce", bytes=_nbytes(ctx.node[e]),
                                         what=WHAT_VOCAB_EMBEDDING)))
    return tuple(c for _, c in sorted(out, key=lambda x: x[0]))


def _parameter_values(ctx: _Context) -> dict[str, tuple[str, ...]]:
    """Nodes computed from parameters alone (Gemma's `1 + weight`), each with those parameters."""
    out: dict[str, tuple[str, ...]] = {}
    for n in ctx.g.nodes:  # topological order
        if n.op in _NEW or not (n.params or n.inputs) or any(i not in out for i in n.inputs):
            continue
        out[n.name] = tuple(dict.fromkeys([*n.params, *(p for i in n.inputs for p in out[i])]))
    return out


def _divisors(ctx: _Context, res: _Pass) -> tuple[tuple[str, int], ...]:
    """What tp must divide: per region its heads (and smaller kv head counts) or its ffn width; each vocab."""
    out: dict[str, int] = {}
    for reg in res.regions:
        if reg.sinks or reg.outputs:
            for a in reg.producers:
                w = ctx.weighted[a]
                out[f"vocab of {w.weight}"] = ctx.pshape[w.weight][w.out_dim]
            continue
        by_module: dict[str, set[int]] = {}
        for mod, k in reg.splits:
            by_module.setdefault(mod, set()).add(k)
        for mod, ks in by_module.items():
            kind = "heads" if reg.attention else "groups"
            for k in sorted(ks, reverse=True):
                out[f"{kind if k == max(ks) else 'kv ' + kind} of {mod}"] = k
        if not by_module:
            label = ctx.label(reg.rows[0])
            out[f"ffn of {label.rsplit('.', 1)[0]}"] = reduce(math.gcd, reg.row_units)
    for p in res.vocab_embeddings.values():
        out[f"vocab of {p}"] = ctx.pshape[p][0]
    return tuple(out.items())
