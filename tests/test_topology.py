"""Device presets, Topology parsing/serialisation, rank geometry and errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from cost_models.devices import PRESETS, get_device
from cost_models.errors import TopologyError
from cost_models.specs import DeviceSpec, LinkLevel
from cost_models.topology import Topology

INTRA, INTER, SAME = LinkLevel.INTRA_NODE, LinkLevel.INTER_NODE, LinkLevel.SAME_DEVICE
GiB = 2**30


# --- presets ------------------------------------------------------------------
@pytest.mark.parametrize("name, dtype, peak", [
    ("H100-80GB", "bf16", 989.4e12), ("H100-80GB", "fp8", 1978.9e12), ("H100-80GB", "fp32", 66.9e12),
    ("H200-141GB", "bf16", 989.4e12), ("A100-80GB", "bf16", 312e12), ("A100-40GB", "tf32", 156e12),
    ("A100-80GB", "fp32", 19.5e12), ("V100-32GB", "fp16", 125e12), ("V100-32GB", "fp32", 15.7e12),
    ("CPU", "fp32", 50e9),
])
def test_preset_dense_peaks(name, dtype, peak):
    assert PRESETS[name].flops(dtype) == pytest.approx(peak)


@pytest.mark.parametrize("name, memory, hbm, nvlink, nic", [
    ("V100-32GB", 32 * GiB, 900e9, 150e9, 12.5e9),
    ("A100-40GB", 40 * GiB, 1555e9, 300e9, 25e9),
    ("A100-80GB", 80 * GiB, 2039e9, 300e9, 25e9),
    ("H100-80GB", 80 * GiB, 3.35e12, 450e9, 50e9),
    ("H200-141GB", 141 * GiB, 4.8e12, 450e9, 50e9),
    ("CPU", 8 * GiB, 20e9, 0.65e9, 0.65e9),
])
def test_preset_memory_and_bandwidths(name, memory, hbm, nvlink, nic):
    d = PRESETS[name]
    assert (d.memory_bytes, d.hbm_bytes_per_s, d.nvlink_bytes_per_s, d.nic_bytes_per_s) == (memory, hbm, nvlink, nic)
    assert d.source and d.name == name


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_dense_and_ordered(name):
    d = PRESETS[name]
    # Tensor-core dtypes are faster than plain fp32 and fp8 doubles bf16 (dense).
    for dtype in ("tf32", "bf16", "fp16", "fp8"):
        if dtype in d.peak_flops:
            assert d.peak_flops[dtype] > d.peak_flops["fp32"]
    if "fp8" in d.peak_flops:
        assert d.peak_flops["fp8"] == pytest.approx(2 * d.peak_flops["bf16"], rel=1e-3)  # whitepaper rounds


@pytest.mark.parametrize("name, missing", [("V100-32GB", "bf16"), ("V100-32GB", "tf32"), ("A100-80GB", "fp8"),
                                           ("CPU", "fp16")])
def test_missing_dtype_names_dtype_and_alternatives(name, missing):
    with pytest.raises(TopologyError, match=rf"no {missing} peak.*it has fp32") as e:
        PRESETS[name].flops(missing)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("alias, canonical", [
    ("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16"), ("half", "fp16"),
    (torch.bfloat16, "bf16"), (torch.float32, "fp32"), ("torch.float16", "fp16"),
    (torch.float8_e4m3fn, "fp8"), ("BF16", "bf16"),
])
def test_flops_aliases(alias, canonical):
    h100 = PRESETS["H100-80GB"]
    assert h100.flops(alias) == h100.peak_flops[canonical]


def test_unknown_dtype_is_an_error():
    with pytest.raises(TopologyError, match="'int4'.*fp32, tf32, bf16"):
        PRESETS["H100-80GB"].flops("int4")


@pytest.mark.parametrize("query, name", [
    ("a100-80gb", "A100-80GB"), ("A100_80GB", "A100-80GB"), ("a100 80gb", "A100-80GB"), ("H100", "H100-80GB"),
    ("h200", "H200-141GB"), ("v100", "V100-32GB"), ("cpu", "CPU"), ("A100-40GB", "A100-40GB"),
])
def test_preset_lookup_is_tolerant(query, name):
    assert get_device(query) is PRESETS[name]


def test_ambiguous_preset_lists_candidates():
    with pytest.raises(TopologyError, match="'A100' is ambiguous.*A100-40GB or A100-80GB"):
        get_device("A100")


def test_devicespec_normalises_and_validates():
    d = DeviceSpec(name="toy", peak_flops={"bfloat16": 1e12}, memory_bytes=80e9,
                   hbm_bytes_per_s=1e11, nvlink_bytes_per_s=0, nic_bytes_per_s=1e9)
    assert dict(d.peak_flops) == {"bf16": 1e12} and d.memory_bytes == 80_000_000_000
    assert DeviceSpec.from_dict(d.to_dict()) == d and hash(d) == hash(DeviceSpec.from_dict(d.to_dict()))


@pytest.mark.parametrize("field, value, message", [
    ("memory_bytes", 0, "memory_bytes=0: must be a positive int"),
    ("hbm_bytes_per_s", -1.0, "hbm_bytes_per_s=-1.0: must be > 0"),
    ("peak_flops", {"bf16": "312e12"}, r"peak_flops\['bf16'\]='312e12': must be a number, not a string"),
    ("peak_flops", {}, "peak_flops={}: must be a non-empty mapping"),
    ("nic_bytes_per_s", True, "nic_bytes_per_s=True: must be a number"),
])
def test_devicespec_errors_name_field_and_value(field, value, message):
    fields = dict(name="toy", peak_flops={"fp32": 1e12}, memory_bytes=GiB, hbm_bytes_per_s=1e11,
                  nvlink_bytes_per_s=0, nic_bytes_per_s=1e9)
    with pytest.raises(TopologyError, match=message):
        DeviceSpec(**{**fields, field: value})


# --- parse and str ----------------------------------------------------------
@pytest.mark.parametrize("text, nodes, per_node, device, local", [
    ("4x8xA100-80GB", 4, 8, "A100-80GB", False),
    ("8xH100-80GB", 1, 8, "H100-80GB", False),
    (" 2 x 8 x h200-141gb ", 2, 8, "H200-141GB", False),
    ("16X8Xa100_40gb", 16, 8, "A100-40GB", False),
    ("1x1xCPU", 1, 1, "CPU", False),
    ("local:4", 1, 4, "CPU", True),
    ("LOCAL : 2", 1, 2, "CPU", True),
])
def test_parse_forms(text, nodes, per_node, device, local):
    t = Topology.parse(text)
    assert (t.nodes, t.devices_per_node, t.device, t.local) == (nodes, per_node, PRESETS[device], local)
    assert Topology.parse(str(t)) == t


@pytest.mark.parametrize("text", ["4x8xA100-80GB", "local:4", "1x8xH100-80GB"])
def test_str_is_the_compact_form(text):
    assert str(Topology.parse(text)) == text


def test_link_overrides_print_and_parse_back():
    t = Topology(nodes=2, devices_per_node=8, device="H100-80GB", inter_node_GBps=25, intra_node_latency_us=3)
    assert str(t) == "2x8xH100-80GB,inter_node_GBps=25.0,intra_node_latency_us=3.0"
    assert Topology.parse(str(t)) == t


def test_defaults_come_from_the_preset():
    t = Topology.parse("4x8xA100-80GB")
    assert (t.intra_node_GBps, t.inter_node_GBps, t.intra_node_latency_us, t.inter_node_latency_us) == (300, 25, 5, 10)
    local = Topology.parse("local:2")
    assert (local.intra_node_GBps, local.intra_node_latency_us) == (0.65, 75)


# --- shape and links ----------------------------------------------------------
def test_world_size_and_rank_geometry():
    t = Topology.parse("4x8xA100-80GB")
    assert t.world_size == 32
    assert [t.node_of(r) for r in (0, 7, 8, 31)] == [0, 0, 1, 3]
    assert t.ranks_on_node(1) == tuple(range(8, 16))


@pytest.mark.parametrize("a, b, level", [(0, 0, SAME), (0, 7, INTRA), (8, 15, INTRA), (7, 8, INTER), (0, 31, INTER)])
def test_link_level_of_pairs(a, b, level):
    assert Topology.parse("4x8xA100-80GB").link_level(a, b) is level


@pytest.mark.parametrize("ranks, level, spanned, per_node", [
    ([5], SAME, 1, 1), ([3, 3], SAME, 1, 1), ([0, 1, 2, 3], INTRA, 1, 4), (range(8), INTRA, 1, 8),
    ([0, 8], INTER, 2, 1), ([0, 8, 16, 24], INTER, 4, 1), ([0, 1, 2, 9], INTER, 2, 3), (range(32), INTER, 4, 8),
])
def test_group_level_is_the_slowest_link(ranks, level, spanned, per_node):
    t = Topology.parse("4x8xA100-80GB")
    assert t.group_level(ranks) is level
    assert (t.nodes_spanned(ranks), t.max_ranks_per_node(ranks)) == (spanned, per_node)


@pytest.mark.parametrize("level, bw, lat", [(INTRA, 450e9, 5e-6), (INTER, 50e9, 10e-6), (SAME, 3.35e12, 0.0),
                                            ("inter_node", 50e9, 10e-6)])
def test_link_specs_in_si_units(level, bw, lat):
    link = Topology.parse("2x8xH100-80GB").link(level)
    assert link.level is LinkLevel(level)
    assert link.bytes_per_s == pytest.approx(bw) and link.latency_s == pytest.approx(lat)


def test_device_without_nvlink_on_one_device_per_node():
    toy = DeviceSpec(name="toy", peak_flops={"fp32": 1e12}, memory_bytes=GiB, hbm_bytes_per_s=1e11,
                     nvlink_bytes_per_s=0, nic_bytes_per_s=1e9)
    t = Topology(nodes=4, devices_per_node=1, device=toy)
    assert t.intra_node_GBps is None and Topology.from_dict(t.to_dict()) == t
    with pytest.raises(TopologyError, match="no intra_node link"):
        t.link(INTRA)
    with pytest.raises(TopologyError, match="intra_node_GBps=None: device toy has no such link"):
        Topology(nodes=1, devices_per_node=8, device=toy)


# --- dicts, files, fingerprint ------------------------------------------------
TOPOLOGIES = [
    Topology.parse("4x8xA100-80GB"),
    Topology.parse("local:4"),
    Topology(nodes=2, devices_per_node=4, device="V100-32GB", inter_node_GBps=6.25, inter_node_latency_us=0),
    Topology(nodes=2, devices_per_node=2, device=DeviceSpec(
        name="MyChip", peak_flops={"bf16": 1e14}, memory_bytes=16 * GiB, hbm_bytes_per_s=1e12,
        nvlink_bytes_per_s=1e11, nic_bytes_per_s=1e10, source="made up")),
]


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=str)
def test_dict_round_trip(topo):
    d = topo.to_dict()
    assert Topology.from_dict(d) == topo
    assert Topology.from_dict(json.loads(json.dumps(d))) == topo
    assert Topology.from_dict(topo.to_dict(expand_device=True)) == topo


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=str)
@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_file_round_trip(tmp_path, topo, suffix):
    path = tmp_path / f"topo{suffix}"
    d = topo.to_dict()
    path.write_text(json.dumps(d) if suffix == ".json" else yaml.safe_dump(d))
    assert Topology.from_file(path) == topo
    assert Topology.coerce(path) == topo and Topology.coerce(str(path)) == topo


def test_hand_written_yaml(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("nodes: 2\ndevices_per_node: 8\ndevice: h100\ninter_node_GBps: 25\n")
    assert Topology.from_file(path) == Topology.parse("2x8xH100-80GB,inter_node_GBps=25")


@pytest.mark.parametrize("spec", ["4x8xA100-80GB", {"nodes": 4, "devices_per_node": 8, "device": "A100-80GB"},
                                  Topology.parse("4x8xA100-80GB")])
def test_coerce(spec):
    assert Topology.coerce(spec) == Topology.parse("4x8xA100-80GB")


def test_fingerprint_is_stable_across_processes():
    code = "from cost_models.topology import Topology; print(Topology.parse('4x8xA100-80GB').fingerprint())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    fp = Topology.parse("4x8xA100-80GB").fingerprint()
    assert fp == other and len(fp) == 64 and int(fp, 16) >= 0


def test_fingerprints_differ_between_topologies():
    texts = ["4x8xA100-80GB", "4x8xA100-40GB", "8x4xA100-80GB", "4x8xA100-80GB,inter_node_GBps=50", "local:4"]
    assert len({Topology.parse(t).fingerprint() for t in texts}) == len(texts)


def test_fingerprint_sees_device_numbers_not_just_the_name():
    preset = Topology.parse("1x8xH100-80GB")
    tweaked = Topology(nodes=1, devices_per_node=8, device=DeviceSpec.from_dict(
        {**preset.device.to_dict(), "hbm_bytes_per_s": 3e12}))
    assert str(tweaked) == "1x8xH100-80GB[custom]"
    assert tweaked.fingerprint() != preset.fingerprint()


# --- bad input: each error is a TopologyError (a ValueError) that says what and how ---
FORMS = "accepted forms"


@pytest.mark.parametrize("text, message", [
    ("4x8xB300", r"unknown device 'B300': presets are V100-32GB, A100-40GB, A100-80GB, H100-80GB, H800-80GB, "
                 r"H200-141GB, CPU; or pass a DeviceSpec"),
    ("4x0xA100-80GB", "devices_per_node=0: must be >= 1"),
    ("0x8xA100-80GB", "nodes=0: must be >= 1"),
    ("axbxc", "not a recognised form"),
    ("", "is empty"),
    ("   ", "is empty"),
    ("local", 'use "local:N"'),
    ("local:x", "process count must be a whole number"),
    ("local:0", "devices_per_node=0: must be >= 1"),
    ("4x8xA100", "'A100' is ambiguous"),
    ("4x8xA100-80GB,inter_node_GBps=-1", "inter_node_GBps=-1.0: must be > 0"),
    ("4x8xA100-80GB,bogus=1", "override 'bogus=1'"),
    ("4x8xA100-80GB,inter_node_GBps=fast", "'fast' is not a number"),
])
def test_parse_errors_quote_the_string_and_show_the_forms(text, message):
    with pytest.raises(TopologyError, match=message) as e:
        Topology.parse(text)
    assert isinstance(e.value, ValueError)
    assert f"topology {text!r}" in str(e.value) and FORMS in str(e.value)


@pytest.mark.parametrize("field, value, message", [
    ("nodes", "4", "nodes='4': must be an int"),
    ("nodes", True, "nodes=True: must be an int, got bool"),
    ("nodes", 2.0, "nodes=2.0: must be an int"),
    ("devices_per_node", 0, "devices_per_node=0: must be >= 1"),
    ("devices_per_node", -3, "devices_per_node=-3: must be >= 1"),
    ("inter_node_GBps", -1, "inter_node_GBps=-1: must be > 0"),
    ("intra_node_GBps", 0, "intra_node_GBps=0: must be > 0"),
    ("intra_node_GBps", float("inf"), "intra_node_GBps=inf: must be > 0 and finite"),
    ("inter_node_GBps", "25", "inter_node_GBps='25': must be a number"),
    ("intra_node_latency_us", -5, "intra_node_latency_us=-5: must be >= 0"),
    ("device", 7, "device=7: must be a preset name"),
    ("device", "B300", "unknown device 'B300'.*or pass a DeviceSpec"),
    ("local", "yes", "local='yes': must be True or False"),
])
def test_constructor_errors_name_field_and_value(field, value, message):
    kwargs = {"nodes": 2, "devices_per_node": 8, "device": "A100-80GB", field: value}
    with pytest.raises(TopologyError, match=message) as e:
        Topology(**kwargs)
    assert isinstance(e.value, ValueError)


def test_local_is_one_node():
    with pytest.raises(TopologyError, match="nodes=2 with local=True"):
        Topology(nodes=2, devices_per_node=2, device="CPU", local=True)


@pytest.mark.parametrize("d, message", [
    ({"nodes": 1, "devices_per_node": 2, "device": "CPU", "gpus": 2}, "unknown key 'gpus'; valid keys are nodes, "),
    ({"nodes": 1, "device": "CPU"}, "missing key.*devices_per_node"),
    ({"nodes": 1, "devices_per_node": 2, "device": {"name": "x"}}, "device: missing key.*peak_flops"),
    ({"nodes": 1, "devices_per_node": 2, "device": {"name": "x", "tflops": 1}}, "device: unknown key 'tflops'"),
    (["4x8xA100-80GB"], "must be a mapping"),
])
def test_from_dict_errors(d, message):
    with pytest.raises(TopologyError, match=message):
        Topology.from_dict(d)


@pytest.mark.parametrize("name, content, message", [
    ("missing.yaml", None, "cannot be read"),
    ("bad.json", "{nodes: ", "does not parse"),
    ("bad.yaml", "nodes: [1, 2", "does not parse"),
    ("list.yaml", "- 4x8xA100-80GB\n", "top level must be a mapping.*got list"),
    ("scalar.json", "42", "top level must be a mapping.*got int"),
    ("typo.yml", "nodes: 1\ndevices_per_node: 2\ndevice: CPU\ngpu: 1\n", "unknown key 'gpu'"),
    ("topo.txt", "4x8xA100-80GB", "use a .json, .yaml or .yml file"),
])
def test_file_errors_name_the_file(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(TopologyError, match=message) as e:
        Topology.from_file(path)
    assert str(path) in str(e.value)


def test_coerce_rejects_other_types():
    with pytest.raises(TopologyError, match="pass a Topology, a string"):
        Topology.coerce(32)


def test_coerce_missing_file_path_is_a_file_error(tmp_path):
    with pytest.raises(TopologyError, match="cannot be read"):
        Topology.coerce(str(tmp_path / "nope.json"))


@pytest.mark.parametrize("call, message", [
    (lambda t: t.node_of(32), "rank 32 is out of range for world size 32"),
    (lambda t: t.node_of(-1), "rank -1 is out of range for world size 32"),
    (lambda t: t.link_level(0, 40), "rank 40 is out of range for world size 32"),
    (lambda t: t.group_level([0, 99]), "rank 99 is out of range for world size 32"),
    (lambda t: t.group_level([]), "must be a non-empty sequence"),
    (lambda t: t.ranks_on_node(4), "node 4 is out of range"),
    (lambda t: t.link("pcie"), "level='pcie': must be one of"),
])
def test_out_of_range_errors(call, message):
    with pytest.raises(TopologyError, match=message):
        call(Topology.parse("4x8xA100-80GB"))
