"""Auto-tune: measure the cost model's best candidates on the real machines, fit its calibration, repeat.

The smallest tune: one trial of one measured step on two local processes (progress goes to stderr):

>>> import tempfile
>>> from pathlib import Path
>>> tmp = Path(tempfile.mkdtemp())
>>> res = autotune("examples/gpt.py:gpt_tiny", "local:2", global_batch_size=8, trials=1, steps=1, warmup=0,
...                max_rounds=1, db=tmp / "tune.sqlite")
>>> print(res.plan.config)   # the best measured configuration, compiled with the fitted calibration
dp2 tp1 pp1 zero3 mb4x1 1f1b recompute=none
>>> print(format_trials(res.trials))   # each: config, predicted and measured step time and peak memory, status
config                                                   status  meas ms  pred ms calib ms     err meas MiB calib MiB mem err
dp2 tp1 pp1 zero3 mb4x1 1f1b recompute=none                  ok ...
>>> res.calibration_path
PosixPath('.../tune.calibration.json')

The loop:
1. compile under the starting calibration; take `trials` of its ranked
   candidates, distinct shapes first (a fit learns more from dp4 vs pp2 x dp2
   than from two recompute policies of one shape);
2. run each for `warmup` + 1 + `steps` steps through the runtime's launcher
   (local processes, or a torchrun/srun job: see Launchers below):
   the warm-up steps are discarded, the next runs under the memory probe
   (runtime.launch.memory_probe: peak bytes per rank, and torch.OutOfMemoryError past
   the device's usable memory, as on the device), the median of the last
   `steps` (each the slowest rank's) is the step time. Out of memory, crashes
   and hangs are recorded with their reason and the tuner goes on (either
   launcher stops every rank of a failed or timed-out trial);
3. fit the calibration to the successful trials (cost_models/fit.py: least
   squares on log step times, freeing only the factors the trials identify,
   at most one fewer than the trials, pulled toward the starting calibration,
   e.g. `partitioner probe`'s; linear least squares on memory), and report
   the leave-one-out error beside the in-sample one (`AutotuneResult.fit_report`);
4. compile again with it; its leaders not yet measured are tried next; stop
   when the measured best is the calibrated model's best, or after
   `max_rounds`.
Every trial is committed to the SQLite `db` as it ends (partitioner/tune/db.py):
re-running skips what is measured and so resumes an interrupted tune.

Launchers: `launcher="local"` (the default; `local:N` topologies) runs each
trial as local processes (runtime.launch.local.launch_local). On a cluster,
`launcher="torchrun"` or `"srun"` runs each trial as one job of
`python -m runtime.run` (partitioner/tune/cluster.py, runtime/launch/cluster.py):
the plan and its programs are written to `trial_dir`/KEY/, the ranks time
and probe the same steps with the same code (runtime/launch/measure.py) and report
through per-rank files; a job past `timeout_s` is stopped with every process
under it. The ranks import the model by name, so it is a spec string there.
One node's torchrun job here (the default endpoint: 127.0.0.1 and a free port):

>>> res = autotune("examples/gpt.py:gpt_tiny", "local:2", global_batch_size=8, trials=1, steps=1, warmup=0,
...                max_rounds=1, db=tmp / "cluster.sqlite", launcher="torchrun",
...                launcher_args=dict(trial_dir=tmp / "trials"))
>>> [(str(t.config), t.status) for t in res.trials]
[('dp2 tp1 pp1 zero3 mb4x1 1f1b recompute=none', 'ok')]
>>> import shutil; shutil.rmtree(tmp)

On two nodes of a cluster the topology says so and torchrun needs a meeting point and a way onto
each node: `autotune("examples/gpt.py:gpt_small", "2x8xH100-80GB", global_batch_size=64,
launcher="torchrun", launcher_args=dict(rdzv_endpoint="node01:29400", wrapper="srun --ntasks-per-node=1"))`.
Inside a SLURM allocation srun starts every rank itself (SLURM is not on the machines the tests run on):

>>> autotune("examples/gpt.py:gpt_small", "2x8xH100-80GB", global_batch_size=64, launcher="srun")  # doctest: +SKIP

launcher_args: torchrun: rdzv_endpoint ("HOST:PORT"; default 127.0.0.1 and a
free port, one node), wrapper (what starts an agent per node), extra; srun:
master_port, python, extra (more srun flags); both: nnodes/nproc_per_node
(checked against the topology), trial_dir (default DB.trials/ beside `db`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from cost_models.calibration import Calibration
from cost_models.errors import DeclarationError, PartitionerError
from cost_models.fit import MEMORY_FACTORS, fit_memory, fit_step_times, leave_one_out
from cost_models.memory import allocator_slack
from cost_models.topology import Topology
from partitioner.compile import PlanInfeasibleError, compile
from partitioner.planner.plan import MemoryBreakdown, ParallelConfig, Plan
from partitioner.tracer.opgraph import OpGraph
from partitioner.tune.cluster import LAUNCHERS, ClusterTrials, cluster_trials
from partitioner.tune.db import TrialStore, trial_key

__all__ = ["AutotuneResult", "Trial", "autotune", "format_trials", "rank_memory_of"]

_PINS = ("dp", "tp", "pp", "zero_stage", "microbatch_size", "schedule", "interleave", "recompute")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trial:
    """One measured configuration.

    status: "ok", "oom" (out of memory), "crash", "timeout", or "infeasible" (the cost model says it
    does not fit, so it was not run). predicted_*: under the calibration it was chosen with;
    calibrated_*: under the final fitted calibration. Peak bytes are per rank.
    """

    config: ParallelConfig
    compression: dict[str, str]
    status: str
    predicted_step_s: float
    predicted_peak_bytes: list[float]
    measured_step_s: float | None = None
    measured_step_times_s: list[float] = dataclasses.field(default_factory=list)
    measured_peak_bytes: list[int] | None = None
    calibrated_step_s: float | None = None
    calibrated_peak_bytes: list[float] | None = None
    error: str = ""
    cached: bool = False  # read from the database, not measured in this call
    round: int = 0
    stage_bounds: list[int] | None = None  # the measured plan's cut: calibrated predictions cost this cut

    @property
    def step_error(self) -> float | None:
        """calibrated / measured - 1."""
        if self.measured_step_s is None or self.calibrated_step_s is None:
            return None
        return self.calibrated_step_s / self.measured_step_s - 1

    @property
    def memory_error(self) -> float | None:
        """The worst rank's calibrated / measured peak - 1 (by magnitude)."""
        if not self.measured_peak_bytes or not self.calibrated_peak_bytes:
            return None
        return max((p / m - 1 for p, m in zip(self.calibrated_peak_bytes, self.measured_peak_bytes)), key=abs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = dataclasses.asdict(self.config)
        d["step_error"], d["memory_error"] = self.step_error, self.memory_error
        return d


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutotuneResult:
    plan: Plan  # the best measured configuration, compiled with the fitted calibration
    trials: tuple[Trial, ...]
    calibration: Calibration
    calibration_path: Path
    db_path: Path
    rounds: int
    fit_rms_before: float | None  # sqrt(mean(log(predicted / measured)^2)) over the ok trials
    fit_rms_after: float | None
    # sqrt(mean(log(predicted / measured)^2)) of each ok trial predicted by a fit to the others: the error to
    # expect on a configuration the fit has not seen (cost_models.fit.leave_one_out)
    fit_rms_loo: float | None = None
    fitted: tuple[str, ...] = ()  # the factors the trials identified and the fit moved

    def fit_report(self) -> str:
        """One line: the fit's in-sample and held-out errors, and what it moved."""
        if self.fit_rms_after is None:
            return "fit: fewer than 2 successful trials, calibration unchanged"
        n = sum(t.status == "ok" for t in self.trials)
        return (f"fit over {n} trials: rms log error {self.fit_rms_before:.3f} -> {self.fit_rms_after:.3f} in sample, "
                f"{self.fit_rms_loo:.3f} leave-one-out; factors fitted: {', '.join(self.fitted) or 'none'}")

    @property
    def best(self) -> Trial:
        return min((t for t in self.trials if t.status == "ok"), key=lambda t: t.measured_step_s)

    def to_dict(self) -> dict[str, Any]:
        return {"best": self.best.to_dict(), "plan_config": str(self.plan.config), "rounds": self.rounds,
                "calibration_path": str(self.calibration_path), "db": str(self.db_path),
                "calibration": self.calibration.to_dict(), "fit_rms_log_error_before": self.fit_rms_before,
                "fit_rms_log_error_after": self.fit_rms_after, "fit_rms_log_error_loo": self.fit_rms_loo,
                "fitted": list(self.fitted), "trials": [t.to_dict() for t in self.trials]}


def format_trials(trials: Sequence[Trial]) -> str:
    """The trials as a table: step time measured, predicted before and after calibration; worst rank's peak."""
    names = [str(t.config) + "".join(f" {lvl}={c}" for lvl, c in t.compression.items() if c != "none")
             for t in trials]
    w = max([52, *map(len, names)])  # compressed plans' names are longer: the columns move with them
    head = (f"{'config':<{w}} {'status':>10} {'meas ms':>8} {'pred ms':>8} {'calib ms':>8} {'err':>7} "
            f"{'meas MiB':>8} {'calib MiB':>9} {'mem err':>7}")
    rows = [head]
    for t, name in zip(trials, names):
        status = t.status + (" (db)" if t.cached else "")
        if t.status != "ok":
            first = t.error.strip().splitlines()[0][:70] if t.error.strip() else ""
            rows.append(f"{name:<{w}} {status:>10}  {first}")
            continue
        calib = "-" if t.calibrated_step_s is None else f"{t.calibrated_step_s * 1e3:8.1f}"
        err = "-" if t.step_error is None else f"{t.step_error:+7.1%}"
        if t.calibrated_peak_bytes:
            r = max(range(len(t.measured_peak_bytes)),
                    key=lambda i: abs(t.calibrated_peak_bytes[i] / t.measured_peak_bytes[i] - 1))
            mem = (f"{t.measured_peak_bytes[r] / 2**20:8.1f} {t.calibrated_peak_bytes[r] / 2**20:9.1f} "
                   f"{t.memory_error:+7.1%}")
        else:
            mem = f"{max(t.measured_peak_bytes or [0]) / 2**20:8.1f} {'-':>9} {'-':>7}"
        rows.append(f"{name:<{w}} {status:>10} {t.measured_step_s * 1e3:8.1f} {t.predicted_step_s * 1e3:8.1f} "
                    f"{calib:>8} {err:>7} {mem}")
    return "\n".join(rows)


def rank_memory_of(plan: Plan) -> list[MemoryBreakdown]:
    """Per rank (in rank order): its pipeline position's memory (Plan.rank_memory)."""
    per_pp = plan.rank_memory()
    return [per_pp[c.pp] for c in sorted(plan.mesh, key=lambda c: c.rank)]


# ---- the loop ---------------------------------------------------------------------------


def autotune(model: str | Callable, topology: Topology | str | dict, *, example_inputs: Sequence[Any] | None = None,
             global_batch_size: int, trials: int = 6, db: str | Path = "partitioner-tune.sqlite", steps: int = 3,
             warmup: int = 1, timeout_s: float = 120, calibration_out: str | Path | None = None,
             progress: bool | TextIO = True, optimizer_fn: Callable | None = None, loss_fn: Callable | None = None,
             data: Callable[[int], Any] | None = None, candidates: Sequence[dict[str, Any]] | None = None,
             max_rounds: int = 3, calibration: Calibration | str | None = None, fit_iterations: int = 30,
             launcher: str = "local", launcher_args: Mapping[str, Any] | None = None,
             **compile_kwargs: Any) -> AutotuneResult:
    """Measure, calibrate and re-rank until the measured best stops changing; see the module docstring.

    model: a picklable factory (a module-level function) or "FILE.py:FACTORY" / "pkg.module:FACTORY" (a
        cluster launcher takes the string only).
    data: step -> (inputs, targets), the global batch; or a spec "pkg.module:fn" of runtime.run's --data,
        fn(step, rank, world_size) -> the global batch (a cluster launcher takes the spec only); default:
        the model module's `example_batch(model, global_batch_size, seed=step)`.
    optimizer_fn / loss_fn: default the plan's optimizer (lr 1e-3) and cross-entropy (runtime.run); a cluster
        launcher takes spec strings (runtime.run's --optimizer/--loss).
    launcher: "local", "torchrun" or "srun"; launcher_args: its options (see the module docstring).
    candidates: the first round's configurations as dicts of compile pins (e.g. {"dp": 2, "tp": 2}),
        instead of the cost model's top `trials`.
    compile_kwargs: passed to every compile (precision, optimizer, max_memory_fraction, pins...).
    """
    from runtime.launch.loading import load_callable
    from runtime.run import default_loss

    _check(trials=trials, steps=steps, warmup=warmup, max_rounds=max_rounds)
    topo = Topology.coerce(topology)
    if launcher not in LAUNCHERS:
        raise DeclarationError(f"launcher={launcher!r}: expected one of {', '.join(map(repr, LAUNCHERS))}")
    if launcher == "local" and not topo.local:
        raise DeclarationError(f"topology {topo}: launcher='local' runs trials as local processes (local:N "
                               "topologies); on a cluster pass launcher=\"torchrun\" or launcher=\"srun\" "
                               "(CLI: --launcher torchrun|srun)")
    if launcher == "local" and launcher_args:
        raise DeclarationError(f"launcher_args {sorted(launcher_args)}: options of a cluster launcher; "
                               "launcher='local' takes none")
    cluster = None
    if launcher != "local":
        cluster = cluster_trials(launcher, topo, launcher_args or {}, model=model, data=data, optimizer=optimizer_fn,
                                 loss=loss_fn, timeout_s=timeout_s, db=Path(db))
        data = optimizer_fn = loss_fn = None  # the ranks load their own (runtime.run)
    elif isinstance(data, str):
        data = functools.partial(_spec_data, load_callable(data, "data"), topo.world_size)
    if isinstance(optimizer_fn, str):
        optimizer_fn = load_callable(optimizer_fn, "optimizer_fn")
    if isinstance(loss_fn, str):
        loss_fn = load_callable(loss_fn, "loss_fn")
    model_fn = load_callable(model, "model") if isinstance(model, str) else model
    module = inspect.getmodule(model_fn)
    built = model_fn()
    if example_inputs is None:
        if not hasattr(module, "example_batch"):
            raise DeclarationError("example_inputs: required when the model's module has no example_batch(model, "
                                   "batch_size)")
        example_inputs = tuple(module.example_batch(built, 2))[:1]
    if cluster is not None and cluster.data is None and not hasattr(module, "example_batch"):
        raise DeclarationError(f"data: required under launcher={launcher!r} when the model's module has no "
                               "example_batch(model, batch_size, seed=): pass data=\"pkg.module:fn\" with "
                               "fn(step, rank, world_size) -> (inputs, targets), the global batch (runtime.run --data)")
    if data is None and cluster is None:  # under a cluster launcher the ranks make their batches (runtime.run)
        if not hasattr(module, "example_batch"):
            raise DeclarationError("data: required (step -> (inputs, targets)) when the model's module has no "
                                   "example_batch(model, batch_size, seed=)")
        data = lambda step: module.example_batch(built, global_batch_size, seed=step)
    from partitioner.tracer.trace import trace

    g = trace(built, tuple(example_inputs), rewrite_attention=compile_kwargs.get("rewrite_attention", True))
    out = _stream(progress)
    cal = Calibration.load(calibration) if isinstance(calibration, (str, Path)) else \
        (calibration or Calibration.for_device(topo.device.name))
    db_path = Path(db)
    cal_path = Path(calibration_out) if calibration_out else db_path.with_suffix(".calibration.json")
    store = TrialStore(db_path)
    compile_kwargs = {"global_batch_size": global_batch_size, **compile_kwargs}
    tuner = _Tuner(g=g, topo=topo, store=store, model_fn=model_fn, data=data, steps=steps, warmup=warmup,
                   timeout_s=timeout_s, optimizer_fn=optimizer_fn, loss_fn=loss_fn or default_loss,
                   compile_kwargs=compile_kwargs, out=out, cluster=cluster)
    try:
        return tuner.run(cal, trials=trials, candidates=candidates, max_rounds=max_rounds, cal_path=cal_path,
                         fit_iterations=fit_iterations)
    finally:
        store.close()


def _spec_data(fn: Callable, world_size: int, step: int) -> Any:
    """runtime.run's --data signature, fn(step, rank, world_size), as the tuner's step -> global batch."""
    return fn(step, 0, world_size)


def _check(**kw: int) -> None:
    for k, v in kw.items():
        least = 0 if k == "warmup" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise DeclarationError(f"{k}={v!r}: must be an int >= {least}")


def _stream(progress: bool | TextIO) -> TextIO | None:
    if progress is True:
        return sys.stderr
    return progress or None


@dataclasses.dataclass
class _Tuner:
    g: OpGraph
    topo: Topology
    store: TrialStore
    model_fn: Callable
    data: Callable[[int], Any]
    steps: int
    warmup: int
    timeout_s: float
    optimizer_fn: Callable | None
    loss_fn: Callable
    compile_kwargs: dict[str, Any]
    out: TextIO | None
    cluster: ClusterTrials | None = None  # None: trials run as local processes (launch_local)
    done: dict[str, Trial] = dataclasses.field(default_factory=dict)  # key -> trial, in the order run

    # -- compiling ------------------------------------------------------------------
    def pins(self, config: ParallelConfig, compression: dict[str, str]) -> dict[str, Any]:
        part = {"recompute_blocks": config.recompute_blocks} if config.recompute_blocks != (1, 1) else {}
        return {**{k: getattr(config, k) for k in _PINS}, **part, "compression": dict(compression)}

    def compile_with(self, pins: dict[str, Any], cal: Calibration, alternatives: int = 0) -> Plan:
        """Compile with `pins` in place of the user's (the other compile arguments stay)."""
        kw = {k: v for k, v in self.compile_kwargs.items() if k not in (*_PINS, "recompute_blocks", "compression")}
        return compile(self.g, self.topo, calibration=cal, alternatives=alternatives, **kw, **pins)

    def compile_pinned(self, config: ParallelConfig, compression: dict[str, str], cal: Calibration,
                       alternatives: int = 0, bounds: Sequence[int] | None = None) -> Plan:
        pins = self.pins(config, compression)
        if bounds is not None:  # the cut that was measured, not the one this calibration would pick
            pins["stage_bounds"] = tuple(bounds)
        return self.compile_with(pins, cal, alternatives)

    def ranked(self, cal: Calibration, k: int) -> list[tuple[ParallelConfig, dict[str, str]]]:
        plan = compile(self.g, self.topo, calibration=cal, alternatives=max(6 * k, 24), **self.compile_kwargs)
        return [(plan.config, dict(plan.compression))] + \
            [(a.config, dict(a.compression)) for a in plan.alternatives if a.fits]

    def key(self, config: ParallelConfig, compression: dict[str, str]) -> str:
        kw = self.compile_kwargs
        return trial_key(graph=self.g.fingerprint(), topology=self.topo.fingerprint(), config=str(config),
                         compression=sorted(compression.items()), batch=kw["global_batch_size"],
                         precision=kw.get("precision"), optimizer=kw.get("optimizer"),
                         memory_fraction=kw.get("max_memory_fraction"), steps=self.steps, warmup=self.warmup)

    # -- the loop --------------------------------------------------------------------
    def run(self, cal: Calibration, *, trials: int, candidates, max_rounds: int, cal_path: Path,
            fit_iterations: int) -> AutotuneResult:
        start = cal  # the prior of every fit: a probe's calibration, or the device's defaults
        first = self.first_round(cal, trials, candidates)
        self.say(f"autotune: {self.g.model_name} on {self.topo}, {len(first)} trials, database {self.store.path}")
        for i, (config, comp) in enumerate(first):
            self.measure(config, comp, cal, index=i + 1, total=len(first), round_=0)
        fit_before = fit_after = fit_loo = None
        fitted: tuple[str, ...] = ()
        rounds = 0
        for rounds in range(1, max_rounds + 1):
            ok = self.ok()
            if len(ok) < 2:
                break
            cal, fit_before, fit_after, fit_loo, fitted = self.fit(start, ok, fit_iterations)
            best = min(ok, key=lambda t: t.measured_step_s)
            new = [(c, comp) for c, comp in self.ranked(cal, 2)[:2] if self.key(c, comp) not in self.done]
            self.say(f"round {rounds}: calibrated (rms log error {fit_before:.3f} -> {fit_after:.3f} in sample, "
                     f"{fit_loo:.3f} leave-one-out; fitted {', '.join(fitted) or 'nothing'}); measured best "
                     f"{best.config} {best.measured_step_s * 1e3:.1f} ms; new leaders to try: {len(new)}")
            if not new:  # the calibrated model's leaders are measured: the measured best stands
                break
            for i, (config, comp) in enumerate(new):
                self.measure(config, comp, cal, index=i + 1, total=len(new), round_=rounds)
        ok = self.ok()
        if len(ok) >= 2 and rounds and any(t.round == rounds for t in ok):
            # include the last round's trials
            cal, fit_before, fit_after, fit_loo, fitted = self.fit(start, ok, fit_iterations)
        if not ok:
            reasons = "; ".join(f"{t.config}: {t.status} ({t.error.splitlines()[0] if t.error else ''})"
                                for t in self.done.values())
            raise AutotuneFailed(f"no trial ran successfully: {reasons}")
        cal_path.parent.mkdir(parents=True, exist_ok=True)
        cal.save(cal_path)
        final = tuple(self.calibrated(t, cal) for t in self.done.values())
        best = min((t for t in final if t.status == "ok"), key=lambda t: t.measured_step_s)
        plan = self.compile_pinned(best.config, best.compression, cal, alternatives=5, bounds=best.stage_bounds)
        self.say(f"best measured: {best.config} {best.measured_step_s * 1e3:.1f} ms/step; calibration saved to "
                 f"{cal_path}")
        return AutotuneResult(plan=plan, trials=final, calibration=cal, calibration_path=cal_path,
                              db_path=self.store.path, rounds=rounds, fit_rms_before=fit_before,
                              fit_rms_after=fit_after, fit_rms_loo=fit_loo, fitted=fitted)

    def first_round(self, cal: Calibration, trials: int, candidates) -> list[tuple[ParallelConfig, dict[str, str]]]:
        if candidates is not None:
            out = []
            for pins in candidates:
                unknown = set(pins) - {*_PINS, "recompute_blocks", "compression"}
                if unknown:
                    raise DeclarationError(f"candidates: unknown pin(s) {sorted(unknown)}; use "
                                           f"{[*_PINS, 'recompute_blocks', 'compression']}")
                p = self.compile_with(pins, cal)
                out.append((p.config, dict(p.compression)))
            return out
        ranked = self.ranked(cal, trials)
        # distinct mesh shapes first, then distinct ZeRO stages, then the rest, each in the cost model's order
        out: list[tuple[ParallelConfig, dict[str, str]]] = []
        for shape in (lambda c: (c.dp, c.tp, c.pp), lambda c: (c.dp, c.tp, c.pp, c.zero_stage), lambda c: c):
            seen = {shape(c) for c, _ in out}
            for c, comp in ranked:
                if len(out) < trials and shape(c) not in seen and (c, comp) not in out:
                    out.append((c, comp))
                    seen.add(shape(c))
        return out

    def ok(self) -> list[Trial]:
        return [t for t in self.done.values() if t.status == "ok"]

    def measure(self, config: ParallelConfig, comp: dict[str, str], cal: Calibration, *, index: int, total: int,
                round_: int) -> Trial:
        key = self.key(config, comp)
        head = f"[{_bar(index, total)}] {index}/{total} {config}" + \
            "".join(f" {lvl}={c}" for lvl, c in comp.items() if c != "none")
        cached = self.store.get(key)
        if cached is not None:
            trial = _trial_from(cached, cached=True)
            self.done[key] = trial
            self.say(f"{head}: {_summary(trial)} (from the database)")
            return trial
        try:
            plan = self.compile_pinned(config, comp, cal)
        except PlanInfeasibleError as e:
            trial = Trial(config=config, compression=comp, status="infeasible", predicted_step_s=math.inf,
                          predicted_peak_bytes=[], error=str(e), round=round_)
            return self.record(key, trial, head)
        predicted = plan.predicted.step_time_s
        peaks = [m.total for m in rank_memory_of(plan)]
        how = f" ({self.cluster.launcher.__class__.__name__.lower()})" if self.cluster else ""
        self.say(f"{head}: predicted {predicted * 1e3:.1f} ms, running {self.warmup} + 1 + {self.steps} steps{how} ...",
                 end="")
        trial = self.launch(plan, config, comp, predicted, peaks, round_, key)
        return self.record(key, trial, head)

    def launch(self, plan: Plan, config, comp, predicted: float, peaks: list[float], round_: int, key: str) -> Trial:
        from runtime.launch.env import LaunchError
        from runtime.launch.local import launch_local
        from runtime.run import default_optimizer

        n = self.warmup + 1 + self.steps
        fraction = self.compile_kwargs.get("max_memory_fraction")  # None: the caching allocator's slack
        limit = plan.predicted.memory_capacity_bytes * fraction if fraction is not None else \
            plan.predicted.memory_capacity_bytes / allocator_slack(plan.config.recompute, plan.config.recompute_blocks)
        base = Trial(config=config, compression=comp, status="ok", predicted_step_s=predicted,
                     predicted_peak_bytes=peaks, round=round_, stage_bounds=list(plan.stage_bounds))
        if self.cluster is not None:
            job = self.cluster.run(plan, key=key, steps=n, probe_step=self.warmup, memory_limit_bytes=limit)
            if job.status != "ok":
                return dataclasses.replace(base, status=job.status, error=job.error)
            return self.measured(base, job.rank_step_times_s, job.peak_step_bytes)
        batches = [self.data(s) for s in range(n)]
        opt = self.optimizer_fn or default_optimizer(plan.optimizer)
        try:
            res = launch_local(plan, self.model_fn, opt, self.loss_fn, batches, timeout_s=self.timeout_s,
                               probe_step=self.warmup, memory_limit_bytes=limit)
        except LaunchError as e:
            return dataclasses.replace(base, status=_failure_kind(str(e)), error=str(e))
        return self.measured(base, res.rank_step_times_s, res.peak_step_bytes)

    def measured(self, base: Trial, rank_step_times_s: list[list[float]], peaks: list[int]) -> Trial:
        """The trial with its measurements: the median over the measured steps of the slowest rank's time (a
        synchronous step ends when its slowest rank does), and each rank's peak in the probed step."""
        times = [max(r[k] for r in rank_step_times_s) for k in range(self.warmup + 1, self.warmup + 1 + self.steps)]
        return dataclasses.replace(base, measured_step_s=statistics.median(times), measured_step_times_s=times,
                                   measured_peak_bytes=list(peaks))

    def record(self, key: str, trial: Trial, head: str) -> Trial:
        self.store.put(key, graph_hash=self.g.fingerprint(), topology_hash=self.topo.fingerprint(),
                       config=str(trial.config), status=trial.status, record=trial.to_dict())
        self.done[key] = trial
        self.say(f"\r{head}: {_summary(trial)}")
        return trial

    def fit(self, cal: Calibration, ok: list[Trial],
            iterations: int) -> tuple[Calibration, float, float, float, tuple[str, ...]]:
        """The calibration refitted to `ok` (regularised toward `cal`, the start: a probe's or the defaults), its
        rms log errors before and after in sample and leave-one-out, and the factors it moved."""
        measured = [t.measured_step_s for t in ok]

        def predict_one(c: Calibration, i: int) -> float:
            t = ok[i]
            return self.compile_pinned(t.config, t.compression, c, bounds=t.stage_bounds).predicted.step_time_s

        result = fit_step_times(lambda c: [predict_one(c, i) for i in range(len(ok))], measured, cal,
                                max_iter=iterations,
                                source=f"autotune {self.topo} {time.strftime('%Y-%m-%d')} ({len(ok)} trials)")
        held_out = leave_one_out(predict_one, measured, cal, max_iter=min(iterations, 15))
        loo = math.sqrt(sum(e * e for e in held_out) / len(held_out))
        # each factor's term by difference: every memory factor scales its bytes linearly
        zero = dataclasses.replace(result.calibration, **dict.fromkeys(MEMORY_FACTORS, 0.0))
        meas, fixed, terms = [], [], {f: [] for f in MEMORY_FACTORS[:-1]}
        for t in ok:  # an ok trial has every rank's peak
            plan = self.compile_pinned(t.config, t.compression, zero, bounds=t.stage_bounds)
            base = [m.total for m in rank_memory_of(plan)]
            meas += t.measured_peak_bytes
            fixed += base
            for f in terms:
                one = rank_memory_of(self.compile_pinned(t.config, t.compression, dataclasses.replace(zero, **{f: 1.0}),
                                                     bounds=t.stage_bounds))
                terms[f] += [m.total - b for m, b in zip(one, base)]
        return fit_memory(meas, fixed, terms, result.calibration), result.rms_log_error_before, \
            result.rms_log_error_after, loo, result.fitted

    def calibrated(self, t: Trial, cal: Calibration) -> Trial:
        if t.status != "ok":
            return t
        plan = self.compile_pinned(t.config, t.compression, cal, bounds=t.stage_bounds)
        return dataclasses.replace(t, calibrated_step_s=plan.predicted.step_time_s,
                                   calibrated_peak_bytes=[m.total for m in rank_memory_of(plan)])

    def say(self, text: str, end: str = "\n") -> None:
        if self.out is not None:
            self.out.write(text + end)
            self.out.flush()


class AutotuneFailed(PartitionerError):
    """No trial of an autotune ran successfully (each trial's reason is in the message)."""


__all__ += ["AutotuneFailed"]


def _failure_kind(message: str) -> str:
    if "OutOfMemoryError" in message or "out of memory" in message.lower() or "out-of-memory" in message:
        return "oom"
    if "no progress within timeout_s" in message:
        return "timeout"
    return "crash"


def _bar(i: int, n: int, width: int = 10) -> str:
    k = round(width * i / n) if n else width
    return "#" * k + "-" * (width - k)


def _summary(t: Trial) -> str:
    if t.status != "ok":
        first = t.error.strip().splitlines()[0] if t.error.strip() else ""
        return f"{t.status.upper()}: {first[:160]}"
    dev = t.predicted_step_s / t.measured_step_s - 1
    peak = max(t.measured_peak_bytes or [0]) / 2**20
    return (f"measured {t.measured_step_s * 1e3:.1f} ms vs predicted {t.predicted_step_s * 1e3:.1f} ms ({dev:+.0%}), "
            f"peak {peak:.1f} MiB vs {max(t.predicted_peak_bytes or [0]) / 2**20:.1f} MiB predicted")


def _trial_from(d: dict[str, Any], *, cached: bool) -> Trial:
    d = dict(d)
    d.pop("step_error", None)
    d.pop("memory_error", None)
    d["config"] = ParallelConfig(**d["config"])
    d["cached"] = cached
    return Trial(**d)
