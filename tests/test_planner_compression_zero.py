"""Compression at ZeRO-2/3: the gradient reduce-scatter flat over the group with one compressor, int8 parameter
gathers at ZeRO-3 under int8/int4 (weights quantized only where the user pinned it), never PowerSGD."""

from __future__ import annotations

import pytest
import torch

from cost_models.comm import CommModel
from cost_models.compression import (
    GATHER_CODE_BYTES,
    gather_time,
    reduce_scatter_time,
    wire_bytes,
)
from examples import gpt as gpt_mod
from partitioner import DeclarationError, OpGraph, PlanInfeasibleError, Topology, compile, trace
from test_planner_compression import GB, SLOW

ONE_PER_NODE = Topology(nodes=4, devices_per_node=1, device="H100-80GB", inter_node_GBps=1.25)
INT8 = 1 + 4 / 256


@pytest.fixture(scope="module")
def tiny() -> OpGraph:
    torch.manual_seed(0)
    model = gpt_mod.gpt_tiny()
    return trace(model, gpt_mod.example_batch(model, 4))


def dp_bytes(g: OpGraph, zero: int, compression: str, precision: str) -> tuple[float, float, int]:
    """(bytes one rank sends per step on local:4 with dp=4, its stage's parameters, microbatches)."""
    plan = compile(g, "local:4", global_batch_size=16, precision=precision, compression=compression, dp=4, tp=1,
                   pp=1, zero_stage=zero, microbatch_size=2)
    assert plan.compression == {"intra_node": compression, "inter_node": "none"}
    return plan.predicted.bytes_per_link["intra_node"], plan.stages[0].num_params, plan.config.num_microbatches


@pytest.mark.parametrize("zero", [2, 3])
def test_int8_pinned_at_zero_2_and_3_sends_a_quarter_of_the_gradient_bytes(tiny, zero):
    none, n, m = dp_bytes(tiny, zero, "none", "fp32")
    int8, _, _ = dp_bytes(tiny, zero, "int8", "fp32")
    share = 3 / 4 * n  # of each reduce-scatter or gather, what one of 4 ranks sends
    gathers = 1 if zero == 2 else 2 * m  # ZeRO-2: the updated parameters once; ZeRO-3: every forward and backward
    assert none == pytest.approx(share * (4 + gathers * 4), rel=1e-9)
    # the all-to-all of int8 codes + one fp32 scale per 256; ZeRO-3 gathers int8 weights too, ZeRO-2's stay fp32
    assert int8 == pytest.approx(share * (INT8 + gathers * (INT8 if zero == 3 else 4)), rel=1e-9)
    gradients = (none - share * gathers * 4) / (int8 - share * gathers * (INT8 if zero == 3 else 4))
    assert gradients == pytest.approx(4 / INT8) and gradients > 3.9
    if zero == 3:
        assert none / int8 == pytest.approx(4 / INT8)


def test_zero3_int8_gathers_int8_weights_where_bf16_leaves_them(tiny):
    bf16, n, m = dp_bytes(tiny, 3, "bf16", "bf16-mixed")
    int8, _, _ = dp_bytes(tiny, 3, "int8", "bf16-mixed")
    share = 3 / 4 * n
    assert bf16 == pytest.approx(share * (2 + 2 * m * 2), rel=1e-9)  # bf16 gradients, bf16 weights as before
    assert int8 == pytest.approx(share * (INT8 + 2 * m * INT8), rel=1e-9)
    assert int8 < bf16


def test_the_planner_compresses_zero2_gradients_where_it_pays(gpt3_xl):
    plan = compile(gpt3_xl, ONE_PER_NODE, global_batch_size=GB, zero_stage=2)
    assert plan.compression["inter_node"] in ("bf16", "int8", "int4") and plan.compression["intra_node"] == "none"
    pins = {k: getattr(plan.config, k) for k in ("dp", "tp", "pp", "zero_stage", "microbatch_size", "recompute")}
    plain = compile(gpt3_xl, ONE_PER_NODE, global_batch_size=GB, compression="none", **pins)
    assert plan.predicted.step_time_s < plain.predicted.step_time_s
    assert plan.predicted.compression_saving_s == pytest.approx(
        plain.predicted.step_time_s - plan.predicted.step_time_s, rel=1e-9)
    assert "data-parallel gradient reduce-scatter)" in str(plan)


def test_the_planner_quantizes_zero3_weights_only_when_pinned(gpt3_xl):
    free = compile(gpt3_xl, SLOW, global_batch_size=GB, zero_stage=3)
    assert all(c in ("none", "bf16") for c in free.compression.values())
    assert all(c in ("none", "bf16") for a in free.alternatives for c in a.compression.values())
    pinned = compile(gpt3_xl, SLOW, global_batch_size=GB, zero_stage=3, dp=32, compression={"inter_node": "int8"})
    # a group crossing both levels reduce-scatters flat: the pinned compressor on both
    assert pinned.compression == {"intra_node": "int8", "inter_node": "int8"}
    assert "data-parallel gradient reduce-scatter and int8 parameter all-gathers" in str(pinned)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_2_3_across_both_levels_need_one_compressor(gpt3_xl, zero):
    with pytest.raises(DeclarationError, match=rf"ZeRO-{zero} reduce-scatters flat over the group, which crosses "
                                               r"both link levels: one compressor for both.*\(e\.g\. dp32"):
        compile(gpt3_xl, SLOW, global_batch_size=GB, zero_stage=zero, dp=32,
                compression={"intra_node": "none", "inter_node": "int8"})


def test_cost_model_of_the_compressed_reduce_scatter_and_gathers():
    cm, n = CommModel(SLOW), 1.3e9
    ranks = range(0, 32, 8)  # one rank per node: flat over the inter-node link
    assert reduce_scatter_time(n, ranks, cm, "none").wire_s == cm.reduce_scatter(4 * n, ranks)
    assert reduce_scatter_time(n, ranks, cm, "none").kernel_s == 0
    assert reduce_scatter_time(n, ranks, cm, "bf16").wire_s == cm.reduce_scatter(2 * n, ranks)
    for c in ("int8", "int4"):
        t = reduce_scatter_time(n, ranks, cm, c)
        assert t.wire_s == cm.all_to_all(wire_bytes(c) * n, ranks) and t.kernel_s > 0
    assert reduce_scatter_time(n, ranks, cm, "int4").wire_s < reduce_scatter_time(n, ranks, cm, "none").wire_s / 7
    with pytest.raises(ValueError, match="not ZeRO-2/3's reduce-scatter"):
        reduce_scatter_time(n, ranks, cm, "powersgd")
    bf16 = gather_time(n, ranks, cm, "bf16", param_bytes=2)
    assert bf16.wire_s == cm.all_gather(2 * n, ranks) and bf16.kernel_s == 0
    for c in ("int8", "int4"):  # int4 gradients still gather int8 weights
        t = gather_time(n, ranks, cm, c, param_bytes=2)
        assert t.wire_s == cm.all_gather(GATHER_CODE_BYTES * n, ranks) and t.kernel_s > 0


def test_zero3_takes_the_bf16_reduction_where_only_it_fits(tiny):
    """A ZeRO-3 unit's bf16 reduction takes its 16-bit gradient, not an fp32 copy (runtime.engines.zero3): the peak
    is lower, and with room between the two peaks the planner chooses it to fit, and says so."""
    kw = dict(global_batch_size=16, precision="bf16-mixed", dp=4, tp=1, pp=1, zero_stage=3, microbatch_size=2,
              zero3_unit="block", recompute="none")
    fp32, bf16 = (compile(tiny, "local:4", compression=c, **kw).predicted.peak_memory_bytes for c in ("none", "bf16"))
    assert bf16 < fp32
    room = (fp32 + bf16) / 2 / Topology.parse("local:4").device.memory_bytes
    plan = compile(tiny, "local:4", max_memory_fraction=room, **kw)
    assert plan.compression["intra_node"] == "bf16" and plan.predicted.compression_needed_to_fit
    assert "uncompressed it does not fit" in str(plan)
    assert type(plan).from_json(plan.to_json()).predicted.compression_needed_to_fit  # kept in the plan file
    with pytest.raises(PlanInfeasibleError, match="no plan fits"):
        compile(tiny, "local:4", max_memory_fraction=room, compression="none", **kw)
