"""Convergence parity of compressed data-parallel training: 4 Gloo processes, the example GPT, 3 seeds.

Each rank trains gpt_tiny with the data-parallel engine (DDP buckets) for
STEPS steps on its rows of seeded batches; the reduction is fp32 (the
baseline), bf16, int8 or int4 with error feedback, PowerSGD (rank 4, error
feedback, warm start, after POWERSGD_WARMUP uncompressed steps: Adam
amplifies the poor first projections of a random Q -- without warm-up it
ends ~10 % above the baseline here, rank 16 ~1 %), or the negative control:
a scaled-sign compressor without feedback. The final loss (mean of the last 5 steps) must be within
1 % of the baseline for int8 and bf16, 3 % for int4 and PowerSGD, and the
control must end measurably further from the baseline than int8.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from examples.training import adamw as _adamw_default
from examples.training import gpt_loss, gpt_tiny_seeded
from runtime.comm.collectives import Collectives
from runtime.compression.compressed_reduce import CompressedReduce
from runtime.engines.data_parallel import DataParallel
from ranks import data_parallel_steps, gloo_group, pattern_batches

pytestmark = pytest.mark.slow

WORLD, STEPS, BATCH, SEQ, SEEDS = 4, 40, 8, 32, (0, 1, 2)
POWERSGD_WARMUP = 10
MODES = ("none", "bf16", "int8", "int4", "powersgd", "sign")


def _train(rank: int, mode: str, seed: int) -> list[float]:
    model = gpt_tiny_seeded()
    coll = Collectives()
    engine = DataParallel(model, group=dist.group.WORLD, ranks=tuple(range(WORLD)), zero_stage=0,
                          collectives=coll, compression="int8" if mode == "sign" else mode,
                          compression_warmup=POWERSGD_WARMUP if mode == "powersgd" else 0)
    if mode == "sign":  # the negative control: 1-bit scaled sign, no error feedback
        engine.reducer._parts["flat"] = CompressedReduce(dist.group.WORLD, coll, bits=1, feedback=False)
    opt = torch.optim.AdamW(engine.optimizer_params(), lr=3e-3)  # fast enough to learn the patterns in STEPS
    return data_parallel_steps(engine, opt, coll, gpt_loss, pattern_batches(seed, STEPS, BATCH, SEQ))


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    with gloo_group(rank, world, store_path, timeout_s=180):
        out = {(mode, seed): _train(rank, mode, seed) for seed in SEEDS for mode in MODES}
        if rank == 0:
            torch.save(out, Path(out_dir) / "rank0.pt")


@pytest.fixture(scope="module")
def losses(spawned):
    return spawned(_worker, WORLD)[0]


def _final(losses, mode: str, seed: int) -> float:
    return sum(losses[(mode, seed)][-5:]) / 5


@pytest.mark.parametrize("seed", SEEDS)
def test_compressed_training_ends_where_uncompressed_training_does(losses, seed):
    base = _final(losses, "none", seed)
    assert losses[("none", seed)][-1] < 0.9 * losses[("none", seed)][0]  # it does learn
    for mode, tol in (("bf16", 0.01), ("int8", 0.01), ("int4", 0.03), ("powersgd", 0.03)):
        got = _final(losses, mode, seed)
        assert abs(got - base) <= tol * base, f"{mode}: final loss {got:.4f} vs {base:.4f} uncompressed"


def test_the_sign_control_without_feedback_does_measurably_worse(losses):
    """Adam is itself sign-like, so the 1-bit control is not far off; but on every seed it ends further from
    the uncompressed run than int8 with feedback does (at least twice as far, and by more than 0.3 % of the
    loss), and over the seeds its mean offset is above three times int8's largest, its seed-to-seed noise.
    (Measured on this machine: sign 0.078 / 0.027 / 0.53 against int8 0.026 / 0.0035 / 0.002.)"""
    off_int8, off_sign = [], []
    for s in SEEDS:
        base = _final(losses, "none", s)
        off_int8.append(abs(_final(losses, "int8", s) - base))
        off_sign.append(abs(_final(losses, "sign", s) - base))
        assert off_sign[-1] > max(2 * off_int8[-1], 0.003 * base), \
            f"seed {s}: sign {off_sign[-1]:.4f}, int8 {off_int8[-1]:.4f}"
    assert sum(off_sign) / len(SEEDS) > 3 * max(off_int8), f"sign {off_sign}, int8 {off_int8}"


def test_a_plan_that_compresses_runs_its_compressor():
    """compile(..., compression="int8") on 4 local processes: the program reduces through the compressed
    collective (all-to-all + all-gather of codes instead of all-reduces) and tracks the fp32 losses."""
    from partitioner import compile
    from runtime import launch_local

    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 1024, (8, 32), generator=g), torch.randint(0, 1024, (8, 32), generator=g))
            for _ in range(3)]
    out = {}
    for comp in ("none", "int8"):
        plan = compile(gpt_tiny_seeded(), "local:4", example_inputs=(torch.randint(0, 1024, (2, 32)),),
                       global_batch_size=8, precision="fp32", dp=4, tp=1, pp=1, zero_stage=0, compression=comp)
        assert plan.compression["intra_node"] == comp
        assert f"compression={comp!r}" in plan.program(0).source
        out[comp] = launch_local(plan, gpt_tiny_seeded, _adamw_default, gpt_loss, data)
    counts = out["int8"].collective_counts[0]
    assert counts["all_to_all"] > 0 and counts["all_gather"] == counts["all_to_all"]
    assert "all_to_all" not in out["none"].collective_counts[0]
    torch.testing.assert_close(torch.tensor(out["int8"].losses), torch.tensor(out["none"].losses), rtol=1e-3, atol=0)
