"""The one error class every piece of bad user input raises.

`PartitionerError` is a `ValueError`, so callers that already catch
`ValueError` keep working; each subclass names the kind of input that was
wrong. Messages say what is wrong, why, and how to fix it (docs/architecture.md#rules-of-the-house).

The families, each a subclass of `PartitionerError`, so
`except PartitionerError` catches every refusal of bad input and nothing else:

- `TopologyError` (here): a topology string, dict, file or keyword.
- `TraceError` (here): a model that cannot be captured as a graph.
- `DeclarationError` (here): a declaration to `compile()` that cannot hold
  (and `PlanInfeasibleError`, partitioner.compile: nothing fits in memory).
- `PlanFormatError` (partitioner.planner.plan_json): a plan file that is not a plan.
- `PlanMismatchError` (partitioner.planner.plan): a plan for another model or topology.
- `LaunchError` (runtime.launch.env): a job that cannot start as launched (launcher
  variables, world size, program hash, rendezvous address).
- `ModelMismatchError` (runtime.engines.step): a model whose parameters are not the plan's.
- `CheckpointError` (runtime.checkpoint): a checkpoint or manifest that cannot be read back.

The runtime's classes live in `runtime` and subclass this one: `cost_models`
imports nothing of the project, so importing it from `runtime` keeps the
one-direction rule (docs/architecture.md#rules-of-the-house).
"""

from __future__ import annotations

__all__ = ["PartitionerError", "TopologyError", "TraceError", "DeclarationError"]


class PartitionerError(ValueError):
    """Bad input to the project: the message names the field and the fix."""


class TopologyError(PartitionerError):
    """A topology string, dict, file or keyword that does not describe hardware."""


class TraceError(PartitionerError):
    """A model that cannot be captured as a graph, with what to try instead."""


class DeclarationError(PartitionerError):
    """A user declaration (dp, tp, batch size, ...) that cannot hold."""
