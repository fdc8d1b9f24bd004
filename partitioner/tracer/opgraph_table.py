"""OpGraph as text: one row per node, or per block with totals."""

from __future__ import annotations

from typing import TYPE_CHECKING

from partitioner.tracer.experts import experts_text

if TYPE_CHECKING:
    from partitioner.tracer.opgraph import OpGraph

__all__ = ["format_table", "human"]


def human(x: float, unit: str = "") -> str:
    """1.53e11 -> '153.0G' (SI prefixes; bytes use the same powers of 1000)."""
    for div, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.1f}{p}{unit}"
    return f"{x:.0f}{unit}"


def _rows_to_text(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    def fmt(r):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def format_table(g: "OpGraph", *, batch_size: int | None, seq_len: int | None, per: str) -> str:
    b, s = g._bs(batch_size, seq_len)
    title = (f"OpGraph of {g.model_name}: {len(g.nodes)} nodes, {g.num_params:,} parameters, "
             f"{len(g.blocks)} blocks, traced by {g.method}"
             + (f" ({g.expanded_from} blocks traced, the rest copied)" if g.expanded_from else "")
             + f"; costs at batch {b}" + (f", seq {s}" if g.traced_seq_len else ""))
    moe = experts_text(g)
    if moe:
        title += f"\nexperts: {moe}"
    if per == "node":
        header = ["node", "op", "module", "shape", "fwd FLOPs", "bwd FLOPs", "params", "act bytes"]
        rows = [[n.name, n.op, n.module_path or "-", str(n.output) if n.output else "-",
                 human(n.cost.forward_flops(b, s)), human(n.cost.backward_flops(b, s)),
                 human(n.param_count), human(n.cost.activation_bytes(b, s), "B")] for n in g.nodes]
        return title + "\n" + _rows_to_text(header, rows, right={4, 5, 6, 7})
    header = ["segment", "nodes", "params", "fwd FLOPs", "bwd FLOPs", "act bytes", "bytes moved"]
    rows = []
    tot = [0, 0, 0.0, 0.0, 0.0, 0.0]
    for label, nodes in g.segments():
        vals = [len(nodes), sum(n.param_count for n in nodes),
                sum(n.cost.forward_flops(b, s) for n in nodes), sum(n.cost.backward_flops(b, s) for n in nodes),
                sum(n.cost.activation_bytes(b, s) for n in nodes),
                sum(n.cost.bytes_read(b, s) + n.cost.bytes_written(b, s) for n in nodes)]
        tot = [x + y for x, y in zip(tot, vals)]
        rows.append([label, str(vals[0]), human(vals[1]), human(vals[2]), human(vals[3]), human(vals[4], "B"), human(vals[5], "B")])
    rows.append(["total", str(tot[0]), human(tot[1]), human(tot[2]), human(tot[3]), human(tot[4], "B"), human(tot[5], "B")])
    return title + "\n" + _rows_to_text(header, rows, right={1, 2, 3, 4, 5, 6})
