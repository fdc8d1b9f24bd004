"""PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression"): what it sends and computes.

The runtime compresses each gradient matrix M (a parameter with ndim >= 2,
viewed as (n, m) = (shape[0], prod(shape[1:]))) whose low-rank factors are
at most half its size, n m >= 2 r (n + m), with rank r = 4 and error
feedback, per bucket:

    P = M Q            all-reduce P   (n r fp32 elements)     2 n m r FLOP
    P = orthogonal(P)                                         ~2 n r^2 FLOP (Gram-Schmidt)
    Q = M^T P          all-reduce Q   (m r fp32 elements)     2 n m r FLOP
    approx = P Q^T; residual = M - approx                     2 n m r FLOP, ~4 passes of 4 n m bytes

Everything else (1-D parameters, small matrices) is all-reduced in fp32 as
it is. So a set of gradients of `numel` elements puts

    wire = sum over compressed matrices r (n + m) + sum over the rest numel

fp32 elements on the wire, a fraction f = wire / numel of the uncompressed
all-reduce; `LowRank` holds those sums, `low_rank` builds it from shapes.

Kernel time, a roofline over the whole sequence (the products are
(n x m)(m x r) with r = 4: 2 r FLOP per 4 bytes of M read, below every
device's ridge point, so the memory term decides on GPUs):

    K = compress_launch_s + L * batches * launch_overhead_s
        + max(FLOP / (fp32 peak * matmul_eff_max), 3 * 4 sum(n m) / (bw * lowrank_eff) + 3 * 4 sum(n m) / bw)
    bw = HBM bytes/s * device_speed * mem_eff

with FLOP = 6 r sum(n m) + 2 r^2 sum(n), six passes over each matrix: three
products (P = M Q and Q = M^T P read M, approx = P Q^T writes it), at the
products' own rate (`lowrank_eff` of the elementwise one: a GPU streams them,
a CPU's GEMM library does not), and three elementwise passes (M = G + E reads
G and E, the residual writes E: the runtime's fused prologue and epilogue) at
torch's elementwise rate, hence `mem_eff` rather than the quantizer's
`compress_mem_eff`; fp32 products (torch's default: no TF32 for matmul).
`runtime.compression.powersgd` stacks the matrices of one bucket by shape and works on
each stack batched, so launches go per (bucket, shape): at most one per
matrix, and about one per bucket of DDP_BUCKET_BYTES when a bucket holds one
shape (big matrices fill buckets alone; a small model's blocks repeat a few
shapes): batches = min(matrices, ceil(4 numel / DDP_BUCKET_BYTES)), L = 10
kernels per batch (_LAUNCHES_PER_BATCH).

>>> lr = low_rank([(2048, 6144), (6144,)])       # a GPT-3 XL c_fc weight and its bias
>>> lr.wire, lr.numel, round(lr.fraction, 5)      # 4 * (2048 + 6144) + 6144
(38912.0, 12589056.0, 0.00309)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from cost_models.compute import elementwise_bytes_per_s
from cost_models.memory import DDP_BUCKET_BYTES

if TYPE_CHECKING:
    from cost_models.comm import CommModel

__all__ = ["POWERSGD_RANK", "LowRank", "compressible", "low_rank", "powersgd_kernel_time"]

POWERSGD_RANK = 4  # runtime default rank (Vogels et al. use 1-4 for their language models)
_FP32 = 4
_PRODUCT_PASSES = 3  # passes of the fp32 matrix the products make, and the elementwise ones (module docstring)
_STREAM_PASSES = 3
# Kernels per batch of same-shape matrices in runtime.compression.powersgd: the fused prologue (M = G + E, P = M Q), two
# batched QRs (orthonormalise Q, then P; a few kernels each), Q = M^T P, the fused epilogue (approx, residual),
# the copies into and out of the bucket.
_LAUNCHES_PER_BATCH = 10


def compressible(shape: tuple[int, ...], rank: int = POWERSGD_RANK) -> bool:
    """Whether PowerSGD compresses a gradient of this shape (its rank-r factors are at most half its size).

    >>> compressible((768, 768)), compressible((768,)), compressible((8, 8))
    (True, False, False)
    """
    if len(shape) < 2:
        return False
    n, m = shape[0], math.prod(shape[1:])
    return n * m >= 2 * rank * (n + m)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LowRank:
    """PowerSGD's view of a set of gradients, in elements.

    numel: gradient elements; wire: fp32 elements each data-parallel
    reduction all-reduces (r (n + m) per compressed matrix, numel of the
    rest); matrix: elements inside compressed matrices, sum n m; rows: sum of
    n over them; matrices: how many. Sums of sets add and subtract.
    """

    rank: int = POWERSGD_RANK
    numel: float = 0.0
    wire: float = 0.0
    matrix: float = 0.0
    rows: float = 0.0
    matrices: float = 0.0

    @property
    def fraction(self) -> float:
        """wire / numel: the share of the uncompressed all-reduce's bytes that PowerSGD sends."""
        return self.wire / self.numel if self.numel > 0 else 1.0

    def _combine(self, other: LowRank, sign: float) -> LowRank:
        assert self.rank == other.rank, "LowRank sums of different ranks"
        return LowRank(rank=self.rank, **{f: getattr(self, f) + sign * getattr(other, f) for f in _SUMS})

    def __add__(self, other: LowRank) -> LowRank:
        return self._combine(other, 1.0)

    def __sub__(self, other: LowRank) -> LowRank:
        return self._combine(other, -1.0)

    def scaled(self, numel: float) -> LowRank:
        """The same mix of shapes for `numel` elements (every sum times numel / self.numel)."""
        if self.numel <= 0 or numel == self.numel:
            return self
        s = numel / self.numel
        return LowRank(rank=self.rank, **{f: getattr(self, f) * s for f in _SUMS})


_SUMS = ("numel", "wire", "matrix", "rows", "matrices")


def low_rank(shapes: Iterable[tuple[int, ...]], rank: int = POWERSGD_RANK) -> LowRank:
    """The sums of `LowRank` over gradients of these shapes."""
    numel = wire = matrix = rows = matrices = 0.0
    for shape in shapes:
        size = math.prod(shape)
        numel += size
        if compressible(shape, rank):
            n, m = shape[0], size // shape[0]
            wire += rank * (n + m)
            matrix, rows, matrices = matrix + size, rows + n, matrices + 1
        else:
            wire += size
    return LowRank(rank=rank, numel=numel, wire=wire, matrix=matrix, rows=rows, matrices=matrices)


def powersgd_kernel_time(lr: LowRank, comm: CommModel) -> float:
    """Seconds of PowerSGD's products, orthogonalisation and residual on one rank (module docstring)."""
    if lr.matrices <= 0:
        return 0.0
    cal, dev = comm.calibration, comm.topology.device
    r = lr.rank
    flops = 6 * r * lr.matrix + 2 * r * r * lr.rows
    bw = elementwise_bytes_per_s(dev, cal)
    streamed = _FP32 * lr.matrix * (_PRODUCT_PASSES / cal.lowrank_eff + _STREAM_PASSES) / bw
    body = max(flops / (dev.flops("fp32") * cal.device_speed * cal.matmul_eff_max), streamed)
    batches = min(lr.matrices, math.ceil(_FP32 * lr.numel / DDP_BUCKET_BYTES))
    return cal.compress_launch_s + _LAUNCHES_PER_BATCH * batches * cal.launch_overhead_s + body
