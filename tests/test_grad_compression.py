"""Gradient compression inside the data-parallel engine, over 4 real Gloo processes.

One spawn of 4 ranks runs every scenario and saves what each rank saw; the
tests compare in this process:

- hierarchical reductions (the 4 ranks as 2 "nodes" of 2): every rank ends with
  the same bytes, within each compressor's error of the exact mean, and only the
  inter-node phase is compressed when the plan compresses only there;
- ZeRO-2 and ZeRO-3 with compressed reduce-scatters (and, at ZeRO-3, int8
  weight gathers) train like the uncompressed engine;
- the int8 weight all-gather is within half a block scale of the masters;
- the first K steps are uncompressed (bitwise equal to fp32);
- resuming from residuals saved to a file (and loaded with weights_only=True)
  reproduces the next steps bitwise, and resuming without them does not;
- residuals saved under another group size are dropped with a warning.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from examples.training import gpt_loss, gpt_tiny_seeded
from runtime.comm.collectives import Collectives
from runtime.engines.data_parallel import DataParallel
from runtime.compression.grad_compression import GradientReducer
from runtime.comm.groups import make_group_among, make_node_groups
from runtime.compression.quantized_gather import quantized_all_gather
from ranks import data_parallel_steps, gloo_group, pattern_batches

pytestmark = pytest.mark.slow

WORLD = 4
NODE_OF = (0, 0, 1, 1)
HIER = (("none", "none"), ("none", "bf16"), ("none", "int8"), ("none", "int4"), ("bf16", "int8"),
        ("int8", "int8"), ("int8", "none"), ("none", "powersgd"))
SHAPES = ((40, 30), (30,), (24, 50))  # a bucket: two matrices and a bias
RESUME = (("int8", 0, None), ("int4", 1, None), ("int8", 2, None), ("powersgd", 0, None),
          ({"intra_node": "none", "inter_node": "int8"}, 1, NODE_OF))


def _bucket(rank: int, seed: int) -> torch.Tensor:
    """Rank-2-mean matrices (PowerSGD with r >= 2 reconstructs them) and a random bias."""
    g = torch.Generator().manual_seed(100 * seed + rank)
    shared = torch.Generator().manual_seed(seed)
    parts = []
    for shape in SHAPES:
        if len(shape) == 2:
            w, z = torch.randn(shape[1], generator=shared), torch.randn(shape[0], generator=shared)
            u, y = torch.randn(shape[0], generator=g), torch.randn(shape[1], generator=g)
            parts.append((torch.outer(u, w) + torch.outer(z, y)).reshape(-1))
        else:
            parts.append(torch.randn(shape, generator=g))
    return torch.cat(parts) * (1 + rank)


def _engine(model, rank, zero, compression, node_of=None, **kw):
    nodes = make_node_groups(rank, [tuple(range(WORLD))], node_of) if node_of else None
    coll = Collectives()
    engine = DataParallel(model, group=dist.group.WORLD, ranks=tuple(range(WORLD)), zero_stage=zero,
                          collectives=coll, compression=compression, nodes=nodes, **kw)
    return engine, torch.optim.AdamW(engine.optimizer_params(), lr=3e-3), coll


def _params(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _hierarchical(rank: int, out: dict) -> None:
    nodes = make_node_groups(rank, [tuple(range(WORLD))], NODE_OF)
    out["nodes"] = (nodes.intra_ranks, nodes.cross_ranks)
    for ci, ce in HIER:
        coll = Collectives()
        red = GradientReducer(dist.group.WORLD, coll, compression={"intra_node": ci, "inter_node": ce}, nodes=nodes)
        g = _bucket(rank, 0)
        red.all_reduce_mean_(g, "bucket", SHAPES)
        out[("hier", ci, ce)] = (g, dict(coll.counts))


def _zero(rank: int, out: dict) -> None:
    for zero in (2, 3):
        for comp in ("none", "bf16", "int8"):
            engine, opt, coll = _engine(gpt_tiny_seeded(), rank, zero, comp)
            losses = data_parallel_steps(engine, opt, coll, gpt_loss, pattern_batches(0, 40))
            out[("zero", zero, comp)] = (losses, dict(coll.bytes))


def _weights(rank: int, out: dict) -> None:
    g = torch.Generator().manual_seed(7 + rank)
    shard = torch.randn(1000, generator=g) * (1 + rank)
    full = torch.empty(WORLD * 1000)
    coll = Collectives()
    h = quantized_all_gather(full, shard, dist.group.WORLD, coll, async_op=True)
    h.wait()
    out["weights"] = (shard, full, dict(coll.bytes))


def _warmup(rank: int, out: dict) -> None:
    for comp, warm in (("none", 0), ("int8", 2)):
        engine, opt, coll = _engine(gpt_tiny_seeded(), rank, 0, comp, compression_warmup=warm)
        snaps = []
        for b in pattern_batches(1, 3):
            data_parallel_steps(engine, opt, coll, gpt_loss, [b])
            snaps.append(_params(engine))
        out[("warmup", comp)] = (snaps, coll.counts["all_to_all"])


def _resume(rank: int, out: dict) -> None:
    batches = pattern_batches(2, 6)
    for i, (comp, zero, node_of) in enumerate(RESUME):
        engine, opt, coll = _engine(gpt_tiny_seeded(), rank, zero, comp, node_of)
        data_parallel_steps(engine, opt, coll, gpt_loss, batches[:3])
        # through a file, as a checkpoint holds it: tensors only, loadable without unpickling objects
        path = Path(out["tmp"]) / f"compression{i}_rank{rank}.pt"
        torch.save(engine.compression_state_dict(), path)
        saved = (_params(engine), copy.deepcopy(opt.state_dict()), torch.load(path, weights_only=True))
        assert all(torch.is_tensor(v) for v in saved[2].values())
        ref = data_parallel_steps(engine, opt, coll, gpt_loss, batches[3:]), _params(engine)
        runs = {}
        for load_residuals in (True, False):
            model = gpt_tiny_seeded()
            model.load_state_dict(saved[0])
            engine, opt, coll = _engine(model, rank, zero, comp, node_of)
            opt.load_state_dict(saved[1])
            if load_residuals:
                engine.load_compression_state_dict(saved[2])
            runs[load_residuals] = data_parallel_steps(engine, opt, coll, gpt_loss, batches[3:]), _params(engine)
        out[("resume", i)] = (ref, runs[True], runs[False], len(saved[2]))


def _world_change(rank: int, out: dict) -> None:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("runtime.compression.grad_compression")
    log.addHandler(Keep())
    big = GradientReducer(dist.group.WORLD, Collectives(), compression="int8")
    big.all_reduce_mean_(_bucket(rank, 3), "b", SHAPES)
    big.step_done()
    sd = big.state_dict()
    pair = make_group_among(rank, [(0, 1), (2, 3)])
    small = GradientReducer(pair, Collectives(), compression="int8")
    small.load_state_dict(sd)
    out["world_change"] = (len(sd), len(small.state_dict()), small.steps, records)


def _refusals(rank: int, out: dict) -> None:
    errors = {}
    cases = {"powersgd_zero2": {"compression": "powersgd", "zero_stage": 2},
             "levels_without_nodes": {"compression": {"inter_node": "int8"}},
             "unknown": {"compression": "fp8"},
             "warmup": {"compression": "int8", "warmup_steps": -1}}
    for name, kw in cases.items():
        try:
            GradientReducer(dist.group.WORLD, Collectives(), **kw)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["refusals"] = errors


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    with gloo_group(rank, world, store_path, timeout_s=180):
        out: dict = {"tmp": out_dir}
        for scenario in (_hierarchical, _weights, _refusals, _world_change, _warmup, _resume, _zero):
            scenario(rank, out)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(spawned):
    return spawned(_worker, WORLD)


# error of one hierarchical reduction relative to the largest input element (module docstring of
# runtime.compression.grad_compression: each quantization costs at most half a block scale of what it quantizes)
_TOL = {"none": 1e-6, "bf16": 2 ** -8, "int8": 2 / 127, "int4": 2 / 7, "powersgd": 1e-4}


@pytest.mark.parametrize("ci,ce", HIER)
def test_hierarchical_reduction_is_identical_everywhere_and_close_to_the_mean(ranks, ci, ce):
    assert ranks[0]["nodes"] == ((0, 1), (0, 2)) and ranks[3]["nodes"] == ((2, 3), (1, 3))
    results = [r[("hier", ci, ce)][0] for r in ranks]
    for r in results[1:]:
        assert torch.equal(r, results[0])
    inputs = [_bucket(r, 0) for r in range(WORLD)]
    exact = torch.stack(inputs).double().mean(0)
    scale = max(x.abs().max().item() for x in inputs)
    tol = _TOL[ci] + _TOL[ce] + 1e-6
    err = (results[0].double() - exact).abs().max().item()
    assert err <= tol * scale, f"({ci}, {ce}): error {err:.3g} > {tol:.3g} x {scale:.3g}"


def test_only_the_compressed_level_sends_codes(ranks):
    _, counts = ranks[0][("hier", "none", "int8")]
    # intra: fp32 reduce-scatter and all-gather; cross: all-to-all + all-gather of codes and of scales
    assert counts == {"reduce_scatter": 1, "all_to_all": 2, "all_gather": 3}
    _, counts = ranks[0][("hier", "none", "none")]
    assert "all_to_all" not in counts
    _, counts = ranks[0][("hier", "int8", "none")]
    assert counts["all_to_all"] == 2 and counts["all_reduce"] == 1
    _, counts = ranks[0][("hier", "none", "powersgd")]
    assert "all_to_all" not in counts and counts["all_reduce"] <= 4


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_2_and_3_train_with_compressed_reduce_scatters(ranks, zero):
    base, base_bytes = ranks[0][("zero", zero, "none")]
    assert base[-1] < 0.9 * base[0]
    for comp in ("bf16", "int8"):
        got, _ = ranks[0][("zero", zero, comp)]
        final, ref = sum(got[-3:]) / 3, sum(base[-3:]) / 3
        assert abs(final - ref) <= 0.01 * ref, f"ZeRO-{zero} {comp}: {final:.4f} vs {ref:.4f}"
    _, int8_bytes = ranks[0][("zero", zero, "int8")]
    assert "reduce_scatter" not in int8_bytes and int8_bytes["all_to_all"] < 0.3 * base_bytes["reduce_scatter"]
    if zero == 3:  # weights gathered as int8 codes (+ scales) instead of fp32
        assert int8_bytes["all_gather"] < 0.3 * base_bytes["all_gather"]


def test_int8_weight_gather_is_within_half_a_block_scale_of_the_masters(ranks):
    fulls = [r["weights"][1] for r in ranks]
    for f in fulls[1:]:
        assert torch.equal(f, fulls[0])
    exact = torch.cat([r["weights"][0] for r in ranks])
    err = (fulls[0] - exact).abs()
    for r in range(WORLD):
        shard = exact[r * 1000:(r + 1) * 1000]
        for b in range(0, 1000, 256):
            block = shard[b:b + 256]
            half_scale = block.abs().max() / 127 / 2
            assert err[r * 1000 + b: r * 1000 + b + block.numel()].max() <= half_scale * 1.0001
    bytes_ = ranks[0]["weights"][2]["all_gather"]
    assert bytes_ == WORLD * (1024 + 4 * 4)  # int8 codes of 4 padded blocks and their 4 fp32 scales per rank


def test_the_first_steps_are_uncompressed(ranks):
    plain, _ = ranks[0][("warmup", "none")]
    warm, all_to_all = ranks[0][("warmup", "int8")]
    for step in (0, 1):
        for k in plain[step]:
            assert torch.equal(plain[step][k], warm[step][k]), f"step {step + 1}: {k} differs during warm-up"
    assert any(not torch.equal(plain[2][k], warm[2][k]) for k in plain[2])
    assert all_to_all == 2  # one compressed bucket reduction (codes, scales), at step 3 only


@pytest.mark.parametrize("case", range(len(RESUME)))
def test_resuming_with_the_residuals_reproduces_the_next_steps_bitwise(ranks, case):
    for r in ranks:
        (ref_losses, ref_params), (got_losses, got_params), (_, cold_params), n_state = r[("resume", case)]
        assert n_state > 2  # steps, world and at least one residual
        assert got_losses == ref_losses
        for k in ref_params:
            assert torch.equal(got_params[k], ref_params[k]), k
        assert any(not torch.equal(cold_params[k], ref_params[k]) for k in ref_params), \
            "resuming without the residuals should train differently (else this test proves nothing)"


def test_residuals_for_another_world_size_are_dropped_with_a_warning(ranks):
    saved, kept, steps, records = ranks[0]["world_change"]
    assert saved > 2 and kept == 2 and steps == 1  # only "steps" and "world" left; the step count survives
    assert any("4 data-parallel ranks" in m and "has 2" in m for m in records), records


def test_impossible_compression_settings_are_refused(ranks):
    errors = ranks[0]["refusals"]
    assert "zero_stage=2" in errors["powersgd_zero2"] and "int8" in errors["powersgd_zero2"]
    assert "nodes" in errors["levels_without_nodes"]
    assert "fp8" in errors["unknown"] and "int4" in errors["unknown"]
    assert "warmup_steps=-1" in errors["warmup"]


def test_a_plan_across_two_nodes_reduces_hierarchically():
    """compile() on two 2-rank "nodes", int8 pinned across nodes only: the program creates the node
    groups and reduces fp32 inside each node (reduce-scatter, all-gather) and int8 across (all-to-all);
    its losses track the uncompressed program's."""
    from examples.training import adamw
    from partitioner import compile
    from runtime import launch_local

    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 1024, (8, 32), generator=g), torch.randint(0, 1024, (8, 32), generator=g))
            for _ in range(3)]
    out = {}
    for comp in ("none", "int8"):
        plan = compile(gpt_tiny_seeded(), "2x2xCPU", example_inputs=(torch.randint(0, 1024, (2, 32)),),
                       global_batch_size=8, precision="fp32", dp=4, tp=1, pp=1, zero_stage=1,
                       compression={"inter_node": comp})
        assert plan.compression == {"intra_node": "none", "inter_node": comp}
        src = plan.program(2).source
        assert ("make_node_groups(RANK" in src) == (comp != "none")
        out[comp] = launch_local(plan, gpt_tiny_seeded, adamw, gpt_loss, data)
    assert "compression={'intra_node': 'none', 'inter_node': 'int8'}, nodes=nodes" in src
    counts = out["int8"].collective_counts[0]
    assert counts["reduce_scatter"] == 3 and counts["all_to_all"] == 6  # per step: 1 intra fp32, 2 cross int8
    assert "all_to_all" not in out["none"].collective_counts[0]
    torch.testing.assert_close(torch.tensor(out["int8"].losses), torch.tensor(out["none"].losses), rtol=1e-3, atol=0)


def test_compile_carries_the_warm_up_into_the_programs():
    from partitioner import DeclarationError, Plan, compile

    kw = {"example_inputs": (torch.randint(0, 1024, (2, 32)),), "global_batch_size": 8, "precision": "fp32",
          "dp": 4, "tp": 1, "pp": 1, "zero_stage": 0}
    plan = compile(gpt_tiny_seeded(), "local:4", compression="powersgd", compression_warmup=10, **kw)
    assert plan.compression_warmup == 10 and Plan.from_json(plan.to_json()).compression_warmup == 10
    assert "compression='powersgd', nodes=None,\n                          compression_warmup=10)" in \
        plan.program(1).source
    assert "the first 10 steps uncompressed" in str(plan)
    assert compile(gpt_tiny_seeded(), "local:4", compression="none", compression_warmup=10,
                   **kw).compression_warmup == 0  # nothing to warm up
    for bad in (-1, 1.5, True):
        with pytest.raises(DeclarationError, match="compression_warmup"):
            compile(gpt_tiny_seeded(), "local:4", compression="int8", compression_warmup=bad, **kw)
