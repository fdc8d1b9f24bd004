"""What each recompute mode runs again in backward (runtime.engines.recompute), and that the planner charges the same.

A block of five bias-free linears around a fused causal attention, run under each mode: the backward's matrix products
and attention kernels are counted at dispatch. "selective-op" (torchtitan's per-op policy) reruns every second
product, the second and fourth here, and never the attention; "selective" reruns no product but the attention;
"full" reruns the whole forward. The gradients are the same in every mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from partitioner import Topology, compile
from runtime.engines.recompute import run_recomputed

H, S, HEADS = 32, 16, 4
PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(H, H, bias=False) for _ in range(4))
        self.up = torch.nn.Linear(H, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, HEADS, H // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, H)
        y = x + self.o(a)
        return y + torch.relu(self.up(y))


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.products = self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.products += func in PRODUCTS
        self.attention += "scaled_dot_product" in func.__name__ and "backward" not in func.__name__
        return func(*args, **(kwargs or {}))


def _backward(mode: str, s: int = S):
    torch.manual_seed(0)
    block, x = Block(), torch.randn(2, s, H, requires_grad=True)
    loss = run_recomputed(mode, block, x).square().sum()
    with _Count() as seen:
        loss.backward()
    return seen, [p.grad for p in block.parameters()] + [x.grad]


def test_each_mode_reruns_what_it_says():
    seen = {mode: _backward(mode) for mode in ("none", "selective", "selective-op", "full")}
    base = seen["none"][0]
    assert base.attention == 0 and base.products >= 10  # two products per linear's backward
    extra = {mode: (s.products - base.products, s.attention) for mode, (s, _) in seen.items()}
    assert extra == {"none": (0, 0), "selective": (0, 1), "selective-op": (2, 0), "full": (5, 1)}, extra
    for mode, (_, grads) in seen.items():
        for got, want in zip(grads, seen["none"][1]):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=mode)


PINS = dict(global_batch_size=16, dp=2, pp=1, tp=1, zero_stage=1, microbatch_size=4, precision="fp32")


def test_the_planner_orders_the_modes_as_they_run(meta_gpt_graph):
    """More recomputation, more time and less memory: none, selective, selective-op, full; where selective does
    not fit and selective-op does, the search takes it over full."""
    plans = {r: compile(meta_gpt_graph, "local:2", recompute=r, **PINS)
             for r in ("none", "selective", "selective-op", "full")}
    times = [p.predicted.step_time_s for p in plans.values()]
    kept = [p.predicted.memory.activations for p in plans.values()]
    assert times == sorted(times) and len(set(times)) == 4, times
    assert kept == sorted(kept, reverse=True) and len(set(kept)) == 4, kept
    assert "selective-op: fused attention's and every second matrix product's" in str(plans["selective-op"])
    peak = {r: p.predicted.memory.total for r, p in plans.items()}
    between = (peak["selective"] + peak["selective-op"]) / 2
    room = between / Topology.parse("local:2").device.memory_bytes
    free = compile(meta_gpt_graph, "local:2", max_memory_fraction=room, **PINS)
    assert free.config.recompute == "selective-op", (free.config, peak)


def test_a_weight_as_wide_as_the_sequence_is_not_taken_for_the_scores():
    """With the hidden size equal to the sequence length every weight is s x s; the policies tell the scores by
    their batch dimension, so selective-op still reruns exactly the second and fourth products."""
    seen, base = _backward("selective-op", s=H)[0], _backward("none", s=H)[0]
    assert (seen.products - base.products, seen.attention) == (2, 0)
