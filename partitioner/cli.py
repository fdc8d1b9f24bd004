"""The `partitioner` command line (also `python -m partitioner`).

    partitioner trace examples/gpt.py:gpt_small            # per-block cost table
    partitioner trace examples/gpt.py:gpt3_175b --device meta --per block
    partitioner trace examples/cnn.py:cnn --per node --batch-size 32

Exit codes: 0 success, 2 bad input (the message says what to fix),
1 an internal error (run with --debug for the traceback).
"""

from __future__ import annotations

import argparse
import sys
import time

from cost_models.errors import PartitionerError

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
