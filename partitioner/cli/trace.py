"""`partitioner trace MODEL`: the cost table of a traced model."""

from __future__ import annotations

import argparse
import time
from typing import Any

from partitioner.cli.common import EXIT_OK, emit


def trace_command(args: argparse.Namespace) -> int:
    from partitioner.loading import load_model
    from partitioner.tracer.trace import trace

    model, inputs, _ = load_model(args.model, device=args.device, batch_size=args.batch_size)
    t0 = time.perf_counter()
    g = trace(model, inputs, method=args.method, expand_repeated=not args.no_expand)
    dt = time.perf_counter() - t0
    flops = g.flops(batch_size=args.batch_size)  # also refuses a batch size the trace fixed
    if args.json:
        emit(args, {"model": args.model, "model_name": g.model_name, "method": g.method, "num_params": g.num_params,
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
