"""Shared by the subcommands: how they print (one JSON document on stdout with --json, info on stderr), the exit
codes, and the plan options compile and autotune share.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cost_models.errors import DeclarationError
from runtime.launch.env import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
)

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_INFEASIBLE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
# torchrun's rendezvous for a job on one machine, on loopback (torchrun's default too, written out so the
# printed command says where it listens)
LOOPBACK = f"--master-addr {DEFAULT_MASTER_ADDR} --master-port {DEFAULT_MASTER_PORT}"


class RunFailed(Exception):
    """A run or autotune trial that failed while running (exit 4), as opposed to bad input (exit 2)."""


def emit(args: argparse.Namespace, doc: Any) -> None:
    """The one JSON document of a --json command, on the real stdout (everything else went to stderr)."""
    print(json.dumps(doc, indent=1), file=args.stdout)


def info(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def plan_options(args: argparse.Namespace) -> dict[str, Any]:
    """compile()'s keyword arguments from the planning flags `add_plan_options` declares."""
    out = {k: getattr(args, k) for k in ("precision", "optimizer", "max_memory_fraction", "dp", "tp", "pp",
                                         "zero_stage", "microbatch_size", "schedule", "interleave", "recompute",
                                         "grad_reduce_dtype", "optimizer_layout", "cp", "cp_kind", "ep", "zero3_unit",
                                         "recompute_blocks")
           if getattr(args, k) is not None}
    if args.compression is not None:
        out["compression"] = compression_arg(args.compression)
    if args.compression_warmup:
        out["compression_warmup"] = args.compression_warmup
    if args.torch_compile is not None:
        out["torch_compile"] = args.torch_compile
    if args.calibration is not None:
        out["calibration"] = args.calibration
    return out


def compression_arg(text: str) -> str | dict[str, str]:
    """--compression int8 -> "int8"; --compression inter_node=int8,intra_node=none -> a dict (compile checks names).

    >>> compression_arg("inter_node=int8, intra_node=none")
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
