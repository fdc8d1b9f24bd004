"""Session-wide settings, applied before any test module imports torch or triton."""

import os

import pytest

# Triton kernels run in the interpreter on CPU tensors (docs/torch-notes.md#the-triton-interpreter-on-cpu).
# It is read when triton is first imported, and some test modules import triton indirectly (torch,
# transformers) before test_quantize does: so it is set here, once, for the whole session. A GPU run sets
# TRITON_INTERPRET=0 to test the compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`-n 3`, as .ci/run runs) several workers share the machine's few cores: each computes on one
# thread, as the ranks it starts do (runtime.launch.local). Two OpenMP threads a worker would oversubscribe the cores,
# and a parallel region runs at the pace of its descheduled thread. Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# What the tests' ranks (launch_local, ranks.spawn) start with imported: the fork server imports it once,
# where each rank would import it itself, for seconds (a Hugging Face modeling module under a loaded machine
# took 4-8 s a rank). The server starts at the first launch, after this.
_HF_FAMILIES = ("gpt2", "llama", "mixtral", "qwen3", "qwen3_moe", "mpt", "bloom", "falcon", "gemma3", "gpt_oss",
                "deepseek_v3")
_PRELOAD = ("transformers", *(f"transformers.models.{f}.modeling_{f}" for f in _HF_FAMILIES), "partitioner",
            "runtime", "examples.gpt", "examples.training", "examples.hf_families", "ranks")


def pytest_configure(config):
    from runtime.launch.local import preload

    preload(*_PRELOAD)


def _traced_on_meta(build, batch: int, seq: int):
    """build() on the meta device (nothing allocated), traced with `batch` x `seq` token ids as idx and targets."""
    import torch

    from partitioner import trace

    with torch.device("meta"):
        model = build()
    idx = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return trace(model, (idx, idx))


@pytest.fixture(scope="session")
def meta_gpt_graph():
    """A 4-block GPT traced on the meta device: plans of it are cheap to compile."""
    from examples import gpt

    cfg = gpt.GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, vocab_size=256)
    return _traced_on_meta(lambda: gpt.GPT(cfg), 2, 64)


@pytest.fixture(scope="session")
def gpt3_xl():
    """GPT-3 XL (1.3B) traced on the meta device at its training sequence length, 2048."""
    from examples import gpt

    return _traced_on_meta(gpt.gpt3_1_3b, 1, 2048)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """spawned(worker, world): ranks.spawn(worker, world, ...) once per (worker, world) in a test module: what
    each rank saved, by rank."""
    import torch.multiprocessing as mp

    from ranks import spawn

    cache: dict = {}

    def get(worker, world: int) -> list:
        if (worker, world) not in cache:  # a failed world fails every test that reads it, not just the first
            try:
                cache[worker, world] = spawn(worker, world, tmp_path_factory.mktemp(f"{worker.__module__}-{world}"))
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
                cache[worker, world] = e
        if isinstance(cache[worker, world], Exception):
            raise cache[worker, world]
        return cache[worker, world]

    return get
