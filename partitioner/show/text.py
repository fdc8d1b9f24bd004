"""Plan as text: the table `print(plan)` shows and the reasoning `plan.explain()` gives.

Both fit in WIDTH columns (tables aside, whose width the model's names set).
The table's long values break after "; " or ", ", so a phrase such as "rank-4
PowerSGD" stays on one line; explain() wraps its prose at spaces.

    Plan for GPT on 2x4xA100-80GB (8 devices), global batch 32 x seq 128, bf16-mixed, adam
      config       dp2 tp2 pp2 zero3 mb16x1 1f1b recompute=none
      mesh         pp 2 x dp 2 x tp 2; rank = pp*4 + dp*2 + tp; node 0: ranks 0-3; node 1: ranks 4-7
      zero         stage 3: parameters, gradients and optimizer state sharded over 2 data-parallel replicas
      ...

tests/golden/ holds whole examples (tests/test_plan_text.py).
"""

from __future__ import annotations

import re
import textwrap
from typing import TYPE_CHECKING

from cost_models.compression_memory import sixteen_bit_units
from cost_models.fp8 import FUSED_CAST_BYTES, TORCH_CAST_BYTES
from cost_models.mesh import Mesh
from cost_models.powersgd import POWERSGD_RANK
from partitioner.planner.schedule import stage_rank
from partitioner.tracer.opgraph_table import human

if TYPE_CHECKING:
    from partitioner.planner.plan import Alternative, Baseline, Plan

__all__ = ["explain_plan", "format_plan", "blocks_text", "compression_text", "load_balancing_text", "ranges_text",
           "sequence_text"]

WIDTH = 120
GiB, MiB = 2**30, 2**20
KEY = 15  # "  compression  ": the widest key and its gap
NEAR_CAPACITY = 0.85  # a rank above this fraction of device memory is flagged in the stage table


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB" if x >= GiB / 10 else f"{x / MiB:.1f} MiB"


def _ms(s: float) -> str:
    v = s * 1e3
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:,.0f}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("h") else "s")


def ranges_text(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def _wrap(line: str, indent: int) -> list[str]:
    """`line` in lines of at most WIDTH columns, broken after "; " or ", " (at spaces only inside a phrase
    too long for a line), continuation lines indented by `indent`."""
    if len(line) <= WIDTH:
        return [line]
    tokens: list[str] = []
    body = line.lstrip(" ")  # its leading spaces kept as they are, even when the first phrase is split at spaces
    for piece in re.split(r"(?<=[;,]) ", body):
        tokens += [piece] if indent + len(piece) <= WIDTH else piece.split(" ")
    lines, cur = [], line[:len(line) - len(body)]
    for t in tokens:
        if cur.strip() and len(cur) + 1 + len(t) > WIDTH:
            lines.append(cur)
            cur = " " * indent + t
        else:
            cur = f"{cur} {t}" if cur.strip() else cur + t
    return [*lines, cur]


def _row(key: str, value: str) -> list[str]:
    return _wrap(f"  {key.ljust(KEY - 4)}  {value}", KEY)


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)]


def blocks_text(names: tuple[str, ...]) -> str:
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


def compression_text(p: Plan) -> str:
    """'inter_node int8 (saves 41 ms/step of exposed DP traffic; ...)', or 'none' (and why, if one was pinned)."""
    used = [f"{level} {c}" for level, c in p.compression.items() if c != "none"]
    if used:
        ms = p.predicted.compression_saving_s * 1e3
        gain = f"saves {ms:.0f} ms/step of exposed DP traffic" if ms >= 0 else \
            f"costs {-ms:.0f} ms/step more than uncompressed"
        if p.predicted.compression_needed_to_fit:
            gain = f"uncompressed it does not fit; {gain}"
        z = p.config.zero_stage
        what = "data-parallel gradient all-reduce" if z <= 1 else "data-parallel gradient reduce-scatter"
        if z == 3 and any(c in ("int8", "int4") for c in p.compression.values()):
            what += " and int8 parameter all-gathers"
        if "bf16" in p.compression.values() and sixteen_bit_units(zero_stage=z, precision=p.precision,
                                                                    compression_warmup=p.compression_warmup):
            what += ", each unit's 16-bit gradient sent as it is (no fp32 copy)"
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


def _async_sgd(p: Plan) -> str:
    """The 'async sgd' row: what the replicas do and how the predicted step time counts it."""
    a = p.async_sgd or {}
    if "every" in a:
        k = a["every"]
        return (f"local SGD, every={k}: each replica steps on its own gradients (its optimizer state stays its "
                f"own); the parameters are averaged by an fp32 all-reduce after {_every(k)}, 1/{k} of "
                "it counted per step in the predicted time and traffic")
    s = a["staleness"]
    when = "at once (as every=1)" if s == 0 else f"{s} step{'s' if s > 1 else ''} later"
    return (f"bounded staleness {s}: each replica steps on its own gradients; every step's update is averaged by "
            f"an asynchronous fp32 all-reduce and applied {when}"
            + ("" if s == 0 else f", so replicas differ by at most their last {s} local updates; the all-reduce is "
                                 "counted as hidden behind the next step's compute"))


def _attention(p: Plan) -> str:
    return (f"{_plural(p.attention_rewrites, 'eager attention')} rewritten to fused scaled_dot_product_attention "
            "(O(s) memory per row; rewrite_attention=False keeps the traced ops)")


def _fused(p: Plan) -> str:
    return (f"{p.fused}: each chain of ops the model spells one with runs as that one ATen op (one kernel, its input "
            "kept for backward; rewrite_attention=False keeps the traced ops)")


def _compiled(p: Plan) -> str:
    """The torch.compile row (runtime.engines.compiled)."""
    return (f"torch.compile ({p.torch_compile}) of each block's code on its own, and of a stage's prefix and "
            "suffix code; recomputation, collectives and engine hooks outside; times predicted as eager")


def _experts(p: Plan) -> str:
    c = p.config
    if c.ep > 1:
        return (f"{p.experts}. Expert parallelism ep{c.ep}: each rank holds 1/{c.ep} of every MoE layer's experts, "
                f"tokens sent to them and back by all-to-alls over groups of {c.ep} data-parallel ranks, expert "
                f"gradients reduced over dp x cp / ep = {c.replicas // c.ep} "
                f"rank{'s' if c.replicas > c.ep else ''}")
    return (f"{p.experts}. ep=1: experts planned like every other parameter (replicated over data parallelism, "
            "sharded by ZeRO, split by tp)")


def load_balancing_text(p: Plan) -> str:
    """How the programs compute the model's router load-balancing loss ("" for a model without one): a
    statistic of the tokens, so of each microbatch (partitioner.codegen.segment_ep)."""
    c = p.config
    if not p.load_balancing_loss:
        return ""
    if p.async_sgd:
        return "the routers' load-balancing loss: each replica's own, on its rows (asynchronous replicas train apart)"
    where = (f"over the {c.replicas} data-parallel ranks' tokens (its sums all-reduced)" if c.replicas > 1
             else "on this rank's tokens")
    if c.pp > 1:
        where += f", its sums carried through the {c.pp} pipeline stages' layers to the last"
    m = c.num_microbatches
    if m == 1:
        return f"the routers' load-balancing loss {where}; on the step's whole batch, as one process computes it"
    return (f"the routers' load-balancing loss {where}, per microbatch; a step's is the mean of its {m} "
            "microbatches' losses, as Megatron-Core computes it; not the loss of the whole batch (expert counts "
            "are known only after every forward); one process matches it accumulating gradients over the same "
            "microbatches")


def _every(k: int) -> str:
    """1 -> 'every step', 4 -> 'every 4th step', 22 -> 'every 22nd step'."""
    if k == 1:
        return "every step"
    return f"every {k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')} step"


def _zero(p: Plan) -> str:
    c = p.config
    if c.replicas == 1:
        return f"stage {c.zero_stage}: no data parallelism, nothing to shard"
    held = ("", "optimizer state", "optimizer state and gradients",
            "parameters, gradients and optimizer state")[c.zero_stage]
    who = f"{c.dp} data-parallel replicas" if c.cp == 1 else \
        f"dp x cp = {c.replicas} ranks ({c.dp} data-parallel replicas of {c.cp} context slices)"
    if not held:
        return f"stage 0: each of the {who} holds full parameters, gradients and optimizer state"
    if c.zero_stage == 3:
        return f"stage 3: {held} sharded over {who}; {_zero3_units(c)}"
    return f"stage {c.zero_stage}: {held} sharded over {who}"


def _zero3_units(c) -> str:
    """What ZeRO-3 gathers at once (ParallelConfig.zero3_unit), in words."""
    if c.zero3_unit == "module":
        return ("gathered per module holding parameters (a few whole at once; gathered again to recompute)"
                if c.recompute != "none" else "gathered per module holding parameters (two whole at once)")
    return "gathered one block at a time"


# what fp8-mixed runs (runtime.engines.fp8), in print(plan) and explain()
FP8_RECIPE = " (fp8 linear GEMMs, per-tensor current scaling)"

def _recipe(p: Plan) -> str:
    """The precision and what the user declared of its recipe: 'bf16-mixed, bf16 gradient reduction, distributed
    optimizer'; 'bf16' is pure bf16."""
    d = p.declarations
    out = p.precision + (" (pure)" if p.precision == "bf16" else FP8_RECIPE if p.precision == "fp8-mixed" else "")
    if d.get("grad_reduce_dtype"):
        out += f", {d['grad_reduce_dtype']} gradient reduction"
    if d.get("optimizer_layout"):
        out += f", {d['optimizer_layout']} optimizer"
    return out


def _batch(p: Plan) -> str:
    c = p.config
    out = (f"{p.global_batch_size} samples per step = {_plural(c.dp, 'replica')} x {_plural(c.num_microbatches, 'microbatch')}"
           f" of {c.microbatch_size}")
    return out + (f" ({human(p.global_batch_size * p.seq_len)} tokens of seq {p.seq_len})" if p.seq_len else "")


def _schedule(p: Plan) -> str:
    c, ins = p.config, p.instructions
    first = " ".join(str(a) for a in ins.ranks[0][:12]) + (" ..." if len(ins.ranks[0]) > 12 else "")
    if c.pp == 1:
        return f"{ins.kind}: one stage, {_plural(c.num_microbatches, 'microbatch')} accumulated; rank 0: {first}"
    virtual = f" x {c.interleave} virtual" if c.interleave > 1 else ""
    return (f"{ins.kind}, {c.pp} pipeline stages{virtual}, {_plural(c.num_microbatches, 'microbatch')}, bubble "
            f"{100 * p.predicted.bubble_fraction:.1f} %; rank 0: {first}")


_RECOMPUTE = {"none": "every in-flight microbatch keeps its activations",
              "selective": "attention scores recomputed in the backward (Korthikanti et al. 2022)",
              "full": "only each block's input kept, its forward rerun in the backward",
              "selective-op": "fused attention's and every second matrix product's outputs kept, the rest rerun in the "
                              "backward (torchtitan's per-op selective AC)"}


def _recompute(c) -> str:
    k, n = c.recompute_blocks
    if (k, n) == (1, 1):
        return f"{c.recompute}: {_RECOMPUTE[c.recompute]}"
    which = "every second block (0, 2, 4, ...)" if (k, n) == (1, 2) else \
        f"the first {k} of every {n} blocks (by index in the stack)"
    return (f"{c.recompute_text}: {which} keep only their input, their forward rerun in the backward; the others "
            "keep their activations")


def _stage_rows(p: Plan) -> list[str]:
    cap = p.predicted.memory_capacity_bytes
    per_rank = p.rank_memory()
    peak_rank = max(per_rank, key=lambda r: per_rank[r].total)
    interleaved = p.interleave > 1
    rows = []
    for s in p.stages:
        r = stage_rank(p.schedule, p.pp, s.index)
        total = per_rank[r].total
        flag = [w for w, on in (("peak", r == peak_rank), (f"near capacity (> {100 * NEAR_CAPACITY:.0f} %)",
                                                            total > NEAR_CAPACITY * cap)) if on]
        rows.append([str(s.index), blocks_text(s.blocks), human(s.num_params), _ms(s.forward_s), _ms(s.backward_s),
                     _gib(s.memory.total), *([_gib(total)] if interleaved else []), f"{100 * total / cap:.1f} %",
                     ranges_text(list(s.ranks)), ", ".join(flag) if s.index == r else ""])
    header = ["stage", "blocks", "params", "fwd ms", "bwd ms", "memory", *(["rank memory"] if interleaved else []),
              "of device", "ranks", "note"]
    right = {2, 3, 4, 5, 6} | ({7} if interleaved else set())
    return _table(header, rows, right)


def _headline(why: str) -> str:
    """'slower by 4.1 % (recompute=selective vs none)' -> 'slower by 4.1 %': the table keeps the reason only."""
    return why.split(" (", 1)[0]


def _lost(p: Plan) -> list[Alternative]:
    return [*p.alternatives, *p.rejected]


def _alt_ms(a: Alternative) -> str:
    return ("" if a.fits else "~") + _ms(a.step_time_s)  # ~: timed by a balanced cut, not searched


def _basis(p: Plan, lost: list[Alternative]) -> str:
    """How runners-up are timed: by the search's closed-form estimate of a cut, which the simulation of the
    instruction lists (the plan's predicted step) can differ from, interleaved schedules most."""
    own = p.predicted.search_step_time_s
    out = f"ms/step as the search estimates a stage cut; this plan {_ms(own)} by it" if own else ""
    if any(not a.fits for a in lost):
        out += ("; " if out else "") + "~: a balanced cut"
    return f" ({out})" if out else ""


def _kinds(p: Plan) -> str:
    """'4 blocks of model.layers in 2 kinds, one code template each: kind 0 = 0, 2; kind 1 = 1, 3'."""
    by_kind: dict[int, list[int]] = {}
    for i, k in enumerate(p.block_kinds):
        by_kind.setdefault(k, []).append(i)
    return (f"{len(p.block_kinds)} blocks of {p.block_container or 'the model'} in {len(by_kind)} kinds (blocks that "
            "compute different graphs), one code template each: "
            + "; ".join(f"kind {k} = {ranges_text(v)}" for k, v in sorted(by_kind.items())))


def sequence_text(p: Plan) -> str:
    return (f"sp: the ops between tensor-split regions (norms, dropouts, residual adds) run on 1/{p.tp} of the tokens; "
            "row-parallel outputs reduce-scattered, column-parallel inputs all-gathered")


def _span(p: Plan, ranks: tuple[int, ...]) -> str:
    nodes = len({p.mesh[r].node for r in ranks})
    return "inside one node" if nodes == 1 else f"across {nodes} nodes"


def _context_buffers(p: Plan) -> str:
    """The memory lines' note of the context-parallel attention buffers (cp > 1 only)."""
    if p.config.cp == 1:
        return ""
    what = "ring k/v blocks arriving and dk/dv accumulators" if p.config.cp_kind == "ring" else "all-to-all buffers"
    return (f" (with {_gib(p.predicted.context_buffer_bytes)} of one attention's {what} at the backward's peak, "
            "where that moment is the rank's peak)")


def context_text(p: Plan) -> str:
    """The context-parallel line: how the sequence is split and what attention sends (cp > 1 only)."""
    c = p.config
    seq = f"{p.seq_len // c.cp} of {p.seq_len} tokens" if p.seq_len else f"1/{c.cp} of the tokens"
    how = ("ring attention: key/value blocks passed to the next rank of the group, cp - 1 steps each way, "
           "behind each block's attention" if c.cp_kind == "ring" else
           "all-to-all (Ulysses): 4 all-to-alls per attention forward and 4 backward re-shard heads")
    return (f"cp{c.cp}: each rank holds {seq} (2 of {2 * c.cp} chunks, the causal load balance) for the whole "
            f"layer; {how}; gradients reduced over dp x cp = {c.replicas} ranks")


def format_plan(p: Plan) -> str:
    c, pr = p.config, p.predicted
    lines = _wrap(f"Plan for {p.model_name} on {p.topology_name} ({p.world_size} devices), global batch "
                  f"{p.global_batch_size}" + (f" x seq {p.seq_len}" if p.seq_len else "") + f", {_recipe(p)}, "
                  f"{p.optimizer}", 2)
    nodes: dict[int, list[int]] = {}
    for m in p.mesh:
        nodes.setdefault(m.node, []).append(m.rank)
    shown = list(nodes.items())[:4]
    axes = f"pp {c.pp} x dp {c.dp}" + (f" (ep {c.ep} inside it)" if c.ep > 1 else "") + " x " + \
        (f"cp {c.cp} x " if c.cp > 1 else "") + f"tp {c.tp}"
    mesh = (f"{axes}; {Mesh(c.pp, c.dp, c.tp, c.cp).formula()}; "
            + "; ".join(f"node {n}: ranks {ranges_text(r)}" for n, r in shown)
            + (f"; ... {len(nodes)} nodes" if len(nodes) > 4 else ""))
    cap = pr.memory_capacity_bytes
    m = pr.memory
    for key, value in (
            ("config", str(c)),
            ("mesh", mesh),
            ("zero", _zero(p)),
            ("batch", _batch(p)),
            ("schedule", _schedule(p)),
            *([("blocks", _kinds(p))] if p.block_kinds else []),
            ("recompute", _recompute(c)),
            *([("sequence", sequence_text(p))] if c.sp else []),
            *([("context", context_text(p))] if c.cp > 1 else []),
            ("compression", compression_text(p)),
            *([("async sgd", _async_sgd(p))] if p.async_sgd else []),
            *([("attention", _attention(p))] if p.attention_rewrites else []),
            *([("fused", _fused(p))] if p.fused else []),
            *([("experts", _experts(p))] if p.experts else []),
            *([("aux loss", load_balancing_text(p))] if p.load_balancing_loss else []),
            *([("compiled", _compiled(p))] if p.torch_compile else []),
            ("predicted", (f"{_ms(pr.step_time_s)} ms/step, {human(pr.tokens_per_s)} tokens/s, "
                          f"{pr.model_tflops_per_device:.1f} TFLOP/s per device, MFU {100 * pr.mfu:.1f} %")),
            ("memory", (f"peak {_gib(pr.peak_memory_bytes)} of {_gib(cap)} per rank "
                       f"({100 * pr.peak_memory_bytes / cap:.1f} %): params {_gib(m.params)}, grads {_gib(m.grads)}, "
                       f"optimizer {_gib(m.optimizer)}, activations {_gib(m.activations)}, buffers {_gib(m.buffers)}"
                       + _context_buffers(p))),
            ("traffic", ", ".join(f"{k} {human(v, 'B')}/step" for k, v in pr.bytes_per_link.items()))):
        lines += _row(key, value)
    lines += ["", *("  " + x for x in _stage_rows(p))]
    # placements summarised per block type: h.0.attn.c_attn.weight -> h.*.attn.c_attn.weight
    groups: dict[tuple[str, str, str], int] = {}
    for pl in p.placements:
        key = (re.sub(r"\.\d+\.", ".*.", pl.param), pl.spec, pl.role)
        groups[key] = groups.get(key, 0) + 1
    if p.tp == 1:  # one line instead of a table of "R replicated" rows
        lines += ["", f"  parameters   tp 1: none of the {len(p.placements)} parameters is tensor-split"]
    else:
        rows = [[name, spec, role, str(n)] for (name, spec, role), n in groups.items()]
        lines += ["", *("  " + x for x in _table(["parameter", "split", "role", "count"], rows, {3}))]
    lost = _lost(p)
    if lost:
        rows = [[str(a.config), _alt_ms(a), _gib(a.peak_memory_bytes), _headline(a.why)] for a in lost]
        room = WIDTH - 2 - sum(max(len(r[i]) for r in rows) + 2 for i in range(3))
        for r in rows:  # the whole reason is in explain()
            r[3] = r[3] if len(r[3]) <= max(room, 20) else r[3][:max(room, 20) - 3] + "..."
        lines += ["", *_wrap(f"  runners-up{_basis(p, lost)}", 4),
                  *("  " + x for x in _table(["config", "ms/step", "peak memory", "why it lost"], rows, {1, 2}))]
    lines.append(f"\n  searched {p.candidates_evaluated} of {p.search_space} candidate configurations exactly "
                 "(the rest bounded out)")
    return "\n".join(lines)


def _baseline(p: Plan, b: Baseline) -> str:
    if b.config is None:
        return f"- {b.name}: not possible here: {b.note}"
    if not b.fits:
        return f"- {b.name} does not fit: {b.note} (its least-memory variant: {b.config})"
    assert b.step_time_s is not None and b.peak_memory_bytes is not None
    ratio = b.step_time_s / p.predicted.step_time_s
    if b.config == p.config and f"{ratio:.2f}" == "1.00" and not p.async_sgd:  # a baseline trains synchronously
        gain = "it is this plan"
    elif ratio >= 1:
        gain = f"this plan is {ratio:.2f}x faster"
    else:
        gain = f"it is {1 / ratio:.2f}x faster than this plan" + (", but the declarations rule it out"
                                                                  if p.declarations else "")
    note = f"; {b.note}" if b.note else ""
    return f"- {b.name} ({b.config}{note}): {_ms(b.step_time_s)} ms/step, {_gib(b.peak_memory_bytes)} peak; {gain}"


def explain_plan(p: Plan) -> str:
    c, pr = p.config, p.predicted
    out = [f"Why {c}:"]
    pins = ", ".join(f"{k}={v}" for k, v in p.declarations.items())
    out.append(f"- it predicts {_ms(pr.step_time_s)} ms per step of {p.global_batch_size} samples "
               f"(MFU {100 * pr.mfu:.1f} %), the fastest of {p.search_space} configurations that "
               + (f"the declarations {pins} allow and that " if pins else "")
               + f"fit in {_gib(pr.memory_capacity_bytes)} per device.")
    if c.pp > 1:
        out.append(f"- {c.pp} pipeline stages ({c.schedule}{', interleave ' + str(c.interleave) if c.interleave > 1 else ''})"
                   f" with {_plural(c.num_microbatches, 'microbatch')} leave a {100 * pr.bubble_fraction:.1f} % bubble; "
                   "stages are cut to balance time under memory (exact dynamic programme).")
    if c.tp > 1:
        out.append(f"- tensor groups of {c.tp} stay inside a node; Megatron splits found in the graph: "
                   f"{sum(1 for x in p.placements if x.role == 'column')} column, "
                   f"{sum(1 for x in p.placements if x.role == 'row')} row, "
                   f"{sum(1 for x in p.placements if x.role.startswith('vocab'))} vocab-parallel parameters.")
    if c.sp:
        why = "as declared" if "sp" in p.declarations else "the planner's choice: no slower than without it"
        out.append(f"- sequence parallelism in each tensor group ({why}): the ops between the tensor-split regions "
                   f"run on 1/{c.tp} of the tokens, row-parallel outputs reduce-scattered and column-parallel inputs "
                   "all-gathered: the bytes of the all-reduces it replaces, those activations divided by "
                   f"{c.tp}.")
    elif c.tp > 1 and p.declarations.get("sp") is False:
        out.append("- no sequence parallelism, as declared (sp=False): the layer norms, dropouts and residual adds "
                   f"run on every token in each of the {c.tp} tensor ranks.")
    if c.cp > 1:
        why = "as declared" if "cp" in p.declarations else "the planner's choice"
        out.append(f"- context parallelism over {c.cp} ranks ({why}, {c.cp_kind}): each rank holds 1/{c.cp} of "
                   f"every sequence, so activations and token-dependent FLOPs per rank are divided by {c.cp}; "
                   + ("each attention passes key/value blocks round the ring, behind its block computations"
                      if c.cp_kind == "ring" else "each attention re-shards heads by 4 all-to-alls each way")
                   + f"; groups of {c.cp} ranks, {c.tp} apart, {_span(p, Mesh(c.pp, c.dp, c.tp, c.cp).cp_ranks())}; "
                   f"gradients reduced over dp x cp = {c.replicas} ranks. The programs run it: each rank's tokens in "
                   "the load-balanced layout, positions read at the rank's own, attention by runtime.context's "
                   "kernels.")
    if p.expert_parallel:
        out.append(f"- {p.expert_parallel}")
    if p.load_balancing_loss:
        out.append(f"- {load_balancing_text(p)}.")
    if c.replicas > 1 and c.dp == 1:
        out.append(f"- ZeRO stage {c.zero_stage} over the {c.replicas} context ranks; exposed communication "
                   f"{_ms(pr.exposed_comm_s)} ms per step; gradient compression: {compression_text(p)}.")
    if c.dp > 1:
        out.append(f"- {c.dp} data-parallel replicas with ZeRO stage {c.zero_stage}; exposed communication "
                   f"{_ms(pr.exposed_comm_s)} ms per step; gradient compression: {compression_text(p)}.")
    if c.replicas > 1 and c.zero_stage == 3 and c.zero3_unit == "module":
        out.append("- ZeRO-3 units per module (DeepSpeed's granularity), not per block: the gathered parameters at "
                   f"a moment are {'three' if c.recompute != 'none' else 'two'} modules' rather than two blocks', "
                   "for more, smaller all-gathers and reduce-scatters, each paying its latency"
                   + ("; the recomputed forward gathers each unit again" if c.recompute != "none" else "") + ".")
    if p.async_sgd:
        out.append(f"- asynchronous SGD {p.async_sgd}, as declared (the planner never chooses it: it changes the "
                   f"training math): {_async_sgd(p)}. The hand configurations below train synchronously.")
    if p.precision == "fp8-mixed":
        out.append(f"- fp8-mixed, as declared{FP8_RECIPE}: the linear layers' forward and both backward GEMMs take "
                   "e4m3 operands (the output gradient e5m2) and are "
                   "costed at the device's fp8 peak (bf16's where fp8 is emulated, on CPU) plus a memory-bound cast "
                   f"of each operand ({FUSED_CAST_BYTES} bytes per element by the fused kernel, {TORCH_CAST_BYTES} by torch ops "
                   "where emulated; the input and weight cast again in backward); "
                   "attention, "
                   "norms and the optimizer as bf16-mixed; memory as bf16-mixed (cost_models.fp8).")
    if c.recompute != "none":
        out.append(f"- {c.recompute_text} activation recomputation: it buys the memory this plan needs"
                   + ("." if c.recompute_blocks == (1, 1) else
                      f", on {c.recompute_blocks[0]} of every {c.recompute_blocks[1]} blocks; recomputing fewer "
                      "would not fit, or no faster plan did."))
    out.append(f"- peak memory {_gib(pr.peak_memory_bytes)}: params {_gib(pr.memory.params)}, grads "
               f"{_gib(pr.memory.grads)}, optimizer {_gib(pr.memory.optimizer)}, activations "
               f"{_gib(pr.memory.activations)}, buffers {_gib(pr.memory.buffers)}{_context_buffers(p)}.")
    lost = _lost(p)
    if lost:
        out.append(f"Runners-up, and why each lost{_basis(p, lost)}:")
        out += [f"- {a.config}: {_alt_ms(a)} ms/step, {_gib(a.peak_memory_bytes)} peak: {a.why}" for a in lost]
    if p.baselines:
        out.append("Against the usual hand configurations (each at its best microbatch, schedule and recompute, "
                   "no gradient compression):")
        out += [_baseline(p, b) for b in p.baselines]
    return "\n".join(x for line in out for x in textwrap.wrap(line, WIDTH, subsequent_indent="  ",
                                                              break_long_words=False, break_on_hyphens=False))
