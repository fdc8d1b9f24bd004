"""Generated per-rank programs: readable, executable, each rank its own rows and shard."""

from __future__ import annotations


import ast
import dataclasses
import re

import pytest

from examples import gpt as gpt_mod
from partitioner import compile, trace
from partitioner.codegen.program import CodegenError


@pytest.fixture(scope="module")
def graph():
    model = gpt_mod.gpt_tiny()
    return trace(model, gpt_mod.example_batch(model, 2))


def dp_plan(graph, zero, world=4, gb=16, mb=2):
    return compile(graph, f"local:{world}", global_batch_size=gb, pp=1, tp=1, zero_stage=zero,
                   microbatch_size=mb, precision="fp32")


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_programs_import_only_torch_and_runtime_and_parse(graph, zero):
    plan = dp_plan(graph, zero)
    for r in range(plan.world_size):
        src = plan.program(r).source
        tree = ast.parse(src)
        mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert mods <= {"torch", "runtime"}, mods
        assert "def build(model_fn, optimizer_fn, loss_fn):" in src
        assert f"RANK = {r}\n" in src and "WORLD_SIZE = 4\n" in src
        assert f"zero_stage={zero}" in src
        plan.program(r).namespace()  # executes: defines build without touching torch.distributed


def test_each_rank_takes_its_own_rows(graph):
    plan = dp_plan(graph, 0, world=4, gb=16, mb=2)
    for r in range(4):
        src = plan.program(r).source
        assert f"rows [{4 * r}, {4 * r + 4}) of the 16-sample global batch" in src
        assert f"dp_rank={r}, dp_size=4, microbatch_size=2, num_microbatches=2" in src


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_2_programs_name_this_ranks_slice(graph, zero):
    plan = dp_plan(graph, zero, world=2, gb=8)
    n = graph.num_params
    half = (n + 1) // 2
    lo = re.search(r"elements \[([\d,]+), ([\d,]+)\) of the ([\d,]+)-element", plan.program(1).source)
    assert lo and [int(x.replace(",", "")) for x in lo.groups()] == [half, n, n]
    what = "optimizer state for" if zero == 1 else "gradients and optimizer state for"
    assert what in plan.program(0).source


def test_zero_3_program_names_each_blocks_shard(graph):
    plan = dp_plan(graph, 3, world=2, gb=8)
    src = plan.program(0).source
    per_block = 12 * 128**2 + 13 * 128
    assert f"transformer.h.0: {per_block:,} parameters; this rank holds {per_block // 2:,} (slice 0 of 2)" in src
    assert "all-gathered per block just in time" in src


def test_all_ranks_share_the_program_hash_and_it_tracks_the_plan(graph):
    a, b = dp_plan(graph, 0), dp_plan(graph, 1)
    assert len({a.program(r).program_hash for r in range(4)}) == 1
    assert a.program(0).program_hash != b.program(0).program_hash


def test_write_programs_writes_one_file_per_rank_and_the_plan(graph, tmp_path):
    plan = dp_plan(graph, 2, world=2, gb=8)
    d = plan.write_programs(tmp_path / "out")
    assert sorted(p.name for p in d.iterdir()) == ["plan.json", "rank_0.py", "rank_1.py"]
    assert (d / "rank_1.py").read_text() == plan.program(1).source


def test_pipeline_programs_need_the_exported_graph(graph):
    without = dataclasses.replace(graph, graph_module=None)  # as an OpGraph loaded from JSON
    plan = compile(without, "local:4", global_batch_size=16, pp=2, tp=1, precision="fp32")
    with pytest.raises(CodegenError, match=r"\(pp=2, tp=1\) carries no model code: the model was given as an "
                                           "OpGraph without its graph"):
        plan.program(0)
    # the example batch passes targets: the loss is computed in the suffix, which reads them as a model input
    src = compile(graph, "local:4", global_batch_size=16, pp=2, tp=1, precision="fp32").program(3).source
    assert "def block(tp, x" in src and re.search(r"def suffix\(tp, x, .*input_targets", src)
    with pytest.raises(CodegenError, match="rank=7: the plan has ranks 0..3"):
        dp_plan(graph, 0).program(7)


def test_each_pipeline_rank_draws_from_its_own_random_stream(graph):
    """Every rank builds the model from one seed; a pipeline rank > 0 then reseeds (seed + 100 x its rank), so its
    layers' dropout masks are not the first rank's again. The tensor slices of a stage share its stream (a
    replicated activation is dropped alike), and programs without a pipeline leave the stream alone."""
    import torch

    from runtime.pipeline.random_streams import seed_pipeline_rank

    plan = compile(graph, "local:4", global_batch_size=16, pp=2, tp=2, dp=1, precision="fp32")
    for rank in range(4):
        src = plan.program(rank).source
        assert src.count("seed_pipeline_rank(") == 1 and f"seed_pipeline_rank({rank // 2})" in src, rank
        assert src.index("model = model_fn()") < src.index("seed_pipeline_rank(") < src.index("stage = make_stage")
    for flat in (dp_plan(graph, 1), compile(graph, "local:2", global_batch_size=16, pp=1, tp=2, precision="fp32")):
        assert "seed_pipeline_rank" not in flat.program(0).source

    def masks(pp_rank):
        torch.manual_seed(0)
        seed_pipeline_rank(pp_rank)
        return torch.nn.functional.dropout(torch.ones(64), 0.5)
    assert torch.equal(masks(0), masks(0)) and torch.equal(masks(1), masks(1))
    assert not torch.equal(masks(0), masks(1))


def test_no_line_of_a_program_grows_with_the_world(meta_gpt_graph):
    """The mesh, the node of every rank, tie groups and data-parallel ranks are written as formulas (grid,
    nodes_of, stage_peers, groups.dp_ranks) and long tables wrapped, so a 1024-rank program's longest line
    is as long as an 8-rank one's (a 3072-rank plan's MESH was one line of 60K characters); and the
    formulas give the plan's own mesh. The longest line of either is a line of model code: the fused attention
    call with its call site and the buffer its mask is made from (shape_mask_attention), as torch.fx writes it."""
    longest = {}
    for topo, gb in (("1x8xA100-80GB", 16), ("128x8xA100-80GB", 2048)):
        plan = compile(meta_gpt_graph, topo, global_batch_size=gb, pp=2, tp=2, precision="fp32")
        for rank in (0, plan.world_size - 1):
            prog = plan.program(rank)
            longest[topo] = max(longest.get(topo, 0), max(map(len, prog.source.splitlines())))
            ns = prog.namespace()
            assert ns["MESH"] == tuple((m.rank, m.pp, m.dp, m.tp) for m in plan.mesh)
            assert ns["NODE_OF"] == tuple(m.node for m in plan.mesh)
    assert longest["128x8xA100-80GB"] <= longest["1x8xA100-80GB"] + 16 <= 360, longest


def test_no_line_of_a_program_grows_with_the_model_depth():
    """The blocks that recompute are a formula over the stack (a 96-layer data-parallel program named each block
    on one line of 1,948 characters): a 48-block model's longest line is a 4-block one's."""
    from conftest import _traced_on_meta
    from examples import gpt

    longest = {}
    for layers in (4, 48):
        cfg = gpt.GPTConfig(n_layer=layers, n_head=4, n_embd=64, block_size=64, vocab_size=256)
        g = _traced_on_meta(lambda: gpt.GPT(cfg), 2, 64)
        for zero in (1, 3):
            plan = compile(g, "1x8xA100-80GB", global_batch_size=16, pp=1, tp=1, zero_stage=zero, recompute="full",
                           precision="fp32")
            src = plan.program(0).source
            assert f"engine.checkpoint_blocks(tuple(f'transformer.h.{{i}}' for i in range({layers})), 'full')" in src
            longest[layers] = max(longest.get(layers, 0), max(map(len, src.splitlines())))
    assert longest[48] == longest[4], longest


# ---- golden programs ----------------------------------------------------------------------------------------
# tests/golden/program_*.txt hold whole generated programs, as tests/golden/plan_*.txt hold printed plans: a
# change to what a rank runs shows as a diff to review. Regenerate with
#     PARTITIONER_REGEN_GOLDEN=1 python -m pytest -q tests/test_codegen.py -k golden

GOLDEN_PROGRAMS = {  # file: (topology, pins, rank)
    "program_gpt_tiny_dp4_zero1_rank1.txt": ("local:4", dict(pp=1, tp=1, zero_stage=1), 1),
    "program_gpt_tiny_pp2_tp2_rank2.txt": ("local:4", dict(pp=2, tp=2, dp=1, sp=False), 2),
    "program_gpt_tiny_pp2_tp2_sp_rank2.txt": ("local:4", dict(pp=2, tp=2, dp=1, sp=True), 2),
    "program_gpt_tiny_pp2_dp2_zero3_rank1.txt": ("local:4", dict(pp=2, tp=1, dp=2, zero_stage=3), 1),
    "program_gpt_tiny_local_sgd_rank0.txt": ("local:2", dict(pp=1, tp=1, async_sgd=dict(every=4)), 0),
    "program_gpt_tiny_dp2_cp2_rank3.txt": ("local:4", dict(pp=1, tp=1, dp=2, cp=2), 3),
}


# expert parallelism: test_expert_run's tiny Mixtral (2 MoE layers of 4 experts, the load-balancing loss on)
GOLDEN_EP_PROGRAMS = {"program_mixtral_tiny_dp2_ep2_rank1.txt": (dict(dp=2, ep=2), 1)}


@pytest.mark.parametrize("name", sorted(GOLDEN_PROGRAMS) + sorted(GOLDEN_EP_PROGRAMS))
def test_golden_programs(graph, name):
    import os
    from pathlib import Path

    if name in GOLDEN_EP_PROGRAMS:
        from test_expert_run import plan_for

        pins, rank = GOLDEN_EP_PROGRAMS[name]
        plan = plan_for("mixtral", **pins)
    else:
        topo, pins, rank = GOLDEN_PROGRAMS[name]
        plan = compile(graph, topo, global_batch_size=8, precision="fp32", microbatch_size=2, **pins)
    source = plan.program(rank).source
    path = Path(__file__).parent / "golden" / name
    if os.environ.get("PARTITIONER_REGEN_GOLDEN") == "1":
        path.write_text(source)
        return
    assert path.is_file(), f"{path} is missing: PARTITIONER_REGEN_GOLDEN=1 python -m pytest -q {__file__} -k golden"
    assert source == path.read_text(), (
        f"rank {rank}'s program differs from {path}. If the change is intended, regenerate with "
        f"PARTITIONER_REGEN_GOLDEN=1 python -m pytest -q tests/test_codegen.py -k golden and review the diff")
