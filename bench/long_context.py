"""Long-context attention: step time (forward + backward) of context-parallel attention against one process.

    python bench/long_context.py            # B=1, H=8, S=4096, D=64, causal, fp32
    python bench/long_context.py --quick    # S=1024, fewer steps: under a minute on two cores
    python bench/long_context.py --plans    # the planner on long-context models instead (no ranks spawned)

Runs, each on the same (B, H, S, D), causal, fp32, timing forward plus backward of attention alone:
- `sdpa`: one process, F.scaled_dot_product_attention on the full sequence, as many threads as the cp
  run has ranks (the same cores), with the default CPU kernel (flash, which ring attention's blocks and
  Ulysses also use) and with the math backend (plain matmuls and softmax, the ring's body off CPU);
- `ring cp2`, `ulysses cp2`: runtime.context on 2 spawned Gloo ranks, one thread each;
- `torch cp2`: torch.distributed.tensor.experimental.context_parallel on the same shapes, if it runs on
  Gloo/CPU in this torch; if not, one line saying why.
A cp run's step time is the slowest rank's, median over the timed steps. Printed with the load average,
since the machine may be shared.

`--plans`: the planner's free choice (cp, its kind, and everything else searched) and its compile time for
Llama-3-shaped models built on the meta device (transformers' LlamaForCausalLM: 405B with 8 kv heads at 8K
and 128K tokens on 16,384 H100s, 16M tokens a step as Meta's report states; a 70B at 4K and 128K on 512
H100s, 4M tokens a step), one line each: config, predicted step and MFU, peak memory per rank, compile
seconds (trace included).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_ranks import err_line, load_average, rank_main, spawn  # noqa: E402 (bench/, beside this file)

CP = 2


def _inputs(b: int, h: int, s: int, d: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, h, s, d, generator=g) for _ in range(4))   # q, k, v, grad of out


def _timed(step, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _sdpa_times(shape, warmup: int, steps: int, threads: int, math: bool) -> list[float]:
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_num_threads(threads)
    q, k, v, grad = _inputs(*shape)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        with sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return _timed(step, warmup, steps)


def _cp_body(kernel: str, shape, warmup: int, steps: int, rank: int, _batches) -> tuple[list, list[float]]:
    """One rank of a cp run: its shard of the sequence, `kernel` forward + backward per step."""
    import torch.distributed as dist

    from runtime.comm.collectives import Collectives
    from runtime.context import ring_attention, shard_sequence, ulysses_attention

    world = dist.get_world_size()
    full = _inputs(*shape)
    if kernel == "torch":
        return [], _torch_cp_times(full, warmup, steps)
    q, k, v, grad = (shard_sequence(t, 2, rank, world) for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attend = {"ring": ring_attention, "ulysses": ulysses_attention}[kernel]
    coll = Collectives()

    def step():
        attend(q, k, v, dist.group.WORLD, coll, causal=True).backward(grad)
        dist.barrier()  # a step ends when every rank's does

    return [], _timed(step, warmup, steps)


def _torch_cp_times(full, warmup: int, steps: int) -> list[float]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    bufs = [t.clone() for t in full]      # context_parallel shards these in place, and restores them after
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2]):
        q, k, v = (t.detach().requires_grad_() for t in bufs[:3])  # a resized buffer may not require grad

        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(bufs[3])
            dist.barrier()

        return _timed(step, warmup, steps)


def _cp_step_time(kernel: str, shape, warmup: int, steps: int) -> float:
    body = functools.partial(_cp_body, kernel, shape, warmup, steps)
    res = spawn(f"long-context-{kernel}", CP, rank_main, lambda r, tmp: (r, CP, tmp, 120.0, body), [], 120.0)
    return statistics.median(max(per) for per in zip(*(r["step_times_s"] for r in res)))


# (name, layers, hidden, heads, kv heads, ffn, vocab, seq, global batch, topology)
PLAN_CASES = (
    ("Llama 3 405B, 8K", 126, 16384, 128, 8, 53248, 128256, 8192, 2048, "2048x8xH100-80GB"),
    ("Llama 3 405B, 128K", 126, 16384, 128, 8, 53248, 128256, 131072, 128, "2048x8xH100-80GB"),
    ("70B, 4K", 80, 8192, 64, 8, 28672, 128256, 4096, 1024, "64x8xH100-80GB"),
    ("70B, 128K", 80, 8192, 64, 8, 28672, 128256, 131072, 32, "64x8xH100-80GB"),
)


def plans() -> int:
    """The planner's choices for PLAN_CASES (module docstring)."""
    import torch
    import transformers

    from partitioner import PlanInfeasibleError, compile

    print(f"long-context plans, bf16-mixed, the planner's free choice; load {load_average()}")
    for name, layers, h, heads, kv, ffn, vocab, seq, gb, topo in PLAN_CASES:
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=h, num_attention_heads=heads,
                                       num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
                                       max_position_embeddings=seq, use_cache=False)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        t0 = time.perf_counter()
        try:
            plan = compile(model, topo, example_inputs=(torch.zeros(1, seq, dtype=torch.long, device="meta"),),
                           global_batch_size=gb, precision="bf16-mixed")
        except PlanInfeasibleError as e:
            print(f"  {name:<20} {topo:<18} infeasible ({time.perf_counter() - t0:.1f} s): {str(e)[:160]}")
            continue
        pr = plan.predicted
        print(f"  {name:<20} {topo:<18} {str(plan.config):<62} {pr.step_time_s:8.2f} s  MFU {pr.mfu:5.1%}  "
              f"{pr.peak_memory_bytes / 2**30:5.1f} GiB  compiled in {time.perf_counter() - t0:.1f} s")
    print(f"load {load_average()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="S=1024, 1 warm-up and 3 timed steps")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 4096, 1024 with --quick)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5, 3 with --quick)")
    p.add_argument("--plans", action="store_true", help="the planner's choices on long-context models instead")
    a = p.parse_args(argv)
    if a.plans:
        return plans()
    seq = a.seq or (1024 if a.quick else 4096)
    steps = a.steps or (3 if a.quick else 5)
    warmup = 1 if a.quick else 2
    shape = (a.batch, a.heads, seq, a.head_dim)

    import torch

    print(f"long-context attention, causal fp32, B={a.batch} H={a.heads} S={seq} D={a.head_dim}, "
          f"forward+backward, median of {steps} steps; torch {torch.__version__}, {CP} ranks x 1 thread vs "
          f"1 process x {CP} threads; load {load_average()}")
    sdpa = statistics.median(_sdpa_times(shape, warmup, steps, CP, math=False))
    sdpa_math = statistics.median(_sdpa_times(shape, warmup, steps, CP, math=True))
    print(f"  sdpa 1 process (flash cpu)  {sdpa * 1e3:9.1f} ms")
    print(f"  sdpa 1 process (math)       {sdpa_math * 1e3:9.1f} ms")
    for kernel, label in (("ring", "ring cp2"), ("ulysses", "ulysses cp2"), ("torch", "torch cp2")):
        try:
            t = _cp_step_time(kernel, shape, warmup, steps)
        except Exception as e:  # noqa: BLE001 (one line for a baseline this torch cannot run)
            first = [ln for ln in str(e).splitlines() if ln.startswith("rank ")]   # "rank r: Type: message"
            print(f"  {label:<27} did not run: {first[0][:240] if first else err_line(e)}"
                  + (" (its ring handles the CUDA SDPA kernels only)" if kernel == "torch" else ""))
            continue
        print(f"  {label:<27} {t * 1e3:9.1f} ms   {t / sdpa:6.2f}x sdpa (flash)   {t / sdpa_math:6.2f}x sdpa (math)")
    print(f"load {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
