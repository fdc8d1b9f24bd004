"""Elastic restarts, killed ranks and mismatched programs, with real torchrun jobs and real SIGKILLs.

- Elastic: a torchrun job (`--nnodes 1:2`, c10d rendezvous on loopback) trains
  on 4 processes and checkpoints; restarted on 2 it re-plans for 2, reshards
  the checkpoint and continues from the same step with the checkpoint's
  parameters (checked to the bit); restarted on 3 (an odd size) it plans
  again and finishes. The final parameters equal one process training all
  the steps on the same global batches.
- A rank SIGKILLed mid-training under `torchrun --max-restarts 1`: torchrun
  restarts the job, it resumes from the last checkpoint and ends with the
  parameters of an uninterrupted run.
- A survivor never hangs: it exits within seconds naming the dead rank.
- Ranks given programs of different plans refuse to start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from examples import gpt
from examples.training import adamw, gpt_tiny_seeded, train_one_process, warmup_cosine
from runtime.checkpoint import latest_checkpoint, load_full_state_dict
from runtime.run import default_loss
from ranks import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MODEL, BATCH = "examples.gpt:gpt_tiny", 12  # 12 samples: dp 2, 3 and 4 all divide it


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _elastic(nproc: int, save: Path, steps: int, *extra: str, max_restarts: int = 0, popen: bool = False):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-conf",
           "last_call_timeout=1", "--max-restarts", str(max_restarts), "-m", "partitioner.elastic", MODEL,
           "--save-dir", str(save), "--save-every", "2", "--steps", str(steps), "--global-batch-size", str(BATCH),
           "--optimizer", "examples.training:adamw", "--timeout-s", "60",
           "--scheduler", "examples.training:warmup_cosine", *extra]  # a schedule: replayed at every restart
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _reference(steps: int) -> dict[str, torch.Tensor]:
    data_model = gpt.gpt_tiny()  # only its config shapes the batches
    batches = [gpt.example_batch(data_model, BATCH, seed=step) for step in range(steps)]
    return train_one_process(gpt_tiny_seeded, adamw, default_loss, batches,
                             scheduler_fn=warmup_cosine).model.state_dict()


def _assert_close(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=2e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_elastic_restarts_on_4_then_2_then_3_ranks(tmp_path):
    save = tmp_path / "ckpt"
    out = _elastic(4, save, 4)
    assert "planned for 4 ranks from a new trace (cached)" in out and latest_checkpoint(save).name == "step_00000004"
    # On 2 ranks with nothing left to train: the parameters it loaded are the checkpoint's, to the bit.
    out = _elastic(2, save, 4, "--save", str(tmp_path / "loaded.pt"))
    # re-planned for the new world size without tracing again
    assert "planned for 2 ranks from the cached trace" in out and "at step 4 (resharded from 4 ranks to 2)" in out
    loaded, saved = torch.load(tmp_path / "loaded.pt", weights_only=True), load_full_state_dict(save)
    assert sorted(loaded) == sorted(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
    out = _elastic(2, save, 6, "--eval-every", "3", "--eval-batches", "2")  # held-out example batches
    assert "step 5/6" in out and "step 1/" not in out
    assert "eval after step 6: loss " in out and "eval after step 5" not in out  # every 3rd step counted from 0
    out = _elastic(3, save, 8, "--save", str(tmp_path / "final.pt"))
    assert "planned for 3 ranks from the cached trace" in out and "at step 6 (resharded from 2 ranks to 3)" in out
    _assert_close(torch.load(tmp_path / "final.pt", weights_only=True), _reference(8))


def _worker_pids(root: int, rank: int) -> list[int]:
    """Descendants of `root` whose environment says RANK=rank and that run partitioner.elastic (torchrun's workers)."""
    parent: dict[int, int] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parent[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found = []
    for pid in parent:
        up = pid
        while up in parent and up != root and up > 1:
            up = parent[up]
        if up != root or pid == root:
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"partitioner.elastic" in cmd:
            found.append(pid)
    return found


def test_killed_rank_restarts_from_the_last_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    proc = _elastic(2, save, 10, "--save", str(tmp_path / "final.pt"), max_restarts=1, popen=True)
    killed = False
    try:
        deadline = time.time() + 200
        while time.time() < deadline and proc.poll() is None and not killed:
            ck = latest_checkpoint(save) if save.is_dir() else None
            if ck is not None and ck.name >= "step_00000004":
                for pid in _worker_pids(proc.pid, 1):
                    os.kill(pid, signal.SIGKILL)
                    killed = True
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert killed, out[-3000:]
    assert proc.returncode == 0, out[-4000:]
    assert "resumed from" in out and "(same plan)" in out, out[-3000:]
    _assert_close(torch.load(tmp_path / "final.pt", weights_only=True), _reference(10))


def test_survivor_names_the_dead_rank_and_exits(tmp_path):
    from partitioner import compile

    with torch.device("meta"):
        model = gpt.gpt_tiny()
    x, _ = gpt.example_batch(model, 2)
    plan = compile(model, "local:2", example_inputs=(x,), global_batch_size=BATCH, precision="fp32", dp=2,
                   zero_stage=0)
    plan.write_programs(tmp_path / "plan")
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(_env(), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "runtime.run", str(tmp_path / "plan" / "plan.json"),
                                       "--model", MODEL, "--steps", "100000", "--timeout-s", "120"], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for line in procs[0].stdout:
            if line.startswith("step 3/"):
                break
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.time()
        _, err = procs[0].communicate(timeout=60)
        took = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 3, err[-2000:]
    assert "rank 1 stopped during step" in err, err[-2000:]
    assert took < 30  # the collective timeout is 120 s: it did not wait for it


def test_ranks_with_programs_of_different_plans_refuse_to_start():
    from partitioner import compile
    from runtime import launch_local
    from runtime.launch.env import LaunchError

    with torch.device("meta"):
        model = gpt.gpt_tiny()
    x, _ = gpt.example_batch(model, 2)
    a = compile(model, "local:2", example_inputs=(x,), global_batch_size=BATCH, precision="fp32", dp=2, zero_stage=0)
    b = compile(model, "local:2", example_inputs=(x,), global_batch_size=BATCH, precision="fp32", dp=2, zero_stage=1)
    batches = [gpt.example_batch(gpt.gpt_tiny(), BATCH, seed=0)]
    with pytest.raises(LaunchError, match=r"different plans.*ranks \[0\] run plan .*ranks \[1\] run plan"):
        launch_local(a, gpt.gpt_tiny, adamw, default_loss, batches,
                     programs={0: a.program(0).source, 1: b.program(1).source}, timeout_s=60)


def test_every_world_sizes_plan_keeps_torch_compile(tmp_path):
    """A job started with --torch-compile re-plans each new world size with it (a restart that dropped it would
    train on, eager and slower, without a word)."""
    from partitioner.elastic import _parser, plan_for_world
    from partitioner.planner.plan import Plan

    args = _parser().parse_args([MODEL, "--save-dir", str(tmp_path), "--save-every", "2", "--steps", "4",
                                 "--global-batch-size", str(BATCH), "--torch-compile", "aot_eager"])
    for world in (2, 3):
        plan = Plan.load(plan_for_world(args, world, rank=0) / "plan.json")
        assert plan.torch_compile == "aot_eager" and plan.world_size == world
    default = _parser().parse_args([MODEL, "--save-dir", str(tmp_path / "eager"), "--save-every", "2", "--steps", "4",
                                    "--global-batch-size", str(BATCH)])
    assert not Plan.load(plan_for_world(default, 2, rank=0) / "plan.json").torch_compile
