"""What the code generators share: how a data-parallel group reduces and compresses, the parameter
table, the recomputation lines and the words for each ZeRO stage. Public names: the data-parallel,
pipeline and async generators all import them from here."""

from __future__ import annotations

import dataclasses
import pprint
import textwrap
from typing import TYPE_CHECKING, Any, NamedTuple

from cost_models.errors import PartitionerError
from cost_models.mesh import Mesh
from cost_models.placements import sharded_dim
from runtime.engines.optimizer_groups import slices_parameters

if TYPE_CHECKING:
    from partitioner.planner.plan import Plan

__all__ = ["CodegenError", "ZERO_WHAT", "DpCompression", "MeshLines", "ModelCodeLines", "SegmentTables",
           "autocast_line", "block_names", "dp_compression", "ep_context", "ep_stage_lines", "literal", "mesh_lines",
           "model_code_lines", "one_rank_ep_context", "optimizer_lines", "params_table", "program_header",
           "ranks_text", "recompute_lines", "recomputed_blocks", "reduce_scatter_impl", "segment_tables",
           "torch_compile_import", "torch_compile_lines", "torch_compile_refusal"]

ZERO_WHAT = {
    0: "DDP: parameters and optimizer state replicated; gradients all-reduced in buckets while backward runs",
    1: "ZeRO-1: optimizer state sharded by even flat slices; gradients all-reduced, each rank steps its slice, "
       "updated slices all-gathered",
    2: "ZeRO-2: gradients reduce-scattered into the owner's slice during backward; optimizer state sharded; "
       "updated slices all-gathered",
    3: "ZeRO-3 (FSDP): parameters sharded at rest, all-gathered per block just in time and freed after use, "
       "the next block prefetched; gradients reduce-scattered per block",
}



class CodegenError(PartitionerError):
    """A plan this code generator cannot emit a program for."""


def reduce_scatter_impl(plan: "Plan") -> tuple[str, str]:
    # Measured here (docs/torch-notes.md#gloo-collective-timings-reduce-scatter-is-slower-than-all-reduce):
    # Gloo's reduce_scatter of 16M floats takes 96 ms on 2 ranks against 58 ms for all_reduce of the same
    # buffer, so on CPU processes all-reduce-then-slice wins; NCCL's reduce-scatter moves half the bytes of
    # an all-reduce and is the faster one.
    device = plan.topology.get("device")
    name = device.get("name") if isinstance(device, dict) else device
    if plan.topology.get("local") or name == "CPU":
        return "all_reduce_slice", "Gloo: all-reduce then slice beats reduce-scatter (docs/torch-notes.md)"
    return "reduce_scatter", "NCCL: reduce-scatter moves half the bytes of an all-reduce"


def params_table(plan: "Plan") -> str:
    """The PARAMS lines of a program: every parameter the plan was compiled for, (name, full shape)."""
    return ",\n".join(f"    ({p.param!r}, {tuple(p.shape)!r})" for p in plan.placements)


@dataclasses.dataclass(frozen=True)
class DpCompression:
    """How a program's data-parallel engine compresses: the `compression=` and `nodes=` arguments it
    passes, why, and the lines (run on every rank) that create the intra/cross-node groups."""

    arg: str
    nodes: str
    why: str
    setup: str


def dp_compression(plan: "Plan", dp_ranks: tuple[int, ...]) -> DpCompression:
    """The compressor(s) of this data-parallel group's gradient reduction, and why.

    The plan names one per link level. A group inside one node uses the intra-node one, a group with
    one rank per node (or ragged) the inter-node one, flat. At ZeRO-0/1 a group spanning several nodes
    with k > 1 ranks on each reduces hierarchically, as the cost model assumes: the intra-node
    compressor inside each node, the inter-node one across (runtime.compression.grad_compression); its node groups
    are created by every rank, since c10d requires it. ZeRO-2/3 reduce-scatter flat over the group.
    """
    from runtime.comm.groups import group_ranks, node_split  # the runtime's own rule for what splits by node

    node_of = tuple(m.node for m in sorted(plan.mesh, key=lambda m: m.rank))
    zero = plan.config.zero_stage
    levels = {lv: plan.compression.get(lv, "none") for lv in ("intra_node", "inter_node")}
    anything = any(c != "none" for c in levels.values())
    split_any = anything and zero <= 1 and any(node_split(g, node_of) for g in group_ranks(plan.mesh)["dp"])
    setup = ("    # Every rank creates the intra- and cross-node groups of every data-parallel group that spans\n"
             "    # nodes (c10d requires it), for the hierarchical reductions.\n"
             "    nodes = make_node_groups(RANK, group_ranks(MESH)['dp'], NODE_OF)\n") if split_any else ""
    if len(dp_ranks) == 1 or not anything:
        return DpCompression("'none'", "None", "the plan compresses nothing on this group's links", setup)
    if split_any and node_split(dp_ranks, node_of):
        ci, ce = levels["intra_node"], levels["inter_node"]
        return DpCompression(repr(levels), "nodes", f"hierarchical: {ci} inside each node, {ce} across nodes",
                             setup)
    level = "inter_node" if len({node_of[r] for r in dp_ranks}) > 1 else "intra_node"
    name = levels[level]
    why = f"the plan's choice for {level} links" + (", reduce-scattered flat over the group" if zero >= 2 else "")
    return DpCompression(repr(name), "None", why if name != "none" else
                         f"the plan compresses nothing on {level} links", setup)


_RECOMPUTE_WHAT = {
    "full": "each block keeps only its input in forward and runs again in backward",
    "selective": "each block keeps the outputs of its matrix products and layer norms and runs every other op "
                 "again in backward, the s x s attention scores included",
    "selective-op": "each block keeps fused attention's outputs and those of every second matrix product (the "
                    "first, third, ...) and runs the other products and every other op again in backward"}


def autocast_line(plan: "Plan") -> str:
    """The build() line that says whether mixed-precision stage code runs under autocast (`StageModel.autocast`)."""
    if plan.code is not None and plan.code.exact_casts:
        return "    stage.autocast = False  # the code casts as the model does: it runs in the module's own dtypes\n"
    return "    stage.autocast = True  # the trace could not tell the model's upcasts from its casts back\n"


def block_names(plan: "Plan") -> tuple[str, ...]:
    """The model's repeated blocks, in their order (their index in the block stack)."""
    return tuple(b for st in plan.stages for b in st.blocks if b not in ("prefix", "suffix"))


def recomputed_blocks(plan: "Plan") -> tuple[str, ...]:
    """The blocks the plan's recomputation runs on: all of them, or those ParallelConfig.recompute_blocks picks."""
    return tuple(b for i, b in enumerate(block_names(plan)) if plan.config.recomputes_block(i))


def recompute_lines(plan: "Plan", call: str) -> str:
    """The program lines that make the plan's blocks recompute (none without recomputation): a comment
    saying how, then `call` (ending in "(") applied to the block names and the mode."""
    c = plan.config
    mode = c.recompute
    if mode == "none":
        return ""
    every = block_names(plan)
    names = recomputed_blocks(plan)
    k, n = c.recompute_blocks
    which = "" if (k, n) == (1, 1) else f" Only the first {k} of every {n} blocks; the others keep their activations."
    why = textwrap.fill(f"Recompute ({mode}, runtime.engines.recompute): {_RECOMPUTE_WHAT[mode]}.{which}", width=100,
                        initial_indent="    # ", subsequent_indent="    # ")
    stack = every[0].rpartition(".")[0] if every else ""
    if len(every) > 2 and every == tuple(f"{stack}.{i}" for i in range(len(every))):
        # a formula: no line grows with depth
        pick = "" if (k, n) == (1, 1) else f" if i % {n} < {k}"
        blocks = f"tuple(f'{stack}.{{i}}' for i in range({len(every)}){pick})"
    else:
        blocks = literal(names, indent=4 + len(call))
    return f"{why}\n    {call}{blocks}, {mode!r})\n"


def torch_compile_refusal(plan: "Plan") -> str:
    """Why a plan's programs cannot run under torch.compile ("" when they can)."""
    c = plan.config
    if not plan.torch_compile or (c.tp == 1 and c.cp == 1 and c.ep == 1):
        return ""
    what = " and ".join(x for x in (f"tp={c.tp}" if c.tp > 1 else "", f"cp={c.cp}" if c.cp > 1 else "",
                                    f"ep={c.ep}" if c.ep > 1 else "") if x)
    return (f"torch_compile={plan.torch_compile!r} with {what}: the blocks of tensor-, context- and expert-parallel "
            "code call collectives inside them (Megatron's f/g, sequence-parallel gathers, ring or Ulysses "
            "attention, the experts' all-to-alls), which runtime.engines.compiled does not compile around yet; "
            "compile without torch_compile for this configuration, or pin tp=1, cp=1 and ep=1 (data-parallel, "
            "ZeRO and pipeline programs compile)")


def torch_compile_lines(plan: "Plan") -> str:
    """The build() lines that compile a data-parallel or async SGD program's blocks (runtime.engines.compiled);
    "" when eager, or when the program runs the plan's code (its StageModel compiles the segment functions)."""
    if not plan.torch_compile or plan.code is not None:
        return ""
    names = tuple(dict.fromkeys(p.block for p in plan.placements if p.block is not None)) or ("",)
    what = "each block's forward" if names != ("",) else "the model's forward (it has no repeated blocks)"
    why = textwrap.fill(f"torch.compile, backend {plan.torch_compile!r} (runtime.engines.compiled): {what} compiled "
                        "on its own; module hooks (ZeRO-3 gathers), gradient hooks, collectives and "
                        "recomputation stay outside the compiled code.", width=100,
                        initial_indent="    # ", subsequent_indent="    # ")
    return f"{why}\n    compile_blocks(model, {names!r}, {plan.torch_compile!r})\n"


def torch_compile_import(plan: "Plan") -> str:
    return "from runtime.engines.compiled import compile_blocks\n" if torch_compile_lines(plan) else ""


@dataclasses.dataclass(frozen=True)
class MeshLines:
    """A program's MESH and NODE_OF values as source, and what they import from runtime.comm.groups."""

    mesh: str
    node_of: str
    imports: tuple[str, ...]


def mesh_lines(plan: "Plan") -> MeshLines:
    """MESH as `grid(pp, dp, tp)` when the plan's mesh is cost_models.mesh's layout, NODE_OF as
    `nodes_of(world, per_node)` when every node holds as many consecutive ranks; the literal tables otherwise
    (a hand-made plan). Written as tables, a 3072-rank plan's MESH was one line of 60K characters."""
    c = plan.config
    mesh = Mesh(c.pp, c.dp, c.tp, c.cp)
    imports = []
    nodes = tuple(m.node for m in sorted(plan.mesh, key=lambda m: m.rank))
    if c.cp > 1:  # (rank, pp, dp, tp, cp): runtime.comm.groups reads the fifth as the context slice
        coords = tuple((m.rank, m.pp, m.dp, m.tp, m.cp) for m in plan.mesh)
        what, laid_out, grid_args = "(rank, pp, dp, tp, cp)", tuple((r, *mesh.coords4(r)) for r in range(mesh.size)), \
            f"pp={c.pp}, dp={c.dp}, tp={c.tp}, cp={c.cp}"
    else:
        coords = tuple((m.rank, m.pp, m.dp, m.tp) for m in plan.mesh)
        what, laid_out, grid_args = "(rank, pp, dp, tp)", tuple((r, *mesh.coords(r)) for r in range(mesh.size)), \
            f"pp={c.pp}, dp={c.dp}, tp={c.tp}"
    if coords == laid_out:
        mesh_src = f"grid({grid_args})  # {what} of every rank: {mesh.formula()}"
        imports.append("grid")
    else:
        mesh_src = f"{coords!r}  # {what} of every rank"
    per = nodes.count(0)
    if per and nodes == tuple(r // per for r in range(len(nodes))):
        node_src = f"nodes_of({len(nodes)}, per_node={per})  # rank -> node: rank // {per}"
        imports.append("nodes_of")
    else:
        node_src = f"{nodes!r}  # rank -> node"
    return MeshLines(mesh_src, node_src, tuple(imports))


def slice_text(shape: tuple[int, ...], spec: str, fused: int, tp: int, t: int) -> str:
    """Which part of a full parameter tensor slice `t` of `tp` holds, for a comment beside it: a fused
    tensor (q, k and v in one weight) is `fused` chunks along the split dim, each split over the tensor group.

    >>> slice_text((384, 128), "S(0)", 3, 2, 1)
    'dim 0 [64:128, 192:256, 320:384] of 384: (192, 128) here'
    >>> slice_text((128, 512), "S(1)", 1, 2, 0)
    'dim 1 [0:256] of 512: (128, 256) here'
    """
    d = sharded_dim(spec)
    if d is None:
        return f"whole: {tuple(shape)}"
    chunk = shape[d] // fused
    per = chunk // tp
    ranges = ", ".join(f"{c * chunk + t * per}:{c * chunk + (t + 1) * per}" for c in range(fused))
    local = tuple(per * fused if i == d else n for i, n in enumerate(shape))
    return f"dim {d} [{ranges}] of {shape[d]}: {local} here"


def literal(value: object, indent: int = 0, width: int = 110) -> str:
    """`value` as Python source wrapped to `width` columns (pprint), its later lines indented by `indent`:
    tables that grow with the model or the world (units, argument lists, action lists) stay readable."""
    text = pprint.pformat(value, width=max(width - indent, 40), compact=True)
    return text.replace("\n", "\n" + " " * indent)


def ranks_text(ranks: tuple[int, ...]) -> str:
    """Ranks for a comment: all of them when few, else the run by its ends."""
    if len(ranks) <= 8:
        return repr(tuple(ranks))
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"({ranks[0]}, {ranks[1]}, ..., {ranks[-1]})"
    return f"({', '.join(map(str, ranks[:4]))}, ..., {ranks[-1]}; {len(ranks)} ranks)"


def program_header(plan: "Plan", rank: int, program_hash: str, *, node_of: bool = True) -> str:
    """What every program states first: its plan's hash, its rank, the mesh (and each rank's node), and the
    parameters it was compiled for."""
    ml = mesh_lines(plan)
    nodes = f"NODE_OF = {ml.node_of}\n" if node_of else ""
    return f'''PROGRAM_HASH = {program_hash!r}
RANK = {rank}
WORLD_SIZE = {plan.world_size}

# The mesh: rank -> (pipeline stage, data-parallel replica, tensor slice{", context slice" if plan.config.cp > 1 else ""}). Every rank creates
# every process group, in this order (c10d requires it).
MESH = {ml.mesh}
{nodes}
# The parameters the plan was compiled for (name, full shape): any other model is refused.
PARAMS = (
{params_table(plan)},
)'''


class SegmentTables(NamedTuple):
    """The model code's parts as a program writes them: the segment functions, their argument tables, and
    what `make_stage` passes StageModel about them."""

    functions: str  # prefix, block template(s), suffix: the generated functions
    args: str  # PREFIX_ARGS = (...) lines: each function's parameters and buffers
    fn_table: str  # 'prefix': prefix, 'block': block, ...
    block_args: str  # (BLOCK_ARGS, BLOCK_1_ARGS,) or ()
    block_inputs: tuple  # the model inputs each block template reads
    kinds_line: str  # BLOCK_KINDS = ... with why
    suffix_args: str  # SUFFIX_ARGS or ()
    lengths_line: str  # "\nSEQ_LENGTHS = ..." with why, where the code holds at some sequence lengths only; else ""
    lengths_kw: str  # ", seq_lengths=SEQ_LENGTHS" or ""
    carry_line: str  # "\nCARRY = ..." with why, where values besides the hidden state cross the cuts; else ""
    carry_kw: str  # ", carry=CARRY" or ""
    index_kw: str  # ", block_indexed=(...)" where a block template takes its index (segment_glue), or ""


def segment_tables(code: Any) -> SegmentTables:
    """The parts of `code` (a plan's ModelCode) that every program running it writes the same way."""
    segs = [code.prefix, *code.templates] + ([code.suffix] if code.suffix is not None else [])
    return SegmentTables(
        functions="\n\n".join(s.source.rstrip() for s in segs),
        args="\n".join(f"{s.name.upper()}_ARGS = {literal(tuple(s.params) + tuple(s.buffers))}" for s in segs),
        fn_table=", ".join(f"{s.name!r}: {s.name}" for s in segs),
        block_args=f"({', '.join(t.name.upper() + '_ARGS' for t in code.templates)},)" if code.block is not None else "()",
        block_inputs=tuple(t.model_inputs for t in code.templates),
        kinds_line=(f"# The blocks are not all alike: kind of each block (kind 0 runs `block`, kind k `block_k`).\n"
                    f"BLOCK_KINDS = {literal(code.block_kinds)}" if code.block_kinds else
                    "BLOCK_KINDS = ()  # every block runs `block`"),
        suffix_args="SUFFIX_ARGS" if code.suffix is not None else "()",
        lengths_line=_lengths_line(code.seq_lengths),
        lengths_kw=", seq_lengths=SEQ_LENGTHS" if code.seq_lengths is not None else "",
        carry_line=_carry_line(code, segs),
        carry_kw=", carry=CARRY" if len(code.carried) > 1 else "",
        index_kw=f", block_indexed={tuple(t.indexed for t in code.templates)!r}"
        if any(t.indexed for t in code.templates) else "")


def _carry_line(code: Any, segs: list) -> str:
    """The CARRY table of code whose cuts carry values besides the hidden state (partitioner.codegen.segment_carry):
    per function, the names of those it takes and returns."""
    if len(code.carried) == 1:
        return ""
    table = {s.name: (s.inputs if s is not code.prefix else (), s.outputs) for s in segs}
    return ("\n# Besides the hidden state x, values cross the cuts between blocks (partitioner.codegen."
            "segment_carry):\n# what each function takes of them and returns, by name. A value no block has written "
            "yet is None; a\n"
            f"# pipeline cut sends {', '.join(code.carried)} as one tensor (runtime.pipeline.carry).\n"
            f"CARRY = {literal(table)}")


def _lengths_line(lengths: tuple[int, int | None] | None) -> str:
    if lengths is None:
        return ""
    lo, hi = lengths
    span = f"{lo} to {hi}" if hi is not None else f"{lo} or more"
    return (f"\n# The code holds for sequence lengths {span} only, the range torch.export traced it for (a table of\n"
            f"# positions that long, or a branch on the length that the example's took): other lengths are refused.\n"
            f"SEQ_LENGTHS = {lengths!r}")


@dataclasses.dataclass(frozen=True)
class ModelCodeLines:
    """The model's code in a data-parallel or async SGD program: imports (torch's, then the runtime's), the
    module-level text (functions, argument tables, `make_stage`) and the build() lines that run it."""

    imports: str = ""
    runtime_import: str = ""
    text: str = ""
    run: str = ""


def _fused_why(plan: "Plan") -> str:
    """Why a data-parallel program runs generated code: the kernels the tracer fused (OpGraph.rewritten)."""
    attention = (f"its {plan.attention_rewrites} eager attention(s) run as one fused scaled_dot_product_attention"
                 "\n# each")
    if not plan.fused:
        return f"{attention}, as the plan's time and memory assume (partitioner.tracer.attention)"
    fused = f"its {plan.fused} run as one ATen op each (the model spells them as chains of ops)"
    if not plan.attention_rewrites:
        return f"{fused},\n# as the plan's time and memory assume (partitioner.tracer.norms, .pointwise)"
    return f"{attention},\n# {fused}, as the plan's time and memory assume (partitioner.tracer)"


def model_code_lines(plan: "Plan") -> ModelCodeLines:
    """The lines that make a data-parallel or async SGD program (pp = tp = 1) run the plan's model code: a
    plan carries code for them when its attention, norms or activations were rewritten to fused kernels, which the
    module's own forward would not run (partitioner.tracer.attention, .norms, .pointwise). All empty otherwise: the
    module runs as it is."""
    code = plan.code
    if code is None:
        return ModelCodeLines()
    cp = plan.config.cp > 1
    tc = f", torch_compile={plan.torch_compile!r}" if plan.torch_compile else ""
    ep = plan.config.ep > 1
    ctx = ep_context(plan)  # the ep context: ep > 1, or the load-balancing loss at ep = 1
    t = segment_tables(code)
    n = code.num_blocks
    why = _fused_why(plan) if not ctx else \
        ("each MoE layer's experts run over the ep group (ep_experts: the\n# all-to-alls of "
         "runtime.experts.expert_parallel) on this rank's experts only (partitioner.codegen.segment_ep)") if ep else \
        (f"the router's load-balancing loss, a statistic of the batch, is computed over the\n# "
         f"{plan.config.replicas} ranks' tokens (ep_aux_loss, partitioner.codegen.segment_ep), as one process does")
    ep_kw = ",\n                      ep=ep, experts=EXPERTS" if ep else ", ep=ep" if ctx else ""
    ep_param, ep_default = ep_stage_lines(plan)
    text = f'''
inf, nan = float("inf"), float("nan")

# ---- the model's code: prefix, block template, suffix (cut from the exported graph). The module's own
# forward is not run: {why}. Beside each value, its shape.

{t.functions}


{t.args}
{t.kinds_line}{t.lengths_line}{t.carry_line}
OUTPUT_SPEC = {code.output_spec!r}
# One stage: the prefix, {f"blocks 0..{n - 1}" if n > 1 else f"{n} block(s)"} of {code.stack or "the model"},
# the suffix.
STAGES = {{0: (0, {n}, True, True)}}


def make_stage(model, tp{", cp" if cp else ""}{ep_param}):
    """`model` running the code above (the whole model on this rank); `plan.verify` calls it too."""
{ep_default}    return StageModel(model, functions={{{t.fn_table}}}, stack={code.stack!r}, input_names={code.prefix.inputs!r},
                      block_inputs={t.block_inputs!r}, block_kinds=BLOCK_KINDS,
                      suffix_inputs={code.suffix.model_inputs if code.suffix else ()!r}, prefix_args=PREFIX_ARGS,
                      block_args={t.block_args}, suffix_args={t.suffix_args},
                      output_spec=OUTPUT_SPEC, stages=STAGES, placements={{}}, tied=(), tp=tp{", cp=cp" if cp else ""}{tc}{ep_kw}\
{t.lengths_kw}{t.carry_kw}{t.index_kw})

'''
    run = ("    # The model runs the code above: its forward takes the batch and runs prefix, blocks and suffix\n"
           + ("    # (a batch without the traced inputs runs the module's own forward instead, with a warning).\n"
              if not ctx else "    # (a batch without the traced inputs is refused: the module's own forward would run neither the\n"
              "    # experts over the ep group nor the load-balancing loss over the ranks' tokens).\n")
           + (f"    make_stage(model, None{', cp' if cp else ''}).run_as_model()\n" if not ctx else
              f"    make_stage(model, None{', cp' if cp else ''}{'' if plan.async_sgd else ', ep'}).run_as_model()"
              f"{'  # each replica its own loss' if plan.async_sgd else ''}\n" if not ep else
              f"    stage = make_stage(model, None{', cp' if cp else ''}, ep)  # this rank's expert slices: stage.experts\n"
              "    stage.run_as_model()\n"))
    return ModelCodeLines(imports="import torch\nfrom torch import device\n\n",
                          runtime_import=fp8_import(plan) + attention_import(plan) + forked_import(plan) +
                          cp_import(plan) + ep_import(plan) + "from runtime.pipeline.stage import StageModel\n",
                          text=text, run=run)


def cp_import(plan: "Plan") -> str:
    """The import of what the code of a context-parallel plan calls (partitioner.codegen.segment_cp)."""
    if plan.config.cp == 1:
        return ""
    return ("from runtime.context.program import CPContext, cp_attention, cp_positions  # context parallelism: "
            "attention over the cp group, this rank's positions\n")


def ep_context(plan: "Plan") -> bool:
    """Whether the plan's code takes the ep context (runtime.experts.program.EPContext): under ep > 1, and at
    ep = 1 where the model computes its routers' load-balancing loss, which the code computes over every rank's
    tokens (partitioner.codegen.segment_ep; the code's MoE fields are set exactly then)."""
    return plan.code is not None and plan.code.moe_layers > 0


def ep_stage_lines(plan: "Plan") -> tuple[str, str]:
    """(make_stage's ep parameter, its first line) for a program whose code takes the ep context: at ep = 1 the
    parameter defaults to a context of this process alone, so `plan.verify`, which calls make_stage(model, tp),
    replays the load-balancing loss over the tokens it runs, as the module computes it."""
    if not ep_context(plan):
        return "", ""
    if plan.config.ep > 1:
        return ", ep", ""
    if pipelined_aux(plan):
        return ", ep=None", ('    if ep is None:  # plan.verify\n'
                             '        raise ValueError("plan.verify builds each pipeline rank apart, without the links that carry "\n'
                             '                         "the load-balancing loss\'s sums from stage to stage: check this plan by "\n'
                             '                         "running it, or verify a plan with pp=1")\n')
    return ", ep=None", (f"    if ep is None:  # plan.verify: one process, the loss over its own tokens\n"
                         f"        ep = {one_rank_ep_context(plan, 'None')}\n")


def one_rank_ep_context(plan: "Plan", collectives: str, token_group: str = "", wrap: str = " ") -> str:
    """The EPContext expression of an ep = 1 program's code (a group of this rank alone, which the
    load-balancing loss's sums are all-reduced over `token_group`, if given); `wrap` goes before top_k."""
    code = plan.code
    group = f", token_group={token_group}" if token_group else ""
    return (f"EPContext(group=None, collectives={collectives}, rank=0, world=1, "
            f"num_experts={max(e for _, e in code.experts)},{wrap}top_k={code.top_k}, layers={code.moe_layers}{group})")


def ep_import(plan: "Plan") -> str:
    """The imports of what the code and engine of an expert-parallel plan call (partitioner.codegen.segment_ep)."""
    if not ep_context(plan):
        return ""
    pipe = ("from runtime.experts.pipeline_aux import AuxPipeline  # the load-balancing loss's sums from stage to "
            "stage\n") if pipelined_aux(plan) else ""
    if plan.config.ep == 1:
        return ("from runtime.experts.program import EPContext, ep_aux_loss, ep_record_router_logits, "
                "ep_router_logits  # the load-balancing loss over every rank's tokens\n" + pipe)
    return ("from runtime.experts.engine import ExpertParallel  # expert parallelism: the expert slices beside the "
            "dense engine\n"
            "from runtime.experts.program import EPContext, ep_aux_loss, ep_experts, ep_router_logits\n" + pipe)


def pipelined_aux(plan: "Plan") -> bool:
    """Whether the load-balancing loss's sums travel from pipeline stage to stage (pp > 1 with the loss:
    runtime.experts.pipeline_aux)."""
    return plan.config.pp > 1 and plan.code is not None and plan.code.aux_loss


def _code_calls(plan: "Plan", fn: str) -> bool:
    """Whether the plan's model code (prefix, block templates, suffix) calls `fn`."""
    return plan.code is not None and any(f"{fn}(" in s.source for s in (plan.code.prefix, *plan.code.templates,
                                                                        plan.code.suffix) if s is not None)


def attention_import(plan: "Plan") -> str:
    """The import of the attention the code calls under a mask computed from shapes alone
    (partitioner.codegen.segment_attention)."""
    return "from runtime.pipeline.attention import shape_mask_attention  # a causal mask runs as is_causal\n" \
        if _code_calls(plan, "shape_mask_attention") else ""


def forked_import(plan: "Plan") -> str:
    """The import of the draws on split activations from each tensor slice's own stream
    (partitioner.codegen.segment_tp)."""
    return "from runtime.pipeline.tensor_parallel import tp_forked  # a dropout on a slice's heads or tokens: the " \
        "slice's own stream\n" if _code_calls(plan, "tp_forked") else ""


def fp8_import(plan: "Plan") -> str:
    """The import of the fp8 linear the code of an fp8-mixed plan calls (partitioner.codegen.segments)."""
    return "from runtime.engines.fp8 import fp8_linear  # fp8-mixed: the linears' GEMMs in float8\n" \
        if _code_calls(plan, "fp8_linear") else ""


def optimizer_lines(plan: "Plan", extra: str = "") -> str:
    """The lines that build the optimizer: runtime.engines.optimizer_groups.make_optimizer over what the engine
    steps (and `extra`, whole tensors beside it), told whether the plan slices parameters between ranks."""
    c = plan.config
    sliced = slices_parameters(c.tp, c.ep, [p.spec for p in plan.placements])
    what = [f"ZeRO-{c.zero_stage} flat shards" if c.zero_stage > 0 else "",
            "tensor-parallel slices" if c.tp > 1 and sliced else "", "expert slices" if c.ep > 1 else ""]
    pieces = " and ".join(w for w in what if w)
    why = (f"    # The optimizer steps parameters in pieces ({pieces}): make_optimizer refuses an optimizer\n"
           f"    # whose update reads whole tensors, and keeps optimizer_fn's parameter groups.\n" if pieces else
           "    # The optimizer steps whole parameters, as in one process.\n")
    args = f", extra={extra}" if extra else ""
    return f"{why}    optimizer = make_optimizer(optimizer_fn, engine{args}, sliced={sliced})\n"
