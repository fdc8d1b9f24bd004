"""Bad input, fuzzed (issue 8): plan JSON, topologies and compile() declarations.

Hypothesis mutates real plan JSON (plans of a 4-block GPT traced on the meta device), topology strings,
dicts and files, and compile()'s declarations. Every case must either succeed or raise a subclass of
`cost_models.errors.PartitionerError` whose message names what is wrong; any other exception, a hang or
a file written outside the case's own directory is a bug in the code under test (fix the decoder, the
parser or the checks, not the test).

The "ci" profile (the default) runs a few thousand cases in about a minute on a 2-core machine, with a
fixed seed (derandomized) so CI does not flicker. To search deeper, with fresh random cases:

    HYPOTHESIS_PROFILE=deep python -m pytest tests/test_fuzz_inputs.py -q     # 20x the cases

No example database is kept (database=None): the test must not write outside its temp directories, and
a failure prints its example (and a @reproduce_failure blob) to replay it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cost_models.errors import PartitionerError, TopologyError
from cost_models.topology import Topology
from partitioner.planner.plan import Plan

settings.register_profile(
    "ci", deadline=None, database=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("deep", settings.get_profile("ci"), derandomize=False)
_SCALES = {"ci": 1, "deep": 20}
_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if _PROFILE not in _SCALES:
    raise ValueError(f"HYPOTHESIS_PROFILE={_PROFILE!r}: use 'ci' (the default) or 'deep'")
_SCALE = _SCALES[_PROFILE]


def cases(n: int) -> settings:
    """`n` examples under the "ci" profile (scaled for "deep"), without touching hypothesis's global settings."""
    return settings(settings.get_profile(_PROFILE), max_examples=n * _SCALE)


def assert_refusal(err: BaseException, names: set[str] = frozenset()) -> None:
    """A documented refusal: a PartitionerError whose message is one meaningful line or more, naming the field
    (one of `names`, when the case knows which fields it broke)."""
    assert isinstance(err, PartitionerError), f"{type(err).__name__}: {err}"
    message = str(err)
    assert message.strip(), f"empty message from {type(err).__name__}"
    if names:
        assert any(n in message for n in names), f"message names none of {sorted(names)}: {message}"


def listing(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


def cwd_listing() -> set[str]:
    """The working directory's entries, less hypothesis's own cache (.hypothesis/, gitignored), which it
    creates there whatever the example database setting."""
    return listing(Path.cwd()) - {".hypothesis"}


class Quiet:
    """A fixture's value that a falsifying example prints by name, not as 30 kB of OpGraph or plan JSON."""

    def __init__(self, name: str, value):
        self.name, self.value = name, value

    def __repr__(self) -> str:
        return f"<{self.name}>"


# ---- plans ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_texts(meta_gpt_graph) -> Quiet:
    """Plans of every program family: data parallel (ZeRO-3), tensor x pipeline, pipeline x ZeRO-3 data parallel."""
    from partitioner import compile

    pins = {"dp": {"dp": 4, "zero_stage": 3}, "tp_pp": {"tp": 2, "pp": 2}, "pp_dp": {"pp": 2, "dp": 2, "zero_stage": 3}}
    return Quiet("plans", {name: compile(meta_gpt_graph, "local:4", global_batch_size=8, **kw).to_json()
                           for name, kw in pins.items()})


@pytest.fixture(scope="module")
def graph(meta_gpt_graph) -> Quiet:
    return Quiet("meta GPT graph", meta_gpt_graph)


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(),
    st.sampled_from([0, -1, 1, 2, 3, 4, 5, 2**31, 2**63, 2**64 + 1, -(2**63), 10**30, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", "nan", "Infinity", "1f1b", "gpipe", "interleaved-1f1b", "none", "int8", "R", "S(0)",
                     "S(9)", "S(-1)", "intra_node", "\x00", "\ud7ff\U0010ffff", "é" * 40]),
)
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)


@st.composite
def _path(draw, data) -> list:
    """A path into the JSON tree: at least one step down, then each further step with even odds."""
    path, node = [], data
    while isinstance(node, (dict, list)) and node and (not path or draw(st.booleans())):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append(key)
        node = node[key]
    return path


_OPS = ("delete", "replace", "wrap", "stringify", "unknown_key", "truncate", "duplicate", "negate", "huge")


class Mutated:
    """A mutated plan document; its repr is the list of mutations (a failing example prints that, not 30 kB)."""

    def __init__(self, base: str, doc: dict, log: list[str], names: set[str]):
        self.base, self.doc, self.log, self.names = base, doc, log, names

    def __repr__(self) -> str:
        return f"Mutated({self.base!r}: {'; '.join(self.log)})"


@st.composite
def mutated_plan(draw, texts: dict[str, str]) -> Mutated:
    """A real plan's JSON with 1-3 structural mutations; `names` holds the dict keys on the mutated paths (the
    fields a refusal should name)."""
    base = draw(st.sampled_from(sorted(texts)))
    data = json.loads(texts[base])
    named: set[str] = set()
    log: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(_path(data))
        if not path:
            continue
        *head, last = path
        parent = data
        for k in head:
            parent = parent[k]
        named |= {k for k in path if isinstance(k, str)}
        op = draw(st.sampled_from(_OPS))
        value = parent[last]
        if op == "delete":
            if isinstance(parent, dict):
                del parent[last]
            else:
                parent.pop(last)
        elif op == "replace":
            parent[last] = draw(_JSON)
        elif op == "wrap":
            parent[last] = draw(st.sampled_from([[value], {"value": value}, {last if isinstance(last, str) else "x": value}]))
        elif op == "stringify":
            parent[last] = json.dumps(value)
        elif op == "unknown_key":
            target = value if isinstance(value, dict) else parent if isinstance(parent, dict) else None
            if target is not None:
                name = draw(st.text(min_size=1, max_size=10))
                target.setdefault(name, draw(_SCALARS))
                named.add(name)
        elif op == "truncate" and isinstance(value, (list, str)) and value:
            parent[last] = value[:draw(st.integers(0, len(value) - 1))]
        elif op == "duplicate" and isinstance(value, list) and value:
            parent[last] = value + [copy.deepcopy(value[draw(st.integers(0, len(value) - 1))])]
        elif op == "negate" and isinstance(value, (int, float)) and not isinstance(value, bool):
            parent[last] = -value - 1
        elif op == "huge" and isinstance(value, (int, float)) and not isinstance(value, bool):
            parent[last] = draw(st.sampled_from([2**62, 10**19, 1e308, math.inf, -math.inf, math.nan]))
        now = parent[last] if (isinstance(parent, dict) and last in parent) or (
            isinstance(parent, list) and last < len(parent)) else "<gone>"
        log.append(f"{op} {'.'.join(map(str, path))}: {repr(value)[:40]} -> {repr(now)[:60]}")
    return Mutated(base, data, log, named)


def check_plan_text(text: str | bytes, names: set[str] = frozenset()) -> Plan | None:
    """Plan.from_json either refuses with a PartitionerError naming one of `names`, or returns a usable Plan."""
    try:
        plan = Plan.from_json(text)
    except Exception as err:  # noqa: BLE001 - the property is about which exceptions escape
        event(f"refused: {type(err).__name__}")
        assert_refusal(err, names)
        return None
    event("decoded")
    check_usable(plan)
    return plan


def check_usable(plan: Plan) -> None:
    """A plan that decodes can be printed, saved again and turned into every kind of rank program (or its
    generator refuses with a PartitionerError)."""
    assert isinstance(plan, Plan)
    assert Plan.from_json(plan.to_json()) == plan
    str(plan)
    for rank in sorted({0, plan.world_size - 1}):
        try:
            plan.program(rank)
        except Exception as err:  # noqa: BLE001
            assert_refusal(err)


@cases(800)
@given(data=st.data())
def test_mutated_plan_json_decodes_or_names_the_field(plan_texts, data):
    m = data.draw(mutated_plan(plan_texts.value))
    check_plan_text(json.dumps(m.doc), m.names)


@cases(300)
@given(doc=_JSON)
def test_random_json_is_refused_as_a_plan(doc):
    with pytest.raises(PartitionerError) as info:
        Plan.from_json(json.dumps(doc))
    assert_refusal(info.value)


@cases(300)
@given(data=st.data())
def test_truncated_garbled_or_binary_plan_files_are_refused(plan_texts, tmp_path_factory, data):
    text = plan_texts.value[data.draw(st.sampled_from(sorted(plan_texts.value)))]
    kind = data.draw(st.sampled_from(["truncate", "bytes", "splice", "nest", "bigint"]))
    if kind == "truncate":
        blob = text.encode()[:data.draw(st.integers(0, len(text) - 1))]
    elif kind == "bytes":
        blob = data.draw(st.binary(max_size=200))
    elif kind == "splice":  # random bytes (often not UTF-8) in the middle of a real plan
        at = data.draw(st.integers(0, len(text)))
        blob = text.encode()[:at] + data.draw(st.binary(min_size=1, max_size=8)) + text.encode()[at:]
    elif kind == "nest":  # deeper than json's recursion limit
        depth = data.draw(st.integers(10, 100_000))
        blob = (b"[" * depth + b"]" * depth)
    else:  # more digits than int() reads by default
        blob = text.replace('"world_size": 4', '"world_size": ' + "9" * data.draw(st.integers(4000, 6000))).encode()
    root = tmp_path_factory.getbasetemp()
    cwd, before = cwd_listing(), listing(root)
    d = Path(tempfile.mkdtemp(dir=root))
    path = d / "plan.json"
    path.write_bytes(blob)
    try:
        plan = Plan.load(path)
    except Exception as err:  # noqa: BLE001
        assert_refusal(err)
        assert str(path) in str(err)  # which file
    else:
        check_usable(plan)
    assert listing(d) == {"plan.json"} and listing(root) == before | {d.name} and cwd_listing() == cwd
    for text_input in (blob, blob.decode("utf-8", "replace")):  # from_json takes text (or bytes) too
        try:
            Plan.from_json(text_input)
        except Exception as err:  # noqa: BLE001
            assert_refusal(err)


def test_plan_from_json_refuses_what_is_not_text():
    for value in (None, 3, ["{}"], {"version": 1}):
        with pytest.raises(PartitionerError, match="plan: expected the plan's JSON text"):
            Plan.from_json(value)


def test_compiled_plans_pass_the_checks(meta_gpt_graph):
    """The other direction: what compile produces always decodes (plan_check is not stricter than the planner)."""
    from partitioner import compile

    for topology, pins in [("local:4", {}), ("local:4", {"pp": 4, "schedule": "gpipe"}), ("local:2", {"tp": 2}),
                           ("local:4", {"pp": 2, "schedule": "interleaved-1f1b", "interleave": 2}),
                           ("2x4xA100-80GB", {"dp": 2, "tp": 2, "pp": 2, "zero_stage": 1}),
                           ("2x4xA100-80GB", {"compression": "int8", "dp": 8}), ("1xH100", {}),
                           ("local:4", {"async_sgd": {"every": 2}, "precision": "fp32"})]:
        plan = compile(meta_gpt_graph, topology, global_batch_size=16, **pins)
        assert Plan.from_json(plan.to_json()) == plan, (topology, pins)


def test_plan_save_writes_only_the_path_given(plan_texts, tmp_path):
    plan = Plan.from_json(plan_texts.value["tp_pp"])
    (tmp_path / "plan.json.tmp").write_text("a user's own file")  # the old fixed temporary name: left alone
    assert plan.save(tmp_path / "plan.json") == tmp_path / "plan.json"
    assert listing(tmp_path) == {"plan.json", "plan.json.tmp"} and Plan.load(tmp_path / "plan.json") == plan
    assert (tmp_path / "plan.json.tmp").read_text() == "a user's own file"
    for bad in (tmp_path / "no" / "dir" / "plan.json", tmp_path / "plan.json.tmp" / "x.json", tmp_path):
        with pytest.raises(PartitionerError, match="cannot write it") as info:
            plan.save(bad)
        assert str(bad) in str(info.value)
    assert listing(tmp_path) == {"plan.json", "plan.json.tmp"}  # no temporary left behind by a failed save


# ---- topologies -----------------------------------------------------------------------------------------

_INTS = st.one_of(st.integers(-3, 20), st.sampled_from([2**31, 10**30, -(10**30)]),
                  st.sampled_from(["0", "-1", "²", "٣", "1_0", " 4", "0x8", "1e3", "", "08"]))
_DEVICES = st.one_of(st.sampled_from(["A100-80GB", "h100", "H100-80GB", "CPU", "cpu", "v100-32gb", "H200",
                                      "A100", "tpu", "", "x", "A100-80GB[custom]"]), st.text(max_size=10))
_LINK_FIELDS = ("intra_node_GBps", "inter_node_GBps", "intra_node_latency_us", "inter_node_latency_us")


@st.composite
def topology_string(draw) -> str:
    kind = draw(st.sampled_from(["shape", "local", "random", "long"]))
    if kind == "random":
        return draw(st.text(max_size=40))
    if kind == "long":
        return draw(st.sampled_from(["x", "4x", "local:", "8xH100,", "/"])) * draw(st.integers(100, 6000))
    if kind == "local":
        head = f"{draw(st.sampled_from(['local', 'LOCAL', 'local ', 'lokal']))}:{draw(_INTS)}"
    else:
        parts = [str(draw(_INTS)) for _ in range(draw(st.integers(1, 3)))] + [draw(_DEVICES)]
        head = draw(st.sampled_from(["x", "X", " x ", "*", "x-"])).join(parts)
    overrides = [f"{draw(st.sampled_from(_LINK_FIELDS + ('nodes', 'bogus', '')))}"
                 f"{draw(st.sampled_from(['=', ':', '==', '']))}"
                 f"{draw(st.one_of(st.sampled_from(['25', '0', '-1', 'nan', 'inf', '1e400', '', 'x', '1_000']), st.text(max_size=5)))}"
                 for _ in range(draw(st.integers(0, 2)))]
    return ",".join([head, *overrides])


def check_topology(spec, names: set[str] = frozenset()) -> Topology | None:
    try:
        topo = Topology.coerce(spec)
    except Exception as err:  # noqa: BLE001 - the property is about which exceptions escape
        event(f"refused: {type(err).__name__}")
        assert isinstance(err, TopologyError), f"{type(err).__name__}: {err}"
        assert_refusal(err, names)
        return None
    event("accepted")
    assert topo.world_size >= 1 and Topology.from_dict(topo.to_dict()) == topo
    if "[custom]" not in str(topo):  # a device that is not a preset prints as NAME[custom], which does not parse
        assert Topology.coerce(str(topo)) == topo
    return topo


@cases(1000)
@given(text=topology_string())
def test_topology_strings_parse_or_name_the_problem(text):
    check_topology(text)


def _valid_topology_dict(draw) -> dict:
    return draw(st.sampled_from([
        {"nodes": 2, "devices_per_node": 8, "device": "A100-80GB", "inter_node_GBps": 25},
        {"nodes": 1, "devices_per_node": 4, "device": "CPU", "local": True},
        {"nodes": 1, "devices_per_node": 2, "device": Topology.parse("1xH100").device.to_dict()},
    ]))


@st.composite
def mutated_topology_dict(draw) -> tuple[dict, set[str]]:
    d = copy.deepcopy(_valid_topology_dict(draw))
    names: set[str] = set()
    for _ in range(draw(st.integers(1, 3))):
        target = d["device"] if isinstance(d.get("device"), dict) and draw(st.booleans()) else d
        key = draw(st.sampled_from(sorted(target) + ["bogus", *_LINK_FIELDS]))
        names |= {key} if target is d else {key, "device"}
        op = draw(st.sampled_from(["delete", "replace", "number"]))
        if op == "delete":
            target.pop(key, None)
        elif op == "replace":
            target[key] = draw(_JSON)
        else:
            target[key] = draw(st.one_of(st.integers(), st.floats(), st.sampled_from([10**400, 2**64, -1, 0]),
                                         st.dictionaries(st.sampled_from(["bf16", "fp32", "fp9", "torch.float16"]),
                                                         st.one_of(st.floats(), st.integers(), st.text(max_size=4)))))
    return d, names


@cases(800)
@given(case=mutated_topology_dict())
def test_topology_dicts_build_or_name_the_field(case):
    d, names = case
    check_topology(d, names)


@cases(400)
@given(data=st.data())
def test_topology_files_read_or_name_the_problem(tmp_path_factory, data):
    suffix = data.draw(st.sampled_from([".json", ".yaml", ".yml", ".JSON", ".txt", ""]))
    kind = data.draw(st.sampled_from(["dict", "random json", "text", "bytes", "yaml tags"]))
    if kind == "dict":
        d, _ = data.draw(mutated_topology_dict())
        blob = json.dumps(d).encode()
    elif kind == "random json":
        blob = json.dumps(data.draw(_JSON)).encode()
    elif kind == "text":
        blob = data.draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")
    elif kind == "bytes":
        blob = data.draw(st.binary(max_size=200))
    else:  # YAML's own syntax: anchors, tags, nesting, numbers it reads as strings
        blob = data.draw(st.sampled_from([
            b"nodes: !!python/object:os.system ls\n", b"nodes: &a [*a]\n", b"a: &x 1\nb: *y\n",
            b"nodes: 1\ndevices_per_node: 312e12\ndevice: CPU\n", b"[" * 5000, b"nodes: 2\n" * 3,
            b"nodes: 1\ndevices_per_node: 2\ndevice: {name: t, peak_flops: {bf16: 1e12}}\n",
            b"nodes: .nan\ndevices_per_node: .inf\ndevice: CPU\n", b"\xef\xbb\xbfnodes: 1\n", b"- 1\n- 2\n",
            b"nodes: 1\ndevices_per_node: 2\ndevice: CPU\nintra_node_GBps: 1" + b"0" * 5000 + b"\n"]))
    root = tmp_path_factory.getbasetemp()
    cwd, before = cwd_listing(), listing(root)
    d = Path(tempfile.mkdtemp(dir=root))
    path = d / f"topology{suffix}"
    path.write_bytes(blob)
    topo = check_topology(path)
    if suffix in (".json", ".yaml", ".yml"):  # a string naming the file reads it too, with the same outcome
        assert check_topology(str(path)) == topo
    assert listing(d) == {path.name} and listing(root) == before | {d.name} and cwd_listing() == cwd


def test_topology_refuses_unicode_digits_and_unreadable_paths(tmp_path):
    for text in ("local:²", "²x8xH100", "8xH100,intra_node_GBps=²"):
        with pytest.raises(TopologyError):
            Topology.parse(text)
    with pytest.raises(TopologyError, match="cannot be read"):
        Topology.coerce(str(tmp_path / ("x" * 300 + ".json")))  # a name longer than the filesystem allows


# ---- compile() declarations -----------------------------------------------------------------------------

_ANY = st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=6), st.lists(st.integers(), max_size=2),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
_WRONG_INT = st.one_of(st.integers(-2, 0), st.sampled_from([3, 5, 16, 2**31, 10**30, 2.0]), _ANY)


def _choice(*valid: str):
    return st.sampled_from(valid)


# Per keyword: (a value the planner may accept, a value it should refuse). Each keyword given is garbage one
# time in four, so that whole searches run often too.
_DECLARATIONS = {
    "dp": (st.sampled_from([1, 2, 4, 8]), _WRONG_INT),
    "tp": (st.sampled_from([1, 2, 4]), _WRONG_INT),
    "pp": (st.sampled_from([1, 2, 4]), _WRONG_INT),
    "zero_stage": (st.integers(0, 3), st.one_of(st.sampled_from([-1, 4, 1.0]), _ANY)),
    "microbatch_size": (st.sampled_from([1, 2, 4, 8]), _WRONG_INT),
    "interleave": (st.sampled_from([1, 2]), _WRONG_INT),
    "schedule": (st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]), st.one_of(
        st.sampled_from(["1F1B", "zb", ""]), _ANY)),
    "recompute": (st.sampled_from(["none", "selective", "full"]), st.one_of(st.sampled_from(["all", "None"]), _ANY)),
    "global_batch_size": (st.sampled_from([8, 16, 32, 12]), st.one_of(
        st.sampled_from([0, -1, 7, 2**40, 10**30, 8.0, True]), _ANY)),
    "precision": (st.sampled_from(["fp32", "bf16-mixed", "fp16-mixed"]), st.one_of(
        st.sampled_from(["bf16", "fp8"]), _ANY)),
    "optimizer": (st.sampled_from(["adam", "adamw", "sgd"]), st.one_of(st.sampled_from(["lamb", "Adam"]), _ANY)),
    "compression": (st.one_of(st.sampled_from(["none", "bf16", "int8", "int4", "powersgd"]), st.fixed_dictionaries(
        {}, optional={"intra_node": st.sampled_from(["none", "int8"]), "inter_node": st.sampled_from(
            ["none", "int8", "powersgd"])})), st.one_of(
        st.sampled_from(["topk", "INT8"]), _ANY, st.dictionaries(
            st.sampled_from(["intra_node", "inter_node", "same_device", "x"]), _ANY, max_size=2))),
    "compression_warmup": (st.integers(0, 10), st.one_of(st.just(-1), _ANY)),
    "clip_grad_norm": (st.sampled_from([None, 1.0, 0.5, 2]), st.one_of(
        st.sampled_from([0, -1.0, math.nan, math.inf, 10**400, True, "1.0"]), _ANY)),
    "max_memory_fraction": (st.sampled_from([0.9, 0.5, 1, 1e-6]), st.one_of(
        st.sampled_from([0, 1.5, -0.1, math.nan, math.inf, 10**400, "0.9"]), _ANY)),
}


@st.composite
def declarations(draw, calibration_files: Quiet) -> dict:
    """compile()'s keywords, each left out, plausible, or garbage (one time in four)."""
    chosen = draw(st.lists(st.sampled_from([*_DECLARATIONS, "calibration"]), unique=True, max_size=6))
    kw = {}
    for k in chosen:
        if k == "calibration":  # good, missing, a directory, not JSON, ... or not a path at all
            kw[k] = draw(st.one_of(st.sampled_from(sorted(calibration_files.value.values())), _ANY))
        else:
            good, bad = _DECLARATIONS[k]
            kw[k] = draw(bad if draw(st.integers(0, 3)) == 0 else good)
    kw.setdefault("global_batch_size", 8)
    return kw


@pytest.fixture(scope="module")
def calibration_files(tmp_path_factory) -> Quiet:
    """Calibration paths a user might pass: good, missing, a directory, not JSON, not UTF-8, the wrong JSON."""
    from cost_models.calibration import Calibration

    d = tmp_path_factory.mktemp("calibrations")
    Calibration.for_device("CPU").save(d / "good.json")
    files = {"good": d / "good.json", "missing": d / "missing.json", "directory": d,
             "not_json": d / "bad.json", "binary": d / "binary.json", "list": d / "list.json",
             "unknown_key": d / "unknown.json", "bad_value": d / "bad_value.json", "huge": d / "huge.json"}
    files["not_json"].write_text("{matmul_eff_max: 0.5")
    files["binary"].write_bytes(b"\xff\xfe\x00garbage\x80")
    files["list"].write_text("[1, 2]")
    files["unknown_key"].write_text('{"matmul_eff_maxx": 0.5}')
    files["bad_value"].write_text('{"matmul_eff_max": NaN, "dp_overlap": "high"}')
    files["huge"].write_text('{"device_speed": 1' + "0" * 5000 + "}")
    return Quiet("calibration files", {k: str(v) for k, v in files.items()})


_TOPOLOGIES = ("local:4", "local:1", "local:3", "2x4xA100-80GB", "1xH100")


@cases(500)
@given(data=st.data())
def test_compile_declarations_plan_or_name_the_declaration(graph, calibration_files, data):
    from partitioner import compile

    topology = data.draw(st.sampled_from(_TOPOLOGIES))
    kw = data.draw(declarations(calibration_files))
    cwd = cwd_listing()
    try:
        plan = compile(graph.value, topology, alternatives=1, **kw)
    except Exception as err:  # noqa: BLE001 - the property is about which exceptions escape
        event(f"refused: {type(err).__name__}")
        # the message names one of the declarations given (or the calibration file's own field)
        assert_refusal(err, set(kw) | {"calibration", "Calibration", "no plan fits", "no configuration"})
    else:
        event("planned")
        for k in ("dp", "tp", "pp", "zero_stage", "microbatch_size", "schedule", "recompute"):
            # a pin is honoured (one pipeline stage runs any schedule as gradient accumulation, named 1f1b)
            if kw.get(k) is not None and not (k == "schedule" and plan.pp == 1):
                assert getattr(plan, k) == kw[k], k
        assert Plan.from_json(plan.to_json()) == plan
    assert cwd_listing() == cwd


# ---- what the fuzzers found, pinned down ------------------------------------------------------------------


def _plan_with(plan_texts: Quiet, edit) -> str:
    doc = json.loads(plan_texts.value["pp_dp"])
    edit(doc)
    return json.dumps(doc)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(mesh=d["mesh"][:1]), "plan.mesh"),  # was a KeyError in codegen
    (lambda d: d.update(stages=[]), "plan.stages"),  # was max() of an empty sequence in print(plan)
    (lambda d: d.update(bucket_bytes=-1), "plan.bucket_bytes"),  # was runtime.engines.flat's ValueError
    (lambda d: d.update(world_size=2**31), "plan.world_size"),  # was an IndexError in codegen
    (lambda d: d["config"].update(zero_stage=-4), "plan.config.zero_stage"),  # was a KeyError in codegen
    (lambda d: d["predicted"].update(step_time_s=10**400), "plan.predicted.step_time_s"),  # OverflowError
    (lambda d: d["predicted"].update(mfu=math.nan), "plan.predicted.mfu"),
    (lambda d: d.update(async_sgd={"every": 0}), "plan.async_sgd"),
])
def test_inconsistent_plans_name_the_field(plan_texts, edit, field):
    with pytest.raises(PartitionerError, match=field.replace(".", r"\.")):
        Plan.from_json(_plan_with(plan_texts, edit))


@pytest.mark.parametrize("blob, why", [
    (b"\xff\xfe\x00{", "not UTF-8|not JSON"), (b"[" * 100_000 + b"]" * 100_000, "RecursionError"),
    (b'{"version": 1, "world_size": ' + b"9" * 5000 + b"}", "ValueError"),
])
def test_plan_files_python_cannot_parse_are_refused(tmp_path, blob, why):
    (tmp_path / "plan.json").write_bytes(blob)
    with pytest.raises(PartitionerError, match=why):
        Plan.load(tmp_path / "plan.json")


@pytest.mark.parametrize("spec, field", [
    ({"nodes": 1, "devices_per_node": 2, "device": "CPU", "intra_node_GBps": 10**400}, "intra_node_GBps"),
    ({"nodes": 10**30, "devices_per_node": 8, "device": "H100"}, "nodes"),  # the planner would never finish
    ({"nodes": 1, "devices_per_node": 2, "device": {**Topology.parse("1xH100").device.to_dict(),
                                                     "peak_flops": {"": 1e12}}}, "peak_flops"),
    ({"nodes": 1, "devices_per_node": 2, "device": {**Topology.parse("1xH100").device.to_dict(),
                                                     "hbm_bytes_per_s": 10**400}}, "hbm_bytes_per_s"),
])
def test_topology_numbers_out_of_range_name_the_field(spec, field):
    with pytest.raises(TopologyError, match=field):
        Topology.coerce(spec)


@pytest.mark.parametrize("blob", [b"\xff\xfe\x00garbage", b'{"nodes": ' + b"1" * 5000 + b"}"])
def test_topology_files_python_cannot_parse_are_refused(tmp_path, blob):
    (tmp_path / "t.json").write_bytes(blob)
    with pytest.raises(TopologyError, match="t.json"):
        Topology.coerce(tmp_path / "t.json")


def test_compile_refusals_found_by_fuzzing(meta_gpt_graph, calibration_files):
    from partitioner import compile
    from partitioner.planner.declarations import MAX_MICROBATCHES

    files = calibration_files.value
    for kw, message in [({"calibration": files["directory"]}, "cannot be read"),  # was IsADirectoryError
                        ({"calibration": files["binary"]}, "not valid JSON"),  # was UnicodeDecodeError
                        ({"calibration": files["huge"]}, "not valid JSON"),  # was ValueError (int digits)
                        ({"calibration": 3}, "calibration=3"),  # was an AttributeError deep in the search
                        ({"clip_grad_norm": math.inf}, "clip_grad_norm=inf"),  # compiled, then refused on load
                        ({"global_batch_size": 10**30}, "global_batch_size"),  # divisors() ran for ever
                        ({"global_batch_size": 2**20, "microbatch_size": 1, "dp": 1, "pp": 4},
                         f"more than the {MAX_MICROBATCHES}")]:  # a schedule of a million microbatches
        with pytest.raises(PartitionerError, match=message):
            compile(meta_gpt_graph, "local:4", **{"global_batch_size": 8, **kw})
    assert compile(meta_gpt_graph, "local:4", global_batch_size=8, calibration=Path(files["good"]), alternatives=0)
