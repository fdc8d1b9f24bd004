"""Generated stage code names no device: a plan compiled from a model on the CPU, on the meta device
(the 175B-on-a-laptop flow, partitioner.elastic's cached trace) or traced for CUDA runs where its
activations are. In one process, no process group; the runs themselves are in test_3d_equivalence
(every case compiled from meta too) and test_verify_faults."""

from __future__ import annotations

import pytest
import torch

from examples.training import gpt_4l_seeded, hf_gpt2_4l_seeded, hf_llama_seeded
from partitioner import compile, trace

VOCAB, SEQ = 256, 16


def _traced(model_fn, on: str):
    with torch.device(on):
        model = model_fn()
    return trace(model, (torch.randint(0, VOCAB, (2, SEQ), device=on),))


def _code(g) -> list[str]:
    """The model code of the first and last rank's programs of a pp2 tp2 plan, without the plan's hashes."""
    plan = compile(g, "local:4", global_batch_size=8, precision="fp32", pp=2, tp=2, dp=1, microbatch_size=2,
                   alternatives=0)
    return [line for r in (0, 3) for line in plan.program(r).source.splitlines()
            if "HASH" not in line and not line.startswith("Plan ")]


def _as_if_traced_on_cuda(g):
    """The CPU trace with every tensor factory's device set to cuda:0, as a trace on a GPU records them."""
    swapped = 0
    for node in g.graph_module.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device):
            node.kwargs = {**node.kwargs, "device": torch.device("cuda", 0)}
            swapped += 1
    assert swapped, "the example GPT makes its positions with arange(device=...): the trace changed"
    return g


def test_the_same_code_from_a_model_on_cpu_on_meta_or_traced_for_cuda():
    cpu = _code(_traced(gpt_4l_seeded, "cpu"))
    assert not any("device(type=" in line for line in cpu)
    assert _code(_traced(gpt_4l_seeded, "meta")) == cpu
    assert _code(_as_if_traced_on_cuda(_traced(gpt_4l_seeded, "cpu"))) == cpu


@pytest.mark.parametrize("model_fn", [hf_gpt2_4l_seeded, hf_llama_seeded], ids=["hf-gpt2", "hf-llama"])
def test_hugging_face_code_traced_on_meta_names_no_device(model_fn):
    """(torch.export numbers some nodes differently for these on meta and on CPU, so the texts are not compared.)"""
    code = _code(_traced(model_fn, "meta"))
    assert not any("device(type=" in line for line in code), [line for line in code if "device(type=" in line][:3]
