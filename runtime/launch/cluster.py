"""Run a plan's per-rank programs as one job through torchrun or srun, under a wall-clock limit.

What autotune uses on a cluster (launch_local is the one-machine path): the
plan and its programs sit in a directory every node can read, and one command
starts `python -m runtime.run` on every rank with `--report`, whose per-rank
files (runtime/launch/measure.py) carry back step times, the probed step's peak bytes
and any error.

>>> job = Torchrun(nproc_per_node=2, rdzv_endpoint="127.0.0.1:29400")
>>> run = run_args("t/plan.json", model="examples/gpt.py:gpt_tiny", steps=5, report="t/reports", probe_step=1)
>>> print(shlex.join(job.argv(run, run_id="trial-1")[3:]))   # after `python -m torch.distributed.run`
--nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 --rdzv-id trial-1 -m runtime.run t/plan.json --programs t --model examples/gpt.py:gpt_tiny --steps 5 --timeout-s 300 --report t/reports --probe-step 1
>>> print(shlex.join(Srun(nodes=2, ntasks_per_node=8, python="python").argv(run)))
srun --nodes 2 --ntasks-per-node 8 --kill-on-bad-exit=1 python -m runtime.run t/plan.json --programs t --model examples/gpt.py:gpt_tiny --steps 5 --timeout-s 300 --report t/reports --probe-step 1

torchrun: one agent per node meets the others at `rdzv_endpoint` (c10d
rendezvous); on one node it defaults to 127.0.0.1 and a free port. On several
nodes something must start an agent on each: `wrapper`, e.g.
("srun", "--ntasks-per-node=1"), put before the torchrun command. srun: SLURM
starts every rank and sets the variables runtime.launch.env.discover reads; on
several nodes rank 0 hosts the rendezvous on the first node's address, which
needs PARTITIONER_ALLOW_EXTERNAL_BIND=1 (set in the job's environment here;
srun passes it on). `--kill-on-bad-exit=1` ends the step when any rank fails.

Never hanging: the job runs in a session of its own. `launch_cluster` waits
for it in 0.2 s slices; past `timeout_s` (wall clock, start-up included), or
`grace_s` after a rank reported a failure while the job still runs (ranks
blocked in a collective with the failed one), it stops the job: SIGTERM to
the process group of the launcher and of every process under it (torchrun
starts each worker in a session of its own, so the launcher's group alone
would miss them), then SIGKILL after `grace_s`. The process tree is read from
/proc before signalling, since a worker whose agent died is re-parented.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from runtime.launch.env import (
    ALLOW_EXTERNAL_BIND,
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    LaunchError,
)
from runtime.launch.measure import RankReport, read_reports

__all__ = ["ClusterResult", "Srun", "Torchrun", "launch_cluster", "run_args", "stop_job"]

TrialStatus = Literal["ok", "oom", "crash", "timeout"]
_TAIL = 3000  # characters of the job's stderr kept in an error


@dataclasses.dataclass(frozen=True, kw_only=True)
class Torchrun:
    """`torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT ... -m runtime.run ...`.

    rdzv_endpoint: HOST:PORT of the c10d rendezvous (a node of the job); None: 127.0.0.1 and a free port,
        for one node only.
    wrapper: what starts one agent per node when nnodes > 1 (e.g. ("srun", "--ntasks-per-node=1"), or a
        pdsh/ssh line); the command follows it.
    executable: torchrun itself; default this Python's torch.distributed.run (the same environment).
    extra: more torchrun flags, e.g. ("--max-restarts", "0").
    """

    nproc_per_node: int
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    wrapper: tuple[str, ...] = ()
    executable: tuple[str, ...] = (sys.executable, "-m", "torch.distributed.run")
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_counts(nnodes=self.nnodes, nproc_per_node=self.nproc_per_node)
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise LaunchError(f"torchrun on {self.nnodes} nodes: pass rdzv_endpoint='HOST:PORT' (CLI "
                              "--rdzv-endpoint), a port on one of the job's nodes that every node can reach; "
                              "127.0.0.1 only reaches this machine")
        if self.nnodes > 1 and not self.wrapper:
            raise LaunchError(f"torchrun on {self.nnodes} nodes needs an agent on each node: pass wrapper=, the "
                              "command that starts one per node (e.g. ('srun', '--ntasks-per-node=1'); CLI "
                              "--launcher-wrapper 'srun --ntasks-per-node=1'), or use launcher='srun'")
        if self.rdzv_endpoint is not None:
            _check_endpoint(self.rdzv_endpoint)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def argv(self, run: Sequence[str], *, run_id: str, endpoint: str | None = None) -> list[str]:
        """The command for runtime.run's arguments `run` (see run_args); `endpoint` overrides rdzv_endpoint."""
        ep = endpoint or self.rdzv_endpoint or f"{DEFAULT_MASTER_ADDR}:{DEFAULT_MASTER_PORT}"
        return [*self.wrapper, *self.executable, "--nnodes", str(self.nnodes), "--nproc-per-node",
                str(self.nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", ep, "--rdzv-id", run_id,
                *self.extra, *run]

    def env(self) -> dict[str, str]:
        return {}  # every rank joins the agent's store: nothing of ours listens (runtime.launch.rendezvous)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Srun:
    """`srun --nodes N --ntasks-per-node P --kill-on-bad-exit=1 ... python -m runtime.run ...` (inside an allocation).

    master_port: where rank 0 hosts the rendezvous store (MASTER_PORT; the first node's address on several
        nodes, loopback on one).
    python: the interpreter on the nodes; default this one (a shared file system is assumed).
    extra: more srun flags, e.g. ("--gpus-per-task=1", "--partition=gpu").
    """

    nodes: int
    ntasks_per_node: int
    master_port: int = DEFAULT_MASTER_PORT
    executable: str = "srun"
    python: str = sys.executable
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_counts(nodes=self.nodes, ntasks_per_node=self.ntasks_per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ntasks_per_node

    def argv(self, run: Sequence[str], *, run_id: str = "", endpoint: str | None = None) -> list[str]:
        return [self.executable, "--nodes", str(self.nodes), "--ntasks-per-node", str(self.ntasks_per_node),
                "--kill-on-bad-exit=1", *self.extra, self.python, *run]

    def env(self) -> dict[str, str]:
        env = {"MASTER_PORT": str(self.master_port)}
        if self.nodes > 1:  # rank 0 listens on the first node's address for the other nodes (runtime.launch.env)
            env[ALLOW_EXTERNAL_BIND] = "1"
        return env


def run_args(plan: str | os.PathLike, *, model: str, steps: int, report: str | os.PathLike,
             programs: str | os.PathLike | None = None, probe_step: int | None = None,
             memory_limit_bytes: float | None = None, timeout_s: float = 300, data: str | None = None,
             optimizer: str | None = None, loss: str | None = None) -> list[str]:
    """`-m runtime.run PLAN --programs DIR --model M --steps N ... --report DIR`: what follows torchrun or `python`."""
    out = ["-m", "runtime.run", str(plan), "--programs", str(programs or Path(plan).parent), "--model", model,
           "--steps", str(steps), "--timeout-s", f"{timeout_s:g}", "--report", str(report)]
    if probe_step is not None:
        out += ["--probe-step", str(probe_step)]
    if memory_limit_bytes is not None:
        out += ["--memory-limit-bytes", f"{memory_limit_bytes:.0f}"]
    for flag, spec in (("--data", data), ("--optimizer", optimizer), ("--loss", loss)):
        if spec is not None:
            out += [flag, spec]
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterResult:
    """What a job measured, or why it failed.

    status: "ok", "oom", "crash" or "timeout". error: why, naming the rank (empty when ok).
    rank_step_times_s / losses: per rank, per step (from the reports; a failed job has what its ranks reported).
    peak_step_bytes: per rank, the probed step's peak (None without a probe or when a rank did not report it).
    argv: the command run; log_dir: its stdout.log and stderr.log.
    """

    status: TrialStatus
    error: str
    rank_step_times_s: list[list[float]]
    losses: list[list[float]]
    peak_step_bytes: list[int] | None
    returncode: int | None
    wall_s: float
    argv: list[str]
    log_dir: Path


def launch_cluster(launcher: Torchrun | Srun, run: Sequence[str], *, report_dir: str | os.PathLike,
                   log_dir: str | os.PathLike, timeout_s: float, run_id: str, cwd: str | os.PathLike | None = None,
                   env: Mapping[str, str] | None = None, grace_s: float = 5.0) -> ClusterResult:
    """Run `launcher.argv(run)` to its end, or stop it (see the module docstring); never raises for a failed job.

    report_dir: runtime.run's --report directory in `run` (cleared first). Raises LaunchError only when the
    command cannot be started at all (say, srun not installed), naming it.
    """
    reports, logs = Path(report_dir), Path(log_dir)
    reports.mkdir(parents=True, exist_ok=True)
    for old in reports.glob("rank_*.json*"):
        old.unlink()
    logs.mkdir(parents=True, exist_ok=True)
    endpoint = None
    if isinstance(launcher, Torchrun) and launcher.rdzv_endpoint is None:
        endpoint = f"{DEFAULT_MASTER_ADDR}:{_free_port()}"  # one node: a port of its own per trial
    argv = launcher.argv(run, run_id=run_id, endpoint=endpoint)
    full_env = {**os.environ, **launcher.env(), **(env or {})}
    world = launcher.world_size
    t0 = time.monotonic()
    with open(logs / "stdout.log", "wb") as out, open(logs / "stderr.log", "wb") as err:
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
        except OSError as exc:
            raise LaunchError(f"cannot start {argv[0]!r} ({exc.strerror or exc}): is it installed on this machine "
                              f"and on PATH? The command was: {shlex.join(argv)}") from None
        try:
            why = _wait(proc, reports, world, timeout_s, grace_s, t0)
        except BaseException:  # Ctrl-C in the tuner: the job is in a session of its own, it would outlive us
            stop_job(proc, grace_s=grace_s)
            raise
        end = None
        if why is not None:
            end = os.fstat(err.fileno()).st_size  # what it wrote before it was stopped, not its noise on SIGTERM
            stop_job(proc, grace_s=grace_s)
    wall = time.monotonic() - t0
    got = read_reports(reports, world)
    stderr = _tail(logs / "stderr.log", end)
    status, error = _outcome(why, proc.returncode, got, world, stderr, timeout_s, argv, logs)
    times = [got[r].step_times_s if r in got else [] for r in range(world)]
    losses = [got[r].losses if r in got else [] for r in range(world)]
    peaks = [got[r].peak_step_bytes if r in got else None for r in range(world)]
    return ClusterResult(status=status, error=error, rank_step_times_s=times, losses=losses,
                         peak_step_bytes=None if None in peaks else peaks, returncode=proc.returncode,
                         wall_s=wall, argv=argv, log_dir=logs)


# ---- waiting and stopping ------------------------------------------------------------------


def _wait(proc: subprocess.Popen, reports: Path, world: int, timeout_s: float, grace_s: float,
          t0: float) -> str | None:
    """None when the job ended by itself; "timeout" or "failed" when it has to be stopped."""
    failed_at, next_read = None, 0.0
    while True:
        try:
            proc.wait(0.2)
            return None
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now - t0 > timeout_s:
            return "timeout"
        if failed_at is None and now >= next_read:  # a rank failed: the others may block on it in a collective
            next_read = now + 1.0
            if any(r.status not in ("running", "ok") for r in read_reports(reports, world).values()):
                failed_at = now
        if failed_at is not None and now - failed_at > grace_s:
            return "failed"


def stop_job(proc: subprocess.Popen, *, grace_s: float = 5.0) -> None:
    """SIGTERM the process groups of `proc` and of every process under it, then SIGKILL what is left."""
    tree = [(proc.pid, _start_time(proc.pid)), *_descendants(proc.pid)]
    _signal_groups(tree, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p, t) for p, t in tree):
        time.sleep(0.1)
        proc.poll()  # reap the launcher as soon as it exits
    tree += [d for d in _descendants(proc.pid) if d not in tree]  # started during the grace period
    _signal_groups(tree, signal.SIGKILL)
    for pid, start in tree:
        if _alive(pid, start):
            _kill(os.kill, pid, signal.SIGKILL)
    proc.wait()


def _signal_groups(tree: list[tuple[int, str | None]], sig: signal.Signals) -> None:
    ours = os.getpgrp()
    groups = set()
    for pid, start in tree:
        if _alive(pid, start):
            try:
                groups.add(os.getpgid(pid))
            except OSError:
                continue
    for g in groups - {ours}:  # never our own group
        _kill(os.killpg, g, sig)


def _kill(kill, target: int, sig: signal.Signals) -> None:
    """os.kill or os.killpg, where the target may have gone in the meantime."""
    try:
        kill(target, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants(root: int) -> list[tuple[int, str | None]]:
    """(pid, start time) of every process under `root`, from /proc (Linux; empty elsewhere)."""
    parent = {}
    try:
        entries = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for name in entries:
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parent[int(name)] = (int(fields[1]), fields[19])  # ppid, start time (clock ticks since boot)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in parent.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append((pid, parent[pid][1]))
        todo += children.get(pid, [])
    return out


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    """Whether `pid` is still the process we saw (same start time) and not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        if start is not None:
            return False  # gone (we could read /proc before)
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False
    return fields[0] != "Z" and (start is None or fields[19] == start)


# ---- the outcome ---------------------------------------------------------------------------


def _outcome(why: str | None, code: int | None, reports: dict[int, RankReport], world: int, stderr: str,
             timeout_s: float, argv: list[str], logs: Path) -> tuple[TrialStatus, str]:
    where = f"\ncommand: {shlex.join(argv)}\nlogs: {logs}/stdout.log, {logs}/stderr.log"
    failed = [r for r in reports.values() if r.status not in ("running", "ok")]
    if failed:
        # the first rank that failed by itself; "peer_lost" ranks only follow a failure elsewhere
        root = min(failed, key=lambda r: (r.status == "peer_lost", r.time, r.rank))
        status: TrialStatus = "oom" if root.status == "oom" else "crash"
        msg = f"rank {root.rank} raised {root.error_type}: {root.error} ({root.where})"
        others = [f"rank {r.rank}: {r.error_type}: {(r.error.splitlines() or [''])[0]}"
                  for r in failed if r is not root]
        if others:
            msg += "\nother ranks failed too: " + "; ".join(others)
        if why is not None:  # the other ranks kept waiting on the failed one
            msg += "\nthe job did not end by itself after that: stopped" + (" at timeout_s" if why == "timeout" else "")
        return status, msg + f"\n\nrank {root.rank}'s traceback:\n{root.traceback}{where}"
    if why == "timeout":
        places = "; ".join(f"rank {r} {reports[r].where}" if r in reports else f"rank {r} never reported"
                           for r in range(world))
        return "timeout", (f"no result within timeout_s={timeout_s:g} s (wall clock): {places}. A collective that "
                           "not every rank reaches (a deadlock in the programs), a rank that cannot start, or a job "
                           "slower than timeout_s; the job and every process under it were stopped. Raise timeout_s "
                           f"if the work is just slow{where}\nstderr (last lines):\n{stderr}")
    missing = [r for r in range(world) if r not in reports or reports[r].status != "ok"]
    if code == 0 and not missing:
        return "ok", ""
    oom = "OutOfMemoryError" in stderr or "out of memory" in stderr.lower()
    if code == 0:
        return "crash", (f"the job exited with code 0, but ranks {missing} reported no result (is runtime.run's "
                         f"--report reaching a directory every node shares?){where}")
    return ("oom" if oom else "crash"), (f"{Path(argv[0]).name} exited with code {code} and no rank reported an "
                                         f"error (it failed before runtime.run started, or a rank was killed: see "
                                         f"its stderr){where}\nstderr (last lines):\n{stderr}")


def _tail(path: Path, end: int | None = None) -> str:
    """The last _TAIL characters of `path` (up to byte `end`)."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END) if end is None else end
            f.seek(max(0, end - _TAIL))
            return f.read(end - f.tell()).decode(errors="replace")
    except OSError:
        return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((DEFAULT_MASTER_ADDR, 0))
        return s.getsockname()[1]


def _check_counts(**counts: int) -> None:
    for name, v in counts.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise LaunchError(f"{name}={v!r}: must be a whole number >= 1")


def _check_endpoint(endpoint: str) -> None:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"rdzv_endpoint={endpoint!r}: expected HOST:PORT, e.g. 'node01:29400'")
