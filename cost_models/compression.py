"""Gradient compression of the data-parallel reduction: bytes on the wire and kernel time.

A compressor applies per link level ("intra_node", "inter_node") to the
data-parallel gradient all-reduce (the GRAD_SYNC of DDP and ZeRO-1). The
runtime reduces gradients in fp32 under every precision
(`runtime.mixed_precision`: reduce_dtype = fp32), so that is the baseline:

    compressor  bytes per gradient element on the wire (w)   how it reduces
    none        4                                         ring/tree/hierarchical all-reduce of fp32
    bf16        2 (min(2, baseline): nothing saved if the baseline were 16-bit)   plain bf16 all-reduce
    int8        1   + 4/256                               two-phase: all-to-all of codes, owners
    int4        1/2 + 4/256                               dequantize+sum+requantize, all-gather

int8/int4 are `runtime.compressed_reduce` (blockwise absmax, one fp32 scale
per block of 256): each rank sends (p-1)/p n w in the all-to-all and again in
the all-gather, 2 (p-1)/p n w in all, the bandwidth term of a ring all-reduce
of n w bytes; its latency terms are those of a ring too ((p-1) alpha per phase).

A group spanning N nodes with k ranks on each reduces hierarchically: within
the node at the intra_node compressor, across nodes (on n/k elements, one
group per local index) at the inter_node compressor, then within the node
again. Per link level, with R the reduce phase (ring reduce-scatter, or the
all-to-all of codes) and G the all-gather, each of n w bytes:

    T_intra = R(n, k, intra, c_intra) + G(n, k, intra, c_intra)
    T_inter = R(n/k, N, inter, c_inter) + G(n/k, N, inter, c_inter)

The gradients go in B = ceil(4n / 25 MiB) buckets (DDP_BUCKET_BYTES), and
the two levels are different links, so bucket i's inter-node phase runs while
bucket i+1 is reduced inside the node: a pipeline, whose time is its
bottleneck plus the fill of one bucket through the other level,

    T = max(T_intra, T_inter) + min(T_intra, T_inter) / B

(so compressing the level that is not the bottleneck buys nothing). With
both levels "none" it is the fastest of that and `CommModel.all_reduce`
(ring, tree, unpipelined hierarchical).

Kernel time, per level that compresses, over the fp32 elements it handles:

    K(n) = compress_launch_s + 3 * 4 n / (compress_mem_eff * HBM bytes/s)

three passes over the fp32 buffer through device memory (read fp32 and write
codes on the sender, read codes and write fp32 on the owner and after the
gather); both constants live in `Calibration`.

>>> from cost_models.topology import Topology
>>> from cost_models.comm import CommModel
>>> cm = CommModel(Topology(nodes=4, devices_per_node=8, device="H100-80GB", inter_node_GBps=1.25))
>>> none = all_reduce_time(1.3e9, range(32), cm, {"intra_node": "none", "inter_node": "none"})
>>> int8 = all_reduce_time(1.3e9, range(32), cm, {"intra_node": "none", "inter_node": "int8"})
>>> round(none.wire_s, 2), round(int8.wire_s, 2), round(int8.kernel_s * 1e3, 2)   # s, s, ms
(0.92, 0.23, 0.84)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Mapping, Sequence

from cost_models.comm import CommModel, calibrated_link, pairwise_all_to_all, ring_all_gather, ring_reduce_scatter
from cost_models.memory import DDP_BUCKET_BYTES
from cost_models.specs import LinkLevel, LinkSpec

__all__ = ["Compressor", "Level", "COMPRESSORS", "IMPLEMENTED", "SEARCHED", "LEVELS", "REDUCE_BYTES",
           "QUANT_BLOCK", "no_compression", "wire_bytes", "kernel_time", "traffic_levels", "ReduceTime",
           "all_reduce_time"]

Compressor = Literal["none", "bf16", "int8", "int4", "powersgd"]
Level = Literal["intra_node", "inter_node"]

COMPRESSORS: tuple[str, ...] = ("none", "bf16", "int8", "int4", "powersgd")
IMPLEMENTED: tuple[str, ...] = ("none", "bf16", "int8", "int4")  # what runtime.data_parallel runs
# What the search tries, least lossy first: on equal predicted time the less lossy one wins.
SEARCHED: tuple[str, ...] = IMPLEMENTED
LEVELS: tuple[str, ...] = (LinkLevel.INTRA_NODE.value, LinkLevel.INTER_NODE.value)

REDUCE_BYTES = 4  # gradients are reduced in fp32 (runtime.mixed_precision.Precision.reduce_dtype)
QUANT_BLOCK = 256  # elements per fp32 absmax scale (runtime.compressed_reduce.CompressedReduce.block)
_SCALE_BYTES = 4
_CODE_BYTES = {"int8": 1.0, "int4": 0.5}
_KERNEL_PASSES = 3  # passes over the fp32 buffer: quantize (r+w), dequantize (r+w), on both sides


def no_compression() -> dict[str, str]:
    """The default: every level uncompressed."""
    return {level: "none" for level in LEVELS}


def wire_bytes(name: str, *, reduce_bytes: float = REDUCE_BYTES) -> float:
    """Bytes per gradient element on the wire with compressor `name`.

    >>> [wire_bytes(c) for c in ("none", "bf16", "int8", "int4")]
    [4, 2, 1.015625, 0.515625]
    >>> wire_bytes("bf16", reduce_bytes=2)   # bf16 gradients already: nothing to save
    2
    """
    if name == "none":
        return reduce_bytes
    if name == "bf16":
        return min(2, reduce_bytes)
    if name in _CODE_BYTES:
        return _CODE_BYTES[name] + _SCALE_BYTES / QUANT_BLOCK
    raise ValueError(f"compressor {name!r} has no cost model; modelled: {', '.join(IMPLEMENTED)}")


def kernel_time(numel: float, comm: CommModel) -> float:
    """Seconds of (de)quantization kernels over `numel` fp32 elements (see the module docstring)."""
    if numel <= 0:
        return 0.0
    cal = comm.calibration
    hbm = comm.topology.device.hbm_bytes_per_s * cal.compress_mem_eff
    return cal.compress_launch_s + _KERNEL_PASSES * REDUCE_BYTES * numel / hbm


def _shape(comm: CommModel, ranks: Sequence[int]) -> tuple[int, int, bool]:
    """(nodes spanned, most ranks on one node, same count on every spanned node)."""
    topo = comm.topology
    nodes, k = topo.nodes_spanned(ranks), topo.max_ranks_per_node(ranks)
    return nodes, k, nodes * k == len(set(ranks))


def traffic_levels(comm: CommModel, ranks: Sequence[int]) -> tuple[str, ...]:
    """The link levels a data-parallel group's gradient reduction crosses (none for one rank).

    >>> from cost_models.topology import Topology
    >>> cm = CommModel(Topology.parse("2x8xH100-80GB"))
    >>> traffic_levels(cm, range(16)), traffic_levels(cm, range(8)), traffic_levels(cm, (0, 8))
    (('intra_node', 'inter_node'), ('intra_node',), ('inter_node',))
    """
    ranks = tuple(ranks)
    if len(ranks) <= 1:
        return ()
    nodes, k, uniform = _shape(comm, ranks)
    if nodes == 1:
        return (LinkLevel.INTRA_NODE.value,)
    if uniform and k > 1:
        return LEVELS
    return (LinkLevel.INTER_NODE.value,)  # one rank per node, or a ragged group: flat over the slowest link


def _reduce_phase(numel: float, p: int, link: LinkSpec, name: str) -> float:
    """Each rank ends with the sum of its 1/p of `numel` elements: (p-1) alpha + (p-1)/p n w / B."""
    if name in _CODE_BYTES:
        return pairwise_all_to_all(numel * wire_bytes(name), p, link)
    return ring_reduce_scatter(numel * wire_bytes(name), p, link)


def _gather_phase(numel: float, p: int, link: LinkSpec, name: str) -> float:
    """Every rank ends with all `numel` elements: (p-1) alpha + (p-1)/p n w / B."""
    return ring_all_gather(numel * wire_bytes(name), p, link)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReduceTime:
    """A gradient all-reduce: seconds on the wire (which backward can hide) and in kernels (which it cannot)."""

    wire_s: float
    kernel_s: float


def all_reduce_time(numel: float, ranks: Sequence[int], comm: CommModel, compression: Mapping[str, str]) -> ReduceTime:
    """All-reduce `numel` fp32 gradient elements over `ranks`, compressed per level (module docstring).

    Levels the group does not cross are ignored.
    """
    ranks = tuple(ranks)
    levels = traffic_levels(comm, ranks)
    if numel <= 0 or not levels:
        return ReduceTime(wire_s=0.0, kernel_s=0.0)
    used = {lv: compression.get(lv, "none") for lv in levels}
    plain = all(c == "none" for c in used.values())
    if plain and levels != LEVELS:
        return ReduceTime(wire_s=comm.all_reduce(numel * REDUCE_BYTES, ranks), kernel_s=0.0)
    topo, cal = comm.topology, comm.calibration
    link = {lv: calibrated_link(topo.link(lv), cal) for lv in levels}
    nodes, k, _ = _shape(comm, ranks)
    if levels == LEVELS:
        ci, ce = used["intra_node"], used["inter_node"]
        intra, inter = link["intra_node"], link["inter_node"]
        t_intra = _reduce_phase(numel, k, intra, ci) + _gather_phase(numel, k, intra, ci)
        t_inter = _reduce_phase(numel / k, nodes, inter, ce) + _gather_phase(numel / k, nodes, inter, ce)
        buckets = math.ceil(numel * REDUCE_BYTES / DDP_BUCKET_BYTES)
        wire = max(t_intra, t_inter) + min(t_intra, t_inter) / buckets + cal.collective_base_latency_s
        if plain:
            return ReduceTime(wire_s=min(wire, comm.all_reduce(numel * REDUCE_BYTES, ranks)), kernel_s=0.0)
        kernel = (kernel_time(numel, comm) if ci != "none" else 0.0) + \
            (kernel_time(numel / k, comm) if ce != "none" else 0.0)
    else:
        (lv, c), = used.items()
        wire = _reduce_phase(numel, len(ranks), link[lv], c) + _gather_phase(numel, len(ranks), link[lv], c) \
            + cal.collective_base_latency_s
        kernel = kernel_time(numel, comm) if c != "none" else 0.0
    return ReduceTime(wire_s=wire, kernel_s=kernel)
