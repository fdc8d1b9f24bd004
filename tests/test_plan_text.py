"""`print(plan)` and `plan.explain()`: golden files, and what the reasoning must say.

Golden files: tests/golden/plan_*.txt hold print(plan), a blank line, then plan.explain(), for plans
compiled from models built on the meta device (the cost model is deterministic, so the text is too).
After an intended change of the text, regenerate them and review the diff:

    PARTITIONER_REGEN_GOLDEN=1 python -m pytest -q tests/test_plan_text.py
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from cost_models.memory import allocator_slack
from examples import gpt as gpt_mod
from partitioner import OpGraph, Plan, compile, trace
from partitioner.show.text import WIDTH

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("PARTITIONER_REGEN_GOLDEN") == "1"


def meta_trace(builder, batch: int = 1) -> OpGraph:
    with torch.device("meta"):
        model = builder()
    idx = torch.empty(batch, model.config.block_size, dtype=torch.long, device="meta")
    return trace(model, (idx, idx))


@pytest.fixture(scope="module")
def small() -> OpGraph:
    return meta_trace(gpt_mod.gpt_small, batch=8)


@pytest.fixture(scope="module")
def xl() -> OpGraph:
    return meta_trace(gpt_mod.gpt2_xl)


def flat(text: str) -> str:
    """explain() wraps its prose at spaces: compare phrases with the line breaks undone."""
    return " ".join(text.split())


def check_golden(name: str, plan: Plan) -> None:
    text = f"{plan}\n\n{plan.explain()}\n"
    path = GOLDEN / name
    if REGEN:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.is_file(), f"{path} is missing: create it with PARTITIONER_REGEN_GOLDEN=1 python -m pytest {__file__}"
    expected = path.read_text()
    assert text == expected, (
        f"print(plan) / plan.explain() differ from {path}. If the change is intended, regenerate with "
        f"PARTITIONER_REGEN_GOLDEN=1 python -m pytest -q {Path(__file__).name} and review the diff.\n"
        f"--- got ---\n{text}")


def test_golden_pipeline_tensor_plan(small):
    plan = compile(small, "2x4xA100-80GB", global_batch_size=32, tp=2, pp=2)
    assert (plan.tp, plan.pp) == (2, 2)
    check_golden("plan_gpt_small_2x4xA100.txt", plan)


def test_golden_data_parallel_plan(small):
    plan = compile(small, "local:4", global_batch_size=32)
    assert (plan.tp, plan.pp) == (1, 1)
    check_golden("plan_gpt_small_local4.txt", plan)


def test_text_fits_the_width_and_names_each_decision(small):
    plan = compile(small, "2x4xA100-80GB", global_batch_size=32, tp=2, pp=2)
    text = str(plan)
    for line in (text + "\n" + plan.explain()).splitlines():
        assert len(line) <= WIDTH, line
    for key in ("config", "mesh", "zero", "batch", "schedule", "recompute", "compression", "predicted", "memory"):
        assert any(line.startswith(f"  {key} ") for line in text.splitlines()), key
    assert "stage 1: optimizer state sharded over 2 data-parallel replicas" in text
    assert "32 samples per step = 2 replicas x 1 microbatch of 16" in text
    assert "node 0: ranks 0-3; node 1: ranks 4-7" in text
    assert "of device" in text and "peak" in text  # memory per pipeline rank against capacity


def test_explain_names_hand_configurations_and_the_declarations_cost(small):
    plan = compile(small, "2x4xA100-80GB", global_batch_size=32, tp=2, pp=2)
    assert [b.name for b in plan.baselines] == ["pure data parallel", "ZeRO-3 only", "Megatron tp=4"]
    assert all(b.fits and b.config is not None for b in plan.baselines)
    megatron = plan.baselines[2].config
    assert (megatron.tp, megatron.pp, megatron.zero_stage <= 1) == (4, 1, True)  # one stage fits this small model
    text = flat(plan.explain())
    assert "- pure data parallel (dp8 tp1 pp1 zero0" in text and "- ZeRO-3 only (dp8 tp1 pp1 zero3" in text
    assert "- Megatron tp=4 (dp2 tp4 pp1" in text and "this plan is" in text
    # The unpinned optimum breaks the pins, and the plan says by how much it would be faster.
    violation = [a for a in plan.rejected if a.why.startswith("violates")]
    assert len(violation) == 1 and violation[0].fits and (violation[0].config.tp, violation[0].config.pp) != (2, 2)
    assert "violates declared tp=2" in text and "% faster; it has tp=1" in text
    assert "but the declarations rule it out" in text


def test_faster_configurations_that_do_not_fit_are_runners_up(xl):
    # 256 samples: with attention costed as a fused kernel (O(s) memory), 64 leave every faster microbatch room
    plan = compile(xl, "8xA100-40GB", global_batch_size=256)
    over = [a for a in plan.rejected if not a.fits]
    assert over, "gpt2_xl on 40 GB devices: a larger microbatch would be faster but does not fit"
    for a in over:  # the device less the caching allocator's slack for the candidate's recompute mode
        cap = 40 * 2**30 / allocator_slack(a.config.recompute, a.config.recompute_blocks)
        assert a.peak_memory_bytes > cap and a.step_time_s < plan.predicted.search_step_time_s
        assert a.why.startswith(f"out of memory by {(a.peak_memory_bytes - cap) / 2**30:.1f} GiB")
    text = flat(plan.explain())
    assert "out of memory by" in text and re.search(r"GiB per rank of the \d+\.\d GiB allowed", text)
    assert "~: a balanced cut" in str(plan)
    assert not any(a.why.startswith("violates") for a in plan.rejected)  # nothing pinned
    assert Plan.from_json(plan.to_json()) == plan


def test_hand_configurations_that_cannot_exist_say_why(small):
    plan = compile(small, "local:6", global_batch_size=30)
    megatron = plan.baselines[2]
    assert megatron.config is None and "tp=6 does not divide the heads" in megatron.note
    assert "- Megatron tp=6: not possible here: tp=6 does not divide the heads" in flat(plan.explain())
    odd = compile(small, "local:4", global_batch_size=6)
    dp = odd.baselines[0]
    assert dp.config is None and dp.note == "the global batch 6 does not split over 4 replicas"


def test_new_fields_round_trip_and_older_plans_load(small):
    plan = compile(small, "2x4xA100-80GB", global_batch_size=32, tp=2, pp=2)
    assert plan.rejected and plan.baselines and plan.predicted.search_step_time_s > 0
    assert Plan.from_json(plan.to_json()) == plan
    older = json.loads(plan.to_json())
    del older["rejected"], older["baselines"], older["predicted"]["search_step_time_s"]
    old = Plan.from_json(json.dumps(older))
    assert old.rejected == () and old.baselines == () and old.predicted.search_step_time_s == 0.0
    assert "Against the usual hand configurations" not in old.explain() and "runners-up" in str(old)
