"""Topology: nodes x devices per node x device, and the links between them.

(Interface fixed by the foundation issue; bodies to be filled in.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

from cost_models.errors import TopologyError
from cost_models.specs import DeviceSpec, LinkLevel, LinkSpec

__all__ = ["Topology"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """`nodes` machines, each with `devices_per_node` identical `device`s.

    Bandwidths are per device, per direction, in GB/s (1e9 bytes/s);
    latencies in microseconds. A field left None takes the device preset's
    value (NVLink for intra-node, the typical NIC for inter-node).

    >>> Topology.parse("4x8xA100-80GB").world_size
    32
    """

    nodes: int
    devices_per_node: int
    device: DeviceSpec | str
    intra_node_GBps: float | None = None
    inter_node_GBps: float | None = None
    intra_node_latency_us: float | None = None
    inter_node_latency_us: float | None = None
    local: bool = False  # "local:N": N CPU processes on this machine (Gloo)

    # --- construction -------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "Topology": ...          # "4x8xA100-80GB", "8xH100-80GB", "local:4"
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Topology": ...
    @classmethod
    def from_file(cls, path: str | Path) -> "Topology": ...  # .json / .yaml / .yml
    @classmethod
    def coerce(cls, spec: "Topology | str | Mapping | Path") -> "Topology": ...
    def to_dict(self) -> dict[str, Any]: ...
    def fingerprint(self) -> str: ...                      # stable sha256 of to_dict()

    # --- shape ------------------------------------------------------------
    @property
    def world_size(self) -> int: ...
    def node_of(self, rank: int) -> int: ...
    def ranks_on_node(self, node: int) -> tuple[int, ...]: ...

    # --- links ------------------------------------------------------------
    def link(self, level: LinkLevel) -> LinkSpec: ...
    def link_level(self, a: int, b: int) -> LinkLevel: ...
    def group_level(self, ranks: Sequence[int]) -> LinkLevel: ...  # slowest link inside the group
