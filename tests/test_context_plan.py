"""Context parallelism (cp) as a plan dimension: declarations, the mesh, JSON, costs, search, text.

The kernels (ring attention, Ulysses) and their equivalence with one process are in
test_context_parallel.py; generated programs run cp > 1 at pp = tp = 1 (test_context_run.py trains them against
one process) and refuse the rest, which test_which_cp_plans_run pins.
"""

from __future__ import annotations

import json

import pytest
import torch

from cost_models.comm import CommModel
from cost_models.errors import DeclarationError
from cost_models.mesh import Mesh
from cost_models.topology import Topology
from examples.gpt import GPT, GPTConfig, example_batch, gpt_small
from partitioner import PlanInfeasibleError, compile, trace
from partitioner.planner.context_split import LONG_SEQUENCE, attention_buffer_bytes, ring_exposed
from partitioner.planner.plan import Plan
from partitioner.planner.tensor_split import find_splits
from partitioner.planner.unit_costs import CostContext
from runtime.comm.groups import group_ranks


@pytest.fixture(scope="module")
def small():
    m = gpt_small()  # 4 heads, seq 128
    return trace(m, example_batch(m, 8))


def _long_graph(seq: int, layers: int = 2):
    """A GPT on the meta device traced at `seq` tokens (8 heads of 64)."""
    with torch.device("meta"):
        m = GPT(GPTConfig(n_layer=layers, n_head=8, n_embd=512, block_size=seq, vocab_size=1024, dropout=0.0))
    return trace(m, (torch.zeros(1, seq, dtype=torch.long, device="meta"),))


@pytest.fixture(scope="module")
def long8k():
    return _long_graph(8192)


# ---- declarations ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("pins, words", [
    (dict(cp=3, topology="local:6"), ["cp=3", "2*cp = 6 equal chunks", "valid cp: 1, 2, 4"]),
    (dict(cp=8, cp_kind="all-to-all", topology="local:8"),
     ["all-to-all", "does not divide the query heads (4)", "cp_kind='ring'"]),
    (dict(dp=2, tp=2, cp=2, pp=1), ["dp(2) * cp(2) * tp(2) * pp(1) = 8 != world size 4"]),
    (dict(dp=2, tp=2, pp=1, cp=2), ["!= world size 4"]),
    (dict(cp=0), ["cp=0", "an int >= 1"]),
    (dict(cp=2, cp_kind="zigzag"), ["cp_kind='zigzag'", "'ring', 'all-to-all'"]),
    (dict(cp=1, cp_kind="ring"), ["cp_kind='ring' with cp=1", "pin cp=2 or more"]),
])
def test_declarations_refuse_what_cp_cannot_run(small, pins, words):
    topology = pins.pop("topology", "local:4")
    with pytest.raises(DeclarationError) as e:
        compile(small, topology, global_batch_size=12 if topology == "local:6" else 8, **pins)
    for w in words:
        assert w in str(e.value)


def test_product_with_cp_unpinned_names_all_degrees(small):
    with pytest.raises(DeclarationError, match=r"dp\(2\) \* tp\(1\) \* pp\(1\) = 2 != world size 4"):
        compile(small, "local:4", global_batch_size=8, dp=2, tp=1, pp=1)


# ---- mesh -------------------------------------------------------------------------------------------------
def test_mesh_orders_pp_dp_cp_tp_outer_to_inner():
    m = Mesh(pp=2, dp=2, tp=2, cp=2)
    assert [m.coords4(r) for r in (0, 1, 2, 4, 8)] == [(0, 0, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (0, 1, 0, 0),
                                                       (1, 0, 0, 0)]
    assert all(m.rank(*m.coords(r), cp=m.coords4(r)[3]) == r for r in range(m.size))
    assert m.cp_ranks(pp=1, dp=1, tp=1) == (13, 15)  # ring neighbours tp ranks apart
    assert m.replica_ranks(pp=1, tp=0) == (8, 10, 12, 14)  # gradients reduced over dp x cp
    assert m.dp_ranks(pp=0, tp=1, cp=1) == (3, 7)
    assert m.pp_ranks(dp=1, tp=1, cp=1) == (7, 15)
    assert Mesh(2, 2, 2).formula() == "rank = pp*4 + dp*2 + tp"  # cp = 1: as before


def test_plan_mesh_and_json_round_trip(small):
    plan = compile(small, "local:8", global_batch_size=8, cp=2, tp=2, pp=1, alternatives=0)
    assert (plan.cp, plan.dp, plan.tp) == (2, 2, 2)
    assert [(m.dp, m.cp, m.tp) for m in plan.mesh[:4]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.to_json() == plan.to_json()
    # a plan written before cp existed (no cp fields) still loads, as cp = 1
    old = json.loads(compile(small, "local:4", global_batch_size=8, alternatives=0).to_json())
    del old["config"]["cp"], old["config"]["cp_kind"]
    for m in old["mesh"]:
        del m["cp"]
    loaded = Plan.from_json(json.dumps(old))
    assert (loaded.cp, loaded.cp_kind, {m.cp for m in loaded.mesh}) == (1, "ring", {0})
    # an edited config whose degrees no longer multiply to the world size is refused
    bad = json.loads(plan.to_json())
    bad["config"]["cp"] = 4
    with pytest.raises(ValueError, match=r"cp\(4\)"):
        Plan.from_json(json.dumps(bad))


# ---- costs ------------------------------------------------------------------------------------------------
def _ctx(g, topo="8xA100-80GB"):
    return CostContext(g, Topology.coerce(topo), find_splits(g), precision="bf16-mixed", optimizer="adam",
                       seq_len=g.traced_seq_len, memory_cap=1e12)


def test_cp_halves_activations_and_token_flops_of_a_long_sequence(long8k):
    ctx = _ctx(long8k)
    block = 1  # a whole transformer block (the prefix rides with unit 0)
    one, two = (ctx.unit_cost(block, tp=1, mb=1, recompute="none", cp=c) for c in (1, 2))
    assert two.activation_bytes == pytest.approx(one.activation_bytes / 2, rel=1e-9)
    # compute about halves (smaller kernels run a little less efficiently)
    assert one.forward_s / 2 < two.forward_s < one.forward_s / 2 * 1.15
    ulysses = ctx.unit_cost(block, tp=1, mb=1, recompute="none", cp=2, cp_kind="all-to-all")
    assert ulysses.forward_s > two.forward_s  # four all-to-alls per attention, nothing hides them


def test_ring_exposed_time_is_zero_when_compute_dominates(long8k):
    """NVLink moves a 4K-token k/v block faster than a block's attention: links 100x faster change nothing.
    Links 10^4x slower expose the transfers."""
    def forward(topo: str) -> float:
        return _ctx(long8k, topo).unit_cost(1, tp=1, mb=1, recompute="none", cp=2).forward_s

    base = forward("8xA100-80GB")
    assert forward("8xA100-80GB,intra_node_GBps=30000") == pytest.approx(base, rel=1e-12)
    assert forward("8xA100-80GB,intra_node_GBps=0.03") > base * 1.5


def test_ring_exposes_only_what_a_transfer_takes_beyond_a_block():
    comm = CommModel(Topology.parse("2x8xH100-80GB"))
    assert ring_exposed(1e6, 1.0, 2.0, comm, (0, 1, 2, 3)) == (0.0, pytest.approx(comm.p2p(2e6, 0, 1)))
    fwd, bwd = ring_exposed(1e9, 1e-3, 2e-3, comm, (0, 8))  # a slow inter-node hop, little compute
    assert fwd == pytest.approx(comm.p2p(1e9, 0, 8) - 0.5e-3)
    assert bwd > fwd > 0
    assert ring_exposed(1e9, 1e-3, 2e-3, comm, (0,)) == (0.0, 0.0)  # cp = 1


def test_attention_buffers_follow_the_kernels():
    """A ring holds 5 fp32 k/v blocks at its backward's peak (two arriving/in use, three dk/dv accumulators);
    Ulysses one all-to-all's send and receive buffers of its largest tensor; nothing without cp."""
    assert attention_buffer_bytes([3.0, 3.0], 2, "ring") == 30.0
    assert attention_buffer_bytes([4.0, 2.0, 2.0, 4.0], 2, "all-to-all") == 8.0
    assert attention_buffer_bytes([3.0, 3.0], 1, "ring") == 0.0


def test_attention_buffers_are_in_the_block_moment(long8k):
    """Per attention node of the 8K GPT (8 heads of 64, bf16-mixed): a ring at cp 4 holds 5 fp32 k/v blocks of
    2048 tokens, 5 * 2 * 2048 * 512 * 4 B = 40 MiB; at cp 8 half that. Ulysses: q's send and receive buffers
    (bf16). Each unit holds one attention node, and the stage's peak moment mid-backward counts it."""
    ctx = _ctx(long8k)
    ring = ctx.unit_cost(1, tp=1, mb=1, recompute="none", cp=4)
    assert ring.context_buffer_bytes == 5 * 2 * 2048 * 512 * 4
    assert ctx.unit_cost(1, tp=1, mb=1, recompute="none", cp=8).context_buffer_bytes == 5 * 2 * 1024 * 512 * 4
    a2a = ctx.unit_cost(1, tp=1, mb=1, recompute="none", cp=4, cp_kind="all-to-all")
    assert a2a.context_buffer_bytes == 2 * 2048 * 512 * 2
    assert ctx.unit_cost(1, tp=1, mb=1, recompute="none", cp=1).context_buffer_bytes == 0.0
    plans = {kind: compile(long8k, "8xA100-80GB", global_batch_size=8, cp=4, cp_kind=kind, tp=1, pp=1, zero_stage=1,
                           microbatch_size=1, alternatives=0) for kind in ("ring", "all-to-all")}
    plan = plans["ring"]
    assert plan.predicted.context_buffer_bytes == ring.context_buffer_bytes  # uncalibrated: buffer scale 1
    # the rank's peak is mid-backward: its buffers differ by the kernels' buffers alone
    ring_b, a2a_b = (p.predicted.memory.buffers for p in plans.values())
    assert ring_b - a2a_b == pytest.approx(ring.context_buffer_bytes - a2a.context_buffer_bytes)
    assert "ring k/v blocks arriving and dk/dv accumulators at the backward's peak" in " ".join(str(plan).split())
    assert "ring k/v blocks arriving" in " ".join(plan.explain().split())
    assert json.loads(plan.to_json())["predicted"]["context_buffer_bytes"] > 0


def test_cp_divides_the_pipeline_hidden_state(long8k):
    ctx = _ctx(long8k)
    assert ctx.boundary_bytes(0, 1, cp=4) == pytest.approx(ctx.boundary_bytes(0, 1) / 4)


# ---- search -----------------------------------------------------------------------------------------------
def test_search_picks_cp_where_memory_forces_it():
    # 6 layers: cp2 halves every layer's activations but adds one attention's ring buffers (5 fp32 k/v blocks,
    # 80 MiB at 4096 tokens), about what 2 layers' halved activations save
    long8k = _long_graph(8192, layers=6)
    topo = Topology.parse("4xA100-40GB")
    kw = dict(global_batch_size=4, recompute="none", tp=1, pp=1, microbatch_size=1, alternatives=0)
    need1 = compile(long8k, topo, cp=1, **kw).predicted.peak_memory_bytes
    need2 = compile(long8k, topo, cp=2, **kw).predicted.peak_memory_bytes
    assert need2 < need1
    frac = (need1 + need2) / 2 / topo.device.memory_bytes
    with pytest.raises(PlanInfeasibleError, match=r"context parallelism \(cp=2 or more"):
        compile(long8k, topo, cp=1, max_memory_fraction=frac, **kw)
    free = compile(long8k, topo, max_memory_fraction=frac, **kw)
    assert free.cp > 1 and free.predicted.peak_memory_bytes <= frac * topo.device.memory_bytes


def test_short_sequences_search_no_cp(small):
    assert 128 < LONG_SEQUENCE
    plan = compile(small, "local:4", global_batch_size=8)
    assert plan.cp == 1 and all(a.config.cp == 1 for a in plan.alternatives)


def test_long_sequences_search_cp(long8k):
    g = _long_graph(LONG_SEQUENCE, layers=1)
    plan = compile(g, "8xA100-80GB", global_batch_size=1, alternatives=5)
    assert plan.dp == 1  # one sequence: the devices can only be used by splitting it
    assert any(c.cp > 1 for c in [plan.config, *(a.config for a in plan.alternatives)])


# ---- text and programs ------------------------------------------------------------------------------------
def test_plan_text_names_cp(small, tmp_path):
    plan = compile(small, "local:4", global_batch_size=8, cp=2, cp_kind="ring", tp=1, alternatives=0)
    text = str(plan)
    assert " cp2 " in text.splitlines()[1]
    assert "x cp 2 x" in text and "cp*1" in text
    assert "context      cp2: each rank holds 64 of 128 tokens" in text
    assert "context parallelism over 2 ranks (as declared, ring)" in plan.explain()
    assert "gradients reduced over dp x cp" in plan.explain()
    page = plan.to_html(tmp_path / "plan.html").read_text()
    assert "context" in page and "cp2: each rank holds 64 of 128 tokens" in page
    assert "rank = pp*4 + dp*2 + cp*1 + tp" in page and "d1 c1 t0" in page


def test_which_cp_plans_run(small):
    plan = compile(small, "local:4", global_batch_size=8, cp=2, tp=1, pp=1, alternatives=0)
    assert "cp_attention(" in plan.program(0).source
    groups = group_ranks(plan.mesh)  # the runtime forms the context groups, and the gradient groups over dp x cp
    assert groups["cp"] == [(0, 1), (2, 3)] and groups["dp"] == [(0, 1, 2, 3)]
    assert "cp_attention(" in compile(small, "local:4", global_batch_size=8, cp=2, tp=2, sp=False,
                                      alternatives=0).program(0).source
    assert "sp_gather(" in compile(small, "local:4", global_batch_size=8, cp=2, tp=2, sp=True,
                                   alternatives=0).program(0).source
    with pytest.raises(DeclarationError, match="async_sgd=.* with cp=2: each replica steps"):
        compile(small, "local:4", global_batch_size=8, cp=2, async_sgd=dict(every=2), alternatives=0).program(0)
    with pytest.raises(DeclarationError, match="verify=True with cp=2: plan.verify replays"):
        compile(gpt_small(), "local:4", example_inputs=example_batch(gpt_small(), 8), global_batch_size=8, cp=2,
                verify=True)
