"""Gradient compression as a plan dimension: chosen where data-parallel traffic is exposed, pinned on
request, refused where the runtime cannot run it, saved and printed with the plan."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cost_models.comm import CommModel
from cost_models.compression import all_reduce_time, wire_bytes
from cost_models.powersgd import low_rank
from examples import gpt as gpt_mod
from partitioner import DeclarationError, Plan, Topology, compile, trace
from partitioner.cli.common import compression_arg as _compression_arg

GB = 512  # global batch of gpt3_1_3b (seq 2048), as GPT-3 XL was trained (Brown et al. 2020, table 2.1)
SLOW = Topology(nodes=4, devices_per_node=8, device="H100-80GB", inter_node_GBps=1.25)  # 10 Gb/s between nodes
PIN_NAMES = ("dp", "tp", "pp", "zero_stage", "microbatch_size", "schedule", "interleave", "recompute")


@pytest.fixture(scope="module")
def fast_plan(gpt3_xl) -> Plan:
    return compile(gpt3_xl, "4x8xH100-80GB", global_batch_size=GB)


@pytest.fixture(scope="module")
def slow_plan(gpt3_xl) -> Plan:
    return compile(gpt3_xl, SLOW, global_batch_size=GB)


def same_config(plan: Plan) -> dict:
    return {k: getattr(plan.config, k) for k in PIN_NAMES}


def test_fast_interconnect_compresses_nothing(fast_plan):
    assert fast_plan.compression == {"intra_node": "none", "inter_node": "none"}
    assert fast_plan.predicted.compression_saving_s == 0.0
    assert "  compression  none" in str(fast_plan)


def test_slow_inter_node_links_compress_the_inter_node_reduction(gpt3_xl, slow_plan):
    assert slow_plan.dp > 1 and slow_plan.zero_stage in (0, 1)
    assert slow_plan.compression["inter_node"] in ("int8", "int4", "powersgd")
    assert slow_plan.compression["intra_node"] == "none"  # NVLink is not the bottleneck of the pipelined reduction
    plain = compile(gpt3_xl, SLOW, global_batch_size=GB, compression="none", **same_config(slow_plan))
    assert plain.compression == {"intra_node": "none", "inter_node": "none"}
    assert slow_plan.predicted.step_time_s < plain.predicted.step_time_s
    assert slow_plan.predicted.compression_saving_s == pytest.approx(
        plain.predicted.step_time_s - slow_plan.predicted.step_time_s, rel=1e-9)
    # and it beats the best uncompressed plan, whatever its configuration
    assert slow_plan.predicted.step_time_s < compile(gpt3_xl, SLOW, global_batch_size=GB,
                                                     compression="none").predicted.step_time_s
    line = next(x for x in str(slow_plan).splitlines() if x.strip().startswith("compression"))
    assert f"inter_node {slow_plan.compression['inter_node']} (saves" in line and "intra_node" not in line


def test_under_fp32_the_planner_compresses_only_what_is_pinned(gpt3_xl):
    """precision="fp32" is fp32 end to end: on the link where bf16-mixed compresses, the fp32 plan does not,
    though compressing its own configuration would be faster; a level pinned under fp32 compresses."""
    free = compile(gpt3_xl, VERY_SLOW, global_batch_size=GB, precision="fp32", zero_stage=0)  # DDP: one a level
    assert free.dp > 1 and free.compression == {"intra_node": "none", "inter_node": "none"}
    assert all(a.compression == free.compression for a in free.alternatives)
    pins = dict(same_config(free), precision="fp32")
    pinned = compile(gpt3_xl, VERY_SLOW, global_batch_size=GB, compression={"inter_node": "int8"}, **pins)
    assert pinned.compression == {"intra_node": "none", "inter_node": "int8"}
    assert pinned.predicted.step_time_s < free.predicted.step_time_s  # it would pay: only the declaration says no


def test_pins_are_honoured_string_and_dict(gpt3_xl, slow_plan):
    pins = same_config(slow_plan)
    everywhere = compile(gpt3_xl, SLOW, global_batch_size=GB, compression="int8", **pins)
    assert everywhere.compression == {"intra_node": "int8", "inter_node": "int8"}
    assert everywhere.declarations["compression"] == {"intra_node": "int8", "inter_node": "int8"}
    per_level = compile(gpt3_xl, SLOW, global_batch_size=GB, compression={"inter_node": "bf16"}, **pins)
    assert per_level.compression == {"intra_node": "none", "inter_node": "bf16"}
    # intra_node pinned, inter_node still the planner's
    free_inter = compile(gpt3_xl, SLOW, global_batch_size=GB, compression={"intra_node": "none"}, **pins)
    assert free_inter.compression == slow_plan.compression


def test_a_pinned_compressor_is_honoured_whatever_the_zero_stage(gpt3_xl):
    plan = compile(gpt3_xl, "4x8xH100-80GB", global_batch_size=GB, compression="int8")
    assert plan.compression == {"intra_node": "int8", "inter_node": "int8"}
    assert all(a.compression == plan.compression for a in plan.alternatives if a.config.dp > 1)


@pytest.mark.parametrize("value, match", [
    ("int2", r"compression='int2': must be one of 'none', 'bf16', 'int8', 'int4', 'powersgd'"),
    ({"inter_node": "fp8"}, r"compression\['inter_node'\]='fp8': must be one of"),
    ({"rack": "int8"}, r"compression: unknown link level\(s\) 'rack'; the levels are 'intra_node', 'inter_node'"),
    (8, r"compression=8: must be None .* or a dict link level -> name"),
])
def test_bad_compression_is_refused_naming_the_field(gpt3_xl, value, match):
    with pytest.raises(DeclarationError, match=match):
        compile(gpt3_xl, SLOW, global_batch_size=GB, compression=value)


def test_compressors_the_runtime_cannot_run_with_the_pins_are_refused(gpt3_xl):
    for z in (2, 3):
        with pytest.raises(DeclarationError, match=rf"with zero_stage={z}: PowerSGD \(inter_node\) runs on the "
                                                   r"DDP/ZeRO-1 gradient all-reduce only.* pin zero_stage=0 or 1"):
            compile(gpt3_xl, SLOW, global_batch_size=GB, compression={"inter_node": "powersgd"}, zero_stage=z)
    # across both levels PowerSGD runs only as (intra none, inter powersgd)
    with pytest.raises(DeclarationError, match=r"runs PowerSGD only across nodes.*pin compression=\{'inter_node': "
                                               r"'powersgd'\} \(e\.g\. dp32 .*crosses intra_node and inter_node\)"):
        compile(gpt3_xl, SLOW, global_batch_size=GB, compression="powersgd", dp=32)
    with pytest.raises(DeclarationError, match=r"with dp=1: there is no data-parallel gradient reduction"):
        compile(gpt3_xl, SLOW, global_batch_size=GB, compression={"inter_node": "int4"}, dp=1)


def test_without_data_parallel_traffic_nothing_is_compressed(gpt3_xl):
    # Decision: a pinned compressor applies where data-parallel gradient traffic crosses its level; a plan
    # whose group does not cross it records "none" there (the pin stays in plan.declarations). Only an
    # explicit contradiction (dp=1 or zero_stage >= 2 pinned with a compressor) is refused.
    one_node = compile(gpt3_xl, "8xH100-80GB", global_batch_size=GB, compression={"inter_node": "int8"})
    assert one_node.compression == {"intra_node": "none", "inter_node": "none"} or one_node.dp == 1
    assert one_node.declarations["compression"] == {"inter_node": "int8"}
    assert "pinned inter_node int8: no data-parallel gradient reduction crosses that level" in str(one_node)
    no_dp = compile(gpt3_xl, "4x8xH100-80GB", global_batch_size=GB, tp=8, pp=4)
    assert no_dp.dp == 1 and no_dp.compression == {"intra_node": "none", "inter_node": "none"}


def test_json_round_trip_and_older_plans_load(slow_plan):
    again = Plan.from_json(slow_plan.to_json())
    assert again == slow_plan and again.compression == slow_plan.compression
    assert again.predicted.compression_saving_s == slow_plan.predicted.compression_saving_s
    import json
    older = json.loads(slow_plan.to_json())
    del older["compression"], older["predicted"]["compression_saving_s"]
    for alt in older["alternatives"]:
        del alt["compression"]
    old = Plan.from_json(json.dumps(older))
    assert old.compression == {"intra_node": "none", "inter_node": "none"}
    bad = json.loads(slow_plan.to_json())
    bad["compression"]["inter_node"] = "int3"
    with pytest.raises(ValueError, match=r"plan.compression\['inter_node'\]: 'int3' is not one of"):
        Plan.from_json(json.dumps(bad))


def test_cost_model_bytes_and_hierarchy():
    assert [wire_bytes(c) for c in ("none", "bf16", "int8", "int4")] == [4, 2, 1 + 4 / 256, 0.5 + 4 / 256]
    assert wire_bytes("bf16", reduce_bytes=2) == 2  # bf16 gradients on the wire already: bf16 saves nothing
    cm = CommModel(SLOW)
    n = 1.3e9
    none = all_reduce_time(n, range(32), cm, {"intra_node": "none", "inter_node": "none"})
    inter = all_reduce_time(n, range(32), cm, {"intra_node": "none", "inter_node": "int8"})
    both = all_reduce_time(n, range(32), cm, {"intra_node": "int8", "inter_node": "int8"})
    assert none.kernel_s == 0 and inter.wire_s < none.wire_s / 3
    # NVLink is not the bottleneck: compressing it too adds kernel time, saves (almost) no wire time
    assert both.wire_s == pytest.approx(inter.wire_s, rel=0.01) and both.kernel_s > inter.kernel_s
    one_node = all_reduce_time(n, range(8), cm, {"intra_node": "int4", "inter_node": "int8"})
    flat = all_reduce_time(n, range(8), cm, {"intra_node": "int4", "inter_node": "none"})
    assert one_node == flat  # a group inside one node ignores the inter_node compressor


def test_cli_flag_parses_names_and_levels():
    assert _compression_arg("int8") == "int8"
    assert _compression_arg("inter_node=int8,intra_node=none") == {"inter_node": "int8", "intra_node": "none"}
    with pytest.raises(DeclarationError, match="is not LEVEL=NAME"):
        _compression_arg("inter_node=int8,int4")


# ---- PowerSGD ---------------------------------------------------------------------------------------------------
VERY_SLOW = Topology(nodes=4, devices_per_node=8, device="H100-80GB", inter_node_GBps=0.125)  # 1 Gb/s between nodes


def test_a_very_slow_inter_node_link_makes_ddp_compress_hard(gpt3_xl):
    plan = compile(gpt3_xl, VERY_SLOW, global_batch_size=GB, zero_stage=0)
    assert plan.compression["intra_node"] == "none" and plan.compression["inter_node"] in ("powersgd", "int4")
    plain = compile(gpt3_xl, VERY_SLOW, global_batch_size=GB, compression="none", **same_config(plan))
    assert plan.predicted.step_time_s < plain.predicted.step_time_s / 2  # a real gain: the plain one waits on 1 Gb/s
    assert plan.predicted.compression_saving_s > 1.0


def psgd_numel(shape: tuple[int, ...], r: int = 4) -> int:
    """Elements PowerSGD all-reduces for one gradient, by the runtime's rule (r (n + m), or all of it)."""
    n, m = (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))
    return r * (n + m) if len(shape) >= 2 and n * m >= 2 * r * (n + m) else n * m


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = gpt_mod.gpt_tiny()
    return model, trace(model, gpt_mod.example_batch(model, 4))


def test_powersgd_pinned_on_one_node_runs_flat_inside_it(tiny):
    _, g = tiny
    plan = compile(g, "local:4", global_batch_size=16, compression="powersgd", tp=1, pp=1)
    assert plan.dp == 4 and plan.zero_stage in (0, 1)
    assert plan.compression == {"intra_node": "powersgd", "inter_node": "none"}
    assert "intra_node powersgd (" in str(plan) and "rank-4 PowerSGD" in str(plan)
    assert Plan.from_json(plan.to_json()) == plan


def test_powersgd_wire_bytes_match_the_parameter_shapes(tiny):
    model, g = tiny
    params = dict(model.named_parameters())  # unique tensors: the tied embedding/LM head once
    numel = sum(p.numel() for p in params.values())
    wire = sum(psgd_numel(tuple(p.shape)) for p in params.values())
    assert 0.01 < wire / numel < 0.5  # the hand computation compresses something, not everything
    pins = {"dp": 4, "tp": 1, "pp": 1, "zero_stage": 0, "microbatch_size": 4}
    plan = compile(g, "local:4", global_batch_size=16, compression="powersgd", **pins)
    assert plan.stages[0].num_params == numel
    # a ring all-reduce of the P, Q factors and the uncompressed rest: 2 (p-1)/p of them in fp32
    assert plan.predicted.bytes_per_link["intra_node"] == pytest.approx(2 * 3 / 4 * 4 * wire, rel=1e-9)


def test_powersgd_under_tensor_parallelism_uses_the_local_shapes(tiny):
    _, g = tiny
    pins = {"dp": 2, "tp": 2, "pp": 1, "zero_stage": 0, "microbatch_size": 2}
    psgd = compile(g, "local:4", global_batch_size=16, compression="powersgd", **pins)
    plain = compile(g, "local:4", global_batch_size=16, compression="none", **pins)
    shapes = {pl.param: list(pl.shape) for pl in psgd.placements}
    for pl in psgd.placements:
        if pl.spec != "R":
            shapes[pl.param][int(pl.spec[2:-1])] //= 2
    local = sum(math.prod(s) for s in shapes.values())
    wire = sum(psgd_numel(tuple(s)) for s in shapes.values())
    assert psgd.stages[0].num_params == local
    # same tensor-parallel traffic in both; the data-parallel all-reduce of 2 ranks sends n fp32 vs the factors
    saved = plain.predicted.bytes_per_link["intra_node"] - psgd.predicted.bytes_per_link["intra_node"]
    assert saved == pytest.approx(2 * 1 / 2 * 4 * (local - wire), rel=1e-9)


def test_powersgd_cost_model_needs_shapes_and_the_one_hierarchical_form():
    cm = CommModel(SLOW)
    lr = low_rank([(2048, 8192)] * 24 + [(2048,)] * 24)
    assert lr.fraction == pytest.approx((24 * 4 * (2048 + 8192) + 24 * 2048) / lr.numel)
    with pytest.raises(ValueError, match="pass low_rank"):
        all_reduce_time(lr.numel, range(32), cm, {"inter_node": "powersgd"})
    with pytest.raises(ValueError, match="only as intra_node 'none', inter_node 'powersgd'"):
        all_reduce_time(lr.numel, range(32), cm, {"intra_node": "powersgd", "inter_node": "none"}, low_rank=lr)
    hier = all_reduce_time(lr.numel, range(32), cm, {"inter_node": "powersgd"}, low_rank=lr)
    int4 = all_reduce_time(lr.numel, range(32), cm, {"inter_node": "int4"})
    assert hier.wire_s < int4.wire_s and hier.kernel_s > int4.kernel_s  # fewer bytes, more matrix work
    assert wire_bytes("powersgd", low_rank=lr) == pytest.approx(4 * lr.fraction)


def test_powersgd_products_run_at_their_measured_rate():
    """lowrank_eff (partitioner probe: a matrix by r columns against the elementwise ops) slows the three product
    passes alone: at 1/4 of the elementwise rate the six passes cost 3 x 4 + 3 = 15 where they cost 6."""
    from cost_models.calibration import Calibration
    from cost_models.memory import DDP_BUCKET_BYTES
    from cost_models.powersgd import powersgd_kernel_time

    topo = Topology.parse("local:4")
    lr = low_rank([(1024, 1024)] * 8)
    streaming = dataclasses.replace(Calibration.for_device("CPU"), lowrank_eff=1.0)
    slow = dataclasses.replace(streaming, lowrank_eff=0.25)
    batches = min(lr.matrices, math.ceil(4 * lr.numel / DDP_BUCKET_BYTES))  # 10 launches each
    body = [powersgd_kernel_time(lr, CommModel(topo, c)) - c.compress_launch_s - 10 * batches * c.launch_overhead_s
            for c in (streaming, slow)]
    assert body[1] / body[0] == pytest.approx(15 / 6)
