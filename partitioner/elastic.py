"""Elastic training: whatever number of processes the launcher starts, plan for it and continue.

    torchrun --nnodes 1:4 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        --max-restarts 3 -m partitioner.elastic examples/gpt.py:gpt_tiny --save-dir ckpt/ --save-every 10 \\
        --steps 1000 --global-batch-size 12

Every (re)start of the job runs this on each rank. The world size is
whatever the rendezvous admitted; the plan for it is `SAVE_DIR/plans/world_W/`
(plan.json and the rank programs): rank 0 compiles it the first time the job
runs at that size (the topology is `--topology` with `{world}` filled in, the
calibration `--calibration` if given) while the other ranks wait for it; a
later restart at a size seen before reuses it. Compiling for a new size reuses
the trace the first start made, kept in `SAVE_DIR/plans/trace/`
(partitioner.tracer.cache): re-planning is the planner's search alone. Then the ranks train under
`runtime.run` with `--resume-from auto`: the newest checkpoint in SAVE_DIR,
written under whatever plan and world size the job had before, is resharded
into the new plan as it loads (runtime.checkpoint), and training continues at
its step with the same global batch: batches are a function of the step, so
the data order does not depend on the world size.

SAVE_DIR must be visible to every node (checkpoints need that anyway).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

from runtime.launch.env import LaunchError, discover

__all__ = ["cached_trace", "main", "plan_for_world"]


def plan_for_world(args: argparse.Namespace, world: int, rank: int) -> Path:
    """The plan directory for `world` ranks: compiled by rank 0 if missing, awaited by the others."""
    d = Path(args.save_dir) / "plans" / f"world_{world}"
    if (d / "plan.json").is_file():
        return d
    if rank == 0:
        from partitioner.compile import compile

        g, how = cached_trace(args)
        plan = compile(g, args.topology.format(world=world), global_batch_size=args.global_batch_size,
                       precision=args.precision, optimizer=args.optimizer_name, calibration=args.calibration,
                       torch_compile=args.torch_compile or False)
        plan = dataclasses.replace(plan, model_source=args.model)
        tmp = d.with_name(f".tmp-{d.name}-{os.getpid()}")
        plan.write_programs(tmp)
        os.replace(tmp, d)  # whole: the waiting ranks see the directory complete or not at all
        print(f"elastic: planned for {world} ranks from {how}: {plan.config} -> {d}", flush=True)
        return d
    deadline = time.time() + args.plan_timeout_s
    while not (d / "plan.json").is_file():
        if time.time() > deadline:
            raise LaunchError(f"rank {rank}: rank 0 wrote no plan for {world} ranks into {d} within "
                              f"{args.plan_timeout_s:g} s: is --save-dir on a file system every node sees?")
        time.sleep(0.2)
    return d


def cached_trace(args: argparse.Namespace) -> tuple[Any, str]:
    """The model's OpGraph, from SAVE_DIR/plans/trace when an earlier start traced this model source."""
    from partitioner.loading import load_model
    from partitioner.tracer.cache import load_trace, save_trace, source_key
    from partitioner.tracer.trace import trace

    d, key = Path(args.save_dir) / "plans" / "trace", source_key(args.model)
    g = load_trace(d, key)
    if g is not None:
        return g, "the cached trace"
    model, inputs, module = load_model(args.model, device="meta", batch_size=2)
    if hasattr(module, "example_batch"):
        inputs = inputs[:1]  # (inputs, targets): the model is called on the inputs
    g = trace(model, inputs)
    return g, ("a new trace (cached)" if save_trace(g, d, key) else "a new trace (torch.fx: not cacheable)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if "{world}" not in args.topology:
        raise LaunchError(f"--topology {args.topology!r} must contain {{world}}, filled with the number of ranks "
                          "(e.g. local:{world}, or h100:{world})")
    env = discover()
    d = plan_for_world(args, env.world_size, env.rank)
    from runtime import run

    argv_run = [str(d / "plan.json"), "--model", args.model, "--steps", str(args.steps), "--save-dir", args.save_dir,
                "--save-every", str(args.save_every), "--resume-from", "auto", "--timeout-s", str(args.timeout_s)]
    for flag in ("optimizer", "scheduler", "loss", "data", "save", "keep_last", "eval_every", "eval_batches",
                 "eval_data"):
        value = getattr(args, flag)
        if value is not None:
            argv_run += [f"--{flag.replace('_', '-')}", str(value)]
    return run.main(argv_run)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m partitioner.elastic", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("model", help="pkg.module:factory or path/file.py:factory")
    p.add_argument("--save-dir", required=True, help="checkpoints and per-world-size plans (shared by all nodes)")
    p.add_argument("--save-every", type=int, required=True, help="checkpoint after every N-th step")
    p.add_argument("--steps", type=int, required=True, help="train until this step")
    p.add_argument("--global-batch-size", type=int, required=True, help="samples per step, for every world size")
    p.add_argument("--topology", default="local:{world}", help="topology with {world} for the number of ranks")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--optimizer-name", default="adam", help="the optimizer the plan is costed for")
    p.add_argument("--calibration", help="a calibration file from autotune")
    p.add_argument("--torch-compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="every world size's plan runs its model code under torch.compile with BACKEND (default when "
                        "given: inductor), as `partitioner compile --torch-compile`")
    p.add_argument("--optimizer", help="factory(params) -> Optimizer (default: the plan's)")
    p.add_argument("--scheduler", help="factory(optimizer) -> a torch LRScheduler, stepped after each optimizer step; "
                                       "replayed to the checkpoint's step at every restart")
    p.add_argument("--loss", help="fn(output, target) -> loss")
    p.add_argument("--data", help="fn(step, rank, world_size) -> the global batch of that step")
    p.add_argument("--eval-every", type=int, metavar="N", help="evaluate after every N-th step (counted from step 0 "
                                                                "across restarts) and after the last")
    p.add_argument("--eval-batches", type=int, metavar="K", help="held-out batches per evaluation (default 1)")
    p.add_argument("--eval-data", help="fn(k, rank, world_size) -> the k-th held-out global batch")
    p.add_argument("--save", help="write the final parameters (rank 0) to this file")
    p.add_argument("--keep-last", type=int, help="keep only the newest N checkpoints")
    p.add_argument("--timeout-s", type=float, default=120.0, help="collective timeout")
    p.add_argument("--plan-timeout-s", type=float, default=300.0, help="how long ranks wait for rank 0's plan")
    return p


if __name__ == "__main__":
    try:
        code = main()
    except LaunchError as exc:
        print(f"partitioner.elastic: error: {exc}", file=sys.stderr, flush=True)
        os._exit(3 if type(exc).__name__ == "PeerLost" else 2)
    except Exception as exc:  # a planning error (PartitionerError) or worse: one line, then leave
        print(f"partitioner.elastic: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as runtime.run: skip the c10d teardown race after the final barrier
