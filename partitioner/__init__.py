"""partitioner: trace a PyTorch model, plan its parallelism, generate per-rank programs.

>>> from partitioner import trace, Topology
"""

from cost_models.errors import DeclarationError, PartitionerError, TopologyError, TraceError
from cost_models.specs import DeviceSpec
from cost_models.topology import Topology
from partitioner.opgraph import Block, OpCost, OpGraph, OpNode, ParamSpec, TensorSpec
from partitioner.trace import trace

__all__ = [
    "trace", "Topology", "DeviceSpec", "OpGraph", "OpNode", "OpCost", "TensorSpec", "ParamSpec", "Block",
    "PartitionerError", "TopologyError", "TraceError", "DeclarationError",
]
