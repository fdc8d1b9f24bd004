"""Calibration: every tunable factor of the cost models, in one frozen record.

The compute, communication and memory formulas (compute.py, comm.py,
memory.py) are textbook models; what makes them predict a real machine are
the few factors held here. The defaults come from published measurements
(each field names its source); `partitioner autotune` fits them to measured
step times by least squares and stores them with `save`/`load` as JSON.

>>> Calibration().matmul_eff_max
0.75
>>> Calibration.from_dict({"mem_eff": 0.85}).mem_eff
0.85
>>> saturating_efficiency(1e9, eff_max=0.75, half_flops=1e9)
0.375
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

from cost_models.errors import PartitionerError

__all__ = ["COLLECTIVE_OPS", "Calibration", "saturating_efficiency"]


def saturating_efficiency(flops: float, *, eff_max: float, half_flops: float) -> float:
    """Fraction of peak FLOP/s an op of `flops` FLOP reaches (dimensionless).

    eff(F) = eff_max * F / (F + F_half)

    A Michaelis-Menten style curve: tiny ops are latency/occupancy bound
    (too few thread blocks to fill the SMs, tile quantisation, wave tails),
    large ops approach `eff_max`, and an op of exactly `half_flops` FLOP runs
    at half of `eff_max`. The shape follows the GEMM throughput-vs-size plots
    of NVIDIA's "Matrix Multiplication Background User's Guide" (Deep
    Learning Performance docs), which rise steeply and then plateau; the two
    parameters are fitted by the autotuner.

    >>> saturating_efficiency(1e9, eff_max=0.8, half_flops=1e9)
    0.4
    >>> round(saturating_efficiency(1e12, eff_max=0.8, half_flops=1e9), 4)
    0.7992
    """
    if flops <= 0:
        return 0.0
    return eff_max * flops / (flops + half_flops)


_FRACTIONS = (  # fields that are a fraction in (0, 1]
    "matmul_eff_max", "conv_eff_max", "attention_eff_max", "vector_eff",
    "mem_eff", "optimizer_eff", "compress_mem_eff", "lowrank_eff", "loss_eff",
)
# Not numbers: checked by their own rules in __post_init__.
_STRUCTURED = ("source", "matmul_eff_by_dtype", "collective_bw_eff", "probe")
# The collectives cost_models.comm.CommModel prices, by the names collective_bw_eff takes.
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")

# Per device preset: the fields whose literature default does not hold there.
_DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    # The CPU runtime quantizes with the torch reference (runtime.compression.quantize), not a fused kernel:
    # ~1.7 GB/s of fp32 per pass measured on this project's machine, of its 20 GB/s "HBM" (devices.py).
    # torch.optim.AdamW (foreach, torch's default on CPU too) steps gpt_small's 5.29M fp32 parameters in 23.9 ms on one
    # thread of this machine: 6.2 GB/s at 28 B per parameter, 0.31 of the 20 GB/s (for-loop 6.4, fused=True 32).
    # PowerSGD's product (bmm of gpt_small's 5.28M gradient elements by 4 columns, 3 passes) runs at ~4.5 GB/s there.
    # F.cross_entropy forward and backward over gpt_small's logits (512 x 8192 fp32, 5 passes) streams 4.7 GB/s on one
    # thread, where the probe's elementwise kernels stream 21 (a fresh 16 MB tensor per pass: page faults).
    # `partitioner probe --topology local:2` on this machine (docs/benchmarks.md, "The CPU's GEMM curve"): a matmul
    # reaches half its plateau at 1.9e5 FLOP in fp32 and 5.9e6 in bf16, not the 1e9 of a GPU, which priced every
    # small GEMM of a CPU run at >= 27 ms (the example GPT on local:2 at 1.18 s a step, measured 16 ms); 1e6 lies
    # between the two.
    "CPU": {"compress_mem_eff": 0.085, "optimizer_eff": 0.31, "lowrank_eff": 0.22,  # 1.7, 6.2, 4.5 GB/s / 20e9
            "loss_eff": 0.22, "gemm_half_flops": 1e6},  # 4.7 / 21 GB/s
    # Measured by `partitioner probe` on one H100 80GB HBM3 (SXM) with torch 2.11 (docs/benchmarks.md, "On a lent
    # H100"): large GEMMs at 73 % (bf16), 69 % (fp16), 77 % (fp32) of the datasheet peaks; torch's elementwise
    # kernels at 82 % of HBM; fused causal attention (SDPA, 2 x 16 heads x 4096 x 128, fwd+bwd) at 690 TFLOP/s
    # counted over the full L x S products, 345 TFLOP/s over the causal half the tracer counts now (FlashAttention-2's
    # convention; the ~35 % of peak Shah et al. 2024 report for it on an H100): attention_eff_max = 0.365 (0.73 / 2).
    # fp8: not probed on the H100; its GEMMs (torch._scaled_mm, e4m3) as measured on the H200 below, the same chip.
    # optimizer_eff and lowrank_eff: not probed on the H100; torch's foreach AdamW and PowerSGD's product as measured
    # on the H200 below (each a fraction of HBM set by its kernels, the same on the same chip).
    "H100-80GB": {"matmul_eff_by_dtype": {"bf16": 0.73, "fp16": 0.69, "fp32": 0.77, "fp8": 0.64}, "mem_eff": 0.82,
                  "attention_eff_max": 0.365, "optimizer_eff": 0.26, "lowrank_eff": 0.52},
    # Measured by `partitioner probe` on one H200 (SXM, 141 GB HBM3e) with torch 2.11 (docs/benchmarks.md, "On a
    # lent H200"): the same GH100 chip at the same clocks (devices.py), and its GEMM plateaus agree with the H100's
    # within 2 points (bf16 72 %, fp16 69 %, fp32 75 %); fp8 GEMMs at 64 % of the 1,979 TFLOP/s fp8 peak
    # (1,269 TFLOP/s, against bf16's 711: 1.78x); elementwise kernels at 83 % of its 4.8 TB/s; fused causal
    # attention at 745 TFLOP/s over the full products, 372 over the causal half the tracer counts
    # (attention_eff_max 0.40, 0.80 / 2); torch.optim.AdamW (foreach, its default) stepped 1.49e9 fp32 parameters in
    # 32.8 ms inside the runtime: 1.27 TB/s at 28 B per parameter, 0.26 of 4.8 TB/s. PowerSGD's product (torch.bmm of
    # 1024 x 1024 fp32 matrices by 4 columns, the probe's lowrank_bytes_per_s) at 2.02 TB/s, 0.52 of the elementwise
    # kernels' 3.92 TB/s (a later H200 probe, torch 2.11, 2026-11-26; docs/benchmarks.md).
    "H200-141GB": {"matmul_eff_by_dtype": {"bf16": 0.72, "fp16": 0.69, "fp32": 0.75, "fp8": 0.64}, "mem_eff": 0.83,
                   "attention_eff_max": 0.40, "optimizer_eff": 0.26, "lowrank_eff": 0.52},
}
# A100 (40 and 80 GB): no probe has run on one. Its 16-bit GEMMs at 0.68 of the 312 TFLOP/s peak, attention scaled
# alike (0.6 x 0.68 / 0.75): the least-squares fit to the nine published A100 runs of the development set, each with
# the recomputation it ran (bench/fidelity; docs/benchmarks.md, "What an A100 sustains"): torchtitan's FSDP2 Llama
# rows on 64 A100s without AC, with full AC and with its per-op selective AC ("selective-op"; its performance page at
# 157a12c5), and MT-NLG 530B on 2240-3360 A100s (Smith et al. 2022, Megatron-DeepSpeed; full recomputation, as its
# hardware to model FLOP/s ratio of 1.34 shows). At 0.68 they are -12 % to +10 % (median |error| 6 %); at 0.75
# -20 % to +2 %, at 0.62 -4 % to +16 %. Isolated large GEMMs reach ~0.8 of peak; a training step sustains less
# (clocks under the power cap of eight busy GPUs, the overlapped collectives' kernels on the same SMs).
_DEVICE_DEFAULTS["A100-80GB"] = _DEVICE_DEFAULTS["A100-40GB"] = {"matmul_eff_by_dtype": {"bf16": 0.68, "fp16": 0.68}}
# The H800 is an H100 SXM5 with NVLink cut (devices.py): the same chip, clocks and HBM, so the H100's measured factors.
_DEVICE_DEFAULTS["H800-80GB"] = _DEVICE_DEFAULTS["H100-80GB"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """Tunable factors of the cost models; units in each field's comment.

    Compute (compute.RooflineCompute):
      matmul_eff_max: plateau of the matmul efficiency curve (fraction of the
          dtype's dense peak). Large cuBLAS GEMMs reach ~70-80 % of peak on
          A100/H100 (NVIDIA "Matrix Multiplication Background User's Guide");
          Megatron-LM end to end reaches 52 % of peak, 163 of 312 TFLOP/s
          per A100 (Narayanan et al. 2021, "Efficient Large-Scale Language
          Model Training on GPU Clusters Using Megatron-LM", SC'21).
      conv_eff_max: plateau for convolutions, a little under matmul:
          implicit-GEMM convolutions reach GEMM-like throughput when channels
          are multiples of 8 (NVIDIA "Convolutional Layers User's Guide").
      attention_eff_max: plateau for fused attention: FlashAttention-2 reaches
          50-73 % of A100 peak (Dao 2023, "FlashAttention-2"), taken as 0.6.
      gemm_half_flops: F_half of the curve, FLOP; 1e9 puts a 1 GFLOP GEMM at
          half of the plateau (a 1 GFLOP GEMM is ~3 us at A100 peak, about a
          kernel launch, so it cannot fill the GPU).
      vector_eff: compute ceiling of elementwise, reduction, embedding and
          other ops, as a fraction of the device's plain fp32 peak: they run
          on CUDA cores, not tensor cores (A100: 19.5 TFLOP/s fp32 vs 312
          TFLOP/s bf16 tensor, A100 datasheet). 1.0, the roofline's ideal
          ceiling: these ops are bandwidth bound, so it rarely decides.
      mem_eff: achieved fraction of HBM bandwidth for streaming kernels:
          STREAM-like measurements (BabelStream, Deakin et al. 2018) reach
          ~80-90 % of the datasheet bandwidth on V100/A100.
      optimizer_eff: the optimizer step's rate as a fraction of HBM bandwidth (x device_speed), its
          bytes counted as the least the update moves (cost_models.optimizer.optimizer_step_bytes: 28 B
          per fp32 Adam parameter). torch's default implementation, what the runtime runs for a
          torch.optim.AdamW, is foreach: eight elementwise kernels (decay, lerp into m, scale and addcmul
          into v, sqrt, divide, add eps, addcdiv into p) that move ~80 B per fp32 parameter, so at a
          STREAM-like 0.8 of HBM it reaches 0.8 x 28 / 80 = 0.28; measured on an H200 1.27 TB/s of
          4.8 (0.26; the probe there 0.262), fused=True 3.2 TB/s (0.67); on the CPU preset
          (for_device("CPU")) 6.2 GB/s of 20, 0.31. `partitioner probe` times torch.optim.AdamW. Plain
          SGD's step is one kernel that moves just its bytes: priced at mem_eff
          (cost_models.optimizer.optimizer_bytes_per_s).
      launch_overhead_s: seconds per kernel; CUDA launch costs a few
          microseconds per kernel (NVIDIA blog "Getting Started with CUDA
          Graphs", 2019).

    Communication (comm.CommModel), per link level:
      *_bw_eff: achieved bytes/s for large messages over the link's (a ratio > 0;
          a fraction of a datasheet link, but `partitioner probe` may find a link faster than
          a preset's estimate, e.g. the CPU preset's loopback, and then says so with > 1).
          Intra-node: nccl-tests all_reduce busbw on DGX A100 is about
          230-240 GB/s of 300 GB/s NVLink3 per direction = 0.78. Inter-node:
          NCCL over InfiniBand reaches about 85-90 % of line rate per NIC, 0.85.
          Same device: a memory copy, 1.0.
      *_extra_latency_s: seconds added to the link's latency (the alpha of
          alpha-beta) per algorithm step; 0 until fitted, since the
          topology presets already give per-hop latencies.
      collective_base_latency_s: fixed seconds per collective call: NCCL's
          own tuning model uses a base latency of 8.4 us for Ring/Simple
          (NCCL src/graph/tuning.cc, `baseLat`).

    Overlap:
      dp_overlap: fraction of the data-parallel gradient collectives hidden
          behind backward compute. DDP and ZeRO overlap bucketed reductions
          with backward (Li et al. 2020, "PyTorch Distributed", VLDB); the
          last bucket cannot overlap. A rule of thumb, 0.7, to be fitted.

    Gradient compression (compression.py):
      compress_mem_eff: fraction of HBM bandwidth the quantize/dequantize
          kernels reach over their three passes of the fp32 gradient: fused
          elementwise Triton kernels stream at STREAM-like rates, a little
          under `mem_eff` for the per-block absmax reduction, 0.7. The CPU
          preset (`for_device("CPU")`): the torch reference's measured
          ~1.7 GB/s of the process's 20 GB/s, 0.085.
      compress_launch_s: seconds per compressed reduction for its kernel
          launches and the small scale tensors (a few launches at
          `launch_overhead_s` each), 10 us. Also the per-gather kernels of
          ZeRO-3's int8 parameter gathers (quantize the shard, dequantize
          the gathered buffer), which stream at `compress_mem_eff` too.
      lowrank_eff: PowerSGD's products (powersgd.py), fp32 matmuls of a
          matrix by r = 4 columns, as a fraction of the elementwise rate
          (HBM x device_speed x mem_eff) their passes over the matrix reach.
          They are memory bound (2 r FLOP per 4 bytes, under every device's
          ridge point); 1 where they stream like the elementwise kernels (the
          GPU presets). A CPU's GEMM library runs them far slower: one thread
          of this project's machine multiplies at ~4.5 GB/s where its
          elementwise kernels stream ~20, the CPU preset's 0.22; four ranks on
          its two cores at 2.5 (`partitioner probe` measures it).
      loss_eff: the loss on the last stage (cost_models.compute.loss_times), a cross
          entropy over the model's output (log-softmax, then its backward into a
          zeroed gradient: five fp32 passes over the logits), as a fraction of the
          elementwise rate. 1 on the GPU presets (memory bound, torch's fused
          kernels); a CPU's exp-bound log-softmax over fresh tensors of a large
          vocabulary streams at ~0.2 of it (the CPU preset; `partitioner probe`
          measures it).
          The residual's passes stream at `mem_eff`, the FLOP term uses
          `matmul_eff_max` of the fp32 peak, and each of its ~10 kernels per
          batch of same-shape matrices costs `launch_overhead_s`.

    Device:
      device_speed: this machine's device against its preset (peak FLOP/s
          and memory bandwidth both): 1 for datasheet hardware. The CPU
          preset's numbers are an estimate for a share of an unknown CPU, so
          the fit moves this rather than push efficiencies past 1.

    Memory (partitioner/planner/stage_costs.py, StageEvaluator._peak_memory): a rank's peak is
      its model state at rest plus the largest of three moments of a backward
      (the loss's, a block's, the end's); each factor scales its bytes there.
      activation_mem_scale: measured / modelled activation bytes (saved
          tensors, recomputation's working set, the gradients into and out of
          a block's largest op); 1 until fitted. The model counts what autograd
          saves per op; allocator rounding and kernels' workspaces add a few
          percent.
      grad_mem_scale: measured / modelled gradient bytes live at the peak
          (flat gradient buffers held through the step, shard gradients and
          .grad once a backward formed them, reductions in flight); 1 until
          fitted.
      loss_mem_scale: measured / modelled memory of the loss on the last
          stage (the model assumes a cross-entropy: one output-sized tensor
          kept per microbatch in flight, two more in its backward); 1 until
          fitted, counted in the last stage's activations.
      buffer_mem_scale: measured / modelled buffers (ZeRO-3's gathered
          parameters, a pipeline stage's received output gradient); 1 until
          fitted.
      memory_overhead_bytes: bytes per rank the model does not see (runtime
          buffers, communication staging); 0 until fitted.

    Pipelines:
      pipeline_idle_cost: fraction of a pipeline rank's idle time (bubble,
          waits) that costs wall-clock time. 1 on dedicated devices (an idle
          GPU's time is lost); on a CPU shared by more processes than cores an
          idle rank yields its core to busy peers, so less is lost; fitted.

    Mixture of experts (partitioner/planner/expert_split.py):
      expert_imbalance: the busiest expert's routed tokens over the mean (>= 1), f: under expert
          parallelism (ep > 1) a rank holding one expert runs its expert FLOPs and keeps activations at the
          balanced share times f, one holding k experts at 1 + (f - 1) / sqrt(k) times it (the sum of k
          experts' loads: expert_split.rank_imbalance), and the all-to-alls wait for it; at ep = 1 no rank
          waits (each runs its own tokens through every expert). 1.25, the capacity factor Switch
          Transformer trains with (Fedus et al. 2022, "Switch Transformers", section 2.2: at 1.25 under
          1 % of tokens overflow their expert with its load-balancing loss), i.e. the busiest expert ~25 %
          above the mean;
          fitted (a time factor, seen only by ep > 1 trials).

    Measured by `partitioner probe` (partitioner/probe/):
      matmul_eff_by_dtype: per dtype ("fp32", "bf16", ...), the plateau of that dtype's
          measured matmul curve as a fraction of its peak (x device_speed); overrides
          matmul_eff_max for that dtype, and scales conv/attention alike. JSON: an object.
      collective_bw_eff: per collective (COLLECTIVE_OPS: "all_gather", ...), its own
          bandwidth against the link model's after the level's bw_eff: the ring formulas give
          every collective the link's rate, which NCCL comes near, but a backend's
          implementation need not (Gloo on a CPU gathers and reduce-scatters 1.5-2.5x slower
          than the ring all-reduce's rate predicts, at the sizes plans send). Absent: 1. JSON:
          an object.
      probe: what the probe measured and fitted (matmul curves, memory bandwidth, the fixed
          per-process memory, alpha-beta per collective, level and group size), kept as
          evidence beside the factors derived from it; never read by a cost formula, and
          left out of equality and hashing (two calibrations with the same factors predict
          the same). None when no probe ran.

    source: where the numbers come from (free text, e.g. "autotune 2x8xA100
        2025-01-01"); the defaults say "literature defaults".
    """

    matmul_eff_max: float = 0.75
    conv_eff_max: float = 0.7
    attention_eff_max: float = 0.6
    gemm_half_flops: float = 1e9
    vector_eff: float = 1.0
    mem_eff: float = 0.8
    optimizer_eff: float = 0.28
    launch_overhead_s: float = 5e-6

    same_device_bw_eff: float = 1.0
    intra_node_bw_eff: float = 0.78
    inter_node_bw_eff: float = 0.85
    same_device_extra_latency_s: float = 0.0
    intra_node_extra_latency_s: float = 0.0
    inter_node_extra_latency_s: float = 0.0
    collective_base_latency_s: float = 8.4e-6

    dp_overlap: float = 0.7

    compress_mem_eff: float = 0.7
    compress_launch_s: float = 10e-6
    lowrank_eff: float = 1.0
    loss_eff: float = 1.0

    device_speed: float = 1.0
    activation_mem_scale: float = 1.0
    grad_mem_scale: float = 1.0
    loss_mem_scale: float = 1.0
    buffer_mem_scale: float = 1.0
    memory_overhead_bytes: float = 0.0
    pipeline_idle_cost: float = 1.0
    expert_imbalance: float = 1.25

    matmul_eff_by_dtype: tuple[tuple[str, float], ...] = ()
    collective_bw_eff: tuple[tuple[str, float], ...] = ()
    probe: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    source: str = "literature defaults"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _STRUCTURED:
                self._check_structured(f.name, value)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or abs(value) > 1e308 or not math.isfinite(value):  # 10**400 would overflow isfinite
                raise PartitionerError(
                    f"Calibration.{f.name} must be a finite number, got {value!r}")
            if f.name in _FRACTIONS and not 0 < value <= 1:
                raise PartitionerError(
                    f"Calibration.{f.name} = {value} is a fraction of peak and must "
                    f"lie in (0, 1]")
            if f.name == "pipeline_idle_cost" and not 0 <= value <= 1:
                raise PartitionerError(
                    f"Calibration.pipeline_idle_cost = {value} must lie in [0, 1] "
                    f"(1 = an idle rank's time is lost, 0 = its cores serve busy ranks)")
            if f.name == "expert_imbalance" and value < 1:
                raise PartitionerError(
                    f"Calibration.expert_imbalance = {value} must be >= 1 (the busiest expert-parallel "
                    f"rank's tokens over the mean)")
            if f.name == "dp_overlap" and not 0 <= value <= 1:
                raise PartitionerError(
                    f"Calibration.dp_overlap = {value} must lie in [0, 1] "
                    f"(0 = no overlap, 1 = fully hidden)")
            if f.name.endswith("_bw_eff") and value <= 0:
                raise PartitionerError(f"Calibration.{f.name} = {value} must be > 0 (achieved / link bytes/s)")
            if f.name == "device_speed" and value <= 0:
                raise PartitionerError(f"Calibration.device_speed = {value} must be > 0")
            if f.name == "gemm_half_flops" and value <= 0:
                raise PartitionerError(
                    f"Calibration.gemm_half_flops = {value} must be > 0 FLOP")
            if value < 0:
                raise PartitionerError(
                    f"Calibration.{f.name} = {value} must be >= 0")

    def _check_structured(self, name: str, value: Any) -> None:
        if name == "source" and not isinstance(value, str):
            raise PartitionerError(f"Calibration.source must be a string, got {value!r}")
        if name == "probe" and value is not None and not isinstance(value, dict):
            raise PartitionerError(f"Calibration.probe must be a JSON object (what `partitioner probe` wrote) or "
                                   f"null, got {type(value).__name__}")
        if name in ("matmul_eff_by_dtype", "collective_bw_eff"):
            what, example = ("dtype -> fraction", '{"fp32": 0.6}') if name == "matmul_eff_by_dtype" else \
                ("collective -> factor", '{"all_gather": 0.5}')
            pairs = value.items() if isinstance(value, Mapping) else value
            try:
                pairs = tuple((str(k), v) for k, v in pairs)
            except (TypeError, ValueError):
                raise PartitionerError(f"Calibration.{name} must map {what}, e.g. {example}, got {value!r}") from None
            for k, v in pairs:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise PartitionerError(f"Calibration.{name}[{k!r}] = {v!r} must be a number")
                if name == "matmul_eff_by_dtype" and not 0 < v <= 1:
                    raise PartitionerError(f"Calibration.matmul_eff_by_dtype[{k!r}] = {v!r} is a fraction of the "
                                           "dtype's peak and must lie in (0, 1]")
                if name == "collective_bw_eff" and (k not in COLLECTIVE_OPS or v <= 0):
                    raise PartitionerError(f"Calibration.collective_bw_eff[{k!r}] = {v!r}: keys are "
                                           f"{list(COLLECTIVE_OPS)}, factors > 0 (achieved / modelled bytes/s)")
            object.__setattr__(self, name, tuple(sorted(pairs)))  # a dict from JSON -> hashable, ordered pairs

    def collective_factor(self, op: str) -> float:
        """collective_bw_eff of `op` (1 where unmeasured).

        >>> Calibration(collective_bw_eff={"all_gather": 0.5}).collective_factor("all_gather")
        0.5
        """
        return dict(self.collective_bw_eff).get(op, 1.0)

    def plateau(self, op_class: str, dtype: str) -> float:
        """The efficiency plateau of a tensor-core class ("matmul", "conv", "attention") at `dtype`: the
        class's own, scaled by the probe's measured matmul plateau of that dtype where there is one.

        >>> round(Calibration(matmul_eff_by_dtype={"fp32": 0.375}).plateau("conv", "fp32"), 6)  # 0.7 * 0.375 / 0.75
        0.35
        """
        own = {"matmul": self.matmul_eff_max, "conv": self.conv_eff_max, "attention": self.attention_eff_max}[op_class]
        measured = dict(self.matmul_eff_by_dtype).get(dtype)
        return own if measured is None else min(1.0, own * measured / self.matmul_eff_max)

    @classmethod
    def for_device(cls, device_name: str) -> "Calibration":
        """The literature defaults, with the device preset's own where it has some.

        >>> Calibration.for_device("CPU").compress_mem_eff, Calibration.for_device("H100-80GB").compress_mem_eff
        (0.085, 0.7)
        """
        return cls(**_DEVICE_DEFAULTS.get(device_name, {}))

    # --- serialisation ------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (JSON-ready)."""
        d = dataclasses.asdict(self)
        d["matmul_eff_by_dtype"] = dict(self.matmul_eff_by_dtype)
        d["collective_bw_eff"] = dict(self.collective_bw_eff)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Calibration":
        """Build from a dict; missing keys keep their defaults.

        Unknown keys raise PartitionerError naming them and the valid keys,
        so a typo in a hand-edited calibration file is not silently ignored.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise PartitionerError(
                f"unknown Calibration key(s) {unknown}; valid keys are {names}")
        return cls(**dict(d))

    def save(self, path: str | Path) -> None:
        """Write `to_dict()` as indented JSON to `path`."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        """Read a file written by `save` (or by hand; see `from_dict`)."""
        try:
            d = json.loads(Path(path).read_bytes())
        except OSError as e:
            raise PartitionerError(f"calibration file {path} cannot be read ({e.strerror or e}): pass the path of "
                                   "a calibration JSON (Calibration.save, `partitioner autotune "
                                   "--calibration-out`), or none for the defaults") from None
        except json.JSONDecodeError as e:
            raise PartitionerError(f"calibration file {path} is not valid JSON: {e}") from e
        except (ValueError, RecursionError) as e:  # not UTF-8; an int of more than 4300 digits; nesting too deep
            raise PartitionerError(f"calibration file {path} is not valid JSON ({type(e).__name__}: "
                                   f"{str(e)[:120]})") from None
        if not isinstance(d, dict):
            raise PartitionerError(
                f"calibration file {path} must hold a JSON object of factors, "
                f"got {type(d).__name__}")
        return cls.from_dict(d)
