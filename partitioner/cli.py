"""The `partitioner` command line (also `python -m partitioner`).

    partitioner compile examples/gpt.py:gpt_small --topology local:4 --global-batch-size 32
    partitioner compile examples/gpt.py:gpt3_175b --device meta --topology 128x8xA100-80GB --global-batch-size 1536 -o gpt.plan.json
    partitioner show gpt.plan.json --explain
    partitioner trace examples/gpt.py:gpt_small            # per-block cost table
    partitioner trace examples/cnn.py:cnn --per node --batch-size 32

Exit codes: 0 success, 2 bad input (the message says what to fix),
1 an internal error (run with --debug for the traceback).
"""

from __future__ import annotations

import argparse
import sys
import time

from cost_models.errors import DeclarationError, PartitionerError

__all__ = ["main"]


def _trace(args: argparse.Namespace) -> int:
    from partitioner.loading import load_model
    from partitioner.trace import trace

    model, inputs, _ = load_model(args.model, device=args.device, batch_size=args.batch_size)
    t0 = time.perf_counter()
    g = trace(model, inputs, method=args.method, expand_repeated=not args.no_expand)
    dt = time.perf_counter() - t0
    print(g.table(batch_size=args.batch_size, per=args.per))
    print(f"\ntraced in {dt:.2f} s; forward+backward {g.flops(batch_size=args.batch_size):.4g} FLOPs "
          f"per step of batch {args.batch_size}")
    return 0


def _compile(args: argparse.Namespace) -> int:
    from partitioner.compile import compile
    from partitioner.loading import load_model

    model, inputs, module = load_model(args.model, device=args.device, batch_size=2)
    if hasattr(module, "example_batch"):
        # an (inputs, targets) training batch: runtime.run calls model(inputs) and gives the targets to
        # the loss, so the plan's code is traced the same way
        inputs = inputs[:1]
    pins = {k: getattr(args, k) for k in ("dp", "tp", "pp", "zero_stage", "microbatch_size", "schedule",
                                         "interleave", "recompute") if getattr(args, k) is not None}
    if args.compression is not None:
        pins["compression"] = _compression_arg(args.compression)
    if args.compression_warmup:
        pins["compression_warmup"] = args.compression_warmup
    t0 = time.perf_counter()
    plan = compile(model, args.topology, example_inputs=inputs, global_batch_size=args.global_batch_size,
                   precision=args.precision, optimizer=args.optimizer, max_memory_fraction=args.max_memory_fraction,
                   **pins)
    dt = time.perf_counter() - t0
    print(plan.to_json() if args.json else plan, end="" if args.json else "\n")
    if args.explain and not args.json:
        print("\n" + plan.explain())
    if args.output:
        plan.save(args.output)
    if args.programs:
        plan.write_programs(args.programs)
    if not args.json:
        wrote = [f"plan written to {args.output}"] if args.output else []
        wrote += [f"programs written to {args.programs}/ (run: torchrun --nproc-per-node {plan.world_size} "
                  f"-m runtime.run {args.programs}/plan.json --model {args.model})"] if args.programs else []
        print(f"\ncompiled in {dt:.2f} s" + "".join("; " + w for w in wrote))
    return 0


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
    from partitioner.plan import Plan

    plan = Plan.load(args.plan)
    print(plan.to_json() if args.json else plan, end="" if args.json else "\n")
    if args.explain and not args.json:
        print("\n" + plan.explain())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="partitioner", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="examples:\n" + "\n".join(__doc__.split("\n\n")[1].splitlines()))
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace", help="trace a model and print its cost table",
                       description="Trace MODEL (FILE.py:FACTORY or package.module:FACTORY) and print its OpGraph.")
    t.add_argument("model", help="e.g. examples/gpt.py:gpt_small")
    t.add_argument("--batch-size", type=int, default=8, help="batch size the costs are shown for (default 8)")
    t.add_argument("--per", choices=("block", "node"), default="block", help="one row per block (default) or per node")
    t.add_argument("--method", choices=("auto", "export", "fx"), default="auto", help="capture mechanism")
    t.add_argument("--device", default=None, help="build the model on this device, e.g. meta for huge models")
    t.add_argument("--no-expand", action="store_true", help="trace every block instead of copying repeated ones")
    t.set_defaults(func=_trace)

    c = sub.add_parser("compile", help="plan a model for a topology and print the plan",
                       description="Compile MODEL for TOPOLOGY: trace, search, cut, schedule; print the plan table.")
    c.add_argument("model", help="e.g. examples/gpt.py:gpt_small")
    c.add_argument("--topology", required=True, help='e.g. "local:4", "4x8xA100-80GB", or a .json/.yaml file')
    c.add_argument("--global-batch-size", type=int, required=True, help="samples per optimizer step, all replicas")
    c.add_argument("--precision", default="bf16-mixed", choices=("fp32", "bf16-mixed", "fp16-mixed"))
    c.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "sgd"))
    for name, kind in (("dp", int), ("tp", int), ("pp", int), ("zero-stage", int), ("microbatch-size", int),
                       ("interleave", int)):
        c.add_argument(f"--{name}", type=kind, default=None, help=f"pin {name} (default: the planner chooses)")
    c.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved-1f1b"), default=None, help="pin the schedule")
    c.add_argument("--recompute", choices=("none", "selective", "full"), default=None, help="pin recomputation")
    c.add_argument("--compression", default=None, metavar="NAME|LEVEL=NAME,...",
                   help="pin the data-parallel gradient compressor (none, bf16, int8, int4, powersgd) on every link "
                        "level, or per level, e.g. inter_node=int8,intra_node=none (default: the planner chooses)")
    c.add_argument("--compression-warmup", type=int, default=0, metavar="K",
                   help="the first K steps reduce uncompressed (default 0)")
    c.add_argument("--max-memory-fraction", type=float, default=0.9, help="usable share of device memory (default 0.9)")
    c.add_argument("--device", default=None, help="build the model on this device, e.g. meta for huge models")
    c.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    c.add_argument("--programs", default=None, metavar="DIR",
                   help="write plan.json and one program per rank (rank_R.py) into DIR, for runtime.run")
    c.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    c.add_argument("--explain", action="store_true", help="also print why this plan won")
    c.set_defaults(func=_compile)

    sh = sub.add_parser("show", help="print a saved plan", description="Print the plan saved in PLAN (JSON).")
    sh.add_argument("plan", help="a plan JSON written by compile -o")
    sh.add_argument("--json", action="store_true", help="print the JSON")
    sh.add_argument("--explain", action="store_true", help="also print why this plan won")
    sh.set_defaults(func=_show)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PartitionerError as exc:
        if args.debug:
            raise
        print(f"partitioner {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence, traceback with --debug
        if args.debug:
            raise
        print(f"partitioner {args.command}: internal error: {type(exc).__name__}: {exc} (rerun with --debug)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
