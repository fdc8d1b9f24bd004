"""Communication priced as the runtime runs it: a compressed gradient reduction is synchronous (hides behind
nothing), and pipeline neighbours across a node boundary talk over the inter-node link."""

from __future__ import annotations

import pytest

from examples import gpt as gpt_mod
from partitioner import Topology
from partitioner.planner.declarations import Declarations
from partitioner.planner.search import enumerate_candidates
from partitioner.planner.stage_costs import StageEvaluator
from partitioner.planner.tensor_split import find_splits
from partitioner.planner.unit_costs import CostContext
from conftest import _traced_on_meta

SLOW = Topology(nodes=2, devices_per_node=4, device="A100-80GB", inter_node_GBps=0.5)


@pytest.fixture(scope="module")
def graph():
    """Wide enough (256) that a pipeline boundary's bytes, not the link's latency, set its time."""
    cfg = gpt_mod.GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=128, vocab_size=512, dropout=0.0)
    return _traced_on_meta(lambda: gpt_mod.GPT(cfg), 2, 128)


def _context(g, topo: Topology) -> CostContext:
    return CostContext(g, topo, find_splits(g), precision="fp32", optimizer="adam", seq_len=g.traced_seq_len,
                       memory_cap=topo.device.memory_bytes)


def _exposed(g, zero_stage: int, option: tuple[str, str]) -> tuple[float, float, float]:
    """(exposed DP seconds with `option`, its reduction's wire seconds, the stage's backward seconds) of dp8 over
    SLOW's two nodes, one stage."""
    ctx = _context(g, SLOW)
    decl = Declarations(global_batch_size=8, dp=8, tp=1, pp=1, zero_stage=zero_stage, microbatch_size=1)
    cand = next(iter(enumerate_candidates(decl, world_size=8, devices_per_node=4, num_units=len(ctx.units),
                                          valid_tp=(1,))))
    ev = StageEvaluator(ctx, cand, compression=option)
    st = ev.stage(0, len(ctx.units), 0)
    wire, _ = ev._reduction(st.params, option, None)
    return st.exposed_comm_s, wire, st.backward_s


def test_a_compressed_reduction_hides_behind_nothing(graph):
    plain, wire, backward = _exposed(graph, 0, ("none", "none"))
    assert plain < wire  # the uncompressed all-reduce hides behind the last backward, in part
    squeezed, wire8, _ = _exposed(graph, 0, ("none", "int8"))
    assert squeezed >= wire8  # the engine runs it inside the gradient hooks: all of it exposed, kernels on top
    z2, wire_z2, _ = _exposed(graph, 2, ("none", "int8"))
    assert z2 >= wire_z2


def test_pipeline_neighbours_across_nodes_pay_the_inter_node_link(graph):
    ctx = _context(graph, SLOW)
    inside = ctx.p2p_times(2, 2, 1)  # stages at ranks 0-1 and 2-3: one node
    across = ctx.p2p_times(4, 2, 1)  # stages at 0-1, 2-3 | 4-5, 6-7: the second boundary crosses the nodes
    wide = ctx.p2p_times(2, 4, 1)  # a stride of a whole node: every boundary crosses
    b = ctx.boundary_bytes(0, 1, 1, 1)
    assert inside[0] == pytest.approx(ctx.comm.p2p(b, 0, 2))
    assert across[0] == pytest.approx(ctx.comm.p2p(b, 3, 5)) == pytest.approx(wide[0])
    assert across[0] > 10 * inside[0]
