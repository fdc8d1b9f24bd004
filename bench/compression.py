"""Gradient compression: bytes on the wire per step, and the torch quantizer's throughput on this CPU.

Benchmark script, not a test: figures are printed, never asserted. Usage::

    python bench/compression.py                  # 4 ranks, gpt_small's gradients, a few seconds per row
    python bench/compression.py --world 2 --numel 16000000

Rows:
  wire     one DDP step of examples.training.gpt_small_seeded (5.29M parameters, one 25 MiB bucket)
           on `--world` Gloo processes, reduced with each compressor; bytes each rank sends per step
           (the shim's counts, an all-to-all or all-gather sending (p-1)/p of its buffer, a ring all-reduce
           2 (p-1)/p), and the ratio against fp32; the reduction's wall time (median of 5) beside it.
  nodes    the same step with the ranks as 2 "nodes" (world 4 only), reduced hierarchically: fp32 inside a
           node, each compressor across; bytes each rank sends over the inter-node groups, ratio vs fp32.
  kernel   runtime.compression.quantize's torch path on one fp32 tensor of `--numel` elements (block 256): GB/s of fp32
           input for quantize (with and without error feedback) and dequantize, best of 5.

  gpu      only where CUDA is available: `runtime.compression.quantize_triton`'s kernels (int8, with error feedback, and
           dequantize) from 4 KB to 512 MB of fp32, bytes each moves per second as a fraction of the device's
           datasheet HBM bandwidth (goal >= 80 % at >= 100 MB), and the launch floor (a 1K-element call).
           `--write-calibration PATH` saves `Calibration.for_device(...)` with those two figures as
           `compress_mem_eff` / `compress_launch_s`, for `compile(..., calibration=PATH)`.
           On CPU the kernels run only in the Triton interpreter, which measures nothing useful.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ and the packages, from anywhere

from runtime.comm.collectives import Collectives  # after the path insert

MODES = ("none", "bf16", "int8", "int4", "powersgd")
HIER = (("none", "bf16"), ("none", "int8"), ("none", "int4"), ("none", "powersgd"))


def _sent(coll, world: int) -> float:
    """Bytes one rank sends: an all-to-all or all-gather (p-1)/p of its buffer, a ring all-reduce 2 (p-1)/p."""
    return sum(v * (2 if op == "all_reduce" else 1) * (world - 1) / world for op, v in coll.bytes.items()
               if op in ("all_reduce", "all_to_all", "all_gather", "reduce_scatter"))


def _step(engine, coll, rank: int) -> float:
    from examples.training import gpt_loss

    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(5):
        x, y = (torch.randint(0, 8192, (2, 128), generator=g) for _ in range(2))
        with engine.no_sync():  # gradients accumulate; the reduction is what is timed
            gpt_loss(engine.module(x), y).backward()
        coll.reset()
        dist.barrier()
        t0 = time.perf_counter()
        engine.finish_gradients()
        times.append(time.perf_counter() - t0)
        engine.zero_grad()
    return statistics.median(times)


def _worker(rank: int, world: int, store: str, out: str) -> None:
    from examples.training import gpt_small_seeded
    from runtime.comm.groups import make_node_groups
    from runtime.engines.data_parallel import DataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    rows = {}
    try:
        for mode in MODES:
            coll = Collectives()
            engine = DataParallel(gpt_small_seeded(), group=dist.group.WORLD, ranks=tuple(range(world)),
                                  zero_stage=0, collectives=coll, compression=mode)
            t = _step(engine, coll, rank)
            rows[mode] = (_sent(coll, world), t)
        if world == 4:
            nodes = make_node_groups(rank, [tuple(range(world))], (0, 0, 1, 1))
            for ci, ce in HIER:
                cross = _CrossCounter(nodes.cross)
                engine = DataParallel(gpt_small_seeded(), group=dist.group.WORLD, ranks=tuple(range(world)),
                                      zero_stage=0, collectives=cross, compression={"intra_node": ci,
                                                                                   "inter_node": ce}, nodes=nodes)
                t = _step(engine, cross, rank)
                rows[("nodes", ci, ce)] = (_sent(cross.across, 2), t)
            rows["numel"] = sum(p.numel() for p in gpt_small_seeded().parameters())
        if rank == 0:
            torch.save(rows, Path(out) / "rows.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


class _CrossCounter(Collectives):
    """A Collectives that also tallies, apart in `across`, what goes over the cross-node group."""

    def __init__(self, cross) -> None:
        super().__init__()
        self.cross, self.across = cross, Collectives()

    def _on(self, op: str, t: torch.Tensor, group) -> None:
        if group is self.cross:
            self.across._count(op, t)

    def all_reduce(self, t, group=None, **kw):
        self._on("all_reduce", t, group)
        return super().all_reduce(t, group, **kw)

    def all_to_all(self, out, inp, group=None, **kw):
        self._on("all_to_all", inp, group)
        return super().all_to_all(out, inp, group, **kw)

    def all_gather(self, out, inp, group=None, **kw):
        self._on("all_gather", out, group)
        return super().all_gather(out, inp, group, **kw)

    def reset(self) -> None:
        super().reset()
        self.across.reset()


def kernel_rows(numel: int) -> list[str]:
    from runtime.compression.quantize import dequantize, quantize

    x = torch.randn(numel)
    r = torch.zeros(numel)
    gb = numel * 4 / 1e9
    out = []
    for bits in (8, 4):
        best = {}
        for name, fn in (("quantize", lambda: quantize(x, bits=bits)),
                         ("quantize+feedback", lambda: quantize(x, bits=bits, residual=r)),
                         ("dequantize", None)):
            q, _ = quantize(x, bits=bits)
            f = fn or (lambda: dequantize(q))
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            best[name] = gb / min(ts)
        out.append(f"kernel int{bits}  " + "  ".join(f"{k} {v:.2f} GB/s" for k, v in best.items()))
    return out


def gpu_rows(write: str | None) -> list[str]:
    if not torch.cuda.is_available():
        return ["gpu       none here: Triton kernel throughput is measured on a CUDA device"]
    from cost_models.calibration import Calibration
    from cost_models.devices import get_device
    from runtime.compression.quantize_triton import dequantize_triton, quantize_triton

    name = torch.cuda.get_device_name()
    spec = get_device(name.replace("NVIDIA ", "").split()[0].split("-")[0])  # "NVIDIA H100 80GB HBM3" -> H100
    peak = spec.hbm_bytes_per_s

    from cuda_timing import cuda_seconds  # bench/, the script's folder

    def best(fn, reps: int = 20) -> float:
        return min(cuda_seconds(fn, reps, warmup=3))

    out, eff_big = [f"gpu       {name} ({spec.name}), datasheet HBM {peak / 1e9:,.0f} GB/s"], []
    launch = None
    for numel in (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26, 1 << 27):
        x = torch.randn(numel, device="cuda")
        r = torch.zeros_like(x)
        q, _ = quantize_triton(x, bits=8)
        t_q = best(lambda: quantize_triton(x, bits=8, residual=r, residual_out=r))  # noqa: B023
        t_d = best(lambda: dequantize_triton(q))  # noqa: B023
        # bytes moved: x, residual in and out (12 n) + codes (n) + scales; codes + scales in, fp32 out (5 n)
        frac_q = (13 * numel + 4 * numel / 256) / t_q / peak
        frac_d = (5 * numel + 4 * numel / 256) / t_d / peak
        if numel == 1 << 10:
            launch = min(t_q, t_d)
        if numel * 4 >= 100e6:
            eff_big.append((frac_q + frac_d) / 2)
        out.append(f"gpu       {numel * 4 / 1e6:>9,.3f} MB  quantize+feedback {t_q * 1e6:>9.1f} us "
                   f"{frac_q:>6.1%} of HBM  dequantize {t_d * 1e6:>9.1f} us {frac_d:>6.1%}")
    eff = sum(eff_big) / len(eff_big)
    out.append(f"gpu       fitted: compress_mem_eff {eff:.3f} (tensors >= 100 MB), compress_launch_s {launch:.2e}")
    if write:
        cal = dataclasses.replace(Calibration.for_device(spec.name), compress_mem_eff=round(eff, 3),
                                  compress_launch_s=launch)
        cal.save(write)
        out.append(f"gpu       wrote {write}: compile(..., calibration={write!r}) uses these figures")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--numel", type=int, default=16_000_000)
    ap.add_argument("--write-calibration", metavar="PATH", help="GPU only: save the fitted kernel constants")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(args.world, os.path.join(tmp, "store"), tmp), nprocs=args.world,
                           start_method="spawn")
        rows = torch.load(Path(tmp) / "rows.pt")
    base = rows["none"][0]
    print(f"compression: gpt_small gradients (5.29M fp32), DDP, {args.world} Gloo ranks, torch {torch.__version__}")
    print(f"{'compressor':10}  {'bytes sent/rank/step':>20}  {'vs fp32':>7}  {'reduce ms':>9}")
    for mode in MODES:
        sent, t = rows[mode]
        print(f"{mode:10}  {sent:>20,.0f}  {base / sent:>6.2f}x  {t * 1e3:>9.1f}")
    if args.world == 4:
        # fp32 across: each rank all-reduces its half of the gradient with one peer (a ring of 2 sends it once)
        base = rows["numel"] * 4 / 2
        print(f"2 nodes x 2 ranks, hierarchical (fp32 inside a node; fp32 across would send {base:,.0f}):")
        print(f"{'across':10}  {'inter-node bytes/rank':>20}  {'vs fp32':>7}  {'reduce ms':>9}")
        for ci, ce in HIER:
            sent, t = rows[("nodes", ci, ce)]
            print(f"{ce:10}  {sent:>20,.0f}  {base / sent:>6.2f}x  {t * 1e3:>9.1f}")
    for line in kernel_rows(args.numel) + gpu_rows(args.write_calibration):
        print(line)


if __name__ == "__main__":
    main()
