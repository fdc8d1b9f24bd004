"""Alpha-beta collective costs, against hand-computed values."""

from __future__ import annotations

import pytest

from cost_models.calibration import Calibration
from cost_models.comm import (
    CommModel,
    calibrated_link,
    hierarchical_all_gather,
    hierarchical_all_reduce,
    hierarchical_reduce_scatter,
    nccl_ring_latency,
    p2p_time,
    pairwise_all_to_all,
    ring_all_gather,
    ring_all_reduce,
    ring_broadcast,
    ring_reduce_scatter,
    tree_all_reduce,
    tree_broadcast,
)
from cost_models.errors import PartitionerError
from cost_models.specs import LinkLevel, LinkSpec

GB = 1e9
A = 5e-6  # alpha, s
L0 = LinkSpec(level=LinkLevel.INTRA_NODE, bytes_per_s=100 * GB, latency_s=0.0)
L5 = LinkSpec(level=LinkLevel.INTRA_NODE, bytes_per_s=100 * GB, latency_s=A)
NV = LinkSpec(level=LinkLevel.INTRA_NODE, bytes_per_s=300 * GB, latency_s=0.0)
IB = LinkSpec(level=LinkLevel.INTER_NODE, bytes_per_s=25 * GB, latency_s=0.0)


# --- pure formulas -----------------------------------------------------------
def test_ring_all_reduce_1GB_8_ranks():
    assert ring_all_reduce(1 * GB, 8, L0) == pytest.approx(17.5e-3, rel=1e-12)  # 2*7/8*1e9/1e11
    assert ring_all_reduce(1 * GB, 8, L5) == pytest.approx(17.5e-3 + 14 * A, rel=1e-12)


def test_tree_all_reduce():
    # 2 * ceil(log2 8) * alpha + 2 n / B = 30 us + 20 ms
    assert tree_all_reduce(1 * GB, 8, L5) == pytest.approx(6 * A + 20e-3)
    # ceil(log2 5) = 3
    assert tree_all_reduce(1 * GB, 5, L5) == pytest.approx(6 * A + 20e-3)


def test_reduce_scatter_and_all_gather_take_the_full_buffer():
    # (p-1) alpha + (p-1)/p * n / B, n = the full (unsharded) 1 GB
    assert ring_reduce_scatter(1 * GB, 8, L5) == pytest.approx(7 * A + 8.75e-3)
    assert ring_all_gather(1 * GB, 8, L5) == pytest.approx(7 * A + 8.75e-3)
    assert ring_reduce_scatter(1 * GB, 8, L5) + ring_all_gather(1 * GB, 8, L5) \
        == pytest.approx(ring_all_reduce(1 * GB, 8, L5))


def test_all_to_all_broadcast_p2p():
    # (p-1)(alpha + n/(pB)) = 7 * (5 us + 1.25 ms)
    assert pairwise_all_to_all(1 * GB, 8, L5) == pytest.approx(7 * (A + 1.25e-3))
    assert ring_broadcast(1 * GB, 8, L5) == pytest.approx(7 * A + 10e-3)
    assert tree_broadcast(1 * GB, 8, L5) == pytest.approx(3 * (A + 10e-3))
    assert p2p_time(1 * GB, L5) == pytest.approx(A + 10e-3)


def test_tree_wins_small_messages_ring_wins_large():
    assert tree_all_reduce(1024, 64, L5) < ring_all_reduce(1024, 64, L5)
    # 17.57 ms vs 20.03 ms. (At large p the two bandwidth terms, 2(p-1)/p n/B and
    # 2 n/B, converge and the ring's (p-1) latency steps decide.)
    assert ring_all_reduce(1 * GB, 8, L5) < tree_all_reduce(1 * GB, 8, L5)


@pytest.mark.parametrize("f", [ring_all_reduce, tree_all_reduce, ring_reduce_scatter,
                               ring_all_gather, pairwise_all_to_all, ring_broadcast,
                               tree_broadcast])
def test_one_rank_or_zero_bytes_cost_nothing(f):
    assert f(1 * GB, 1, L5) == 0.0
    assert f(0, 8, L5) == 0.0
    with pytest.raises(PartitionerError, match="nbytes >= 0"):
        f(-1, 8, L5)
    with pytest.raises(PartitionerError, match="p >= 1"):
        f(1, 0, L5)


def test_p2p_zero_bytes_costs_nothing():
    assert p2p_time(0, L5) == 0.0


def test_hierarchical_all_reduce_by_hand():
    # RS in node: 7/8 * 1e9/300e9; AR of 1e9/8 across 2 nodes: 2*1/2*1.25e8/25e9 = 5 ms; AG.
    in_node = 7 / 8 * 1 * GB / (300 * GB)
    assert hierarchical_all_reduce(1 * GB, 2, 8, NV, IB) == pytest.approx(2 * in_node + 5e-3)
    flat = ring_all_reduce(1 * GB, 16, IB)  # 2 * 15/16 * 1e9/25e9 = 75 ms
    assert flat == pytest.approx(75e-3)
    assert hierarchical_all_reduce(1 * GB, 2, 8, NV, IB) < flat / 5


def test_hierarchical_degenerates_to_ring():
    assert hierarchical_all_reduce(1 * GB, 1, 8, L5, IB) == pytest.approx(ring_all_reduce(1 * GB, 8, L5))
    assert hierarchical_all_reduce(1 * GB, 4, 1, NV, IB) == pytest.approx(ring_all_reduce(1 * GB, 4, IB))


def test_hierarchical_reduce_scatter_and_all_gather():
    # RS in node 7/8 * 1e9/300e9, then RS of 1.25e8 over 2 nodes: 1/2 * 1.25e8/25e9 = 2.5 ms
    expected = 7 / 8 * 1 * GB / (300 * GB) + 2.5e-3
    assert hierarchical_reduce_scatter(1 * GB, 2, 8, NV, IB) == pytest.approx(expected)
    assert hierarchical_all_gather(1 * GB, 2, 8, NV, IB) == pytest.approx(expected)


def test_nccl_ring_latency_counts_every_rank_of_the_ring():
    # NCCL's model (src/graph/tuning.cc): (p - 1 - (N - 1)) intra-node steps + (N - 1) inter-node steps
    nv = LinkSpec(level=LinkLevel.INTRA_NODE, bytes_per_s=300 * GB, latency_s=5e-6)
    ib = LinkSpec(level=LinkLevel.INTER_NODE, bytes_per_s=25 * GB, latency_s=10e-6)
    assert nccl_ring_latency(192, 8, nv, ib) == pytest.approx(1344 * 5e-6 + 191 * 10e-6)
    assert nccl_ring_latency(1, 8, nv, ib) == pytest.approx(7 * 5e-6)  # one node: the intra-node ring
    assert nccl_ring_latency(4, 1, nv, ib) == pytest.approx(3 * 10e-6)  # one rank per node: the flat ring
    # a gather of 8 KB over 1536 ranks is all latency, ~8.6 ms: not the (k-1) + (N-1) = 198 steps of two phases
    t = hierarchical_all_gather(8e3, 192, 8, nv, ib)
    assert t == pytest.approx(1344 * 5e-6 + 191 * 10e-6, rel=1e-3) and t > 4 * (7 * 5e-6 + 191 * 10e-6)
    assert hierarchical_reduce_scatter(8e3, 192, 8, nv, ib) == t


def test_calibrated_link():
    cal = Calibration(inter_node_bw_eff=0.5, inter_node_extra_latency_s=2e-6)
    link = calibrated_link(LinkSpec(level=LinkLevel.INTER_NODE, bytes_per_s=25 * GB,
                                    latency_s=3e-6), cal)
    assert link.bytes_per_s == pytest.approx(12.5 * GB)
    assert link.latency_s == pytest.approx(5e-6)
    assert link.level == LinkLevel.INTER_NODE


# --- CommModel on a Topology ---------------------------------------------------------
EXACT = Calibration(same_device_bw_eff=1.0, intra_node_bw_eff=1.0, inter_node_bw_eff=1.0,
                    collective_base_latency_s=0.0)


@pytest.fixture(scope="module")
def topo():
    from cost_models.topology import Topology
    t = Topology(nodes=2, devices_per_node=8, device="A100-80GB", intra_node_GBps=100,
                 inter_node_GBps=25, intra_node_latency_us=5, inter_node_latency_us=10)
    assert t.link(LinkLevel.INTRA_NODE).bytes_per_s == pytest.approx(100 * GB)
    assert t.link(LinkLevel.INTRA_NODE).latency_s == pytest.approx(5e-6)
    assert t.link(LinkLevel.INTER_NODE).bytes_per_s == pytest.approx(25 * GB)
    assert t.link(LinkLevel.INTER_NODE).latency_s == pytest.approx(10e-6)
    return t


@pytest.fixture(scope="module")
def cm(topo):
    return CommModel(topo, EXACT)


INTRA = LinkSpec(level=LinkLevel.INTRA_NODE, bytes_per_s=100 * GB, latency_s=5e-6)
INTER = LinkSpec(level=LinkLevel.INTER_NODE, bytes_per_s=25 * GB, latency_s=10e-6)


def test_model_ring_in_one_node_matches_the_formula(cm):
    assert cm.all_reduce(1 * GB, range(8), "ring") == pytest.approx(17.5e-3 + 14 * 5e-6)
    assert cm.all_reduce(1 * GB, [8, 9, 10, 11, 12, 13, 14, 15], "ring") \
        == pytest.approx(17.5e-3 + 14 * 5e-6)
    assert cm.reduce_scatter(1 * GB, range(8), "ring") == pytest.approx(8.75e-3 + 7 * 5e-6)
    assert cm.all_to_all(1 * GB, range(8)) == pytest.approx(pairwise_all_to_all(1 * GB, 8, INTRA))
    assert cm.broadcast(1 * GB, range(8), "ring") == pytest.approx(ring_broadcast(1 * GB, 8, INTRA))


def test_model_flat_ring_across_nodes_runs_over_the_nic(cm):
    assert cm.all_reduce(1 * GB, range(16), "ring") == pytest.approx(ring_all_reduce(1 * GB, 16, INTER))
    assert cm.all_reduce(1 * GB, range(16), "tree") == pytest.approx(tree_all_reduce(1 * GB, 16, INTER))


def test_model_hierarchical_across_nodes(cm):
    expected = hierarchical_all_reduce(1 * GB, 2, 8, INTRA, INTER)
    # RS in node 8.75 ms + 35 us, AR of 125 MB over 2 nodes 5 ms + 20 us, AG 8.75 ms + 35 us
    assert expected == pytest.approx(22.5e-3 + 90e-6)
    assert cm.all_reduce(1 * GB, range(16), "hierarchical") == pytest.approx(expected)
    assert cm.all_reduce(1 * GB, range(16)) == pytest.approx(expected)  # auto picks it
    assert cm.all_reduce(1 * GB, range(16), "hierarchical") < cm.all_reduce(1 * GB, range(16), "ring")
    assert cm.reduce_scatter(1 * GB, range(16)) == pytest.approx(
        hierarchical_reduce_scatter(1 * GB, 2, 8, INTRA, INTER))
    assert cm.all_gather(1 * GB, range(16)) == pytest.approx(
        hierarchical_all_gather(1 * GB, 2, 8, INTRA, INTER))


def test_model_two_nodes_are_slower_than_one(cm):
    for algorithm in ("auto", "ring", "tree", "hierarchical"):
        assert cm.all_reduce(1 * GB, range(16), algorithm) > cm.all_reduce(1 * GB, range(8), algorithm)
    # 8 ranks split 4 + 4 over two nodes are slower than 8 ranks in one node.
    assert cm.all_reduce(1 * GB, [0, 1, 2, 3, 8, 9, 10, 11]) > cm.all_reduce(1 * GB, range(8))


def test_model_auto_is_the_minimum(cm):
    for nbytes in (1e3, 1e6, 1e9):
        for ranks in (range(8), range(16), [0, 8], [0, 1, 8, 9]):
            times = [cm.all_reduce(nbytes, ranks, a) for a in ("ring", "tree", "hierarchical")]
            assert cm.all_reduce(nbytes, ranks) == pytest.approx(min(times))


def test_model_small_message_across_nodes_takes_the_tree(cm):
    # 1 KB over 16 ranks: latency bound, 2 * 4 * 10 us beats the ring's 30 * 10 us.
    assert cm.all_reduce(1e3, range(16)) == pytest.approx(cm.all_reduce(1e3, range(16), "tree"))


def test_model_p2p(cm):
    assert cm.p2p(1 * GB, 0, 1) == pytest.approx(5e-6 + 10e-3)
    assert cm.p2p(1 * GB, 7, 8) == pytest.approx(10e-6 + 40e-3)
    assert cm.p2p(1 * GB, 3, 3) == 0.0
    assert cm.p2p(0, 0, 8) == 0.0


def test_model_trivial_groups_cost_nothing(cm):
    assert cm.all_reduce(1 * GB, [5]) == 0.0
    assert cm.all_gather(1 * GB, [5]) == 0.0
    assert cm.all_reduce(0, range(16)) == 0.0


def test_model_applies_the_calibration(topo):
    base = CommModel(topo, EXACT).all_reduce(1 * GB, range(8), "ring")
    slow = CommModel(topo, Calibration(intra_node_bw_eff=0.5, collective_base_latency_s=0.0))
    assert slow.all_reduce(1 * GB, range(8), "ring") == pytest.approx(base + 17.5e-3)
    default = CommModel(topo)  # base latency 8.4 us, intra efficiency 0.78
    assert default.all_reduce(1 * GB, range(8), "ring") == pytest.approx(
        17.5e-3 / 0.78 + 14 * 5e-6 + 8.4e-6)


def test_model_bad_input(cm):
    with pytest.raises(PartitionerError, match=r"algorithm='tree'.*\['ring', 'hierarchical', 'auto'\]"):
        cm.reduce_scatter(1 * GB, range(8), "tree")
    with pytest.raises(PartitionerError, match=r"algorithm='hierarchical'.*\['ring', 'tree', 'auto'\]"):
        cm.broadcast(1 * GB, range(8), "hierarchical")
    with pytest.raises(PartitionerError, match="same number of ranks on every node"):
        cm.all_reduce(1 * GB, [0, 1, 2, 8], "hierarchical")
    assert cm.all_reduce(1 * GB, [0, 1, 2, 8]) == pytest.approx(
        ring_all_reduce(1 * GB, 4, INTER))  # uneven: auto falls back to flat algorithms
    with pytest.raises(PartitionerError, match=r"ranks \[16\].*size 16"):
        cm.all_reduce(1 * GB, [0, 16])
    with pytest.raises(PartitionerError, match=r"ranks \[1\] appear more than once"):
        cm.all_gather(1 * GB, [0, 1, 1])
    with pytest.raises(PartitionerError, match=r"ranks \[-1\]"):
        cm.p2p(1, -1, 0)


def test_model_on_a_preset_topology():
    from cost_models.topology import Topology
    cm = CommModel(Topology.parse("4x8xA100-80GB"))
    t_node, t_all = cm.all_reduce(1 * GB, range(8)), cm.all_reduce(1 * GB, range(32))
    assert 0 < t_node < t_all
    assert t_all == pytest.approx(cm.all_reduce(1 * GB, range(32), "hierarchical"))
    # Data-parallel group of one local index across the 4 nodes (tp = 8 inside).
    assert cm.all_reduce(1 * GB, [0, 8, 16, 24]) > t_node
