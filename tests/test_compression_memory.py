"""What a compressed gradient reduction holds, measured on 4 real Gloo ranks against cost_models.compression_memory.

Every rank reduces a bucket of real gradient shapes (the example GPT's) with
`runtime.compression.grad_compression.GradientReducer` three times, under the memory
probe: what the reducer keeps between steps (its state: residuals, PowerSGD's
factors) and the most a reduction allocates on top of what it was given (the
probe's peak over what was held on entry) must be what the memory model says,
per fp32 byte of the bucket. Flat over the 4 ranks, and hierarchical as 2
nodes of 2 ranks.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from cost_models.compression_memory import reduction_memory
from ranks import gloo_group

pytestmark = pytest.mark.slow

# (intra_node, inter_node), ZeRO stage, nodes (2: ranks 0,1 and 2,3 on a node each)
CASES = [(("int8", "none"), 0, 1), (("int4", "none"), 1, 1), (("bf16", "none"), 0, 1), (("powersgd", "none"), 0, 1),
         (("int8", "none"), 2, 1), (("int4", "none"), 3, 1), (("bf16", "none"), 2, 1),
         (("none", "int8"), 0, 2), (("int8", "int8"), 1, 2), (("none", "powersgd"), 0, 2)]
SHAPES = [(512, 128), (128, 512), (512,), (384, 128), (128,), (128, 384)]  # matrices and vectors, as in a block


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    from runtime.comm.collectives import Collectives
    from runtime.compression.grad_compression import GradientReducer
    from runtime.comm.groups import make_node_groups
    from runtime.launch.memory_probe import PeakMemory

    with gloo_group(rank, world, store_path):
        nodes = make_node_groups(rank, [tuple(range(world))], node_of=(0, 0, 1, 1))
        n = sum(math.prod(s) for s in SHAPES)
        out = {}
        for compression, zero, n_nodes in CASES:
            spec = dict(zip(("intra_node", "inter_node"), compression)) if n_nodes > 1 else compression[0]
            red = GradientReducer(None, Collectives(), compression=spec, zero_stage=zero,
                                  nodes=nodes if n_nodes > 1 else None)
            torch.manual_seed(rank)
            working = []
            for _ in range(3):
                g = torch.randn(n)
                with PeakMemory() as probe:
                    if zero < 2:
                        red.all_reduce_mean_(g, "bucket", SHAPES)
                    else:
                        red.reduce_scatter_mean(g, "bucket")
                red.step_done()
                working.append(probe.peak)
            held = sum(t.numel() * t.element_size() for k, t in red.state_dict().items()
                       if t.dim() and t.is_floating_point())
            out[compression, zero, n_nodes] = (held / (4 * n), working[-1] / (4 * n))
        torch.save(out, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def measured(spawned):
    return functools.partial(spawned, _worker)(4)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'-'.join(c[0])}-zero{c[1]}-nodes{c[2]}")
def test_the_model_counts_what_the_reducer_holds_and_allocates(measured, case):
    compression, zero, n_nodes = case
    want = reduction_memory(compression, zero_stage=zero, dp=4, nodes=n_nodes)
    for rank, out in enumerate(measured):
        held, working = out[case]
        assert held == pytest.approx(want.held, rel=0.05, abs=0.01), f"rank {rank}: held {held:.3f} x the bucket"
        assert working == pytest.approx(want.working, rel=0.08, abs=0.02), \
            f"rank {rank}: working set {working:.3f} x the bucket, the model says {want.working}"
