"""The `partitioner` command line (also `python -m partitioner`): trace, compile, show, run, autotune, reshard.

    partitioner trace examples/gpt.py:gpt_small                  # per-block cost table
    partitioner compile examples/gpt.py:gpt_tiny --topology local:4 --global-batch-size 8 -o plan.json
    partitioner compile examples/gpt.py:gpt3_175b --device meta --topology 128x8xA100-80GB --global-batch-size 1536 -o gpt.plan.json
    partitioner show plan.json --explain
    partitioner show plan.json --rank 3                           # the program rank 3 runs
    partitioner run plan.json --steps 10                          # local:N plans train here; others print torchrun
    partitioner autotune examples/gpt.py:gpt_tiny --topology local:4 --global-batch-size 8 -o best.json
    partitioner autotune examples/gpt.py:gpt_small --topology 2x8xH100-80GB --global-batch-size 64 --launcher srun
    partitioner reshard ckpt/ --to plan_b.json -o ckpt_b/           # a checkpoint for another plan, offline

Every subcommand takes --json: exactly one JSON document on stdout (progress
and info on stderr), nothing on stdout when it fails. Errors are one line on
stderr; --debug adds the traceback.

Exit codes:
    0    success
    1    internal error (a bug: run with --debug for the traceback)
    2    bad input: arguments, model, topology, plan file (the message says what to fix)
    3    the plan is infeasible: no configuration fits in memory
    4    a run or autotune trial failed
    130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from cost_models.choices import OPTIMIZERS, PRECISIONS, RECOMPUTE_POLICIES, SCHEDULES
from cost_models.errors import DeclarationError, PartitionerError
from partitioner.compile import PlanInfeasibleError
from runtime.launch.env import (
    ALLOW_EXTERNAL_BIND,
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    LaunchError,
)

__all__ = ["build_parser", "main"]

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_INFEASIBLE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
# torchrun's rendezvous for a job on one machine, on loopback (torchrun's default too, written out so the
# printed command says where it listens)
_LOOPBACK = f"--master-addr {DEFAULT_MASTER_ADDR} --master-port {DEFAULT_MASTER_PORT}"


class RunFailed(Exception):
    """A run or autotune trial that failed while running (exit 4), as opposed to bad input (exit 2)."""


def _emit(args: argparse.Namespace, doc: Any) -> None:
    """The one JSON document of a --json command, on the real stdout (everything else went to stderr)."""
    print(json.dumps(doc, indent=1), file=args.stdout)


def _info(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- trace ------------------------------------------------------------------------------------------------


def _trace(args: argparse.Namespace) -> int:
    from partitioner.loading import load_model
    from partitioner.tracer.trace import trace

    model, inputs, _ = load_model(args.model, device=args.device, batch_size=args.batch_size)
    t0 = time.perf_counter()
    g = trace(model, inputs, method=args.method, expand_repeated=not args.no_expand)
    dt = time.perf_counter() - t0
    flops = g.flops(batch_size=args.batch_size)  # also refuses a batch size the trace fixed
    if args.json:
        _emit(args, {"model": args.model, "model_name": g.model_name, "method": g.method, "num_params": g.num_params,
                     "batch_size": args.batch_size, "per": args.per, "rows": _trace_rows(g, args.batch_size, args.per),
                     "flops": flops, "trace_time_s": dt})
        return EXIT_OK
    print(g.table(batch_size=args.batch_size, per=args.per))
    print(f"\ntraced in {dt:.2f} s; forward+backward {flops:.4g} FLOPs per step of batch {args.batch_size}")
    return EXIT_OK


def _trace_rows(g: Any, batch_size: int, per: str) -> list[dict[str, Any]]:
    """The rows of `g.table(per=...)` as numbers (the table shows them rounded, '153.0G')."""
    b, s = batch_size, g.traced_seq_len or 1

    def costs(nodes) -> dict[str, Any]:
        return {"params": sum(n.param_count for n in nodes),
                "forward_flops": sum(n.cost.forward_flops(b, s) for n in nodes),
                "backward_flops": sum(n.cost.backward_flops(b, s) for n in nodes),
                "activation_bytes": sum(n.cost.activation_bytes(b, s) for n in nodes),
                "bytes_moved": sum(n.cost.bytes_read(b, s) + n.cost.bytes_written(b, s) for n in nodes)}

    if per == "node":
        return [{"node": n.name, "op": n.op, "module": n.module_path, "shape": str(n.output) if n.output else None,
                 **costs([n])} for n in g.nodes]
    return [{"segment": label, "nodes": len(nodes), **costs(nodes)} for label, nodes in g.segments()]


# ---- compile / show ---------------------------------------------------------------------------------------


def _compile(args: argparse.Namespace) -> int:
    from cost_models.topology import Topology
    from partitioner.compile import compile
    from partitioner.loading import load_model

    topology = Topology.coerce(args.topology)  # a bad topology fails before the model is built
    model, inputs, module = load_model(args.model, device=args.device, batch_size=2)
    if hasattr(module, "example_batch"):
        # an (inputs, targets) training batch: runtime.run calls model(inputs) and gives the targets to
        # the loss, so the plan's code is traced the same way
        inputs = inputs[:1]
    t0 = time.perf_counter()
    plan = compile(model, topology, example_inputs=inputs, global_batch_size=args.global_batch_size,
                   **_plan_options(args))
    plan = dataclasses.replace(plan, model_source=args.model)  # so `partitioner run` needs no --model
    dt = time.perf_counter() - t0
    if args.verify:
        _info(str(_verify(args, plan, model, inputs)))
    if args.output:
        plan.save(args.output)
    if args.programs:
        plan.write_programs(args.programs)
    if args.json:
        args.stdout.write(plan.to_json())
        return EXIT_OK
    print(plan)
    if args.explain:
        print("\n" + plan.explain())
    wrote = [f"plan written to {args.output}"] if args.output else []
    if args.programs:
        wrote.append(f"programs written to {args.programs}/ (run: torchrun --nproc-per-node {plan.world_size} "
                     f"{_LOOPBACK} -m runtime.run {args.programs}/plan.json --model {args.model})")
    print(f"\ncompiled in {dt:.2f} s" + "".join("; " + w for w in wrote))
    return EXIT_OK


def _verify(args: argparse.Namespace, plan: Any, model: Any, inputs: tuple[Any, ...]) -> Any:
    """compile --verify: as compile(..., verify=True), on a copy of the model; a model built on meta (--device
    meta) is built again on the CPU from its factory, with random token ids for inputs."""
    import copy

    import torch

    from partitioner.loading import load_module
    from runtime.verify.check import MAX_VERIFY_ELEMENTS, num_parameters

    if not any(p.is_meta for p in model.parameters()):
        return plan.verify(lambda: copy.deepcopy(model), inputs)
    n = num_parameters(plan)
    if n > MAX_VERIFY_ELEMENTS:
        raise DeclarationError(f"--verify: {args.model} has {n:.3g} parameter elements; verifying builds it "
                               f"pp * tp + 1 times on the CPU (over {MAX_VERIFY_ELEMENTS:.3g} is refused): verify "
                               "a smaller configuration of the same model code, or drop --verify")
    module, name = load_module(args.model)
    factory = getattr(module, name)
    return plan.verify((lambda: copy.deepcopy(factory)) if isinstance(factory, torch.nn.Module) else factory)


def _plan_options(args: argparse.Namespace) -> dict[str, Any]:
    """compile()'s keyword arguments from the planning flags `_add_plan_options` declares."""
    out = {k: getattr(args, k) for k in ("precision", "optimizer", "max_memory_fraction", "dp", "tp", "pp",
                                         "zero_stage", "microbatch_size", "schedule", "interleave", "recompute")
           if getattr(args, k) is not None}
    if args.compression is not None:
        out["compression"] = _compression_arg(args.compression)
    if args.compression_warmup:
        out["compression_warmup"] = args.compression_warmup
    return out


def _compression_arg(text: str) -> str | dict[str, str]:
    """--compression int8 -> "int8"; --compression inter_node=int8,intra_node=none -> a dict (compile checks names).

    >>> _compression_arg("inter_node=int8, intra_node=none")
    {'inter_node': 'int8', 'intra_node': 'none'}
    """
    if "=" not in text:
        return text.strip()
    out = {}
    for item in text.split(","):
        level, sep, name = item.partition("=")
        if not sep or not level.strip() or not name.strip():
            raise DeclarationError(f"--compression {text!r}: {item!r} is not LEVEL=NAME; write e.g. "
                                   "--compression int8 or --compression inter_node=int8,intra_node=none")
        out[level.strip()] = name.strip()
    return out


def _show(args: argparse.Namespace) -> int:
    from partitioner.planner.plan import Plan

    plan = Plan.load(args.plan)
    if args.rank is not None:
        if not 0 <= args.rank < plan.world_size:
            raise DeclarationError(f"--rank {args.rank}: {args.plan} has ranks 0..{plan.world_size - 1} "
                                   f"(world size {plan.world_size})")
        source = plan.program(args.rank).source
        if args.json:
            _emit(args, {"rank": args.rank, "source": source})
        else:
            print(source, end="")
        return EXIT_OK
    if args.json:
        args.stdout.write(plan.to_json())
        return EXIT_OK
    print(plan)
    if args.explain:
        print("\n" + plan.explain())
    return EXIT_OK


# ---- run --------------------------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
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
    from runtime.run import default_loss, default_optimizer

    module, _, _ = load_object(spec, "--model")
    model_fn = load_callable(spec, "--model")
    optimizer_fn = load_callable(args.optimizer, "--optimizer") if args.optimizer else default_optimizer(plan.optimizer)
    loss_fn = load_callable(args.loss, "--loss") if args.loss else default_loss
    for name, fn in (("--model", model_fn), ("--optimizer", optimizer_fn), ("--loss", loss_fn)):
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
    sources = None  # None: launch_local generates each rank's program from the plan
    if args.programs:
        d = _programs(args, plan)
        sources = {r: (d / f"rank_{r}.py").read_text() for r in range(plan.world_size)}

    _info(f"training {args.steps} steps of {spec} on {plan.world_size} local processes ({plan.config})")
    try:
        res = launch_local(plan, model_fn, optimizer_fn, loss_fn, batches, timeout_s=args.timeout_s,
                           programs=sources, verify=not args.no_verify)
    except LaunchError as exc:
        raise RunFailed(f"the run failed: {exc}") from exc
    if args.save:
        torch.save(res.state_dict, args.save)
        _info(f"saved the trained parameters to {args.save}")
    if args.json:
        _emit(args, {"plan": args.plan, "model": spec, "world_size": plan.world_size, "steps": args.steps,
                     "losses": res.losses, "step_times_s": res.step_times_s,
                     "predicted_step_s": plan.predicted.step_time_s, "peak_memory_bytes": res.peak_memory_bytes,
                     "peak_rss_bytes": res.peak_rss_bytes, "collective_counts": res.collective_counts})
        return EXIT_OK
    for i, (loss, dt) in enumerate(zip(res.losses, res.step_times_s)):
        print(f"step {i + 1}/{args.steps} loss {loss:.6f} ({dt:.3f} s)")
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
        _info(f"using the programs in {d}/")
        return d
    plan.write_programs(d)
    _info(f"wrote plan.json and rank_0.py .. rank_{plan.world_size - 1}.py to {d}/")
    return d


def _print_command(args: argparse.Namespace, plan: Any, topo: Any, spec: str) -> int:
    programs = _programs(args, plan)
    tail = ["-m", "runtime.run", args.plan, "--programs", str(programs), "--model", spec, "--steps", str(args.steps),
            "--timeout-s", f"{args.timeout_s:g}"]
    for flag in ("optimizer", "loss", "data", "save"):
        if getattr(args, flag):
            tail += [f"--{flag}", getattr(args, flag)]
    tail = shlex.join(tail)
    srun = f"srun --nodes {topo.nodes} --ntasks-per-node {topo.devices_per_node} python {tail}"
    if topo.nodes == 1:  # the rendezvous stays on this machine: loopback, said explicitly (runtime.launch.env)
        torchrun = f"torchrun --nproc-per-node {topo.devices_per_node} {_LOOPBACK} {tail}"
    else:  # the $VARs are left for the shell on each node to expand
        torchrun = (f"torchrun --nnodes {topo.nodes} --nproc-per-node {topo.devices_per_node} --node-rank $NODE_RANK "
                    f"--master-addr $MASTER_ADDR --master-port {DEFAULT_MASTER_PORT} {tail}")
        # rank 0 hosts the rendezvous on the first node's address, reachable from the others: the explicit
        # opt-in runtime.launch.rendezvous requires to listen beyond loopback (srun passes the environment on)
        srun = f"{ALLOW_EXTERNAL_BIND}=1 {srun}"
    if args.json:
        _emit(args, {"plan": args.plan, "model": spec, "topology": str(topo), "world_size": plan.world_size,
                     "nodes": topo.nodes, "programs": str(programs), "torchrun": torchrun, "srun": srun})
        return EXIT_OK
    where = "" if topo.nodes == 1 else (f" on each of the {topo.nodes} nodes (NODE_RANK 0..{topo.nodes - 1}, "
                                        "MASTER_ADDR the first node's address)")
    print(f"{plan.world_size} ranks on {topo}: run from this directory{where}, with the plan and {programs}/ "
          f"on a shared filesystem:\n  {torchrun}\nor under SLURM:\n  {srun}\n"
          f"(torchrun's own rendezvous store listens on every interface whatever --master-addr says: on a "
          f"shared network, firewall port {DEFAULT_MASTER_PORT})")
    return EXIT_OK


# ---- autotune ---------------------------------------------------------------------------------------------


def _autotune(args: argparse.Namespace) -> int:
    from cost_models.topology import Topology
    from partitioner.tune.autotune import AutotuneFailed, autotune, format_trials

    topology = Topology.coerce(args.topology)  # a bad topology fails before anything runs
    try:
        res = autotune(args.model, topology, global_batch_size=args.global_batch_size, trials=args.trials,
                       db=args.db, steps=args.steps, warmup=args.warmup, timeout_s=args.timeout_s,
                       calibration_out=args.calibration_out, progress=sys.stderr, data=args.data,
                       launcher=args.launcher, launcher_args=_launcher_args(args), **_plan_options(args))
    except AutotuneFailed as exc:  # every trial ran and failed: a failed run (4), not bad input
        raise RunFailed(str(exc)) from exc
    plan = dataclasses.replace(res.plan, model_source=args.model)
    if args.output:
        plan.save(args.output)
    if args.json:
        _emit(args, res.to_dict())
        return EXIT_OK
    print(format_trials(res.trials))
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


# ---- the parser -------------------------------------------------------------------------------------------


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join("  " + line for line in lines)


_EXIT_CODES = __doc__[__doc__.index("Exit codes:"):].strip()


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    p.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
    for name in ("dp", "tp", "pp", "zero-stage", "microbatch-size", "interleave"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"pin {name} (default: the planner chooses)")
    p.add_argument("--schedule", choices=SCHEDULES, default=None, help="pin the schedule")
    p.add_argument("--recompute", choices=RECOMPUTE_POLICIES, default=None, help="pin recomputation")
    p.add_argument("--compression", default=None, metavar="NAME|LEVEL=NAME,...",
                   help="pin the data-parallel gradient compressor (none, bf16, int8, int4, powersgd) on every link "
                        "level, or per level, e.g. inter_node=int8,intra_node=none (default: the planner chooses)")
    p.add_argument("--compression-warmup", type=int, default=0, metavar="K",
                   help="the first K steps reduce uncompressed (default 0)")
    p.add_argument("--max-memory-fraction", type=float, default=0.9, help="usable share of device memory (default 0.9)")


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="partitioner", description=__doc__.split("\n\n")[0], formatter_class=raw,
                                epilog=_examples(*(line.strip() for line in __doc__.split("\n\n")[1].splitlines()))
                                + "\n\n" + _EXIT_CODES)
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    # on every subcommand too; SUPPRESS keeps `partitioner --debug run ...` from being reset by the subparser
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout, nothing else there")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback on errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="{trace,compile,show,run,autotune}")

    def command(name: str, help: str, description: str, *examples: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=description, parents=[common], formatter_class=raw,
                              epilog=_examples(*examples) + "\n\n" + _EXIT_CODES)

    t = command("trace", "trace a model and print its cost table",
                "Trace MODEL (FILE.py:FACTORY or package.module:FACTORY) and print its OpGraph's costs.",
                "partitioner trace examples/gpt.py:gpt_small",
                "partitioner trace examples/cnn.py:cnn --per node --batch-size 32",
                "partitioner trace examples/gpt.py:gpt_tiny --json | jq '.rows[0]'")
    t.add_argument("model", help="e.g. examples/gpt.py:gpt_small")
    t.add_argument("--batch-size", type=int, default=8, help="batch size the costs are shown for (default 8)")
    t.add_argument("--per", choices=("block", "node"), default="block", help="one row per block (default) or per node")
    t.add_argument("--method", choices=("auto", "export", "fx"), default="auto", help="capture mechanism")
    t.add_argument("--device", default=None, help="build the model on this device, e.g. meta for huge models")
    t.add_argument("--no-expand", action="store_true", help="trace every block instead of copying repeated ones")
    t.set_defaults(func=_trace)

    c = command("compile", "plan a model for a topology and print the plan",
                "Compile MODEL for TOPOLOGY: trace, search, cut, schedule; print the plan table.",
                "partitioner compile examples/gpt.py:gpt_tiny --topology local:4 --global-batch-size 8 -o plan.json",
                "partitioner compile examples/gpt.py:gpt3_175b --device meta --topology 128x8xA100-80GB "
                "--global-batch-size 1536 --explain",
                "partitioner compile examples/gpt.py:gpt_small --topology local:4 --global-batch-size 8 --tp 2 "
                "--programs out/")
    c.add_argument("model", help="e.g. examples/gpt.py:gpt_small (recorded in the plan for `partitioner run`)")
    c.add_argument("--topology", required=True, help='e.g. "local:4", "4x8xA100-80GB", or a .json/.yaml file')
    c.add_argument("--global-batch-size", type=int, required=True, help="samples per optimizer step, all replicas")
    _add_plan_options(c)
    c.add_argument("--device", default=None, help="build the model on this device, e.g. meta for huge models")
    c.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    c.add_argument("--programs", default=None, metavar="DIR",
                   help="write plan.json and one program per rank (rank_R.py) into DIR, for runtime.run")
    c.add_argument("--explain", action="store_true", help="also print why this plan won")
    c.add_argument("--verify", action="store_true",
                   help="run the chosen plan's generated code in this process against the model (plan.verify) and "
                        "fail where they differ")
    c.set_defaults(func=_compile)

    sh = command("show", "print a saved plan, or one rank's program",
                 "Print the plan saved in PLAN (JSON), or with --rank the Python program that rank runs.",
                 "partitioner show plan.json --explain", "partitioner show plan.json --rank 3",
                 "partitioner show plan.json --json")
    sh.add_argument("plan", help="a plan JSON written by compile -o")
    sh.add_argument("--rank", type=int, default=None, help="print this rank's generated program instead")
    sh.add_argument("--explain", action="store_true", help="also print why this plan won")
    sh.set_defaults(func=_show)

    r = command("run", "train with a plan: local processes, or print the cluster command",
                "Train with PLAN. A local:N plan runs here as N Gloo processes, one line per step; a plan for GPUs "
                "or several nodes writes its programs beside the plan and prints the torchrun and srun commands.",
                "partitioner run plan.json --steps 10",
                "partitioner run plan.json --model examples/gpt.py:gpt_tiny --steps 3 --json",
                "partitioner run gpt.plan.json --print-command")
    r.add_argument("plan", help="a plan JSON written by compile -o")
    r.add_argument("--model", default=None, help="pkg.module:factory or FILE.py:factory (default: the one the plan "
                                                 "was compiled from)")
    r.add_argument("--steps", type=_positive, default=10, help="training steps (default 10)")
    r.add_argument("--timeout-s", type=float, default=300.0,
                   help="how long a rank may go without progress before the run is stopped (default 300)")
    r.add_argument("--programs", default=None, metavar="DIR",
                   help="run the rank_R.py in DIR (e.g. edited by hand); written there from the plan when missing")
    r.add_argument("--optimizer", default=None, help="factory(params) -> Optimizer (default: the plan's optimizer)")
    r.add_argument("--loss", default=None, help="fn(output, target) -> loss (default: cross-entropy or MSE)")
    r.add_argument("--data", default=None, help="fn(step, rank, world_size) -> (inputs, targets), the global batch "
                                                "(default: the model module's example_batch)")
    r.add_argument("--save", default=None, metavar="FILE", help="write the trained parameters here")
    r.add_argument("--print-command", action="store_true", help="print the torchrun command even for a local plan")
    r.add_argument("--no-verify", action="store_true",
                   help="skip checking the programs' model code against the model before spawning (plan.verify)")
    r.set_defaults(func=_run)

    a = command("autotune", "compile, measure the best candidates, recalibrate, keep the fastest",
                "Compile MODEL for TOPOLOGY, run the most promising configurations for a few steps each, record "
                "the measurements in --db and refit the cost model from them, and keep the fastest plan.",
                "partitioner autotune examples/gpt.py:gpt_tiny --topology local:4 --global-batch-size 8 -o best.json",
                "partitioner autotune examples/gpt.py:gpt_tiny --topology local:2 --global-batch-size 8 --trials 3 "
                "--db tune.sqlite --json",
                "partitioner autotune examples/gpt.py:gpt_small --topology 2x8xH100-80GB --global-batch-size 64 "
                "--launcher srun --db tune.sqlite   # inside a SLURM allocation",
                "partitioner autotune examples/gpt.py:gpt_small --topology 2x8xH100-80GB --global-batch-size 64 "
                "--launcher torchrun --rdzv-endpoint node01:29400 --launcher-wrapper 'srun --ntasks-per-node=1'")
    a.add_argument("model", help="e.g. examples/gpt.py:gpt_tiny")
    a.add_argument("--topology", required=True,
                   help='e.g. "local:4", "2x8xH100-80GB" (with --launcher torchrun/srun), or a .json/.yaml file')
    a.add_argument("--global-batch-size", type=int, required=True, help="samples per optimizer step, all replicas")
    a.add_argument("--trials", type=_positive, default=6, help="configurations to measure (default 6)")
    a.add_argument("--db", default="partitioner-tune.sqlite", help="the measurements database (default "
                                                                   "partitioner-tune.sqlite)")
    a.add_argument("--steps", type=_positive, default=3, help="measured steps per trial (default 3)")
    a.add_argument("--warmup", type=int, default=1, help="unmeasured steps before them (default 1)")
    a.add_argument("--timeout-s", type=float, default=120.0, help="per trial (default 120)")
    a.add_argument("--calibration-out", default=None, metavar="PATH", help="write the refitted calibration here")
    a.add_argument("-o", "--output", default=None, help="write the best plan JSON here")
    a.add_argument("--data", default=None, help="fn(step, rank, world_size) -> (inputs, targets), the global batch "
                                                "(default: the model module's example_batch)")
    g = a.add_argument_group("launcher", "how each trial runs: local processes, or one torchrun/srun job per trial "
                                         "(python -m runtime.run; partitioner/tune/cluster.py)")
    g.add_argument("--launcher", choices=("local", "torchrun", "srun"), default="local",
                   help="local (default; local:N topologies), torchrun or srun (a cluster topology)")
    g.add_argument("--nnodes", type=_positive, default=None, help="nodes of each job (default: the topology's)")
    g.add_argument("--nproc-per-node", type=_positive, default=None,
                   help="ranks per node (default: the topology's devices per node)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="torchrun's c10d rendezvous (default on one node: 127.0.0.1 and a free port)")
    g.add_argument("--launcher-wrapper", default=None, metavar="CMD",
                   help="what starts one torchrun agent per node on several nodes, e.g. 'srun --ntasks-per-node=1'")
    g.add_argument("--launcher-extra", default=None, metavar="FLAGS",
                   help="more flags for torchrun or srun, after an = since they start with --: "
                        "--launcher-extra='--gpus-per-task=1 --partition=gpu'")
    g.add_argument("--trial-dir", default=None, metavar="DIR",
                   help="where each trial's plan, programs, reports and logs go, on a file system every node "
                        "shares (default: DB.trials/ beside --db)")
    _add_plan_options(a)
    a.set_defaults(func=_autotune)

    rs = command("reshard", "rewrite a checkpoint for another plan, offline",
                 "Read the checkpoint CKPT (a step_N directory, or a save directory's newest) written under any plan, "
                 "and write it to OUT chunked as plan B's ranks hold their shards, with B in its manifest. One "
                 "process; the parameters and optimizer state are copied exactly.",
                 "partitioner reshard ckpt/ --to plan_b.json -o ckpt_b/",
                 "partitioner reshard ckpt/step_00000100 --to plan_b.json -o ckpt_b/ --json")
    rs.add_argument("checkpoint", help="a checkpoint directory (or a save directory: its newest)")
    rs.add_argument("--to", required=True, metavar="PLAN", help="plan B's JSON (compile -o)")
    rs.add_argument("-o", "--output", required=True, help="the new checkpoint directory (must not exist or be empty)")
    rs.set_defaults(func=_reshard)
    return p


def _reshard(args: argparse.Namespace) -> int:
    from partitioner.planner.plan import Plan
    from runtime.checkpoint.files import read_manifest, reshard

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # usage errors: argparse prints them and exits 2
    args.stdout = sys.stdout
    try:
        if args.json:  # stray prints (ours, a library's) must not corrupt the JSON on stdout
            sys.stdout = sys.stderr
        return args.func(args)
    except BaseException as exc:  # noqa: BLE001 - the CLI's last line of defence: one line, traceback with --debug
        error = exc
    finally:
        sys.stdout = args.stdout
    code = _exit_code(error)
    if code is None:
        raise error  # SystemExit and the like
    if args.debug:
        traceback.print_exception(error)
    # some messages carry a worker's traceback after their first line: that much only with --debug
    lines = str(error).splitlines() or [""]
    message = str(error) if args.debug or len(lines) == 1 else lines[0] + " (run with --debug for the details)"
    if code == EXIT_INTERRUPTED:
        line = "interrupted"
    elif code == EXIT_INTERNAL:
        line = f"internal error: {type(error).__name__}: {lines[0]}" + (
            "" if args.debug else " (run with --debug for the traceback)")
    else:
        line = f"error: {message}"
    print(f"partitioner {args.command}: {line}", file=sys.stderr)
    return code


def _exit_code(exc: BaseException) -> int | None:
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, PlanInfeasibleError):
        return EXIT_INFEASIBLE
    if isinstance(exc, RunFailed):
        return EXIT_FAILED
    if isinstance(exc, (PartitionerError, LaunchError, FileNotFoundError)):
        return EXIT_BAD_INPUT
    if isinstance(exc, Exception):
        return EXIT_INTERNAL
    return None


if __name__ == "__main__":
    sys.exit(main())
