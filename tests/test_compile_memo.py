"""compile() keeps what it derives from a graph alone (partitioner.compile._derived): a graph compiled again
gives the same plan without cutting its code again, and a graph that cannot be cut is refused again."""

import importlib

import pytest

from examples import gpt
from partitioner import compile, trace

compile_module = importlib.import_module("partitioner.compile")  # the package's `compile` is the function


def _tiny():
    m = gpt.gpt_tiny()
    return trace(m, gpt.example_batch(m, 2)[:1])


def test_a_graph_compiled_again_gives_the_same_plan_and_cuts_its_code_once(monkeypatch):
    cuts = []
    real = compile_module.extract
    monkeypatch.setattr(compile_module, "extract", lambda *a, **kw: cuts.append(kw) or real(*a, **kw))
    g = _tiny()
    pins = dict(global_batch_size=8, precision="fp32", pp=2, tp=2, microbatch_size=2)
    first = compile(g, "local:4", **pins)
    n = len(cuts)
    assert n >= 2 and any(kw["tp"] == 2 for kw in cuts)  # the limits at tp 1 and 2, the plan's code
    again = compile(g, "local:4", **pins)
    assert len(cuts) == n and again.to_json() == first.to_json()
    # another degree's code is cut once, when first asked for
    other = compile(g, "local:4", **{**pins, "pp": 1, "tp": 4, "microbatch_size": 4})
    assert other.config.tp == 4 and len(cuts) == n + 1
    assert compile(_tiny(), "local:4", **pins).to_json() == first.to_json()  # as a graph traced anew


def test_a_graph_whose_code_cannot_be_cut_is_refused_each_time(monkeypatch):
    def no_cut(*a, **kw):
        raise compile_module.SegmentError("no stack to cut")

    monkeypatch.setattr(compile_module, "extract", no_cut)
    g = _tiny()
    for _ in range(2):
        with pytest.raises(Exception, match="pp=2: no per-rank program can be generated .*no stack to cut"):
            compile(g, "local:2", global_batch_size=8, precision="fp32", pp=2)
