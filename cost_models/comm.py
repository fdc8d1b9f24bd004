"""Communication time: alpha-beta (Hockney) costs of collectives and p2p.

A message of n bytes over a link costs alpha + n / B: alpha is the link's
latency (s), B its bandwidth (bytes/s per device per direction). Collective
costs per algorithm follow Thakur, Rabenseifner & Gropp 2005 ("Optimization
of Collective Communication Operations in MPICH", IJHPCA); their bandwidth
terms are the "bus bandwidth" factors of the NCCL docs / nccl-tests
(PERFORMANCE.md: busbw = algbw * 2(p-1)/p for all-reduce, (p-1)/p for
reduce-scatter and all-gather, 1 for broadcast).

Conventions, all functions:
  * nbytes is the full (unsharded) buffer of one rank: the all-reduce
    input, the reduce-scatter input, the all-gather output, the all-to-all
    send buffer, the broadcast buffer.
  * p <= 1 ranks, or 0 bytes, cost 0 s: nothing is sent and the emitted
    program skips the call (no latency is charged for an empty collective).
  * Results are seconds.

>>> from cost_models.specs import LinkLevel, LinkSpec
>>> nvlink = LinkSpec(level=LinkLevel.INTRA_NODE, bytes_per_s=100e9, latency_s=0.0)
>>> ring_all_reduce(1e9, 8, nvlink)                   # 2 * 7/8 * 1e9 / 100e9
0.0175
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections import Counter
from typing import TYPE_CHECKING, Literal, Sequence

from cost_models.calibration import Calibration
from cost_models.errors import PartitionerError
from cost_models.specs import LinkLevel, LinkSpec

if TYPE_CHECKING:
    from cost_models.topology import Topology

__all__ = [
    "Algorithm", "ring_all_reduce", "tree_all_reduce", "ring_reduce_scatter",
    "ring_all_gather", "pairwise_all_to_all", "ring_broadcast", "tree_broadcast",
    "p2p_time", "hierarchical_all_reduce", "hierarchical_reduce_scatter",
    "hierarchical_all_gather", "nccl_ring_latency", "calibrated_link", "CommModel",
]

Algorithm = Literal["ring", "tree", "hierarchical", "auto"]


def _empty(nbytes: float, p: int) -> bool:
    if nbytes < 0 or p < 1:
        raise PartitionerError(f"a collective needs nbytes >= 0 and p >= 1, got "
                               f"nbytes={nbytes}, p={p}")
    return p == 1 or nbytes == 0


# --- flat algorithms over one link level ------------------------------------
def ring_all_reduce(nbytes: float, p: int, link: LinkSpec) -> float:
    """Ring all-reduce (reduce-scatter then all-gather): 2(p-1) alpha + 2(p-1)/p * n/B.

    >>> link = LinkSpec(level=LinkLevel.INTRA_NODE, bytes_per_s=100e9, latency_s=5e-6)
    >>> round(ring_all_reduce(1e9, 8, link) * 1e3, 6)     # ms: 17.5 + 14 * 0.005
    17.57
    """
    if _empty(nbytes, p):
        return 0.0
    return 2 * (p - 1) * link.latency_s + 2 * (p - 1) / p * nbytes / link.bytes_per_s


def tree_all_reduce(nbytes: float, p: int, link: LinkSpec) -> float:
    """Double-binary-tree all-reduce: 2 ceil(log2 p) alpha + 2 n/B.

    NCCL's trees (Jeaugey 2019, "Massively Scale Your Deep Learning Training
    with NCCL 2.4"; Sanders, Speck & Traeff 2009, "Two-tree algorithms for
    full bandwidth broadcast, reduction and scan"): a pipelined reduce up the
    tree then a broadcast down, each of the two trees carrying half the data,
    so each rank moves about n bytes per phase; depth ceil(log2 p) per phase.
    Log latency, but twice the bandwidth term of a ring at large p.
    """
    if _empty(nbytes, p):
        return 0.0
    return 2 * math.ceil(math.log2(p)) * link.latency_s + 2 * nbytes / link.bytes_per_s


def ring_reduce_scatter(nbytes: float, p: int, link: LinkSpec) -> float:
    """Ring reduce-scatter of an n-byte input (each rank keeps n/p): (p-1) alpha + (p-1)/p * n/B."""
    if _empty(nbytes, p):
        return 0.0
    return (p - 1) * link.latency_s + (p - 1) / p * nbytes / link.bytes_per_s


def ring_all_gather(nbytes: float, p: int, link: LinkSpec) -> float:
    """Ring all-gather to an n-byte output (each rank holds n/p): (p-1) alpha + (p-1)/p * n/B."""
    return ring_reduce_scatter(nbytes, p, link)


def pairwise_all_to_all(nbytes: float, p: int, link: LinkSpec) -> float:
    """Pairwise-exchange all-to-all of an n-byte send buffer: (p-1)(alpha + n/(p B)).

    p-1 rounds, each sending the n/p-byte piece for one peer (Thakur et al.
    2005, section 4.5, long messages).
    """
    if _empty(nbytes, p):
        return 0.0
    return (p - 1) * (link.latency_s + nbytes / (p * link.bytes_per_s))


def ring_broadcast(nbytes: float, p: int, link: LinkSpec) -> float:
    """Pipelined ring (chain) broadcast: (p-1) alpha + n/B.

    The buffer streams down the chain in small chunks, so each link carries
    n bytes once (NCCL: busbw = algbw for broadcast); the pipeline fill of
    (p-1) chunks is counted in the latency term only.
    """
    if _empty(nbytes, p):
        return 0.0
    return (p - 1) * link.latency_s + nbytes / link.bytes_per_s


def tree_broadcast(nbytes: float, p: int, link: LinkSpec) -> float:
    """Binomial-tree broadcast: ceil(log2 p) (alpha + n/B) (Thakur et al. 2005, short messages)."""
    if _empty(nbytes, p):
        return 0.0
    return math.ceil(math.log2(p)) * (link.latency_s + nbytes / link.bytes_per_s)


def p2p_time(nbytes: float, link: LinkSpec) -> float:
    """One send/recv: alpha + n/B; 0 bytes cost 0."""
    if nbytes < 0:
        raise PartitionerError(f"p2p needs nbytes >= 0, got {nbytes}")
    return 0.0 if nbytes == 0 else link.latency_s + nbytes / link.bytes_per_s


# --- hierarchical algorithms: `nodes` nodes x `per_node` ranks each ----------
# Assumption: each of the per_node devices of a node drives its own NIC at
# the inter-node link's bytes/s (rail-optimised clusters such as DGX A100/H100
# have one NIC per GPU), so the per_node inter-node phases run in parallel,
# one per local index, each on n/per_node of the data.
def hierarchical_all_reduce(nbytes: float, nodes: int, per_node: int,
                            intra: LinkSpec, inter: LinkSpec) -> float:
    """Reduce-scatter in the node, all-reduce across nodes, all-gather in the node.

    T = RS_ring(n, k, intra) + AR_ring(n/k, N, inter) + AG_ring(n, k, intra)
    with k = per_node, N = nodes. With N = 1 it is the intra-node ring, with
    k = 1 the inter-node ring.
    """
    return (ring_reduce_scatter(nbytes, per_node, intra)
            + ring_all_reduce(nbytes / per_node, nodes, inter)
            + ring_all_gather(nbytes, per_node, intra))


def nccl_ring_latency(nodes: int, per_node: int, intra: LinkSpec, inter: LinkSpec) -> float:
    """Latency of one NCCL ring all-gather or reduce-scatter over `nodes` x `per_node` ranks (s).

    NCCL runs these two collectives as rings only (src/graph/tuning.cc skips every other
    algorithm for them), each channel's ring passing through every rank of the group, so
    its latency model charges nsteps - nInterSteps intra-node steps and nInterSteps
    inter-node ones, with nsteps = p - 1 and nInterSteps = N - 1:

        (N k - N) alpha_intra + (N - 1) alpha_inter

    A two-phase algorithm would take only (k - 1) + (N - 1) steps; at thousands of ranks
    the ring's N (k - 1) intra-node steps are most of the latency (1536 ranks on 192
    nodes of 8: 1344 of 1535 steps).
    """
    return (nodes * per_node - nodes) * intra.latency_s + (nodes - 1) * inter.latency_s


def _two_level_bytes_time(nbytes: float, nodes: int, per_node: int, intra: LinkSpec, inter: LinkSpec) -> float:
    """Bandwidth term of a reduce-scatter (or all-gather) in the node then across nodes:
    (k-1)/k n/B_intra + (N-1)/N (n/k)/B_inter, each device driving its own NIC (see above)."""
    return ((per_node - 1) / per_node * nbytes / intra.bytes_per_s
            + (nodes - 1) / nodes * nbytes / per_node / inter.bytes_per_s)


def hierarchical_reduce_scatter(nbytes: float, nodes: int, per_node: int,
                                intra: LinkSpec, inter: LinkSpec) -> float:
    """Bytes of RS_ring(n, k, intra) + RS_ring(n/k, N, inter), each rank ending with n/(kN); the
    latency of the ring NCCL runs (`nccl_ring_latency`).

    The bytes are those of NCCL's multi-node ring too (one ring per local rank, each leaving
    the node through its own NIC: n/k per NIC), counted as if the two levels took turns.
    """
    if _empty(nbytes, nodes * per_node):
        return 0.0
    return _two_level_bytes_time(nbytes, nodes, per_node, intra, inter) + nccl_ring_latency(nodes, per_node, intra, inter)


def hierarchical_all_gather(nbytes: float, nodes: int, per_node: int,
                            intra: LinkSpec, inter: LinkSpec) -> float:
    """The reverse of `hierarchical_reduce_scatter`, at the same cost: AG_ring(n/k, N, inter) + AG_ring(n, k, intra)."""
    return hierarchical_reduce_scatter(nbytes, nodes, per_node, intra, inter)


def calibrated_link(link: LinkSpec, calibration: Calibration, op: str = "all_reduce") -> LinkSpec:
    """The link as achieved by collective `op`: bytes/s * <level>_bw_eff * collective_bw_eff[op], latency +
    <level>_extra_latency_s."""
    prefix = {LinkLevel.SAME_DEVICE: "same_device", LinkLevel.INTRA_NODE: "intra_node",
              LinkLevel.INTER_NODE: "inter_node"}[LinkLevel(link.level)]
    return dataclasses.replace(
        link,
        bytes_per_s=link.bytes_per_s * getattr(calibration, f"{prefix}_bw_eff") * calibration.collective_factor(op),
        latency_s=link.latency_s + getattr(calibration, f"{prefix}_extra_latency_s"))


# --- the model over a topology ----------------------------------------------
@dataclasses.dataclass(frozen=True)
class _GroupShape:
    p: int
    level: LinkLevel
    nodes: int
    per_node: int
    uniform_per_node: bool
    ranks_per_node: dict


@functools.lru_cache(maxsize=256)
def _calibrated_link_of(model: "CommModel", level: LinkLevel, op: str) -> LinkSpec:
    return calibrated_link(model.topology.link(level), model.calibration, op)


@functools.lru_cache(maxsize=4096)
def _group_shape(model: "CommModel", op: str, ranks: tuple[int, ...]) -> _GroupShape:
    """Size, slowest link and per-node layout of a group: checked once per (model, group).

    Keyed on the (hashable, frozen) model and the rank tuple, so the planner's
    thousands of calls on the same data-parallel group cost O(1) each.
    """
    model._check_ranks(ranks)
    if len(set(ranks)) != len(ranks):
        dup = sorted(r for r, c in Counter(ranks).items() if c > 1)
        raise PartitionerError(f"{op}: ranks {dup} appear more than once in {list(ranks)}")
    per_node = Counter(model.topology.node_of(r) for r in ranks)
    k = min(per_node.values()) if per_node else 0
    return _GroupShape(p=len(ranks), level=model.topology.group_level(ranks) if ranks else LinkLevel.SAME_DEVICE,
                       nodes=len(per_node), per_node=k, uniform_per_node=bool(per_node) and k == max(per_node.values()),
                       ranks_per_node=dict(per_node))
@dataclasses.dataclass(frozen=True)
class CommModel:
    """Collective times for groups of ranks on a Topology (seconds).

    A group's flat algorithms run over its slowest link
    (`topology.group_level`). A group that spans several nodes with the same
    number k > 1 of ranks on each also has the hierarchical algorithm (see
    `hierarchical_all_reduce` for the one-NIC-per-device assumption).
    algorithm="auto" returns the fastest available algorithm. Every
    non-empty collective also pays `calibration.collective_base_latency_s`
    once; p2p does not.

    >>> from cost_models.topology import Topology
    >>> cm = CommModel(Topology.parse("2x8xA100-80GB"))
    >>> [round(cm.all_reduce(1e9, range(16), a) * 1e3, 1) for a in ("ring", "hierarchical")]  # ms
    [88.5, 13.5]
    """

    topology: "Topology"
    calibration: Calibration = Calibration()

    def _link(self, level: LinkLevel, op: str) -> LinkSpec:
        return _calibrated_link_of(self, level, op)

    def _check_ranks(self, ranks: Sequence[int]) -> None:
        world = self.topology.world_size
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, numbers.Integral)
               or not 0 <= r < world]
        if bad:
            raise PartitionerError(f"ranks {bad} are not ranks of a world of size {world} "
                                   f"(valid: 0..{world - 1})")

    def _pick(self, op: str, algorithm: str, nbytes: float, ranks: Sequence[int],
              flat: dict, hier) -> float:
        """Time of `op` on `ranks` with `algorithm` (or the fastest, for "auto")."""
        valid = [*flat, *(["hierarchical"] if hier else []), "auto"]
        if algorithm not in valid:
            raise PartitionerError(f"{op}: algorithm={algorithm!r} is not one of {valid}")
        shape = _group_shape(self, op, tuple(ranks))
        if _empty(nbytes, shape.p):
            return 0.0
        link = self._link(shape.level, op)
        times = {name: f(nbytes, shape.p, link) for name, f in flat.items()}
        if hier and shape.uniform_per_node:
            # One node: both phases on the group's own link (the inter phase is empty).
            intra = self._link(LinkLevel.INTRA_NODE, op) if shape.nodes > 1 else link
            inter = self._link(LinkLevel.INTER_NODE, op) if shape.nodes > 1 else link
            times["hierarchical"] = hier(nbytes, shape.nodes, shape.per_node, intra, inter)
        elif algorithm == "hierarchical":
            raise PartitionerError(
                f"{op}: algorithm='hierarchical' needs the same number of ranks on "
                f"every node; this group has {shape.ranks_per_node} (node: ranks) "
                f"(use 'ring' or 'auto')")
        t = min(times.values()) if algorithm == "auto" else times[algorithm]
        return t + self.calibration.collective_base_latency_s

    def all_reduce(self, nbytes: float, ranks: Sequence[int],
                   algorithm: Algorithm = "auto") -> float:
        """All-reduce an n-byte buffer on every rank of `ranks`: ring, tree or hierarchical."""
        return self._pick("all_reduce", algorithm, nbytes, ranks,
                          {"ring": ring_all_reduce, "tree": tree_all_reduce},
                          hierarchical_all_reduce)

    def reduce_scatter(self, nbytes: float, ranks: Sequence[int],
                       algorithm: Algorithm = "auto") -> float:
        """Reduce-scatter an n-byte input (each rank keeps n/p): ring or hierarchical."""
        return self._pick("reduce_scatter", algorithm, nbytes, ranks,
                          {"ring": ring_reduce_scatter}, hierarchical_reduce_scatter)

    def all_gather(self, nbytes: float, ranks: Sequence[int],
                   algorithm: Algorithm = "auto") -> float:
        """All-gather to an n-byte output (each rank holds n/p): ring or hierarchical."""
        return self._pick("all_gather", algorithm, nbytes, ranks,
                          {"ring": ring_all_gather}, hierarchical_all_gather)

    def all_to_all(self, nbytes: float, ranks: Sequence[int]) -> float:
        """Pairwise all-to-all of an n-byte send buffer over the group's slowest link.

        Pessimistic for multi-node groups: the k-1 pieces for same-node peers
        would go over the faster intra-node link.
        """
        return self._pick("all_to_all", "auto", nbytes, ranks,
                          {"pairwise": pairwise_all_to_all}, None)

    def broadcast(self, nbytes: float, ranks: Sequence[int],
                  algorithm: Algorithm = "auto") -> float:
        """Broadcast an n-byte buffer from one rank of the group: pipelined ring or binomial tree."""
        return self._pick("broadcast", algorithm, nbytes, ranks,
                          {"ring": ring_broadcast, "tree": tree_broadcast}, None)

    def p2p(self, nbytes: float, src: int, dst: int) -> float:
        """Send n bytes from rank `src` to rank `dst`: alpha + n/B over their link; src == dst costs 0."""
        self._check_ranks([src, dst])
        if src == dst:
            return 0.0
        return p2p_time(nbytes, self._link(self.topology.link_level(src, dst), "p2p"))
