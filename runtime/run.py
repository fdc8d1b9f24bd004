"""Train with a compiled plan under torchrun, mpirun or srun: one process per rank.

    partitioner compile examples/gpt.py:gpt_tiny --topology local:2 --programs out/   # out/plan.json, out/rank_*.py
    torchrun --nproc-per-node 2 -m runtime.run out/plan.json --model examples/gpt.py:gpt_tiny --steps 10
    mpirun -np 8 -x MASTER_ADDR -x PARTITIONER_ALLOW_EXTERNAL_BIND=1 python -m runtime.run out/plan.json --model pkg.models:gpt --data pkg.data:batch
    PARTITIONER_ALLOW_EXTERNAL_BIND=1 srun --ntasks 16 python -m runtime.run out/plan.json --model pkg.models:gpt --data pkg.data:batch

Each rank finds its place with `runtime.launch.env.discover()`, runs `rank_{r}.py`
from the plan's directory (or --programs), and trains `--steps` steps on the
global batches `--data` returns: `fn(step, rank, world_size) -> (inputs,
targets)`, the same global batch on every rank (the program slices its own).
Without --data, batches come from the model module's
`example_batch(model, global_batch_size, seed=step)` on a CPU copy of the
model (for small models). Rank 0 prints `step 1/10 loss 2.302585 (0.215 s)`.

Checkpoints: `--save-dir D --save-every K` writes a sharded checkpoint
(runtime.checkpoint) into D after every K-th step; `--resume-from C` loads C
(a checkpoint or a save directory's newest, written under any plan of the
model) and continues at its step; `--resume-from auto` does so when D holds a
checkpoint and starts fresh otherwise: the line to give torchrun
`--max-restarts`, so that a restarted job continues from its last checkpoint.

Evaluation: `--eval-every N` evaluates after every N-th step and after the last, on `--eval-batches K`
held-out global batches from `--eval-data fn` (fn(k, rank, world_size) -> the k-th; without --data, the
example batches at seeds 1000000 + k): the mean loss, as one process computes it in eval mode, nothing
trained (runtime.engines.evaluation). Rank 0 prints `eval after step 10: loss 2.290311 over 4 batch(es)`.

Measuring (what autotune's cluster launcher runs): `--probe-step K` runs
step K (0-based) under the memory probe, `--memory-limit-bytes B` makes that
step raise torch.OutOfMemoryError past B bytes (as launch_local does), and
`--report DIR` has each rank keep DIR/rank_R.json up to date with its step
times, losses, the probed step's peak and the error it stopped with
(runtime/launch/measure.py). `--trace PATH` writes a Chrome/Perfetto trace of one step
(`--trace-step K`, default the last): when each action of every rank's instruction list ran
(runtime.pipeline.action_trace), to set beside the plan's simulated step
(`partitioner.show.timeline.compare_measured(plan, PATH)`).

Verification: on a first start (and on a resume from a checkpoint that other
programs wrote, as after an elastic restart under a new plan), rank 0 runs replica 0's
programs' model code against the module in its own process before step 1
(runtime.verify.check: no process group, tensor slices as threads) and stops with
the place they differ; the other ranks wait for it. Skipped for models over
2e8 parameter elements and with --no-verify. Then, where the plan splits the
batch, rank 0 tells how --loss reduces over the rows of step 1's batch
(runtime.launch.loss_check): a sum stops the run, a mean over what rows hold
unequally (padded tokens) is warned, with the fix.

Faults: each rank bumps a counter in the job's store every second from a
background thread. When a collective fails (a peer died: Gloo reports a
closed connection), the rank looks at the counters: the ranks whose counter
stopped are named in the error (`rank 2 stopped: no heartbeat for 3 s`), and
the process exits with status 3 instead of hanging until the timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from runtime.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from runtime.device import keep_freed_host_memory, placing_on, set_rank_device
from runtime.device.audit import audit_requested, device_audit
from runtime.engines.lr_schedule import attach_lr_schedule, resume_lr_schedule
from runtime.launch.env import DistEnv, LaunchError, choose_device, discover
from runtime.launch.evaluation import EVAL_SEED, check_eval_mode, eval_mode_check_applies, evaluate_batches
from runtime.launch.heartbeat import Heartbeat, PeerLost
from runtime.launch.loading import load_callable, load_object
from runtime.launch.measure import RankReporter, measure_step
from runtime.launch.program_check import check_same_program
from runtime.launch.rendezvous import rendezvous_store
from runtime.pipeline.action_trace import chrome_trace, recording
from runtime.pipeline.program_module import exec_program
from runtime.verify.check import VerifyError

__all__ = ["main", "load_callable", "default_loss", "default_optimizer"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    env = discover()
    report = None
    if args.report:
        report = RankReporter(args.report, rank=env.rank, world_size=env.world_size, steps=args.steps,
                              probe_step=args.probe_step)
    try:
        return _train(args, env, report)
    except BaseException as exc:
        if report is not None:
            report.fail(_failure_status(exc), exc)
        raise


def _failure_status(exc: BaseException) -> str:
    """The report's status for the exception a rank stops with."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom"
    return "peer_lost" if isinstance(exc, PeerLost) else "crash"


def _train(args: argparse.Namespace, env: DistEnv, report: RankReporter | None) -> int:
    name, device = choose_device(args.device, env.local_rank)  # a device this process cannot use: stop here
    _check_probe(args)
    plan = _read_plan(Path(args.plan))
    if env.world_size != plan["world_size"]:
        raise LaunchError(f"plan {args.plan} is for {plan['world_size']} ranks, but this job has "
                          f"{env.world_size} ({env.launcher}): launch {plan['world_size']} processes "
                          f"(e.g. torchrun --nproc-per-node {plan['world_size']}), or recompile the plan for "
                          f"{env.world_size} devices")
    program = Path(args.programs or Path(args.plan).parent) / f"rank_{env.rank}.py"
    if not program.is_file():
        raise LaunchError(f"no program for rank {env.rank}: {program} does not exist. Write the programs next to "
                          "the plan with plan.write_programs(DIR) or `partitioner compile ... --programs DIR`, "
                          "or point --programs at their directory")
    model_fn = load_callable(args.model, "--model")
    optimizer_fn = load_callable(args.optimizer, "--optimizer") if args.optimizer else \
        default_optimizer(plan.get("optimizer", "adam"))
    loss_fn = load_callable(args.loss, "--loss") if args.loss else default_loss
    scheduler_fn = load_callable(args.scheduler, "--scheduler") if args.scheduler else None
    data_fn = load_callable(args.data, "--data") if args.data else \
        _example_data(args.model, plan.get("global_batch_size"))
    eval_fn = held_out_data(args, args.model, plan.get("global_batch_size"))

    import torch.distributed as dist

    if args.save_every is not None and args.save_every < 1:
        raise LaunchError(f"--save-every {args.save_every}: must be a positive number of steps")
    if (args.save_every is None) != (args.save_dir is None):
        raise LaunchError("--save-dir and --save-every go together: pass both to write checkpoints, or neither")
    if args.resume_from == "auto" and not args.save_dir:
        raise LaunchError("--resume-from auto resumes from --save-dir's newest checkpoint: pass --save-dir too")
    resume = _resume_path(args)
    plan_text = Path(args.plan).read_text()

    set_rank_device(device)
    if device.type == "cpu":
        keep_freed_host_memory()
    _init(env, timedelta(seconds=args.timeout_s), name)
    heartbeat = Heartbeat(env)
    finished = False
    audit = contextlib.ExitStack()  # the device audit, when asked for: over build, steps and saving
    try:
        if not args.no_verify and not _written_by(resume, program):
            with placing_on("cpu"):  # plan.verify compares with the module in this process, on the host
                _verify_first_start(plan, program.parent, env, model_fn, loss_fn, data_fn, heartbeat)
                _check_first_loss(plan, env, model_fn, loss_fn, data_fn, heartbeat)
                if eval_fn is not None:
                    _check_eval_mode(plan, env, model_fn, eval_fn, heartbeat)
        if args.device_audit or audit_requested():
            audit.enter_context(device_audit())
        ns = exec_program(program.read_text(), str(program), rank=env.rank, __file__=str(program))
        if not callable(ns.get("build")):
            raise LaunchError(f"{program} defines no build(model_fn, optimizer_fn, loss_fn): it is not a rank program")
        check_same_program(str(ns.get("PROGRAM_HASH", "")))
        # Every rank builds the model: an unseeded factory would give each its own random init, and
        # tensor-parallel ranks (which slice their own copy) would train different models.
        torch.manual_seed(0)
        runner = ns["build"](model_fn, optimizer_fn, loss_fn)
        attach_lr_schedule(runner, scheduler_fn)  # before a checkpoint's load: on the optimizer as built
        start = 0
        if resume is not None:
            info = load_checkpoint(runner, resume, plan_json=plan_text)
            start = info.step
            resume_lr_schedule(runner, start)
            if env.rank == 0:
                how = "same plan" if info.same_plan else f"resharded from {info.world_size} ranks to {env.world_size}"
                print(f"resumed from {info.path} at step {start} ({how})", flush=True)
        for step in range(start, args.steps):
            batch = data_fn(step, env.rank, env.world_size)
            if report is not None:
                report.begin(step)
            traced = args.trace is not None and step == _trace_step(args)
            schedule = getattr(runner, "lr_schedule", None)  # a hand-written program's runner may have none
            lr = f", lr {schedule.last_lr()[0]:.6g}" if schedule is not None else ""  # the rate of this step
            with heartbeat.naming_dead_ranks(f"step {step + 1}"):
                with _tracing(traced) as log:
                    m = measure_step(runner, batch, probe=step == args.probe_step, limit_bytes=args.memory_limit_bytes)
                if traced:
                    _write_trace(args, plan, env, log, step, m.seconds)
            if report is not None:
                report.step(m)
            if env.rank == 0:
                print(f"step {step + 1}/{args.steps} loss {float(m.loss):.6f} ({m.seconds:.3f} s){lr}", flush=True)
            if args.save_every and (step + 1) % args.save_every == 0:
                with heartbeat.naming_dead_ranks(f"saving the checkpoint of step {step + 1}"):
                    path = save_checkpoint(runner, args.save_dir, step=step + 1, plan_json=plan_text,
                                           extra={"data_position": step + 1}, keep_last=args.keep_last)
                if env.rank == 0:
                    print(f"saved checkpoint {path}", flush=True)
            if eval_fn is not None and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
                t0 = time.perf_counter()
                with heartbeat.naming_dead_ranks(f"the evaluation after step {step + 1}"):
                    loss = evaluate_batches(runner, [eval_fn(k, env.rank, env.world_size)
                                                     for k in range(args.eval_batches)])
                if env.rank == 0:
                    print(f"eval after step {step + 1}: loss {loss:.6f} over {args.eval_batches} batch(es) "
                          f"({time.perf_counter() - t0:.3f} s)", flush=True)
        if args.save:
            state = runner.full_state_dict()
            if env.rank == 0:
                torch.save(state, args.save)
                print(f"saved the trained parameters to {args.save}", flush=True)
        # No rank may tear Gloo down while a peer is still in its last collective (or rank 0 still
        # saving), and even after this barrier, whichever rank destroys its group and exits first
        # breaks the others' connections mid-teardown: their processes abort ("terminate called
        # without an active exception"), failing a job that trained correctly. So after the barrier
        # the entry point leaves without c10d teardown (os._exit below), as launch_local's workers do.
        audit.close()
        dist.barrier()
        finished = True
        if report is not None:
            report.finish()
    except BaseException as exc:  # recorded before the teardown below, which may wait on a dead peer
        if report is not None:
            report.fail(_failure_status(exc), exc)
        raise
    finally:
        audit.close()
        heartbeat.close()
        if not finished and not heartbeat.lost:  # with a peer lost, teardown could wait on it
            dist.destroy_process_group()
    return 0


def _trace_step(args: argparse.Namespace) -> int:
    return args.steps - 1 if args.trace_step is None else args.trace_step


@contextlib.contextmanager
def _tracing(on: bool):
    """The step's actions logged (runtime.pipeline.action_trace), from a common origin: every rank reads its
    clock right after a barrier, so the ranks' logs line up to the barrier's skew."""
    if not on:
        yield None
        return
    import torch.distributed as dist

    dist.barrier()
    origin = time.perf_counter()
    with recording() as entries:
        yield (origin, entries)


def _write_trace(args: argparse.Namespace, plan: dict[str, Any], env: DistEnv, log, step: int, seconds: float) -> None:
    """Gather every rank's log of the traced step to rank 0, which writes --trace as a Chrome trace."""
    import torch.distributed as dist

    logs: list = [None] * env.world_size
    dist.all_gather_object(logs, log)
    if env.rank != 0:
        return
    per_pipeline_rank = env.world_size // int(plan.get("config", {}).get("pp", 1) or 1)
    trace = chrome_trace(logs, pipeline_rank=lambda r: r // per_pipeline_rank,
                         other={"step": step, "step_time_us": seconds * 1e6, "config": plan.get("config"),
                                "model": plan.get("model_name"), "topology": plan.get("topology_name")})
    Path(args.trace).write_text(json.dumps(trace))
    print(f"wrote the measured trace of step {step + 1} to {args.trace}", flush=True)


def _verify_first_start(plan: dict[str, Any], programs: Path, env: DistEnv, model_fn: Callable, loss_fn: Callable,
                        data_fn: Callable, heartbeat: Heartbeat) -> None:
    """Rank 0 runs replica 0's programs' model code against the module in its own process (runtime.verify.check) on
    the first microbatch of step 1's batch, before anything trains; the other ranks wait for it. A mismatch
    stops rank 0 with VerifyError, and the others with PeerLost naming it."""
    import torch.distributed as dist

    from runtime.verify.check import first_microbatch, verify_plan, verify_skip_reason

    why = verify_skip_reason(plan)  # the same on every rank: all skip the barrier, or none
    if why:
        if env.rank == 0 and not why.startswith("pp = tp = 1"):
            print(f"not verifying the programs: {why}", flush=True)
        return
    if env.rank == 0:
        files = {m["rank"]: programs / f"rank_{m['rank']}.py" for m in plan["mesh"] if m["dp"] == 0}
        missing = [str(f) for f in files.values() if not f.is_file()]
        if missing:
            raise LaunchError(f"cannot verify the programs: {', '.join(missing)} missing (rank 0 reads replica 0's "
                              "programs); put every rank's program in --programs, or pass --no-verify")
        inputs, targets = first_microbatch(plan, data_fn(0, env.rank, env.world_size))
        report = verify_plan(plan, model_fn, inputs, loss_fn, targets=targets,
                             sources={r: f.read_text() for r, f in files.items()})
        print(report, flush=True)
    with heartbeat.naming_dead_ranks("waiting for rank 0 to verify the programs"):
        dist.barrier()


def _check_first_loss(plan: dict[str, Any], env: DistEnv, model_fn: Callable, loss_fn: Callable, data_fn: Callable,
                      heartbeat: Heartbeat) -> None:
    """Rank 0 tells how loss_fn reduces over the rows of step 1's batch (runtime.launch.loss_check) while the
    others wait: a summed loss stops it with LaunchError (and the others with PeerLost naming it), a loss that is
    not a mean over rows is warned. Where the check applies, every rank knows it from the plan and the loss."""
    import torch.distributed as dist

    from runtime.launch.loss_check import check_loss_reduction, loss_check_applies

    if not loss_check_applies(plan, loss_fn):
        return
    if env.rank == 0:
        check_loss_reduction(plan, model_fn, loss_fn, data_fn(0, env.rank, env.world_size))
    with heartbeat.naming_dead_ranks("waiting for rank 0 to check the loss"):
        dist.barrier()


def _check_eval_mode(plan: dict[str, Any], env: DistEnv, model_fn: Callable, eval_fn: Callable,
                     heartbeat: Heartbeat) -> None:
    """Rank 0 checks that the module's eval mode is what an evaluation of the traced code computes
    (runtime.launch.evaluation.check_eval_mode) while the others wait; every rank knows from the plan whether
    the check applies."""
    import torch.distributed as dist

    if not eval_mode_check_applies(plan):
        return
    if env.rank == 0:
        check_eval_mode(plan, model_fn, eval_fn(0, env.rank, env.world_size))
    with heartbeat.naming_dead_ranks("waiting for rank 0 to check the model's eval mode"):
        dist.barrier()


def _written_by(resume: Path | None, program: Path) -> bool:
    """Resuming from a checkpoint these very programs wrote: they were verified when that run first started.
    A restart under another plan (partitioner.elastic on fewer ranks) runs new programs and verifies them."""
    from runtime.checkpoint import read_manifest
    from runtime.verify.check import program_hash

    if resume is None:
        return False
    saved = read_manifest(resume).get("plan_hash", "")
    return bool(saved) and saved == program_hash(program.read_text())


def _check_probe(args: argparse.Namespace) -> None:
    if args.probe_step is not None and not 0 <= args.probe_step < args.steps:
        raise LaunchError(f"--probe-step {args.probe_step}: must be one of the steps 0..{args.steps - 1} "
                          f"(0-based) of this run's --steps {args.steps}")
    if args.memory_limit_bytes is not None and args.probe_step is None:
        raise LaunchError("--memory-limit-bytes applies to the probed step: pass --probe-step K too")
    if args.trace_step is not None and args.trace is None:
        raise LaunchError("--trace-step names the step --trace records: pass --trace PATH too")
    if args.trace is not None and not 0 <= _trace_step(args) < args.steps:
        raise LaunchError(f"--trace-step {args.trace_step}: must be one of the steps 0..{args.steps - 1} "
                          f"(0-based) of this run's --steps {args.steps}")


def _resume_path(args: argparse.Namespace) -> Path | None:
    if args.resume_from is None:
        return None
    if args.resume_from == "auto":
        found = latest_checkpoint(args.save_dir)
        return None if found is None else Path(verify_checkpoint(found)["path"])
    return Path(verify_checkpoint(args.resume_from)["path"])  # refuses a missing or corrupted one before starting


def default_optimizer(name: str) -> Callable:
    """The optimizer the plan was costed for, with a default learning rate: params -> Optimizer."""
    table = {"adam": (torch.optim.Adam, 1e-3), "adamw": (torch.optim.AdamW, 1e-3), "sgd": (torch.optim.SGD, 1e-2)}
    if name.lower() not in table:
        raise LaunchError(f"the plan's optimizer {name!r} has no default here ({', '.join(table)}): "
                          "pass --optimizer pkg.module:factory")
    cls, lr = table[name.lower()]
    return functools.partial(cls, lr=lr)


def default_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for integer targets (logits (..., C), targets (...)), mean squared error otherwise.

    A tuple output uses its first element (the example GPT returns (logits, loss)), an output with
    `.logits` those (Hugging Face models).
    """
    if isinstance(output, (tuple, list)):
        output = output[0]
    output = getattr(output, "logits", output)
    if not target.is_floating_point():
        return F.cross_entropy(output.flatten(0, -2), target.flatten())
    return F.mse_loss(output, target)


def held_out_data(args: argparse.Namespace, model_spec: str, batch_size: int | None) -> Callable | None:
    """fn(k, rank, world_size) -> the k-th held-out batch, with --eval-every (runtime.run's and `partitioner
    run`'s flags); None without."""
    if args.eval_every is None:
        if args.eval_data:
            raise LaunchError("--eval-data without --eval-every: pass --eval-every N to evaluate after every N-th step")
        return None
    if args.eval_every < 1 or args.eval_batches < 1:
        raise LaunchError(f"--eval-every {args.eval_every} --eval-batches {args.eval_batches}: both must be positive")
    if args.eval_data:
        return load_callable(args.eval_data, "--eval-data")
    if args.data:
        raise LaunchError("--eval-every with --data: pass --eval-data pkg.module:fn too, with fn(k, rank, world_size) "
                          "-> the k-th held-out batch (evaluating on training batches measures nothing held out)")
    try:
        data = _example_data(model_spec, batch_size)
    except LaunchError:
        raise LaunchError(f"--eval-every needs held-out batches, and {model_spec.rsplit(':', 1)[0]} has no "
                          "example_batch(model, batch_size) to make them: pass --eval-data pkg.module:fn with "
                          "fn(k, rank, world_size) -> the k-th held-out global batch") from None
    return lambda k, rank, world_size: data(EVAL_SEED + k, rank, world_size)


def _example_data(model_spec: str, batch_size: int | None) -> Callable:
    where = model_spec.rsplit(":", 1)[0]
    factory = load_callable(model_spec, "--model")
    module, _, _ = load_object(model_spec, "--model")
    if not hasattr(module, "example_batch") or not batch_size:
        raise LaunchError(f"no --data and the model's module {where} has no example_batch(model, batch_size): "
                          "pass --data pkg.module:fn with fn(step, rank, world_size) -> (inputs, targets)")
    model = None

    def data(step: int, rank: int, world_size: int):
        nonlocal model
        if model is None:
            with torch.device("cpu"):
                model = factory()
        return module.example_batch(model, batch_size, seed=step)

    return data


def _init(env: DistEnv, timeout: timedelta, name: str) -> None:
    import torch.distributed as dist

    # not init_method="tcp://...": rank 0's store would listen on every interface (runtime.launch.rendezvous);
    # under torchrun every rank joins the agent's store, as tcp:// did (TORCHELASTIC_USE_AGENT_STORE)
    dist.init_process_group(name, store=rendezvous_store(env, timeout), rank=env.rank, world_size=env.world_size,
                            timeout=timeout)


def _read_plan(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise LaunchError(f"plan file {path} does not exist")
    try:
        plan = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LaunchError(f"plan file {path} is not JSON ({exc}): pass the file plan.save() wrote") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("world_size"), int):
        raise LaunchError(f"plan file {path} has no integer world_size: pass the file plan.save() wrote")
    return plan


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.run", description=__doc__.split("\n")[0])
    p.add_argument("plan", help="the plan JSON (rank_{r}.py programs beside it)")
    p.add_argument("--model", required=True, help="pkg.module:factory or path/file.py:factory")
    p.add_argument("--optimizer", help="factory(params) -> Optimizer (default: the plan's optimizer)")
    p.add_argument("--loss", help="fn(output, target) -> loss (default: cross-entropy or MSE)")
    p.add_argument("--scheduler", help="factory(optimizer) -> a torch LRScheduler, stepped after each optimizer step "
                                       "(default: none, a constant learning rate)")
    p.add_argument("--data", help="fn(step, rank, world_size) -> (inputs, targets), the global batch")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--eval-every", type=int, metavar="N",
                   help="evaluate after every N-th step and after the last: the mean loss over --eval-batches held-out "
                        "batches, as one process computes it in eval mode (no dropout, nothing trained)")
    p.add_argument("--eval-batches", type=int, default=1, metavar="K", help="batches per evaluation (default 1)")
    p.add_argument("--eval-data", help="fn(k, rank, world_size) -> (inputs, targets), the k-th held-out global batch "
                                       "(default: the model module's example_batch at seeds 1000000 + k)")
    p.add_argument("--programs", help="directory of rank_{r}.py (default: the plan's directory)")
    p.add_argument("--save", help="write the trained parameters (rank 0) to this file")
    p.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    p.add_argument("--device", help="cpu (Gloo), cuda (cuda:LOCAL_RANK, NCCL) or cuda:N; default: cuda where "
                                    "CUDA is, else cpu. A device this machine lacks stops the job at start-up")
    p.add_argument("--device-audit", action="store_true",
                   help="fail on any op that mixes the rank's device with a tensor never put there, naming the op "
                        "and the line (runtime.device.audit; also PARTITIONER_DEVICE_AUDIT=1): for tests, slow"),
    p.add_argument("--save-dir", help="write sharded checkpoints here (with --save-every)")
    p.add_argument("--save-every", type=int, help="checkpoint after every N-th step")
    p.add_argument("--keep-last", type=int, help="keep only the newest N checkpoints")
    p.add_argument("--resume-from", help="a checkpoint (or save dir) to continue from; 'auto': --save-dir's newest, "
                                         "if any (for torchrun --max-restarts)")
    p.add_argument("--probe-step", type=int, metavar="K",
                   help="run step K (0-based) under runtime.launch.memory_probe and report its peak bytes (--report)")
    p.add_argument("--memory-limit-bytes", type=float, metavar="B",
                   help="in the probed step, raise torch.OutOfMemoryError past B bytes, as a device of B bytes would")
    p.add_argument("--no-verify", action="store_true",
                   help="skip checking the programs' model code against the module on rank 0 before step 1 "
                        "(runtime.verify.check; done by default on a first start, for models up to 2e8 parameters)")
    p.add_argument("--trace", metavar="PATH",
                   help="write a Chrome/Perfetto trace of one step's actions on every rank (rank 0 writes it; "
                        "compare it with the plan's: partitioner.show.timeline.compare_measured)")
    p.add_argument("--trace-step", type=int, metavar="K", help="the step --trace records, 0-based (default: the last)")
    p.add_argument("--report", metavar="DIR",
                   help="each rank keeps DIR/rank_R.json up to date: status, step times, losses, the probed "
                        "step's peak bytes, the error it stopped with (runtime/launch/measure.py)")
    return p


if __name__ == "__main__":
    try:
        code = main()
    except PeerLost as exc:
        print(f"runtime.run: error: {exc}", file=sys.stderr, flush=True)
        os._exit(3)  # peers are gone: c10d teardown would block on them
    except (LaunchError, VerifyError) as exc:
        print(f"runtime.run: error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # every rank passed the final barrier; skip the c10d teardown race (see main)
