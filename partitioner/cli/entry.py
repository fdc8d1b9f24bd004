"""`main(argv)`: parse, run the subcommand, print one line per error and exit with a code that says what failed."""

from __future__ import annotations

import sys
import traceback

from cost_models.errors import PartitionerError
from partitioner.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INFEASIBLE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    RunFailed,
)
from partitioner.cli.parser import build_parser
from partitioner.compile import PlanInfeasibleError
from runtime.launch.env import (
    LaunchError,
)


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
    code = exit_code(error)
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


def exit_code(exc: BaseException) -> int | None:
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
