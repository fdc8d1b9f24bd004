"""Frozen descriptions of hardware: a device and a link.

Units: FLOP/s, bytes, bytes/s, seconds. Bandwidths are per device, per
direction (what one GPU can push into a link while receiving as much).
"""

from __future__ import annotations

import dataclasses
import math
from enum import Enum
from types import MappingProxyType
from typing import Any, Mapping

from cost_models.errors import TopologyError

__all__ = ["DeviceSpec", "LinkSpec", "LinkLevel", "canonical_dtype"]


class LinkLevel(str, Enum):
    """Where two ranks talk: the same device, the same node, or across nodes."""

    SAME_DEVICE = "same_device"
    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"


# Every spelling a user or torch may give for the dtypes `peak_flops` knows.
# torch dtypes are matched by `str(dtype)` ("torch.bfloat16"), so this module
# does not import torch.
_DTYPE_ALIASES: Mapping[str, str] = MappingProxyType({
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32",
    "tf32": "tf32", "tensorfloat32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8",
})
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


def canonical_dtype(dtype: Any) -> str:
    """The `peak_flops` key for a dtype name or torch dtype.

    >>> canonical_dtype("bfloat16"), canonical_dtype("torch.float32")
    ('bf16', 'fp32')
    """
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise TopologyError(
            f"dtype {dtype!r} is not a known compute dtype; use one of "
            f"{', '.join(DTYPES)} (or a torch dtype / its name such as 'bfloat16')")
    return _DTYPE_ALIASES[key]


def _number(owner: str, field: str, value: Any, *, minimum: float, strict: bool) -> float:
    """`value` as a float, checked finite and > (strict) or >= `minimum`."""
    if isinstance(value, str):
        # PyYAML (YAML 1.1) reads `312e12` as a string; `3.12e+14` is a float.
        raise TopologyError(
            f"{owner} {field}={value!r}: must be a number, not a string "
            f"(in YAML write exponents with a dot and a sign, e.g. 3.12e+14)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TopologyError(f"{owner} {field}={value!r}: must be a number, got {type(value).__name__}")
    bad = value <= minimum if strict else value < minimum
    if bad or (isinstance(value, int) and value > 1e308) or not math.isfinite(value):  # huge ints: no overflow
        raise TopologyError(f"{owner} {field}={value!r}: must be {'>' if strict else '>='} {minimum:g} and finite")
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU process).

    name: preset name, e.g. "A100-80GB".
    peak_flops: dense peak FLOP/s per dtype name ("fp32", "tf32", "bf16",
        "fp16", "fp8"); a dtype missing here is not supported by the device.
        Aliases ("bfloat16", "torch.float16") are stored under these names.
    memory_bytes: usable device memory.
    hbm_bytes_per_s: memory bandwidth.
    nvlink_bytes_per_s: intra-node link bandwidth per direction (0 = none).
    nic_bytes_per_s: typical inter-node NIC bandwidth per device per direction.
    nvlink_latency_s: typical one-way latency of the intra-node link.
    nic_latency_s: typical one-way latency of the inter-node link.
    process_bytes: device memory every process holds outside its tensors (the driver's
        context and the kernels the framework loads), which its allocator never sees.
    comm_buffer_bytes: device memory one communicator of the device's collective library
        holds for as long as it lives (NCCL's per-channel receive buffers); 0 where the
        library allocates per call (Gloo on CPU).
    source: where the numbers come from (datasheet, measurement).

    >>> DeviceSpec(name="toy", peak_flops={"float32": 1e12}, memory_bytes=2**30,
    ...            hbm_bytes_per_s=1e11, nvlink_bytes_per_s=0, nic_bytes_per_s=1e9).flops("fp32")
    1000000000000.0
    """

    name: str
    # hash=False: a mapping is not hashable; the name and numbers still are.
    peak_flops: Mapping[str, float] = dataclasses.field(hash=False)
    memory_bytes: int
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    nic_bytes_per_s: float
    nvlink_latency_s: float = 5e-6
    nic_latency_s: float = 10e-6
    process_bytes: int = 0
    comm_buffer_bytes: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        owner = f"DeviceSpec {self.name!r}"
        if not isinstance(self.name, str) or not self.name.strip():
            raise TopologyError(f"DeviceSpec name={self.name!r}: must be a non-empty string such as 'A100-80GB'")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise TopologyError(
                f"{owner} peak_flops={self.peak_flops!r}: must be a non-empty mapping "
                f"dtype -> FLOP/s, e.g. {{'bf16': 312e12}}")
        flops = {}
        for k, v in self.peak_flops.items():
            try:
                dtype = canonical_dtype(k)
            except TopologyError as e:
                raise TopologyError(f"{owner} peak_flops key {k!r}: {e}") from None
            flops[dtype] = _number(owner, f"peak_flops[{k!r}]", v, minimum=0, strict=True)
        object.__setattr__(self, "peak_flops", MappingProxyType(flops))
        memory = self.memory_bytes
        if isinstance(memory, float) and memory.is_integer():
            memory = int(memory)  # 80e9 is a natural way to write bytes
        if isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
            raise TopologyError(f"{owner} memory_bytes={self.memory_bytes!r}: must be a positive int (bytes)")
        object.__setattr__(self, "memory_bytes", memory)
        for field, strict in (("hbm_bytes_per_s", True), ("nvlink_bytes_per_s", False),
                              ("nic_bytes_per_s", False), ("nvlink_latency_s", False),
                              ("nic_latency_s", False)):
            object.__setattr__(self, field, _number(owner, field, getattr(self, field), minimum=0, strict=strict))
        for field in ("process_bytes", "comm_buffer_bytes"):
            value = getattr(self, field)
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TopologyError(f"{owner} {field}={getattr(self, field)!r}: must be an int >= 0 (bytes)")
            object.__setattr__(self, field, value)
        if not isinstance(self.source, str):
            raise TopologyError(f"{owner} source={self.source!r}: must be a string")

    def flops(self, dtype: Any) -> float:
        """Dense peak FLOP/s for `dtype` ("bf16", "bfloat16", torch.bfloat16, ...).

        Strict: "fp32" is the plain fp32 peak; a caller that enables TF32
        matmuls asks for "tf32". A dtype the device lacks is an error.

        >>> from cost_models.devices import get_device
        >>> get_device("A100-80GB").flops("bfloat16")
        312000000000000.0
        """
        key = canonical_dtype(dtype)
        if key not in self.peak_flops:
            raise TopologyError(
                f"device {self.name} has no {key} peak (asked for {dtype!r}); it has "
                f"{', '.join(self.peak_flops)}: pick one of those dtypes")
        return self.peak_flops[key]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields; `DeviceSpec.from_dict` reads them back."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["peak_flops"] = dict(self.peak_flops)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DeviceSpec":
        """The inverse of `to_dict`; unknown or missing keys are errors."""
        if not isinstance(d, Mapping):
            raise TopologyError(f"device {d!r}: must be a preset name or a mapping of DeviceSpec fields")
        fields = [f.name for f in dataclasses.fields(cls)]
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        unknown = [k for k in d if k not in fields]
        if unknown:
            raise TopologyError(f"device: unknown key {unknown[0]!r}; DeviceSpec fields are {', '.join(fields)}")
        missing = [k for k in required if k not in d]
        if missing:
            raise TopologyError(f"device: missing key(s) {', '.join(missing)}; required are {', '.join(required)}")
        return cls(**d)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One level of the interconnect, as seen by one device.

    bytes_per_s: per device, per direction.
    latency_s: one-way latency of a message (the alpha of alpha-beta).
    """

    level: LinkLevel
    bytes_per_s: float
    latency_s: float
