"""The bounds the search prunes with (partitioner.planner.stage_costs, cut.py) against every cut, and the stage
memo with PowerSGD among the options: each bound must hold for every candidate, or the search would lose plans."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import examples.gpt as gpt_mod
from cost_models.calibration import Calibration
from partitioner import Topology, trace
from partitioner.planner.cut import cut_stages, evaluate_cut
from partitioner.planner.declarations import Declarations
from partitioner.planner.search import enumerate_candidates
from partitioner.planner.stage_costs import StageEvaluator
from partitioner.planner.tensor_split import find_splits
from partitioner.planner.unit_costs import CostContext


def _graph(layers: int):
    cfg = gpt_mod.GPTConfig(n_layer=layers, n_head=4, n_embd=64, block_size=64, vocab_size=256, dropout=0.0)
    with torch.device("meta"):
        model = gpt_mod.GPT(cfg)
    idx = torch.empty(2, 64, dtype=torch.long, device="meta")
    return trace(model, (idx, idx))


def _candidates(g, topo: str, frac: float, calibration: Calibration | None = None, **pins):
    topology = Topology.parse(topo)
    splits = find_splits(g)
    decl = Declarations(global_batch_size=16, **pins)
    ctx = CostContext(g, topology, splits, precision="bf16-mixed", optimizer="adam", seq_len=g.traced_seq_len,
                      memory_cap=frac * topology.device.memory_bytes, calibration=calibration)
    valid = splits.valid_tp(tuple(t for t in (1, 2, 4, 8) if topology.world_size % t == 0))
    cands = enumerate_candidates(decl, world_size=topology.world_size, devices_per_node=topology.devices_per_node,
                                 num_units=len(ctx.units), valid_tp=valid)
    return ctx, list(cands)


def _all_cuts(n: int, stages: int):
    for inner in itertools.combinations(range(1, n), stages - 1):
        yield (0, *inner, n)


# (topology, memory fraction, memory scales): roomy ones, and ones where many candidates (or all cuts of some) do not
# fit; the CPU preset's processes hold no fixed memory, so small fractions leave room to the model alone; a
# calibration that scales the memory terms apart (the peak moment is picked on unscaled bytes)
@pytest.mark.parametrize("topo,frac,scales", [
    ("2x4xA100-80GB", 0.9, None), ("local:8", 0.9, None), ("local:8", 1e-4, None), ("local:8", 2e-4, None),
    ("local:8", 2e-4, dict(activation_mem_scale=0.6, buffer_mem_scale=3.0, grad_mem_scale=1.5))])
def test_every_bound_holds_for_every_candidate_and_cut(topo, frac, scales):
    """lower_bound() is at most the best cut's step time, and infinite only where no cut fits (its memory tests:
    model state, and activations against each stage's room); min_max_c() is the bottleneck of the units' compute
    over all cuts, below every cut's slowest stage; the cut search with the tail and c limits finds the
    exhaustive best."""
    g = _graph(4)
    ctx, cands = _candidates(g, topo, frac, Calibration(**scales) if scales else None)
    n = len(ctx.units)
    refused = bounded = 0
    for cand in cands:
        ev = StageEvaluator(ctx, cand)
        S = ev.num_stages
        if S > n:
            continue
        cuts = [evaluate_cut(ev, b) for b in _all_cuts(n, S)]
        fitting = [c.step_time_s for c in cuts if c is not None]
        lb = ev.lower_bound()
        if math.isinf(lb):
            refused += 1
            assert not fitting, f"{cand}: refused by the lower bound, but a cut fits"
            continue
        bounded += 1
        if fitting:
            assert lb <= min(fitting) * (1 + 1e-12), cand
            found = cut_stages(ev)
            assert found is not None and found.step_time_s == pytest.approx(min(fitting), rel=1e-12)
        pre = [ev._f[u] + ev._b[u] + ev.engine_floor[u] for u in range(n + 1)]
        bottleneck = min(max(pre[b[k + 1]] - pre[b[k]] for k in range(S)) for b in _all_cuts(n, S))
        assert ev.min_max_c() <= bottleneck <= ev.min_max_c() * (1 + 1e-6), cand
    assert bounded and (refused or frac > 0.5)  # the tight memories exercise the refusals


def test_the_activation_test_refuses_what_the_cut_search_cannot_fit():
    """Where the activations cannot fit in the stages' room, the cut search finds no cut either (and where the
    room suffices, the test does not refuse on its own)."""
    g = _graph(6)
    ctx, cands = _candidates(g, "local:4", 4e-4, pp=2, tp=1, zero_stage=0)
    verdicts = set()
    for cand in cands:
        ev = StageEvaluator(ctx, cand)
        may = ev._activations_may_fit()
        verdicts.add(may)
        if not may:
            assert cut_stages(ev) is None, cand
    assert verdicts == {True, False}


def test_stage_memo_holds_with_powersgd_among_the_options():
    """Candidates whose data-parallel group crosses nodes may compress with PowerSGD, whose cost depends on the
    shapes of each range's gradients: the memo keys those too, so every range costs what evaluating it does."""
    g = _graph(6)
    ctx, cands = _candidates(g, "2x4xA100-80GB", 0.9, pp=4, tp=1, zero_stage=0, microbatch_size=1,
                             schedule="1f1b")
    cand = next(c for c in cands if c.dp == 2)
    ev = StageEvaluator(ctx, cand)
    assert any("powersgd" in o for o in ev.options)
    n, asked = len(ctx.units), 0
    for i, j in itertools.combinations(range(n + 1), 2):
        for k in range(ev.num_stages):
            if (i == 0) != (k == 0) or (j == n) != (k == ev.num_stages - 1):
                continue
            memo, direct = ev.stage(i, j, k), ev._stage(i, j, k)
            assert memo.tail_s == pytest.approx(direct.tail_s, rel=1e-12) and memo.c == pytest.approx(direct.c)
            assert (memo.fits, memo.compression) == (direct.fits, direct.compression)
            asked += 1
    assert len(ev._stage_memo) < asked
