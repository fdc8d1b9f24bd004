"""The instruction list a program runs: its plan's schedule for this pipeline rank, lowered one step further
with the data-parallel collectives as actions (`partitioner.planner.schedule.add_unshard_reshard`), written
as an `ACTIONS` table with a comment saying what each collective action does under this plan.

The plan's own `instructions` stay as the planner timed them (compute, transfers, GRAD_SYNC, OPTIM); the
lowering only adds UNSHARD / RESHARD, which the simulator costs at nothing, so a program's list predicts the
step its plan does. Pipeline and data-parallel programs both write their lists here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from partitioner.codegen.common import literal
from partitioner.planner.schedule import add_unshard_reshard

if TYPE_CHECKING:
    from partitioner.planner.plan import Plan

__all__ = ["instruction_lines"]


def _collectives(plan: Plan) -> list[str]:
    """What GRAD_SYNC, UNSHARD and RESHARD do under this plan, one sentence each."""
    c = plan.config
    if c.dp == 1:
        return ["No replicas (dp = 1): GRAD_SYNC reduces nothing over data parallelism."]
    over = f"the {c.dp} replicas"
    all_reduce = (f"GRAD_SYNC waits for the gradient all-reduces over {over} that the last B launched bucket by "
                  "bucket as its gradients filled (every earlier B accumulates without communicating).")
    lines = {
        0: [all_reduce],
        1: [all_reduce, "UNSHARD all-gathers the updated flat-buffer slices into the replicated parameters."],
        2: [f"Every B reduce-scatters its gradient buckets over {over} (one in flight); GRAD_SYNC waits for "
            "the last.",
            "UNSHARD all-gathers the updated bucket slices into the replicated parameters."],
        3: ["UNSHARD starts the all-gather of the unit the forward uses first; F and B gather the others one "
            "ahead as their modules run and free each after use; every B reduce-scatters each unit's gradient "
            f"over {over} (one in flight); GRAD_SYNC waits for the last; RESHARD frees any unit still gathered."],
    }[c.zero_stage]
    return lines


def instruction_lines(plan: Plan, pipeline_rank: int) -> str:
    """The commented `ACTIONS = '...'.split()` of a program on pipeline rank `pipeline_rank`."""
    c = plan.config
    lowered = add_unshard_reshard(plan.instructions, zero_stage=c.zero_stage)
    text = " ".join(str(a) for a in lowered.ranks[pipeline_rank])
    comment = [f"This rank's instruction list, run in order by runtime.pipeline.executor: {c.num_microbatches} "
               f"microbatch(es) of {c.microbatch_size} per step.", *_collectives(plan)]
    wrapped = "\n".join(_wrap(comment))
    return f"{wrapped}\nACTIONS = {literal(text)}.split()"


def _wrap(sentences: list[str], width: int = 110) -> list[str]:
    out, line = [], "#"
    for word in " ".join(sentences).split():
        if len(line) + 1 + len(word) > width:
            out.append(line)
            line = "#"
        line += " " + word
    return out + [line]
