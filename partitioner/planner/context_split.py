"""Context parallelism as the planner costs it: which cp degrees a candidate may take, and what attention pays.

Under cp > 1 every rank of a context group holds 2 of the sequence's 2*cp chunks (chunk r and chunk
2*cp-1-r, runtime.context.sequence: the causal load balance) for the whole layer. Per rank, then:

- every token-dependent quantity of a node (FLOPs, bytes moved, activations kept, tensor-parallel
  collective bytes, the hidden state sent between pipeline stages) is its whole-sequence value over cp:
  linear terms because the rank holds s/cp tokens; attention's s^2 terms because its queries (s/cp of
  them) meet all s keys, and the load-balanced layout gives every rank the same share of the causal
  triangle (`local`). What does not depend on the sequence (a weight's bytes) stays whole.
- ring attention (Liu et al. 2023; Megatron-Core's p2p context parallelism): per attention node, forward,
  cp - 1 steps each sending this rank's current k/v block to its ring neighbour while it attends to the
  block it holds; backward, cp - 1 steps sending k/v and the dk/dv accumulator, and one last dk/dv send
  to the block's owner (runtime.context.ring_attention). Each transfer overlaps one block's attention,
  1/cp of the node's local time, so only what a transfer takes beyond that is exposed (`ring_exposed`).
- DeepSpeed-Ulysses (Jacobs et al. 2023): four all-to-alls per attention node forward (q, k, v to a
  head split, the output back) and four backward (their gradients), over the context group, not
  overlapped (`all_to_all_time`).
- memory: while an attention node runs, the kernel holds buffers beyond the activations autograd keeps (a
  ring's k/v blocks arriving and its dk/dv accumulators travelling; Ulysses' all-to-all send and receive
  buffers), counted at their peak per attention node (`attention_buffer_bytes`).
- gradients are reduced, and ZeRO shards, over dp x cp ranks (cost_models.mesh.Mesh.replica_ranks).

Units: seconds and bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cost_models.comm import CommModel
from partitioner.planner.declarations import Declarations
from partitioner.tracer.opgraph import OpGraph
from partitioner.tracer.symbolic import Poly

__all__ = ["ATTENTION_OP", "LONG_SEQUENCE", "MAX_CP", "all_to_all_time", "attention_buffer_bytes", "attention_heads",
           "cp_options", "kv_blocks", "local", "ring_exposed", "ring_step"]

ATTENTION_OP = "scaled_dot_product_attention"
# The planner offers cp > 1 unpinned from this sequence length on (and below it only where nothing fits
# without): Megatron-Core's and NeMo's long-context recipes turn context parallelism on from 16K tokens
# (Llama 3 trained its 8K stage without it, its 128K stage with cp=16). Below, cp only trades data-parallel
# replicas for attention traffic, which never pays while the replicas have samples to take.
LONG_SEQUENCE = 16384
MAX_CP = 32  # the largest degree searched (Llama 3's 128K recipe uses 16)


def local(p: Poly, b: float, s: float, cp: int) -> float:
    """A per-microbatch Poly's value on one of cp ranks: its sequence-independent part whole, the rest over cp.

    >>> local(Poly.from_terms({(0, 0): 10.0, (1, 1): 2.0, (1, 2): 1.0}), 1, 8, 2)  # 10 + (16 + 64) / 2
    50.0
    """
    whole = p(b, s)
    if cp == 1:
        return whole
    fixed = p(b, 0)
    return fixed + (whole - fixed) / cp


# Ops that only reshape, select or broadcast a tensor: a k/v that reaches attention through them (grouped-query
# attention's repeat_kv: unsqueeze, expand, reshape) is sent in its smallest form (the kernel expands it)
_SHAPE_OPS = frozenset({"view", "reshape", "expand", "slice", "unsqueeze", "squeeze", "transpose", "permute",
                        "contiguous", "clone", "_unsafe_view", "alias"})


def kv_blocks(g: OpGraph) -> dict[str, tuple[Any, Any]]:
    """Per attention node, the (k, v) TensorSpecs a context-parallel kernel sends: each input followed back
    through shape-only ops to its smallest form (under grouped-query attention the k/v heads before they are
    repeated for every query head, runtime.context.ring_attention's GQA blocks)."""
    by_name = {n.name: n for n in g.nodes}

    def smallest(name: str) -> Any:
        node, best = by_name.get(name), None
        while node is not None and node.output is not None:
            if best is None or node.output.numel(1, 1) < best.numel(1, 1):
                best = node.output
            if node.op not in _SHAPE_OPS or not node.inputs:
                break
            node = by_name.get(node.inputs[0])
        return best

    return {n.name: (smallest(n.inputs[1]), smallest(n.inputs[2]))
            for n in g.nodes if n.op == ATTENTION_OP and len(n.inputs) >= 3}


def attention_heads(g: OpGraph) -> tuple[int, int] | None:
    """(query heads, key/value heads) of the model's attention, the fewest over its attention nodes (shape
    (B, H, S, D) each); None when the graph has no scaled_dot_product_attention."""
    out = {n.name: n.output for n in g.nodes}
    heads = None
    for n in g.nodes:
        if n.op != ATTENTION_OP or len(n.inputs) < 3:
            continue
        q, k = out.get(n.inputs[0]), out.get(n.inputs[1])
        if q is None or k is None or len(q.shape) != 4 or len(k.shape) != 4:
            continue
        h = (round(q.shape[1](1, 1)), round(k.shape[1](1, 1)))
        heads = h if heads is None else (min(heads[0], h[0]), min(heads[1], h[1]))
    return heads


def cp_options(d: Declarations, *, tp: int, world_size: int, seq_len: int, heads: tuple[int, int] | None,
               search: bool) -> tuple[tuple[int, str], ...]:
    """The (cp, cp_kind) a candidate with tensor degree `tp` may take. Pinned: that. Unpinned: (1, "ring"),
    and where `search` (a long sequence, or nothing fits without cp) every power of two up to MAX_CP that
    splits the sequence into 2*cp chunks and the devices left by tp, as a ring, and as all-to-all where
    tp * cp divides the heads.

    >>> cp_options(Declarations(global_batch_size=8), tp=2, world_size=8, seq_len=64, heads=(4, 4), search=True)
    ((1, 'ring'), (2, 'ring'), (2, 'all-to-all'), (4, 'ring'))
    """
    if d.cp is not None:
        cps = [d.cp]
    elif search:
        cps = [1] + [c for c in (2**i for i in range(1, MAX_CP.bit_length()))
                     if seq_len % (2 * c) == 0 and world_size % (tp * c) == 0]
    else:
        cps = [1]
    out: list[tuple[int, str]] = []
    for c in cps:
        if c == 1:
            out.append((1, "ring"))
            continue
        ulysses = heads is not None and all(h % (tp * c) == 0 for h in heads)
        kinds = [d.cp_kind] if d.cp_kind is not None else ["ring"] + (["all-to-all"] if ulysses else [])
        out += [(c, k) for k in kinds if k == "ring" or ulysses]
    return tuple(out)


def ring_step(comm: CommModel, nbytes: float, ranks: Sequence[int]) -> float:
    """Seconds of one ring step: every rank sends `nbytes` to the next at once, so the slowest neighbour
    pair (an inter-node hop where the group spans nodes) sets the pace."""
    n = len(ranks)
    return max(comm.p2p(nbytes, ranks[i], ranks[(i + 1) % n]) for i in range(n))


def ring_exposed(kv_bytes: float, forward_s: float, backward_s: float, comm: CommModel,
                 ranks: Sequence[int]) -> tuple[float, float]:
    """(forward, backward) seconds of one attention node's ring traffic that its compute does not hide.

    kv_bytes: this rank's k and v block (its s/cp tokens); forward_s / backward_s: the node's local
    attention time. Forward: cp - 1 k/v sends, each behind one block's attention (forward_s / cp).
    Backward: cp - 1 sends of k/v plus the dk/dv accumulator (fp32 in the kernel, 2x a 16-bit k/v), each
    behind one block's backward, then the accumulator's last hop to its owner, exposed.

    >>> from cost_models.topology import Topology
    >>> from cost_models.comm import CommModel
    >>> comm = CommModel(Topology.parse("8xH100-80GB"))
    >>> ring_exposed(1e6, 1.0, 2.0, comm, (0, 1))[0]  # a 1 MB block behind a second of attention: hidden
    0.0
    """
    cp = len(ranks)
    if cp == 1:
        return 0.0, 0.0
    fwd = (cp - 1) * max(0.0, ring_step(comm, kv_bytes, ranks) - forward_s / cp)
    bwd = (cp - 1) * max(0.0, ring_step(comm, 3 * kv_bytes, ranks) - backward_s / cp) + \
        ring_step(comm, 2 * kv_bytes, ranks)
    return fwd, bwd


def all_to_all_time(sizes: Sequence[float], comm: CommModel, ranks: Sequence[int]) -> float:
    """Seconds of one direction's four Ulysses all-to-alls of one attention node, one after the other: q, k,
    v and the output (or their gradients); sizes: those tensors' bytes on this rank (s/cp tokens, all its
    heads), of which each all-to-all sends (cp - 1)/cp (cost_models.comm.CommModel.all_to_all)."""
    if len(ranks) == 1:
        return 0.0
    return sum(comm.all_to_all(b, ranks) for b in sizes)


# runtime.context.ring_attention casts this rank's k/v block to fp32 (one (2, B, H_kv, S/cp, D) message) and
# accumulates dk/dv in fp32, whatever the compute dtype
RING_MESSAGE_ITEMSIZE = 4
# at the backward's peak, in k/v-block units: the block in use and the next one arriving (the forward's two),
# and three dk/dv accumulators: this step's share, the running sum still being sent to the next rank and the
# one arriving from the previous rank
_RING_BUFFERS = 5


def attention_buffer_bytes(sizes: Sequence[float], cp: int, kind: str) -> float:
    """Bytes one attention node's context-parallel kernel holds on a rank beyond the activations, at its peak.

    ring (runtime.context.ring_attention): sizes = this rank's k and v blocks as the kernel sends them (fp32,
        `RING_MESSAGE_ITEMSIZE`; s/cp tokens, k/v heads unrepeated), kv = sum(sizes). Forward: 2 kv (the block
        attended to, the next arriving: double-buffered); backward: 2 kv plus 3 kv of dk/dv (this step's
        share, the accumulator travelling on, the one arriving). Peak: 5 kv, in backward.
    all-to-all (runtime.context.ulysses): sizes = q, k, v and the output on this rank (compute dtype); the
        four all-to-alls run one at a time, each holding a contiguous send copy and a receive buffer of its
        tensor (the reshaped result is what SDPA keeps, counted with the activations). Peak: 2 max(sizes).
    cp = 1: 0 (plain SDPA).

    >>> attention_buffer_bytes([4e6, 4e6], 4, "ring")        # 5 x an 8 MB fp32 k/v block
    40000000.0
    >>> attention_buffer_bytes([2e6, 1e6, 1e6, 2e6], 4, "all-to-all")
    4000000.0
    """
    if cp == 1 or not sizes:
        return 0.0
    if kind == "ring":
        return _RING_BUFFERS * float(sum(sizes))
    return 2.0 * max(sizes)
