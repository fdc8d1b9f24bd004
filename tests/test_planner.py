"""The planner: optimal under its cost model, sane against practice, honours pins,
deterministic, refuses what cannot hold."""

from __future__ import annotations

import itertools
import json
import math
import random
import re

import pytest
import torch

from examples import gpt as gpt_mod
from partitioner import (DeclarationError, OpGraph, Plan, PlanFormatError, PlanInfeasibleError, PlanMismatchError,
                         Topology, compile, trace)
from partitioner.planner.stage_costs import StageEvaluator
from partitioner.planner.unit_costs import CostContext
from partitioner.planner.cut import evaluate_cut
from partitioner.planner.declarations import Declarations
from partitioner.planner.schedule import peak_inflight, validate
from partitioner.planner.search import enumerate_candidates, search
from partitioner.planner.tensor_split import find_splits

GiB = 2**30


def meta_gpt(n_layer, n_embd=64, n_head=4, block=64, vocab=256, dropout=0.0, seq=None) -> OpGraph:
    cfg = gpt_mod.GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block, vocab_size=vocab,
                            dropout=dropout)
    with torch.device("meta"):
        model = gpt_mod.GPT(cfg)
    idx = torch.empty(2, seq or block, dtype=torch.long, device="meta")
    return trace(model, (idx, idx))


@pytest.fixture(scope="module")
def small() -> OpGraph:
    model = gpt_mod.gpt_small()
    return trace(model, gpt_mod.example_batch(model, 8))


@pytest.fixture(scope="module")
def gpt3_175b() -> OpGraph:
    with torch.device("meta"):
        model = gpt_mod.gpt3_175b()
    idx = torch.empty(1, 2048, dtype=torch.long, device="meta")
    return trace(model, (idx, idx))


# ---------------------------------------------------------------- optimality


def exhaustive_best(ctx: CostContext, cands) -> float:
    """The best step time over every candidate and every cut into contiguous stages."""
    n = len(ctx.units)
    best = math.inf
    for cand in cands:
        ev = StageEvaluator(ctx, cand)
        S = ev.num_stages
        if S > n:
            continue
        for inner in itertools.combinations(range(1, n), S - 1):
            cut = evaluate_cut(ev, (0, *inner, n))
            if cut is not None:
                best = min(best, cut.step_time_s)
    return best


INSTANCES = [  # (layers, topology, global batch, memory fraction, pins)
    (3, "local:4", 8, 0.9, {}),
    (5, "2x4xA100-80GB", 16, 0.9, {}),
    (8, "1x8xH100-80GB", 16, 2e-5, {}),
    (6, "2x2xV100-32GB", 8, 3e-5, {"precision": "fp16-mixed"}),
    (12, "2x8xA100-40GB", 32, 1e-4, {"zero_stage": 1, "recompute": "selective", "microbatch_size": 1}),
    (10, "4x4xA100-80GB", 16, 0.9, {"tp": 1, "zero_stage": 0, "recompute": "none", "microbatch_size": 1}),
]


@pytest.mark.parametrize("layers,topo,gb,frac,pins", INSTANCES)
def test_search_finds_the_exhaustive_optimum(layers, topo, gb, frac, pins):
    rng = random.Random(layers)
    g = meta_gpt(layers, n_embd=rng.choice([64, 128]))
    topology = Topology.parse(topo)
    splits = find_splits(g)
    decl = Declarations(global_batch_size=gb, **pins)
    ctx = CostContext(g, topology, splits, precision=decl.precision, optimizer="adam", seq_len=g.traced_seq_len,
                      memory_cap=frac * topology.device.memory_bytes)
    valid = splits.valid_tp(tuple(t for t in range(1, topology.world_size + 1) if topology.world_size % t == 0))
    cands = list(enumerate_candidates(decl, world_size=topology.world_size,
                                      devices_per_node=topology.devices_per_node, num_units=len(ctx.units),
                                      valid_tp=valid))
    found = search(ctx, cands, keep=1)
    truth = exhaustive_best(ctx, cands)
    if math.isinf(truth):
        assert not found.ranked
    else:
        assert found.ranked and found.ranked[0].cut.step_time_s == pytest.approx(truth, rel=1e-9)
    assert found.evaluated <= found.space


@pytest.mark.parametrize("pins", [dict(pp=2, dp=2, microbatch_size=1, schedule="1f1b"),
                                  dict(pp=4, microbatch_size=2, zero_stage=3, recompute="full"),
                                  dict(pp=2, tp=2, interleave=2, schedule="interleaved-1f1b", microbatch_size=1)])
def test_memoised_stage_costs_equal_their_evaluation_over_every_range(pins):
    """StageEvaluator.stage answers repeated ranges from a memo keyed on their contents: every range at every
    stage index must cost what evaluating it does (the prefix units, the tied embedding and LM head, and the
    p2p into a range all differ by position)."""
    g = meta_gpt(6)
    topology = Topology.parse("2x4xA100-80GB")
    splits = find_splits(g)
    decl = Declarations(global_batch_size=16, **pins)
    ctx = CostContext(g, topology, splits, precision="bf16-mixed", optimizer="adam", seq_len=g.traced_seq_len,
                      memory_cap=0.9 * topology.device.memory_bytes)
    valid = splits.valid_tp((1, 2, 4, 8))
    cand = next(iter(enumerate_candidates(decl, world_size=8, devices_per_node=4, num_units=len(ctx.units),
                                          valid_tp=valid)))
    ev = StageEvaluator(ctx, cand)
    n, asked = len(ctx.units), 0
    for i, j in itertools.combinations(range(n + 1), 2):
        for k in range(ev.num_stages):
            if (i == 0) != (k == 0) or (j == n) != (k == ev.num_stages - 1):
                continue  # not a stage of any cut
            memo, direct = ev.stage(i, j, k), ev._stage(i, j, k)
            assert memo.c == pytest.approx(direct.c, rel=1e-12) and memo.tail_s == pytest.approx(direct.tail_s, rel=1e-12)
            assert memo.memory == pytest.approx(direct.memory, rel=1e-12) and memo.params == pytest.approx(direct.params)
            assert (memo.fits, memo.compression) == (direct.fits, direct.compression)
            asked += 1
    assert len(ev._stage_memo) <= asked
    if ev.num_stages > 2:  # (two stages: every range is a prefix or a suffix, each asked once)
        assert len(ev._stage_memo) < asked  # the repeated blocks share entries


def test_interleaved_ranks_fit_by_the_sum_of_their_stages():
    """A rank of an interleaved pipeline holds v virtual stages, its first ones more microbatches in flight
    than its last: it fits when their sum does, though its biggest stage takes more than 1/v of the cap.
    Under a cap just above the plan's own per-rank peak the plan is found, not refused."""
    g = meta_gpt(8, n_embd=256)
    topo = Topology.parse("local:4")
    pins = dict(global_batch_size=32, pp=4, dp=1, tp=1, microbatch_size=4, schedule="interleaved-1f1b",
                interleave=2, recompute="none", zero_stage=0)
    loose = compile(g, topo, max_memory_fraction=0.9, **pins)
    peak = max(m.total for m in loose.rank_memory().values())
    share = max((st.memory.total - st.memory.buffers) * 2 + st.memory.buffers for st in loose.stages)
    assert share > 1.1 * peak  # the 1/v rule alone would want 10 % more than the rank holds
    cap = peak * 1.005
    tight = compile(g, topo, max_memory_fraction=cap / topo.device.memory_bytes, **pins)
    assert max(m.total for m in tight.rank_memory().values()) <= cap


def test_interleaved_chunks_stay_balanced_where_the_first_memory_rule_would_force_them_apart():
    """Llama-3-70B, tp4 pp8 x 5 chunks on 64 H100s, as Megatron-Bridge trains it: under the first pass's rule (each
    chunk within 1/5 of the cap) the chunk holding the embedding cannot take two layers, which pushed a third layer
    onto other chunks (1-3 layers each, 38.0 s a step by the plan). The leader is cut again under the rank-sum
    rule: every chunk two layers, the chunks with the embedding or the head within a layer of the rest."""
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, use_cache=False)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg)
    plan = compile(model, "8x8xH100-80GB", example_inputs=(torch.zeros(1, 8192, dtype=torch.long, device="meta"),),
                   global_batch_size=256, tp=4, pp=8, dp=2, zero_stage=0, microbatch_size=1, precision="bf16-mixed",
                   schedule="interleaved-1f1b", interleave=5, recompute="full")
    layers = [sum(b.startswith("model.layers.") for b in st.blocks) for st in plan.stages]
    assert layers == [2] * 40, layers
    cs = [st.forward_s + st.backward_s for st in plan.stages]
    assert max(cs) < 1.5 * min(cs)  # the head's chunk: its two layers and the LM head


def test_memory_cap_is_respected_and_binds(small):
    loose = compile(small, "local:4", global_batch_size=32, max_memory_fraction=0.9)
    cap = loose.predicted.peak_memory_bytes * 0.6 / (8 * GiB)
    tight = compile(small, "local:4", global_batch_size=32, max_memory_fraction=cap)
    assert tight.predicted.peak_memory_bytes <= cap * 8 * GiB * (1 + 1e-9)
    assert tight.config != loose.config


# ---------------------------------------------------------------- practice


def test_gpt3_175b_on_1024_a100s_looks_like_practice(gpt3_175b):
    plan = compile(gpt3_175b, "128x8xA100-80GB", global_batch_size=1536)
    assert plan.predicted.peak_memory_bytes <= 80 * GiB
    # practice: tensor groups inside a node, and either a pipeline across nodes (Megatron's 3D) or fully
    # sharded data parallelism over them (FSDP + tensor parallelism, torchtitan's 2D). This used to demand
    # a pipeline; it accepts FSDP + TP since selective recomputation is costed as runtime.engines.recompute runs
    # it (only matrix products' and norms' outputs kept): dp256 tp4 ZeRO-3 then fits in 61 GiB and predicts
    # 20.4 s/step against 22.3 s for the best pipelined plan, the layout torchtitan trains such models with
    assert 1 < plan.tp <= 8 and (plan.pp > 1 or plan.zero_stage == 3)
    # Published: Megatron-LM with sequence parallelism and selective recomputation, 51-56 % MFU for 175B-1T
    # (Korthikanti et al. 2022, Table 5). With sp and zb-h1 the planner predicts 60.5 % here: optimistic, as
    # its -23..-28 % on the published MT-NLG runs is (../shared/fidelity); the bound says where it must stay.
    assert 0.30 <= plan.predicted.mfu <= 0.62
    # Under Megatron-LM's own constraint (no ZeRO: every replica holds full optimizer state),
    # memory forces tp * pp >= 64, tensor groups inside a node and a pipeline across nodes; Megatron's
    # published layout, tensor groups of 8 (Narayanan et al. 2021, Table 1), is within 5 % of the best.
    megatron = compile(gpt3_175b, "128x8xA100-80GB", global_batch_size=1536, zero_stage=0)
    assert megatron.tp in (4, 8) and megatron.pp > 1 and megatron.tp * megatron.pp >= 64
    assert megatron.predicted.peak_memory_bytes <= 80 * GiB and 0.30 <= megatron.predicted.mfu <= 0.60
    published = compile(gpt3_175b, "128x8xA100-80GB", global_batch_size=1536, zero_stage=0, tp=8)
    assert published.predicted.step_time_s <= 1.05 * megatron.predicted.step_time_s
    tp_groups = {tuple(m.rank for m in megatron.mesh if m.pp == 0 and m.dp == d) for d in range(megatron.dp)}
    for group in tp_groups:
        assert len({megatron.mesh[r].node for r in group}) == 1  # a tensor group never leaves its node


def test_gpt3_1_3b_on_8_a100s_is_pure_data_parallel():
    with torch.device("meta"):
        model = gpt_mod.gpt3_1_3b()
    idx = torch.empty(1, 2048, dtype=torch.long, device="meta")
    plan = compile(model, "8xA100-80GB", example_inputs=(idx, idx), global_batch_size=512)
    assert (plan.dp, plan.tp, plan.pp) == (8, 1, 1)


def test_stages_balance_time_and_carry_embedding_and_head(gpt3_175b):
    plan = compile(gpt3_175b, "128x8xA100-80GB", global_batch_size=1536, zero_stage=0, tp=8, pp=8, schedule="1f1b")
    c = [s.forward_s + s.backward_s for s in plan.stages]
    assert max(c) / min(c) < 1.1  # balanced...
    sizes = [len([b for b in s.blocks if b.startswith("transformer.h.")]) for s in plan.stages]
    assert sum(sizes) == 96 and sizes[0] <= sizes[3] and sizes[-1] <= sizes[3]  # ...by giving the ends fewer layers
    assert plan.stages[0].blocks[0] == "prefix" and plan.stages[-1].blocks[-1] == "suffix"


# ---------------------------------------------------------------- pins


@pytest.mark.parametrize("pins", [
    dict(dp=2, tp=2, pp=2),
    dict(zero_stage=3),
    dict(pp=2, schedule="gpipe", microbatch_size=2),
    dict(pp=2, schedule="interleaved-1f1b", interleave=2),
    dict(pp=2, schedule="zb-h1", dp=2, zero_stage=1),
    dict(recompute="full", tp=4),
    dict(dp=8),
])
def test_pinned_declarations_are_honoured(small, pins):
    plan = compile(small, "local:8", global_batch_size=32, **pins)
    for k, v in pins.items():
        assert getattr(plan.config, k) == v, k
    assert plan.dp * plan.tp * plan.pp == 8
    assert plan.dp * plan.microbatch_size * plan.num_microbatches == 32
    validate(plan.instructions)


@pytest.mark.parametrize("pins,match", [
    (dict(dp=2, tp=2, pp=1), r"dp\(2\) \* tp\(2\) \* pp\(1\) = 4 != world size 8"),
    (dict(tp=3), r"tp\(3\) = 3 does not divide world size 8 of topology local:8; valid products: 1, 2, 4, 8"),
    (dict(pp=8), r"pp=8 > 4 blocks.*valid pp: 1, 2, 4"),
    (dict(dp=4, microbatch_size=3), r"global_batch_size=32 is not divisible by dp\(4\) \* microbatch_size\(3\) = 12; "
                                    r"valid global batch sizes near it: 24, 36"),
    (dict(zero_stage=4), r"zero_stage=4: must be 0 \(DDP\), 1, 2 or 3"),
    (dict(schedule="zigzag"), r"schedule='zigzag': must be one of 'gpipe', '1f1b', 'interleaved-1f1b', 'zb-h1'"),
    (dict(schedule="zb-h1", recompute="selective"), r"schedule='zb-h1' with recompute='selective': .*'full' or"),
    (dict(schedule="interleaved-zb", recompute="selective"), r"schedule='interleaved-zb' with recompute='selective'"),
    (dict(schedule="zb-v", interleave=3), r"schedule='zb-v' places exactly 2 stages per pipeline rank"),
    (dict(schedule="dualpipe-v", interleave=3), r"schedule='dualpipe-v' places exactly 2 stages per pipeline rank"),
    (dict(schedule="dualpipe-v", pp=2, dp=4, tp=1, microbatch_size=4),
     r"schedule='dualpipe-v' needs at least 2 pp = 4 microbatches per replica.*= 2: use microbatch_size <= 2"),
    (dict(schedule="interleaved-zb", interleave=1), r"schedule='interleaved-zb' with interleave=1 is plain zb-h1"),
    (dict(interleave=2, schedule="1f1b"), r"interleave=2 needs schedule='interleaved-1f1b' or 'interleaved-zb'"),
    (dict(precision="fp8"), r"precision='fp8': must be one of"),
    (dict(max_memory_fraction=1.5), r"max_memory_fraction=1.5: must be in \(0, 1\]"),
])
def test_impossible_declarations_are_refused_with_the_fix(small, pins, match):
    with pytest.raises(DeclarationError, match=match) as info:
        compile(small, "local:8", global_batch_size=32, **pins)
    assert isinstance(info.value, ValueError)


def test_tp_that_does_not_divide_the_heads_is_refused(small):
    with pytest.raises(DeclarationError, match=r"tp=3 does not divide heads of transformer\.h\.\*\.attn \(4\), "
                                               r"ffn .*valid tp: 1, 2$"):
        compile(small, "local:6", global_batch_size=36, tp=3)


def test_a_precision_the_device_lacks_is_refused(small):
    with pytest.raises(ValueError, match="'V100-32GB' has no peak FLOP/s for dtype 'bf16'.*choose another precision"):
        compile(small, "2xV100-32GB", global_batch_size=8, precision="bf16-mixed")


def test_global_batch_must_divide(small):
    with pytest.raises(DeclarationError, match=r"global_batch_size=30 is not divisible by dp\(8\)"):
        compile(small, "local:8", global_batch_size=30, dp=8)


def test_nothing_fits_says_how_far_and_what_to_relax(gpt3_175b):
    with pytest.raises(PlanInfeasibleError) as info:
        compile(gpt3_175b, "8xA100-80GB", global_batch_size=64)
    msg = str(info.value)
    assert "least memory per rank any candidate needs is" in msg and "GiB" in msg
    assert re.search(r"A100-80GB offers 7\d\.\d GiB \(80 GiB over the caching allocator's 1\.\d+ at recompute=", msg)
    assert "more devices" in msg and "recompute='full'" in msg and "ZeRO-3" in msg


# ---------------------------------------------------------------- the plan as data


def test_same_inputs_give_byte_identical_json(small):
    a = compile(small, "local:8", global_batch_size=32)
    b = compile(small, "local:8", global_batch_size=32)
    assert a.to_json() == b.to_json()


def test_save_load_round_trips_and_checks_what_it_belongs_to(small, tmp_path):
    plan = compile(small, "local:8", global_batch_size=32, pp=2, schedule="1f1b")
    path = plan.save(tmp_path / "p.plan.json")
    loaded = Plan.load(path, graph=small, topology="local:8")
    assert loaded == plan and loaded.to_json() == plan.to_json()
    other = meta_gpt(3)
    with pytest.raises(PlanMismatchError, match="compiled for another model"):
        Plan.load(path, graph=other)
    with pytest.raises(PlanMismatchError, match="compiled for topology local:8 .* not local:4"):
        Plan.load(path, topology="local:4")


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(version=99), "version 99 is not supported"),
    (lambda d: d["config"].update(dp="two"), r"plan.config.dp: expected an integer"),
    (lambda d: d.update(surprise=1), r"unknown field\(s\) \['surprise'\]"),
    (lambda d: d.update(instructions="rank 0: 0X0"), r"plan.instructions"),
])
def test_corrupt_plan_files_are_refused_naming_the_field(small, tmp_path, edit, match):
    data = json.loads(compile(small, "local:4", global_batch_size=16).to_json())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFormatError, match=match):
        Plan.load(path)


def test_plan_carries_mesh_placements_schedule_and_prediction(small):
    plan = compile(small, "local:8", global_batch_size=32, dp=2, tp=2, pp=2, schedule="1f1b")
    assert [(m.pp, m.dp, m.tp) for m in plan.mesh[:4]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert {p.param for p in plan.placements} == {p.name for p in small.params}
    assert plan.placement("transformer.h.0.mlp.c_fc.weight").spec == "S(0)"
    assert plan.placement("transformer.h.0.mlp.c_proj.weight").spec == "S(1)"
    assert plan.placement("transformer.h.0.ln_1.weight").spec == "R"
    assert plan.placement("transformer.wte.weight").stages == (0, 1)  # tied: embedding and LM head
    assert plan.schedule == "1f1b" and plan.instructions.kind == "1f1b"
    validate(plan.instructions)
    assert peak_inflight(plan.instructions) == (min(2, plan.num_microbatches), 1)
    pr = plan.predicted
    assert pr.step_time_s > 0 and pr.tokens_per_s == pytest.approx(32 * 128 / pr.step_time_s)
    assert pr.peak_memory_bytes == pytest.approx(pr.memory.total)
    assert 0 < pr.mfu < 1 and pr.bytes_per_link["intra_node"] > 0
    text = str(plan)
    assert str(plan.config).startswith("dp2 tp2") and " pp2 " in str(plan.config)  # tp2+sp where it pays
    assert str(plan.config) in text and "c_fc.weight" in text and "S(1)" in text and "runners-up" in text
    assert f"Why {plan.config}" in plan.explain()


def test_node_granularity_cuts_inside_blocks():
    g = meta_gpt(2)
    plan = compile(g, "local:4", global_batch_size=8, pp=4, cut_granularity="node", precision="fp32")
    assert plan.pp == 4 and len(plan.stages) == 4
    assert all(s.first_node <= s.last_node for s in plan.stages)
    assert plan.stages[-1].last_node == len(g.nodes) - 1


def test_compile_traces_a_model_given_example_inputs():
    model = gpt_mod.gpt_tiny()
    plan = compile(model, "local:2", example_inputs=gpt_mod.example_batch(model, 2), global_batch_size=8)
    assert plan.dp * plan.tp * plan.pp == 2 and plan.model_name == "GPT"
    with pytest.raises(DeclarationError, match="example_inputs: required"):
        compile(model, "local:2", global_batch_size=8)
    with pytest.raises(DeclarationError, match="global_batch_size: required"):
        compile(model, "local:2", example_inputs=gpt_mod.example_batch(model, 2))


def test_declarations_as_one_value_plan_as_the_keywords(meta_gpt_graph):
    """compile(declarations=Declarations) is compile(**pins); giving a value both ways, or a stray type, is refused."""
    from partitioner import Declarations

    kw = dict(global_batch_size=16, tp=2, zero_stage=1, compression="bf16", clip_grad_norm=0.5)
    by_value = compile(meta_gpt_graph, "2x4xA100-80GB", declarations=Declarations.declare(**kw))
    assert by_value.to_json() == compile(meta_gpt_graph, "2x4xA100-80GB", **kw).to_json()
    with pytest.raises(DeclarationError, match="declarations= and tp= both given"):
        compile(meta_gpt_graph, "local:4", tp=2, declarations=Declarations.declare(global_batch_size=8))
    with pytest.raises(DeclarationError, match="pass a partitioner.Declarations"):
        compile(meta_gpt_graph, "local:4", declarations={"global_batch_size": 8})
    with pytest.raises(DeclarationError, match="tensor_parallel: not a declaration"):
        Declarations.declare(global_batch_size=8, tensor_parallel=2)


def test_zb_v_plan_places_its_v_and_round_trips(small, tmp_path):
    """zb-v: stage s and 2 pp - 1 - s on pipeline rank s, in the plan's stages, its per-rank memory, the
    generated programs' peers, and through save / load (check_plan holds the placement to the schedule)."""
    plan = compile(small, "local:4", global_batch_size=32, dp=2, pp=2, tp=1, schedule="zb-v", microbatch_size=4)
    assert (plan.schedule, plan.interleave, plan.num_microbatches) == ("zb-v", 2, 4)
    pp_of = {m.rank: m.pp for m in plan.mesh}
    assert [sorted({pp_of[r] for r in st.ranks}) for st in plan.stages] == [[0], [1], [1], [0]]
    validate(plan.instructions)
    assert plan.instructions.stages_of(0) == (0, 3)
    assert "STAGE_RANKS = (0, 2, 2, 0)" in plan.program(rank=0).source
    assert set(plan.rank_memory()) == {0, 1}
    plan.save(tmp_path / "zbv.plan.json")
    assert Plan.load(tmp_path / "zbv.plan.json", graph=small, topology="local:4").config == plan.config


def test_zero_bubble_runs_under_zero3_when_pinned_and_is_not_searched_into_it(small):
    """A split backward under ZeRO-3 is honoured when pinned (W gathers its units again:
    runtime.engines.zero3.split_backward); the search, whose cost model does not charge those gathers, pairs
    the zero-bubble schedules with ZeRO 0-2 only."""
    for schedule in ("zb-h1", "interleaved-zb", "zb-v"):
        plan = compile(small, "local:4", global_batch_size=32, dp=2, pp=2, tp=1, schedule=schedule, zero_stage=3,
                       microbatch_size=4)
        assert (plan.config.schedule, plan.config.zero_stage) == (schedule, 3)
    plan = compile(small, "local:4", global_batch_size=32, dp=2, pp=2, tp=1, alternatives=50)
    searched = [plan.config] + [a.config for a in plan.alternatives]
    assert not [c for c in searched if c.schedule in ("zb-h1", "interleaved-zb", "zb-v") and c.zero_stage == 3]
    assert any(c.zero_stage == 3 for c in searched)


def test_dualpipe_v_is_pinnable_placed_in_its_v_and_not_searched(small, tmp_path):
    """dualpipe-v pinned: zb-v's V in the plan's stages and the generated programs' peers, 2 pp microbatches at
    least, through save / load; the search does not try it unpinned (run pair by pair it is zb-v at best)."""
    plan = compile(small, "local:4", global_batch_size=32, dp=2, pp=2, tp=1, schedule="dualpipe-v", microbatch_size=4)
    assert (plan.schedule, plan.interleave, plan.num_microbatches) == ("dualpipe-v", 2, 4)
    pp_of = {m.rank: m.pp for m in plan.mesh}
    assert [sorted({pp_of[r] for r in st.ranks}) for st in plan.stages] == [[0], [1], [1], [0]]
    validate(plan.instructions)
    assert "STAGE_RANKS = (0, 2, 2, 0)" in plan.program(rank=0).source
    assert "dualpipe-v" in str(plan)
    plan.save(tmp_path / "dualpipe.plan.json")
    assert Plan.load(tmp_path / "dualpipe.plan.json", graph=small, topology="local:4").config == plan.config
    searched = compile(small, "local:4", global_batch_size=32, dp=2, pp=2, tp=1, alternatives=50)
    assert all(c.schedule != "dualpipe-v" for c in [searched.config] + [a.config for a in searched.alternatives])


def test_the_search_tries_the_zero_bubble_interleavings(small):
    """Unpinned, zb-v is a candidate where m >= 2 pp - 1 microbatches fill its V, interleaved-zb (v=2) at m = pp;
    both are planned with their predicted bubble below interleaved 1F1B's at the same configuration."""
    pinned = dict(dp=1, pp=2, tp=1, zero_stage=0, recompute="none")
    plans = {s: compile(small, "local:2", global_batch_size=m * 4, microbatch_size=4, schedule=s, **pinned)
             for s, m in (("zb-v", 4), ("interleaved-zb", 2))}
    other = {m: compile(small, "local:2", global_batch_size=m * 4, microbatch_size=4, schedule="interleaved-1f1b",
                        interleave=2, **pinned) for m in (4, 2)}
    assert plans["zb-v"].predicted.bubble_fraction < other[4].predicted.bubble_fraction
    assert plans["interleaved-zb"].predicted.bubble_fraction < other[2].predicted.bubble_fraction
    from partitioner.planner.search import _schedules
    d = Declarations(global_batch_size=16)
    assert ("zb-v", 2) in _schedules(d, 2, 4, 12) and ("interleaved-zb", 2) not in _schedules(d, 2, 4, 12)
    assert ("interleaved-zb", 2) in _schedules(d, 2, 2, 12) and ("zb-v", 2) not in _schedules(d, 2, 2, 12)
