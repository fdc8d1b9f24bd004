"""Frozen descriptions of hardware: a device and a link.

Units: FLOP/s, bytes, bytes/s, seconds. Bandwidths are per device, per
direction (what one GPU can push into a link while receiving as much).
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from types import MappingProxyType
from typing import Mapping

__all__ = ["DeviceSpec", "LinkSpec", "LinkLevel"]


class LinkLevel(str, Enum):
    """Where two ranks talk: the same device, the same node, or across nodes."""

    SAME_DEVICE = "same_device"
    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU process).

    name: preset name, e.g. "A100-80GB".
    peak_flops: dense peak FLOP/s per dtype name ("fp32", "tf32", "bf16",
        "fp16", "fp8"); a dtype missing here is not supported by the device.
    memory_bytes: usable device memory.
    hbm_bytes_per_s: memory bandwidth.
    nvlink_bytes_per_s: intra-node link bandwidth per direction (0 = none).
    nic_bytes_per_s: typical inter-node NIC bandwidth per device per direction.
    source: where the numbers come from (datasheet, measurement).
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: int
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    nic_bytes_per_s: float
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`; fp32 matmuls may use tf32 where it exists."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One level of the interconnect, as seen by one device.

    bytes_per_s: per device, per direction.
    latency_s: one-way latency of a message (the alpha of alpha-beta).
    """

    level: LinkLevel
    bytes_per_s: float
    latency_s: float
