"""Session-wide settings, applied before any test module imports torch or triton."""

import os

import pytest

# Triton kernels run in the interpreter on CPU tensors (docs/torch-notes.md#the-triton-interpreter-on-cpu).
# It is read when triton is first imported, and some test modules import triton indirectly (torch,
# transformers) before test_quantize does: so it is set here, once, for the whole session. A GPU run sets
# TRITON_INTERPRET=0 to test the compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def meta_gpt_graph():
    """A 4-block GPT traced on the meta device (nothing allocated): plans of it are cheap to compile."""
    import torch

    from examples import gpt
    from partitioner import trace

    cfg = gpt.GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, vocab_size=256)
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    idx = torch.empty(2, 64, dtype=torch.long, device="meta")
    return trace(model, (idx, idx))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """spawned(worker, world): start `world` processes running worker(rank, world, store_path, out_dir) and return
    each rank's `out_dir/rank{r}.pt`, once per (worker, world) in a test module."""
    import torch
    import torch.multiprocessing as mp

    cache: dict = {}

    def get(worker, world: int) -> list[dict]:
        if (worker, world) not in cache:
            tmp = tmp_path_factory.mktemp(f"{worker.__module__}-{world}")
            mp.start_processes(worker, args=(world, str(tmp / "store"), str(tmp)), nprocs=world, start_method="spawn")
            cache[worker, world] = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
        return cache[worker, world]

    return get
