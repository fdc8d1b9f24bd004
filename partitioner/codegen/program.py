"""`program(plan, rank) -> RankProgram`: the readable Python one rank runs.

The program imports only torch and `runtime` (as a compiler's output links
its runtime). Every block is commented with the plan decision it implements:
which groups exist, which collective runs where and why, which rows of the
batch and which slice of the parameters this rank holds. Executing the
source defines `build(model_fn, optimizer_fn, loss_fn)`, which returns the
runtime's step runner (`runtime.engines.step.StepRunner`).

Data-parallel plans (pp = tp = 1, any ZeRO stage) are emitted here;
pipeline, tensor-parallel and 3D programs by `partitioner.codegen.pipeline`;
async SGD plans (`plan.async_sgd`) by `partitioner.codegen.async_sgd`. Context parallelism (cp > 1)
composes with the first two: the program runs the plan's code as `partitioner.codegen.segment_cp` rewrote
it, over the cp group (`runtime.context.program.CPContext`), on each rank's tokens of every row;
`not_runnable` says why a cp plan gets no program (async SGD, no code). Expert parallelism (ep > 1) runs
data-parallel programs over the plan's code as `partitioner.codegen.segment_ep` rewrote it: each MoE
layer's experts over the ep group (`runtime.experts.program.EPContext`), the rank's expert slices kept
apart (`runtime.experts.engine.ExpertParallel`); `not_runnable_ep` says which ep plans get no program.

>>> from partitioner import compile
>>> from examples.mlp import mlp, example_inputs
>>> model = mlp()
>>> plan = compile(model, "local:4", example_inputs(model), global_batch_size=32, dp=4, zero_stage=3,
...                zero3_unit="block")
>>> print(plan.program(1).source)
\"\"\"Per-rank program: rank 1 of 4.
<BLANKLINE>
Plan ... for MLP on local:4: dp4 tp1 pp1 zero3 mb8x1 1f1b recompute=none.
...
def build(model_fn, optimizer_fn, loss_fn):
    groups = make_groups(RANK, MESH)
...
    engine = DataParallel(model, group=groups.dp, ranks=groups.dp_ranks, zero_stage=3,
...
    return runtime.engines.step.StepRunner(
        engine=engine, optimizer=optimizer, loss_fn=loss_fn, collectives=collectives, dp_group=groups.dp,
        dp_rank=1, dp_size=4, microbatch_size=8, num_microbatches=1,
        clip_grad_norm=None, program_hash=PROGRAM_HASH, actions=ACTIONS)
<BLANKLINE>
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from partitioner.codegen.async_sgd import async_program_source
from partitioner.codegen.common import CodegenError, torch_compile_refusal
from partitioner.codegen.data_parallel import data_parallel_program_source, expected_collectives
from partitioner.codegen.pipeline import pipeline_program_source
from runtime.pipeline.program_module import exec_program

if TYPE_CHECKING:
    from partitioner.planner.plan import Plan

__all__ = ["RankProgram", "program", "write_programs", "expected_collectives", "CodegenError", "not_runnable",
           "not_runnable_aux", "not_runnable_ep"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankProgram:
    """What one rank runs: `source` is readable, directly executable Python."""

    rank: int
    world_size: int
    source: str
    program_hash: str  # sha256 of the plan JSON: every rank of one plan shares it

    def namespace(self) -> dict:
        """Execute the source; the returned namespace holds `build`."""
        return exec_program(self.source, f"<rank_{self.rank}.py>", rank=self.rank)


def not_runnable(plan: "Plan") -> str:
    """Why no program is generated for a context-parallel plan ("" when one is): programs run cp > 1 from the
    plan's model code, with any dp, tp (with or without sequence parallelism), pp and ZeRO stage."""
    c = plan.config
    if c.cp == 1:
        return ""
    what = f"cp={c.cp} ({c.cp_kind})"
    if plan.async_sgd:
        return f"{what} with async_sgd: asynchronous replicas do not run context parallelism; compile with cp=1"
    if plan.code is None:
        return (f"{what}: a context-parallel program runs the model as generated code (attention over the cp "
                f"group, each rank's positions), and this plan has none: {plan.code_note or 'no traced graph'}")
    return ""


def not_runnable_ep(plan: "Plan") -> str:
    """Why no program is generated for an expert-parallel plan ("" when one is): programs run ep > 1 from the
    plan's model code (partitioner.codegen.segment_ep) with data, pipeline and tensor parallelism (cp = 1, no
    sequence parallelism), fp32 or bf16-mixed,
    any ZeRO stage (the experts' optimizer state and gradients sharded over the ranks holding the same experts,
    runtime.experts.engine)."""
    c = plan.config
    if c.ep == 1:
        return ""
    what = f"ep={c.ep}"
    alone = "; compile with ep=1 (experts replicated over data parallelism) to train this configuration"
    fix = ", or ep=1 (experts replicated over data parallelism) to train this configuration"
    if plan.async_sgd:
        return f"{what} with async_sgd: asynchronous replicas do not run expert parallelism{alone}"
    if c.cp > 1:
        return (f"{what} with cp={c.cp}: expert-parallel programs run with data, pipeline and tensor parallelism "
                f"only (the ep group inside dp) so far; pin cp=1{fix}")
    if c.tp > 1 and c.sp:
        return (f"{what} with tp={c.tp} and sequence parallelism: each tensor slice would route a different share of "
                f"the tokens, which the ep groups (one per tensor slice) do not exchange; pin sp=False{fix}")
    if plan.code is None:
        return (f"{what}: an expert-parallel program runs the model as generated code (each MoE layer's experts "
                f"over the ep group), and this plan has none: {plan.code_note or 'no traced graph'}")
    if plan.precision not in ("fp32", "bf16-mixed"):
        return (f"{what} with precision={plan.precision!r}: the expert slices are kept outside the data-parallel "
                f"engine as fp32 masters, cast to the compute dtype as the code reads them, and unscaled by no loss "
                f"scaler; compile with precision='fp32' or 'bf16-mixed'{fix}")
    return ""


def not_runnable_aux(plan: "Plan") -> str:
    """Why no program is generated for a plan of a model that computes its routers' load-balancing loss (""
    when one is): the loss is a statistic of the batch, which the generated code computes over the dp x cp
    ranks' tokens (partitioner.codegen.segment_ep), so a plan with several such ranks needs that code (under
    pp > 1 each stage's sums travel to the last stage: runtime.experts.pipeline_aux)."""
    c = plan.config
    if not plan.load_balancing_loss or plan.async_sgd:
        return ""
    what = "the model's load-balancing loss (output_router_logits=True)"
    fix = "build the model without it (output_router_logits=False)"
    if c.tp > 1 and c.sp:
        return (f"{what} with tp={c.tp} and sequence parallelism: each tensor slice routes its own share of the "
                "tokens, and the loss is summed over the data-parallel ranks only; pin sp=False")
    if c.cp > 1:  # the experts' token counts are read at the whole sequence length there (fails at run time)
        return (f"{what} with cp={c.cp}: context-parallel programs do not run MoE layers on each rank's share of "
                f"the tokens yet; pin cp=1")
    if c.replicas > 1 and (plan.code is None or not plan.code.aux_loss):
        return (f"{what} over {c.replicas} data-parallel ranks: a statistic of the whole batch (tokens per expert "
                f"times mean router probability), which the program computes over every rank's tokens as generated "
                f"code, and this plan has none ({plan.code_note or 'no traced graph'}); {fix}, or train on one rank")
    return ""


def program(plan: "Plan", rank: int) -> RankProgram:
    if not isinstance(rank, int) or not 0 <= rank < plan.world_size:
        raise CodegenError(f"rank={rank!r}: the plan has ranks 0..{plan.world_size - 1}")
    c = plan.config
    why = not_runnable(plan)
    if why:
        raise CodegenError(why)
    why = not_runnable_aux(plan) or not_runnable_ep(plan) or torch_compile_refusal(plan)
    if why:
        raise CodegenError(why)
    if c.pp > 1 or c.tp > 1:
        source, h = pipeline_program_source(plan, rank)
        return RankProgram(rank=rank, world_size=plan.world_size, source=source, program_hash=h)
    plan_json = plan.to_json()
    h = hashlib.sha256(plan_json.encode()).hexdigest()
    if plan.async_sgd:  # replicas that step alone and average parameters: no DataParallel engine
        return RankProgram(rank=rank, world_size=plan.world_size, source=async_program_source(plan, rank, h),
                           program_hash=h)
    return RankProgram(rank=rank, world_size=plan.world_size, source=data_parallel_program_source(plan, rank, h),
                       program_hash=h)


def write_programs(plan: "Plan", directory: str | Path) -> Path:
    """`directory/plan.json` and `directory/rank_{r}.py` for every rank; returns the directory."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for r in range(plan.world_size):
        (d / f"rank_{r}.py").write_text(program(plan, r).source)
    plan.save(d / "plan.json")
    return d
