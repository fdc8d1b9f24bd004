"""`partitioner autotune MODEL`: candidates measured, the fastest that fits kept, the cost model refitted."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from cost_models.errors import DeclarationError
from partitioner.cli.common import EXIT_OK, RunFailed, emit, plan_options


def autotune_command(args: argparse.Namespace) -> int:
    from cost_models.topology import Topology
    from partitioner.tune.autotune import AutotuneFailed, autotune, format_trials

    topology = Topology.coerce(args.topology)  # a bad topology fails before anything runs
    try:
        res = autotune(args.model, topology, global_batch_size=args.global_batch_size, trials=args.trials,
                       db=args.db, steps=args.steps, warmup=args.warmup, timeout_s=args.timeout_s,
                       calibration_out=args.calibration_out, progress=sys.stderr, data=args.data,
                       launcher=args.launcher, launcher_args=_launcher_args(args), **plan_options(args))
    except AutotuneFailed as exc:  # every trial ran and failed: a failed run (4), not bad input
        raise RunFailed(str(exc)) from exc
    plan = dataclasses.replace(res.plan, model_source=args.model)
    if args.output:
        plan.save(args.output)
    if args.json:
        emit(args, res.to_dict())
        return EXIT_OK
    print(format_trials(res.trials))
    print(res.fit_report())
    print(f"\nbest: {plan.config} (predicted {plan.predicted.step_time_s:.3f} s/step)"
          + (f"; plan written to {args.output}" if args.output else "")
          + f"; calibration in {res.calibration_path}")
    return EXIT_OK


def _launcher_args(args: argparse.Namespace) -> dict[str, Any]:
    """autotune's launcher_args from the --launcher options given (refused by autotune under --launcher local)."""
    given = {"nnodes": args.nnodes, "nproc_per_node": args.nproc_per_node, "rdzv_endpoint": args.rdzv_endpoint,
             "wrapper": args.launcher_wrapper, "extra": args.launcher_extra, "trial_dir": args.trial_dir}
    flags = {"nnodes": "--nnodes", "nproc_per_node": "--nproc-per-node", "rdzv_endpoint": "--rdzv-endpoint",
             "wrapper": "--launcher-wrapper", "extra": "--launcher-extra", "trial_dir": "--trial-dir"}
    if args.launcher == "local" and any(v is not None for v in given.values()):
        named = [flags[k] for k, v in given.items() if v is not None]
        raise DeclarationError(f"{', '.join(named)}: options of a cluster launcher; add --launcher torchrun or "
                               "--launcher srun (--launcher local runs trials as processes on this machine)")
    if args.launcher == "srun" and (args.rdzv_endpoint or args.launcher_wrapper):
        raise DeclarationError("--rdzv-endpoint and --launcher-wrapper are torchrun's: srun starts every rank "
                               "itself and rank 0 hosts the rendezvous; drop them or use --launcher torchrun")
    return {k: v for k, v in given.items() if v is not None}
