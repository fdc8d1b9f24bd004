"""fp8 linears on a GPU: measured forward + backward against bf16, beside what the cost model charges.

Benchmark script, not a test: figures are printed, never asserted. Needs a CUDA device with FP8 tensor cores
(H100/H200, compute capability 8.9+); elsewhere it says so and exits 0. Usage, from the project root::

    python bench/fp8_gemm.py [--calibration probe.json]

For linears of transformer sizes (tokens x in -> out), bf16 operands as the fp8-mixed recipe hands them:
`F.linear` in bf16 against `runtime.engines.fp8.fp8_linear` (per-tensor current scaling: casts of x and W
forward, of dy, x and W again backward, the GEMMs through torch._scaled_mm), each forward + backward timed
with CUDA events (median of 20 after 5 warm-ups). One line per shape:

    8192x4096->14336   bf16 2.95 ms (pred 2.71)  fp8 1.88 ms (pred 1.62)  speedup 1.57x (pred 1.67x)

`pred` is the planner's charge for the same op (partitioner.planner.unit_costs: the GEMMs by the roofline at
the dtype's peak and plateau -- "fp8" for the fp8 GEMMs -- plus the casts as memory-bound ops) with the
device preset's calibration, or the one given (a `partitioner probe` file: its measured fp8 plateau).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: the repository root

from cuda_timing import cuda_seconds  # noqa: E402

from cost_models.calibration import Calibration  # noqa: E402
from cost_models.compute import RooflineCompute  # noqa: E402
from cost_models.devices import get_device  # noqa: E402
from cost_models.fp8 import cast_bytes  # noqa: E402
from runtime.engines.fp8 import fp8_linear  # noqa: E402

SHAPES = ((8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096), (16384, 8192, 8192),
          (16384, 8192, 28672), (2048, 1024, 1024))


def timed(fn, reps: int = 20) -> float:
    """Median seconds of fn() on the current stream, by CUDA events."""
    return statistics.median(cuda_seconds(fn, reps, warmup=5))


def predicted(m: int, k: int, n: int, cal: Calibration, device) -> tuple[float, float]:
    """(bf16, fp8) seconds of one linear's forward + backward as unit_costs charges them."""
    flops, moved = 2.0 * m * k * n, 2.0 * (m * k + k * n + m * n)
    bf16 = RooflineCompute(device, "bf16", cal)
    fp8 = RooflineCompute(device, "fp8", cal)
    plain = bf16.op_time(flops, moved, "matmul") + bf16.op_time(2 * flops, 2 * moved, "matmul")
    operands = m * k + k * n
    casts = bf16.op_time(0.0, cast_bytes(operands, fused=True), "elementwise") + \
        bf16.op_time(0.0, cast_bytes(m * n + operands, fused=True), "elementwise")
    return plain, fp8.op_time(flops, moved, "matmul") + fp8.op_time(2 * flops, 2 * moved, "matmul") + casts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calibration", help="a `partitioner probe` calibration JSON (default: the preset's)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("fp8_gemm: no CUDA device with FP8 tensor cores here; nothing measured")
        return 0
    name = torch.cuda.get_device_name()
    device = get_device(name.replace("NVIDIA ", "").split()[0].split("-")[0])  # "NVIDIA H200" -> H200
    cal = Calibration.load(args.calibration) if args.calibration else Calibration.for_device(device.name)
    print(f"# {name} ({device.name}), torch {torch.__version__}; calibration: {args.calibration or 'preset'}")
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True) * k ** -0.5
        w = w.detach().requires_grad_()
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

        def run(linear):
            return lambda: torch.autograd.backward(linear(x, w), dy)

        t_bf16, t_fp8 = timed(run(F.linear)), timed(run(fp8_linear))
        p_bf16, p_fp8 = predicted(m, k, n, cal, device)
        tflops = 6.0 * m * k * n / 1e12
        print(f"{m}x{k}->{n:<7} bf16 {t_bf16 * 1e3:7.2f} ms (pred {p_bf16 * 1e3:6.2f}, {tflops / t_bf16:6.0f} TFLOP/s)"
              f"  fp8 {t_fp8 * 1e3:7.2f} ms (pred {p_fp8 * 1e3:6.2f}, {tflops / t_fp8:6.0f} TFLOP/s)"
              f"  speedup {t_bf16 / t_fp8:4.2f}x (pred {p_bf16 / p_fp8:4.2f}x)", flush=True)
    print("# the GEMM alone, torch._scaled_mm (e4m3 x e4m3 -> bf16), fp32 accumulation vs Hopper's fast accumulation "
          "(use_fast_accum=True, torchao's and TransformerEngine's forward setting)")
    for m, k, n in SHAPES:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        rates = [2.0 * m * k * n / timed(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                                   use_fast_accum=fast)) / 1e12 for fast in (False, True)]
        print(f"{m}x{k}->{n:<7} _scaled_mm {rates[0]:6.0f} TFLOP/s ({rates[0] * 1e12 / device.peak_flops['fp8']:.0%} of "
              f"the fp8 peak), fast accumulation {rates[1]:6.0f} ({rates[1] * 1e12 / device.peak_flops['fp8']:.0%})",
              flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(256, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(256, 8192, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    exact = a.float() @ b.float()  # products of fp8 values are exact in fp32; fp32 sums
    size = a.float().abs() @ b.float().abs()
    for fast in (False, True):
        got = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
        err = ((got - exact).abs() / size).max().item()
        print(f"accumulation error at K=8192, use_fast_accum={fast}: {err:.2e} of sum |a||b| (2^{math.log2(err):.1f})"
              if err > 0 else f"accumulation error at K=8192, use_fast_accum={fast}: 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
