"""partitioner: trace a PyTorch model, plan its parallelism, generate per-rank programs.

>>> from partitioner import compile, trace, Topology
"""

from cost_models.errors import DeclarationError, PartitionerError, TopologyError, TraceError
from cost_models.specs import DeviceSpec
from cost_models.topology import Topology
from partitioner.compile import PlanInfeasibleError, compile
from partitioner.planner.declarations import Declarations, PlannerOptions
from partitioner.planner.plan import Plan, PlanMismatchError
from partitioner.planner.plan_json import PlanFormatError
from partitioner.tracer.opgraph import Block, OpCost, OpGraph, OpNode, ParamSpec, TensorSpec
from partitioner.tracer.trace import trace
from partitioner.tune.autotune import AutotuneResult, Trial, autotune

__all__ = [
    "compile", "Declarations", "PlannerOptions", "autotune", "AutotuneResult", "Trial", "Plan", "PlanInfeasibleError", "PlanMismatchError", "PlanFormatError", "trace", "Topology", "DeviceSpec", "OpGraph", "OpNode", "OpCost", "TensorSpec", "ParamSpec", "Block",
    "PartitionerError", "TopologyError", "TraceError", "DeclarationError",
]
