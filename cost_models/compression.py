"""Gradient compression of the data-parallel reduction: bytes on the wire and kernel time.

A compressor applies per link level ("intra_node", "inter_node") to the
data-parallel gradient reduction: the all-reduce of DDP and ZeRO-1, the
reduce-scatter of ZeRO-2/3 (and, at ZeRO-3 with int8/int4, the parameter
all-gathers). The runtime reduces gradients in fp32 under every precision
(`runtime.engines.mixed_precision`: master_dtype = fp32; pure bf16: 2 bytes), so that is the baseline:

    compressor  bytes per gradient element on the wire (w)   how it reduces
    none        4                                         ring/tree/hierarchical all-reduce of fp32
    bf16        2 (min(2, baseline): nothing saved if the baseline were 16-bit)   plain bf16 collective
    int8        1   + 4/256                               two-phase: all-to-all of codes, owners
    int4        1/2 + 4/256                               dequantize+sum+requantize, all-gather
    powersgd    4 f, f = LowRank.fraction (powersgd.py)   rank-4 factors P, Q: two fp32 all-reduces

int8/int4 are `runtime.compression.compressed_reduce` (blockwise absmax, one fp32 scale
per block of 256): each rank sends (p-1)/p n w in the all-to-all and again in
the all-gather, 2 (p-1)/p n w in all, the bandwidth term of a ring all-reduce
of n w bytes; its latency terms are those of a ring too ((p-1) alpha per phase).
PowerSGD is a ring all-reduce of f n fp32 elements, plus a second round's
latency (P before Q); f depends on the gradients' shapes (powersgd.py).

DDP / ZeRO-1. A group spanning N nodes with k ranks on each reduces
hierarchically: within the node at the intra_node compressor, across nodes
(on n/k elements, one group per local index) at the inter_node compressor,
then within the node again. Per link level, with R the reduce phase (ring
reduce-scatter, or the all-to-all of codes) and G the all-gather, each of n w bytes:

    T_intra = R(n, k, intra, c_intra) + G(n, k, intra, c_intra)
    T_inter = R(n/k, N, inter, c_inter) + G(n/k, N, inter, c_inter)

PowerSGD crosses both levels only as (intra "none", inter "powersgd"): an
fp32 all-reduce inside the node (T_intra as above), then each of the k
cross-node groups runs the same PowerSGD on all n elements:
T_inter = AR(f n 4, N, inter). It is never at intra_node with another
inter_node compressor (`combinations`).

The gradients go in B = ceil(4n / 25 MiB) buckets (DDP_BUCKET_BYTES), and
the two levels are different links, so bucket i's inter-node phase runs while
bucket i+1 is reduced inside the node: a pipeline, whose time is its
bottleneck plus the fill of one bucket through the other level,

    T = max(T_intra, T_inter) + min(T_intra, T_inter) / B

(so compressing the level that is not the bottleneck buys nothing). With
both levels "none" it is the fastest of that and `CommModel.all_reduce`
(ring, tree, unpipelined hierarchical).

ZeRO-2 / ZeRO-3. The gradient reduce-scatter is flat over the whole group
(never hierarchical) with one compressor c, the same on both levels when the
group crosses both: none and bf16 are `CommModel.reduce_scatter` of n w bytes,
int8/int4 the first phase of the two-phase collective alone, an all-to-all of
n w bytes (`CommModel.all_to_all`, over the group's slowest link) after
which each owner dequantizes and sums its shard. At ZeRO-3 with int8/int4 the
parameter all-gathers send int8 codes and one fp32 scale per 256 elements
(GATHER_CODE_BYTES = 1 + 4/256 per element instead of the compute dtype's 2
or 4). No PowerSGD there.

Kernel time over the fp32 elements a rank handles, per compressing level:

    K(n) = compress_launch_s + passes * 4 n / (compress_mem_eff * HBM bytes/s)

passes = 3 for an all-reduce (quantize on the sender, dequantize at the
owner and after the gather), 2 for a reduce-scatter (no gather); a
quantized parameter gather moves (n/p)(4 + 1) bytes to quantize the fp32
master shard and n (1 + a) to dequantize the gathered buffer, a = compute
dtype bytes (`runtime.compression.quantized_gather`).
PowerSGD's matrix work is `powersgd.powersgd_kernel_time`. The constants live
in `Calibration`.

>>> from cost_models.topology import Topology
>>> from cost_models.comm import CommModel
>>> from cost_models.powersgd import low_rank
>>> cm = CommModel(Topology(nodes=4, devices_per_node=8, device="H100-80GB", inter_node_GBps=1.25))
>>> none = all_reduce_time(1.3e9, range(32), cm, {"intra_node": "none", "inter_node": "none"})
>>> int8 = all_reduce_time(1.3e9, range(32), cm, {"intra_node": "none", "inter_node": "int8"})
>>> round(none.wire_s, 2), round(int8.wire_s, 2), round(int8.kernel_s * 1e3, 2)   # s, s, ms
(0.92, 0.23, 0.84)
>>> lr = low_rank([(2048, 6144)] * 100)                  # 1.26e9 elements in 100 matrices, f = 0.0026
>>> psgd = all_reduce_time(lr.numel, range(0, 32, 8), cm, {"inter_node": "powersgd"}, low_rank=lr)
>>> round(psgd.wire_s * 1e3, 1), round(psgd.kernel_s * 1e3, 1)                      # ms, ms
(18.6, 16.3)
>>> [round(reduce_scatter_time(1.3e9, range(0, 32, 8), cm, c).wire_s, 2) for c in ("none", "int8")]
[3.67, 0.93]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, Mapping, Sequence

from cost_models.comm import (
    CommModel,
    calibrated_link,
    pairwise_all_to_all,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from cost_models.memory import DDP_BUCKET_BYTES
from cost_models.powersgd import LowRank, powersgd_kernel_time
from cost_models.specs import LinkLevel, LinkSpec

__all__ = ["Compressor", "Level", "COMPRESSORS", "IMPLEMENTED", "SEARCHED", "LEVELS", "REDUCE_BYTES",
           "REDUCE_BYTES_OF_PRECISION",
           "QUANT_BLOCK", "GATHER_CODE_BYTES", "WEIGHT_CODES", "no_compression", "wire_bytes", "kernel_time", "traffic_levels",
           "combinations", "group_compressor", "ReduceTime", "all_reduce_time", "reduce_scatter_time",
           "gather_time", "group_shape"]

Compressor = Literal["none", "bf16", "int8", "int4", "powersgd"]
Level = Literal["intra_node", "inter_node"]

COMPRESSORS: tuple[str, ...] = ("none", "bf16", "int8", "int4", "powersgd")
IMPLEMENTED: tuple[str, ...] = COMPRESSORS  # what runtime.engines.data_parallel runs
# What the search tries, least lossy first: on equal predicted time the less lossy one wins.
SEARCHED: tuple[str, ...] = ("none", "bf16", "int8", "int4", "powersgd")
LEVELS: tuple[str, ...] = (LinkLevel.INTRA_NODE.value, LinkLevel.INTER_NODE.value)

REDUCE_BYTES = 4  # gradients are reduced in fp32 (runtime.engines.mixed_precision.Precision.master_dtype)
# ... except under pure bf16, whose gradients are bf16 (grad_reduce_dtype="bf16" under a mixed precision is
# the "bf16" compressor on every level: partitioner.planner.declarations.reduction_pins)
REDUCE_BYTES_OF_PRECISION = {"fp32": 4, "bf16-mixed": 4, "fp16-mixed": 4, "bf16": 2, "fp8-mixed": 4}
QUANT_BLOCK = 256  # elements per fp32 absmax scale (runtime.compression.compressed_reduce.CompressedReduce.block)
_SCALE_BYTES = 4
_CODE_BYTES = {"int8": 1.0, "int4": 0.5}
GATHER_CODE_BYTES = 1 + _SCALE_BYTES / QUANT_BLOCK  # ZeRO-3 int8/int4: parameters gathered as int8 codes
WEIGHT_CODES: tuple[str, ...] = tuple(_CODE_BYTES)  # the compressors under which ZeRO-3 gathers int8 weights
_ALL_REDUCE_PASSES = 3  # passes over the fp32 buffer: quantize (r+w), dequantize (r+w), on both sides
_REDUCE_SCATTER_PASSES = 2  # the sender's quantize (or cast), the owner's dequantize-and-sum


def no_compression() -> dict[str, str]:
    """The default: every level uncompressed."""
    return {level: "none" for level in LEVELS}


def wire_bytes(name: str, *, reduce_bytes: float = REDUCE_BYTES, low_rank: LowRank | None = None) -> float:
    """Bytes per gradient element on the wire with compressor `name` (PowerSGD: given the gradients' shapes).

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
    if name == "powersgd":
        if low_rank is None:
            raise ValueError("powersgd: its bytes depend on the gradients' shapes; pass low_rank=powersgd.low_rank(...)")
        return REDUCE_BYTES * low_rank.fraction
    raise ValueError(f"compressor {name!r} has no cost model; modelled: {', '.join(IMPLEMENTED)}")


def kernel_time(numel: float, comm: CommModel, *, passes: int = _ALL_REDUCE_PASSES) -> float:
    """Seconds of (de)quantization kernels over `numel` fp32 elements (see the module docstring)."""
    if numel <= 0:
        return 0.0
    cal = comm.calibration
    hbm = comm.topology.device.hbm_bytes_per_s * cal.compress_mem_eff
    return cal.compress_launch_s + passes * REDUCE_BYTES * numel / hbm


def group_shape(comm: CommModel, ranks: Sequence[int]) -> tuple[int, int, bool]:
    """(nodes spanned, most ranks on one node, same count on every spanned node)."""
    return _group_shape(comm.topology, tuple(ranks))


@functools.lru_cache(maxsize=4096)
def _group_shape(topo, ranks: tuple[int, ...]) -> tuple[int, int, bool]:
    # the search asks this of the same few data-parallel groups hundreds of thousands of times
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
    nodes, k, uniform = group_shape(comm, ranks)
    if nodes == 1:
        return (LinkLevel.INTRA_NODE.value,)
    if uniform and k > 1:
        return LEVELS
    return (LinkLevel.INTER_NODE.value,)  # one rank per node, or a ragged group: flat over the slowest link


def combinations(levels: Sequence[str], zero_stage: int) -> tuple[tuple[str, str], ...]:
    """The (intra_node, inter_node) compressors the runtime runs on a group crossing `levels`, least lossy first.

    >>> combinations(("intra_node",), 3)
    (('none', 'none'), ('bf16', 'none'), ('int8', 'none'), ('int4', 'none'))
    >>> [c for c in combinations(LEVELS, 0) if "powersgd" in c], combinations(LEVELS, 2)[2]
    ([('none', 'powersgd')], ('int8', 'int8'))
    """
    levels = tuple(levels)
    flat = SEARCHED if zero_stage <= 1 else tuple(c for c in SEARCHED if c != "powersgd")
    if not levels:
        return (("none", "none"),)
    if levels == LEVELS and zero_stage >= 2:
        return tuple((c, c) for c in flat)  # one flat reduce-scatter over both levels
    if levels == LEVELS:
        return tuple((a, b) for a in SEARCHED for b in SEARCHED
                     if "powersgd" not in (a, b) or (a, b) == ("none", "powersgd"))
    if levels == (LinkLevel.INTRA_NODE.value,):
        return tuple((c, "none") for c in flat)
    return tuple(("none", c) for c in flat)


def group_compressor(compression: Sequence[str]) -> str:
    """The one compressor of a ZeRO-2/3 group's flat reduce-scatter, from its (intra_node, inter_node) pair."""
    return next((c for c in compression if c != "none"), "none")


def _reduce_phase(numel: float, p: int, link: LinkSpec, name: str, reduce_bytes: float = REDUCE_BYTES) -> float:
    """Each rank ends with the sum of its 1/p of `numel` elements: (p-1) alpha + (p-1)/p n w / B."""
    if name in _CODE_BYTES:
        return pairwise_all_to_all(numel * wire_bytes(name), p, link)
    return ring_reduce_scatter(numel * wire_bytes(name, reduce_bytes=reduce_bytes), p, link)


def _gather_phase(numel: float, p: int, link: LinkSpec, name: str, reduce_bytes: float = REDUCE_BYTES) -> float:
    """Every rank ends with all `numel` elements: (p-1) alpha + (p-1)/p n w / B."""
    return ring_all_gather(numel * wire_bytes(name, reduce_bytes=reduce_bytes), p, link)


def _level_all_reduce(numel: float, p: int, link: LinkSpec, name: str, lr: LowRank | None,
                      reduce_bytes: float = REDUCE_BYTES) -> float:
    """One level's all-reduce of `numel` gradient elements over p ranks, compressed with `name`."""
    if name == "powersgd":  # P, then Q (with the uncompressed rest): a ring's bytes, two rounds of latency
        return ring_all_reduce(wire_bytes(name, low_rank=lr) * numel, p, link) + 2 * (p - 1) * link.latency_s
    return _reduce_phase(numel, p, link, name, reduce_bytes) + _gather_phase(numel, p, link, name, reduce_bytes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReduceTime:
    """A gradient collective: seconds on the wire (which backward can hide) and in kernels (which it cannot)."""

    wire_s: float
    kernel_s: float


def _check(levels: tuple[str, ...], used: Mapping[str, str], low_rank: LowRank | None) -> None:
    if "powersgd" not in used.values():
        return
    if low_rank is None:
        raise ValueError("powersgd: pass low_rank=powersgd.low_rank(gradient shapes); its cost depends on them")
    if levels == LEVELS and (used["intra_node"], used["inter_node"]) != ("none", "powersgd"):
        raise ValueError(f"{dict(used)}: a group crossing both levels runs PowerSGD only as intra_node 'none', "
                         "inter_node 'powersgd'")


def all_reduce_time(numel: float, ranks: Sequence[int], comm: CommModel, compression: Mapping[str, str], *,
                    low_rank: LowRank | None = None, reduce_bytes: float = REDUCE_BYTES) -> ReduceTime:
    """All-reduce `numel` gradient elements over `ranks`, compressed per level (module docstring).

    Levels the group does not cross are ignored. `low_rank`: the gradients'
    shapes (powersgd.low_rank), needed for "powersgd"; its mix of shapes is
    taken for `numel` elements. `reduce_bytes`: bytes of an uncompressed
    element, 4 (fp32) but 2 where the gradients are bf16 (pure bf16 training).
    """
    ranks = tuple(ranks)
    levels = traffic_levels(comm, ranks)
    if numel <= 0 or not levels:
        return ReduceTime(wire_s=0.0, kernel_s=0.0)
    used = {lv: compression.get(lv, "none") for lv in levels}
    _check(levels, used, low_rank)
    lr = low_rank.scaled(numel) if low_rank is not None else None
    plain = all(c == "none" for c in used.values())
    if plain and levels != LEVELS:
        return ReduceTime(wire_s=comm.all_reduce(numel * reduce_bytes, ranks), kernel_s=0.0)
    topo, cal = comm.topology, comm.calibration
    link = {lv: calibrated_link(topo.link(lv), cal) for lv in levels}
    nodes, k, _ = group_shape(comm, ranks)
    rounds = 2 if "powersgd" in used.values() else 1  # collectives in sequence, each paying the base latency
    if levels == LEVELS:
        ci, ce = used["intra_node"], used["inter_node"]
        intra, inter = link["intra_node"], link["inter_node"]
        t_intra = _level_all_reduce(numel, k, intra, ci, lr, reduce_bytes)
        # PowerSGD compresses the full matrices in each of the k cross-node groups; the others n/k each
        t_inter = _level_all_reduce(numel if ce == "powersgd" else numel / k, nodes, inter, ce, lr, reduce_bytes)
        buckets = math.ceil(numel * reduce_bytes / DDP_BUCKET_BYTES)
        wire = max(t_intra, t_inter) + min(t_intra, t_inter) / buckets + rounds * cal.collective_base_latency_s
        if plain:
            return ReduceTime(wire_s=min(wire, comm.all_reduce(numel * reduce_bytes, ranks)), kernel_s=0.0)
        kernel = (kernel_time(numel, comm) if ci != "none" else 0.0) + (
            powersgd_kernel_time(lr, comm) if ce == "powersgd" else kernel_time(numel / k, comm) if ce != "none"
            else 0.0)
    else:
        (lv, c), = used.items()
        wire = _level_all_reduce(numel, len(ranks), link[lv], c, lr, reduce_bytes) + rounds * cal.collective_base_latency_s
        kernel = powersgd_kernel_time(lr, comm) if c == "powersgd" else kernel_time(numel, comm) if c != "none" \
            else 0.0
    return ReduceTime(wire_s=wire, kernel_s=kernel)


def reduce_scatter_time(numel: float, ranks: Sequence[int], comm: CommModel, compressor: str, *,
                        reduce_bytes: float = REDUCE_BYTES) -> ReduceTime:
    """ZeRO-2/3's gradient reduce-scatter of `numel` elements over `ranks`, flat, with one compressor
    (`reduce_bytes` per uncompressed element: 4, or 2 for pure bf16's gradients).

    none/bf16: `CommModel.reduce_scatter` of n w bytes; int8/int4: the
    all-to-all of codes (the two-phase collective's first phase) and the
    kernels of two passes over the fp32 gradients.
    """
    ranks = tuple(ranks)
    if compressor == "powersgd":
        raise ValueError("powersgd: the runtime runs PowerSGD on the DDP/ZeRO-1 all-reduce only, not ZeRO-2/3's "
                         "reduce-scatter")
    if numel <= 0 or len(ranks) <= 1:
        return ReduceTime(wire_s=0.0, kernel_s=0.0)
    nbytes = numel * wire_bytes(compressor, reduce_bytes=reduce_bytes)
    wire = comm.all_to_all(nbytes, ranks) if compressor in _CODE_BYTES else comm.reduce_scatter(nbytes, ranks)
    kernel = kernel_time(numel, comm, passes=_REDUCE_SCATTER_PASSES) if compressor != "none" else 0.0
    return ReduceTime(wire_s=wire, kernel_s=kernel)


def gather_time(numel: float, ranks: Sequence[int], comm: CommModel, compressor: str, *,
                param_bytes: float) -> ReduceTime:
    """A ZeRO-3 parameter all-gather to `numel` elements over `ranks`: in the compute dtype (`param_bytes`
    per element), or as int8 codes + scales when the group's compressor is int8 or int4."""
    ranks = tuple(ranks)
    if numel <= 0 or len(ranks) <= 1:
        return ReduceTime(wire_s=0.0, kernel_s=0.0)
    if compressor not in WEIGHT_CODES:
        return ReduceTime(wire_s=comm.all_gather(numel * param_bytes, ranks), kernel_s=0.0)
    cal = comm.calibration
    # quantize this rank's fp32 master shard; dequantize every rank's codes into the gathered buffer
    moved = numel / len(ranks) * (REDUCE_BYTES + 1) + numel * (1 + param_bytes)
    kernel = cal.compress_launch_s + moved / (comm.topology.device.hbm_bytes_per_s * cal.compress_mem_eff)
    return ReduceTime(wire_s=comm.all_gather(numel * GATHER_CODE_BYTES, ranks), kernel_s=kernel)
