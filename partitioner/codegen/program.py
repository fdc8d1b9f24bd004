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
`not_runnable` says why a cp plan gets no program (async SGD, no code).

>>> from partitioner import compile
>>> from examples.mlp import mlp, example_inputs
>>> model = mlp()
>>> plan = compile(model, "local:4", example_inputs(model), global_batch_size=32, dp=4)
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
           "not_runnable_ep"]


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


def not_runnable_ep(ep: int) -> str:
    """Why no program is generated for an expert-parallel plan (runtime.experts' kernels exist, codegen does not)."""
    return (f"ep={ep}: expert-parallel plans are costed but not yet runnable: no per-rank program replaces the MoE "
            "layers by runtime.experts' dispatch / grouped experts / combine over the ep group yet; compile with "
            "ep=1 (experts replicated over data parallelism) to train, or use this plan for its predictions only")


def program(plan: "Plan", rank: int) -> RankProgram:
    if not isinstance(rank, int) or not 0 <= rank < plan.world_size:
        raise CodegenError(f"rank={rank!r}: the plan has ranks 0..{plan.world_size - 1}")
    c = plan.config
    why = not_runnable(plan)
    if why:
        raise CodegenError(why)
    if c.ep > 1:
        raise CodegenError(not_runnable_ep(c.ep))
    why = torch_compile_refusal(plan)
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
