"""`partitioner probe --topology T -o FILE`: measure this machine (or the cluster job's ranks) into a calibration."""

from __future__ import annotations

import argparse
import sys

from partitioner.cli.common import EXIT_OK, emit


def probe_command(args: argparse.Namespace) -> int:
    from partitioner.probe import Sweep, probe

    sweep = Sweep.quick() if args.quick else None
    cal = probe(args.topology, out=args.output, sweep=sweep, timeout_s=args.timeout_s, progress=sys.stderr)
    if cal.probe is None:  # a rank other than 0 of a job: rank 0 reports
        return EXIT_OK
    if args.json:
        emit(args, cal.to_dict())
        return EXIT_OK
    print(format_probe(cal.probe))
    print(f"\ncalibration: device_speed {cal.device_speed:.3g}, mem_eff {cal.mem_eff:.3g}, optimizer_eff "
          f"{cal.optimizer_eff:.3g}, lowrank_eff {cal.lowrank_eff:.3g}, loss_eff {cal.loss_eff:.3g}, launch "
          f"{cal.launch_overhead_s * 1e6:.2f} us, intra_node_bw_eff {cal.intra_node_bw_eff:.3g}, "
          f"collective base latency {cal.collective_base_latency_s * 1e6:.0f} us"
          + "".join(f", {op} bandwidth x{f:.3g}" for op, f in cal.collective_bw_eff)
          + (f"; written to {args.output}" if args.output else ""))
    return EXIT_OK


def format_probe(evidence: dict) -> str:
    """The probe's evidence as a table: per dtype the matmul plateau, per collective its alpha-beta line."""
    rows = [f"{evidence['ranks']} ranks on {', '.join(evidence['devices'])}: fixed memory per process "
            f"{evidence['fixed_process_bytes'] / 2**20:.0f} MiB, copy {evidence['memory_bytes_per_s'] / 1e9:.1f} GB/s, "
            f"AdamW step {evidence['optimizer_bytes_per_s'] / 1e9:.1f} GB/s (28 B per parameter), "
            + (f"PowerSGD product {evidence['lowrank_bytes_per_s'] / 1e9:.1f} GB/s, "
               if "lowrank_bytes_per_s" in evidence else "")  # older probe files lack it
            + (f"cross entropy {evidence['loss_bytes_per_s'] / 1e9:.1f} GB/s (5 fp32 passes), "
               if "loss_bytes_per_s" in evidence else "")
            + f"op overhead {evidence['op_overhead_s'] * 1e6:.2f} us"]
    for dtype, c in evidence["matmul"].items():
        rows.append(f"matmul {dtype}: plateau {c['plateau_flops_per_s'] / 1e9:.1f} GFLOP/s, half at "
                    f"{c['half_flops']:.3g} FLOP")
    rows.append(f"{'collective':<15} {'level':<11} {'p':>3} {'alpha us':>9} {'busbw GB/s':>10}")
    for ln in evidence["collectives"]:
        rows.append(f"{ln['op']:<15} {ln['level']:<11} {ln['p']:>3} {ln['alpha_s'] * 1e6:>9.1f} "
                    f"{ln['busbw_bytes_per_s'] / 1e9:>10.3f}")
    return "\n".join(rows)
