"""What a rank measures of its training steps, and the report file it writes: shared by every launcher.

launch_local's workers and `python -m runtime.run` (under torchrun, mpirun or
srun) time and probe a step with the same `measure_step`, so a trial measures
the same thing whichever launcher started it:

>>> import torch
>>> import torch.distributed as dist
>>> from partitioner import compile
>>> from examples.mlp import mlp, example_inputs
>>> from examples.training import sgd
>>> model = mlp()
>>> plan = compile(model, "local:1", example_inputs(model), global_batch_size=8)
>>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)   # a job of one rank
>>> runner = plan.program(0).namespace()["build"](mlp, sgd, torch.nn.functional.cross_entropy)
>>> batch = (example_inputs(model)[0], torch.zeros(8, dtype=torch.long))
>>> m = measure_step(runner, batch, probe=True, limit_bytes=460 * 2**20)
>>> m.seconds > 0, m.peak_bytes
(True, 9401038)
>>> dist.destroy_process_group()

`probe=True` runs the step under runtime.launch.memory_probe.PeakMemory: the peak is
the bytes of tensor storages live during the step, those held on entry that
the step uses (parameters, gradients, optimizer state) counted by the probe
itself, and with `limit_bytes` an
allocation past the limit raises torch.OutOfMemoryError, as a device of that
capacity would. The probe slows the step: leave a probed step out of timings.

A job's ranks report through files (`runtime.run --report DIR`): rank r
rewrites DIR/rank_{r}.json atomically (write, then rename) when it starts,
after every step and when it ends, so whoever reads it (autotune's cluster
launcher, runtime/launch/cluster.py) sees the last complete version: what a rank
measured, or where it was when it failed or was killed.

    {"rank": 1, "world_size": 2, "status": "ok", "steps": 3, "step_times_s": [0.31, 0.12, 0.12],
     "losses": [6.95, 6.97, 6.91], "probe_step": 1, "peak_step_bytes": 31457280, ...}

status: "running", "ok", "oom" (torch.OutOfMemoryError), "peer_lost" (a
peer stopped: runtime.launch.heartbeat.PeerLost) or "crash" (any other exception;
error_type, error and traceback say which).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from runtime.device import rank_device, synchronize
from runtime.launch.memory_probe import CudaPeakMemory, PeakMemory

__all__ = ["RankReport", "RankReporter", "StepMeasure", "measure_step", "read_reports", "report_path",
           "state_bytes", "write_atomic"]

ReportStatus = Literal["running", "ok", "oom", "peer_lost", "crash"]


@dataclasses.dataclass(frozen=True)
class StepMeasure:
    loss: Any  # what runner.step returned (the global mean loss)
    seconds: float  # wall-clock time of runner.step on this rank
    peak_bytes: int | None  # with probe=True: the step's peak of live storages, held state included


def state_bytes(held: Mapping[str, int]) -> int:
    """params + grads + optimizer of a runner's held_bytes() (other keys, such as a "total", are not added again)."""
    return sum(int(held.get(k, 0)) for k in ("params", "grads", "optimizer"))


def measure_step(runner: Any, batch: Any, *, probe: bool = False, limit_bytes: float | None = None) -> StepMeasure:
    """Run `runner.step(batch)` once, timed; with `probe`, under the memory probe (see the module docstring)."""
    # A GPU step returns once its kernels are queued (the loss's .item() waits for the last stage only):
    # the clock is read after the device is done, and started after earlier work is.
    synchronize()
    t0 = time.perf_counter()
    if not probe:
        loss = runner.step(batch)
        synchronize()
        return StepMeasure(loss, time.perf_counter() - t0, None)
    dev = rank_device()
    pm = CudaPeakMemory(dev, limit_bytes=limit_bytes) if dev.type == "cuda" else PeakMemory(limit_bytes=limit_bytes)
    with pm:  # the CPU probe counts what is held on entry itself; CUDA's allocator knows it
        loss = runner.step(batch)
    return StepMeasure(loss, time.perf_counter() - t0, pm.peak_bytes)


# ---- the per-rank report --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankReport:
    """One rank's report file (see the module docstring). step_times_s/losses: per step run so far."""

    rank: int
    world_size: int
    status: ReportStatus
    steps: int  # the steps this run was asked for
    current_step: int | None = None  # the step (0-based) being run now; None between steps and outside them
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    probe_step: int | None = None
    peak_step_bytes: int | None = None
    error_type: str = ""
    error: str = ""
    traceback: str = ""
    host: str = ""
    pid: int = 0
    time: float = 0.0  # when this version was written (time.time())

    @property
    def where(self) -> str:
        """Where the rank is (or stopped): "in step 3 of 5", "before step 1 (starting: ...)", "after finishing"."""
        done = len(self.step_times_s)
        if self.status == "ok":
            return "after finishing"
        if self.current_step is not None:
            return f"in step {self.current_step + 1} of {self.steps}"
        if done == 0:
            return "before step 1 (starting: imports, rendezvous, build)"
        if done >= self.steps:
            return f"after its {self.steps} steps (finishing)"
        return f"between steps {done} and {done + 1}"

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> RankReport:
        names = {f.name for f in dataclasses.fields(RankReport)}
        return RankReport(**{k: v for k, v in d.items() if k in names})


def report_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank_{rank}.json"


def write_atomic(path: Path, write: Callable[[Any], Any]) -> None:
    """`write(binary file)` into PATH.part, then rename it over `path`: readers see all of it or none."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def read_reports(directory: str | os.PathLike, world_size: int) -> dict[int, RankReport]:
    """rank -> its report, for the ranks whose report exists and parses (a missing rank never reported)."""
    out = {}
    for r in range(world_size):
        try:
            out[r] = RankReport.from_dict(json.loads(report_path(directory, r).read_text()))
        except (OSError, ValueError, TypeError):
            continue
    return out


class RankReporter:
    """Keeps rank `rank`'s report file in `directory` up to date: `begin(step)` and `step` around each step,
    then `finish` or `fail`."""

    def __init__(self, directory: str | os.PathLike, *, rank: int, world_size: int, steps: int,
                 probe_step: int | None = None):
        self.path = report_path(directory, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.report = RankReport(rank=rank, world_size=world_size, status="running", steps=steps,
                                 probe_step=probe_step, host=socket.gethostname(), pid=os.getpid())
        self._write()

    def begin(self, step: int) -> None:
        """Step `step` (0-based) starts: a rank that hangs in it, or fails, is reported there."""
        self._write(current_step=step)

    def step(self, m: StepMeasure) -> None:
        """The step begun last ended, measuring `m`."""
        r = self.report
        peak = m.peak_bytes if m.peak_bytes is not None else r.peak_step_bytes
        self._write(step_times_s=[*r.step_times_s, m.seconds], losses=[*r.losses, float(m.loss)],
                    peak_step_bytes=peak, current_step=None)

    def finish(self) -> None:
        self._write(status="ok")

    def fail(self, status: ReportStatus, exc: BaseException) -> None:
        """Record the exception this rank stops with (the first one: a later, consequent one is not recorded)."""
        if self.report.status != "running":
            return
        self._write(status=status, error_type=type(exc).__qualname__, error=str(exc),
                    traceback="".join(traceback.format_exception(exc)))

    def _write(self, **changes: Any) -> None:
        self.report = dataclasses.replace(self.report, **changes, time=time.time())
        data = json.dumps(dataclasses.asdict(self.report)).encode()
        write_atomic(self.path, lambda f: f.write(data))
