"""`partitioner run PLAN`: a local plan trained here as N processes; any other, the launch command printed."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from cost_models.errors import DeclarationError
from partitioner.cli.common import EXIT_OK, LOOPBACK, RunFailed, emit, info
from runtime.launch.env import (
    ALLOW_EXTERNAL_BIND,
    DEFAULT_MASTER_PORT,
    LaunchError,
)


def run_command(args: argparse.Namespace) -> int:
    from cost_models.topology import Topology
    from partitioner.planner.plan import Plan

    plan = Plan.load(args.plan)
    spec = args.model or plan.model_source
    if not spec:
        raise DeclarationError(f"{args.plan} does not record the model it was compiled for (compiled from Python, "
                               "or by an older version): pass --model FILE.py:FACTORY, e.g. "
                               "--model examples/gpt.py:gpt_tiny")
    topo = Topology.from_dict(plan.topology)
    if args.print_command or not topo.local:
        return _print_command(args, plan, topo, spec)
    return _run_local(args, plan, spec)


def _run_local(args: argparse.Namespace, plan: Any, spec: str) -> int:
    import torch

    from runtime.launch.loading import load_callable, load_object
    from runtime.launch.local import check_model, check_sendable, launch_local
    from runtime.run import default_loss, default_optimizer, held_out_data

    module, _, _ = load_object(spec, "--model")
    model_fn = load_callable(spec, "--model")
    optimizer_fn = load_callable(args.optimizer, "--optimizer") if args.optimizer else default_optimizer(plan.optimizer)
    loss_fn = load_callable(args.loss, "--loss") if args.loss else default_loss
    scheduler_fn = load_callable(args.scheduler, "--scheduler") if args.scheduler else None
    for name, fn in (("--model", model_fn), ("--optimizer", optimizer_fn), ("--loss", loss_fn),
                     ("--scheduler", scheduler_fn)):
        if fn is not None:
            check_sendable(name, fn)
    check_model(plan, model_fn)  # a model that is not the plan's is bad input (2), not a failed run (4)
    if args.data:
        data_fn = load_callable(args.data, "--data")
        batches = [data_fn(step, 0, plan.world_size) for step in range(args.steps)]
    elif hasattr(module, "example_batch"):
        with torch.device("cpu"):
            model = model_fn()
        batches = [module.example_batch(model, plan.global_batch_size, seed=step) for step in range(args.steps)]
    else:
        raise DeclarationError(f"{spec}: its module has no example_batch(model, batch_size, seed=) to make batches "
                               "from; pass --data pkg.module:fn with fn(step, rank, world_size) -> (inputs, targets)")
    eval_fn = held_out_data(args, spec, plan.global_batch_size)
    eval_batches = None if eval_fn is None else [eval_fn(k, 0, plan.world_size) for k in range(args.eval_batches)]
    sources = None  # None: launch_local generates each rank's program from the plan
    if args.programs:
        d = _programs(args, plan)
        sources = {r: (d / f"rank_{r}.py").read_text() for r in range(plan.world_size)}

    info(f"training {args.steps} steps of {spec} on {plan.world_size} local processes ({plan.config})")
    try:
        res = launch_local(plan, model_fn, optimizer_fn, loss_fn, batches, timeout_s=args.timeout_s,
                           programs=sources, verify=not args.no_verify, scheduler_fn=scheduler_fn,
                           eval_batches=eval_batches, eval_every=args.eval_every if eval_batches else None)
    except LaunchError as exc:
        raise RunFailed(f"the run failed: {exc}") from exc
    if args.save:
        torch.save(res.state_dict, args.save)
        info(f"saved the trained parameters to {args.save}")
    if args.json:
        emit(args, {"plan": args.plan, "model": spec, "world_size": plan.world_size, "steps": args.steps,
                     "losses": res.losses, "step_times_s": res.step_times_s,
                     "predicted_step_s": plan.predicted.step_time_s, "peak_memory_bytes": res.peak_memory_bytes,
                     "peak_rss_bytes": res.peak_rss_bytes, "collective_counts": res.collective_counts,
                     "eval_losses": res.eval_losses})
        return EXIT_OK
    evals = dict(res.eval_losses)
    for i, (loss, dt) in enumerate(zip(res.losses, res.step_times_s)):
        print(f"step {i + 1}/{args.steps} loss {loss:.6f} ({dt:.3f} s)")
        if i + 1 in evals:
            print(f"eval after step {i + 1}: loss {evals[i + 1]:.6f} over {args.eval_batches} batch(es)")
    mean = sum(res.step_times_s) / len(res.step_times_s)
    print(f"{args.steps} steps on {plan.world_size} processes: loss {res.losses[0]:.6f} -> {res.losses[-1]:.6f}, "
          f"{mean:.3f} s/step (predicted {plan.predicted.step_time_s:.3f} s), "
          f"peak held memory {max(res.peak_memory_bytes) / 2**20:.1f} MiB per rank")
    return EXIT_OK


def _programs(args: argparse.Namespace, plan: Any) -> Path:
    """The per-rank programs' directory: --programs if it holds every rank's (say, edited by hand), else
    written there from the plan (default: PLAN.programs/ beside the plan)."""
    d = Path(args.programs) if args.programs else Path(args.plan).with_suffix(".programs")
    if args.programs and all((d / f"rank_{r}.py").is_file() for r in range(plan.world_size)):
        info(f"using the programs in {d}/")
        return d
    plan.write_programs(d)
    info(f"wrote plan.json and rank_0.py .. rank_{plan.world_size - 1}.py to {d}/")
    return d


def _print_command(args: argparse.Namespace, plan: Any, topo: Any, spec: str) -> int:
    programs = _programs(args, plan)
    tail = ["-m", "runtime.run", args.plan, "--programs", str(programs), "--model", spec, "--steps", str(args.steps),
            "--timeout-s", f"{args.timeout_s:g}"]
    for flag in ("optimizer", "scheduler", "loss", "data", "save", "eval_every", "eval_data"):
        if getattr(args, flag):
            tail += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.eval_every:
        tail += ["--eval-batches", str(args.eval_batches)]
    tail = shlex.join(tail)
    srun = f"srun --nodes {topo.nodes} --ntasks-per-node {topo.devices_per_node} python {tail}"
    if topo.nodes == 1:  # the rendezvous stays on this machine: loopback, said explicitly (runtime.launch.env)
        torchrun = f"torchrun --nproc-per-node {topo.devices_per_node} {LOOPBACK} {tail}"
    else:  # the $VARs are left for the shell on each node to expand
        torchrun = (f"torchrun --nnodes {topo.nodes} --nproc-per-node {topo.devices_per_node} --node-rank $NODE_RANK "
                    f"--master-addr $MASTER_ADDR --master-port {DEFAULT_MASTER_PORT} {tail}")
        # rank 0 hosts the rendezvous on the first node's address, reachable from the others: the explicit
        # opt-in runtime.launch.rendezvous requires to listen beyond loopback (srun passes the environment on)
        srun = f"{ALLOW_EXTERNAL_BIND}=1 {srun}"
    if args.json:
        emit(args, {"plan": args.plan, "model": spec, "topology": str(topo), "world_size": plan.world_size,
                     "nodes": topo.nodes, "programs": str(programs), "torchrun": torchrun, "srun": srun})
        return EXIT_OK
    where = "" if topo.nodes == 1 else (f" on each of the {topo.nodes} nodes (NODE_RANK 0..{topo.nodes - 1}, "
                                        "MASTER_ADDR the first node's address)")
    print(f"{plan.world_size} ranks on {topo}: run from this directory{where}, with the plan and {programs}/ "
          f"on a shared filesystem:\n  {torchrun}\nor under SLURM:\n  {srun}\n"
          f"(torchrun's own rendezvous store listens on every interface whatever --master-addr says: on a "
          f"shared network, firewall port {DEFAULT_MASTER_PORT})")
    return EXIT_OK
