"""Calibration and the roofline compute model, against hand-computed values."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cost_models.calibration import Calibration, saturating_efficiency
from cost_models.compute import (OP_CLASSES, ComputeModel, RooflineCompute, dtype_for)
from cost_models.errors import PartitionerError
from cost_models.specs import DeviceSpec

# Round numbers close to an A100-80GB, so the expected values are easy to check.
DEV = DeviceSpec(name="test-gpu", peak_flops={"bf16": 312e12, "fp16": 312e12},
                 memory_bytes=80 * 10**9, hbm_bytes_per_s=2e12,
                 nvlink_bytes_per_s=300e9, nic_bytes_per_s=25e9)
NO_LAUNCH = Calibration(launch_overhead_s=0.0)
A100 = DeviceSpec(name="a100-like", peak_flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12},
                  memory_bytes=80 * 10**9, hbm_bytes_per_s=2e12,
                  nvlink_bytes_per_s=300e9, nic_bytes_per_s=25e9)


# --- the efficiency curve ---------------------------------------------------
def test_curve_is_half_at_half_flops_and_saturates():
    assert saturating_efficiency(1e9, eff_max=0.8, half_flops=1e9) == pytest.approx(0.4)
    assert saturating_efficiency(3e9, eff_max=0.8, half_flops=1e9) == pytest.approx(0.6)
    assert saturating_efficiency(1e15, eff_max=0.8, half_flops=1e9) == pytest.approx(0.8, rel=1e-5)
    assert saturating_efficiency(0.0, eff_max=0.8, half_flops=1e9) == 0.0


def test_curve_is_monotone():
    effs = [saturating_efficiency(10.0**k, eff_max=0.75, half_flops=1e9) for k in range(3, 15)]
    assert effs == sorted(effs) and effs[-1] < 0.75


# --- Calibration --------------------------------------------------------------
def test_calibration_defaults_are_in_the_documented_ranges():
    c = Calibration()
    assert 0.7 <= c.matmul_eff_max <= 0.8
    assert c.gemm_half_flops == 1e9          # a 1 GFLOP GEMM runs at half the plateau
    assert c.mem_eff == 0.8
    assert 0 < c.dp_overlap <= 1


def test_calibration_round_trips_through_dict_and_json(tmp_path):
    c = Calibration(matmul_eff_max=0.71, inter_node_bw_eff=0.9, source="fit 2x8xA100")
    assert Calibration.from_dict(c.to_dict()) == c
    path = tmp_path / "cal.json"
    c.save(path)
    assert json.loads(path.read_text())["matmul_eff_max"] == 0.71
    assert Calibration.load(path) == c


def test_calibration_from_partial_dict_keeps_defaults():
    c = Calibration.from_dict({"mem_eff": 0.9})
    assert c.mem_eff == 0.9 and c.matmul_eff_max == Calibration().matmul_eff_max


def test_a_calibration_file_from_before_optimizer_eff_loads_with_the_device_default(tmp_path):
    """Files written before the field existed (a probe's, autotune's) lack it: they load with the default."""
    old = {k: v for k, v in Calibration(mem_eff=0.5, source="probe before").to_dict().items() if k != "optimizer_eff"}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    c = Calibration.load(path)
    assert c.optimizer_eff == Calibration().optimizer_eff and c.mem_eff == 0.5
    assert Calibration.for_device("H200-141GB").optimizer_eff == 0.26  # torch's foreach AdamW measured there


def test_calibration_unknown_keys_are_named():
    with pytest.raises(PartitionerError, match=r"\['mem_efff', 'zzz'\].*valid keys"):
        Calibration.from_dict({"mem_efff": 0.9, "zzz": 1, "dp_overlap": 0.5})


@pytest.mark.parametrize("field,value", [("mem_eff", 1.5), ("matmul_eff_max", 0.0), ("optimizer_eff", 0.0),
                                         ("dp_overlap", -0.1), ("gemm_half_flops", 0.0),
                                         ("launch_overhead_s", -1e-6),
                                         ("intra_node_bw_eff", "fast"),
                                         ("inter_node_extra_latency_s", float("nan"))])
def test_calibration_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(PartitionerError, match=field):
        Calibration(**{field: value})


def test_calibration_load_rejects_non_object(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text("[1, 2]")
    with pytest.raises(PartitionerError, match="JSON object"):
        Calibration.load(path)
    path.write_text("{not json")
    with pytest.raises(PartitionerError, match="not valid JSON"):
        Calibration.load(path)


def test_calibration_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Calibration().mem_eff = 0.5  # type: ignore[misc]


# --- RooflineCompute -------------------------------------------------------------
def test_large_matmul_is_compute_bound_near_plateau():
    m = RooflineCompute(DEV, "bf16", NO_LAUNCH)
    # eff = 0.75 * 1e12 / (1e12 + 1e9); t = 1e12 / (312e12 * eff) = 1.001e12 / 2.34e14
    assert m.op_time(1e12, 1e8, "matmul") == pytest.approx(1.001e12 / 2.34e14)


def test_one_gflop_matmul_runs_at_half_efficiency():
    cal = Calibration(matmul_eff_max=0.8, launch_overhead_s=0.0)
    m = RooflineCompute(DEV, "bf16", cal)
    assert m.compute_efficiency("matmul", 1e9) == pytest.approx(0.4)
    assert m.op_time(1e9, 0.0, "matmul") == pytest.approx(1e9 / (312e12 * 0.4))  # 8.01 us


def test_elementwise_is_bandwidth_bound_plus_launch():
    m = RooflineCompute(DEV, "bf16")  # default launch 5 us, mem_eff 0.8
    # 1 GB read + written at 2e12 * 0.8 B/s = 625 us; 1 MFLOP is negligible.
    assert m.op_time(1e6, 1e9, "elementwise") == pytest.approx(625e-6 + 5e-6)


def test_memory_bound_matmul_takes_the_memory_time():
    m = RooflineCompute(DEV, "bf16", NO_LAUNCH)
    # 1 GFLOP at eff 0.375 is 8.5 us, but 4 GB of bytes at 1.6e12 B/s is 2.5 ms.
    assert m.op_time(1e9, 4e9, "matmul") == pytest.approx(4e9 / 1.6e12)


def test_vector_ops_run_at_the_fp32_cuda_core_peak():
    m = RooflineCompute(A100, "bf16", NO_LAUNCH)
    # 1 TFLOP of elementwise math at the 19.5e12 FLOP/s fp32 peak, not 312e12.
    assert m.op_time(1e12, 0.0, "reduction") == pytest.approx(1e12 / 19.5e12)
    half = RooflineCompute(A100, "bf16", Calibration(vector_eff=0.5, launch_overhead_s=0.0))
    assert half.op_time(1e12, 0.0, "reduction") == pytest.approx(2e12 / 19.5e12)
    # A device without an fp32 entry falls back to the dtype's peak.
    assert RooflineCompute(DEV, "bf16", NO_LAUNCH).op_time(1e12, 0.0, "other") \
        == pytest.approx(1e12 / 312e12)


def test_empty_op_costs_the_launch_only():
    assert RooflineCompute(DEV, "bf16").op_time(0.0, 0.0, "other") == pytest.approx(5e-6)


def test_every_op_class_is_accepted_and_bigger_ops_take_longer():
    m = RooflineCompute(DEV, "bf16")
    for op_class in OP_CLASSES:
        assert m.op_time(1e9, 1e6, op_class) < m.op_time(1e11, 1e8, op_class)


def test_bad_inputs_raise_partitioner_error():
    m = RooflineCompute(DEV, "bf16")
    with pytest.raises(PartitionerError, match=r"op_class='gemm'.*matmul"):
        m.op_time(1.0, 1.0, "gemm")
    with pytest.raises(PartitionerError, match="flops >= 0"):
        m.op_time(-1.0, 0.0, "matmul")
    with pytest.raises(PartitionerError, match=r"fp8.*\['bf16', 'fp16'\]"):
        RooflineCompute(DEV, "fp8")


def test_roofline_satisfies_the_protocol():
    assert isinstance(RooflineCompute(DEV, "bf16"), ComputeModel)


def test_dtype_for():
    assert dtype_for("fp32") == "fp32"
    assert dtype_for("bf16-mixed") == "bf16"
    assert dtype_for("fp16-mixed") == "fp16"
    assert dtype_for("bf16") == "bf16"  # pure bf16 (parameters, gradients and state in bf16) computes in bf16 too
    with pytest.raises(PartitionerError, match=r"precision='bfloat16'.*bf16-mixed"):
        dtype_for("bfloat16")


# --- fp32 and TF32 -----------------------------------------------------------------


def test_fp32_matmul_uses_tf32_only_when_enabled():
    plain = RooflineCompute(A100, "fp32", NO_LAUNCH)
    tf32 = RooflineCompute(A100, "fp32", NO_LAUNCH, tf32_matmuls=True)
    assert plain.peak_flops("matmul") == 19.5e12
    assert tf32.peak_flops("matmul") == 156e12
    assert tf32.peak_flops("elementwise") == 19.5e12     # CUDA-core ops stay fp32
    assert plain.op_time(1e12, 0, "matmul") == pytest.approx(8 * tf32.op_time(1e12, 0, "matmul"))


def test_dtype_aliases_are_canonical():
    assert RooflineCompute(A100, "bfloat16").dtype == "bf16"
    with pytest.raises(PartitionerError, match="float128"):
        RooflineCompute(A100, "float128")


def test_on_a_preset_device():
    from cost_models.devices import get_device
    m = RooflineCompute(get_device("H100-80GB"), dtype_for("bf16-mixed"))
    big, small = m.op_time(1e13, 1e9, "matmul"), m.op_time(1e9, 1e6, "matmul")
    assert m.compute_efficiency("matmul", 1e13) > 0.7 > 0.4 > m.compute_efficiency("matmul", 1e9)
    assert big / small > 1000
