"""Issue 8: elastic re-planning reuses the cached trace (partitioner.tracer.cache).

A trace read back from disk must plan exactly as the live one: same OpGraph, same fingerprint (plans and
checkpoints are tied to it), same plans and the same generated rank programs (code generation reads the
ExportedProgram kept beside the OpGraph).
"""

from __future__ import annotations

import json
import shutil

import pytest

from partitioner.compile import compile
from partitioner.loading import load_model
from partitioner.tracer.trace import trace
from partitioner.tracer.cache import _FORMAT, load_trace, save_trace, source_key

SPEC = "examples/gpt.py:gpt_tiny"


@pytest.fixture(scope="module")
def traced():
    model, inputs, _ = load_model(SPEC, device="meta", batch_size=2)
    return trace(model, inputs[:1])


@pytest.fixture
def cached(traced, tmp_path):
    key = source_key(SPEC)
    assert save_trace(traced, tmp_path / "trace", key)
    return tmp_path / "trace", key


def test_the_cached_trace_is_the_trace(traced, cached):
    g = load_trace(*cached)
    assert g == traced and g.fingerprint() == traced.fingerprint()
    assert [n.cost for n in g.nodes] == [n.cost for n in traced.nodes]


@pytest.mark.parametrize("pins", [{"pp": 2, "tp": 2}, {"dp": 3}, {}])
def test_plans_and_programs_from_the_cache_equal_those_from_the_live_trace(traced, cached, pins):
    world = 3 if pins.get("dp") == 3 else 4
    kw = dict(global_batch_size=12, precision="fp32", **pins)
    live, again = compile(traced, f"local:{world}", **kw), compile(load_trace(*cached), f"local:{world}", **kw)
    assert again.config == live.config and again.predicted == live.predicted
    assert [again.program(r).source for r in range(world)] == [live.program(r).source for r in range(world)]


def test_another_model_source_misses(traced, cached, tmp_path):
    d, _ = cached
    assert load_trace(d, source_key("examples/gpt.py:gpt_small")) is None
    edited = tmp_path / "gpt_copy.py"
    shutil.copy("examples/gpt.py", edited)
    before = source_key(f"{edited}:gpt_tiny")
    edited.write_text(edited.read_text() + "\n# edited\n")
    assert source_key(f"{edited}:gpt_tiny") != before  # an edited model is traced again
    assert source_key("examples.gpt:gpt_tiny") == source_key("examples.gpt:gpt_tiny")


def test_a_damaged_entry_is_a_miss_not_an_error(cached):
    d, key = cached
    (d / "graph.pt2").write_bytes(b"not an archive")
    with pytest.warns(UserWarning, match="unreadable.*tracing again"):
        assert load_trace(d, key) is None
    (d / "opgraph.json").write_text("{")
    assert load_trace(d, key) is None
    (d / "opgraph.json").write_text(json.dumps({"format": _FORMAT, "key": key, "graph": {"nodes": 3}}))
    with pytest.warns(UserWarning):
        assert load_trace(d, key) is None
    assert load_trace(d.parent / "nothing-here", key) is None


def test_saving_again_replaces_the_entry_whole(traced, cached):
    d, _ = cached
    assert save_trace(traced, d, "another-key")
    assert load_trace(d, "another-key") == traced
    assert sorted(p.name for p in d.parent.iterdir()) == ["trace"]  # no temporary left behind


def test_an_fx_trace_is_not_cached(traced, tmp_path):
    import dataclasses
    fx_like = dataclasses.replace(traced, graph_module=None)
    assert not save_trace(fx_like, tmp_path / "trace", "k") and not (tmp_path / "trace").exists()
