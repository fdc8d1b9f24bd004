"""When each action of a rank's instruction list ran: the measured side of `plan.timeline()`.

`recording()` turns the log on in this process for the executor runs inside it
(`runtime.pipeline.executor.PipelineExecutor.run`, which every generated program's step goes through): each
action is logged as (action, start, end), seconds of `time.perf_counter` on this rank. What an action's span
holds is what it did on this rank: F, B, I and W their compute and the waits for the messages they read (a
receive is posted by RECV_F/RECV_B, logged when it is posted, which is one compute early where it can be, and
waited for inside the F, B or I that needs it), SEND_* the posting of a send, GRAD_SYNC the wait for the rank's gradient reductions (launched by its last backward, so the part that
overlapped compute is not in it), OPTIM the optimizer step, UNSHARD/RESHARD the ZeRO parameter gathers and
frees that code generation added.

`chrome_trace` writes every rank's log as one Chrome/Perfetto trace of the form
`partitioner.show.timeline.chrome_trace` writes for the simulated step: complete ("X") events in microseconds
from a common origin (each rank's clock read right after a barrier), one process per rank named with its
pipeline rank, threads per lane (compute, send, collective), the action in `args`. `runtime.run --trace`
writes it; `partitioner.show.timeline.compare_measured` sets it beside the plan's prediction.

>>> with recording() as log:
...     log_action("0F0", 1.0, 1.5)
>>> chrome_trace([(1.0, log)], pipeline_rank=lambda r: 0)["traceEvents"][-1]["name"]
'F0'
>>> log_action("0F0", 0.0, 1.0)   # outside recording(): nothing kept, nothing costs
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from cost_models.actions import COMPUTE_OPS, P2P_OPS, Action, Op

__all__ = ["LANES", "chrome_trace", "lane_of", "log_action", "recording", "recording_now"]

LANES = ("compute", "send", "collective")  # as partitioner.show.timeline.LANES: the two traces line up

_log: list[tuple[str, float, float]] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, float, float]]]:
    """Log the actions the executor runs in this block (nested blocks log to their own list)."""
    global _log
    outer, _log = _log, []
    try:
        yield _log
    finally:
        _log = outer


def recording_now() -> bool:
    return _log is not None


def log_action(action: str, start: float, end: float) -> None:
    if _log is not None:
        _log.append((action, start, end))


def lane_of(action: Action) -> str:
    """compute: F, B, I, W and the optimizer step; send: the transfers; collective: the data-parallel ones."""
    if action.op in COMPUTE_OPS or action.op is Op.OPTIM:
        return "compute"
    return "send" if action.op in P2P_OPS else "collective"


def event_name(action: Action) -> str:
    """The name `partitioner.show.timeline` gives the same action (F0, B0, send F0, ...); the rest by op."""
    op, mb = action.op, action.microbatch
    if op in COMPUTE_OPS:
        return f"{op.value}{mb}"
    if op is Op.SEND_F or op is Op.SEND_B:
        return f"send {'F' if op is Op.SEND_F else 'B'}{mb}"
    if op is Op.RECV_F or op is Op.RECV_B:
        return f"recv {'F' if op is Op.RECV_F else 'B'}{mb}"
    return "optim" if op is Op.OPTIM else op.value


def chrome_trace(logs: Sequence[tuple[float, Sequence[tuple[str, float, float]]]], *,
                 pipeline_rank: Callable[[int], int], other: dict[str, Any] | None = None) -> dict[str, Any]:
    """One trace of every rank's log: `logs[r]` = (rank r's origin, its (action, start, end) entries)."""
    events: list[dict[str, Any]] = []
    for r, (origin, entries) in enumerate(logs):
        events.append({"name": "process_name", "ph": "M", "pid": r,
                       "args": {"name": f"rank {r} (pipeline rank {pipeline_rank(r)})"}})
        events += [{"name": "thread_name", "ph": "M", "pid": r, "tid": t, "args": {"name": lane}}
                   for t, lane in enumerate(LANES)]
        for text, start, end in entries:
            action = Action.parse(text)
            lane = lane_of(action)
            args: dict[str, Any] = {"action": text, "stage": action.stage, "pipeline_rank": pipeline_rank(r)}
            if action.microbatch is not None:
                args["microbatch"] = action.microbatch
            events.append({"name": event_name(action), "cat": lane, "ph": "X", "pid": r, "tid": LANES.index(lane),
                           "ts": (start - origin) * 1e6, "dur": (end - start) * 1e6, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"measured": True, **(other or {})}}
