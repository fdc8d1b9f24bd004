"""Step time of compiled data-parallel programs vs torch's own wrappers, same model, same batch, same run.

Benchmark script, not a test: figures are printed, never asserted. Usage (from anywhere)::

    python bench/runtime_dp.py                                   # ddp, zero1, zero3 at 2 and 4 ranks (a few minutes)
    python bench/runtime_dp.py --worlds 2 --strategies ddp --steps 20
    python bench/runtime_dp.py --rounds 3                        # alternate compiled/torch 3 times, pool the steps

Model: the benchmark model of docs/torch-notes.md, ``examples.training.gpt_small_seeded``
(4 layers, d=256, 4 heads, seq 128, vocab 8192, tied embedding), fp32, AdamW
(``examples.training.adamw``), loss ``examples.training.gpt_loss``, global batch
8; step s uses ``examples.gpt.example_batch(model, 8, seed=s)``. Every rank sees
the global batch and trains on its rows [r*8/W, (r+1)*8/W).

Per (strategy, world) row, in this one run:

    compiled  g = trace(model, example_batch(model, 2));
              plan = compile(g, f"local:{W}", global_batch_size=8, pp=1, tp=1, zero_stage=Z,
                             microbatch_size=8 // W, precision="fp32")
              launch_local(plan, gpt_small_seeded, adamw, gpt_loss, batches, timeout_s=300).step_times_s
    torch     ddp    DistributedDataParallel(model)                      (zero_stage=0)
              zero1  DistributedDataParallel + ZeroRedundancyOptimizer    (zero_stage=1)
              zero3  FSDP2 fully_shard on each block, then on the root    (zero_stage=3)

The torch harness copies what launch_local's workers do so the two sides get
the same treatment: spawned processes (``multiprocessing`` "spawn" context),
``torch.set_num_threads(1)`` per rank, Gloo over a FileStore in a temp dir with
the same timeout, the global batches loaded from a file, and rank 0 timing
each step with ``time.perf_counter`` around the same work the compiled
runner's ``step()`` does: slice this rank's rows, ``loss_fn(model(idx),
targets)``, ``backward()``, ``optimizer.step()``, ``zero_grad(set_to_none=True)``,
``float(loss)``. One difference stays: the compiled ``step()`` also
all-reduces the scalar loss (its contract is to return the global mean loss);
``--torch-loss-allreduce`` makes the torch side do the same.

Each reported time is the median over the steps after the first ``--warmup``
(default 2) of ``--steps`` (default 12) per launch, pooled over ``--rounds``
(default 1; each round runs compiled then torch, alternating which goes
first). ratio = compiled / torch (goal <= 1.05; below 1.0 where the planner's
choices allow). "predicted" is ``plan.predicted.step_time_s``, printed next to
the measurement to calibrate the cost model for this CPU. Noise between runs
here is about +-10 % (docs/torch-notes.md#the-benchmark-model-and-its-baseline-step-times).
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from torch_ranks import err_line, load_average, ms, rank_main, ratio, spawn, torch_keeps_freed  # noqa: E402

GLOBAL_BATCH = 8
TIMEOUT_S = 300
GOAL_RATIO = 1.05
STRATEGIES = {"ddp": 0, "zero1": 1, "zero3": 3}  # strategy -> the plan's zero_stage
TORCH_NAME = {"ddp": "DistributedDataParallel",
              "zero1": "DDP + ZeroRedundancyOptimizer",
              "zero3": "FSDP2 fully_shard (per block, then root)"}


# ------------------------------------------------------------------ torch baseline: one rank


def _optimizer_class_and_kwargs():
    """examples.training.adamw as (class, constructor kwargs), for ZeroRedundancyOptimizer(optimizer_class=...)."""
    import torch

    from examples.training import adamw

    probe = adamw([torch.nn.Parameter(torch.zeros(1))])
    cls = type(probe)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    return cls, {k: v for k, v in probe.defaults.items() if k in accepted}


def _torch_worker(strategy: str, world: int, rank: int, tmpdir: str, loss_allreduce: bool) -> None:
    """One rank of the torch baseline; mirrors runtime.launch.local._worker (threads, store, timeout, batches, timing)."""
    rank_main(rank, world, tmpdir, TIMEOUT_S,
              lambda rank, batches: _torch_train(strategy, world, rank, batches, loss_allreduce))


def _torch_train(strategy: str, world: int, rank: int, batches: list, loss_allreduce: bool):
    import torch.distributed as dist

    from examples.training import adamw, gpt_loss, gpt_small_seeded

    model = gpt_small_seeded()
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(model)
        optimizer = adamw(module.parameters())
    elif strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(model)
        cls, kwargs = _optimizer_class_and_kwargs()
        optimizer = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=cls, **kwargs)
    elif strategy == "zero3":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        module = model
        optimizer = adamw(model.parameters())
    else:
        raise ValueError(f"unknown strategy {strategy!r}")

    per = GLOBAL_BATCH // world
    a, b = rank * per, (rank + 1) * per
    losses, times = [], []
    for idx, targets in batches:
        t0 = time.perf_counter()
        x, y = idx[a:b], targets[a:b]
        loss = gpt_loss(module(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lv = loss.detach().reshape(1)
        if loss_allreduce:
            dist.all_reduce(lv, op=dist.ReduceOp.AVG)
        value = float(lv.item())
        times.append(time.perf_counter() - t0)
        losses.append(value)
    return losses, times


def run_torch(strategy: str, world: int, batches: list, loss_allreduce: bool) -> dict:
    """Spawn `world` ranks of the torch baseline; the global mean loss and rank 0's step times, per step."""
    res = spawn(strategy, world, _torch_worker, lambda r, tmp: (strategy, world, r, tmp, loss_allreduce), batches,
                TIMEOUT_S)
    # The global mean loss (equal rows per rank), comparable with the compiled step()'s return value.
    losses = [sum(vals) / world for vals in zip(*(x["losses"] for x in res))]
    return {"losses": losses, "step_times_s": res[0]["step_times_s"]}


# ------------------------------------------------------------------ compiled program


def make_plan(graph, world: int, zero_stage: int):
    from partitioner import compile

    return compile(graph, f"local:{world}", global_batch_size=GLOBAL_BATCH, pp=1, tp=1, zero_stage=zero_stage,
                   microbatch_size=GLOBAL_BATCH // world, precision="fp32")


def run_compiled(plan, batches: list) -> dict:
    from examples.training import adamw, gpt_loss, gpt_small_seeded
    from runtime.launch.local import launch_local

    out = launch_local(plan, gpt_small_seeded, adamw, gpt_loss, batches, timeout_s=TIMEOUT_S)
    return {"losses": list(out.losses), "step_times_s": list(out.step_times_s),
            "collective_counts": out.collective_counts[0] if out.collective_counts else {}}


# ------------------------------------------------------------------ parent: orchestrate, print


def measure_row(strategy: str, world: int, graph, batches: list, ns) -> dict:
    row: dict = {"strategy": strategy, "world": world, "compiled": [], "torch": [], "errors": []}
    zero = STRATEGIES[strategy]
    try:
        plan = make_plan(graph, world, zero)
        row["predicted_s"] = float(plan.predicted.step_time_s)
        row["config"] = str(plan.config)
    except Exception as e:  # noqa: BLE001 (report and go on)
        row["errors"].append(f"compile: {err_line(e)}")
        plan = None
    for rnd in range(ns.rounds):
        order = ("compiled", "torch") if rnd % 2 == 0 else ("torch", "compiled")
        for side in order:
            if side == "compiled" and plan is None:
                continue
            if any(err.startswith(side) for err in row["errors"]):
                continue  # failed once: do not retry every round
            label = f"{strategy} W={world} {side} (round {rnd + 1}/{ns.rounds})"
            print(f"  running {label} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            res = None
            for attempt in (1, 2):  # one retry: a rare native crash of a run should not void the row
                try:
                    res = run_compiled(plan, batches) if side == "compiled" else \
                        run_torch(strategy, world, batches, ns.torch_loss_allreduce)
                    break
                except Exception as e:  # noqa: BLE001
                    print(f"    FAILED (attempt {attempt}/2): {e}", file=sys.stderr, flush=True)
                    if attempt == 1:
                        row.setdefault("retried", []).append(f"{side}: {err_line(e)}")
                    else:
                        row["errors"].append(f"{side}: {err_line(e)}")
            if res is None:
                continue
            timed = res["step_times_s"][ns.warmup:]
            row[side].extend(timed)
            row.setdefault(f"{side}_losses", res["losses"])
            if side == "compiled":
                row["collective_counts"] = res.get("collective_counts", {})
            print(f"    done in {time.perf_counter() - t0:.1f} s: median {statistics.median(timed) * 1e3:.1f} ms "
                  f"over {len(timed)} steps", file=sys.stderr, flush=True)
    for side in ("compiled", "torch"):
        if row[side]:
            row[f"{side}_s"] = statistics.median(row[side])
    if "compiled_s" in row and "torch_s" in row:
        row["ratio"] = row["compiled_s"] / row["torch_s"]
    if "compiled_s" in row and row.get("predicted_s"):
        row["meas_over_pred"] = row["compiled_s"] / row["predicted_s"]
    if row.get("compiled_losses") and row.get("torch_losses"):
        row["loss_diff"] = max(abs(a - b) for a, b in zip(row["compiled_losses"], row["torch_losses"]))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="steps per launch, warm-up included (default 12)")
    ap.add_argument("--warmup", type=int, default=2, help="leading steps per launch left out of the median (default 2)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES))
    ap.add_argument("--rounds", type=int, default=1, help="launches per side per row, alternating order, steps pooled")
    ap.add_argument("--torch-loss-allreduce", action="store_true",
                    help="torch side also all-reduces the loss each step, as the compiled step() does")
    ap.add_argument("--torch-keep-freed", action="store_true",
                    help="torch ranks keep freed host memory as the compiled ranks do (glibc never trims its heap)")
    ns = ap.parse_args(argv)
    torch_malloc = torch_keeps_freed(ns.torch_keep_freed)
    if ns.steps - ns.warmup < 1:
        ap.error(f"--steps {ns.steps} leaves no timed step after --warmup {ns.warmup}")
    if GLOBAL_BATCH % max(ns.worlds) or any(w < 1 for w in ns.worlds):
        ap.error(f"each world size must divide the global batch {GLOBAL_BATCH}")

    import platform
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    import examples.gpt
    from examples.training import gpt_small_seeded
    from partitioner import trace

    model = gpt_small_seeded()
    n_params = sum(p.numel() for p in model.parameters())
    batches = [examples.gpt.example_batch(model, GLOBAL_BATCH, seed=s) for s in range(ns.steps)]
    graph = trace(model, examples.gpt.example_batch(model, 2))
    del model

    timed = ns.steps - ns.warmup
    print(f"runtime_dp: gpt_small (4 layers, d=256, 4 heads, seq 128, vocab 8192, {n_params / 1e6:.2f}M unique params), "
          f"fp32, AdamW, global batch {GLOBAL_BATCH}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs; Gloo, "
          f"1 thread per rank; {ns.steps} steps per launch, median of the last {timed} (after {ns.warmup} warm-up)"
          f"{f' x {ns.rounds} rounds pooled' if ns.rounds > 1 else ''}; torch side "
          f"{'with' if ns.torch_loss_allreduce else 'without'} the loss all-reduce"
          f"; {torch_malloc}", flush=True)
    print(f"load average at start {load_average()} (1/5/15 min; anything else running on these cores skews the figures)")
    if timed < 10:
        print(f"note: only {timed} timed steps per launch (the benchmark's standard is >= 10)")

    rows = [measure_row(s, w, graph, batches, ns) for s in ns.strategies for w in ns.worlds]

    print()
    hdr = (f"{'strategy':<9} {'world':>5} {'compiled ms':>12} {'torch ms':>10} {'ratio':>7} "
           f"{'predicted ms':>13} {'meas/pred':>10}")
    print(hdr + "   (ms: median per step; ratio = compiled / torch; meas/pred = compiled / predicted)")
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['strategy']:<9} {r['world']:>5} {ms(r.get('compiled_s')):>12} {ms(r.get('torch_s')):>10} "
              f"{ratio(r.get('ratio')):>7} {ms(r.get('predicted_s')):>13} {ratio(r.get('meas_over_pred')):>10}")
    print()
    for r in rows:
        spread = ""
        for side in ("compiled", "torch"):
            if r[side]:
                spread += f" {side} min/max {min(r[side]) * 1e3:.0f}/{max(r[side]) * 1e3:.0f} ms;"
        ld = f" max |loss diff| compiled vs torch {r['loss_diff']:.2e};" if "loss_diff" in r else ""
        cc = f" compiled rank-0 collectives {r['collective_counts']}" if r.get("collective_counts") else ""
        print(f"{r['strategy']} W={r['world']} ({r.get('config', '?')} vs {TORCH_NAME[r['strategy']]}):"
              f"{spread}{ld}{cc}")
        for e in r.get("retried", []):
            print(f"  retried once after: {e}")
        for e in r["errors"]:
            print(f"  ERROR {e}")
    print(f"load average at end {load_average()}")
    print()
    for r in rows:
        head = f"GOAL {r['strategy']} W={r['world']}:"
        if "ratio" not in r:
            print(f"{head} no ratio ({'; '.join(r['errors']) or 'not measured'}): FAIL")
            continue
        print(f"{head} compiled / torch = {ms(r['compiled_s'])} / {ms(r['torch_s'])} ms = {r['ratio']:.3f} "
              f"(goal <= {GOAL_RATIO:.2f}): {'PASS' if r['ratio'] <= GOAL_RATIO else 'FAIL'}")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
