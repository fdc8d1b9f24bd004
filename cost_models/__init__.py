"""Cost models: hardware (Topology) and the time/memory formulas the planner uses.

Imports nothing else of the project (docs/architecture.md#rules-of-the-house).

>>> from cost_models import Topology, CommModel
>>> topo = Topology.parse("2x8xA100-80GB")
>>> CommModel(topo).all_reduce(1e9, range(16)) > CommModel(topo).all_reduce(1e9, range(8))
True
"""

from cost_models.calibration import Calibration
from cost_models.comm import CommModel
from cost_models.compute import ComputeModel, RooflineCompute, dtype_for
from cost_models.devices import PRESETS, get_device
from cost_models.errors import DeclarationError, PartitionerError, TopologyError, TraceError
from cost_models.memory import (
    ModelStateBytes,
    inflight_microbatches,
    model_state_bytes,
    temporary_buffer_bytes,
    transformer_activation_bytes,
)
from cost_models.specs import DeviceSpec, LinkLevel, LinkSpec
from cost_models.topology import Topology

__all__ = [
    "Topology", "DeviceSpec", "LinkSpec", "LinkLevel", "PRESETS", "get_device",
    "Calibration", "ComputeModel", "RooflineCompute", "dtype_for", "CommModel",
    "ModelStateBytes", "model_state_bytes", "transformer_activation_bytes", "inflight_microbatches",
    "temporary_buffer_bytes",
    "PartitionerError", "TopologyError", "TraceError", "DeclarationError",
]
