"""A plan as one self-contained HTML page: summary, device grid, stage map, memory, timeline, runners-up.

Inline SVG, CSS and a few lines of JavaScript (hover tooltips, highlighting
a pipeline stage's devices); nothing is fetched, so the file opens offline
and can be mailed around. Every section carries a stable id (summary,
device-grid, stage-map, memory-bars, timeline, alternatives).

>>> import tempfile
>>> from pathlib import Path
>>> from partitioner import compile
>>> from examples.mlp import mlp, example_inputs
>>> model = mlp()
>>> plan = compile(model, "local:2", example_inputs(model), global_batch_size=16)
>>> path = plan.to_html(Path(tempfile.mkdtemp()) / "mlp.plan.html")
>>> path
PosixPath('.../mlp.plan.html')
>>> page = path.read_text()
>>> all(f'id="{s}"' in page for s in ("summary", "device-grid", "stage-map", "memory-bars", "timeline",
...                                        "alternatives"))
True
>>> path.unlink(); path.parent.rmdir()
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import TYPE_CHECKING

from cost_models.mesh import Mesh
from partitioner.planner.schedule import stage_rank
from partitioner.show.text import (blocks_text, compression_text, context_text, load_balancing_text, ranges_text,
                                   sequence_text)
from partitioner.show.timeline import Timeline, build_timeline, event_style, stage_color
from partitioner.tracer.opgraph_table import human

if TYPE_CHECKING:
    from partitioner.planner.plan import Plan

__all__ = ["render_html", "write_html"]

GiB = 2**30
MEMORY_PARTS = (("params", "parameters", "#2f3e46"), ("grads", "gradients", "#52796f"),
                ("optimizer", "optimizer state", "#a3b18a"), ("activations", "activations", "#cfc6b8"),
                ("buffers", "buffers", "#8d7b9d"))
MAX_BARS = 64  # above this many ranks, one memory bar per pipeline rank (its ranks hold the same)


def esc(x: object) -> str:
    return html.escape(str(x), quote=True)


def _unit(x: float) -> tuple[float, str]:
    """The binary unit to show `x` bytes in: GiB from 1 GiB up, else MiB (small plans of the examples)."""
    return (GiB, "GiB") if x >= GiB else (2**20, "MiB")


def _size(x: float) -> str:
    div, name = _unit(x)
    return f"{x / div:.2f} {name}"


def _ticks(top: float, n: int = 8) -> list[float]:
    """Round tick values from 0 to `top`: steps of 1, 2 or 5 x 10^k."""
    if top <= 0:
        return [0.0]
    raw = top / n
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    return [i * step for i in range(int(top / step) + 1)]


# ---------------------------------------------------------------- sections


def _summary(plan: Plan) -> str:
    c, pr = plan.config, plan.predicted
    frac = pr.peak_memory_bytes / pr.memory_capacity_bytes if pr.memory_capacity_bytes else 0.0
    rows = [("config", str(c)),
            ("batch", f"global batch {plan.global_batch_size}" + (f" x seq {plan.seq_len}" if plan.seq_len else "")
             + f", {plan.precision}, {plan.optimizer}"),
            ("step time", (f"{pr.step_time_s * 1e3:.2f} ms predicted, bubble {100 * pr.bubble_fraction:.1f} %, "
                           f"exposed data-parallel communication {pr.exposed_comm_s * 1e3:.2f} ms")),
            ("throughput", (f"{human(pr.tokens_per_s)} tokens/s, {human(pr.samples_per_s)} samples/s, "
                            f"{pr.model_tflops_per_device:.1f} TFLOP/s per device, MFU {100 * pr.mfu:.1f} %")),
            ("peak memory", (f"{_size(pr.peak_memory_bytes)} of {_size(pr.memory_capacity_bytes)} per device "
                             f"({100 * frac:.3g} %)")),
            *([("sequence", sequence_text(plan))] if c.sp else []),
            *([("context", context_text(plan))] if c.cp > 1 else []),
            *([("experts", plan.expert_parallel)] if plan.expert_parallel else []),
            *([("aux loss", load_balancing_text(plan))] if plan.load_balancing_loss else []),
            ("compression", compression_text(plan)),
            ("search", f"{plan.candidates_evaluated} of {plan.search_space} configurations evaluated exactly"),
            ("declared", ", ".join(f"{k}={v}" for k, v in plan.declarations.items()) or "nothing pinned")]
    dl = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in rows)
    bar = (f'<div class="cap" data-tip="{esc(f"peak {_size(pr.peak_memory_bytes)} of {_size(pr.memory_capacity_bytes)}")}">'
           f'<div style="width:{min(100.0, 100 * frac):.2f}%"></div></div>')
    return (f'<header id="summary"><h1>Plan for {esc(plan.model_name)} on {esc(plan.topology_name)} '
            f'({plan.world_size} devices)</h1><dl>{dl}</dl>{bar}</header>')


def _device_grid(plan: Plan) -> str:
    """One small SVG per node, one cell per rank coloured by pipeline stage; tensor groups outlined."""
    stages_of = {r: [s.index for s in plan.stages if stage_rank(plan.schedule, plan.pp, s.index) == r]
                 for r in range(plan.pp)}
    mem = plan.rank_memory()
    nodes: dict[int, list] = {}
    for m in plan.mesh:
        nodes.setdefault(m.node, []).append(m)
    W, H, G = 46, 40, 6  # cell width, height, gap (px)
    boxes = []
    for node, coords in nodes.items():
        width = len(coords) * (W + G) + G
        parts = [f'<svg width="{width}" height="{H + 2 * G + 16}" role="img">',
                 f'<text x="{G}" y="12" class="lbl">node {node}</text>']
        for i, m in enumerate(coords):
            x, y = G + i * (W + G), 16 + G
            cp = f", cp {m.cp}" if plan.cp > 1 else ""
            # expert parallelism: ep consecutive data-parallel replicas form a group; this rank holds its dp % ep slice
            ep = f"; experts {m.dp % plan.ep + 1}/{plan.ep} of ep group {m.dp // plan.ep}" if plan.ep > 1 else ""
            tip = (f"rank {m.rank}: node {m.node}, pp {m.pp}, dp {m.dp}{cp}, tp {m.tp}{ep}; stages "
                   f"{', '.join(map(str, stages_of[m.pp]))}; peak {_size(mem[m.pp].total)}")
            parts.append(f'<g class="cell" data-pp="{m.pp}" data-tip="{esc(tip)}">'
                         f'<rect id="rank-{m.rank}" x="{x}" y="{y}" width="{W}" height="{H}" rx="4" '
                         f'fill="{stage_color(m.pp)}"/>'
                         f'<text x="{x + W / 2}" y="{y + 17}" class="r">{m.rank}</text>'
                         f'<text x="{x + W / 2}" y="{y + 31}" class="c">d{m.dp}{f" c{m.cp}" if plan.cp > 1 else ""} '
                         f't{m.tp}</text></g>')
        if plan.tp > 1:  # tensor groups are runs of consecutive ranks with the same (pp, dp, cp)
            i = 0
            while i < len(coords):
                j = i
                while j + 1 < len(coords) and (coords[j + 1].pp, coords[j + 1].dp, coords[j + 1].cp) == \
                        (coords[i].pp, coords[i].dp, coords[i].cp):
                    j += 1
                x = G + i * (W + G) - 3
                parts.append(f'<rect class="tpg" x="{x}" y="{16 + G - 3}" width="{(j - i + 1) * (W + G) - G + 6}" '
                             f'height="{H + 6}" rx="7"/>')
                i = j + 1
        boxes.append("".join(parts) + "</svg>")
    legend = "".join(f'<span class="key" data-pp="{r}"><i style="background:{stage_color(r)}"></i>'
                     f'stage {", ".join(map(str, stages_of[r]))} (pipeline rank {r})</span>' for r in range(plan.pp))
    if plan.tp > 1:
        legend += f'<span class="key"><i class="tpkey"></i>tensor-parallel group of {plan.tp}</span>'
    return (f'<section id="device-grid"><h2>Devices</h2><p class="legend">{legend}</p>'
            f'<div class="nodes">{"".join(boxes)}</div>'
            f'<p class="note">{Mesh(plan.pp, plan.dp, plan.tp, plan.cp).formula()}; cells show rank, data-parallel '
            f'replica (d){", context slice (c)" if plan.cp > 1 else ""} and tensor slice (t){f"; expert-parallel groups: {plan.ep} consecutive data-parallel replicas" if plan.ep > 1 else ""}.</p></section>')


def _stage_map(plan: Plan) -> str:
    """The layer strip (blocks in order, coloured by stage) and the per-stage table."""
    total = sum(len(s.blocks) for s in plan.stages) or 1
    strip, x = [], 0.0
    for s in plan.stages:
        w = 1300 * len(s.blocks) / total
        label = blocks_text(s.blocks)
        r = stage_rank(plan.schedule, plan.pp, s.index)
        strip.append(f'<g data-pp="{r}" data-tip="{esc(f"stage {s.index}: {label}")}">'
                     f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="30" fill="{stage_color(r)}" '
                     f'stroke="#fff"/><text x="{x + w / 2:.1f}" y="19" class="r">{esc(label if len(label) * 6 < w else s.index)}'
                     '</text></g>')
        x += w
    slowest = max((s.forward_s + s.backward_s for s in plan.stages), default=0.0) or 1.0
    rows = []
    for s in plan.stages:
        share = 100 * (s.forward_s + s.backward_s) / slowest
        r = stage_rank(plan.schedule, plan.pp, s.index)
        rows.append(f'<tr data-pp="{r}"><td><i class="sw" style="background:{stage_color(r)}">'
                    f'</i>{s.index}</td><td>{r}</td><td>{esc(blocks_text(s.blocks))}</td>'
                    f'<td class="n">{esc(human(s.num_params))}</td><td class="n">{s.forward_s * 1e3:.3f}</td>'
                    f'<td class="n">{s.backward_s * 1e3:.3f}</td><td><div class="hbar" style="width:{share:.1f}%"></div></td>'
                    f'<td class="n">{esc(_size(s.memory.total))}</td><td>{esc(ranges_text(list(s.ranks)))}</td></tr>')
    return (f'<section id="stage-map"><h2>Layers to stages</h2><svg width="1300" height="30">{"".join(strip)}</svg>'
            '<table><thead><tr><th>stage</th><th>pipeline rank</th><th>blocks</th><th>params per rank</th>'
            '<th>fwd ms</th><th>bwd ms</th><th>fwd+bwd vs slowest</th><th>memory</th><th>ranks</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></section>')


def _memory_bars(plan: Plan) -> str:
    """Stacked bars per rank against the device's capacity (drawn off scale when the plan is far below it)."""
    mem, cap = plan.rank_memory(), plan.predicted.memory_capacity_bytes
    bars = [(f"rank {m.rank}", m.pp) for m in plan.mesh] if plan.world_size <= MAX_BARS else \
        [(f"ranks {ranges_text([m.rank for m in plan.mesh if m.pp == r])}", r) for r in range(plan.pp)]
    peak = max(m.total for m in mem.values())
    on_scale = peak >= 0.25 * cap  # else the bars would be slivers under a far-away line
    top = max(cap, peak) * 1.05 if on_scale else peak * 1.25
    W, H, L, B = 1300, 260, 60, 40  # plot width, height, left and bottom margins (px)
    bw = min(40.0, (W - L) / len(bars) * 0.7)
    step = (W - L) / len(bars)
    y = lambda v: H - B - (H - B - 10) * v / top
    out = [f'<svg width="{W}" height="{H}">']
    div, unit = _unit(top)
    for t in _ticks(top / div, 5):
        out.append(f'<line x1="{L}" x2="{W}" y1="{y(t * div):.1f}" y2="{y(t * div):.1f}" class="grid"/>'
                   f'<text x="{L - 6}" y="{y(t * div) + 4:.1f}" class="ax" text-anchor="end">{t:g}</text>')
    for i, (label, r) in enumerate(bars):
        x, base, m = L + i * step + (step - bw) / 2, 0.0, mem[r]
        for field, name, color in MEMORY_PARTS:
            v = getattr(m, field)
            tip = f"{label} (pipeline rank {r}): {name} {_size(v)}; total {_size(m.total)}"
            out.append(f'<rect x="{x:.1f}" y="{y(base + v):.1f}" width="{bw:.1f}" height="{y(base) - y(base + v):.2f}" '
                       f'fill="{color}" data-tip="{esc(tip)}"/>')
            base += v
        out.append(f'<rect x="{x:.1f}" y="{H - B + 4}" width="{bw:.1f}" height="5" fill="{stage_color(r)}"/>')
        if len(bars) <= 32:
            out.append(f'<text x="{x + bw / 2:.1f}" y="{H - B + 22}" class="ax" text-anchor="middle">{esc(label)}</text>')
    if on_scale:
        out.append(f'<line x1="{L}" x2="{W}" y1="{y(cap):.1f}" y2="{y(cap):.1f}" class="capline"/>'
                   f'<text x="{W - 4}" y="{y(cap) - 4:.1f}" class="ax" text-anchor="end">capacity {esc(_size(cap))}</text>')
    out.append(f'<text x="{L - 6}" y="{H - 4}" class="ax" text-anchor="end">{unit}</text></svg>')
    note = "" if on_scale else (f'<p class="note">The device capacity, {esc(_size(cap))}, is off this scale: the peak '
                                f'uses {100 * peak / cap:.2g} % of it.</p>')
    legend = "".join(f'<span class="key"><i style="background:{c}"></i>{n}</span>' for _, n, c in MEMORY_PARTS)
    return f'<section id="memory-bars"><h2>Memory per rank</h2><p class="legend">{legend}</p>{"".join(out)}{note}</section>'


def _timeline(plan: Plan, tl: Timeline) -> str:
    """Per pipeline rank: compute (forwards light, backwards dark), sends (instants), data-parallel collectives."""
    W, L, top = 1300, 110, max(tl.step_time_s, 1e-12)
    lanes = {"compute": (0, 24), "send": (27, 6), "collective": (36, 10)}  # lane -> (y offset, height) in a rank
    row = 56
    H = 30 + row * tl.num_ranks
    x = lambda t: L + (W - L - 10) * t / top
    out = [f'<svg width="{W}" height="{H}">']
    for t in _ticks(top * 1e3, 10):
        out.append(f'<line x1="{x(t / 1e3):.1f}" x2="{x(t / 1e3):.1f}" y1="0" y2="{H - 20}" class="grid"/>'
                   f'<text x="{x(t / 1e3):.1f}" y="{H - 6}" class="ax" text-anchor="middle">{t:g}</text>')
    for r in range(tl.num_ranks):
        out.append(f'<text x="4" y="{r * row + 17}" class="ax">pipeline rank {r}</text>'
                   f'<text x="4" y="{r * row + 31}" class="lane">send</text>'
                   f'<text x="4" y="{r * row + 44}" class="lane">dp collective</text>')
    for e in tl.events:
        dy, h = lanes[e.lane]
        x0, w = x(e.start_s), max(x(e.end_s) - x(e.start_s), 1.5)  # instants (sends) stay visible
        color, op = event_style(e)
        tip = (f"{e.name} (stage {e.stage}) on pipeline rank {e.rank}: {e.start_s * 1e3:.3f} - "
               f"{e.end_s * 1e3:.3f} ms ({(e.end_s - e.start_s) * 1e3:.3f} ms)")
        out.append(f'<rect x="{x0:.2f}" y="{e.rank * row + dy}" width="{w:.2f}" height="{h}" fill="{color}" '
                   f'fill-opacity="{op}" data-tip="{esc(tip)}"/>')
        if e.lane == "compute" and w > 8 * len(e.name):
            out.append(f'<text x="{x0 + w / 2:.2f}" y="{e.rank * row + dy + 16}" class="ev">{esc(e.name)}</text>')
    out.append(f'<text x="{L - 14}" y="{H - 6}" class="ax" text-anchor="end">ms</text></svg>')
    return (f'<section id="timeline"><h2>One training step, simulated ({tl.step_time_s * 1e3:.2f} ms)</h2>{"".join(out)}'
            '<p class="note">From the plan\'s instruction lists (partitioner.planner.simulate). Approximated from what the '
            'plan holds: transfer times are counted in the receiving compute, so sends show as instants; each stage\'s '
            'exposed data-parallel communication is predicted.exposed_comm_s shared by parameters; the optimizer '
            'step is the rest of the predicted step time. <code>plan.timeline("step.json")</code> writes this as a '
            'Perfetto trace.</p></section>')


def _alternatives(plan: Plan) -> str:
    best = plan.predicted.step_time_s
    rows = [(f'<tr class="chosen"><td>chosen</td><td>{esc(plan.config)}</td><td class="n">{best * 1e3:.2f}</td>'
             f'<td class="n">{esc(_size(plan.predicted.peak_memory_bytes))}</td><td>yes</td>'
             '<td>the fastest that fits (of equals, the simplest)</td></tr>')]
    for i, a in enumerate(plan.alternatives, 1):
        rows.append(f'<tr><td>{i}</td><td>{esc(a.config)}</td><td class="n">{a.step_time_s * 1e3:.2f}</td>'
                    f'<td class="n">{esc(_size(a.peak_memory_bytes))}</td><td>{"yes" if a.fits else "no"}</td>'
                    f'<td>{esc(a.why)}</td></tr>')
    return ('<section id="alternatives"><h2>Runners-up</h2><table><thead><tr><th>#</th><th>config</th>'
            '<th>ms/step</th><th>peak memory</th><th>fits</th><th>why it lost</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table><p class="note">A runner-up\'s ms/step is the planner\'s '
            'closed-form estimate for its best stage cut; the chosen plan\'s is its simulated schedule.</p></section>')


CSS = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px 24px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 8px; } h2 { font-size: 15px; margin: 22px 0 6px; }
dl { display: grid; grid-template-columns: 110px 1fr; gap: 2px 12px; margin: 0; } dt { color: #666; }
.cap { width: 400px; height: 8px; background: #e6e6e6; margin-top: 6px; } .cap div { height: 8px; background: #c0392b; }
.nodes { display: flex; flex-wrap: wrap; gap: 10px; } .nodes svg { border: 1px solid #ccc; border-radius: 6px; }
.lbl { font-size: 11px; fill: #555; } .r { font-size: 13px; fill: #fff; text-anchor: middle; font-weight: 600; }
.c { font-size: 9px; fill: #fff; text-anchor: middle; } .tpg { fill: none; stroke: #111; stroke-width: 2; }
.cell.hl rect, g.hl rect { stroke: #000; stroke-width: 3; } tr.hl { background: #fff3c4; }
.legend .key { margin-right: 14px; white-space: nowrap; } .key i, .sw { display: inline-block; width: 12px;
  height: 12px; margin-right: 4px; vertical-align: -2px; border-radius: 2px; }
.tpkey { border: 2px solid #111; width: 10px !important; height: 10px !important; }
table { border-collapse: collapse; margin-top: 8px; } td, th { padding: 3px 10px; border-bottom: 1px solid #eee;
  text-align: left; } th { color: #555; font-weight: 600; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.hbar { height: 8px; background: #888; min-width: 1px; width: 120px; } tr.chosen { background: #eef6ee; }
.grid { stroke: #eee; } .ax { font-size: 10px; fill: #555; } .lane { font-size: 9px; fill: #999; }
.ev { font-size: 10px; fill: #111; text-anchor: middle; } .capline { stroke: #c0392b; stroke-dasharray: 6 4; stroke-width: 2; }
.note { color: #666; font-size: 12px; max-width: 1300px; }
#tooltip { position: absolute; pointer-events: none; background: #222; color: #fff; padding: 4px 8px;
  border-radius: 4px; font-size: 12px; max-width: 480px; }
"""

# Errors go into #js-errors (tests read it from the dumped DOM); data-ready marks that the script ran to its end.
JS = """
(function () {
  var errors = document.getElementById("js-errors");
  function record(msg) { errors.textContent += msg + "\\n"; errors.hidden = false; }
  window.addEventListener("error", function (e) { record(String(e.message)); });
  try {
    var tip = document.getElementById("tooltip");
    document.addEventListener("mousemove", function (e) {
      var t = e.target.closest("[data-tip]");
      if (!t) { tip.hidden = true; return; }
      tip.textContent = t.getAttribute("data-tip");
      tip.style.left = (e.pageX + 14) + "px";
      tip.style.top = (e.pageY + 14) + "px";
      tip.hidden = false;
    });
    // hovering a stage (table row, strip, legend, cell) highlights everything of that pipeline rank
    var marked = document.querySelectorAll("[data-pp]");
    function mark(pp) {
      marked.forEach(function (el) { el.classList.toggle("hl", pp !== null && el.getAttribute("data-pp") === pp); });
    }
    marked.forEach(function (el) {
      el.addEventListener("mouseenter", function () { mark(el.getAttribute("data-pp")); });
      el.addEventListener("mouseleave", function () { mark(null); });
    });
  } catch (err) {
    record(String(err && err.stack || err));
  }
  document.body.setAttribute("data-ready", "1");
})();
"""


def render_html(plan: Plan) -> str:
    """The page as a string (see `write_html`)."""
    title = f"Plan: {plan.model_name} on {plan.topology_name}, {plan.config}"
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{esc(title)}</title>",
        f"<style>{CSS}</style></head><body>",
        _summary(plan), _device_grid(plan), _stage_map(plan), _memory_bars(plan),
        _timeline(plan, build_timeline(plan)), _alternatives(plan),
        '<div id="tooltip" hidden></div><pre id="js-errors" hidden></pre>',
        f"<script>{JS}</script></body></html>", ""])


def write_html(plan: Plan, path: str | Path) -> Path:
    """Write `render_html(plan)` to `path` (atomically) and return the path."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_html(plan), encoding="utf-8")
    tmp.replace(path)
    return path
