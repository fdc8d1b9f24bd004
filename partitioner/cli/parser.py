"""The argparse parser of every subcommand (docs/cli.md is generated from it)."""

from __future__ import annotations

import argparse

from cost_models.choices import (
    CP_KINDS,
    GRAD_REDUCE_DTYPES,
    OPTIMIZER_LAYOUTS,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE_POLICIES,
    SCHEDULES,
    ZERO3_UNITS,
)
from partitioner.cli.autotune import autotune_command
from partitioner.cli.compile import compile_command, show_command
from partitioner.cli.probe import probe_command
from partitioner.cli.reshard import reshard_command
from partitioner.cli.run import run_command
from partitioner.cli.trace import trace_command

USAGE = """The `partitioner` command line (also `python -m partitioner`): trace, compile, show, run, autotune, reshard, probe.

    partitioner trace examples/gpt.py:gpt_small                  # per-block cost table
    partitioner compile examples/gpt.py:gpt_tiny --topology local:4 --global-batch-size 8 -o plan.json
    partitioner compile examples/gpt.py:gpt3_175b --device meta --topology 128x8xA100-80GB --global-batch-size 1536 -o gpt.plan.json
    partitioner show plan.json --explain
    partitioner show plan.json --rank 3                           # the program rank 3 runs
    partitioner run plan.json --steps 10                          # local:N plans train here; others print torchrun
    partitioner autotune examples/gpt.py:gpt_tiny --topology local:4 --global-batch-size 8 -o best.json
    partitioner autotune examples/gpt.py:gpt_small --topology 2x8xH100-80GB --global-batch-size 64 --launcher srun
    partitioner reshard ckpt/ --to plan_b.json -o ckpt_b/           # a checkpoint for another plan, offline
    partitioner probe --topology local:4 -o local4.calibration.json  # measure this machine (<= 60 s)

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

EXIT_CODES = USAGE[USAGE.index("Exit codes:"):].strip()


def examples_text(*lines: str) -> str:
    return "examples:\n" + "\n".join("  " + line for line in lines)


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    p.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
    p.add_argument("--grad-reduce-dtype", choices=GRAD_REDUCE_DTYPES, default=None,
                   help="dtype of the data-parallel gradient reduction under a mixed precision (default: fp32, "
                        "the planner free to compress)")
    p.add_argument("--optimizer-layout", choices=OPTIMIZER_LAYOUTS, default=None,
                   help="distributed: masters and optimizer state sharded over dp (Megatron's distributed "
                        "optimizer, ZeRO-1); replicated: ZeRO 0 (default: the planner chooses zero_stage)")
    for name in ("dp", "tp", "pp", "zero-stage", "microbatch-size", "interleave"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"pin {name} (default: the planner chooses)")
    p.add_argument("--cp", type=int, default=None,
                   help="pin the context-parallel degree: each sequence split over CP ranks (default: the planner "
                        "chooses)")
    p.add_argument("--cp-kind", choices=CP_KINDS, default=None,
                   help="attention under cp > 1: ring (key/value blocks round the group) or all-to-all (Ulysses)")
    p.add_argument("--ep", type=int, default=None,
                   help="pin the expert-parallel degree: each MoE layer's experts divided over EP data-parallel "
                        "ranks (default: the planner chooses for MoE models; programs run ep > 1 with dp, pp "
                        "and tp, fp32)")
    p.add_argument("--zero3-unit", choices=ZERO3_UNITS, default=None,
                   help="what ZeRO-3 gathers at once: block (a repeated block) or module (each module holding "
                        "parameters, DeepSpeed's granularity; pins --zero-stage 3; tp = cp = ep = 1 only) "
                        "(default: the planner chooses)")
    p.add_argument("--schedule", choices=SCHEDULES, default=None, help="pin the schedule")
    p.add_argument("--recompute", choices=RECOMPUTE_POLICIES, default=None, help="pin recomputation")
    p.add_argument("--recompute-blocks", default=None, metavar="K/N",
                   help="full recomputation of the first K of every N blocks only, the others keeping their "
                        "activations (e.g. 1/2: every second block; pins --recompute full) (default: every block "
                        "where recompute is pinned, else the planner chooses)")
    p.add_argument("--compression", default=None, metavar="NAME|LEVEL=NAME,...",
                   help="pin the data-parallel gradient compressor (none, bf16, int8, int4, powersgd) on every link "
                        "level, or per level, e.g. inter_node=int8,intra_node=none (default: the planner chooses)")
    p.add_argument("--compression-warmup", type=int, default=0, metavar="K",
                   help="the first K steps reduce uncompressed (default 0)")
    p.add_argument("--torch-compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="the programs run their model code under torch.compile, each block on its own, with BACKEND "
                        "(default when given: inductor; e.g. aot_eager)")
    p.add_argument("--max-memory-fraction", type=float, default=None,
                   help="usable share of device memory (default: all of it, less the caching allocator's slack for "
                        "the plan's recompute mode)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="the cost models' factors: a JSON from `partitioner probe` or autotune's --calibration-out "
                        "(default: the device's literature defaults)")


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="partitioner", description=USAGE.split("\n\n")[0], formatter_class=raw,
                                epilog=examples_text(*(line.strip() for line in USAGE.split("\n\n")[1].splitlines()))
                                + "\n\n" + EXIT_CODES)
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    # on every subcommand too; SUPPRESS keeps `partitioner --debug run ...` from being reset by the subparser
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout, nothing else there")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback on errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="{trace,compile,show,run,autotune,reshard,probe}")

    def command(name: str, help: str, description: str, *examples: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=description, parents=[common], formatter_class=raw,
                              epilog=examples_text(*examples) + "\n\n" + EXIT_CODES)

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
    t.set_defaults(func=trace_command)

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
    add_plan_options(c)
    c.add_argument("--device", default=None, help="build the model on this device, e.g. meta for huge models")
    c.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    c.add_argument("--programs", default=None, metavar="DIR",
                   help="write plan.json and one program per rank (rank_R.py) into DIR, for runtime.run")
    c.add_argument("--explain", action="store_true", help="also print why this plan won")
    c.add_argument("--verify", action="store_true",
                   help="run the chosen plan's generated code in this process against the model (plan.verify) and "
                        "fail where they differ")
    c.set_defaults(func=compile_command)

    sh = command("show", "print a saved plan, or one rank's program",
                 "Print the plan saved in PLAN (JSON), or with --rank the Python program that rank runs.",
                 "partitioner show plan.json --explain", "partitioner show plan.json --rank 3",
                 "partitioner show plan.json --json")
    sh.add_argument("plan", help="a plan JSON written by compile -o")
    sh.add_argument("--rank", type=int, default=None, help="print this rank's generated program instead")
    sh.add_argument("--explain", action="store_true", help="also print why this plan won")
    sh.set_defaults(func=show_command)

    r = command("run", "train with a plan: local processes, or print the cluster command",
                "Train with PLAN. A local:N plan runs here as N Gloo processes, one line per step; a plan for GPUs "
                "or several nodes writes its programs beside the plan and prints the torchrun and srun commands.",
                "partitioner run plan.json --steps 10",
                "partitioner run plan.json --model examples/gpt.py:gpt_tiny --steps 3 --json",
                "partitioner run gpt.plan.json --print-command")
    r.add_argument("plan", help="a plan JSON written by compile -o")
    r.add_argument("--model", default=None, help="pkg.module:factory or FILE.py:factory (default: the one the plan "
                                                 "was compiled from)")
    r.add_argument("--steps", type=positive, default=10, help="training steps (default 10)")
    r.add_argument("--timeout-s", type=float, default=300.0,
                   help="how long a rank may go without progress before the run is stopped (default 300)")
    r.add_argument("--programs", default=None, metavar="DIR",
                   help="run the rank_R.py in DIR (e.g. edited by hand); written there from the plan when missing")
    r.add_argument("--optimizer", default=None, help="factory(params) -> Optimizer (default: the plan's optimizer)")
    r.add_argument("--scheduler", default=None, help="factory(optimizer) -> a torch LRScheduler, stepped after each "
                                                    "optimizer step (default: none, a constant learning rate)")
    r.add_argument("--loss", default=None, help="fn(output, target) -> loss (default: cross-entropy or MSE)")
    r.add_argument("--data", default=None, help="fn(step, rank, world_size) -> (inputs, targets), the global batch "
                                                "(default: the model module's example_batch)")
    r.add_argument("--eval-every", type=positive, default=None, metavar="N",
                   help="evaluate after every N-th step and after the last: the mean loss over --eval-batches held-out "
                        "batches in eval mode (no dropout, nothing trained)")
    r.add_argument("--eval-batches", type=positive, default=1, metavar="K", help="batches per evaluation (default 1)")
    r.add_argument("--eval-data", default=None, help="fn(k, rank, world_size) -> (inputs, targets), the k-th held-out "
                                                     "global batch (default: the model module's example_batch at "
                                                     "seeds 1000000 + k)")
    r.add_argument("--save", default=None, metavar="FILE", help="write the trained parameters here")
    r.add_argument("--print-command", action="store_true", help="print the torchrun command even for a local plan")
    r.add_argument("--no-verify", action="store_true",
                   help="skip checking the programs' model code against the model before spawning (plan.verify)")
    r.set_defaults(func=run_command)

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
    a.add_argument("--trials", type=positive, default=6, help="configurations to measure (default 6)")
    a.add_argument("--db", default="partitioner-tune.sqlite", help="the measurements database (default "
                                                                   "partitioner-tune.sqlite)")
    a.add_argument("--steps", type=positive, default=3, help="measured steps per trial (default 3)")
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
    g.add_argument("--nnodes", type=positive, default=None, help="nodes of each job (default: the topology's)")
    g.add_argument("--nproc-per-node", type=positive, default=None,
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
    add_plan_options(a)
    a.set_defaults(func=autotune_command)

    rs = command("reshard", "rewrite a checkpoint for another plan, offline",
                 "Read the checkpoint CKPT (a step_N directory, or a save directory's newest) written under any plan, "
                 "and write it to OUT chunked as plan B's ranks hold their shards, with B in its manifest. One "
                 "process; the parameters and optimizer state are copied exactly.",
                 "partitioner reshard ckpt/ --to plan_b.json -o ckpt_b/",
                 "partitioner reshard ckpt/step_00000100 --to plan_b.json -o ckpt_b/ --json")
    rs.add_argument("checkpoint", help="a checkpoint directory (or a save directory: its newest)")
    rs.add_argument("--to", required=True, metavar="PLAN", help="plan B's JSON (compile -o)")
    rs.add_argument("-o", "--output", required=True, help="the new checkpoint directory (must not exist or be empty)")
    rs.set_defaults(func=reshard_command)

    pr = command("probe", "measure this machine's compute, memory and links into a calibration",
                 "Measure the machine TOPOLOGY runs on in about a minute: matmul FLOP/s by dtype and size, memory "
                 "bandwidth, an AdamW step's, the fixed memory of a process, and all-reduce / all-gather / reduce-scatter / all-to-all "
                 "/ send bandwidth and latency per link level and group size (alpha-beta fits); write the cost "
                 "models' factors fitted to them, with the measurements, as one calibration JSON. local:N spawns N "
                 "ranks here; on a cluster, run it under torchrun or srun (one process per device).",
                 "partitioner probe --topology local:4 -o local4.calibration.json",
                 "partitioner compile examples/gpt.py:gpt_small --topology local:4 --global-batch-size 8 "
                 "--calibration local4.calibration.json",
                 "torchrun --nproc-per-node 8 -m partitioner probe --topology 8xH100-80GB -o h100.calibration.json",
                 "srun -N 2 --ntasks-per-node 8 python -m partitioner probe --topology 2x8xH100-80GB -o cal.json")
    pr.add_argument("--topology", required=True, help='e.g. "local:4", or the cluster\'s, "2x8xH100-80GB"')
    pr.add_argument("-o", "--output", default=None, help="write the calibration JSON here")
    pr.add_argument("--quick", action="store_true", help="a few seconds' sweep: fewer sizes, fp32 only")
    pr.add_argument("--timeout-s", type=float, default=300.0, help="how long the ranks may take (default 300)")
    pr.set_defaults(func=probe_command)
    return p
