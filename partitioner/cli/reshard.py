"""`partitioner reshard CKPT --to PLAN`: a checkpoint rewritten for another plan, offline."""

from __future__ import annotations

import argparse
import json
import time

from partitioner.cli.common import EXIT_OK


def reshard_command(args: argparse.Namespace) -> int:
    from partitioner.planner.plan import Plan
    from runtime.checkpoint import read_manifest, reshard

    plan = Plan.load(args.to)
    t0 = time.perf_counter()
    out = reshard(args.checkpoint, plan, args.output)
    m = read_manifest(out)
    summary = {"checkpoint": str(out), "step": m["step"], "world_size": m["world_size"],
               "config": str(plan.config), "bytes": sum(f["bytes"] for f in m["files"].values()),
               "seconds": round(time.perf_counter() - t0, 3)}
    if args.json:
        args.stdout.write(json.dumps(summary) + "\n")
    else:
        print(f"resharded step {m['step']} for {plan.config} ({plan.world_size} ranks) into {out}: "
              f"{summary['bytes'] / 2**20:.1f} MiB in {summary['seconds']:.2f} s")
    return EXIT_OK
