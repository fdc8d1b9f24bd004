"""Expert parallelism (ep) as a plan dimension: declarations and refusals, JSON, per-rank costs, search, text.

The runtime's kernels (dispatch, grouped experts, combine, aux loss) are tested in test_expert_parallel.py;
generated programs do not run ep > 1 yet, which test_ep_plans_are_not_runnable pins.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from cost_models.calibration import Calibration
from cost_models.errors import DeclarationError, PartitionerError
from cost_models.topology import Topology
from examples import hf_families
from examples.gpt import example_batch, gpt_tiny
from partitioner import compile, trace
from partitioner.cli.common import plan_options
from partitioner.cli.parser import add_plan_options
from partitioner.codegen.common import CodegenError
from partitioner.planner.declarations import Declarations
from partitioner.planner.expert_split import Experts, edp_ranks, ep_options, ep_ranks, experts_of, rank_imbalance
from partitioner.planner.plan import ParallelConfig, Plan
from partitioner.planner.tensor_split import find_splits
from test_experts import Net  # embedding, blocks of a norm and a list-of-experts MoE, a head
from partitioner.planner.unit_costs import CostContext
from partitioner.tracer.experts import MoELayer

TOKENS = (torch.zeros(2, 16, dtype=torch.long),)


@pytest.fixture(scope="module")
def moe():
    return trace(hf_families.qwen3_moe_seeded(), TOKENS)  # 4 MoE layers of 4 batched experts, top-2


@pytest.fixture(scope="module")
def dense():
    m = gpt_tiny()
    return trace(m, example_batch(m, 2))


def _ctx(g, topology: str, calibration: Calibration | None = None) -> CostContext:
    topo = Topology.coerce(topology)
    return CostContext(g, topo, find_splits(g), precision="bf16-mixed", optimizer="adam", seq_len=g.traced_seq_len,
                       memory_cap=topo.device.memory_bytes, calibration=calibration)


# ---- declarations ----------------------------------------------------------------------------------------
def test_ep_on_a_dense_model_is_refused(dense):
    with pytest.raises(DeclarationError, match=r"ep=2: no MoE layer found in the graph: .*drop ep or pin ep=1"):
        compile(dense, "local:4", global_batch_size=8, ep=2)
    assert compile(dense, "local:2", global_batch_size=4, ep=1, alternatives=0).ep == 1  # ep=1 is harmless


@pytest.mark.parametrize("pins, words", [
    (dict(ep=3, topology="local:6"), ["ep=3 does not divide the number of experts (4 per MoE layer)",
                                      "valid ep: 1, 2, 4"]),
    (dict(ep=4, dp=2), ["ep=4 does not divide dp=2", "multiple of 4"]),
    (dict(ep=4, pp=2), ["ep=4 divides no data-parallel degree", "pin dp to a multiple of 4"]),
    (dict(ep=0), ["ep=0", "an int >= 1"]),
    (dict(ep=2, async_sgd=dict(every=2), precision="fp32"), ["async_sgd", "ep=2", "pin ep=1"]),
])
def test_declarations_refuse_what_ep_cannot_run(moe, pins, words):
    topology = pins.pop("topology", "local:4")
    with pytest.raises(DeclarationError) as e:
        compile(moe, topology, global_batch_size=12 if topology == "local:6" else 8, **pins)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_experts_of_different_shapes_refuse_ep_and_plan_ep1_saying_why():
    g = trace(Net(widths=(32, 32, 32, 48), moe_every=1), TOKENS)
    assert experts_of(g).why_not.startswith(
        "experts of different shapes in layers.0.mlp, layers.1.mlp, layers.2.mlp ...")
    with pytest.raises(DeclarationError, match="ep=2: experts of different shapes in layers.0.mlp, layers.1.mlp"):
        compile(g, "local:4", global_batch_size=8, ep=2)
    plan = compile(g, "local:4", global_batch_size=8, alternatives=0)
    assert plan.ep == 1
    assert "expert parallelism: ep=1 (experts of different shapes" in " ".join(plan.explain().split())
    # the same model with equal experts may take ep > 1
    assert ep_options(Declarations(global_batch_size=8), experts_of(trace(Net(moe_every=1), TOKENS)), dp=4, tp=1, cp=1,
                      devices_per_node=4) == (1, 2, 4)


def test_ep_options_keep_the_search_small_and_in_a_node():
    e = Experts(layers=(MoELayer(module="m", block=0, num_experts=64, top_k=8, router="m.gate.weight",
                                 experts=("m.experts.w",), style="batched", uniform=True, expert_params=1,
                                 combine="c"),))
    d = Declarations(global_batch_size=8)
    assert e.num_experts == 64
    # 1, every degree inside the node (ep * tp <= 8), then the smallest and largest across nodes only
    assert ep_options(d, e, dp=256, tp=2, cp=1, devices_per_node=8) == (1, 2, 4, 8, 64)
    assert ep_options(d, Experts(), dp=256, tp=1, cp=1, devices_per_node=8) == (1,)  # a dense model: ep=1 only
    assert ep_options(dataclasses.replace(d, ep=4), e, dp=6, tp=1, cp=1, devices_per_node=8) == ()


# ---- mesh, JSON ----------------------------------------------------------------------------------------------
def test_ep_groups_are_consecutive_dp_ranks_and_expert_data_parallel_the_rest():
    c = ParallelConfig(dp=8, tp=2, pp=1, zero_stage=1, microbatch_size=1, num_microbatches=1, schedule="1f1b",
                       interleave=1, recompute="none", ep=4)
    assert ep_ranks(c) == (0, 2, 4, 6)  # dp ranks tp apart: in one node of 8 when ep * tp <= 8
    assert edp_ranks(c) == (0, 8)  # the ranks holding rank 0's experts
    assert str(c).startswith("dp8 ep4 tp2 ")


def test_json_round_trip_and_old_plans(moe):
    plan = compile(moe, "local:4", global_batch_size=8, ep=2, alternatives=0)
    data = json.loads(plan.to_json())
    assert data["config"]["ep"] == 2 and "expert parallelism over 2 ranks" in data["expert_parallel"]
    again = Plan.from_json(plan.to_json())
    assert again.config == plan.config and again.ep == 2 and again.to_json() == plan.to_json()
    one = json.loads(compile(moe, "local:4", global_batch_size=8, ep=1, alternatives=0).to_json())
    assert "ep" not in one["config"]  # ep = 1 is left out: plans written before ep keep their hashes
    del data["config"]["ep"], data["expert_parallel"]  # a plan written before ep existed
    old = Plan.from_json(json.dumps(data))
    assert old.ep == 1 and old.expert_parallel == ""


# ---- costs -----------------------------------------------------------------------------------------------
def test_expert_parameters_per_rank_are_divided_by_ep(moe):
    ctx = _ctx(moe, "local:4")
    experts = sum(p.numel for p in moe.params if p.name in ctx.experts.params)
    total = sum(p.numel for p in moe.params)
    assert experts == 4 * 2 * 4 * 64 * 32 * 3 // 2  # 4 layers x 4 experts x (gate_up 64x64 + down 32x64)
    for ep in (1, 2, 4):
        arr = ctx.unit_arrays(1, 2, "none", ep=ep)
        assert arr.par[-1] == pytest.approx(total - experts + experts / ep)
        assert arr.epar[-1] == pytest.approx(experts / ep) if ep > 1 else arr.epar == ()
    plans = {ep: compile(moe, "local:4", global_batch_size=8, dp=4, pp=1, zero_stage=0, ep=ep, alternatives=0)
             for ep in (1, 2, 4)}
    held = {ep: p.stages[0].num_params for ep, p in plans.items()}
    assert held[1] - held[2] == experts // 2 and held[1] - held[4] == experts * 3 // 4
    assert plans[4].predicted.memory.optimizer < plans[2].predicted.memory.optimizer < \
        plans[1].predicted.memory.optimizer


def test_all_to_all_only_with_ep_and_dearer_across_nodes(moe):
    inside, across = _ctx(moe, "1x4xH100-80GB"), _ctx(moe, "2x2xH100-80GB")
    assert inside.expert_exchange_s(2, 1, 1, 1) == 0.0 and inside.expert_bytes(1, 2, 1, 1, 1) == 0.0
    t_in, t_across = inside.expert_exchange_s(2, 1, 1, 4), across.expert_exchange_s(2, 1, 1, 4)
    assert 0 < t_in < t_across
    # per MoE layer and microbatch: 4 all-to-alls of tokens x top-k x hidden x 2 bytes, 3/4 of it sent
    layer_bytes = 2 * 16 * 2 * 64 * 2
    u = next(u for u, (a, b) in enumerate(inside.units) if any(n.name in dict(inside.experts.exchanges)
                                                              for n in moe.nodes[a:b]))
    assert inside.expert_bytes(u, 2, 1, 1, 4) == pytest.approx(4 * 3 / 4 * layer_bytes)
    # the unit with the MoE layer pays them (and its experts run at the busiest rank's load); others do not
    one, four = inside.unit_cost(u, tp=1, mb=2, recompute="none"), inside.unit_cost(u, tp=1, mb=2, recompute="none",
                                                                                     ep=4)
    assert four.forward_s > one.forward_s and four.backward_s > one.backward_s
    plan = compile(moe, "2x2xH100-80GB", global_batch_size=8, dp=4, ep=4, alternatives=0)
    assert plan.predicted.bytes_per_link["inter_node"] > 0 and "across 2 nodes" in " ".join(plan.explain().split())
    plan = compile(moe, "2x2xH100-80GB", global_batch_size=8, dp=4, ep=2, alternatives=0)
    assert plan.predicted.bytes_per_link["intra_node"] > 0 and "inside a node" in " ".join(plan.explain().split())


def test_imbalance_is_a_calibration_factor_seen_only_under_ep(moe):
    with pytest.raises(PartitionerError, match="expert_imbalance = 0.5 must be >= 1"):
        Calibration(expert_imbalance=0.5)
    cal = Calibration.for_device(Topology.coerce("local:4").device.name)
    base, skew = _ctx(moe, "local:4", cal), _ctx(moe, "local:4", dataclasses.replace(cal, expert_imbalance=2.0))
    u = 1  # every block of this model is a MoE layer
    assert base.unit_cost(u, tp=1, mb=2, recompute="none") == skew.unit_cost(u, tp=1, mb=2, recompute="none")
    assert skew.unit_cost(u, tp=1, mb=2, recompute="none", ep=2).forward_s > \
        base.unit_cost(u, tp=1, mb=2, recompute="none", ep=2).forward_s


def test_dense_costs_are_those_without_ep(dense):
    ctx = _ctx(dense, "local:4")
    assert ctx.experts == Experts()
    for u in range(len(ctx.units)):
        assert ctx.unit_cost(u, tp=1, mb=2, recompute="none") == ctx.unit_cost(u, tp=1, mb=2, recompute="none", ep=1)


# ---- search --------------------------------------------------------------------------------------------
def test_search_takes_ep_where_memory_forces_it_and_never_for_a_dense_model(moe, dense):
    pins = dict(global_batch_size=8, dp=4, pp=1, tp=1, zero_stage=0, microbatch_size=2, recompute="none",
                alternatives=0)
    peak = {ep: compile(moe, "1x4xH100-80GB", ep=ep, **pins).predicted.peak_memory_bytes for ep in (1, 2)}
    assert peak[2] < peak[1]
    cap = (peak[1] + peak[2]) / 2 / Topology.coerce("1x4xH100-80GB").device.memory_bytes
    free = compile(moe, "1x4xH100-80GB", max_memory_fraction=cap, **pins)
    assert free.ep > 1 and "the planner's choice" in " ".join(free.explain().split())
    roomy = compile(moe, "1x4xH100-80GB", **pins)
    assert roomy.config.ep in (1, 2, 4) and roomy.search_space == 3  # ep = 1, 2, 4 were the candidates
    plan = compile(dense, "local:4", global_batch_size=8)
    assert plan.ep == 1 and all(a.config.ep == 1 for a in plan.alternatives) and plan.expert_parallel == ""


# ---- text, page, programs ---------------------------------------------------------------------------------
def test_plan_text_and_page_show_ep(moe, tmp_path):
    plan = compile(moe, "local:4", global_batch_size=8, dp=4, ep=2, alternatives=0)
    text = " ".join(str(plan).split())  # rows are wrapped
    assert " ep2 " in str(plan).splitlines()[1] and "pp 1 x dp 4 (ep 2 inside it) x tp 1" in text
    assert "Expert parallelism ep2: each rank holds 1/2 of every MoE layer's experts" in text
    why = " ".join(plan.explain().split())
    assert "expert parallelism over 2 ranks (as declared): each rank holds 2 of the 4 experts" in why
    assert "expert gradients reduced over dp x cp / ep = 2 ranks, dense ones over 4" in why
    page = plan.to_html(tmp_path / "plan.html").read_text()
    assert "expert parallelism over 2 ranks" in page
    assert "experts 2/2 of ep group 1" in page and "expert-parallel groups: 2 consecutive data-parallel" in page


def test_ep_plans_that_cannot_run_are_refused(moe):
    """Programs run ep > 1 in fp32 and bf16-mixed (tests/test_expert_run.py runs them): a pure bf16 plan is
    refused, saying why; verify=True cannot replay the ep group in one process."""
    assert compile(moe, "local:4", global_batch_size=8, ep=2, alternatives=0).program(0).source
    plan = compile(moe, "local:4", global_batch_size=8, ep=2, precision="bf16", alternatives=0)
    with pytest.raises(CodegenError, match="ep=2 with precision='bf16': the expert slices are kept outside"):
        plan.program(0)
    with pytest.raises(DeclarationError, match="verify=True with ep=2"):
        compile(hf_families.qwen3_moe_seeded(), "local:4", example_inputs=TOKENS, global_batch_size=8, ep=2,
                verify=True)


def test_the_cli_pins_ep():
    p = argparse.ArgumentParser()
    add_plan_options(p)
    assert plan_options(p.parse_args(["--ep", "4"]))["ep"] == 4 and "ep" not in plan_options(p.parse_args([]))


# ---- expert compute: imbalance per rank, weights read, GEMM per local expert --------------------------------
def test_a_rank_holding_more_experts_is_less_imbalanced():
    assert rank_imbalance(1.25, 8, 1) == 1.0  # replicated experts: each rank runs its own tokens, however routed
    assert rank_imbalance(1.25, 8, 8) == 1.25  # one expert per rank: the busiest expert's load
    assert rank_imbalance(1.25, 8, 2) == pytest.approx(1.125)  # 4 experts: the excess / sqrt(4)
    assert rank_imbalance(1.25, 256, 64) == pytest.approx(1.125) and rank_imbalance(1.25, 256, 8) < 1.05


@pytest.fixture(scope="module")
def wide_moe():
    """One Mixtral layer, 8 experts of 1024 x 4096 (top-2) on the meta device: big enough for H100 GEMMs."""
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=256, hidden_size=1024, intermediate_size=4096, num_hidden_layers=1,
                        num_attention_heads=8, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg)
    return trace(model, (torch.zeros(1, 64, dtype=torch.long, device="meta"),))


def test_expert_gemms_read_their_experts_weights_and_pay_only_the_rank_imbalance(wide_moe):
    g = wide_moe
    ctx = _ctx(g, "1x8xH100-80GB", Calibration(expert_imbalance=1.25))
    weights = {name: (w, held) for name, w, held in ctx.experts.weights}
    gemms = [n for n in g.nodes if n.name in ctx.experts.nodes and n.cost.op_class == "matmul"]
    assert len(gemms) == 2 and all(weights[n.name] == (8 * 1024 * 4096 * 4 * (2 if i == 0 else 1), 8)
                                   for i, n in enumerate(gemms))  # [E, 1024, 2 x 4096] and [E, 4096, 1024], fp32

    def experts_s(ep: int, mb: int, seq: int) -> float:  # a microbatch's forward of the MoE layer, all-to-alls off
        topo = Topology.coerce("1x8xH100-80GB")
        c = CostContext(g, topo, find_splits(g), precision="bf16-mixed", optimizer="adam", seq_len=seq,
                        memory_cap=topo.device.memory_bytes, calibration=Calibration(expert_imbalance=1.25))
        return sum(c.unit_cost(u, tp=1, mb=mb, recompute="none", ep=ep).forward_s for u in c._moe_units) - \
            c.expert_exchange_s(mb, 1, 1, ep) / 2

    # few tokens: the GEMMs are bound by reading the weights, and under ep = 8 a rank reads one expert's
    few = {ep: experts_s(ep, 1, 64) for ep in (1, 8)}
    assert few[8] < few[1]
    # many tokens: compute bound; the same rows per rank at ep = 1 (no imbalance: a rank runs its own tokens
    # through every expert) and the busiest rank's 1.25 x under ep = 8 with one expert each, 1.125 x at ep = 2
    many = {ep: experts_s(ep, 8, 4096) for ep in (1, 2, 8)}
    assert many[1] < many[2] < many[8]
    # other units are costed once for every ep
    dense_u = next(u for u in range(len(ctx.units)) if u not in ctx._moe_units)
    assert ctx.unit_cost(dense_u, tp=1, mb=2, recompute="none", ep=8) == \
        ctx.unit_cost(dense_u, tp=1, mb=2, recompute="none")
