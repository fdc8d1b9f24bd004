"""Device presets: name -> DeviceSpec, each number with its source.

Conventions (all presets):
- FLOP/s are *dense* peaks (datasheets print the 2:4-sparsity figure, twice
  the dense one, next to tensor-core numbers; we halve those).
- Memory is the marketed size read as GiB: "80GB" -> 80 * 2**30 bytes,
  because nvidia-smi reports an A100-80GB as 81920 MiB. (H100 reports
  81559 MiB and H200 143771 MiB, slightly less; compile()'s memory cap keeps
  a margin.) What every process holds before its tensors (CUDA context, NCCL
  buffers) is `process_bytes` and `comm_buffer_bytes`, below.
- Bandwidths are bytes/s with 1e9 per GB, per GPU, per direction: NVLink
  "600 GB/s" on a datasheet is the bidirectional total, 300e9 each way;
  a NIC's Gb/s is divided by 8.
- NIC: the typical compute fabric of the vendor's reference system, one
  NIC per GPU (DGX A100: 8x 200 Gb/s HDR; DGX H100/H200: 8x 400 Gb/s NDR).

>>> get_device("h100").flops("bf16")
989400000000000.0
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from cost_models.errors import TopologyError
from cost_models.specs import DeviceSpec

__all__ = ["PRESETS", "get_device"]

GiB = 2**30

# H100 SXM5 dense peaks, from the NVIDIA H100 Tensor Core GPU Architecture
# whitepaper (table "H100 SXM5": FP32 66.9, TF32 494.7, BF16/FP16 989.4,
# FP8 1978.9 TFLOPS dense). H200 is the same GH100 chip at the same clocks:
# its datasheet prints the same sparse peaks (TF32 989, BF16 1979, FP8 3958).
_GH100_FLOPS = {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12}
# A100 datasheet (SXM and PCIe alike): FP32 19.5, TF32 156, BF16/FP16 312
# TFLOPS dense (312/624/624 with sparsity). No fp8 on Ampere.
_GA100_FLOPS = {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}

# Fixed device memory of a GPU process (DeviceSpec.process_bytes, comm_buffer_bytes):
# - The CUDA context and the kernels torch loads: a process that had only run
#   `torch.randn(1).cuda()` held 723 MiB (nvidia-smi; "What is the reason for pytorch's GPU
#   memory floor", discuss.pytorch.org/t/73021: "the first CUDA call creates the CUDA context,
#   which uses the memory on the device"). Lazy module loading (CUDA 11.7+) loads fewer kernels
#   up front; `partitioner probe` measures this machine's figure (fixed_process_bytes).
# - NCCL's buffers, per communicator: one receive connection per channel of a ring, each with a
#   buffer per protocol, NCCL src/init.cc defaults: DEFAULT_BUFFSIZE (Simple) 4 MiB,
#   DEFAULT_LL128_BUFFSIZE 120 x 640 x 8 x 8 B, DEFAULT_LL_BUFFSIZE 8 x 512 x 8 x 16 B; at most
#   MAXCHANNELS = 32 channels (src/include/device.h), taken as the count: an upper bound.
_CUDA_PROCESS_BYTES = 723 * 2**20
_NCCL_CONNECTION_BYTES = 4 * 2**20 + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
_NCCL_COMMUNICATOR_BYTES = 32 * _NCCL_CONNECTION_BYTES
_GPU_FIXED = {"process_bytes": _CUDA_PROCESS_BYTES, "comm_buffer_bytes": _NCCL_COMMUNICATOR_BYTES}

_DEVICES = (
    DeviceSpec(
        name="V100-32GB",
        # V100 datasheet, SXM2 column: FP32 15.7 TFLOPS, Tensor 125 TFLOPS
        # (fp16 in, fp32 accumulate); Volta has no bf16 or tf32.
        peak_flops={"fp32": 15.7e12, "fp16": 125e12},
        memory_bytes=32 * GiB,            # 32 GB HBM2
        hbm_bytes_per_s=900e9,            # datasheet: 900 GB/s
        nvlink_bytes_per_s=150e9,         # datasheet: NVLink 300 GB/s bidirectional
        nic_bytes_per_s=12.5e9,           # typical 100 Gb/s EDR InfiniBand per GPU
        **_GPU_FIXED,
        source="NVIDIA V100 Tensor Core GPU datasheet (SXM2); NIC typical EDR",
    ),
    DeviceSpec(
        name="A100-40GB",
        peak_flops=_GA100_FLOPS,
        memory_bytes=40 * GiB,            # 40 GB HBM2 (nvidia-smi: 40960 MiB)
        hbm_bytes_per_s=1555e9,           # datasheet: 1,555 GB/s
        nvlink_bytes_per_s=300e9,         # datasheet: NVLink 600 GB/s bidirectional
        nic_bytes_per_s=25e9,             # DGX A100 datasheet: 200 Gb/s HDR per GPU
        **_GPU_FIXED,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB); DGX A100 datasheet",
    ),
    DeviceSpec(
        name="A100-80GB",
        peak_flops=_GA100_FLOPS,
        memory_bytes=80 * GiB,            # 80 GB HBM2e (nvidia-smi: 81920 MiB)
        hbm_bytes_per_s=2039e9,           # datasheet, SXM: 2,039 GB/s
        nvlink_bytes_per_s=300e9,         # datasheet: NVLink 600 GB/s bidirectional
        nic_bytes_per_s=25e9,             # DGX A100 datasheet: 200 Gb/s HDR per GPU
        **_GPU_FIXED,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB); DGX A100 datasheet",
    ),
    DeviceSpec(
        name="H100-80GB",
        peak_flops=_GH100_FLOPS,
        memory_bytes=80 * GiB,            # 80 GB HBM3
        hbm_bytes_per_s=3.35e12,          # datasheet, SXM: 3.35 TB/s
        nvlink_bytes_per_s=450e9,         # datasheet: NVLink 900 GB/s bidirectional
        nic_bytes_per_s=50e9,             # DGX H100 datasheet: 400 Gb/s NDR per GPU
        **_GPU_FIXED,
        source="NVIDIA H100 datasheet and architecture whitepaper (SXM5); DGX H100 datasheet",
    ),
    DeviceSpec(
        # The export variant of H100 SXM5 (the GPU DeepSeek-V3 was trained on): the same GH100 compute and
        # 80 GB HBM3, NVLink cut to 400 GB/s bidirectional (NVIDIA H800 SXM5 datasheet).
        name="H800-80GB",
        peak_flops=_GH100_FLOPS,
        memory_bytes=80 * GiB,            # 80 GB HBM3
        hbm_bytes_per_s=3.35e12,          # datasheet, SXM: 3.35 TB/s
        nvlink_bytes_per_s=200e9,         # datasheet: NVLink 400 GB/s bidirectional
        nic_bytes_per_s=50e9,             # 400 Gb/s InfiniBand per GPU (DeepSeek-V3 report, 3.2.2: IB 50 GB/s)
        **_GPU_FIXED,
        source="NVIDIA H800 SXM5 datasheet; NIC as DeepSeek-V3 technical report section 3.2.2",
    ),
    DeviceSpec(
        name="H200-141GB",
        peak_flops=_GH100_FLOPS,
        memory_bytes=141 * GiB,           # 141 GB HBM3e
        hbm_bytes_per_s=4.8e12,           # datasheet, SXM: 4.8 TB/s
        nvlink_bytes_per_s=450e9,         # datasheet: NVLink 900 GB/s bidirectional
        nic_bytes_per_s=50e9,             # DGX H200 datasheet: 400 Gb/s NDR per GPU
        **_GPU_FIXED,
        source="NVIDIA H200 datasheet (SXM); dense peaks as H100 SXM5 whitepaper",
    ),
    DeviceSpec(
        # One Gloo process of "local:N" on this project's shared 2-core machine
        # (AMD EPYC with AVX-512 and avx512_bf16). ESTIMATES, to be calibrated:
        # - fp32 50e9 FLOP/s: a 1-thread 2048^3 matmul measured ~100e9 on an
        #   idle core; local:4 puts two processes on each core. bf16 likewise
        #   ~460e9 measured -> 230e9. fp16 matmul has no fast path here
        #   (measured 0.3e9), so it is left out: asking for it is an error.
        # - memory 8 GiB per process: a default budget, not a hardware limit.
        # - "HBM" is DRAM, ~20e9 B/s per process.
        # - The intra-node "link" is loopback Gloo (docs/torch-notes.md, Gloo collective timings): all_reduce of
        #   1M fp32 (4.19e6 B) takes 6.6 ms on 2 ranks. Ring model
        #   t = 2(n-1)/n * B/bw + 2(n-1)*alpha with alpha ~75 us (order
        #   50-100 us for a Gloo TCP message) gives bw = 4.19e6/6.45e-3
        #   = 0.65e9 B/s; it predicts 10.1 ms for 4 ranks (measured 9.0).
        #   Large messages run faster (16M: 58 ms, ~1.2e9 B/s): conservative.
        # - Inter-node: Gloo over TCP is no faster than its loopback, so the
        #   same 0.65e9 B/s (below a 10 GbE NIC's 1.25e9), ~100 us typical.
        name="CPU",
        peak_flops={"fp32": 50e9, "bf16": 230e9},
        memory_bytes=8 * GiB,
        hbm_bytes_per_s=20e9,
        nvlink_bytes_per_s=0.65e9,
        nic_bytes_per_s=0.65e9,
        nvlink_latency_s=75e-6,
        nic_latency_s=100e-6,
        source="estimates for one Gloo process on a shared 2-core machine; see devices.py",
    ),
)

PRESETS: Mapping[str, DeviceSpec] = MappingProxyType({d.name: d for d in _DEVICES})


def _norm(name: str) -> str:
    """Case, '-', '_' and spaces do not matter: 'a100_80gb' == 'A100-80GB'."""
    return "".join(c for c in name.lower() if c.isalnum())


def get_device(name: str) -> DeviceSpec:
    """The preset called `name`, matched loosely; a bare model ("H100") if unambiguous.

    >>> get_device("a100_80gb").name, get_device("H100").name
    ('A100-80GB', 'H100-80GB')
    """
    if not isinstance(name, str):
        raise TopologyError(f"device={name!r}: must be a preset name or a DeviceSpec")
    key = _norm(name)
    exact = [d for n, d in PRESETS.items() if _norm(n) == key]
    if exact:
        return exact[0]
    by_model = [d for n, d in PRESETS.items() if _norm(n.split("-")[0]) == key]
    if len(by_model) == 1:
        return by_model[0]
    if by_model:
        raise TopologyError(
            f"device {name!r} is ambiguous: it could be {' or '.join(d.name for d in by_model)}; "
            f"name the memory size")
    raise TopologyError(
        f"unknown device {name!r}: presets are {', '.join(PRESETS)}; "
        f"or pass a DeviceSpec (or a dict of its fields) for other hardware")
