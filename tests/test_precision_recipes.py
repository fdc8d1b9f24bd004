"""Precision recipes users run, as the planner sees them: pure bf16, the gradient reduction's dtype, Megatron's
distributed optimizer. Their bytes per parameter written out by hand, their bytes on the wire, the plan that
records them, and the refusals of contradictions (before any search). Run for real: test_precision_runs.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cost_models.comm import CommModel
from cost_models.compression import all_reduce_time, reduce_scatter_time
from cost_models.errors import DeclarationError
from cost_models.memory import ModelStateBytes, model_state_bytes
from cost_models.topology import Topology
from partitioner import compile
from partitioner.planner.declarations import Declarations, reduction_pins
from partitioner.planner.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
P = 1000.0  # parameters of a rank, before ZeRO


# --- bytes per parameter ---------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer,params,grads,state", [
    ("adam", 2, 2, 2 + 2),        # bf16 weights, bf16 grads, Adam's m and v in bf16; no fp32 master
    ("sgd-momentum", 2, 2, 2),    # one bf16 momentum buffer
    ("sgd", 2, 2, 0)])
def test_pure_bf16_bytes_per_parameter(optimizer, params, grads, state):
    s = model_state_bytes(P, precision="bf16", optimizer=optimizer, zero_stage=0, dp=4)
    assert s == ModelStateBytes(params=P * params, grads=P * grads, optimizer=P * state)


@pytest.mark.parametrize("stage,per_param", [
    (0, 2 + 2 + 4),               # 8 B: half of mixed precision's 16
    (1, 2 + 2 + 4 / 4),           # Adam state sharded over dp = 4
    (2, 2 + 2 / 4 + 4 / 4),       # + gradients
    (3, (2 + 2 + 4) / 4)])        # + parameters
def test_pure_bf16_under_zero(stage, per_param):
    s = model_state_bytes(P, precision="bf16", optimizer="adam", zero_stage=stage, dp=4)
    assert s.total == pytest.approx(P * per_param)


@pytest.mark.parametrize("dp", [2, 8, 64])
def test_distributed_optimizer_is_zero_1_of_mixed_precision(dp):
    """Megatron's distributed optimizer: 16-bit parameters and gradients replicated (2 + 2), the fp32 master (4)
    and Adam's m and v (8) sharded: 4 + 12/dp bytes per parameter (ZeRO paper, P_os). The planner charges the
    engine's fp32 gradients on top (6 + 12/dp, Megatron's figure: test_precision_runs measures it)."""
    s = model_state_bytes(P, precision="bf16-mixed", optimizer="adam", zero_stage=1, dp=dp)
    assert (s.params, s.grads, s.optimizer) == (P * 2, P * 2, pytest.approx(P * 12 / dp))


# --- bytes on the wire -----------------------------------------------------------------------------
def test_uncompressed_bf16_gradients_send_half_the_bytes():
    """Pure bf16's gradients go on the wire as they are, 2 bytes an element: the fp32 reduction of n elements
    costs what a bf16 one of 2n does."""
    cm = CommModel(Topology.parse("1x8xH100-80GB"))
    ranks, n = range(8), 1e8
    none = {"intra_node": "none", "inter_node": "none"}
    bf16 = all_reduce_time(n, ranks, cm, none, reduce_bytes=2)
    assert bf16.wire_s == pytest.approx(cm.all_reduce(2 * n, ranks))
    assert bf16.wire_s == pytest.approx(all_reduce_time(n / 2, ranks, cm, none).wire_s)
    assert reduce_scatter_time(n, ranks, cm, "none", reduce_bytes=2).wire_s == pytest.approx(
        cm.reduce_scatter(2 * n, ranks))


def test_grad_reduce_dtype_pins_the_compressor_of_every_level():
    d = Declarations(global_batch_size=8, grad_reduce_dtype="fp32")
    assert reduction_pins(d) == {"intra_node": "none", "inter_node": "none"}
    assert reduction_pins(Declarations(global_batch_size=8, compression={"inter_node": "int8"})) == \
        {"inter_node": "int8"}


# --- plans -----------------------------------------------------------------------------------------
def _plan(g, **kw) -> Plan:
    return compile(g, "2x2xH100-80GB", global_batch_size=8, alternatives=0, dp=4, tp=1, pp=1, **kw)


def test_plans_of_each_recipe(meta_gpt_graph):
    mixed = _plan(meta_gpt_graph, zero_stage=0, compression="none")
    pure = _plan(meta_gpt_graph, zero_stage=0, precision="bf16")
    reduced = _plan(meta_gpt_graph, zero_stage=0, grad_reduce_dtype="bf16")
    distributed = _plan(meta_gpt_graph, optimizer_layout="distributed")
    # pure bf16 against bf16-mixed: 2 B of parameters as 2, 2 B of gradients against the engine's 4 of fp32, 4 B
    # of bf16 Adam state against 12 of fp32 master and state; half the gradient bytes on the wire. (The
    # gradients' other terms, one parameter's gradient as autograd forms it, are 16-bit in both.)
    p, m = pure.predicted.memory, mixed.predicted.memory
    assert (p.params, p.optimizer) == (m.params, pytest.approx(m.optimizer / 3))
    assert m.grads - p.grads == pytest.approx(p.params)  # 2 B more per parameter: fp32 against bf16
    assert pure.compression == {"intra_node": "none", "inter_node": "none"}
    for level in ("intra_node", "inter_node"):
        assert pure.predicted.bytes_per_link[level] == pytest.approx(mixed.predicted.bytes_per_link[level] / 2)
        assert reduced.predicted.bytes_per_link[level] == pytest.approx(mixed.predicted.bytes_per_link[level] / 2)
    # bf16 reduction: the same model state as fp32's (gradients accumulate in the same fp32 buffers; the
    # compressor's bf16 copy of what it reduces comes on top), bf16 on both levels
    r, m = reduced.predicted.memory, mixed.predicted.memory
    assert (r.params, r.optimizer) == (m.params, m.optimizer) and r.grads >= m.grads
    assert reduced.compression == {"intra_node": "bf16", "inter_node": "bf16"}
    assert distributed.config.zero_stage == 1
    assert str(pure).splitlines()[0].endswith("bf16 (pure), adam")
    assert "bf16-mixed, bf16 gradient reduction, adam" in str(reduced).splitlines()[0]
    assert "bf16-mixed, distributed optimizer, adam" in str(distributed).splitlines()[0]
    back = Plan.from_json(distributed.to_json())
    assert back.declarations["optimizer_layout"] == "distributed" and back.declarations["zero_stage"] == 1
    assert Plan.from_json(reduced.to_json()).declarations["grad_reduce_dtype"] == "bf16"


# --- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(optimizer_layout="distributed", zero_stage=0), r"optimizer_layout='distributed' with zero_stage=0: .*"
                                                         r"pin zero_stage=1, or drop one"),
    (dict(optimizer_layout="distributed", zero_stage=2), r"zero_stage=2 shards more"),
    (dict(optimizer_layout="replicated", zero_stage=1), r"optimizer_layout='replicated' with zero_stage=1"),
    (dict(optimizer_layout="sharded"), r"optimizer_layout='sharded': must be one of 'replicated', 'distributed'"),
    (dict(grad_reduce_dtype="fp16"), r"grad_reduce_dtype='fp16': must be one of 'fp32', 'bf16'"),
    (dict(precision="fp32", grad_reduce_dtype="bf16"), r"precision='fp32' holds fp32 gradients.*compression='bf16'"),
    (dict(precision="bf16", grad_reduce_dtype="fp32"), r"precision='bf16' holds bf16 gradients.*'bf16-mixed'"),
    (dict(grad_reduce_dtype="bf16", compression={"inter_node": "int8"}), r"says \{'inter_node': 'int8'\}"),
    (dict(grad_reduce_dtype="fp32", compression="bf16"), r"grad_reduce_dtype='fp32' with compression"),
    (dict(grad_reduce_dtype="bf16", compression_warmup=3), r"warm-up would reduce the first steps in fp32")])
def test_contradictions_are_refused_before_the_search(meta_gpt_graph, kw, match):
    with pytest.raises(DeclarationError, match=match):
        compile(meta_gpt_graph, "local:2", global_batch_size=8, **kw)


def test_cli_carries_the_recipe(tmp_path):
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "partitioner", "compile", "examples/gpt.py:gpt_tiny", "--topology",
                        "local:2", "--global-batch-size", "8", "--grad-reduce-dtype", "bf16", "--optimizer-layout",
                        "distributed", "-o", out], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "bf16-mixed, bf16 gradient reduction, distributed optimizer" in " ".join(r.stdout.split())  # wrapped
    doc = json.loads(out.read_text())
    assert doc["declarations"]["grad_reduce_dtype"] == "bf16" and doc["config"]["zero_stage"] == 1
