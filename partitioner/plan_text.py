"""Plan as text: the table `print(plan)` shows and the reasoning `plan.explain()` gives."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from cost_models.powersgd import POWERSGD_RANK
from partitioner.opgraph_table import human

if TYPE_CHECKING:
    from partitioner.plan import Plan

__all__ = ["format_plan", "explain_plan"]

GiB = 2**30


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)]


def _blocks(names: tuple[str, ...]) -> str:
    """('prefix', 'h.0', 'h.1', 'h.2') -> 'prefix + h.0-2'."""
    out, run = [], []
    for n in names:
        m = re.fullmatch(r"(.*\.)(\d+)", n)
        if m and run and run[-1][0] == m.group(1) and run[-1][2] + 1 == int(m.group(2)):
            run[-1] = (run[-1][0], run[-1][1], int(m.group(2)))
            continue
        if m:
            run.append((m.group(1), int(m.group(2)), int(m.group(2))))
        else:
            run.append((n, None, None))
    for base, a, b in run:
        out.append(base if a is None else f"{base}{a}" if a == b else f"{base}{a}-{b}")
    return " + ".join(out)


def _compression(p: "Plan") -> str:
    """'inter_node int8 (saves 41 ms/step of exposed DP traffic; ...)', or 'none' (and why, if one was pinned)."""
    used = [f"{level} {c}" for level, c in p.compression.items() if c != "none"]
    if used:
        ms = p.predicted.compression_saving_s * 1e3
        gain = f"saves {ms:.0f} ms/step of exposed DP traffic" if ms >= 0 else \
            f"costs {-ms:.0f} ms/step more than uncompressed"
        z = p.config.zero_stage
        what = "data-parallel gradient all-reduce" if z <= 1 else "data-parallel gradient reduce-scatter"
        if z == 3 and any(c in ("int8", "int4") for c in p.compression.values()):
            what += " and int8 parameter all-gathers"
        if "powersgd" in p.compression.values():
            what += f", rank-{POWERSGD_RANK} PowerSGD with error feedback"
        if p.compression_warmup:
            what += f"; the first {p.compression_warmup} steps uncompressed"
        return f"{', '.join(used)} ({gain}; {what})"
    pinned = {k: v for k, v in p.declarations.get("compression", {}).items() if v != "none"}
    if pinned:
        return (f"none (pinned {', '.join(f'{k} {v}' for k, v in pinned.items())}: no data-parallel gradient "
                "reduction crosses that level in this plan)")
    return "none"


def format_plan(p: "Plan") -> str:
    c, pr = p.config, p.predicted
    lines = [f"Plan for {p.model_name} on {p.topology_name} ({p.world_size} devices), "
             f"global batch {p.global_batch_size}" + (f" x seq {p.seq_len}" if p.seq_len else "") + f", {p.precision}, {p.optimizer}",
             f"  config     {c}",
             f"  predicted  {pr.step_time_s * 1e3:.1f} ms/step, {human(pr.tokens_per_s)} tokens/s, "
             f"{pr.model_tflops_per_device:.1f} TFLOP/s per device, MFU {100 * pr.mfu:.1f} %, "
             f"bubble {100 * pr.bubble_fraction:.1f} %",
             f"  memory     peak {_gib(pr.peak_memory_bytes)} of {_gib(pr.memory_capacity_bytes)} per rank "
             f"(params {_gib(pr.memory.params)}, grads {_gib(pr.memory.grads)}, optimizer {_gib(pr.memory.optimizer)}, "
             f"activations {_gib(pr.memory.activations)}, buffers {_gib(pr.memory.buffers)})",
             "  traffic    " + ", ".join(f"{k} {human(v, 'B')}/step" for k, v in pr.bytes_per_link.items()),
             f"  compression  {_compression(p)}"]
    # mesh: which ranks on which node, and the group shapes
    nodes: dict[int, list[int]] = {}
    for m in p.mesh:
        nodes.setdefault(m.node, []).append(m.rank)
    shown = list(nodes.items())[:4]
    lines.append(f"  mesh       pp {c.pp} x dp {c.dp} x tp {c.tp}; rank = pp*{c.dp * c.tp} + dp*{c.tp} + tp; "
                 + "; ".join(f"node {n}: ranks {_ranges(r)}" for n, r in shown)
                 + (f"; ... {len(nodes)} nodes" if len(nodes) > 4 else ""))
    rows = [[str(s.index), _blocks(s.blocks), human(s.num_params), f"{s.forward_s * 1e3:.2f}", f"{s.backward_s * 1e3:.2f}",
             _gib(s.memory.total), _ranges(list(s.ranks))] for s in p.stages]
    lines += ["", *("  " + x for x in _table(["stage", "blocks", "params", "fwd ms", "bwd ms", "memory", "ranks"], rows, {2, 3, 4, 5}))]
    # placements summarised per block type: h.0.attn.c_attn.weight -> h.*.attn.c_attn.weight
    groups: dict[tuple[str, str, str], int] = {}
    for pl in p.placements:
        key = (re.sub(r"\.\d+\.", ".*.", pl.param), pl.spec, pl.role)
        groups[key] = groups.get(key, 0) + 1
    rows = [[name, spec, role, str(n)] for (name, spec, role), n in groups.items()]
    lines += ["", *("  " + x for x in _table(["parameter", "split", "role", "count"], rows, {3}))]
    first = " ".join(str(a) for a in p.instructions.ranks[0][:12])
    lines += ["", f"  schedule   {p.instructions.kind}, {p.instructions.num_microbatches} microbatches; "
                  f"rank 0: {first}{' ...' if len(p.instructions.ranks[0]) > 12 else ''}"]
    if p.alternatives:
        rows = [[str(a.config), f"{a.step_time_s * 1e3:.1f}", _gib(a.peak_memory_bytes), a.why] for a in p.alternatives]
        lines += ["", "  runners-up", *("  " + x for x in _table(["config", "ms/step", "peak memory", "why it lost"], rows, {1, 2}))]
    lines.append(f"\n  searched {p.candidates_evaluated} of {p.search_space} candidate configurations exactly "
                 "(the rest bounded out)")
    return "\n".join(lines)


def explain_plan(p: "Plan") -> str:
    c, pr = p.config, p.predicted
    out = [f"Why {c}:"]
    out.append(f"- it predicts {pr.step_time_s * 1e3:.1f} ms per step of {p.global_batch_size} samples "
               f"(MFU {100 * pr.mfu:.1f} %), the fastest of {p.search_space} configurations that "
               f"the declarations {p.declarations or '{}'} allow and that fit in "
               f"{_gib(pr.memory_capacity_bytes)} per device.")
    if c.pp > 1:
        out.append(f"- {c.pp} pipeline stages ({c.schedule}{', interleave ' + str(c.interleave) if c.interleave > 1 else ''})"
                   f" with {c.num_microbatches} microbatches leave a {100 * pr.bubble_fraction:.1f} % bubble; "
                   "stages are cut to balance time under memory (exact dynamic programme).")
    if c.tp > 1:
        out.append(f"- tensor groups of {c.tp} stay inside a node; Megatron splits found in the graph: "
                   f"{sum(1 for x in p.placements if x.role == 'column')} column, "
                   f"{sum(1 for x in p.placements if x.role == 'row')} row, "
                   f"{sum(1 for x in p.placements if x.role.startswith('vocab'))} vocab-parallel parameters.")
    if c.dp > 1:
        out.append(f"- {c.dp} data-parallel replicas with ZeRO stage {c.zero_stage}; exposed communication "
                   f"{pr.exposed_comm_s * 1e3:.2f} ms per step; gradient compression: {_compression(p)}.")
    if c.recompute != "none":
        out.append(f"- {c.recompute} activation recomputation: it buys the memory this plan needs.")
    out.append(f"- peak memory {_gib(pr.peak_memory_bytes)}: params {_gib(pr.memory.params)}, grads "
               f"{_gib(pr.memory.grads)}, optimizer {_gib(pr.memory.optimizer)}, activations "
               f"{_gib(pr.memory.activations)}, buffers {_gib(pr.memory.buffers)}.")
    if p.alternatives:
        out.append("Runners-up:")
        out += [f"  {a.config}: {a.step_time_s * 1e3:.1f} ms/step, {_gib(a.peak_memory_bytes)} peak, {a.why}"
                for a in p.alternatives]
    return "\n".join(out)
