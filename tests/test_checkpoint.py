"""Sharded checkpoints: any plan loads any plan's checkpoint, bit-exact; saves are atomic; loads are safe.

The truth test: train 2 steps under plan A, checkpoint, resume under plan B
(other dp/tp/pp, ZeRO stage, world size) for 2 more: the losses and final
parameters equal one process training 4 steps (fp32 tolerance). Loading is
bit-exact: a checkpoint loaded under B and saved again holds the same
parameters and optimizer state to the bit. Killing a save midway (SIGKILL
from outside, for real) leaves the previous checkpoint intact and loadable.
A corrupted shard, a foreign model's checkpoint and a malicious pickle in
DCP's metadata are refused with errors naming the file.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.training import adamw
from runtime import launch_local
from runtime.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_full_checkpoint,
    load_full_state_dict,
    read_manifest,
    reshard,
    verify_checkpoint,
)
from runtime.checkpoint.layout import local_to_full, range_boxes
from runtime.launch.env import LaunchError
from runtime.pipeline.tensor_parallel import shard_parameter
from ranks import assert_trains_like, gloo_group
from test_3d_equivalence import MODELS, batches, plan_for, reference

ROOT = Path(__file__).resolve().parents[1]


# ---- geometry (no processes) ------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), data=st.data())
def test_boxes_of_a_slice_range_are_exactly_its_elements(shape, data):
    ndim = len(shape)
    spec_dim = data.draw(st.one_of(st.none(), st.integers(0, ndim - 1)))
    world = data.draw(st.integers(1, 3)) if spec_dim is not None else 1
    fused = data.draw(st.integers(1, 3)) if spec_dim is not None else 1
    full_shape = list(shape)
    if spec_dim is not None:
        full_shape[spec_dim] *= world * fused
    full = torch.arange(math.prod(full_shape), dtype=torch.float32).view(full_shape)
    rank = data.draw(st.integers(0, world - 1))
    local = shard_parameter(full, "R" if spec_dim is None else f"S({spec_dim})", rank, world, fused)
    n = local.numel()
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    got = []
    for box in range_boxes(local.shape, a, b):
        for lb in local_to_full(box, local.shape, spec_dim, rank, world, fused):
            fsl = tuple(slice(o, o + s) for o, s in zip(lb.full.offsets, lb.full.sizes))
            lsl = tuple(slice(o, o + s) for o, s in zip(lb.local.offsets, lb.local.sizes))
            assert torch.equal(full[fsl], local[lsl])
            got.append(local[lsl].reshape(-1))
    covered = torch.cat(got) if got else torch.empty(0)
    assert sorted(covered.tolist()) == sorted(local.reshape(-1)[a:b].tolist())


# ---- training across plans (processes) ------------------------------------------------------------

STEPS = 4


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """Plan A (dp 2, ZeRO-1) trains steps 1-2 and checkpoints; the one-process reference trains 1-4."""
    model_fn, loss_fn = MODELS["gpt"]
    data = batches(STEPS)
    d = tmp_path_factory.mktemp("ckpt_a")
    a = plan_for("gpt", pp=1, dp=2, tp=1, zero=1)
    out = launch_local(a, model_fn, adamw, loss_fn, data[:2], save_dir=d, save_every=2, timeout_s=180)
    want_losses, want = reference(model_fn, loss_fn, data)
    return {"dir": d, "plan": a, "out": out, "data": data, "want_losses": want_losses, "want": want}


def _assert_matches_reference(out, run, first_step: int):
    assert_trains_like(out, run["want_losses"][first_step:], run["want"], adam_steps=len(run["want_losses"]))


@pytest.mark.slow
@pytest.mark.parametrize("b", [dict(pp=2, dp=1, tp=2), dict(pp=1, dp=2, tp=2, zero=3), dict(pp=2, dp=2, tp=1, zero=2),
                               dict(pp=1, dp=1, tp=1), dict(pp=2, dp=1, tp=2, on="meta")],
                         ids=["pp2tp2", "dp2tp2-zero3", "pp2dp2-zero2", "one-rank", "pp2tp2-from-meta"])
def test_resume_under_another_plan_trains_as_one_process(run_a, b):
    """pp2tp2-from-meta: the new plan compiled from the model on the meta device, as partitioner.elastic
    compiles every plan after a restart from its cached meta trace."""
    model_fn, loss_fn = MODELS["gpt"]
    assert run_a["out"].checkpoints and Path(run_a["out"].checkpoints[-1]).name == "step_00000002"
    torch.testing.assert_close(torch.tensor(run_a["out"].losses), torch.tensor(run_a["want_losses"][:2]),
                               rtol=1e-5, atol=1e-6)
    plan_b = plan_for("gpt", **b)
    out = launch_local(plan_b, model_fn, adamw, loss_fn, run_a["data"], resume_from=run_a["dir"], timeout_s=180)
    assert out.start_step == 2
    _assert_matches_reference(out, run_a, 2)


@pytest.mark.slow
def test_full_state_dict_loads_into_the_plain_model(run_a):
    full = load_full_state_dict(run_a["dir"])
    model = MODELS["gpt"][0]()
    model.load_state_dict(full, strict=True)  # the model's own names, tied aliases included
    for k, v in run_a["out"].state_dict.items():
        assert torch.equal(full[k], v), k


@pytest.mark.slow
def test_offline_reshard_then_resume(run_a, tmp_path):
    model_fn, loss_fn = MODELS["gpt"]
    plan_b = plan_for("gpt", pp=2, dp=1, tp=2)
    dst = reshard(run_a["dir"], plan_b, tmp_path / "b")
    m = read_manifest(dst)
    assert m["world_size"] == 4 and m["plan"]["config"]["tp"] == 2 and m["step"] == 2
    before, after = load_full_checkpoint(run_a["dir"]), load_full_checkpoint(dst)
    for k, v in before.items():
        if k.startswith(("model/", "optim/", "buffer/")):
            assert torch.equal(after[k], v), k
    out = launch_local(plan_b, model_fn, adamw, loss_fn, run_a["data"], resume_from=dst, timeout_s=180)
    _assert_matches_reference(out, run_a, 2)


def _resave_worker(rank, world, store, out_dir):
    """Build plan B's runner, load the checkpoint (written under plan A), save it again under B."""
    from partitioner.planner.plan import Plan
    from runtime.checkpoint import load_checkpoint, save_checkpoint

    with gloo_group(rank, world, store):
        plan = Plan.from_json(Path(os.environ["CKPT_TEST_PLAN"]).read_text())
        ns: dict = {}
        exec(compile(plan.program(rank).source, f"rank_{rank}.py", "exec"), ns)
        torch.manual_seed(0)
        runner = ns["build"](MODELS["gpt"][0], adamw, MODELS["gpt"][1])
        info = load_checkpoint(runner, os.environ["CKPT_TEST_SRC"], plan_json=plan.to_json())
        save_checkpoint(runner, os.environ["CKPT_TEST_DST"], step=info.step, plan_json=plan.to_json())
        torch.save({"step": info.step, "same_plan": info.same_plan}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("b,world", [(dict(pp=2, dp=1, tp=2), 4), (dict(pp=1, dp=2, tp=1, zero=3), 2)],
                         ids=["pp2tp2", "dp2-zero3"])
def test_load_then_save_is_bit_exact(run_a, tmp_path, spawned, monkeypatch, b, world):
    plan_b = plan_for("gpt", **b)
    (tmp_path / "plan_b.json").write_text(plan_b.to_json())
    monkeypatch.setenv("CKPT_TEST_PLAN", str(tmp_path / "plan_b.json"))
    monkeypatch.setenv("CKPT_TEST_SRC", str(run_a["dir"]))
    monkeypatch.setenv("CKPT_TEST_DST", str(tmp_path / "again"))
    results = spawned(_resave_worker, world)
    assert all(r["step"] == 2 and not r["same_plan"] for r in results)
    before, after = load_full_checkpoint(run_a["dir"]), load_full_checkpoint(tmp_path / "again")
    kinds = [k for k in before if k.startswith(("model/", "optim/", "buffer/"))]
    assert any(k.startswith("optim/exp_avg_sq/") for k in kinds)
    for k in kinds:
        assert torch.equal(after[k], before[k]), k  # parameters and Adam's moments, to the bit
    assert verify_checkpoint(tmp_path / "again")["optimizer"]["scalars"] == \
        verify_checkpoint(run_a["dir"])["optimizer"]["scalars"]


# ---- refusing bad checkpoints ---------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_corrupted_truncated_or_missing_shard_is_refused_naming_the_file(run_a, tmp_path):
    src = latest_checkpoint(run_a["dir"])
    bad = _copy(src, tmp_path / "flip")
    shard = bad / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp.*SHA-256"):
        load_full_state_dict(bad)
    model_fn, loss_fn = MODELS["gpt"]
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp"):  # before any process starts
        launch_local(run_a["plan"], model_fn, adamw, loss_fn, run_a["data"], resume_from=bad)
    short = _copy(src, tmp_path / "short")
    (short / "__0_0.distcp").write_bytes((short / "__0_0.distcp").read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: 100 bytes"):
        verify_checkpoint(short)
    gone = _copy(src, tmp_path / "gone")
    (gone / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata: missing"):
        verify_checkpoint(gone)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/partitioner-pwned",))


@pytest.mark.slow
def test_metadata_pickle_never_runs_code(run_a, tmp_path):
    """Even with the manifest's hash updated to match, a .metadata that names os.system is refused."""
    bad = _copy(latest_checkpoint(run_a["dir"]), tmp_path / "evil")
    (bad / ".metadata").write_bytes(pickle.dumps(_Evil()))
    m = json.loads((bad / "manifest.json").read_text())
    import hashlib

    m["files"][".metadata"] = {"bytes": (bad / ".metadata").stat().st_size,
                               "sha256": hashlib.sha256((bad / ".metadata").read_bytes()).hexdigest()}
    (bad / "manifest.json").write_text(json.dumps(m))
    Path("/tmp/partitioner-pwned").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match=r"\.metadata: not a valid DCP metadata file.*posix.system|os.system"):
        load_full_state_dict(bad)
    assert not Path("/tmp/partitioner-pwned").exists()


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused(run_a):
    from examples.training import gpt_8l_seeded, gpt_loss

    other = plan_for("gpt8", pp=1, dp=2, tp=1)
    with pytest.raises(CheckpointError, match="another model"):
        launch_local(other, gpt_8l_seeded, adamw, gpt_loss, run_a["data"], resume_from=run_a["dir"])


def test_missing_or_garbage_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        verify_checkpoint(tmp_path / "nope")
    (tmp_path / "step_00000001").mkdir()
    (tmp_path / "step_00000001" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not JSON"):
        read_manifest(tmp_path / "step_00000001")
    with pytest.raises(LaunchError, match="save_dir and save_every go together"):
        launch_local(plan_for("gpt", pp=1, dp=1, tp=1), MODELS["gpt"][0], adamw, MODELS["gpt"][1], batches(1),
                     save_every=1)


VALID = {"format": "partitioner-checkpoint", "version": 1, "step": 2, "world_size": 2, "graph_hash": "ab",
         "plan_hash": "cd", "plan": None, "params": {"w": [2, 3]}, "state_keys": {"w": "w"},
         "optimizer": {"type": "torch.optim.adamw.AdamW", "elementwise": ["exp_avg"],
                       "scalars": {"step": {"value": 2.0, "tensor": True, "dtype": "float32"}}, "param_groups": [{}]},
         "compression": False, "files": {".metadata": {"bytes": 1, "sha256": "00"}}, "extra": {}}

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                     max_leaves=8)


@settings(max_examples=1500, deadline=None)
@given(field=st.sampled_from(sorted(VALID)), value=_json, drop=st.booleans())
def test_fuzzed_manifests_raise_only_checkpoint_errors(tmp_path_factory, field, value, drop):
    d = tmp_path_factory.mktemp("m", numbered=True)
    m = dict(VALID)
    if drop:
        m.pop(field)
    else:
        m[field] = value
    (d / "manifest.json").write_text(json.dumps(m))
    try:
        read_manifest(d)
    except CheckpointError as e:
        assert str(d) in str(e)
    before = set(os.listdir(d))
    try:
        load_full_state_dict(d)
    except CheckpointError:
        pass
    assert set(os.listdir(d)) == before  # nothing written


# ---- a save killed midway ----------------------------------------------------------------------

_KILL_SCRIPT = """
import sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
from examples.training import adamw, gpt_4l_seeded, gpt_loss
from runtime import launch_local
from test_3d_equivalence import batches, plan_for

if __name__ == "__main__":
    plan = plan_for("gpt", pp=1, dp=2, tp=1, zero=0)
    launch_local(plan, gpt_4l_seeded, adamw, gpt_loss, batches(200), save_dir=sys.argv[1], save_every=1,
                 timeout_s=120)
"""


def _kill_during_a_save(tmp_path: Path, attempt: int) -> tuple[Path, Path | None]:
    """Train with a checkpoint every step and SIGKILL every process while a later save is being written.
    Returns the save directory and the save caught mid-write (None if that save finished before the kill)."""
    script = tmp_path / "train.py"
    script.write_text(_KILL_SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests")))
    save = tmp_path / f"ckpt{attempt}"
    proc = subprocess.Popen([sys.executable, str(script), str(save)], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    killed_in = None
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            done = latest_checkpoint(save) if save.is_dir() else None  # read before the temporaries: a later save
            tmps = [p for p in save.glob(".tmp-step_*") if any(p.glob("*.distcp"))] if save.is_dir() else []
            tmps = [p for p in tmps if done is not None and p.name.removeprefix(".tmp-") > done.name]
            if tmps:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank, mid-write
                killed_in = tmps[0]
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert killed_in is not None, "never caught a save in progress: " + proc.stderr.read().decode()[-2000:]
    # between the look and the kill the save may have finished (renamed): then nothing was interrupted
    return save, killed_in if killed_in.exists() else None


@pytest.mark.slow
def test_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    for attempt in range(3):
        save, killed_in = _kill_during_a_save(tmp_path, attempt)
        if killed_in is not None:
            break
    assert killed_in is not None, "three saves finished between the look and the kill: none was interrupted"
    good = latest_checkpoint(save)
    assert good is not None and good.name < killed_in.name.removeprefix(".tmp-")
    m = verify_checkpoint(save)  # intact: every file matches the manifest
    full = load_full_state_dict(save)
    assert m["step"] >= 1 and "transformer.wte.weight" in full or full
    # and training resumes from it under the same plan; the next save replaces the leftover
    model_fn, loss_fn = MODELS["gpt"]
    data = batches(m["step"] + 1)
    out = launch_local(plan_for("gpt", pp=1, dp=2, tp=1, zero=0), model_fn, adamw, loss_fn, data, resume_from=save,
                       save_dir=save, save_every=1, timeout_s=180)
    assert out.start_step == m["step"] and len(out.losses) == 1
    assert latest_checkpoint(save).name == f"step_{m['step'] + 1:08d}"


@pytest.mark.slow
def test_cli_reshard(run_a, tmp_path):
    plan_b = plan_for("gpt", pp=2, dp=1, tp=2)
    plan_b.save(tmp_path / "b.json")
    cmd = [sys.executable, "-m", "partitioner", "reshard", str(run_a["dir"]), "--to", str(tmp_path / "b.json"),
           "-o", str(tmp_path / "out"), "--json"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["step"] == 2 and summary["world_size"] == 4
    other = plan_for("gpt8", pp=1, dp=2, tp=1)
    other.save(tmp_path / "other.json")
    cmd[6], cmd[8] = str(tmp_path / "other.json"), str(tmp_path / "out2")
    out = subprocess.run(cmd[:-1], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "different models" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out2").exists()
