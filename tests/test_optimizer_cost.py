"""The optimizer step's cost (cost_models/optimizer.py): its bytes per parameter by optimizer and precision, and
the time a stage's tail charges for it, against the closed form."""

from __future__ import annotations

import pytest

from cost_models.calibration import Calibration
from cost_models.errors import PartitionerError
from cost_models.optimizer import gradient_buffer_bytes, optimizer_bytes_per_s, optimizer_step_bytes
from partitioner import Topology
from partitioner.planner.declarations import Declarations
from partitioner.planner.search import enumerate_candidates
from partitioner.planner.stage_costs import StageEvaluator
from partitioner.planner.tensor_split import find_splits
from partitioner.planner.unit_costs import CostContext


@pytest.mark.parametrize("optimizer,precision,per_param", [
    ("adam", "fp32", 28), ("adamw", "fp32", 28), ("adam", "bf16-mixed", 28), ("adam", "fp8-mixed", 28),
    ("adam", "bf16", 14), ("sgd", "fp32", 12), ("sgd-momentum", "fp32", 20), ("sgd", "bf16", 6),
])
def test_bytes_per_parameter(optimizer, precision, per_param):
    assert optimizer_step_bytes(optimizer, precision) == per_param


def test_unknown_optimizer_or_precision_is_refused_naming_the_choices():
    with pytest.raises(PartitionerError, match=r"'lion' is not one of \['adam', 'adamw', 'sgd', 'sgd-momentum'\]"):
        optimizer_step_bytes("lion", "fp32")
    with pytest.raises(PartitionerError, match="precision='int8'"):
        optimizer_step_bytes("adam", "int8")


def _stage(g, *, optimizer="adam", precision="fp32", cal=None, dp=1, zero_stage=0):
    """The one stage's StageCost on dp x A100s, and the elementwise rate its engine's buffers are priced at."""
    topo = Topology.parse(f"{dp}xA100-80GB")
    splits = find_splits(g)
    ctx = CostContext(g, topo, splits, precision=precision, optimizer=optimizer, seq_len=g.traced_seq_len,
                      memory_cap=topo.device.memory_bytes, calibration=cal)
    decl = Declarations(global_batch_size=8, dp=dp, tp=1, pp=1, zero_stage=zero_stage, microbatch_size=8 // dp)
    cand = next(iter(enumerate_candidates(decl, world_size=dp, devices_per_node=dp, num_units=len(ctx.units),
                                          valid_tp=(1,))))
    ev = StageEvaluator(ctx, cand)
    return ev.stage(0, len(ctx.units), 0), topo.device.hbm_bytes_per_s * ctx.cal.device_speed * ctx.cal.mem_eff


def _optimizer_s(g, *, optimizer="adam", precision="fp32", cal=None, dp=1, zero_stage=0) -> tuple[float, float]:
    """(the optimizer step's seconds in the one stage's tail, the parameters it holds) on dp x A100s: the tail
    less its exposed communication and the engine's per-step work on its buffers (the test below)."""
    st, rate = _stage(g, optimizer=optimizer, precision=precision, cal=cal, dp=dp, zero_stage=zero_stage)
    settle = st.params * gradient_buffer_bytes(precision, zero_stage)[1] / rate
    return st.tail_s - st.exposed_comm_s - settle, st.params


@pytest.mark.parametrize("precision,zero_stage", [("fp32", 0), ("bf16-mixed", 0), ("bf16-mixed", 2),
                                                  ("bf16-mixed", 3)])
def test_the_engines_gradient_buffers_are_charged_per_microbatch_and_per_step(meta_gpt_graph, precision, zero_stage,
                                                                             monkeypatch):
    """Each microbatch's gradients added into the engine's buckets lengthen the backward; the step's zeroing and
    master copy lengthen the tail (cost_models.optimizer.gradient_buffer_bytes, at the elementwise rate)."""
    import partitioner.planner.stage_costs as stage_costs

    cal = Calibration(mem_eff=0.5)
    per_mb, per_step = gradient_buffer_bytes(precision, zero_stage)
    assert per_mb > 0 and (per_step > 0) == (zero_stage <= 1)
    st, rate = _stage(meta_gpt_graph, precision=precision, cal=cal, dp=2, zero_stage=zero_stage)
    monkeypatch.setattr(stage_costs, "gradient_buffer_bytes", lambda precision, zero_stage: (0, 0))
    bare, _ = _stage(meta_gpt_graph, precision=precision, cal=cal, dp=2, zero_stage=zero_stage)
    assert st.forward_s == bare.forward_s
    assert st.backward_s - bare.backward_s == pytest.approx(st.params * per_mb / rate, rel=1e-9)
    shard = st.params / (2 if zero_stage else 1)
    optim = shard * optimizer_step_bytes("adam", precision) / optimizer_bytes_per_s(
        "adam", Topology.parse("2xA100-80GB").device, cal)
    assert st.tail_s - st.exposed_comm_s == pytest.approx(optim + st.params * per_step / rate, rel=1e-9)


def test_the_stage_tail_charges_the_closed_form(meta_gpt_graph):
    cal = Calibration(optimizer_eff=0.25, device_speed=2.0)
    t, params = _optimizer_s(meta_gpt_graph, cal=cal)
    assert t == pytest.approx(params * 28 / (2039e9 * 2.0 * 0.25), rel=1e-12)  # A100-80GB: 2,039 GB/s
    assert optimizer_bytes_per_s("adam", Topology.parse("1xA100-80GB").device, cal) == pytest.approx(2039e9 * 0.5)


def test_optimizer_time_scales_with_the_factor_the_bytes_and_zero(meta_gpt_graph):
    adam, _ = _optimizer_s(meta_gpt_graph, cal=Calibration(optimizer_eff=0.3))
    slower, _ = _optimizer_s(meta_gpt_graph, cal=Calibration(optimizer_eff=0.15))
    assert slower == pytest.approx(2 * adam, rel=1e-12)
    # mem_eff prices the elementwise ops, not the optimizer step
    same = _optimizer_s(meta_gpt_graph, cal=Calibration(optimizer_eff=0.3, mem_eff=0.4))[0]
    assert same == pytest.approx(adam, rel=1e-12)
    # plain SGD: 12 B, one kernel at the elementwise rate
    sgd, _ = _optimizer_s(meta_gpt_graph, optimizer="sgd", cal=Calibration(optimizer_eff=0.3, mem_eff=0.6))
    assert sgd == pytest.approx(adam * 12 / 28 * 0.3 / 0.6, rel=1e-12) and sgd < adam
    assert _optimizer_s(meta_gpt_graph, optimizer="sgd", cal=Calibration(optimizer_eff=0.3, mem_eff=0.3))[0] == \
        pytest.approx(adam * 12 / 28, rel=1e-12)
    assert _optimizer_s(meta_gpt_graph, optimizer="adamw", cal=Calibration(optimizer_eff=0.3))[0] == pytest.approx(adam)
    pure, _ = _optimizer_s(meta_gpt_graph, precision="bf16", cal=Calibration(optimizer_eff=0.3))
    assert pure == pytest.approx(adam / 2, rel=1e-12)
    # ZeRO >= 1 steps this rank's shard only
    sharded, _ = _optimizer_s(meta_gpt_graph, cal=Calibration(optimizer_eff=0.3), dp=2, zero_stage=1)
    assert sharded == pytest.approx(adam / 2, rel=1e-12)
