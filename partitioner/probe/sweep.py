"""What the probe measures: message and matrix sizes, repeats, and the groups of ranks per link level.

Groups run the way a plan runs them: every group of a size at once (the two pairs of local:4 reduce
together, as two data-parallel groups do), so a measurement carries the contention training sees.

>>> from cost_models.topology import Topology
>>> groups_by_level(Topology.parse("2x4xA100-80GB"))
{'intra_node': {2: [[0, 1], [2, 3], [4, 5], [6, 7]], 4: [[0, 1, 2, 3], [4, 5, 6, 7]]}, 'inter_node': {2: [[0, 4], [1, 5], [2, 6], [3, 7]]}}
>>> Sweep.quick().message_bytes
(4096, 65536, 1048576)
"""

from __future__ import annotations

import dataclasses

from cost_models.calibration import COLLECTIVE_OPS
from cost_models.errors import PartitionerError
from cost_models.topology import Topology

__all__ = ["COLLECTIVES", "MATMUL_DTYPES", "Sweep", "groups_by_level"]

COLLECTIVES = tuple(op for op in COLLECTIVE_OPS if op != "broadcast")  # no plan prices a broadcast


MATMUL_DTYPES = ("fp32", "bf16", "fp16", "fp8")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sweep:
    """The probe's sizes and repeats.

    message_bytes: the collectives' full buffers (nccl-tests' sizes, 4 KiB to 64 MiB by 4x, as large as the
        gradient buckets and gathered logits a small model's plan sends; a cluster run may pass larger).
        matmul_sizes: n of the n x n x n products per dtype
        ("fp8": e4m3 codes through torch._scaled_mm, measured only where the device has FP8 tensor cores). stream_bytes: the buffer the memory
        bandwidth copy moves, the fp32 parameters the optimizer step and the matrices PowerSGD's product are
        timed on; elementwise_bytes:
        the operands of the memory-bound ops timed; overlap_bytes: the all-reduce hidden behind matmuls;
        attention_shape: (batch, heads, sequence, head dim) of the fused attention timed. loss_shape: (tokens,
        vocabulary) of the fp32 logits the cross entropy is timed on. repeats: timed runs per point (the median
        is kept), after one untimed.
    max_op_s: a point slower than this ends its size sweep (the larger sizes would only cost time), so the
        probe stays within about a minute on a slow machine.
    """

    message_bytes: tuple[int, ...] = tuple(4096 * 4 ** k for k in range(8))
    matmul_sizes: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    stream_bytes: int = 32 * 2 ** 20
    elementwise_bytes: int = 4 * 2 ** 20
    overlap_bytes: int = 4 * 2 ** 20
    attention_shape: tuple[int, int, int, int] = (1, 8, 1024, 64)
    loss_shape: tuple[int, int] = (512, 8192)
    repeats: int = 5
    max_op_s: float = 0.3
    collectives: tuple[str, ...] = COLLECTIVES

    def __post_init__(self) -> None:
        bad = sorted(set(self.collectives) - set(COLLECTIVES))
        if bad:
            raise PartitionerError(f"Sweep.collectives: unknown {bad}; choose from {list(COLLECTIVES)}")
        odd = sorted(set(self.dtypes) - set(MATMUL_DTYPES))
        if odd:
            raise PartitionerError(f"Sweep.dtypes: unknown {odd}; choose from {list(MATMUL_DTYPES)}")
        if self.repeats < 1 or not self.message_bytes or not self.matmul_sizes:
            raise PartitionerError("Sweep: repeats >= 1 and at least one message and one matmul size are needed")

    @classmethod
    def quick(cls) -> "Sweep":
        """A few seconds' sweep (tests; a first look)."""
        return cls(message_bytes=(4096, 65536, 1048576), matmul_sizes=(64, 256), dtypes=("fp32",),
                   stream_bytes=8 * 2 ** 20, elementwise_bytes=2 ** 20, overlap_bytes=2 ** 20,
                   attention_shape=(1, 4, 256, 64), loss_shape=(128, 2048), repeats=3)

    @classmethod
    def for_gpu(cls) -> "Sweep":
        """nccl-tests-like sizes up to 256 MiB and matmuls up to 8192: a GPU is far from its plateau at 1024."""
        return cls(message_bytes=tuple(4096 * 4 ** k for k in range(10)),
                   matmul_sizes=(256, 512, 1024, 2048, 4096, 8192), dtypes=("fp32", "bf16", "fp16", "fp8"),
                   stream_bytes=2 ** 30, elementwise_bytes=2 ** 28, overlap_bytes=2 ** 26,
                   attention_shape=(2, 16, 4096, 128), loss_shape=(8192, 32768), repeats=5)


def groups_by_level(topo: Topology) -> dict[str, dict[int, list[list[int]]]]:
    """level -> group size -> the disjoint groups of that size, every rank in at most one.

    Intra-node: consecutive ranks of each node, sizes 2, 4, ... up to the devices per node (and that count).
    Inter-node: one rank per node at the same local index, sizes 2, 4, ... up to the node count."""
    per, nodes = topo.devices_per_node, topo.nodes
    out: dict[str, dict[int, list[list[int]]]] = {}
    intra = {p: [[n * per + i * p + j for j in range(p)] for n in range(nodes) for i in range(per // p)]
             for p in _sizes(per)}
    if intra:
        out["intra_node"] = intra
    inter = {p: [[(i * p + j) * per + local for j in range(p)] for local in range(per) for i in range(nodes // p)]
             for p in _sizes(nodes)}
    if inter:
        out["inter_node"] = inter
    return out


def _sizes(n: int) -> list[int]:
    sizes, p = [], 2
    while p <= n:
        sizes.append(p)
        p *= 2
    return sizes + ([n] if n > 1 and n not in sizes else [])
