"""The program of a data-parallel plan (pp = tp = 1, any ZeRO stage): one DataParallel engine over the
replicas, with the collectives one step issues counted in its comments (and by `expected_collectives`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from partitioner.codegen.common import (
    ZERO_WHAT,
    autocast_line,
    dp_compression,
    ep_context,
    literal,
    mesh_lines,
    model_code_lines,
    one_rank_ep_context,
    optimizer_lines,
    pipelined_aux,
    program_header,
    ranks_text,
    recompute_lines,
    recomputed_blocks,
    reduce_scatter_impl,
    torch_compile_import,
    torch_compile_lines,
)
from partitioner.codegen.instructions import instruction_lines

if TYPE_CHECKING:
    from partitioner.planner.plan import Plan

__all__ = ["data_parallel_program_source", "expected_collectives", "context_lines", "expert_tables", "expert_lines",
           "expert_engine_lines", "expert_groups", "zero3_units"]


_OUTSIDE = "(outside the blocks)"  # zero3_units' name for the unit of the parameters outside the blocks


def data_parallel_program_source(plan: "Plan", rank: int, h: str) -> str:
    """The source of rank `rank`'s program; `h` is the plan's hash (PROGRAM_HASH)."""
    c = plan.config
    me = plan.mesh[rank]
    dp_ranks = tuple(m.rank for m in plan.mesh if m.pp == me.pp and m.tp == me.tp)
    impl, why_impl = reduce_scatter_impl(plan)
    comp = dp_compression(plan, dp_ranks)
    # int8/int4 send each reduction as all-to-alls and all-gathers of codes, PowerSGD as factor all-reduces
    counted = " (uncompressed)" if comp.arg.strip("'") not in ("none", "bf16") else ""
    per = c.microbatch_size * c.num_microbatches
    first = me.dp * per
    replica = dp_ranks.index(rank)  # this rank's index in its gradient group (dp x cp ranks under cp)
    expected = ", ".join(f"{n} {op}" for op, n in sorted(expected_collectives(plan).items())) or "none"
    if c.cp > 1:
        expected += (" (and inside every attention, over the cp group: the ring's k/v sends" if c.cp_kind == "ring"
                     else " (and inside every attention, over the cp group: Ulysses' all-to-alls") + ")"

    held_apart = _outside_engine(plan)
    blocks = zero3_units(plan)
    per_module = c.zero_stage == 3 and c.zero3_unit == "module"
    unit_word = "module" if per_module else "block"
    # per module: gathered by the first op reading a unit (the module's own forward calls no hook of theirs
    # when the program runs generated code; where it runs the module's forward, its hooks come first)
    granularity = "\n                          unit_granularity='module'," if per_module else ""
    # Generated code calls each block's module and the root, nothing inside them: its block units are gathered by
    # those modules' hooks, not by the smallest module holding a unit's parameters (which, with frozen parameters
    # left out of the units, may be one the code never calls: LoRA's adapters sit in the attention module)
    by_block = plan.code is not None and c.zero_stage == 3 and not per_module
    unit_modules = " unit_modules=UNIT_MODULES," if by_block else ""
    module_table = (f"# The modules whose calls gather each unit: the block the code calls, the root for the rest.\n"
                    f"UNIT_MODULES = {literal(tuple('' if k == _OUTSIDE else k for k in blocks))}\n"
                    if by_block else "")
    units = ",\n".join(f"    {literal(tuple(names), indent=4)}" for names in blocks.values())
    numel = {p.param: math.prod(p.shape) for p in plan.placements if p.param not in held_apart}
    shard_lines = []
    if c.zero_stage == 3:
        for name, names in blocks.items():
            n = sum(numel[x] for x in names)
            shard_lines.append(f"    #   {name}: {n:,} parameters; this rank holds {math.ceil(n / c.replicas):,} "
                               f"(slice {replica} of {c.replicas})")
    elif c.zero_stage in (1, 2):
        n = sum(numel.values())
        shard = math.ceil(n / c.replicas)
        what = "optimizer state" if c.zero_stage == 1 else "gradients and optimizer state"
        shard_lines.append(f"    #   {what} for elements [{replica * shard:,}, {min(n, (replica + 1) * shard):,}) of "
                           f"the {n:,}-element flat parameter buffer (slice {replica} of {c.replicas})")
    shards = "\n".join(shard_lines) or "    #   nothing sharded: every replica holds every parameter, gradient and state"
    ml = mesh_lines(plan)
    names = {*ml.imports, "make_groups", *(("group_ranks", "make_node_groups") if comp.setup else ()),
             *(("make_group_among",) if c.ep > 1 else ())}
    group_imports = ", ".join(sorted(names))
    code = model_code_lines(plan)  # the model's own forward, or the generated code
    who = "replicas" if c.cp == 1 else f"dp {c.dp} x cp {c.cp} ranks (replicas and their context slices)"
    which = f"replica {me.dp} of {c.dp}" if c.cp == 1 else f"{replica} of {c.replicas}"
    recompute = recompute_lines(plan, "engine.checkpoint_blocks(")
    tokens, cp_args = "", ""
    if c.cp > 1:
        a, b = me.cp, 2 * c.cp - 1 - me.cp
        tokens = (f"\n    # Of each row, only this rank's tokens: chunks {a} and {b} of {2 * c.cp} (the causal load balance),"
                  f"\n    # inputs and targets alike; the loss, a mean over them, is averaged over the dp x cp ranks.")
        cp_args = f",\n        cp_rank={me.cp}, cp_size={c.cp}"

    source = f'''"""Per-rank program: rank {rank} of {plan.world_size}.

Plan {h[:12]} for {plan.model_name} on {plan.topology_name}: {c}.
Precision {plan.precision}; global batch {plan.global_batch_size}. Generated by partitioner.codegen:
it imports only torch and runtime; `build(model_fn, optimizer_fn, loss_fn)` returns the step runner.
"""

{code.imports}import runtime.engines.step
from runtime.comm.collectives import Collectives
from runtime.comm.groups import {group_imports}
from runtime.engines.data_parallel import DataParallel
from runtime.engines.optimizer_groups import make_optimizer
{torch_compile_import(plan)}{code.runtime_import}
{program_header(plan, rank, h)}
{code.text}{expert_tables(plan, rank)}
# {unit_word.title()}s: ZeRO-3 gathers and frees parameters one {unit_word} at a time.
UNITS = (
{units},
)
{module_table}
{instruction_lines(plan, 0)}


def build(model_fn, optimizer_fn, loss_fn):
    groups = make_groups(RANK, MESH)
{comp.setup}    # reduce-scatter implementation: {impl} ({why_impl}).
    collectives = Collectives(reduce_scatter_impl={impl!r})
    model = model_fn()
    runtime.engines.step.check_parameters(model, PARAMS)
{context_lines(plan, rank)}{expert_lines(plan, rank)}{code.run}
    # Data parallelism over {who} {ranks_text(dp_ranks)} (this rank is {which}).
    # {ZERO_WHAT[c.zero_stage]}.
    # Gradient buckets of {plan.bucket_bytes:,} bytes. Collectives per step{counted}: {expected}.
    # This rank holds:
{shards}
    # Gradient compression on this group: {comp.why}.
    engine = DataParallel(model, group=groups.dp, ranks=groups.dp_ranks, zero_stage={c.zero_stage},
                          collectives=collectives, bucket_bytes={plan.bucket_bytes}, precision={plan.precision!r},
                          units=UNITS,{granularity}{unit_modules} compression={comp.arg}, nodes={comp.nodes},
                          compression_warmup={plan.compression_warmup})
{torch_compile_lines(plan)}{expert_engine_lines(plan)}{recompute}{optimizer_lines(plan)}
    # Each step: rows [{first}, {first + per}) of the {plan.global_batch_size}-sample global batch, as
    # {c.num_microbatches} microbatch(es) of {c.microbatch_size}, run by ACTIONS above.{tokens}
    return runtime.engines.step.StepRunner(
        engine=engine, optimizer=optimizer, loss_fn=loss_fn, collectives=collectives, dp_group=groups.dp,
        dp_rank={me.dp}, dp_size={c.dp}, microbatch_size={c.microbatch_size}, num_microbatches={c.num_microbatches},
        clip_grad_norm={plan.clip_grad_norm!r}, program_hash=PROGRAM_HASH, actions=ACTIONS{cp_args})
'''
    return source




def _outside_engine(plan: "Plan") -> set[str]:
    """The expert slices an ep > 1 program keeps outside the data-parallel engine (runtime.experts.engine), and
    the parameters its code never reads, which its stage keeps frozen (runtime.pipeline.stage)."""
    code = plan.code
    if code is None:
        return set()
    read = code.read_params()
    unread = {p.param for p in plan.placements if not read & {p.param, *p.aliases}}
    return unread | ({n for n, _ in code.experts} if plan.config.ep > 1 else set())


def zero3_units(plan: "Plan") -> dict[str, list[str]]:
    """The ZeRO-3 units of a data-parallel program, name -> parameters: per block (the parameters outside the
    blocks one more unit), or with zero3_unit="module" per module holding parameters directly, in the
    placements' order; expert slices held apart under ep > 1 are in none."""
    per_module = plan.config.zero_stage == 3 and plan.config.zero3_unit == "module"
    apart = _outside_engine(plan)
    units: dict[str, list[str]] = {}
    for p in plan.placements:
        if p.param in apart:
            continue
        name = p.param.rpartition(".")[0] or "(the root module)" if per_module else p.block or _OUTSIDE
        units.setdefault(name, []).append(p.param)
    return units


def _on_root(names: list[str]) -> bool:
    """Whether a unit read under these parameter names sits on the root module (runtime.engines.zero3: the
    smallest module holding all of them), so that it stays gathered from forward to backward."""
    mods = [n.split(".")[:-1] for n in names]
    return not mods[0] or any(not m or m[0] != mods[0][0] for m in mods)


def context_lines(plan: "Plan", rank: int) -> str:
    """The build() lines that make a context-parallel program's group context ("" without cp)."""
    c = plan.config
    if c.cp == 1:
        return ""
    me = plan.mesh[rank]
    how = "k/v blocks passed round the ring (runtime.context.ring_attention)" if c.cp_kind == "ring" else \
        "all-to-alls from a token split to a head split and back (runtime.context.ulysses)"
    ranks = tuple(m.rank for m in plan.mesh if (m.pp, m.dp, m.tp) == (me.pp, me.dp, me.tp))
    return (f"    # Context parallelism over ranks {ranks_text(ranks)} (this rank is context slice {me.cp} of {c.cp}):\n"
            f"    # it holds chunks {me.cp} and {2 * c.cp - 1 - me.cp} of {2 * c.cp} of every sequence (the causal load balance);\n"
            f"    # every attention sees the whole sequence by {how}.\n"
            f"    cp = CPContext(groups.cp, collectives, rank={me.cp}, world={c.cp}, kind={c.cp_kind!r})\n")


def expert_groups(plan: "Plan") -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(ep groups, expert-data-parallel groups) as global ranks: an ep group is ep consecutive data-parallel
    ranks (same pp, tp, cp; dp indices k*ep .. k*ep + ep - 1: partitioner.planner.expert_split.ep_ranks); the
    ranks holding the same experts share pp, tp and dp index mod ep (every cp slice)."""
    ep = plan.config.ep
    eps: dict[tuple, list[int]] = {}
    edps: dict[tuple, list[int]] = {}
    for m in plan.mesh:
        eps.setdefault((m.pp, m.tp, m.cp, m.dp // ep), []).append(m.rank)
        edps.setdefault((m.pp, m.tp, m.dp % ep), []).append(m.rank)
    return tuple(tuple(sorted(r)) for r in eps.values()), tuple(tuple(sorted(r)) for r in edps.values())


def _ep_rank(plan: "Plan", rank: int) -> int:
    return plan.mesh[rank].dp % plan.config.ep


def expert_tables(plan: "Plan", rank: int, held: set[str] | None = None) -> str:
    """The module-level tables of an expert-parallel program ("" without ep): its groups and expert slices (of the
    parameters in `held`, this rank's stages' under pp > 1; all without)."""
    c = plan.config
    if c.ep == 1:
        return ""
    eps, edps = expert_groups(plan)
    r = _ep_rank(plan, rank)
    mine = [(n, e) for n, e in plan.code.experts if held is None or n in held]
    rows = {n: (r * e // c.ep, (r + 1) * e // c.ep) for n, e in mine}
    es = sorted({e for _, e in mine})
    held_text = ", ".join(f"experts {r * e // c.ep}..{(r + 1) * e // c.ep - 1} of {e}" for e in es)
    lines = "\n".join(f"    {n!r}: {lo, hi}," for n, (lo, hi) in rows.items())
    return f'''
# Expert parallelism: ep groups (the ranks among which each MoE layer's experts are divided, ep={c.ep}) and
# expert-data-parallel groups (the ranks holding the same experts, whose expert gradients are summed).
EP_GROUPS = {literal(eps)}
EDP_GROUPS = {literal(edps)}
# This rank holds {held_text} in each of {"its" if c.pp > 1 else "the"} {len(mine) // 2} MoE layers (index {r} of its ep group):
# rows [lo, hi) along dim 0 of every batched expert weight.
EXPERTS = {{
{lines}
}}
'''


# a continuation line of "    ep = EPContext(": aligned under its first argument
_UNDER_EP_CONTEXT = "\n" + " " * 19


def expert_lines(plan: "Plan", rank: int) -> str:
    """The build() lines that make an expert-parallel program's groups and context; at ep = 1 the context of a
    program computing the load-balancing loss ("" for neither)."""
    c = plan.config
    if not ep_context(plan):
        return ""
    code = plan.code
    pipe = ("    # Pipelined, each stage adds its MoE layers' sums to those of the stages before and hands them on\n"
            "    # with the activation, their gradient coming back with the activation's (runtime.experts.pipeline_aux);\n"
            "    # the last stage forms the loss.\n"
            "    ep.pipeline = AuxPipeline(stage_ranks=STAGE_RANKS, rank=RANK, collectives=collectives, group=groups.pp)\n"
            ) if pipelined_aux(plan) else ""
    if c.ep == 1:
        return ("    # The router's load-balancing loss is a statistic of the batch: its sums are all-reduced "
                f"over the {c.replicas}\n    # ranks' tokens of each microbatch (groups.dp), as one process computes it on "
                "that microbatch\n    # (runtime.experts.aux_loss); the experts are replicated (ep=1).\n"
                f"    ep = {one_rank_ep_context(plan, 'collectives', 'groups.dp', wrap=_UNDER_EP_CONTEXT)}\n" + pipe)
    eps, edps = expert_groups(plan)
    mine = next(g for g in eps if rank in g)
    same = next(g for g in edps if rank in g)
    aux = (f"; the router's load-balancing loss\n    # summed over the {c.replicas} ranks' tokens of the batch "
           "(groups.dp), as one process computes it") if code.aux_loss else ""
    return (f"    # Expert parallelism over ranks {ranks_text(mine)} (this rank is {_ep_rank(plan, rank)} of {c.ep}): "
            f"tokens travel to\n    # their experts and back by all-to-alls with variable split sizes{aux}.\n"
            f"    # Ranks {ranks_text(same)} hold the same experts.\n"
            "    ep_group = make_group_among(RANK, EP_GROUPS)\n"
            "    edp_group = make_group_among(RANK, EDP_GROUPS)\n"
            f"    ep = EPContext(group=ep_group, collectives=collectives, rank={_ep_rank(plan, rank)}, world={c.ep}, "
            f"num_experts={max(e for _, e in code.experts)},\n                   top_k={code.top_k}, "
            f"layers={code.moe_layers}, token_group=groups.dp)\n" + pipe)


def expert_engine_lines(plan: "Plan") -> str:
    """The build() lines that put the expert slices beside the dense engine ("" without ep)."""
    c = plan.config
    if c.ep == 1:
        return ""
    shard = (f"\n    # ZeRO-{c.zero_stage} over the {c.replicas // c.ep} ranks holding the same experts: this rank steps its "
             f"1/{c.replicas // c.ep} of their flat\n    # buffer (optimizer state and gradients), all-gathered at UNSHARD."
             if c.zero_stage > 0 and c.replicas > c.ep else "")
    cast = ("    stage.cast = engine.precision.param_dtype  # the fp32 expert slices enter the code in the compute dtype\n"
            + autocast_line(plan) if plan.precision != "fp32" and c.pp == 1 and c.tp == 1 else "")
    return (f"    # The expert slices stay outside that engine: their gradients are summed over edp_group and divided\n"
            f"    # by the {c.replicas} replicas (one process's mean); the optimizer steps them with the rest.{shard}\n"
            f"    engine = ExpertParallel(engine, stage.experts, ep_group=ep_group, ep_rank=ep.rank, ep={c.ep}, "
            f"edp_group=edp_group,\n                            replicas={c.replicas}, collectives=collectives, "
            f"zero_stage={c.zero_stage})\n" + cast)


def expected_collectives(plan: "Plan") -> dict[str, int]:
    """The collectives one training step of a data-parallel program issues, by op.

    The program's instruction list holds one GRAD_SYNC per step (and, at ZeRO
    >= 1, an UNSHARD; at ZeRO-3 a RESHARD, which frees without communicating);
    the data-parallel engine realises them as (B = gradient buckets, cut by
    `runtime.engines.flat.bucket` over parameters in reverse registration order;
    U = ZeRO-3 units, the blocks plus the parameters outside them; m =
    microbatches):
      DDP      B all-reduces
      ZeRO-1   B all-reduces, then 1 all-gather of the updated flat buffer (UNSHARD)
      ZeRO-2   m*B reduce-scatters (every microbatch), B all-gathers (UNSHARD)
      ZeRO-3   m*U reduce-scatters; m*(2U - 1) all-gathers: U in forward, U - 1 in
               backward (the unit outside the blocks stays gathered until its backward).
               Per module (zero3_unit="module"): m*(2U - R) all-gathers, R the units on
               the root module (a tied embedding and LM head: kept from forward to
               backward); under recomputation each block's recomputed forward gathers
               its k modules but the last two again (gathered for their backward by
               then, runtime.engines.zero3): m * sum(k - 2) more
    plus one all-reduce of the reported loss, and one of the squared norm when
    clipping at ZeRO >= 1; an all-reduce per microbatch for the router's load-balancing loss, where the model
    computes one (at any ep). Under expert parallelism the buckets and units hold the dense parameters only,
    plus 5 all-to-alls per MoE layer and microbatch, and one all-reduce (and under ZeRO one all-gather) of the
    experts over the ranks holding the same ones when there are several. Tests compare these with the counting shim.
    """
    from runtime.engines.flat import bucket  # the engine's own bucketing rule, not a copy of it

    c = plan.config
    if c.replicas == 1:
        return {}
    apart = _outside_engine(plan)
    dense = [p for p in plan.placements if p.param not in apart]
    names = [p.param for p in dense][::-1]
    numels = [math.prod(p.shape) for p in dense][::-1]
    B = len(bucket(names, numels, plan.bucket_bytes))
    units = zero3_units(plan)
    U = len(units)
    m = c.num_microbatches
    gathers = 2 * U - 1
    if c.zero_stage == 3 and c.zero3_unit == "module":
        aliases = {p.param: p.aliases for p in plan.placements}
        gathers = 2 * U - sum(_on_root([a for n in names for a in (n, *aliases[n])]) for names in units.values())
        if c.recompute != "none":  # per recomputed block, all but the two gathered for its backward go again
            blocks: dict[str, set[str]] = {}
            again = set(recomputed_blocks(plan))
            for p in plan.placements:
                if p.block in again:
                    blocks.setdefault(p.block, set()).add(p.param.rpartition(".")[0])
            gathers += sum(max(0, len(mods) - 2) for mods in blocks.values())
    out = {0: {"all_reduce": B}, 1: {"all_reduce": B, "all_gather": 1},
           2: {"reduce_scatter": m * B, "all_gather": B},
           3: {"reduce_scatter": m * U, "all_gather": m * gathers}}[c.zero_stage]
    out["all_reduce"] = out.get("all_reduce", 0) + 1 + (1 if plan.clip_grad_norm and c.zero_stage >= 1 else 0)
    if plan.code is not None and plan.code.aux_loss:  # the load-balancing loss's sums: an all-reduce per microbatch
        out["all_reduce"] += m
    if apart:  # expert parallelism (runtime.experts): per MoE layer and microbatch 3 all-to-alls forward, 2 backward;
        # the experts' gradients over the ranks holding the same experts (and, under ZeRO, their updated shards
        # gathered back)
        out["all_to_all"] = 5 * plan.code.moe_layers * m
        out["all_reduce"] += 1 if c.replicas > c.ep else 0
        if c.replicas > c.ep and c.zero_stage > 0:
            out["all_gather"] = out.get("all_gather", 0) + 1
    return out
