"""What a compressed gradient reduction holds in memory: its error feedback between steps, its working set while it runs.

Per fp32 byte of the gradient one reduction takes (a DDP/ZeRO-1/ZeRO-2 bucket, a
ZeRO-3 unit), the buffers `runtime.compression.grad_compression` allocates, counted as the
memory probe counts them (`runtime.launch.memory_probe`, tests/test_compression_memory.py):

=========  =====================  =====================================================================
compressor  held between steps     working set of one reduction, on top of the bucket itself
=========  =====================  =====================================================================
none       0                      0 (ZeRO-2/3: the shard it returns, counted by the memory model)
bf16       0                      all-reduce: the bucket divided by p, its bf16 copy (1.5);
                                  reduce-scatter: the same, and the bf16 shard and its fp32 copy;
                                  a ZeRO-3 unit's 16-bit gradient (below), divided in place: per
                                  byte of it, the bf16 shard and its fp32 copy (3/p) while drained
int8/int4  all-reduce: the phase   all-reduce: the bucket padded to whole blocks, its sum with the
           1 residual (1) and      residual, the dequantized codes (the new residual), the codes (1/4,
           phase 2's of this       int4: and their packing); reduce-scatter: the bucket divided by p and
           rank's chunk (1/p);     padded again to whole blocks per chunk first
           reduce-scatter: 1
powersgd   the residual of every  M = G + E, P Q^T, and the new residual
           matrix it factors (1)
=========  =====================  =====================================================================

The residuals are kept per bucket or unit (by its parameters' names), so a
stage holds them for all its gradients at once: `held` times the stage's
fp32 gradient bytes. The working set exists only while one reduction runs
(compressed reductions are synchronous, one at a time): `working` times the
largest bucket or unit.

A ZeRO-3 unit reduced at bf16 whose gradient is 16-bit already (the mixed precisions'
gradients of the gathered 16-bit parameters) is handed to the reduce-scatter as it is, in
bf16 and reduced in the background like an uncompressed one (`runtime.engines.zero3`): the
fp32 copy the other compressors take would be rounded to bf16 for the wire anyway. Its input
is then 2 bytes per element, not 4 (`input_bytes`), as FSDP2's with reduce_dtype=bf16 is.

Hierarchical (a group over N nodes of k ranks, DDP/ZeRO-1, two compressors):
the gradient divided by p and padded (2) is reduce-scattered inside the node
at the intra-node compressor (int8/int4: a phase-1 residual of the whole
gradient), its 1/k chunk all-reduced across nodes at the inter-node one
(int8/int4: (1 + 1/N) / k; PowerSGD runs on the whole gradient after an fp32
reduction inside the node: 1), and gathered in the node again (int8/int4:
phase 2's residual, 1/k); the largest of the three phases' working sets comes
on top.
"""

from __future__ import annotations

import dataclasses

from cost_models.compression import group_compressor

__all__ = ["ReductionMemory", "reduction_memory", "sixteen_bit_units"]

_BITS = ("int8", "int4")

# working set per fp32 byte reduced, flat (one compressor over the whole group)
_ALL_REDUCE_WORKING = {"none": 0.0, "bf16": 1.5, "int8": 3.25, "int4": 3.375, "powersgd": 3.0}
_REDUCE_SCATTER_WORKING = {"none": 0.0, "bf16": 1.625, "int8": 4.25, "int4": 4.375}


@dataclasses.dataclass(frozen=True)
class ReductionMemory:
    """Bytes per fp32 gradient byte: `held` from a step's reduction to the next (error feedback, per
    gradient byte of the stage), `working` while one reduction runs (per byte of that bucket or unit as
    the reduction takes it). `input_bytes`: bytes per element of a ZeRO-3 unit's gradient as its
    reduction takes it where that is not the engine's gradient buffers' dtype (2: the 16-bit gradient
    itself); None: the engine's."""

    held: float = 0.0
    working: float = 0.0
    input_bytes: float | None = None


def sixteen_bit_units(*, zero_stage: int, precision: str, compression_warmup: int = 0) -> bool:
    """Whether a bf16 reduction takes ZeRO-3's units' gradients as they are: they are 16-bit under every precision
    but fp32, and no uncompressed warm-up steps reduce them in fp32 first (runtime.engines.zero3).

    >>> sixteen_bit_units(zero_stage=3, precision="bf16-mixed"), sixteen_bit_units(zero_stage=3, precision="fp32")
    (True, False)
    """
    return zero_stage == 3 and precision != "fp32" and not compression_warmup


def reduction_memory(compression: tuple[str, str], *, zero_stage: int, dp: int,
                     nodes: int = 1, sixteen_bit_units: bool = False) -> ReductionMemory:
    """The buffers of a data-parallel group of `dp` ranks on `nodes` nodes reducing with this
    (intra_node, inter_node) compression at `zero_stage` (levels the group does not cross are "none").
    sixteen_bit_units: at ZeRO-3 the units' gradients are 16-bit (a mixed or pure 16-bit precision, no
    uncompressed warm-up steps), so a bf16 reduction takes them as they are (module docstring).

    >>> reduction_memory(("int8", "none"), zero_stage=0, dp=4)
    ReductionMemory(held=1.25, working=3.25, input_bytes=None)
    >>> reduction_memory(("int8", "none"), zero_stage=3, dp=4)
    ReductionMemory(held=1.0, working=4.25, input_bytes=None)
    >>> reduction_memory(("none", "int8"), zero_stage=1, dp=16, nodes=2)   # 8 ranks a node
    ReductionMemory(held=0.1875, working=3.125, input_bytes=None)
    >>> reduction_memory(("bf16", "none"), zero_stage=3, dp=4, sixteen_bit_units=True)
    ReductionMemory(held=0.0, working=0.75, input_bytes=2)
    """
    if dp <= 1:
        return ReductionMemory()
    intra, inter = compression
    if zero_stage >= 2:
        c = group_compressor(compression)  # one compressor over the whole group (runtime.compression.grad_compression)
        if c == "bf16" and zero_stage == 3 and sixteen_bit_units:
            return ReductionMemory(working=3.0 / dp, input_bytes=2)
        return ReductionMemory(held=1.0 if c in _BITS else 0.0, working=_REDUCE_SCATTER_WORKING[c])
    if nodes <= 1 or intra == inter and intra in ("none", "powersgd"):
        c = group_compressor(compression)
        held = {"int8": 1 + 1 / dp, "int4": 1 + 1 / dp, "powersgd": 1.0}.get(c, 0.0)
        return ReductionMemory(held=held, working=_ALL_REDUCE_WORKING[c])
    k = dp // nodes
    if inter == "powersgd":  # fp32 all-reduce in the node, then PowerSGD on the whole gradient across nodes
        return ReductionMemory(held=1.0, working=1.0 + _ALL_REDUCE_WORKING["powersgd"])
    held = (1 + 1 / k if intra in _BITS else 0.0) + ((1 + 1 / nodes) / k if inter in _BITS else 0.0)
    # on top of the divided and padded gradient (2), the most of: the reduce-scatter in the node (its own
    # division excepted), the cross-node all-reduce of this rank's 1/k chunk (the chunk and its working
    # set), the gather in the node (its output, and the chunk)
    working = 2.0 + max(_REDUCE_SCATTER_WORKING[intra] - 1.0, (1 + _ALL_REDUCE_WORKING[inter]) / k, 1 + 1 / k)
    return ReductionMemory(held=held, working=working)
