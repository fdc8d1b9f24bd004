"""Per-rank programs for pipeline, tensor-parallel and 3D plans (pp > 1 or tp > 1).

The program holds, as readable Python: the model's code (prefix, one block
template, suffix: `plan.code`, cut from the exported graph at compile time
and, with tp > 1, rewritten for this rank's shard), which virtual stages and
blocks this rank runs, its instruction list, the peers of every stage, the
tensor placements, the tied parameters and their group, and the
data-parallel engine over its replicas. `build()` returns a
`runtime.pipeline.runner.PipelineRunner`.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from cost_models.placements import is_sharded
from partitioner.codegen.common import (
    ZERO_WHAT,
    CodegenError,
    attention_import,
    autocast_line,
    cp_import,
    ep_context,
    ep_import,
    ep_stage_lines,
    dp_compression,
    forked_import,
    fp8_import,
    literal,
    mesh_lines,
    optimizer_lines,
    program_header,
    ranks_text,
    reduce_scatter_impl,
    segment_tables,
    slice_text,
)
from partitioner.codegen.data_parallel import context_lines, expert_engine_lines, expert_lines, expert_tables
from partitioner.codegen.instructions import instruction_lines
from runtime.comm.groups import stage_peers  # the rule the program will use
from runtime.pipeline.random_streams import SEED_STRIDE

if TYPE_CHECKING:
    from partitioner.planner.plan import Plan

__all__ = ["pipeline_program_source", "stage_blocks"]


def stage_blocks(plan: Plan) -> dict[int, tuple[int, int, bool, bool]]:
    """Virtual stage -> (first block, end block, runs the prefix, runs the suffix), from the plan's cuts."""
    code = plan.code
    out: dict[int, tuple[int, int, bool, bool]] = {}
    seen: set[int] = set()
    for st in plan.stages:
        idx = []
        for name in st.blocks:
            if name in ("prefix", "suffix"):
                continue
            tail = name[len(code.stack) + 1:] if code.stack else name
            if not tail.isdigit():
                raise CodegenError(f"stage {st.index} holds {name!r}, not a whole block of {code.stack}")
            idx.append(int(tail))
        if idx != list(range(idx[0], idx[-1] + 1)) if idx else False:
            raise CodegenError(f"stage {st.index} holds blocks {idx}, not a contiguous run")
        if seen & set(idx):
            raise CodegenError(f"stage {st.index} shares a block with an earlier stage: the cut falls inside a block "
                               "(cut_granularity='node'); code is generated for block-granularity cuts only")
        seen |= set(idx)
        # the first stage runs the prefix even where it computes nothing: it hands on the input the first block
        # reads (segments.extract), a model whose blocks start at its input
        pre, suf = "prefix" in st.blocks or st.index == 0, "suffix" in st.blocks
        if (pre and st.index != 0) or (suf and st.index != len(plan.stages) - 1):
            raise CodegenError(f"stage {st.index} holds part of the prefix or suffix: cut at block boundaries")
        out[st.index] = (idx[0], idx[-1] + 1, pre, suf) if idx else (0, 0, pre, suf)
    if seen != set(range(code.num_blocks)):
        raise CodegenError(f"the stages hold blocks {sorted(seen)}, not all {code.num_blocks} blocks")
    return out


def _holders(plan: Plan, blocks: dict[int, tuple[int, int, bool, bool]]) -> dict[str, set[int]]:
    """Parameter -> the pipeline ranks whose stages read it."""
    code, sched = plan.code, plan.instructions
    out: dict[str, set[int]] = {}
    for s, (a, b, pre, suf) in blocks.items():
        r = sched.rank_of(s)
        names = [n for _, n in code.prefix.params] if pre else []
        names += [n for _, n in code.suffix.params] if suf and code.suffix else []
        for i in range(a, b):
            names += list(code.block_params(i))
        for n in names:
            out.setdefault(n, set()).add(r)
    return out


def pipeline_program_source(plan: Plan, rank: int) -> tuple[str, str]:
    c, code = plan.config, plan.code
    if code is None:
        raise CodegenError(f"this plan (pp={c.pp}, tp={c.tp}) carries no model code: "
                           f"{plan.code_note or 'compile it from the model (an nn.Module), not from a saved OpGraph'}")
    if code.tp != c.tp:
        raise CodegenError(f"the plan's model code is for tp={code.tp}, its configuration tp={c.tp}; recompile")
    if c.pp > 1 and code.block is None:
        raise CodegenError("pp > 1 needs a layer stack to cut; this model has none: compile with pp=1")
    plan_json = plan.to_json()
    h = hashlib.sha256(plan_json.encode()).hexdigest()
    me = plan.mesh[rank]
    tc = f", torch_compile={plan.torch_compile!r}" if plan.torch_compile else ""  # runtime.engines.compiled
    blocks = stage_blocks(plan) if code.block is not None else {0: (0, 0, True, True)}
    sched = plan.instructions
    mine = sched.stages_of(me.pp)
    my_blocks = {s: blocks[s] for s in mine}
    by_coord = {(m.pp, m.dp, m.tp, m.cp): m.rank for m in plan.mesh}
    stage_ranks = tuple(by_coord[(sched.rank_of(s), me.dp, me.tp, me.cp)] for s in range(len(plan.stages)))
    dp_ranks = tuple(m.rank for m in plan.mesh if m.pp == me.pp and m.tp == me.tp)
    holders = _holders(plan, blocks) if code.block is not None else {}
    # a parameter that trains nothing has no gradient to sum: each stage reading it holds its own copy
    tied = sorted(n for n, rs in holders.items() if len(rs) > 1 and n not in code.frozen)
    holder_sets = {frozenset(holders[n]) for n in tied}
    if len(holder_sets) > 1:
        raise CodegenError(f"parameters {tied} are shared by different sets of pipeline stages; only one tied "
                           "group (embedding and LM head) is supported")
    tie_pp = sorted(next(iter(holder_sets))) if holder_sets else []
    tie_groups = sorted({tuple(sorted(by_coord[(p, d, t, k)] for p in tie_pp))
                         for d in range(c.dp) for t in range(c.tp) for k in range(c.cp)}) if tie_pp else []
    # every rank creates every tie group, in one order (c10d): the runtime's rule derives them from the mesh
    by_rule = bool(tie_groups) and stage_peers(plan.mesh, tie_pp) == tuple(tie_groups)
    tie_src = f"stage_peers(MESH, {tuple(tie_pp)!r})" if by_rule else literal(tuple(tie_groups))
    held: set[str] = set()
    for s, (a, b, pre, suf) in my_blocks.items():
        held |= {n for _, n in code.prefix.params} if pre else set()
        held |= {n for _, n in code.suffix.params} if suf and code.suffix else set()
        for i in range(a, b):
            held |= set(code.block_params(i))
    placements = {p.param: (p.spec, p.fused) for p in plan.placements if is_sharded(p.spec) and p.param in held}
    apart = set(tied) | ({n for n, _ in code.experts} if c.ep > 1 else set())  # outside the data-parallel engine
    units = [tuple(n for n in code.block_params(i) if n not in apart)
             for s, (a, b, _, _) in sorted(my_blocks.items()) for i in range(a, b)]
    rest = tuple(sorted(held - {n for u in units for n in u} - apart))
    unit_modules = [f"{code.stack}.{i}" if code.stack else str(i)
                    for s, (a, b, _, _) in sorted(my_blocks.items()) for i in range(a, b)
                    if any(n not in apart for n in code.block_params(i))]
    units = [u for u in units if u] + ([rest] if rest else [])
    unit_modules += [""] if rest else []  # prefix/suffix parameters: gathered by the root's (the stage's) forward
    per_module = c.zero_stage == 3 and c.zero3_unit == "module"
    if per_module:  # each module holding parameters its own unit, gathered by the first op reading it
        by_module: dict[str, list[str]] = {}
        for n in (n for u in units for n in u):
            by_module.setdefault(n.rpartition(".")[0], []).append(n)
        units, unit_modules = [tuple(u) for u in by_module.values()], list(by_module)
    impl, why_impl = reduce_scatter_impl(plan)
    stage_lines = "\n".join(
        f"    {s}: ({a}, {b}, {pre}, {suf}),  # "
        + ", ".join((["prefix"] if pre else []) + ([f"blocks {a}..{b - 1}" if b > a + 1 else f"block {a}"] if b > a else []) + (["suffix"] if suf else []))
        for s, (a, b, pre, suf) in sorted(my_blocks.items()))
    by_param = {p.param: p for p in plan.placements}
    place_lines = "\n".join(f"    {n!r}: {v!r},  # {by_param[n].role}: "
                            f"{slice_text(by_param[n].shape, v[0], v[1], c.tp, me.tp)}"
                            for n, v in placements.items()) or "    # none: every parameter is whole on every rank"
    functions, args, fn_table, block_args, block_inputs, kinds_line, suffix_args, lengths_line, lengths_kw, \
        carry_line, carry_kw, index_kw = segment_tables(code)
    lengths_kw += carry_kw + index_kw  # all end StageModel's call
    cp_args = "" if c.cp == 1 else f",\n        cp_rank={me.cp}, cp_size={c.cp}"  # this rank's tokens of each row
    mixed = plan.precision != "fp32"
    comp = dp_compression(plan, dp_ranks)
    ml = mesh_lines(plan)
    names = {*ml.imports, "make_group_among", "make_groups", "make_self_group", *(("stage_peers",) if by_rule else ()),
             *(("group_ranks", "make_node_groups") if comp.setup else ())}
    group_imports = ", ".join(sorted(names))
    if c.replicas == 1 and not mixed:
        engine = ("    # No data parallelism (dp = 1) and fp32: gradients stay in .grad, the optimizer steps the\n"
                  "    # parameters, nothing is reduced across replicas.\n"
                  "    engine = Unreplicated(model)\n")
    else:
        group = "groups.dp" if c.replicas > 1 else "make_self_group(RANK, WORLD_SIZE)"
        why = "" if c.replicas > 1 else " (dp = 1: the engine over this rank alone keeps the fp32 masters)"
        who = f"replicas {ranks_text(dp_ranks)} (this rank is replica {me.dp} of {c.dp})" if c.cp == 1 else \
            (f"dp {c.dp} x cp {c.cp} ranks {ranks_text(dp_ranks)} (replicas and their context slices; this rank is "
             f"{dp_ranks.index(rank)} of {c.replicas})")
        engine = (f"    # Data parallelism over {who}: "
                  f"{ZERO_WHAT[c.zero_stage]}{why}.\n"
                  f"    engine = DataParallel(model, group={group}, ranks={'groups.dp_ranks' if c.replicas > 1 else repr(dp_ranks)}, "
                  f"zero_stage={c.zero_stage},\n"
                  f"                          collectives=collectives, bucket_bytes={plan.bucket_bytes}, "
                  f"precision={plan.precision!r},\n"
                  f"                          units=UNITS, unit_modules=UNIT_MODULES, "
                  + ("unit_granularity='module', " if per_module else "") +
                  f"compression={comp.arg}, nodes={comp.nodes},\n"
                  f"                          compression_warmup={plan.compression_warmup})  # {comp.why}\n")

    # pp > 1: each pipeline rank draws from its own random stream (runtime.pipeline.random_streams)
    random_import = "from runtime.pipeline.random_streams import seed_pipeline_rank\n" if c.pp > 1 else ""
    stream = ("keeps the stream the build left" if me.pp == 0
              else f"draws from its own stream, seed + {SEED_STRIDE * me.pp}")
    random_lines = "" if c.pp == 1 else (
        f"    # Random draws (dropout): pipeline rank {me.pp} {stream}\n"
        "    # (each rank's layers draw afresh, as in one process); this stage's tensor slices and replicas share it.\n"
        f"    seed_pipeline_rank({me.pp})\n")
    ctx = ep_context(plan)  # the ep context: ep > 1, or the load-balancing loss at ep = 1
    ep_kw = ", ep=ep,\n                      experts=EXPERTS" if c.ep > 1 else ", ep=ep" if ctx else ""
    # recomputation of the first k of every n blocks only (ParallelConfig.recompute_blocks)
    blocks_kw = f", recompute_blocks={c.recompute_blocks!r}" if c.recompute_blocks != (1, 1) else ""
    ep_param, ep_default = ep_stage_lines(plan)
    source = f'''"""Per-rank program: rank {rank} of {plan.world_size} (pipeline rank {me.pp}, replica {me.dp}, tensor slice {me.tp}).

Plan {h[:12]} for {plan.model_name} on {plan.topology_name}: {c}.
Precision {plan.precision}; global batch {plan.global_batch_size}. Generated by partitioner.codegen:
it imports only torch and runtime; `build(model_fn, optimizer_fn, loss_fn)` returns the step runner.
"""

import torch
from torch import device

import runtime.engines.step
from runtime.comm.collectives import Collectives
from runtime.comm.groups import {group_imports}
from runtime.engines.data_parallel import DataParallel
from runtime.engines.optimizer_groups import make_optimizer
from runtime.engines.unreplicated import Unreplicated
{random_import}from runtime.pipeline.runner import PipelineRunner
from runtime.pipeline.stage import StageModel, state_keys
from runtime.pipeline.tensor_parallel import (TPContext, sp_gather, sp_scatter, sp_vocab_embedding, tp_chunk,
                                              tp_copy, tp_cross_entropy, tp_gather, tp_reduce, tp_vocab_embedding)
from runtime.pipeline.vocab_logits import tp_vocab_logits
{fp8_import(plan)}{attention_import(plan)}{forked_import(plan)}{cp_import(plan)}{ep_import(plan)}
inf, nan = float("inf"), float("nan")

{program_header(plan, rank, h)}

# This rank's virtual stages: stage -> (first block, end block, runs the prefix, runs the suffix)
# of {code.stack or 'the model'} ({code.num_blocks} blocks; {len(plan.stages)} stages in all, {c.schedule}
# schedule{f", {c.interleave} virtual stages per rank" if c.interleave > 1 else ""}).
STAGES = {{
{stage_lines}
}}
# Global rank of every virtual stage in this replica and tensor slice: the peers of SEND/RECV.
STAGE_RANKS = {literal(stage_ranks)}
{instruction_lines(plan, me.pp)}

# Tensor parallelism over {c.tp} rank(s): this rank's sharded parameters -> (spec, fused chunks), with
# the slice of the full tensor this rank holds (tensor slice {me.tp}); the others it holds are whole.
PLACEMENTS = {{
{place_lines}
}}
# Parameters read by stages on different pipeline ranks (a tied embedding and LM head): each
# holder keeps a copy, their gradients are summed over the holders, for each replica and tensor slice
# (pipeline ranks {tuple(tie_pp)}: {len(tie_groups)} group(s), {ranks_text(tie_groups[0]) if tie_groups else "none"} first).
TIED = {literal(tuple(tied))}
TIE_GROUPS = {tie_src}
# ZeRO-3 gathers one unit ({"a module holding parameters" if per_module else "a block, then the rest"}) at a time.
UNITS = {literal(tuple(tuple(u) for u in units))}
UNIT_MODULES = {literal(tuple(unit_modules))}
{expert_tables(plan, rank, held)}
# ---- the model's code: prefix, block template, suffix (cut from the exported graph{", rewritten for the tensor shards" if c.tp > 1 else ""})
# Beside each value, its shape on this rank{" (the tensor-split dim divided by tp)" if c.tp > 1 else ""}: sizes that follow an
# input are named by it (idx.1: dim 1 of idx), and the dtype is the traced one{" (floats run in " + ("fp16" if plan.precision == "fp16-mixed" else "bf16") + " under " + plan.precision + ")" if plan.precision != "fp32" else ""}.

{functions}


{args}
{kinds_line}{lengths_line}{carry_line}
OUTPUT_SPEC = {code.output_spec!r}
# The hidden state at every cut, as sizes of the model inputs: receivers size their buffers from
# the microbatch they hold, so no shape message precedes an activation{"" if code.hidden_shape else " (unknown here: one does)"}.
HIDDEN_SHAPE = {code.hidden_shape!r}


def make_stage(model, tp{", cp" if c.cp > 1 else ""}{ep_param}):
    """This rank's stages of `model` (pruned in place), running the code above; `tp` is the tensor-parallel
    context (None when tp = 1){"; `cp` the context-parallel one" if c.cp > 1 else ""}. `build` calls it; so does `plan.verify`, with its collectives simulated."""
{ep_default}    return StageModel(model, functions={{{fn_table}}}, stack={code.stack!r}, input_names={code.prefix.inputs!r},
                      block_inputs={block_inputs!r}, block_kinds=BLOCK_KINDS,
                      suffix_inputs={code.suffix.model_inputs if code.suffix else ()!r}, prefix_args=PREFIX_ARGS,
                      block_args={block_args}, suffix_args={suffix_args}, output_spec=OUTPUT_SPEC, stages=STAGES,
                      placements=PLACEMENTS, tied=TIED, tp=tp, tp_rank={me.tp}, tp_world={c.tp},
                      recompute={c.recompute!r}{blocks_kw}{", cp=cp" if c.cp > 1 else ""}{ep_kw}{tc}{lengths_kw})


def build(model_fn, optimizer_fn, loss_fn):
    groups = make_groups(RANK, MESH)
{comp.setup}    tie_group = make_group_among(RANK, TIE_GROUPS)
    # reduce-scatter implementation: {impl} ({why_impl}).
    collectives = Collectives(reduce_scatter_impl={impl!r})
    model = model_fn()
    runtime.engines.step.check_parameters(model, PARAMS)
{random_lines}    full_keys = state_keys(model)
    {f"tp = TPContext(groups.tp, collectives, {me.tp}, {c.tp})  # this rank is tensor slice {me.tp} of {c.tp}" if c.tp > 1 else "tp = None  # tp = 1: the code calls no tensor-parallel collective"}
{context_lines(plan, rank)}{expert_lines(plan, rank)}    stage = make_stage(model, tp{", cp" if c.cp > 1 else ""}{", ep" if ctx else ""})

{engine}{expert_engine_lines(plan)}    {"stage.cast = engine.precision.param_dtype  # tied copies enter the code in the compute dtype" if mixed else "# fp32: tied copies enter the code as they are"}
{autocast_line(plan) if mixed else ""}{optimizer_lines(plan, 'list(stage.tied.values())')}    return PipelineRunner(
        stage=stage, engine=engine, optimizer=optimizer, loss_fn=loss_fn, collectives=collectives, groups=groups,
        tie_group=tie_group, tie_first={bool(tie_pp) and me.pp == tie_pp[0]}, actions=ACTIONS,
        num_stages={len(plan.stages)}, stage_ranks=STAGE_RANKS, dp_rank={me.dp}, dp_size={c.dp}, tp_size={c.tp},
        microbatch_size={c.microbatch_size}, num_microbatches={c.num_microbatches},
        clip_grad_norm={plan.clip_grad_norm!r}, placements=PLACEMENTS, full_keys=full_keys, mesh=MESH,
        program_hash=PROGRAM_HASH, hidden_shape=HIDDEN_SHAPE,
        hidden_dtype={"engine.precision.param_dtype" if mixed else "torch.float32"}{cp_args})
'''
    return source, h
