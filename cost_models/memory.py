"""Memory per rank: model state, activations, in-flight microbatches, buffers.

All results are bytes (floats: a sharded count such as 12P/64 need not be an
integer; round up where an allocation is meant). GB below means 1e9 bytes.

>>> round(model_state_bytes(7.5e9, precision="bf16-mixed", optimizer="adam",
...                         zero_stage=3, dp=64).total / 1e9, 3)     # ZeRO paper: 1.9 GB
1.875
"""

from __future__ import annotations

import dataclasses
import functools

from cost_models.choices import PRECISIONS, RECOMPUTE_POLICIES, SCHEDULES, ZERO_STAGES, Recompute
from cost_models.errors import PartitionerError

__all__ = [
    "PRECISIONS", "OPTIMIZERS", "ZERO_STAGES", "RECOMPUTE_POLICIES", "SCHEDULES",
    "DDP_BUCKET_BYTES", "MATRIX_PRODUCTS", "SELECTIVE_KEEPS", "ModelStateBytes", "model_state_bytes",
    "transformer_activation_bytes", "inflight_microbatches", "chunk_inflight", "chunk_live",
    "TemporaryBytes", "temporary_buffer_bytes", "process_fixed_bytes", "ALLOCATOR_SLACK", "allocator_slack",
]

OPTIMIZERS = ("adam", "sgd", "sgd-momentum")  # the optimizer state a parameter carries (see _BYTES)
# The ATen ops whose outputs selective recomputation keeps: matrix products and layer norms (Korthikanti et
# al. 2022), unless they read or write the s x s attention scores. torchtitan's per-op policy ("selective-op")
# keeps fused attention's outputs and those of every second matrix product in a block's forward order (the first,
# third, ...; one that reads or writes the scores is recomputed and not counted). The planner costs what they
# keep; the runtime's checkpoint policies (runtime.engines.recompute) save exactly these.
MATRIX_PRODUCTS = ("linear", "matmul", "mm", "addmm", "bmm", "baddbmm")
SELECTIVE_KEEPS = MATRIX_PRODUCTS + ("layer_norm",)

# Bytes per parameter: (params, grads, optimizer state).
# fp32: fp32 weights and grads; Adam keeps m and v in fp32 (8), SGD with
# momentum one fp32 buffer (4), plain SGD nothing.
# Mixed precision (ZeRO paper, Rajbhandari et al. 2020, section 3.1): 16-bit
# weights and grads (2 + 2); the optimizer keeps an fp32 master copy (4) plus
# its fp32 state: Adam m and v (8) -> K = 12; SGD-momentum 4 -> 8; SGD -> 4.
_MIXED = ("bf16-mixed", "fp16-mixed", "fp8-mixed")
_BYTES_PER_PARAM = {
    ("fp32", "adam"): (4, 4, 8),
    ("fp32", "sgd"): (4, 4, 0),
    ("fp32", "sgd-momentum"): (4, 4, 4),
    # fp8-mixed holds what bf16-mixed holds: its fp8 codes live only inside each GEMM (cost_models.fp8).
    **{(mixed, "adam"): (2, 2, 12) for mixed in _MIXED},
    **{(mixed, "sgd"): (2, 2, 4) for mixed in _MIXED},
    **{(mixed, "sgd-momentum"): (2, 2, 8) for mixed in _MIXED},
    # Pure bf16 (precision "bf16"): no masters; torch.optim keeps its state in the parameters' dtype,
    # so Adam's m and v are bf16 (2 + 2), SGD-momentum's buffer 2.
    ("bf16", "adam"): (2, 2, 4),
    ("bf16", "sgd"): (2, 2, 0),
    ("bf16", "sgd-momentum"): (2, 2, 2),
}

# torch DistributedDataParallel's default gradient bucket: bucket_cap_mb=25,
# which DDP converts as 25 * 1024 * 1024 bytes.
DDP_BUCKET_BYTES = 25 * 2**20


def _choice(field: str, value, valid) -> None:
    if value not in valid:
        raise PartitionerError(f"{field}={value!r} is not one of {list(valid)}")


def _positive(**kw) -> None:
    for k, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 1:
            raise PartitionerError(f"{k}={v!r} must be a number >= 1")


# --- model state --------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state held by one rank."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@functools.lru_cache(maxsize=8192)  # the planner asks for the same stage sizes hundreds of thousands of times
def model_state_bytes(num_params: float, *, precision: str, optimizer: str,
                      zero_stage: int, dp: int) -> ModelStateBytes:
    """Model state of one rank holding `num_params` parameters (before ZeRO).

    Per parameter: (params, grads, optimizer) bytes = (4, 4, 8) fp32 Adam,
    (4, 4, 4) fp32 SGD-momentum, (4, 4, 0) fp32 SGD, (2, 2, 12) mixed Adam
    (ZeRO paper's 2 + 2 + K, K = 12), (2, 2, 8) / (2, 2, 4) mixed SGD with /
    without momentum, (2, 2, 4) pure bf16 Adam (no masters, bf16 m and v).
    ZeRO stage s divides by dp (= N_d): stage >= 1 the optimizer state (the
    masters with it: Megatron's distributed optimizer is stage 1), >= 2 the
    grads, 3 the params. Mixed Adam (Psi = P):
      stage 0: 16P, 1: 4P + 12P/N_d, 2: 2P + 14P/N_d, 3: 16P/N_d;
    pure bf16 Adam: 8P, 4P + 4P/N_d, 2P + 6P/N_d, 8P/N_d.
    The gradient reduction's dtype (grad_reduce_dtype) changes bytes on the
    wire, not these: gradients accumulate in the same buffers either way.
    These are the papers' formulas; the planner (partitioner.planner.stage_costs)
    charges on top what the runtime's engine holds beyond them: the mixed
    precisions' gradients accumulated in fp32 (4 B, not 2) at stages 0-2.

    >>> s = model_state_bytes(7.5e9, precision="bf16-mixed", optimizer="adam",
    ...                       zero_stage=1, dp=64)
    >>> round(s.total / 1e9, 1)          # ZeRO paper, Figure 1: 31.4 GB
    31.4
    """
    _choice("precision", precision, PRECISIONS)
    _choice("optimizer", optimizer, OPTIMIZERS)
    _choice("zero_stage", zero_stage, ZERO_STAGES)
    _positive(dp=dp)
    if num_params < 0:
        raise PartitionerError(f"num_params={num_params} must be >= 0")
    p, g, o = _BYTES_PER_PARAM[precision, optimizer]
    return ModelStateBytes(
        params=num_params * p / (dp if zero_stage >= 3 else 1),
        grads=num_params * g / (dp if zero_stage >= 2 else 1),
        optimizer=num_params * o / (dp if zero_stage >= 1 else 1),
    )


# --- activations ----------------------------------------------------------
def transformer_activation_bytes(*, s: int, b: int, h: int, a: int, t: int = 1,
                                 recompute: Recompute = "none",
                                 sequence_parallel: bool = False) -> float:
    """Activation bytes one transformer layer keeps for backward, per microbatch.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models" (Table 2); s: sequence length, b: microbatch size,
    h: hidden size, a: attention heads, t: tensor-parallel degree.
      none:                 s b h (10 + 24/t + 5 a s / (h t))   (t = 1: 34 + 5as/h)
      none, seq. parallel:  s b h (34 / t + 5 a s / (h t))
      selective:            drops the 5 a s / h attention term: s b h (10 + 24/t),
                            or 34 s b h / t with sequence parallelism
      full:                 only the layer input, 2 s b h (/ t with seq. parallel)
    Assumes 16-bit activations and 1-byte dropout masks, as the paper does;
    the layer's own parameter-sized buffers are not counted.

    >>> transformer_activation_bytes(s=2048, b=1, h=12288, a=96) / 1e9    # GPT-3, 114 sbh
    2.868903936
    """
    _positive(s=s, b=b, h=h, a=a, t=t)
    _choice("recompute", recompute, RECOMPUTE_POLICIES)
    if recompute == "selective-op":
        raise PartitionerError("transformer_activation_bytes(recompute='selective-op'): the paper has no row for "
                               "torchtitan's per-op policy (what it keeps depends on the order of the layer's "
                               "matrix products); compile() counts it from the traced graph")
    sbh = s * b * h
    attention = 5 * a * s / (h * t)  # the softmax/dropout/QK^T term, paper's 5as/h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    rest = 34 / t if sequence_parallel else 10 + 24 / t
    return sbh * (rest + (attention if recompute == "none" else 0.0))


# --- the caching allocator ----------------------------------------------------
# Device memory torch's caching allocator reserves over what the step's tensors take at its peak (reserved /
# allocated), by recompute mode, with expandable segments (which the runtime turns on for CUDA ranks:
# runtime.device.placement). Measured by bench/gpu_memory.py on an H200 (docs/benchmarks.md): 1.020-1.028
# without recomputation, 1.120 with full recomputation (its many short-lived buffers of varying sizes); taken
# with some margin. Where max_memory_fraction is not pinned, a plan fits when its predicted peak times this
# slack fits in the device's memory.
ALLOCATOR_SLACK = {"none": 1.05, "selective": 1.05, "full": 1.12, "selective-op": 1.05}


def allocator_slack(recompute: str, blocks: tuple[int, int] = (1, 1)) -> float:
    """ALLOCATOR_SLACK of a recompute mode; full recomputation of k of every n blocks (recompute_blocks) takes
    k / n of the way from none's to full's, the short-lived buffers of recomputation coming from the blocks
    recomputed.

    >>> allocator_slack("none"), allocator_slack("full"), round(allocator_slack("full", (1, 2)), 3)
    (1.05, 1.12, 1.085)
    """
    _choice("recompute", recompute, RECOMPUTE_POLICIES)
    if recompute != "full":
        return ALLOCATOR_SLACK[recompute]
    k, n = blocks
    return ALLOCATOR_SLACK["none"] + (ALLOCATOR_SLACK["full"] - ALLOCATOR_SLACK["none"]) * k / n


# --- fixed per process -------------------------------------------------------
def process_fixed_bytes(*, process_bytes: float, comm_buffer_bytes: float, communicators: int) -> float:
    """Device memory a rank holds however small its model: the process's own (driver context,
    loaded kernels) plus one set of collective-library buffers per communicator it uses.

    The device preset gives both (cost_models.devices: CUDA context, NCCL's per-channel
    buffers); a rank of a dp x tp x pp mesh talks in one group per dimension larger than 1.

    >>> process_fixed_bytes(process_bytes=723 * 2**20, comm_buffer_bytes=294 * 2**20, communicators=2) / 2**20
    1311.0
    """
    for k, v in {"process_bytes": process_bytes, "comm_buffer_bytes": comm_buffer_bytes,
                 "communicators": communicators}.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise PartitionerError(f"{k}={v!r} must be a number >= 0")
    return float(process_bytes + communicators * comm_buffer_bytes)


# --- pipeline schedules -------------------------------------------------------
def inflight_microbatches(schedule: str, *, pp: int, stage: int, num_microbatches: int,
                          interleave: int = 1) -> int:
    """Microbatches whose activations a pipeline stage holds at its peak.

      gpipe: all m forwards run before any backward: m.
      1f1b: stage i warms up with pp - i forwards, then alternates
          (Narayanan et al. 2021, PipeDream-Flush / Megatron): min(m, pp - i).
      interleaved-1f1b (Narayanan et al. 2021, SC'21, section 2.2), each
          stage holds `interleave` (v) model chunks of 1/v of its layers.
          Megatron-LM's warm-up (schedules.py,
          forward_backward_pipelining_with_interleaving) runs
          (pp - i - 1) * 2 + (v - 1) * pp forwards, then one more before the
          first backward: min(that + 1, m * v), counted in chunk-microbatches
          (each 1/v of a stage-microbatch's activations). Stage 0 thus holds
          pp * (1 + (pp - 1) / (pp v)) stage-microbatches' worth, the paper's
          figure.
      zb-h1 (Qi et al. 2023): 1F1B's order with each weight-gradient pass (W)
          deferred into the cool-down; a microbatch's activations stay until its
          W, so every stage holds min(m, pp), 1F1B's first stage's count.

    >>> inflight_microbatches("1f1b", pp=4, stage=0, num_microbatches=8)
    4
    >>> inflight_microbatches("interleaved-1f1b", pp=4, stage=0, num_microbatches=8, interleave=2)
    11
    >>> inflight_microbatches("zb-h1", pp=4, stage=3, num_microbatches=8)
    4
    """
    _choice("schedule", schedule, SCHEDULES)
    _positive(pp=pp, num_microbatches=num_microbatches, interleave=interleave)
    if not 0 <= stage < pp:
        raise PartitionerError(f"stage={stage} must lie in 0..{pp - 1} for pp={pp}")
    m = num_microbatches
    if schedule != "interleaved-1f1b":
        if interleave != 1:
            raise PartitionerError(f"interleave={interleave} applies only to "
                                   f"schedule='interleaved-1f1b', not {schedule!r}")
        return m if schedule == "gpipe" else min(m, pp) if schedule == "zb-h1" else min(m, pp - stage)
    if interleave < 2:
        raise PartitionerError("schedule='interleaved-1f1b' needs interleave >= 2 model "
                               "chunks per stage; with 1 chunk use schedule='1f1b'")
    return min(_interleaved_warmup(pp, stage, interleave) + 1, m * interleave)


def _interleaved_warmup(pp: int, stage: int, interleave: int) -> int:
    """Forwards pipeline rank `stage` runs before its first backward in Megatron-LM's interleaved order
    (partitioner.planner.schedule, before capping at the m * interleave it has)."""
    return (pp - stage - 1) * 2 + (interleave - 1) * pp


@functools.lru_cache(maxsize=4096)
def chunk_inflight(*, pp: int, stage: int, num_microbatches: int, interleave: int) -> tuple[int, ...]:
    """Interleaved 1F1B: per model chunk of pipeline rank `stage`, the most microbatches whose forward
    is done and backward not yet, in the order partitioner.planner.schedule runs them (Megatron-LM's: the k-th
    forward of a rank runs chunk (k mod pp v) // pp, the k-th backward chunk v - 1 - (k mod pp v) // pp).

    What the rank's total (`inflight_microbatches`) does not say is how it splits: the first chunks
    fill during the warm-up, the last (holding the loss, often the largest) hardly. The chunks peak at
    different moments, so these peaks summed exceed the rank's total; `chunk_live` gives the moments.

    >>> chunk_inflight(pp=2, stage=1, num_microbatches=2, interleave=2)    # 3 in all: 2 + 1, not 2 + 2
    (2, 1)
    >>> chunk_inflight(pp=4, stage=0, num_microbatches=8, interleave=2)   # 11 in all, 12 chunk peaks
    (8, 4)
    """
    live = chunk_live(pp=pp, stage=stage, num_microbatches=num_microbatches, interleave=interleave)
    return tuple(max(vec[c] for vec in live) for c in range(interleave))


@functools.lru_cache(maxsize=4096)
def chunk_live(*, pp: int, stage: int, num_microbatches: int, interleave: int) -> tuple[tuple[int, ...], ...]:
    """Interleaved 1F1B: the microbatches in flight per model chunk of pipeline rank `stage` right after each of
    its forwards (the moments its activations peak), those no other moment covers chunk by chunk. A rank whose
    chunks keep a_c bytes per microbatch holds at most max over these of sum_c live_c a_c: the exact peak, where
    `chunk_inflight`'s per-chunk peaks summed count microbatches no moment holds together (63 for the 47 of
    rank 0 at pp 8, 5 chunks, 64 microbatches). After the warm-up both sequences repeat every pp v steps, so
    two periods find every moment.

    >>> chunk_live(pp=2, stage=1, num_microbatches=2, interleave=2)
    ((2, 1),)
    >>> chunk_live(pp=4, stage=0, num_microbatches=8, interleave=2)      # the rank's 11 together, or chunk 0's 8
    ((7, 4), (8, 3))
    """
    _positive(pp=pp, num_microbatches=num_microbatches, interleave=interleave)
    pv, total = pp * interleave, num_microbatches * interleave
    warmup = min(_interleaved_warmup(pp, stage, interleave), total)
    live, seen = [0] * interleave, set()

    def forward(k: int) -> None:
        live[(k % pv) // pp] += 1
        seen.add(tuple(live))

    for k in range(warmup):
        forward(k)
    for k in range(min(total - warmup, 2 * pv + 1)):
        forward(warmup + k)
        live[interleave - 1 - (k % pv) // pp] -= 1
    # the moments no other covers: a covering moment holds strictly more in all, so taken by falling sums each is
    # checked against the uncovered ones before it only (a few), not every moment
    uncovered: list[tuple[int, ...]] = []
    for u in sorted(seen, key=sum, reverse=True):
        if not any(all(a <= b for a, b in zip(u, w)) for w in uncovered):
            uncovered.append(u)
    return tuple(sorted(uncovered))


# --- temporary buffers ------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class TemporaryBytes:
    """Short-lived buffers of one rank at its peak (bytes)."""

    dp_bucket: float
    gathered_params: float
    logits: float

    @property
    def total(self) -> float:
        return self.dp_bucket + self.gathered_params + self.logits


def temporary_buffer_bytes(*, dp: int = 1, zero_stage: int = 0,
                           bucket_bytes: float = DDP_BUCKET_BYTES,
                           largest_block_param_bytes: float = 0.0, prefetch: bool = True,
                           b: int = 0, s: int = 0, vocab: int = 0) -> TemporaryBytes:
    """Buffers that live for part of a step, beyond model state and activations.

      dp_bucket: one gradient bucket being reduced when dp > 1 (DDP's default
          25 MiB, `DDP_BUCKET_BYTES`), else 0.
      gathered_params: ZeRO-3 all-gathers a block's full parameters before
          use: largest_block_param_bytes (unsharded, compute dtype), times 2
          with prefetch (the block computing and the next one, FSDP's
          default), 0 for stages 0-2.
      logits: b * s * vocab * 4 bytes, the fp32 logits the loss reads (pass
          vocab / t under a vocabulary-parallel head; 0 on non-last stages).

    >>> temporary_buffer_bytes(dp=8, zero_stage=3, largest_block_param_bytes=1e8,
    ...                        b=1, s=2048, vocab=50304).total
    638304768.0
    """
    _positive(dp=dp)
    _choice("zero_stage", zero_stage, ZERO_STAGES)
    for k, v in {"bucket_bytes": bucket_bytes,
                 "largest_block_param_bytes": largest_block_param_bytes,
                 "b": b, "s": s, "vocab": vocab}.items():
        if v < 0:
            raise PartitionerError(f"{k}={v} must be >= 0")
    gathered = largest_block_param_bytes * (2 if prefetch else 1) if zero_stage == 3 else 0.0
    return TemporaryBytes(
        dp_bucket=float(bucket_bytes) if dp > 1 else 0.0,
        gathered_params=float(gathered),
        logits=float(b * s * vocab * 4),
    )
