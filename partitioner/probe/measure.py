"""What one rank of the probe measures, with the default process group up: the rank's device (matmul FLOP/s
by dtype and size, a per-op overhead, a stream copy's bandwidth, an optimizer step's, PowerSGD's product's, a
cross entropy's, the fixed memory of the process) and its share
of the collectives (every group of `sweep.groups_by_level` at once, through the runtime's collectives shim,
the calls the generated programs make).

Every rank measures its device at the same time as the others (a barrier first): on a CPU shared by the ranks,
the contention training sees. A collective's time is the slowest participant's (a MAX all-reduce over the
world after each run, untimed): the same number on every rank, so every rank stops a size sweep at the same
point. Returns plain lists and dicts (JSON-ready) for derive.py.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from cost_models.compute import LOSS_PASSES
from cost_models.optimizer import optimizer_step_bytes
from cost_models.powersgd import POWERSGD_RANK
from partitioner.probe.sweep import Sweep
from runtime.comm.collectives import Collectives

__all__ = ["FP8", "fixed_process_bytes", "fp8_tensor_cores", "measure_rank"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP8 = "fp8"  # e4m3 operands through torch._scaled_mm, bf16 out: the GEMM precision="fp8-mixed" runs on a GPU


def measure_rank(sweep: Sweep, groups: dict[str, dict[int, list[list[int]]]], device: torch.device) -> dict[str, Any]:
    """This rank's measurements (see the module docstring); every rank of the world must call it."""
    fixed = fixed_process_bytes(device)  # before the probe allocates anything of its own
    dist.barrier()
    out: dict[str, Any] = {"rank": dist.get_rank(), "device": str(device), "fixed_process_bytes": fixed,
                           "matmul": _matmuls(sweep, device), "op_overhead_s": _op_overhead(device),
                           "stream": _stream(sweep, device), "elementwise": _elementwise(sweep, device),
                           "optimizer": _optimizer_step(sweep, device), "lowrank": _lowrank(sweep, device),
                           "loss": _loss(sweep, device), "overlap": _overlap(sweep, device),
                           "attention": _attention(sweep, device),
                           "collectives": []}
    comm = Collectives()
    for level, by_size in groups.items():
        for p, members in by_size.items():
            made = [dist.new_group(g) for g in members]  # every rank creates every group, in one order
            mine = next(((g, h) for g, h in zip(members, made) if dist.get_rank() in g), None)
            for op in sweep.collectives:
                if op == "p2p" and p != 2:  # a send is between two ranks: the pairs say all there is
                    continue
                for nbytes, seconds in _sweep_op(op, sweep, mine, p, comm, device):
                    out["collectives"].append({"op": op, "level": level, "p": p, "ranks": members[0],
                                               "bytes": nbytes, "seconds": seconds})
    return out


def fixed_process_bytes(device: torch.device) -> int:
    """Memory a process holds before its model: torch, the process group, the device context.

    CPU: the resident set (Linux /proc/self/statm; the peak RSS elsewhere). CUDA: the device memory in use that
    torch's allocator does not hold (CUDA context, NCCL buffers), total - free - reserved."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total - free - torch.cuda.memory_reserved(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, repeats: int, window_s: float = 0.05) -> float:
    """Seconds per call of fn: the median over `repeats` windows of calls back to back, each at least `window_s`
    long, after one untimed call. A window, not a single call: where ranks share cores, a lone call may run
    while its peers wait and look twice as fast as training, where all ranks compute at once."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0, calls = time.perf_counter(), 0
        while True:
            fn()
            calls += 1
            _sync(device)
            elapsed = time.perf_counter() - t0
            if elapsed >= window_s:
                break
        times.append(elapsed / calls)
    return statistics.median(times)


def _calls(fn: Callable[[], Any], device: torch.device, n: int) -> float:
    """Mean seconds of n calls back to back after one untimed (for calls that hold collectives)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / n


def _matmuls(sweep: Sweep, device: torch.device) -> list[dict[str, Any]]:
    out = []
    for name in sweep.dtypes:
        if name == FP8 and not fp8_tensor_cores(device):
            continue  # the fp8 GEMM does not exist here (CPU, pre-Hopper GPUs): the planner emulates or refuses it
        for n in sweep.matmul_sizes:
            product = _fp8_product(n, device) if name == FP8 else _product(n, _DTYPES[name], device)
            dist.barrier()  # every rank at once
            s = _time(product, device, sweep.repeats)
            out.append({"dtype": name, "n": n, "flops": 2.0 * n ** 3, "seconds": s})
            if _slowest(s, device) > sweep.max_op_s:  # agreed by every rank: the next size would be 8x slower
                break
    return out


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` multiplies float8 operands in hardware (CUDA compute capability 8.9+: Ada, Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _product(n: int, dtype: torch.dtype, device: torch.device) -> Callable[[], Any]:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return lambda: a @ b


def _fp8_product(n: int, device: torch.device) -> Callable[[], Any]:
    """The GEMM of runtime.engines.fp8 alone (the casts are memory-bound ops the elementwise rate covers):
    e4m3 codes, a row-major and b column-major as _scaled_mm wants, unit scales, bf16 out."""
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def _op_overhead(device: torch.device) -> float:
    """Seconds per op that does almost nothing: the dispatch / launch cost every op of a step pays."""
    x = torch.zeros(8, device=device)
    return _time(lambda: [x.add(1.0) for _ in range(100)], device, 3) / 100


def _stream(sweep: Sweep, device: torch.device) -> dict[str, float]:
    """A copy of `stream_bytes`: it reads and writes them (STREAM's copy kernel counts 2x)."""
    src = torch.ones(sweep.stream_bytes // 4, device=device)
    dst = torch.empty_like(src)
    dist.barrier()
    s = _time(lambda: dst.copy_(src), device, sweep.repeats)
    return {"bytes": 2.0 * sweep.stream_bytes, "seconds": s}


def _optimizer_step(sweep: Sweep, device: torch.device, tensors: int = 8) -> dict[str, float]:
    """A step of torch.optim.AdamW(lr=1e-3) over about `stream_bytes` of fp32 parameters in `tensors` tensors, its
    gradients set: torch's default implementation for the device (foreach on CUDA and on CPU), what the runtime
    steps when a plan's optimizer is "adamw". Counted as the bytes the cost model charges it
    (cost_models.optimizer.optimizer_step_bytes, 28 per parameter); `_time`'s untimed first call is the first
    step, which creates m and v."""
    n = max(1, sweep.stream_bytes // 4 // tensors)
    params = [torch.randn(n, device=device).requires_grad_() for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    dist.barrier()
    s = _time(opt.step, device, sweep.repeats)
    return {"bytes": float(optimizer_step_bytes("adamw", "fp32") * n * tensors), "seconds": s}


def _lowrank(sweep: Sweep, device: torch.device) -> dict[str, float]:
    """PowerSGD's product P = M Q on about `stream_bytes` of fp32 matrices (1024 x 1024, batched as the runtime
    stacks same-shape gradients) by r = 4 columns (cost_models.powersgd.POWERSGD_RANK): the bytes of M it reads.
    Memory bound, but a CPU's GEMM library does not stream it as its elementwise kernels stream."""
    n = 1024
    batch = max(1, sweep.stream_bytes // (4 * n * n))
    m = torch.randn(batch, n, n, device=device)
    q = torch.randn(batch, n, POWERSGD_RANK, device=device)
    dist.barrier()
    s = _time(lambda: torch.bmm(m, q), device, sweep.repeats)
    return {"bytes": float(4 * m.numel()), "seconds": s}


def _elementwise(sweep: Sweep, device: torch.device) -> dict[str, float]:
    """Bytes/s of the memory-bound ops a training step is made of (an add, a product, GELU, softmax, each
    counted as its input and output bytes), summed: torch's kernels, slower than a copy where they compute
    a transcendental per element, are what the cost model's memory-bound ops run."""
    n = sweep.elementwise_bytes // 4
    x, y = torch.randn(n // 256, 256, device=device), torch.randn(n // 256, 256, device=device)
    ops = [(lambda: x + y, 3), (lambda: x * y, 3), (lambda: torch.nn.functional.gelu(x), 2),
           (lambda: torch.softmax(x, -1), 2)]
    dist.barrier()
    seconds = sum(_time(fn, device, sweep.repeats) for fn, _ in ops)
    return {"bytes": float(sum(k for _, k in ops) * 4 * n), "seconds": seconds}


def _loss(sweep: Sweep, device: torch.device) -> dict[str, float]:
    """Bytes/s of a language model's loss, forward and backward: F.cross_entropy over fp32 logits of
    `sweep.loss_shape`, counted as cost_models.compute.loss_times counts it (LOSS_PASSES over the logits). Its own
    rate: the log-softmax computes an exp per element, and a CPU's fresh tensors of this size fault their pages in."""
    rows, vocab = sweep.loss_shape
    logits = torch.randn(rows, vocab, device=device, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), device=device)

    def step() -> None:
        torch.autograd.grad(torch.nn.functional.cross_entropy(logits, targets), logits)
    dist.barrier()
    s = _time(step, device, sweep.repeats)
    return {"bytes": float(sum(LOSS_PASSES) * 4 * logits.numel()), "seconds": s}


def _attention(sweep: Sweep, device: torch.device) -> dict[str, Any]:
    """Fused attention forward and backward (SDPA, causal, the device's 16-bit dtype; fp32 on a CPU), with the
    FLOP the tracer's rule for causal `scaled_dot_product_attention` counts (tracer/op_rules.py: half the L x S
    products, fwd (4 B H L S d + 5 B H L S) / 2, bwd twice the products + 5 B H L S, halved): the rate the cost model's
    attention ops run at, whichever kernel torch picks here (FlashAttention-2 reaches about 35 % of an H100's
    peak, Shah et al. 2024, "FlashAttention-3", and 50-73 % of an A100's)."""
    b, h, seq, d = sweep.attention_shape
    name = "bf16" if device.type == "cuda" else "fp32"
    q, k, v = (torch.randn(b, h, seq, d, device=device, dtype=_DTYPES[name], requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, seq, d, device=device, dtype=_DTYPES[name])

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    scores = b * h * seq * seq // 2  # causal: the products under the diagonal
    flops = 3 * (4 * scores * d) + 10 * scores
    dist.barrier()
    return {"dtype": name, "shape": [b, h, seq, d], "flops": float(flops), "seconds": _time(step, device, sweep.repeats)}


def _overlap(sweep: Sweep, device: torch.device) -> dict[str, float]:
    """How much of an all-reduce over the world hides behind compute: the matmuls alone, the all-reduce alone,
    then the all-reduce started asynchronously before the matmuls and waited for after them. Where ranks share
    cores, the collective's own CPU work competes with the compute and little hides."""
    a = torch.randn(256, 256, device=device)
    buf = torch.ones(sweep.overlap_bytes // 4, device=device)
    compute = lambda: [a @ a for _ in range(8)]

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    # a fixed number of calls, not windows: every rank must issue the same collectives
    dist.barrier()
    t_compute = _calls(compute, device, sweep.repeats)
    dist.barrier()
    t_comm = _calls(lambda: dist.all_reduce(buf), device, sweep.repeats)
    dist.barrier()
    t_both = _calls(both, device, sweep.repeats)
    return {"compute_s": t_compute, "comm_s": t_comm, "both_s": t_both}


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)  # NCCL reduces only device tensors
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _sweep_op(op: str, sweep: Sweep, mine, p: int, comm: Collectives, device: torch.device):
    """(bytes, seconds) per message size of `op` on every group of size p at once; ranks in no group wait."""
    for nbytes in sweep.message_bytes:
        n = max(p, nbytes // 4 // p * p)  # fp32 elements, a multiple of p (equal shards)
        run = _op(op, n, mine, p, comm, device) if mine is not None else (lambda: None)
        times = []
        for k in range(sweep.repeats + 1):
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            run()
            _sync(device)
            if k:  # the first run is a warm-up (first use of a group sets up its connections)
                times.append(_slowest(time.perf_counter() - t0, device))
            else:
                _slowest(0.0, device)
        s = statistics.median(times)
        yield 4 * n, s
        if s > sweep.max_op_s:
            return


def _op(op: str, n: int, mine, p: int, comm: Collectives, device: torch.device) -> Callable[[], Any]:
    ranks, group = mine
    full = torch.ones(n, device=device)
    shard = torch.ones(n // p, device=device)
    if op == "all_reduce":
        return lambda: comm.all_reduce(full, group)
    if op == "all_gather":
        return lambda: comm.all_gather(full, shard, group)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(shard, full, group)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: comm.all_to_all(out, full, group)
    # p2p (groups of two): the first sends n elements to the second, as one pipeline stage to the next
    me = ranks.index(dist.get_rank())
    peer = ranks[1 - me]
    if me == 0:
        return lambda: comm.send(full, peer, tag=7).wait()
    return lambda: comm.recv(full, peer, tag=7).wait()
