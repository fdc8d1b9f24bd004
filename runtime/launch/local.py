"""Run a plan's per-rank programs as local processes over Gloo: the path tests and autotune use.

>>> import torch
>>> from partitioner import compile
>>> from examples.mlp import mlp, example_inputs
>>> from examples.training import sgd
>>> mse = torch.nn.functional.mse_loss
>>> model = mlp()
>>> plan = compile(model, "local:2", example_inputs(model), global_batch_size=8, precision="fp32", dp=2,
...                zero_stage=0, compression="none")
>>> g = torch.Generator().manual_seed(0)
>>> batches = [(torch.randn(8, 784, generator=g), torch.randn(8, 10, generator=g)) for _ in range(2)]
>>> result = launch_local(plan, mlp, sgd, mse, batches, timeout_s=60)
>>> [round(loss, 3) for loss in result.losses], result.collective_counts[0]
([1.186, 0.921], {'broadcast': 1, 'all_reduce': 4})

Everything that can be checked is checked before a process starts: the world
size, that the callables can be sent to spawned workers, that the model has
the plan's parameters (built on the meta device, nothing allocated), that each
program compiles.

Failure detection (the parent never just joins): each worker records in
shared memory the time and phase of its last progress (started, built, each
step, state gathered). The parent waits on the workers' process sentinels in
0.1 s slices and after each wake-up checks (1) which workers exited without a
result file: a Python exception (the worker writes type, message and
traceback to `error_{rank}.json`, then `os._exit(1)`s without running c10d
teardown) or a death by signal; the first such rank is reported, a signal
death first since exceptions on other ranks ("connection closed") follow from
it; (2) whether any unfinished worker has made no progress for `timeout_s`
plus a few seconds (a deadlock that c10d's own timeout did not end). Either
way the other workers are killed at once (SIGTERM, then SIGKILL), so ranks
blocked in a collective with a dead peer never keep the parent waiting. Temp
files (store, programs, batches, results) go with the temp directory in every
case; workers also exit if the parent process disappears. A worker that
succeeded writes `result_{rank}.pt` atomically, passes a barrier (so no rank
leaves while a peer is still in its last collective) and exits at once.
Rendezvous is a FileStore in the temp directory: no port is opened for it.

Workers are forked from a multiprocessing fork server that has imported torch
and the runtime once (where the platform has one; spawn elsewhere): a spawned
worker spends ~2 s of CPU importing torch, which on a few shared cores is most
of a short run. Nothing of the launching process is inherited but what spawn
sends (the callables by reference, sys.path, the working directory) and its
environment at launch time, set in each worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from cost_models.errors import PartitionerError
from runtime.checkpoint import load_checkpoint, save_checkpoint
from runtime.device import check_device, keep_freed_host_memory, set_rank_device
from runtime.device.audit import audit_requested, device_audit
from runtime.engines.lr_schedule import attach_lr_schedule, resume_lr_schedule
from runtime.engines.optimizer_groups import check_optimizer, differing_groups, slices_parameters
from runtime.launch.env import LaunchError, choose_device
from runtime.launch.evaluation import check_eval_batches, check_eval_mode, evaluate_batches
from runtime.launch.loss_check import check_loss_reduction
from runtime.launch.measure import measure_step, state_bytes, write_atomic
from runtime.launch.program_check import check_same_program
from runtime.pipeline.program_module import exec_program

__all__ = ["LaunchResult", "launch_local", "check_world_size", "check_local_device", "check_sendable", "check_model",
           "fork_context", "preload", "stop_processes"]

_GRACE_S = 5.0  # on top of timeout_s before a silent rank is declared hung
_PH_SPAWNED, _PH_START, _PH_BUILD, _PH_STEP0 = -1, 0, 1, 2  # phases; _PH_STEP0 + k: k steps done


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchResult:
    """What a local run measured.

    losses, step_times_s: per step, from rank 0 (every rank returns the same loss).
    state_dict: the full trained parameters under the model's names (rank 0's full_state_dict()).
    peak_memory_bytes: per rank, the most bytes of parameters, gradients and optimizer state the
        runner held (held_bytes()'s params + grads + optimizer) after build and after any step: what the plan's memory
        prediction (params + grads + optimizer) is checked against.
    collective_counts: per rank, the runner's `collectives.counts` after all steps.
    collective_seconds: per rank, the runner's `collectives.seconds` after all steps (blocking all-to-alls).
    held_bytes: per rank, the runner's held_bytes() after the last step.
    peak_rss_bytes: per rank, the process's peak resident memory (ru_maxrss; includes torch itself).
    rank_step_times_s: per rank, per step.
    start_step: the step this launch began at (resume_from: the checkpoint's step; else 0); losses[i] is step
        start_step + i + 1's.
    checkpoints: the checkpoint directories this launch wrote (save_dir), oldest first.
    eval_losses: (steps done, mean evaluation loss over eval_batches) after each evaluation, from rank 0.
    peak_step_bytes: per rank, with `probe_step`: the most bytes of tensor storages live during that step
        (runtime.launch.memory_probe: held state plus everything the step allocated); None without.
    """

    losses: list[float]
    state_dict: dict[str, torch.Tensor]
    step_times_s: list[float]
    peak_memory_bytes: list[int]
    collective_counts: list[dict[str, int]]
    held_bytes: list[dict[str, int]]
    peak_rss_bytes: list[int]
    rank_step_times_s: list[list[float]] = dataclasses.field(default_factory=list)
    peak_step_bytes: list[int] | None = None
    start_step: int = 0
    checkpoints: list[str] = dataclasses.field(default_factory=list)
    collective_seconds: list[dict[str, float]] = dataclasses.field(default_factory=list)
    eval_losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)


def _check_optimizer(plan: Any, optimizer_fn: Callable, *, checkpoints: bool) -> None:
    """An optimizer that cannot step this plan's pieces of parameters is refused here, before any rank starts
    (each rank's build() checks again: runtime.engines.optimizer_groups), and so is a checkpointed run whose
    optimizer would step runs of ZeRO shards (what runtime.checkpoint refuses at its first save)."""
    c = getattr(plan, "config", None)
    if c is None:
        return
    placements = getattr(plan, "placements", ())
    check_optimizer(optimizer_fn, zero_stage=c.zero_stage,
                    sliced=slices_parameters(c.tp, c.ep, [p.spec for p in placements]))
    if checkpoints and c.zero_stage > 0 and differing_groups(optimizer_fn, {p.param: p.shape for p in placements}):
        raise LaunchError(
            "optimizer_fn gives its parameter groups different hyperparameters, so under ZeRO its optimizer steps "
            "each group's runs of the flat shards (runtime.engines.optimizer_groups), and checkpoints keep "
            "optimizer state per shard: save_dir and resume_from are not supported with it yet. Use one set of "
            "hyperparameters for every parameter, or zero_stage=0, to checkpoint")


def launch_local(plan: Any, model_fn: Callable, optimizer_fn: Callable, loss_fn: Callable,
                 batches: Sequence[Any], *, timeout_s: float = 120, world_size: int | None = None,
                 programs: Mapping[int, str] | None = None, probe_step: int | None = None,
                 memory_limit_bytes: float | None = None, save_dir: str | os.PathLike | None = None,
                 save_every: int | None = None, keep_last: int | None = None,
                 resume_from: str | os.PathLike | None = None, verify: bool = True, device: str = "cpu",
                 device_audit: bool | None = None, scheduler_fn: Callable | None = None,
                 eval_batches: Sequence[Any] | None = None, eval_every: int | None = None) -> LaunchResult:
    """Spawn one process per rank, run each rank's program on `batches` (global batches), gather the results.

    plan: the Plan (or anything with world_size, placements and program(rank)).
    programs: rank -> program source, instead of `plan.program(rank).source`.
    timeout_s: c10d's collective timeout, and how long any rank may go without progress.
    probe_step: run step `probe_step` (0-based) under runtime.launch.memory_probe.PeakMemory and report each rank's
        peak in `peak_step_bytes` (the probe slows that step: leave it out of timings).
    memory_limit_bytes: in the probed step, a rank going past this many bytes raises torch.OutOfMemoryError,
        as a device of that capacity would.
    save_dir, save_every, keep_last: write a sharded checkpoint (runtime.checkpoint) into save_dir after every
        `save_every` steps (counted from step 0, so a resumed run saves at the same steps), keeping the newest
        `keep_last` (all by default).
    resume_from: a checkpoint (or a save_dir: its newest) written under any plan of this model: parameters and
        optimizer state are loaded into this plan's shards, and training continues at the checkpoint's step:
        `batches[k]` is always the batch of step k, so the run takes batches[step:].
    verify: before spawning, run the programs' model code in this process on the first microbatch of
        batches[0] and compare with model_fn()'s module (runtime.verify.check; raises VerifyError naming where they
        differ). On a first start, and on a resume from a checkpoint another plan wrote (not one these programs
        wrote: they were verified when that run started), for pipeline / tensor-parallel plans of at most
        runtime.verify.check.MAX_VERIFY_ELEMENTS parameter elements; verify=False skips it.
    device: "cpu" (Gloo, the default) or "cuda" (rank r on cuda:r, NCCL; one GPU per rank): where each rank
        builds its share of the model, moves its batches and keeps its state (runtime.device).
    device_audit: run every rank under runtime.device.audit (fail on any op mixing the rank's device with a
        tensor never placed there, naming the op and the line); None: as PARTITIONER_DEVICE_AUDIT says.
    scheduler_fn: scheduler_fn(optimizer) -> a torch LRScheduler, built on each rank's optimizer and stepped after
        each optimizer step, as a one-process loop steps it (runtime.engines.lr_schedule); on a resume, replayed
        to the checkpoint's step.
    eval_batches, eval_every: after every `eval_every` steps (counted from step 0, as save_every) and after the last,
        the mean of runner.evaluate over `eval_batches` (global batches: the loss as one process computes it in
        eval mode, nothing trained; runtime.engines.evaluation), in `eval_losses`; without eval_every, after the
        last step only.
    Raises LaunchError for a bad setup or any failed rank (naming it, with its traceback).
    """
    world = plan.world_size if world_size is None else world_size
    check_world_size(plan, world)
    check_local_device(device, world)
    audit = audit_requested() if device_audit is None else bool(device_audit)
    for name, fn in (("model_fn", model_fn), ("optimizer_fn", optimizer_fn), ("loss_fn", loss_fn)):
        check_sendable(name, fn)
    if scheduler_fn is not None:
        check_sendable("scheduler_fn", scheduler_fn)
    check_model(plan, model_fn)
    _check_optimizer(plan, optimizer_fn, checkpoints=save_dir is not None or resume_from is not None)
    sources = _sources(plan, world, programs)
    batches = list(batches)
    if probe_step is not None and not 0 <= probe_step < len(batches):
        raise LaunchError(f"probe_step={probe_step}: must index one of the {len(batches)} batches")
    if save_every is not None and (isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1):
        raise LaunchError(f"save_every={save_every!r}: must be a positive number of steps")
    if (save_every is None) != (save_dir is None):
        raise LaunchError("save_dir and save_every go together: pass both to write checkpoints, or neither")
    eval_batches = check_eval_batches(plan, eval_batches, eval_every)
    start = 0
    if resume_from is not None:
        from runtime.checkpoint.manifest import check_checkpoint_model, verify_checkpoint

        manifest = verify_checkpoint(resume_from)  # a missing, corrupted or foreign checkpoint: refused before spawning
        if getattr(plan, "placements", None) is not None:
            check_checkpoint_model(manifest, {p.param: p.shape for p in plan.placements}, manifest["path"],
                                   graph_hash=getattr(plan, "graph_hash", ""))
        start = manifest["step"]
        if start > len(batches):
            raise LaunchError(f"resume_from={str(resume_from)!r} is at step {start}, but only {len(batches)} batches "
                              "were given: batches[k] is the batch of step k, pass the whole run's batches")
    if verify and batches and not (resume_from is not None and _written_by(manifest, sources)):
        _verify(plan, model_fn, loss_fn, batches[0], sources)
    if verify and batches:
        check_loss_reduction(plan, model_fn, loss_fn, batches[0])  # a sum refused, a token mean warned
    if verify and eval_batches:
        check_eval_mode(plan, model_fn, eval_batches[0])  # eval mode the traced code cannot run: refused here
    plan_json = plan.to_json() if hasattr(plan, "to_json") else None

    tmp = Path(tempfile.mkdtemp(prefix="runtime-launch-"))
    procs: list[Any] = []
    ok = False
    try:
        torch.save(batches, tmp / "batches.pt")
        torch.save(eval_batches, tmp / "eval_batches.pt")
        for r, src in sources.items():
            (tmp / f"rank_{r}.py").write_text(src)
        ctx = fork_context(model_fn)
        progress = ctx.Array("d", [time.time()] * world, lock=False)  # time of each rank's last progress
        phase = ctx.Array("i", [_PH_SPAWNED] * world, lock=False)
        job = _Job(world_size=world, dir=str(tmp), timeout_s=timeout_s, parent_pid=os.getpid(),
                   environ=dict(os.environ),
                   model_fn=model_fn, optimizer_fn=optimizer_fn, loss_fn=loss_fn, probe_step=probe_step,
                   memory_limit_bytes=memory_limit_bytes, save_dir=None if save_dir is None else str(save_dir),
                   save_every=save_every, keep_last=keep_last,
                   resume_from=None if resume_from is None else str(resume_from), plan_json=plan_json,
                   device=device, device_audit=audit, scheduler_fn=scheduler_fn, eval_every=eval_every)
        for r in range(world):
            p = ctx.Process(target=_worker, args=(job, r, progress, phase), name=f"runtime-rank{r}")
            p.start()
            procs.append(p)
        _watch(procs, tmp, progress, phase, timeout_s, len(batches) - start)
        results = [torch.load(tmp / f"result_{r}.pt", weights_only=True) for r in range(world)]
        ok = True
    finally:
        stop_processes(procs, grace_s=5.0 if ok else 0.0)
        shutil.rmtree(tmp, ignore_errors=True)
    return _collect(results)


# ---- checks before anything starts ------------------------------------------------------


def check_world_size(plan: Any, world_size: int) -> None:
    if world_size != plan.world_size:
        raise LaunchError(f"plan is for {plan.world_size} ranks, launched on {world_size}: the plan's mesh fixes "
                          f"the number of processes; launch {plan.world_size} processes or recompile the plan "
                          f"for a topology of {world_size} devices")


def check_local_device(device: str, world_size: int) -> None:
    """launch_local's device: cpu, or cuda with a GPU for every rank (rank r on cuda:r)."""
    if device not in ("cpu", "cuda"):
        raise LaunchError(f"device={device!r}: launch_local runs every rank on cpu (Gloo) or on cuda (rank r on "
                          "cuda:r, NCCL); pass one of those")
    if device == "cuda":
        try:
            check_device(f"cuda:{world_size - 1}")
        except PartitionerError as exc:
            raise LaunchError(f"launch_local(device='cuda') with {world_size} ranks needs {world_size} GPUs: "
                              f"{exc}") from None


def check_sendable(name: str, fn: Any) -> None:
    """`fn` must reach spawned workers by reference: a module-level function or class (or a partial of one)."""
    if not callable(fn):
        raise LaunchError(f"{name} must be callable; got {type(fn).__name__} {fn!r}")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise LaunchError(f"{name}={fn!r} cannot be sent to the worker processes ({type(exc).__name__}: {exc}): "
                          "lambdas and local functions cannot be sent to worker processes; define it at module "
                          "level (a functools.partial of a module-level function also works)") from None
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise LaunchError(f"{name}={fn!r} is defined in an interactive session (__main__ has no file), which "
                          "spawned workers cannot import; define it in a module file and import it")


def check_model(plan: Any, model_fn: Callable) -> None:
    """The model from `model_fn()` (built on the meta device) must have exactly the plan's parameters."""
    placements = getattr(plan, "placements", None)
    if placements is None:
        return
    try:
        with torch.device("meta"):
            model = model_fn()
    except Exception as exc:
        raise LaunchError(f"model_fn() failed under torch.device('meta'), where it is built to check it against "
                          f"the plan without allocating memory: {type(exc).__name__}: {exc}; let model_fn build on "
                          "the current device (no .to()/.cuda(), no reading tensor values while constructing)") from exc
    if not isinstance(model, torch.nn.Module):
        raise LaunchError(f"model_fn() returned {type(model).__name__}, not a torch.nn.Module")
    planned = {p.param: getattr(p, "shape", None) for p in placements}
    params = dict(model.named_parameters(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for n, t in params.items():
        aliases.setdefault(id(t), []).append(n)
    missing = [n for n in planned if n not in params]
    unplanned = [names[0] for names in aliases.values() if not any(n in planned for n in names)]
    shapes = [f"{n} model {tuple(params[n].shape)} vs plan {tuple(s)}" for n, s in planned.items()
              if s is not None and n in params and tuple(params[n].shape) != tuple(s)]
    if missing or unplanned or shapes:
        parts = [f"{what}: {_few(items)}" for what, items in (
            ("the plan's parameters missing from the model", missing),
            ("the model's parameters not in the plan", unplanned),
            ("shapes that differ", shapes)) if items]
        raise LaunchError(f"the model from model_fn ({type(model).__name__}) does not match the plan: "
                          f"{'; '.join(parts)}. The plan was compiled for another model: recompile it for this "
                          "model, or pass the model_fn it was compiled for")


def _few(items: list[str], k: int = 4) -> str:
    more = f" (and {len(items) - k} more)" if len(items) > k else ""
    return ", ".join(items[:k]) + more


def _verify(plan: Any, model_fn: Callable, loss_fn: Callable, batch: Any, sources: Mapping[int, str]) -> None:
    """The programs' model code against the module, here, before any process starts (runtime.verify.check)."""
    from runtime.verify.check import first_microbatch, verify_plan, verify_skip_reason

    if verify_skip_reason(plan):
        return
    inputs, targets = first_microbatch(plan, batch)
    try:
        verify_plan(plan, model_fn, inputs, loss_fn, targets=targets, sources=sources)
    except PartitionerError:
        raise
    except Exception as e:  # the user's model or loss failed on the first microbatch: as a rank's failure would
        raise LaunchError(f"the model or loss raised {type(e).__name__}: {e} while plan.verify ran the first "
                          "microbatch (in this process, before any rank started); fix the model, or pass "
                          "verify=False to find it in the ranks instead") from e


def _written_by(manifest: Mapping[str, Any], sources: Mapping[int, str]) -> bool:
    """The checkpoint was saved by these very programs, so they were verified when that run started; a
    resume under another plan (a restart on fewer ranks) runs new programs and verifies them."""
    from runtime.verify.check import program_hash

    return bool(manifest.get("plan_hash")) and {program_hash(s) for s in sources.values()} == {manifest["plan_hash"]}


def _sources(plan: Any, world: int, programs: Mapping[int, str] | None) -> dict[int, str]:
    if programs is not None:
        missing, extra = sorted(set(range(world)) - set(programs)), sorted(set(programs) - set(range(world)))
        if missing or extra:
            raise LaunchError(f"programs must map each rank 0..{world - 1} to a source; missing {missing}, "
                              f"unexpected {extra}")
        sources = {r: programs[r] for r in range(world)}
    else:
        sources = {r: plan.program(r).source for r in range(world)}
    for r, src in sources.items():
        try:
            compile(src, f"rank_{r}.py", "exec")
        except SyntaxError as exc:
            raise LaunchError(f"the program for rank {r} does not compile: {exc.msg} at line {exc.lineno}: "
                              f"{(exc.text or '').strip()!r}") from None
    return sources


# ---- the worker -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Job:
    world_size: int
    dir: str
    timeout_s: float
    parent_pid: int
    model_fn: Callable
    optimizer_fn: Callable
    loss_fn: Callable
    probe_step: int | None = None
    memory_limit_bytes: float | None = None
    save_dir: str | None = None
    save_every: int | None = None
    keep_last: int | None = None
    resume_from: str | None = None
    plan_json: str | None = None
    device: str = "cpu"
    device_audit: bool = False
    scheduler_fn: Callable | None = None
    eval_every: int | None = None
    environ: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _worker(job: _Job, rank: int, progress: Any, phase: Any) -> None:
    import torch.distributed as dist

    def mark(ph: int) -> None:
        phase[rank], progress[rank] = ph, time.time()

    mark(_PH_START)
    os.environ.clear()  # the launcher's environment now, not the fork server's at its start
    os.environ.update(job.environ)
    _exit_with_parent(job.parent_pid)
    d = Path(job.dir)
    audit = contextlib.ExitStack()  # the device audit, when asked for: from build to the last state gathered
    try:
        torch.set_num_threads(1)  # a few ranks share a few cores
        timeout = timedelta(seconds=job.timeout_s)
        # A FileStore in the temp dir: no port to find or to expose.
        store = dist.FileStore(str(d / "store"), job.world_size)
        store.set_timeout(timeout)
        name, dev = choose_device(job.device, local_rank=rank)  # one machine: the local rank is the rank
        set_rank_device(dev)
        if dev.type == "cpu":
            keep_freed_host_memory()
        dist.init_process_group(name, rank=rank, world_size=job.world_size, store=store, timeout=timeout)
        if job.device_audit:
            audit.enter_context(device_audit())
        mark(_PH_START)
        path = d / f"rank_{rank}.py"
        ns = exec_program(path.read_text(), str(path), rank=rank, __file__=str(path))  # tracebacks show its lines
        if not callable(ns.get("build")):
            raise LaunchError(f"the program for rank {rank} defines no build(model_fn, optimizer_fn, loss_fn)")
        check_same_program(str(ns.get("PROGRAM_HASH", "")))
        mark(_PH_BUILD)
        # Every rank builds the model: an unseeded factory would give each its own random init, and
        # tensor-parallel ranks (which slice their own copy) would train different models.
        torch.manual_seed(0)
        runner = ns["build"](job.model_fn, job.optimizer_fn, job.loss_fn)
        attach_lr_schedule(runner, job.scheduler_fn)  # before a checkpoint's load: on the optimizer as built
        start = 0
        if job.resume_from is not None:
            start = load_checkpoint(runner, job.resume_from, plan_json=job.plan_json).step
            resume_lr_schedule(runner, start)
        peak = state_bytes(runner.held_bytes())
        batches = torch.load(d / "batches.pt", weights_only=True)[start:]
        eval_batches = torch.load(d / "eval_batches.pt", weights_only=True)
        losses, times, probed, saved, evals = [], [], None, [], []
        for k, batch in enumerate(batches):
            mark(_PH_STEP0 + k)
            m = measure_step(runner, batch, probe=k == job.probe_step, limit_bytes=job.memory_limit_bytes)
            if m.peak_bytes is not None:
                probed = m.peak_bytes
            times.append(m.seconds)
            losses.append(float(m.loss))
            peak = max(peak, state_bytes(runner.held_bytes()))
            done = start + k + 1
            if job.save_every is not None and done % job.save_every == 0:
                saved.append(str(save_checkpoint(runner, job.save_dir, step=done, plan_json=job.plan_json,
                                                 extra={"data_position": done}, keep_last=job.keep_last)))
            if eval_batches and ((job.eval_every and done % job.eval_every == 0) or k == len(batches) - 1):
                evals.append((done, evaluate_batches(runner, eval_batches)))
        mark(_PH_STEP0 + len(batches))
        state = runner.full_state_dict()
        audit.close()
        result = {"losses": losses, "step_times_s": times, "state_dict": state,
                  "held_bytes": {k: int(v) for k, v in runner.held_bytes().items()},
                  "counts": {k: int(v) for k, v in runner.collectives.counts.items()},
                  "seconds": {k: float(v) for k, v in getattr(runner.collectives, "seconds", {}).items()},
                  "peak_memory_bytes": int(peak), "peak_rss_bytes": _peak_rss(), "peak_step_bytes": probed,
                  "start_step": start, "checkpoints": saved, "eval_losses": evals}
        write_atomic(d / f"result_{rank}.pt", lambda f: torch.save(result, f))
        mark(_PH_STEP0 + len(batches) + 1)
    except BaseException as exc:  # report, then leave without c10d teardown (peers may be blocked)
        err = {"type": type(exc).__qualname__, "message": str(exc), "traceback": traceback.format_exc(),
               "time": time.time()}
        write_atomic(d / f"error_{rank}.json", lambda f: f.write(json.dumps(err).encode()))
        _exit(1)
    try:  # leave only once every rank is past its last collective: an early exit could cut a peer's gather
        dist.barrier()
    finally:
        _exit(0)  # the result is written; c10d and interpreter teardown would only add seconds


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_parent(parent_pid: int) -> None:
    """Leave if the launching process dies, rather than linger blocked in a collective (the launcher is not
    the parent of a worker forked by the fork server: its pid is polled)."""

    def watch() -> None:
        while _alive(parent_pid):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# What the fork server imports once; a worker imports the rest (the program's engines, the model's module).
_PRELOAD = ["torch", "torch.distributed", "runtime.launch.local", "runtime.engines.step", "runtime.comm.collectives"]
_preloaded: list[str] = []  # preload()'s, then the first launch's model module


def preload(*modules: str) -> None:
    """Have every rank launch_local starts in this process begin with `modules` imported: the fork server that
    starts the ranks imports them once. A rank otherwise imports what it unpickles itself, and a Hugging Face
    modeling module takes each rank seconds. launch_local adds the module model_fn is defined in; name here the
    modules of models later launches build (a session launching several model families, a test suite). The
    server starts at the first launch and keeps its modules: call this before it. A module that fails to
    import is left to the ranks, which report its error."""
    _preloaded.extend(m for m in modules if m not in _preloaded)


def fork_context(model_fn: Any = None) -> Any:
    """The multiprocessing context launch_local starts ranks with: the fork server, which imports torch, the
    runtime and preload()'s modules once (and model_fn's module, at its start), or "spawn" where there is none.
    Code starting processes of its own beside the launches (a test's workers) shares the server through it."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    module = getattr(model_fn, "__module__", None) or getattr(getattr(model_fn, "func", None), "__module__", None)
    if module and module != "__main__":  # __main__ is not importable by name: the server runs its file anyway
        preload(module)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD + _preloaded)  # read when the server first starts; it serves every launch
    return ctx


def _peak_rss() -> int:
    import resource

    kb_or_b = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb_or_b if sys.platform == "darwin" else kb_or_b * 1024)


# ---- the parent: watching, stopping, collecting ------------------------------------------


def _watch(procs: list[Any], tmp: Path, progress: Any, phase: Any, timeout_s: float, n_steps: int) -> None:
    n = len(procs)
    while True:
        exits = [p.exitcode for p in procs]  # before the result check: a result is written before exit
        done = [(tmp / f"result_{r}.pt").exists() for r in range(n)]
        if all(done):
            return
        dead = [r for r in range(n) if exits[r] is not None and not done[r]]
        if dead:
            stop_processes(procs, grace_s=0.0)
            raise _failure(dead, exits, tmp, phase, progress, n_steps)
        now = time.time()
        silent = [r for r in range(n) if not done[r] and now - progress[r] > timeout_s + _GRACE_S]
        if silent:
            stop_processes(procs, grace_s=0.0)
            where = "; ".join(f"rank {r} {_phase(phase[r], n_steps)}, silent {now - progress[r]:.0f} s"
                              for r in silent)
            raise LaunchError(f"no progress within timeout_s={timeout_s:g} s (+{_GRACE_S:g} s): {where}. A "
                              "collective that not every rank reaches (a deadlock in the programs), or a phase "
                              "slower than timeout_s; all ranks were killed. Raise timeout_s if the work is "
                              "just slow")
        multiprocessing.connection.wait([p.sentinel for p, d in zip(procs, done) if not d], timeout=0.1)


def _failure(dead: list[int], exits: list[int | None], tmp: Path, phase: Any, progress: Any,
             n_steps: int) -> LaunchError:
    errors = {}
    for r in range(len(exits)):
        f = tmp / f"error_{r}.json"
        if f.exists():
            errors[r] = json.loads(f.read_text())
    # A death by signal first (exceptions elsewhere follow from it), then the earliest exception.
    root = min(dead, key=lambda r: (not (exits[r] or 0) < 0, errors.get(r, {}).get("time", math.inf), r))
    code = exits[root]
    where = _phase(phase[root], n_steps)
    if root in errors:
        e = errors[root]
        msg = f"rank {root} raised {e['type']}: {e['message']} ({where})\n\nrank {root}'s traceback:\n{e['traceback']}"
    elif code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        msg = (f"rank {root} died from {name} (exit code {code}) {where}, without a Python exception"
               f"{_SIGNAL_HINTS.get(name, '')}")
    elif phase[root] == _PH_SPAWNED:
        msg = (f"rank {root} exited with code {code} before its worker ran: the new process could not start or "
               "unpickle its arguments (its traceback is on stderr). Common causes: a script that launches without "
               "an `if __name__ == \"__main__\":` guard, or model_fn/optimizer_fn/loss_fn in a module a fresh "
               "process cannot import")
    else:
        msg = (f"rank {root} exited with code {code} {where} without a result or an exception: something in its "
               "program called sys.exit() or os._exit()")
    others = [f"rank {r}: {errors[r]['type']}: {errors[r]['message'].splitlines()[0] if errors[r]['message'] else ''}"
              for r in sorted(errors) if r != root]
    if others:
        msg += "\nother ranks failed too, likely as a consequence: " + "; ".join(others)
    now = time.time()
    running = [f"rank {r} {_phase(phase[r], n_steps)} (last progress {now - progress[r]:.1f} s ago)"
               for r in range(len(exits)) if exits[r] is None and r not in errors]
    if running:
        msg += "\nstill running, then killed: " + "; ".join(running)
    return LaunchError(msg)


_SIGNAL_HINTS = {
    "SIGKILL": ": killed from outside (the out-of-memory killer: see `dmesg`; or a kill -9)",
    "SIGABRT": ": an abort in native code (Gloo aborts when a receive gets a message of another size: a "
               "send/recv mismatch, see docs/torch-notes.md; or a failed internal check)",
    "SIGSEGV": ": a crash in native code",
}


def _phase(ph: int, n_steps: int) -> str:
    if ph == _PH_SPAWNED:
        return "while starting the process"
    if ph == _PH_START:
        return "while starting (import, rendezvous, program load)"
    if ph == _PH_BUILD:
        return "in build()"
    k = ph - _PH_STEP0
    if k < n_steps:
        return f"in step {k + 1} of {n_steps}"
    return "in full_state_dict()/held_bytes()" if k == n_steps else "after finishing"


def stop_processes(procs: list[Any], *, grace_s: float) -> None:
    """Join workers for up to grace_s, then SIGTERM, then SIGKILL what is left."""
    deadline = time.time() + grace_s
    for p in procs:
        if p.exitcode is None and grace_s > 0:
            p.join(max(0.0, deadline - time.time()))
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.exitcode is None:
            p.kill()
            p.join()


def _check_agree(what: str, call: str, r: int, a: float, b: float) -> None:
    """Rank 0's loss `a` and rank r's `b` of one step or evaluation: equal, as the program contract says."""
    if not math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7) and not (math.isnan(a) and math.isnan(b)):
        raise LaunchError(f"{what}: rank 0 returned loss {a!r}, rank {r} {b!r}; the program contract is that "
                          f"{call}() returns the global mean loss on every rank: reduce it first")


def _collect(results: list[dict[str, Any]]) -> LaunchResult:
    losses = results[0]["losses"]
    for r, res in enumerate(results[1:], 1):
        for k, (a, b) in enumerate(zip(losses, res["losses"])):
            _check_agree(f"step {k + 1}", "step", r, a, b)
        for (k, a), (_, b) in zip(results[0].get("eval_losses", []), res.get("eval_losses", [])):
            _check_agree(f"evaluation after step {k}", "evaluate", r, a, b)
    if results[0]["state_dict"] is None:
        raise LaunchError("rank 0's full_state_dict() returned None; the program contract is that it returns the "
                          "full parameters on rank 0")
    return LaunchResult(losses=losses, state_dict=results[0]["state_dict"],
                        step_times_s=results[0]["step_times_s"],
                        peak_memory_bytes=[res["peak_memory_bytes"] for res in results],
                        collective_counts=[res["counts"] for res in results],
                        held_bytes=[res["held_bytes"] for res in results],
                        peak_rss_bytes=[res["peak_rss_bytes"] for res in results],
                        rank_step_times_s=[res["step_times_s"] for res in results],
                        peak_step_bytes=None if results[0]["peak_step_bytes"] is None else
                        [res["peak_step_bytes"] for res in results],
                        start_step=results[0]["start_step"], checkpoints=results[0]["checkpoints"],
                        collective_seconds=[res.get("seconds", {}) for res in results],
                        eval_losses=[(int(k), float(v)) for k, v in results[0].get("eval_losses", [])])
