"""autotune through a cluster launcher: real torchrun jobs of `python -m runtime.run`, one per trial.

- torchrun on 127.0.0.1 (c10d rendezvous, 2 ranks): a trial measures step
  times and per-rank peaks, the same peak bytes launch_local measures for
  that plan; a candidate that runs out of memory and one that crashes in a
  rank are recorded with their reason, and the tuner goes on.
- A trial whose ranks hang is stopped at its wall-clock timeout, recorded as
  "timeout", and no process of it is left.
- srun is not installed here (no SLURM on this machine), so its command line
  is checked as composed, not run; starting it fails with a clear error.
- The CLI: `partitioner autotune --launcher torchrun` through a subprocess,
  with its exit codes.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_autotune import _small_memory_local2

from cost_models.errors import DeclarationError
from cost_models.topology import Topology
from examples import gpt
from partitioner import autotune
from partitioner.tune.autotune import AutotuneFailed
from partitioner.tune.cluster import cluster_launcher
from partitioner.tune.db import TrialStore
from runtime.launch.cluster import Srun, Torchrun, launch_cluster, run_args
from runtime.launch.env import LaunchError
from runtime.launch.local import launch_local
from runtime.run import default_loss, default_optimizer

REPO = Path(__file__).resolve().parent.parent

# Imported by the ranks by file name (a cluster launcher takes specs, not callables).
MODELS = f'''
import os, sys, time
from pathlib import Path
import torch
sys.path.insert(0, {str(REPO)!r})
sys.path.insert(0, {str(REPO / 'tests')!r})
from examples import gpt
from test_autotune import _Fragile as Fragile  # the local tuner's failing candidate


class Hanging(gpt.GPT):
    """gpt_tiny whose first step never ends in the ranks (not while the tuner traces it, nor in the launcher's
    look at the loss before step 1, which runs the model in eval mode: runtime.launch.loss_check)."""

    def forward(self, idx, targets=None):
        if "TORCHELASTIC_RUN_ID" in os.environ and self.training:  # set by torchrun for its workers
            (Path(os.environ["HANG_PID_DIR"]) / f"{{os.getpid()}}.pid").write_text("")
            time.sleep(600)
        return super().forward(idx, targets)


def fragile_tiny():
    torch.manual_seed(0)
    return Fragile(gpt.CONFIGS["gpt_tiny"])


def hanging_tiny():
    torch.manual_seed(0)
    return Hanging(gpt.CONFIGS["gpt_tiny"])


def example_batch(model, batch_size, seq_len=None, seed=0):
    return gpt.example_batch(model, batch_size, seq_len, seed)
'''


@pytest.fixture
def models(tmp_path) -> Path:
    path = tmp_path / "cluster_models.py"
    path.write_text(MODELS)
    return path


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting to be reaped by whoever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _running_with(text: str) -> list[str]:
    """Command lines of live processes that mention `text`."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and not _gone(int(p.name)):
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{p.name}: {cmd}")
    return found


# ---- real torchrun jobs ---------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_trials_measure_like_local_and_failures_are_recorded(tmp_path, models):
    cands = [{"dp": 2, "microbatch_size": 4}, {"dp": 2, "microbatch_size": 2}, {"dp": 2, "microbatch_size": 1}]
    res = autotune(f"{models}:fragile_tiny", _small_memory_local2(), launcher="torchrun",
                   example_inputs=(torch.zeros(4, 128, dtype=torch.long),), global_batch_size=8,
                   candidates=cands, steps=2, warmup=1, db=tmp_path / "tune.sqlite", precision="fp32",
                   max_rounds=1, progress=False, timeout_s=90,
                   rewrite_attention=False)  # the module's own forward runs, where its failures live
    trial = {t.config.microbatch_size: t for t in res.trials}
    ok = trial[4]
    assert ok.status == "ok", ok.error
    assert len(ok.measured_step_times_s) == 2 and all(t > 0 for t in ok.measured_step_times_s)
    assert ok.measured_step_s == pytest.approx(statistics.median(ok.measured_step_times_s))
    assert len(ok.measured_peak_bytes) == 2 and min(ok.measured_peak_bytes) > 10 * 2**20
    assert trial[2].status == "oom" and "OutOfMemoryError" in trial[2].error and "rank " in trial[2].error
    assert trial[1].status == "crash" and "deliberate crash at microbatch 1" in trial[1].error
    assert res.best is ok and res.plan.config.microbatch_size == 4
    assert sorted(r["status"] for r in TrialStore(tmp_path / "tune.sqlite").rows()) == ["crash", "ok", "oom"]
    # the reports the ranks wrote, kept in the trial directory with the job's logs
    reports = sorted((tmp_path / "tune.trials").glob("*/reports/rank_*.json"))
    assert len(reports) == 6
    assert {json.loads(p.read_text())["status"] for p in reports} >= {"ok", "oom"}

    # launch_local measures the same plan's probed step to the byte: one measuring code for both launchers
    model = gpt.gpt_tiny()
    batches = [gpt.example_batch(model, 8, seed=s) for s in range(2)]
    local = launch_local(res.plan, gpt.gpt_tiny, default_optimizer(res.plan.optimizer), default_loss, batches,
                         timeout_s=60, probe_step=1)
    assert local.peak_step_bytes == ok.measured_peak_bytes, (local.peak_step_bytes, ok.measured_peak_bytes)


@pytest.mark.slow
def test_a_hanging_trial_is_stopped_at_its_timeout(tmp_path, models, monkeypatch):
    monkeypatch.setenv("HANG_PID_DIR", str(tmp_path))
    db = tmp_path / "tune.sqlite"
    with pytest.raises(AutotuneFailed, match="timeout"):
        autotune(f"{models}:hanging_tiny", "local:2", launcher="torchrun", global_batch_size=8,
                 example_inputs=(torch.zeros(4, 128, dtype=torch.long),), candidates=[{"dp": 2}], steps=1,
                 warmup=0, db=db, precision="fp32", max_rounds=1, progress=False, timeout_s=20,
                 rewrite_attention=False)  # the module's own forward runs, where it hangs
    (row,) = TrialStore(db).rows()
    assert row["status"] == "timeout" and "no result within timeout_s=20 s" in row["error"]
    assert "rank 0 in step 1 of 2" in row["error"] and "rank 1 in step 1 of 2" in row["error"]
    pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2, "both ranks reached the hanging step"
    assert all(_gone(pid) for pid in pids)
    assert _running_with(str(tmp_path / "tune.trials")) == [], "a process of the trial survived"


# ---- srun (not installed here) and torchrun command lines ------------------------------------------


def test_srun_command_line_is_composed_for_the_topology(tmp_path):
    """SLURM is not installed on this machine, so srun is not run: the command is checked as composed."""
    run = run_args("/shared/t/plan.json", model="/shared/gpt.py:gpt_small", steps=5, report="/shared/t/reports",
                   probe_step=1, memory_limit_bytes=72e9, timeout_s=120, data="pkg.data:batch")
    srun = cluster_launcher("srun", Topology.parse("2x8xH100-80GB"),
                            {"extra": "--gpus-per-task=1", "python": "python3"})
    assert srun.argv(run) == [
        "srun", "--nodes", "2", "--ntasks-per-node", "8", "--kill-on-bad-exit=1", "--gpus-per-task=1", "python3",
        "-m", "runtime.run", "/shared/t/plan.json", "--programs", "/shared/t", "--model", "/shared/gpt.py:gpt_small",
        "--steps", "5", "--timeout-s", "120", "--report", "/shared/t/reports", "--probe-step", "1",
        "--memory-limit-bytes", "72000000000", "--data", "pkg.data:batch"]
    # several nodes: rank 0 hosts the rendezvous on the first node, which must be allowed explicitly
    assert srun.env() == {"MASTER_PORT": "29500", "PARTITIONER_ALLOW_EXTERNAL_BIND": "1"}
    assert Srun(nodes=1, ntasks_per_node=4).env() == {"MASTER_PORT": "29500"}
    # the counts come from the topology; given ones must agree with it
    with pytest.raises(DeclarationError, match=r"3 nodes, but the topology 2x8xH100-80GB has 2"):
        cluster_launcher("srun", Topology.parse("2x8xH100-80GB"), {"nnodes": 3})
    if shutil.which("srun") is None:  # starting it fails at once, naming the command, rather than hanging
        with pytest.raises(LaunchError, match=r"cannot start 'srun'.*srun --nodes 2"):
            launch_cluster(srun, run, report_dir=tmp_path / "reports", log_dir=tmp_path, timeout_s=5, run_id="x")


def test_torchrun_command_line_on_one_and_several_nodes():
    run = run_args("t/plan.json", model="m.py:f", steps=3, report="t/r")
    one = cluster_launcher("torchrun", Topology.parse("local:4"), {})
    argv = one.argv(run, run_id="trial-1", endpoint="127.0.0.1:29411")
    assert argv[argv.index("--nnodes"):argv.index("-m", 3)] == [
        "--nnodes", "1", "--nproc-per-node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29411",
        "--rdzv-id", "trial-1"]
    many = cluster_launcher("torchrun", Topology.parse("2x8xH100-80GB"),
                            {"rdzv_endpoint": "node01:29400", "wrapper": "srun --ntasks-per-node=1"})
    argv = many.argv(run, run_id="trial-2")
    assert argv[:2] == ["srun", "--ntasks-per-node=1"] and argv[argv.index("--nnodes") + 1] == "2"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "node01:29400"
    with pytest.raises(LaunchError, match="rdzv_endpoint='HOST:PORT'"):
        Torchrun(nnodes=2, nproc_per_node=8)
    with pytest.raises(LaunchError, match="an agent on each node"):
        Torchrun(nnodes=2, nproc_per_node=8, rdzv_endpoint="node01:29400")


def test_cluster_launchers_refuse_callables_and_local_refuses_cluster_topologies(tmp_path):
    with pytest.raises(DeclarationError, match=r'launcher="torchrun" or launcher="srun"'):
        autotune("examples/gpt.py:gpt_tiny", "2x8xH100-80GB", global_batch_size=8, db=tmp_path / "x.sqlite")
    with pytest.raises(DeclarationError, match=r"model=.*import it by name.*FILE.py:NAME"):
        autotune(gpt.gpt_tiny, "local:2", launcher="torchrun", global_batch_size=8, db=tmp_path / "x.sqlite")
    with pytest.raises(DeclarationError, match=r"data=.*FILE.py:NAME"):
        autotune("examples/gpt.py:gpt_tiny", "local:2", launcher="srun", global_batch_size=8,
                 data=lambda step: None, db=tmp_path / "x.sqlite")
    with pytest.raises(DeclarationError, match=r"launcher='mpirun'"):
        autotune("examples/gpt.py:gpt_tiny", "local:2", launcher="mpirun", global_batch_size=8,
                 db=tmp_path / "x.sqlite")


# ---- the CLI ---------------------------------------------------------------------------------------


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "partitioner", "autotune", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.slow
def test_cli_autotune_through_torchrun(tmp_path):
    r = _cli(str(REPO / "examples/gpt.py") + ":gpt_tiny", "--topology", "local:2", "--global-batch-size", "8",
             "--dp", "2", "--precision", "fp32", "--trials", "1", "--steps", "1", "--warmup", "0",
             "--launcher", "torchrun", "--db", "tune.sqlite", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["best"]["status"] == "ok" and len(doc["best"]["measured_peak_bytes"]) == 2
    assert "(torchrun)" in r.stderr and (tmp_path / "tune.trials").is_dir()
    # bad input, exit 2: a cluster topology with the local launcher; a torchrun flag with srun
    model = str(REPO / "examples/gpt.py") + ":gpt_tiny"
    r = _cli(model, "--topology", "2x8xH100-80GB", "--global-batch-size", "8", cwd=tmp_path)
    assert r.returncode == 2 and "--launcher torchrun|srun" in r.stderr and r.stdout == ""
    r = _cli(model, "--topology", "2x8xH100-80GB", "--global-batch-size", "8", "--launcher", "srun",
             "--rdzv-endpoint", "node01:29400", cwd=tmp_path)
    assert r.returncode == 2 and "--rdzv-endpoint and --launcher-wrapper are torchrun's" in r.stderr
