"""A plan's simulated training step as a timeline: events, a Chrome/Perfetto trace, a Gantt chart.

`build_timeline` runs the plan's own instruction lists (`plan.instructions`)
through `partitioner.planner.simulate` with durations rebuilt from the plan, and
names each action as it ran, per pipeline rank and lane (compute, send,
collective). The trace (`plan.timeline()`) and the HTML page
(`plan.to_html()`) both draw these events.

>>> import shutil, tempfile
>>> from pathlib import Path
>>> from partitioner import compile
>>> from examples.mlp import mlp, example_inputs
>>> model = mlp()
>>> plan = compile(model, "local:2", example_inputs(model), global_batch_size=16, microbatch_size=4, dp=2)
>>> out = Path(tempfile.mkdtemp())
>>> trace = plan.timeline(out / "step.json", png=out / "step.png")
>>> sorted({e["name"] for e in trace["traceEvents"] if e["ph"] == "X"})[:4]
['B0', 'B1', 'F0', 'F1']
>>> sorted(p.name for p in out.iterdir())
['step.json', 'step.png']
>>> shutil.rmtree(out)

Open step.json in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cost_models.actions import COMPUTE_OPS
from partitioner.planner.schedule import Action, Op
from partitioner.planner.simulate import Durations, simulate

if TYPE_CHECKING:
    from partitioner.planner.plan import Plan

__all__ = [
    "LANES",
    "STAGE_COLORS",
    "Timeline",
    "TimelineEvent",
    "build_timeline",
    "chrome_trace",
    "compare_measured",
    "MeasuredComparison",
    "event_style",
    "plan_durations",
    "stage_color",
    "write_timeline",
]

Lane = Literal["compute", "send", "collective"]
LANES: tuple[Lane, ...] = ("compute", "send", "collective")

# Tableau 10: distinct at a glance and for colour-blind readers; pipeline ranks past 10 reuse them.
STAGE_COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
OPTIM_COLOR = "#6b6b6b"
COLLECTIVE_COLOR = "#3d3d6b"


def stage_color(pipeline_rank: int) -> str:
    """The colour of a pipeline rank (and of every virtual stage it holds) on the page and in the chart."""
    return STAGE_COLORS[pipeline_rank % len(STAGE_COLORS)]


def event_style(e: TimelineEvent) -> tuple[str, float]:
    """(colour, opacity) of an event: its stage's colour, forwards lighter than backwards; grey optimizer steps,
    one colour for collectives."""
    if e.name == "optim":
        return OPTIM_COLOR, 1.0
    if e.lane == "collective":
        return COLLECTIVE_COLOR, 1.0
    return stage_color(e.rank), 0.55 if e.name.startswith(("F", "send F")) else 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimelineEvent:
    """One action as simulated: on pipeline rank `rank`, in `lane`, from start_s to end_s (seconds).

    name: "F3" / "B3" (forward / backward of microbatch 3), "send F3" / "send B3"
    (its activation / input gradient leaving), "dp all-reduce" or
    "dp reduce-scatter" (the stage's data-parallel gradient reduction), "optim".
    stage: the virtual stage it belongs to; microbatch: None for stage-wide actions.
    """

    rank: int
    lane: Lane
    name: str
    stage: int
    microbatch: int | None
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timeline:
    """The events of one step, rank by rank in program order; step_time_s: when the last one ends."""

    events: tuple[TimelineEvent, ...]
    step_time_s: float
    num_ranks: int


def plan_durations(plan: Plan) -> Durations:
    """Durations for `simulate` from what the plan records, which is less than the planner knew.

    Approximations (the planner's own Durations are comparisons.durations):
      - p2p is 0: StagePlan.forward_s / backward_s already include receiving the
        boundary activation / gradient (the planner's per-stage c_k), so the
        critical path through the pipeline is the planner's; a send is drawn
        as an instant at its issue time.
      - grad_sync: the plan records only the busiest stage's exposed
        data-parallel communication (predicted.exposed_comm_s); each stage gets
        a share in proportion to its parameters.
      - optim: not recorded per stage; the remainder of the predicted step
        time past the simulated compute and communication, split over a
        rank's virtual stages, so the timeline ends at the predicted step time,
        or a little past it where counting transfers inside compute already
        overshoots (a few % for interleaved schedules: nothing is left to fill).
    """
    stages = plan.stages
    most = max((s.num_params for s in stages), default=0) or 1
    exposed = plan.predicted.exposed_comm_s if plan.dp > 1 else 0.0
    base = Durations(forward=tuple(s.forward_s for s in stages), backward=tuple(s.backward_s for s in stages),
                     p2p=(0.0,) * (len(stages) - 1), grad_sync=tuple(exposed * s.num_params / most for s in stages),
                     optim=(0.0,) * len(stages))
    rest = plan.predicted.step_time_s - simulate(plan.instructions, base).step_time_s
    return dataclasses.replace(base, optim=(max(0.0, rest) / plan.interleave,) * len(stages))


def _name(action: Action, zero_stage: int) -> tuple[str, Lane] | None:
    """What the timeline calls an action and where it draws it; None for receives (their wait is the gap)."""
    op, mb = action.op, action.microbatch
    if op in COMPUTE_OPS:   # F, B, and a split backward's I and W
        return f"{op.value}{mb}", "compute"
    if op is Op.SEND_F or op is Op.SEND_B:
        return f"send {'F' if op is Op.SEND_F else 'B'}{mb}", "send"
    if op is Op.GRAD_SYNC:
        # ZeRO-2/3 reduce-scatter the gradients; DDP and ZeRO-1 all-reduce them
        return ("dp reduce-scatter" if zero_stage >= 2 else "dp all-reduce"), "collective"
    if op is Op.OPTIM:
        return "optim", "compute"
    return None


def build_timeline(plan: Plan) -> Timeline:
    """Simulate the plan's step and name its events (see `plan_durations` for what is approximated)."""
    sim = simulate(plan.instructions, plan_durations(plan))
    events = []
    for ev in sim.events:
        action = Action.parse(ev.action)
        named = _name(action, plan.zero_stage)
        if named is None or (action.op is Op.GRAD_SYNC and plan.dp == 1):
            continue  # without data parallelism there is no gradient reduction to draw
        name, lane = named
        events.append(TimelineEvent(rank=ev.rank, lane=lane, name=name, stage=action.stage,
                                    microbatch=action.microbatch, start_s=ev.start, end_s=ev.end))
    return Timeline(events=tuple(events), step_time_s=sim.step_time_s, num_ranks=plan.instructions.pp)


def chrome_trace(plan: Plan, timeline: Timeline | None = None) -> dict[str, Any]:
    """The Chrome/Perfetto trace: complete ("X") events, pid = pipeline rank, tid = lane, times in microseconds."""
    tl = timeline or build_timeline(plan)
    out: list[dict[str, Any]] = []
    for r in range(tl.num_ranks):
        ranks = [m.rank for m in plan.mesh if m.pp == r]
        out.append({"name": "process_name", "ph": "M", "pid": r,
                    "args": {"name": f"pipeline rank {r} (ranks {ranks[0]}-{ranks[-1]})"}})
        out += [{"name": "thread_name", "ph": "M", "pid": r, "tid": t, "args": {"name": lane}}
                for t, lane in enumerate(LANES)]
    for e in tl.events:
        args: dict[str, Any] = {"stage": e.stage}
        if e.microbatch is not None:
            args["microbatch"] = e.microbatch
        out.append({"name": e.name, "cat": e.lane, "ph": "X", "pid": e.rank, "tid": LANES.index(e.lane),
                    "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6, "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"model": plan.model_name, "topology": plan.topology_name, "config": str(plan.config),
                          "step_time_us": tl.step_time_s * 1e6,
                          "note": "simulated from the plan; p2p folded into compute, optimizer step estimated "
                                  "(partitioner.show.timeline.plan_durations)"}}


def write_timeline(plan: Plan, path: str | Path | None = None, *, png: str | Path | None = None) -> dict[str, Any]:
    """`plan.timeline()`: the trace dict; with `path`, also written as JSON; with `png`, a Gantt chart."""
    tl = build_timeline(plan)
    trace = chrome_trace(plan, tl)
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    if png is not None:
        _write_png(plan, tl, Path(png))
    return trace


def _write_png(plan: Plan, tl: Timeline, path: Path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError("plan.timeline(png=...) draws with matplotlib, which is not installed: "
                          "pip install matplotlib") from None
    # A bare Figure on the Agg canvas: no pyplot, so the caller's backend and open figures are untouched.
    fig = Figure(figsize=(12, 1.2 + 0.8 * tl.num_ranks), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    lane_y = {"compute": (0.35, 0.5), "send": (0.2, 0.12), "collective": (0.0, 0.18)}  # (bottom, height) in a rank
    for e in tl.events:
        bottom, height = lane_y[e.lane]
        y = tl.num_ranks - 1 - e.rank + bottom
        color, alpha = event_style(e)
        width = max((e.end_s - e.start_s) * 1e3, tl.step_time_s * 1e3 / 1500)  # instants stay visible
        ax.broken_barh([(e.start_s * 1e3, width)], (y, height), facecolors=color, alpha=alpha, linewidth=0)
        if e.lane == "compute" and width > tl.step_time_s * 1e3 / 40:  # label the bars wide enough to hold one
            ax.text(e.start_s * 1e3 + width / 2, y + height / 2, e.name, ha="center", va="center", fontsize=7)
    ax.set_yticks([tl.num_ranks - 1 - r + 0.45 for r in range(tl.num_ranks)],
                  [f"pipeline rank {r}" for r in range(tl.num_ranks)])
    ax.set_xlim(0, tl.step_time_s * 1e3 * 1.01 or 1)
    ax.set_ylim(-0.1, tl.num_ranks)
    ax.set_xlabel("ms")
    ax.set_title(f"{plan.model_name} on {plan.topology_name}: {plan.config} "
                 f"({tl.step_time_s * 1e3:.2f} ms/step, simulated)", fontsize=9)
    handles = [Patch(color=stage_color(r), label=f"stage {r}") for r in range(min(plan.pp, len(STAGE_COLORS)))]
    handles += [Patch(color=COLLECTIVE_COLOR, label="dp collective"), Patch(color=OPTIM_COLOR, label="optim")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)


# ---- the measured step beside the predicted one ------------------------------------------------------------
_KIND_ORDER = ("F", "I", "W", "B", "send", "dp reduction", "optim")


def _kind(name: str) -> str | None:
    """The kind of an event of either trace, by its name: F/B/I/W, send, dp reduction, optim; None for what the
    simulated step does not draw (receives, whose wait is inside F or B; ZeRO's UNSHARD / RESHARD)."""
    if name == "optim":
        return "optim"
    if name.startswith("send "):
        return "send"
    if name.startswith("dp ") or name == "GRAD_SYNC":
        return "dp reduction"
    if name[:1] in ("F", "B", "I", "W") and name[1:].isdigit():
        return name[0]
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredComparison:
    """Predicted against measured per pipeline rank and kind of action: rows of (pipeline rank, kind, count of
    the rank's actions of that kind, predicted seconds each, measured seconds each, averaged over the ranks
    that hold that pipeline rank), and the step times."""

    rows: tuple[tuple[int, str, int, float, float], ...]
    predicted_step_s: float
    measured_step_s: float

    def __str__(self) -> str:
        lines = [f"step: predicted {self.predicted_step_s * 1e3:,.2f} ms, measured {self.measured_step_s * 1e3:,.2f} ms "
                 f"(measured / predicted {self.measured_step_s / self.predicted_step_s:.2f})"
                 if self.predicted_step_s > 0 else f"step: measured {self.measured_step_s * 1e3:,.2f} ms",
                 "pp rank  action        count  predicted ms  measured ms  ratio",
                 "-------  ------------  -----  ------------  -----------  -----"]
        for r, kind, n, pred, meas in self.rows:
            ratio = f"{meas / pred:5.2f}" if pred > 0 else "    -"
            lines.append(f"{r:<7}  {kind:<12}  {n:>5}  {pred * 1e3:>12.3f}  {meas * 1e3:>11.3f}  {ratio}")
        return "\n".join(lines)


def compare_measured(plan: Plan, measured: dict[str, Any] | str | Path) -> MeasuredComparison:
    """Set a measured trace (`python -m runtime.run ... --trace PATH`, the dict or its path) beside the plan's
    simulated step: per pipeline rank and kind of action, the mean duration of each, and the two step times.

    A measured F or B holds the waits for its messages; a measured dp reduction only what the rank's last
    backward did not already overlap (the reductions start inside it); the simulated ones are the plan's
    (`plan_durations`). The measured step is the runner's wall time when the trace carries it, else the span of
    its events.

    >>> from partitioner import compile
    >>> from examples.mlp import mlp, example_inputs
    >>> model = mlp()
    >>> plan = compile(model, "local:2", example_inputs(model), global_batch_size=16, microbatch_size=8, dp=2)
    >>> measured = {"traceEvents": [
    ...     {"ph": "X", "name": n, "pid": r, "ts": t, "dur": d, "args": {"pipeline_rank": 0}}
    ...     for r in (0, 1) for n, t, d in (("F0", 0, 100), ("F1", 100, 100), ("B0", 200, 300), ("B1", 500, 300),
    ...                                     ("GRAD_SYNC", 800, 50), ("optim", 850, 50))]}
    >>> c = compare_measured(plan, measured)
    >>> [(kind, n, round(meas * 1e6)) for _, kind, n, _, meas in c.rows]
    [('F', 2, 100), ('B', 2, 300), ('dp reduction', 1, 50), ('optim', 1, 50)]
    >>> round(c.measured_step_s * 1e6)
    900
    """
    trace = json.loads(Path(measured).read_text()) if isinstance(measured, (str, Path)) else measured
    tl = build_timeline(plan)
    predicted: dict[tuple[int, str], list[float]] = {}
    for e in tl.events:
        kind = _kind(e.name)
        if kind is not None:
            predicted.setdefault((e.rank, kind), []).append(e.end_s - e.start_s)
    got: dict[tuple[int, str], list[float]] = {}
    per_rank: dict[tuple[int, str], dict[int, int]] = {}
    start, end = float("inf"), float("-inf")
    for ev in trace.get("traceEvents", ()):
        if ev.get("ph") != "X":
            continue
        start, end = min(start, ev["ts"]), max(end, ev["ts"] + ev["dur"])
        kind = _kind(ev["name"])
        if kind is None:
            continue
        key = (int(ev.get("args", {}).get("pipeline_rank", ev["pid"])), kind)
        got.setdefault(key, []).append(ev["dur"] * 1e-6)
        counts = per_rank.setdefault(key, {})
        counts[ev["pid"]] = counts.get(ev["pid"], 0) + 1
    if not got:
        raise ValueError("the measured trace has no F, B, send, dp reduction or optim events: write it with "
                         "`python -m runtime.run PLAN --model ... --trace PATH`")
    order = {k: i for i, k in enumerate(_KIND_ORDER)}
    rows = []
    for key in sorted(set(predicted) | set(got), key=lambda k: (k[0], order[k[1]])):
        pred, meas = predicted.get(key, []), got.get(key, [])
        n = max(len(pred), max(per_rank.get(key, {0: 0}).values()))
        rows.append((key[0], key[1], n, sum(pred) / len(pred) if pred else 0.0, sum(meas) / len(meas) if meas else 0.0))
    step_us = trace.get("otherData", {}).get("step_time_us")
    return MeasuredComparison(rows=tuple(rows), predicted_step_s=tl.step_time_s,
                              measured_step_s=step_us * 1e-6 if step_us else (end - start) * 1e-6)
