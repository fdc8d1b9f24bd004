"""Topology: nodes x devices per node x device, and the links between them.

Ranks are numbered node-major: node 0 holds ranks 0..d-1, node 1 holds
d..2d-1, and so on (what torchrun and SLURM do with one process per GPU).

>>> t = Topology.parse("4x8xA100-80GB")
>>> t.world_size, t.node_of(9), t.link_level(0, 9).value
(32, 1, 'inter_node')
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from cost_models.devices import PRESETS, get_device
from cost_models.errors import TopologyError
from cost_models.specs import DeviceSpec, LinkLevel, LinkSpec

__all__ = ["Topology"]

# Each link field -> (scale from the DeviceSpec unit, the DeviceSpec field it defaults to).
_LINK_SOURCE = {
    "intra_node_GBps": (1e-9, "nvlink_bytes_per_s"),
    "inter_node_GBps": (1e-9, "nic_bytes_per_s"),
    "intra_node_latency_us": (1e6, "nvlink_latency_s"),
    "inter_node_latency_us": (1e6, "nic_latency_s"),
}
_FORMS = ('accepted forms: "NODESxDEVICESxDEVICE" (e.g. "4x8xA100-80GB"), '
          '"DEVICESxDEVICE" for one node (e.g. "8xH100-80GB"), or "local:N" '
          '(N CPU processes on this machine), optionally followed by link '
          'overrides such as ",inter_node_GBps=25"')
# [0-9], not \d or str.isdigit(): those accept "²" (which int() refuses) and other scripts' digits
_SHAPE = re.compile(r"(?:(?P<nodes>[0-9]+)x)?(?P<devices>[0-9]+)x(?P<device>.+)", re.IGNORECASE)
_LOCAL = re.compile(r"local:(?P<devices>.*)", re.IGNORECASE)


# The planner enumerates the divisors of the world size and builds one mesh entry per rank: far beyond
# any machine (the largest are ~10^5 devices) that is a hang, not a plan.
MAX_WORLD_SIZE = 2**20


def _positive_int(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{field}={value!r}: must be an int, got {type(value).__name__}")
    if value < 1:
        raise TopologyError(f"{field}={value!r}: must be >= 1")
    if value > MAX_WORLD_SIZE:
        raise TopologyError(f"{field}={value}: more than the {MAX_WORLD_SIZE} devices this planner handles")


def _is_file(text: str) -> bool:
    """Whether `text` names an existing file; False for what cannot be a path (too long, a NUL byte)."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """`nodes` machines, each with `devices_per_node` identical `device`s.

    Bandwidths are per device, per direction, in GB/s (1e9 bytes/s);
    latencies in microseconds. A field left None takes the device preset's
    value (NVLink for intra-node, the typical NIC for inter-node); after
    construction every field is filled in and `device` is a DeviceSpec.

    >>> Topology.parse("4x8xA100-80GB").world_size
    32
    >>> Topology(nodes=2, devices_per_node=8, device="h100", inter_node_GBps=25).inter_node_GBps
    25.0
    """

    nodes: int
    devices_per_node: int
    device: DeviceSpec | str
    intra_node_GBps: float | None = None
    inter_node_GBps: float | None = None
    intra_node_latency_us: float | None = None
    inter_node_latency_us: float | None = None
    local: bool = False  # "local:N": N CPU processes on this machine (Gloo)

    def __post_init__(self) -> None:
        _positive_int("nodes", self.nodes)
        _positive_int("devices_per_node", self.devices_per_node)
        if self.nodes * self.devices_per_node > MAX_WORLD_SIZE:
            raise TopologyError(f"nodes={self.nodes} x devices_per_node={self.devices_per_node} = "
                                f"{self.nodes * self.devices_per_node} devices: more than the {MAX_WORLD_SIZE} "
                                "this planner handles")
        if isinstance(self.device, str):
            object.__setattr__(self, "device", get_device(self.device))
        elif not isinstance(self.device, DeviceSpec):
            raise TopologyError(
                f"device={self.device!r}: must be a preset name ({', '.join(PRESETS)}) or a DeviceSpec")
        if not isinstance(self.local, bool):
            raise TopologyError(f"local={self.local!r}: must be True or False")
        if self.local and self.nodes != 1:
            raise TopologyError(f"nodes={self.nodes} with local=True: a local run is one machine, use nodes=1")
        for field in _LINK_SOURCE:
            object.__setattr__(self, field, self._link_value(field))

    def _default(self, field: str) -> float | None:
        """The preset's value for a link field; None where the device has no such link."""
        scale, device_field = _LINK_SOURCE[field]
        value = round(getattr(self.device, device_field) * scale, 9)  # 5e-6*1e6 -> 5.0, not 4.99..
        return value if value > 0 or field.endswith("_us") else None

    def _link_value(self, field: str) -> float | None:
        """The user's value, checked, or the preset's."""
        value = getattr(self, field)
        is_latency = field.endswith("_us")
        if value is None:
            value = self._default(field)
            used = self.devices_per_node > 1 if field.startswith("intra") else self.nodes > 1
            if value is None and used:
                raise TopologyError(
                    f"{field}=None: device {self.device.name} has no such link "
                    f"({_LINK_SOURCE[field][1]}=0); pass {field}= explicitly")
            return value  # None: e.g. one device per node and no NVLink, nothing to describe
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TopologyError(f"{field}={value!r}: must be a number, got {type(value).__name__}")
        huge = isinstance(value, int) and abs(value) > 1e308  # math.isfinite would overflow converting it
        if huge or not math.isfinite(value) or (value < 0 if is_latency else value <= 0):
            raise TopologyError(f"{field}={value!r}: must be {'>= 0' if is_latency else '> 0'} and finite")
        return float(value)

    # --- construction -------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "Topology":
        """Parse "4x8xA100-80GB", "8xH100-80GB" or "local:4" (+ ",field=value" overrides).

        Whitespace and the device's case do not matter.

        >>> str(Topology.parse(" 2 x 8 x h100-80gb "))
        '2x8xH100-80GB'
        """
        if not isinstance(text, str):
            raise TopologyError(f"topology {text!r}: must be a string; {_FORMS}")
        compact = "".join(text.split())
        if not compact:
            raise TopologyError(f"topology {text!r} is empty; {_FORMS}")
        head, *overrides = compact.split(",")
        try:
            kwargs = cls._parse_overrides(overrides)
            if head.lower() == "local":
                raise TopologyError('"local" needs a process count: use "local:N", e.g. "local:4"')
            if m := _LOCAL.fullmatch(head):
                if not re.fullmatch("[0-9]+", m["devices"]):
                    raise TopologyError(f"local:{m['devices']}: the process count must be a whole number")
                return cls(nodes=1, devices_per_node=int(m["devices"]), device="CPU", local=True, **kwargs)
            if m := _SHAPE.fullmatch(head):
                return cls(nodes=int(m["nodes"] or 1), devices_per_node=int(m["devices"]),
                           device=m["device"], **kwargs)
            raise TopologyError("not a recognised form")
        except TopologyError as err:
            raise TopologyError(f"topology {text!r}: {err}; {_FORMS}") from None

    @staticmethod
    def _parse_overrides(items: Sequence[str]) -> dict[str, float]:
        names = list(_LINK_SOURCE)
        out: dict[str, float] = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or key not in names:
                raise TopologyError(f"override {item!r}: expected FIELD=NUMBER with FIELD one of {', '.join(names)}")
            try:
                out[key] = float(value)
            except ValueError:
                raise TopologyError(f"override {item!r}: {value!r} is not a number") from None
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Topology":
        """Build from the constructor's keywords; `device` may be a name or a dict of DeviceSpec fields.

        >>> Topology.from_dict({"nodes": 1, "devices_per_node": 2, "device": "CPU"}).world_size
        2
        """
        if not isinstance(d, Mapping):
            raise TopologyError(f"topology {d!r}: must be a mapping of Topology fields")
        fields = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in fields:
                raise TopologyError(f"topology: unknown key {key!r}; valid keys are {', '.join(fields)}")
        missing = [k for k in ("nodes", "devices_per_node", "device") if k not in d]
        if missing:
            raise TopologyError(f"topology: missing key(s) {', '.join(missing)}; e.g. "
                                '{"nodes": 4, "devices_per_node": 8, "device": "A100-80GB"}')
        kwargs = dict(d)
        if isinstance(kwargs["device"], Mapping):
            kwargs["device"] = DeviceSpec.from_dict(kwargs["device"])
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path) -> "Topology":
        """Read a .json, .yaml or .yml file holding a `from_dict` mapping."""
        path = Path(path)
        if path.suffix.lower() not in (".json", ".yaml", ".yml"):
            raise TopologyError(f"topology file {str(path)!r}: use a .json, .yaml or .yml file")
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as err:
            raise TopologyError(f"topology file {str(path)!r} cannot be read: {err.strerror or err}") from None
        except UnicodeDecodeError as err:
            raise TopologyError(f"topology file {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start}): "
                                "write it as JSON or YAML") from None
        try:
            data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as err:
            raise TopologyError(f"topology file {str(path)!r} does not parse: {err}") from None
        except (ValueError, RecursionError) as err:  # an int of more than 4300 digits; nesting too deep
            raise TopologyError(f"topology file {str(path)!r} does not parse: {type(err).__name__}: "
                                f"{str(err)[:120]}") from None
        if not isinstance(data, Mapping):
            raise TopologyError(
                f"topology file {str(path)!r}: the top level must be a mapping of Topology fields "
                f"(nodes, devices_per_node, device, ...), got {type(data).__name__}")
        try:
            return cls.from_dict(data)
        except TopologyError as err:
            raise TopologyError(f"topology file {str(path)!r}: {err}") from None

    @classmethod
    def coerce(cls, spec: "Topology | str | Mapping | Path") -> "Topology":
        """Any accepted description -> Topology: a Topology, a file path, a string, a dict.

        A string naming an existing file (or ending in .json/.yaml/.yml) is read
        as a file; any other string is parsed.
        """
        if isinstance(spec, Topology):
            return spec
        if isinstance(spec, Path):
            return cls.from_file(spec)
        if isinstance(spec, str):
            looks_like_file = spec.strip().lower().endswith((".json", ".yaml", ".yml"))
            return cls.from_file(spec) if looks_like_file or _is_file(spec) else cls.parse(spec)
        if isinstance(spec, Mapping):
            return cls.from_dict(spec)
        raise TopologyError(f"topology {spec!r}: pass a Topology, a string such as "
                            f'"4x8xA100-80GB", a dict or a path to a .json/.yaml file')

    def to_dict(self, *, expand_device: bool = False) -> dict[str, Any]:
        """Plain fields that `from_dict` reads back to an equal Topology.

        `device` is the preset name when it is an unmodified preset (unless
        `expand_device`), else the dict of its DeviceSpec fields.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["device"] = self.device.name if self._preset_device() and not expand_device else self.device.to_dict()
        return d

    def fingerprint(self) -> str:
        """sha256 hex of the canonical JSON of `to_dict(expand_device=True)`.

        The device's numbers are hashed, not just its name, so a plan made
        before a preset was recalibrated does not match the new topology.
        """
        blob = json.dumps(self.to_dict(expand_device=True), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def _preset_device(self) -> bool:
        return PRESETS.get(self.device.name) == self.device

    def __str__(self) -> str:
        """The compact form `parse` reads back: "4x8xA100-80GB", "local:4",
        plus ",field=value" for links that differ from the preset.
        A device that is not an unmodified preset cannot be parsed back
        (use `to_dict`); it is shown as "NAME[custom]".
        """
        head = f"local:{self.devices_per_node}" if self.local else (
            f"{self.nodes}x{self.devices_per_node}x{self.device.name}"
            + ("" if self._preset_device() else "[custom]"))
        overrides = [f"{f}={getattr(self, f)!r}" for f in _LINK_SOURCE if getattr(self, f) != self._default(f)]
        return ",".join([head, *overrides])

    def table(self) -> str:
        """A few aligned lines for humans.

        >>> print(Topology.parse("local:2").table())  # doctest: +NORMALIZE_WHITESPACE
        local:2: 1 node x 2 devices = 2 ranks
        device      CPU: fp32 0.05 TFLOP/s, bf16 0.23 TFLOP/s; 8 GiB; HBM 20 GB/s
        intra_node  0.65 GB/s per direction, 75 us
        inter_node  0.65 GB/s per direction, 100 us
        """
        dev = self.device
        flops = ", ".join(f"{k} {v / 1e12:g} TFLOP/s" for k, v in dev.peak_flops.items())
        lines = [
            f"{self}: {self.nodes} node{'s' * (self.nodes > 1)} x {self.devices_per_node} "
            f"device{'s' * (self.devices_per_node > 1)} = {self.world_size} rank{'s' * (self.world_size > 1)}",
            f"device      {dev.name}: {flops}; {dev.memory_bytes / 2**30:g} GiB; HBM {dev.hbm_bytes_per_s / 1e9:g} GB/s",
        ]
        for level in ("intra_node", "inter_node"):
            gbps = getattr(self, f"{level}_GBps")
            bw = "none" if gbps is None else f"{gbps:g} GB/s per direction"
            lines.append(f"{level:<11} {bw}, {getattr(self, f'{level}_latency_us'):g} us")
        return "\n".join(lines)

    # --- shape ------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """nodes * devices_per_node."""
        return self.nodes * self.devices_per_node

    def _check_rank(self, rank: Any) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TopologyError(f"rank={rank!r}: must be an int")
        if not 0 <= rank < self.world_size:
            raise TopologyError(
                f"rank {rank} is out of range for world size {self.world_size} (ranks are 0..{self.world_size - 1})")
        return rank

    def node_of(self, rank: int) -> int:
        """The node holding `rank` (node-major numbering)."""
        return self._check_rank(rank) // self.devices_per_node

    def ranks_on_node(self, node: int) -> tuple[int, ...]:
        """The ranks of `node`, e.g. node 1 of "4x8x..." -> (8, ..., 15)."""
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nodes:
            raise TopologyError(f"node {node!r} is out of range: this topology has nodes 0..{self.nodes - 1}")
        start = node * self.devices_per_node
        return tuple(range(start, start + self.devices_per_node))

    def _nodes_of(self, ranks: Sequence[int]) -> Counter[int]:
        """node -> number of distinct ranks of `ranks` on it."""
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not ranks:
            raise TopologyError(f"ranks={ranks!r}: must be a non-empty sequence of ranks")
        return Counter(self.node_of(r) for r in set(map(self._check_rank, ranks)))

    def nodes_spanned(self, ranks: Sequence[int]) -> int:
        """How many nodes the group `ranks` touches."""
        return len(self._nodes_of(ranks))

    def max_ranks_per_node(self, ranks: Sequence[int]) -> int:
        """The most distinct ranks of the group on any one node."""
        return max(self._nodes_of(ranks).values())

    # --- links ------------------------------------------------------------
    def link(self, level: LinkLevel | str) -> LinkSpec:
        """The link at `level`, in bytes/s and seconds.

        SAME_DEVICE is a copy in device memory: HBM bandwidth, no latency.
        """
        try:
            level = LinkLevel(level)
        except ValueError:
            raise TopologyError(f"level={level!r}: must be one of {', '.join(l.value for l in LinkLevel)}") from None
        if level is LinkLevel.SAME_DEVICE:
            return LinkSpec(level=level, bytes_per_s=self.device.hbm_bytes_per_s, latency_s=0.0)
        prefix = level.value  # "intra_node" / "inter_node"
        gbps = getattr(self, f"{prefix}_GBps")
        if gbps is None:
            raise TopologyError(f"this topology has no {prefix} link: device {self.device.name} "
                                f"has none; pass {prefix}_GBps= to describe it")
        return LinkSpec(level=level, bytes_per_s=gbps * 1e9, latency_s=getattr(self, f"{prefix}_latency_us") * 1e-6)

    def link_level(self, a: int, b: int) -> LinkLevel:
        """SAME_DEVICE if a == b, INTRA_NODE on one node, else INTER_NODE."""
        if self._check_rank(a) == self._check_rank(b):
            return LinkLevel.SAME_DEVICE
        return LinkLevel.INTRA_NODE if self.node_of(a) == self.node_of(b) else LinkLevel.INTER_NODE

    def group_level(self, ranks: Sequence[int]) -> LinkLevel:
        """The slowest link inside the group; one rank alone is SAME_DEVICE."""
        nodes = self._nodes_of(ranks)
        if len(nodes) > 1:
            return LinkLevel.INTER_NODE
        return LinkLevel.INTRA_NODE if max(nodes.values()) > 1 else LinkLevel.SAME_DEVICE
