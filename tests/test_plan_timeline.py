"""plan.timeline(): the simulated step as Perfetto events, per pipeline rank and lane, and as a Gantt PNG."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from partitioner import compile
from partitioner.show.timeline import LANES, build_timeline

PLANS = {  # name -> (topology, pins): a plain, an interleaved and a zero-bubble pipeline, and pure data parallelism
    "1f1b": ("2x4xA100-80GB", {"global_batch_size": 64, "pp": 2, "tp": 2, "dp": 2, "microbatch_size": 4,
                               "schedule": "1f1b"}),
    "interleaved": ("2x4xA100-80GB", {"global_batch_size": 32, "pp": 2, "tp": 2, "microbatch_size": 2,
                                      "schedule": "interleaved-1f1b", "interleave": 2}),
    "zb-h1": ("2x4xA100-80GB", {"global_batch_size": 64, "pp": 2, "tp": 2, "dp": 2, "microbatch_size": 4,
                                "schedule": "zb-h1"}),
    "ddp": ("local:4", {"global_batch_size": 16, "dp": 4, "zero_stage": 0}),
    "zero3": ("local:4", {"global_batch_size": 16, "dp": 4, "zero_stage": 3}),
}


@pytest.fixture(scope="module", params=list(PLANS))
def plan(request, meta_gpt_graph):
    topology, pins = PLANS[request.param]
    return compile(meta_gpt_graph, topology, **pins)


def x_events(trace_dict):
    return [e for e in trace_dict["traceEvents"] if e["ph"] == "X"]


def test_events_are_ordered_and_disjoint_within_each_lane(plan):
    events = x_events(plan.timeline())
    assert events
    for rank in range(plan.pp):
        for tid, lane in enumerate(LANES):
            mine = [e for e in events if e["pid"] == rank and e["tid"] == tid]
            assert all(e["cat"] == lane and e["dur"] >= 0 for e in mine)
            for a, b in itertools.pairwise(mine):  # in program order, each starts after the previous ended
                assert a["ts"] + a["dur"] <= b["ts"] + 1e-6, (rank, lane, a, b)
    assert {e["pid"] for e in events} == set(range(plan.pp))


def test_one_forward_and_one_backward_per_microbatch_and_stage(plan):
    events = x_events(plan.timeline())
    stages = plan.pp * plan.interleave
    for op in ("F", "I", "W") if plan.schedule == "zb-h1" else ("F", "B"):   # zb-h1: the backward split
        done = [(e["args"]["stage"], e["args"]["microbatch"]) for e in events
                if e["cat"] == "compute" and e["name"].startswith(op)]
        assert len(done) == plan.num_microbatches * stages
        assert set(done) == {(s, m) for s in range(stages) for m in range(plan.num_microbatches)}


def test_names_say_what_runs(plan):
    names = {e["name"] for e in x_events(plan.timeline())}
    assert {"F0", "B0", "optim"} <= names or (plan.schedule == "zb-h1" and {"F0", "I0", "W0", "optim"} <= names)
    if plan.pp > 1:
        assert {"send F0", "send B0"} <= names
    else:
        assert not any(n.startswith("send") for n in names)
    if plan.dp > 1:
        assert ("dp reduce-scatter" if plan.zero_stage >= 2 else "dp all-reduce") in names


def test_the_step_ends_at_the_simulated_and_about_the_predicted_step_time(plan):
    tl = build_timeline(plan)
    end = max(e["ts"] + e["dur"] for e in x_events(plan.timeline()))
    assert end == pytest.approx(tl.step_time_s * 1e6, rel=1e-9)
    # the plan does not hold the per-boundary p2p times nor each stage's optimizer step
    # (plan_timeline.plan_durations): the rebuilt step lands near the planner's, not on it
    assert tl.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=0.1)


def test_json_and_png_are_written(plan, tmp_path):
    path, png = tmp_path / "step.json", tmp_path / "step.png"
    out = plan.timeline(path, png=png)
    assert json.loads(path.read_text()) == out
    names = {e["args"]["name"] for e in out["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == set(LANES)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    import matplotlib.image

    height, width = matplotlib.image.imread(png).shape[:2]
    assert width == 1200 and height > 150


def test_no_files_without_paths(plan, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan.timeline()
    assert list(tmp_path.iterdir()) == []


def test_png_without_matplotlib_says_how_to_install_it(meta_gpt_graph, tmp_path, monkeypatch):
    plan = compile(meta_gpt_graph, "local:4", global_batch_size=16, dp=4)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import now fails
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plan.timeline(png=tmp_path / "step.png")


# ---- the measured step (python -m runtime.run --trace) beside the predicted one -------------------------------

@pytest.mark.slow
def test_runtime_trace_records_every_action_and_compares_with_the_plan(tmp_path):
    """Two real ranks run a pp2 x ZeRO-less plan of the example GPT under torchrun; --trace writes every rank's
    actions of the traced step, one at a time, in program order but for receives, logged when posted (one compute
    early), which compare_measured sets beside the plan."""
    import os
    import subprocess

    from examples.gpt import example_batch, gpt_tiny
    from partitioner.show.timeline import compare_measured

    model = gpt_tiny()  # traced on its input alone, as `partitioner compile` does: runtime.run gives the targets to the loss
    plan = compile(model, "local:2", example_batch(model, 2)[:1], global_batch_size=8, pp=2, microbatch_size=2,
                   schedule="1f1b")
    plan.write_programs(tmp_path)  # plan.json and rank_{r}.py
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "runtime.run", str(tmp_path / "plan.json"), "--model", "examples/gpt.py:gpt_tiny", "--steps", "2",
           "--trace", str(tmp_path / "trace.json"), "--no-verify", "--timeout-s", "60"]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wrote the measured trace of step 2" in proc.stdout
    trace = json.loads((tmp_path / "trace.json").read_text())
    by_rank: dict[int, list] = {}
    for e in x_events(trace):
        by_rank.setdefault(e["pid"], []).append(e)
    for r, events in by_rank.items():
        names, listed = [e["args"]["action"] for e in events], [str(a) for a in plan.instructions.ranks[r]]
        assert sorted(names) == sorted(listed)
        recv = ("RECV_F", "RECV_B")
        # program order, but a receive logged when posted: one compute early (runtime.pipeline.executor), and
        # before the compute that reads it
        assert [n for n in names if not any(k in n for k in recv)] == [n for n in listed if not any(k in n for k in recv)]
        for k, n in enumerate(names):
            if any(x in n for x in recv):
                reader = n.replace("RECV_F", "F").replace("RECV_B", "B")
                assert reader in names[k + 1:], (n, names)
        for a, b in itertools.pairwise(events):  # one action at a time
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
    c = compare_measured(plan, tmp_path / "trace.json")
    kinds = {(r, kind) for r, kind, *_ in c.rows}
    assert {(0, "F"), (0, "B"), (1, "F"), (1, "B"), (0, "send"), (0, "optim")} <= kinds
    assert all(meas > 0 for r, kind, n, pred, meas in c.rows if kind in ("F", "B"))
    assert c.measured_step_s > 0 and c.predicted_step_s > 0
    assert "measured / predicted" in str(c)
