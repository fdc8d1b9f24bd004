"""Checkpoint save/load time and bytes per rank vs torch DCP's save of the same model under FSDP2; resharding.

Benchmark script, not a test: figures are printed, never asserted; what each load restored is checked and the
check printed (a time for a broken load is worthless). Usage (from anywhere)::

    python bench/checkpoint.py                          # gpt_small, worlds 2 and 4, pp2 x tp2, 4 -> 2 -> 3 (~3 min)
    python bench/checkpoint.py --repeats 5              # more repeats per median
    python bench/checkpoint.py --model tiny --worlds 2  # quicker
    python bench/checkpoint.py --no-pp-tp --no-reshard

Model: ``examples.training.gpt_small_seeded`` by default (4 layers, d=256, 4 heads, seq 128, vocab 8192, tied
embedding; 5.29M parameters), fp32, AdamW (``examples.training.adamw``), ``examples.training.gpt_loss``, global
batch 12 (divisible by 2, 3 and 4); step s trains on ``examples.gpt.example_batch(model, 12, seed=s)``. A
checkpoint holds the parameters and AdamW's exp_avg and exp_avg_sq (3 x 4 bytes per parameter) plus the
buffers (the causal masks).

Per world size W in --worlds, in this one run:

    ours   plan = compile(g, f"local:{W}", dp=W, tp=1, pp=1, zero_stage=3, precision="fp32", ...)
           W spawned processes exec plan.program(rank).source and build a runner A; A.step(batch 0);
           --repeats x: barrier, time save_checkpoint(A, fresh dir, step=1, plan_json=...);
           build a fresh runner B; --repeats x: barrier, time load_checkpoint(B, first dir)
    torch  FSDP2: fully_shard on each block, then the root, on the same model and world; one AdamW step on
           the same batch; --repeats x: barrier, time get_model_state_dict + get_optimizer_state_dict +
           dcp.save into a fresh dir; a fresh FSDP2 model; --repeats x: barrier, time
           get_*_state_dict + dcp.load + set_model_state_dict + set_optimizer_state_dict

Both sides are timed the same way: each rank times its own call with ``time.perf_counter`` after a barrier;
a repeat's time is the slowest rank's (the job waits for it), and the figure is the median over repeats.
Both sides fsync their files (DCP's FileSystemWriter default); ours also hashes every file (SHA-256) for the
manifest and checks the hashes on load. Loads read files just written (page cache warm) on both sides.
bytes/rank: the sizes of the ``__{rank}_*.distcp`` files rank r wrote (mean over ranks; ``.metadata`` and
our ``manifest.json`` are counted in the total only). ratio = ours / torch.

With W=4 also a pp2 x tp2 plan (ours only: torch has no equivalent one-liner here). Resharding: the W=4
ZeRO-3 checkpoint loaded by the W=2 ZeRO-3 plan (time per rank, slowest rank, median over repeats), then that
W=2 runner saves, and a W=3 ZeRO-3 plan loads the W=2 checkpoint; and offline
``runtime.checkpoint.reshard(W=4 checkpoint, W=2 plan, dir)`` in this one (parent) process, with torch's default
thread count, plus the W=2 plan loading its output.

Checks after each load (printed): the loaded runner's full parameters and buffers equal, bitwise, those the
checkpoint was saved from; ``load_full_state_dict`` of the checkpoint equals them too; then the saving and
the loaded runner (or FSDP2 model) each take one more step on batch 1: equal loss and parameters mean the
optimizer state came back too (bitwise under the same plan; to 1e-5 after resharding, where the reduction
order changes). Ours vs torch after one step: the largest parameter difference (the same math in fp32).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing.connection
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from torch_ranks import err_line, load_average  # bench/, beside this file

GLOBAL_BATCH = 12  # divisible by 2, 3 and 4: every plan here trains on the same batches
TIMEOUT_S = 300
MODELS = {"tiny": "gpt_tiny_seeded", "small": "gpt_small_seeded", "4l": "gpt_4l_seeded"}
RESHARD_TOL = 1e-5  # another plan reduces gradients in another order: fp32 rounding, not bitwise


# ------------------------------------------------------------------ rank side


def _model_fn(name: str):
    import examples.training

    return getattr(examples.training, MODELS[name])


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _build(job: dict, rank: int):
    """Exec the plan's program for this rank and build a runner, as runtime.launch.local's workers do."""
    import torch

    from examples.training import adamw, gpt_loss

    ns: dict[str, Any] = {"__name__": f"rank_{rank}"}
    exec(compile(job["programs"][rank], f"<rank_{rank}.py>", "exec"), ns)  # noqa: S102 - the plan's program
    torch.manual_seed(0)
    return ns["build"](_model_fn(job["model"]), adamw, gpt_loss)


def _ours(job: dict, rank: int, batches: list) -> dict:
    """Train one step, time saves into fresh dirs, time loads into a fresh runner, check, step both once more."""
    from runtime.checkpoint import load_checkpoint, save_checkpoint

    base, reps, pj = Path(job["dir"]), job["repeats"], job["plan_json"]
    a = _build(job, rank)
    a.step(batches[0])
    save_s = [_timed(lambda i=i: save_checkpoint(a, base / f"save_{i}", step=1, plan_json=pj)) for i in range(reps)]
    saved = a.full_state_dict()
    b = _build(job, rank)
    load_s = [_timed(lambda: load_checkpoint(b, base / "save_0", plan_json=pj)) for _ in range(reps)]
    loaded = b.full_state_dict()
    loss_a, loss_b = a.step(batches[1]), b.step(batches[1])
    after_a, after_b = a.full_state_dict(), b.full_state_dict()
    out = {"save_s": save_s, "load_s": load_s}
    if rank == 0:
        out.update(saved=saved, loaded=verdict(loaded, saved), loss=[loss_a, loss_b], after=verdict(after_b, after_a))
    return out


def _reshard(job: dict, rank: int, batches: list) -> dict:
    """Load each source checkpoint into a fresh runner of this plan (timed), save it (if asked), step once."""
    from runtime.checkpoint import load_checkpoint, save_checkpoint

    reps, pj = job["repeats"], job["plan_json"]
    out: dict[str, Any] = {"load_s": {}, "states": {}}
    runner = None
    for label, src in job["sources"]:
        runner = _build(job, rank)
        out["load_s"][label] = [_timed(lambda r=runner, s=src: load_checkpoint(r, s, plan_json=pj))
                                for _ in range(reps)]
        state = runner.full_state_dict()
        if rank == 0:
            out["states"][label] = state
    if job.get("save_to"):
        out["save_s"] = [_timed(lambda: save_checkpoint(runner, job["save_to"], step=1, plan_json=pj))]
    out["loss"] = runner.step(batches[1])
    return out


def _torch(job: dict, rank: int, batches: list) -> dict:
    """The same protocol on torch's FSDP2 and torch.distributed.checkpoint."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from examples.training import adamw, gpt_loss

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)

    def fsdp():
        model = _model_fn(job["model"])()
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, adamw(model.parameters())

    def step(model, opt, batch) -> float:
        x, y = batch
        loss = gpt_loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = loss.detach().reshape(1)
        dist.all_reduce(lv, op=dist.ReduceOp.AVG)
        return float(lv.item())

    def full(model) -> dict:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save(model, opt, path) -> None:
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)

    def load(model, opt, path) -> None:
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])

    base, reps = Path(job["dir"]), job["repeats"]
    model_a, opt_a = fsdp()
    step(model_a, opt_a, batches[0])
    save_s = [_timed(lambda i=i: save(model_a, opt_a, str(base / f"save_{i}"))) for i in range(reps)]
    saved = {k: v.detach().clone() for k, v in full(model_a).items()}  # empty except on rank 0
    model_b, opt_b = fsdp()
    load_s = [_timed(lambda: load(model_b, opt_b, str(base / "save_0"))) for _ in range(reps)]
    loaded = full(model_b)
    loss_a, loss_b = step(model_a, opt_a, batches[1]), step(model_b, opt_b, batches[1])
    after_a, after_b = full(model_a), full(model_b)
    out = {"save_s": save_s, "load_s": load_s}
    if rank == 0:
        out.update(saved=saved, loaded=verdict(loaded, saved), loss=[loss_a, loss_b], after=verdict(after_b, after_a))
    return out


def _equal(a: dict, b: dict) -> bool:
    import torch

    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def verdict(a: dict, b: dict) -> str:
    """"OK" when the two state dicts hold the same keys and bitwise equal tensors; else what differs."""
    import torch

    if _equal(a, b):
        return "OK"
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    differ = [(float((a[k].float() - b[k].float()).abs().max()) if a[k].shape == b[k].shape else float("inf"), k)
              for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
    parts = ([f"{len(only_a)} keys only in the first, e.g. {only_a[:2]}"] if only_a else []) + \
        ([f"{len(only_b)} keys only in the second, e.g. {only_b[:2]}"] if only_b else []) + \
        ([f"{len(differ)} tensors differ, worst {max(differ)[1]} by {max(differ)[0]:.1e}"] if differ else [])
    return "MISMATCH (" + "; ".join(parts) + ")"


BODIES = {"ours": _ours, "torch": _torch, "reshard": _reshard}


def _rank_main(job: dict, rank: int) -> None:
    """One rank: Gloo over a FileStore (as runtime.launch.local), run the job's body, write result_{rank}.pt."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    d = Path(job["tmp"])
    try:
        torch.set_num_threads(1)  # as launch_local: a few ranks share a few cores
        timeout = timedelta(seconds=TIMEOUT_S)
        store = dist.FileStore(str(d / "store"), job["world"])
        store.set_timeout(timeout)
        dist.init_process_group("gloo", rank=rank, world_size=job["world"], store=store, timeout=timeout)
        result = BODIES[job["kind"]](job, rank, torch.load(d / "batches.pt", weights_only=True))
        torch.save(result, d / f"result_{rank}.pt.part")
        os.replace(d / f"result_{rank}.pt.part", d / f"result_{rank}.pt")
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001 (report, then leave without c10d teardown: peers may be blocked)
        (d / f"error_{rank}.json").write_text(json.dumps(
            {"type": type(exc).__qualname__, "message": str(exc), "traceback": traceback.format_exc()}))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------ parent: spawn, measure, check


def run_job(job: dict, batches: list) -> list[dict]:
    """Spawn job["world"] ranks running job["kind"]; every rank's result (raises with the first failed rank's traceback)."""
    import torch
    import torch.multiprocessing as mp

    from runtime.launch.local import stop_processes

    world = job["world"]
    tmp = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    procs = []
    try:
        torch.save(batches, tmp / "batches.pt")
        job = dict(job, tmp=str(tmp))
        ctx = mp.get_context("spawn")
        for r in range(world):
            p = ctx.Process(target=_rank_main, args=(job, r), name=f"ckpt-{job['kind']}-rank{r}")
            p.start()
            procs.append(p)
        deadline = time.time() + TIMEOUT_S + 60
        while not all((tmp / f"result_{r}.pt").exists() for r in range(world)):
            failed = [r for r, p in enumerate(procs) if p.exitcode is not None
                      and not (tmp / f"result_{r}.pt").exists()]
            if failed or time.time() > deadline:
                errs = [json.loads(f.read_text()) for r in range(world) if (f := tmp / f"error_{r}.json").exists()]
                why = f"ranks {failed} failed (exit codes {[procs[r].exitcode for r in failed]})" if failed \
                    else f"no finish within {TIMEOUT_S + 60} s"
                detail = f"\n{errs[0]['type']}: {errs[0]['message']}\n{errs[0]['traceback']}" if errs else ""
                raise RuntimeError(f"{job['kind']} on {world} ranks: {why}{detail}")
            multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.1)
        return [torch.load(tmp / f"result_{r}.pt", weights_only=True) for r in range(world)]
    finally:
        stop_processes(procs, grace_s=5.0)
        shutil.rmtree(tmp, ignore_errors=True)


def slowest_median(per_rank: list[list[float]]) -> float:
    """Median over repeats of the slowest rank's time in that repeat."""
    return statistics.median(max(ts) for ts in zip(*per_rank))


def rank_bytes(ckpt: Path, world: int) -> tuple[list[int], int]:
    """Bytes of each rank's __{rank}_*.distcp files, and of the whole checkpoint directory."""
    per = [sum(f.stat().st_size for f in ckpt.glob(f"__{r}_*.distcp")) for r in range(world)]
    return per, sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file())


def max_diff(a: dict, b: dict) -> float:
    keys = sorted(set(a) & set(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in keys) if keys else float("nan")


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def compile_plan(graph, world: int, **pins):
    from partitioner import compile

    pins = {"dp": world, "tp": 1, "pp": 1, "zero_stage": 3, "microbatch_size": GLOBAL_BATCH // world} | pins
    return compile(graph, f"local:{world}", global_batch_size=GLOBAL_BATCH, precision="fp32", recompute="none",
                   **pins)


def job_for(kind: str, plan, world: int, model: str, repeats: int, d: Path, **more) -> dict:
    programs = {r: plan.program(r).source for r in range(world)} if plan is not None else {}
    return {"kind": kind, "world": world, "model": model, "repeats": repeats, "dir": str(d), "programs": programs,
            "plan_json": plan.to_json() if plan is not None else None} | more


def measure_world(world: int, label: str, plan, args, batches: list, top: Path, with_torch: bool) -> dict:
    """Ours (and torch's FSDP2) at one world size: times, bytes, checks; prints the row."""
    from runtime.checkpoint import load_full_state_dict, resolve_checkpoint

    row: dict[str, Any] = {"label": f"world {world} {label}"}
    d = top / f"ours_w{world}_{label}"
    print(f"  running ours {row['label']} ({plan.config}) ...", file=sys.stderr, flush=True)
    res = run_job(job_for("ours", plan, world, args.model, args.repeats, d), batches)
    ckpt = resolve_checkpoint(d / "save_0")
    row["ckpt"] = ckpt
    row["save"], row["load"] = slowest_median([r["save_s"] for r in res]), slowest_median([r["load_s"] for r in res])
    row["bytes"], row["total"] = rank_bytes(ckpt, world)
    r0 = res[0]
    row["saved"], row["loss_next"] = r0["saved"], r0["loss"][0]
    on_disk = verdict(load_full_state_dict(ckpt), r0["saved"])
    same_loss = "OK" if r0["loss"][0] == r0["loss"][1] else "MISMATCH"
    row["checks"] = [f"loaded == saved {r0['loaded']}", f"load_full_state_dict == saved {on_disk}",
                     f"next step loss {r0['loss'][1]:.6f} vs {r0['loss'][0]:.6f} {same_loss}",
                     f"params after it {r0['after']}"]
    row["per_rank"] = ([statistics.median(r["save_s"]) for r in res], [statistics.median(r["load_s"]) for r in res])
    if with_torch:
        td = top / f"torch_w{world}"
        print(f"  running torch FSDP2 + DCP world {world} ...", file=sys.stderr, flush=True)
        tres = run_job(job_for("torch", None, world, args.model, args.repeats, td), batches)
        t0 = tres[0]
        row["t_save"] = slowest_median([r["save_s"] for r in tres])
        row["t_load"] = slowest_median([r["load_s"] for r in tres])
        row["t_bytes"], row["t_total"] = rank_bytes(td / "save_0", world)
        t_loss = "OK" if t0["loss"][0] == t0["loss"][1] else "MISMATCH"
        row["checks"] += [f"torch: loaded == saved {t0['loaded']}", f"torch: next step loss {t_loss}",
                          f"torch: params after it {t0['after']}",
                          f"ours vs torch FSDP2 after one step: max |param diff| {max_diff(r0['saved'], t0['saved']):.1e}"]
    print_row(row)
    return row


def print_row(row: dict) -> None:
    per = statistics.mean(row["bytes"])
    if "t_save" in row:
        t_per = statistics.mean(row["t_bytes"])
        line = (f"{row['label']}: save {row['save']:.3f} s (torch DCP FSDP2 {row['t_save']:.3f} s, ratio "
                f"{row['save'] / row['t_save']:.2f}), load {row['load']:.3f} s ({row['t_load']:.3f} s, "
                f"{row['load'] / row['t_load']:.2f}), bytes/rank {mb(per)} ({mb(t_per)}); total {mb(row['total'])} "
                f"({mb(row['t_total'])})")
    else:
        line = (f"{row['label']}: save {row['save']:.3f} s, load {row['load']:.3f} s, bytes/rank {mb(per)}; "
                f"total {mb(row['total'])} (torch: no FSDP2 equivalent measured)")
    print(line, flush=True)
    saves, loads = row["per_rank"]
    print(f"  per rank (median): save {'/'.join(f'{t:.3f}' for t in saves)} s, load "
          f"{'/'.join(f'{t:.3f}' for t in loads)} s, bytes {'/'.join(mb(b) for b in row['bytes'])}", flush=True)
    print(f"  check: {'; '.join(row['checks'])}", flush=True)


def measure_reshard(args, graph, batches: list, top: Path, w4: dict) -> list[str]:
    """4 -> 2 (direct, and offline reshard then load), 2 -> 3; prints the lines; returns the checks.

    The reference is the world-4 runner's own full state at its save (`w4["saved"]`), not the checkpoint read
    back, so a fault in reading checkpoints back cannot hide one in resharding."""
    from runtime.checkpoint import load_full_state_dict, reshard, resolve_checkpoint

    want, loss4, src4 = w4["saved"], w4["loss_next"], w4["ckpt"]

    def loss_check(loss: float) -> str:
        ok = "OK" if abs(loss - loss4) <= RESHARD_TOL else "MISMATCH"
        return f"next step loss {loss:.6f} vs world 4's {loss4:.6f} (|diff| {abs(loss - loss4):.1e}) {ok}"

    plan2 = compile_plan(graph, 2)
    off_s = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        reshard(src4, plan2, top / f"offline_{i}")
        off_s.append(time.perf_counter() - t0)
    off = top / "offline_0"
    checks = [f"offline copy: load_full_state_dict == world-4 state {verdict(load_full_state_dict(off), want)}"]
    _, total = rank_bytes(off, 2)
    print(f"reshard offline 4 -> 2 (runtime.checkpoint.reshard, one process): {statistics.median(off_s):.3f} s, "
          f"output {mb(total)} in {len(list(off.glob('*.distcp')))} .distcp files", flush=True)
    print(f"  check: {checks[-1]}", flush=True)

    chain2 = top / "chain_w2"
    print("  running reshard 4 -> 2 ...", file=sys.stderr, flush=True)
    res = run_job(job_for("reshard", plan2, 2, args.model, args.repeats, top, sources=[
        ("direct", str(src4)), ("offline", str(off))], save_to=str(chain2)), batches)
    direct = slowest_median([r["load_s"]["direct"] for r in res])
    offline = slowest_median([r["load_s"]["offline"] for r in res])
    checks += [f"4 -> 2: loaded == world-4 state {verdict(res[0]['states']['direct'], want)}",
               f"loaded from the offline copy == world-4 state {verdict(res[0]['states']['offline'], want)}",
               loss_check(res[0]["loss"])]
    print(f"reshard 4 -> 2 (dp4 zero3 checkpoint, dp2 zero3 plan): load {direct:.3f} s (slowest rank); of the "
          f"offline-resharded copy {offline:.3f} s; then save at world 2 {max(r['save_s'][0] for r in res):.3f} s",
          flush=True)
    print(f"  check: {'; '.join(checks[-3:])}", flush=True)

    plan3 = compile_plan(graph, 3)
    print(f"  running reshard 2 -> 3 ({plan3.config}) ...", file=sys.stderr, flush=True)
    res3 = run_job(job_for("reshard", plan3, 3, args.model, args.repeats, top,
                           sources=[("direct", str(resolve_checkpoint(chain2)))]), batches)
    t3 = slowest_median([r["load_s"]["direct"] for r in res3])
    checks += [f"2 -> 3: loaded == world-4 state {verdict(res3[0]['states']['direct'], want)}",
               loss_check(res3[0]["loss"])]
    print(f"reshard 2 -> 3 (the world-2 runner's checkpoint, dp3 zero3 plan): load {t3:.3f} s (slowest rank)",
          flush=True)
    print(f"  check: {'; '.join(checks[-2:])}", flush=True)
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", choices=list(MODELS), default="small",
                    help="examples.training factory: tiny (0.54M params), small (5.29M, default), 4l (0.24M)")
    ap.add_argument("--repeats", type=int, default=3, help="saves and loads per measurement; median (default 3)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4], choices=[2, 3, 4])
    ap.add_argument("--no-pp-tp", action="store_true", help="skip the pp2 x tp2 plan at world 4")
    ap.add_argument("--no-reshard", action="store_true", help="skip resharding 4 -> 2 -> 3 (needs world 4)")
    ap.add_argument("--dir", default=None, help="keep the checkpoints in a new subdirectory of this one (default: "
                    "a temp dir, removed after)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")

    import platform
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    import examples.gpt
    from partitioner import trace

    model = _model_fn(args.model)()
    n_params = sum(p.numel() for p in model.parameters())
    n_buf = sum(b.numel() * b.element_size() for b in model.buffers())
    batches = [examples.gpt.example_batch(model, GLOBAL_BATCH, seed=s) for s in range(2)]
    graph = trace(model, examples.gpt.example_inputs(model, 2))
    cfg = model.config
    del model
    print(f"checkpoint bench: gpt {args.model} ({cfg.n_layer} layers, d={cfg.n_embd}, vocab {cfg.vocab_size}, seq "
          f"{cfg.block_size}), {n_params / 1e6:.2f}M parameters, fp32 + AdamW: checkpoint {mb(3 * 4 * n_params)} "
          f"(params, exp_avg, exp_avg_sq) + {mb(n_buf)} buffers; global batch {GLOBAL_BATCH}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs; Gloo, 1 thread "
          f"per rank; times: slowest rank, median of {args.repeats}; ratio = ours / torch; "
          f"load average {load_average()}", flush=True)

    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    top = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir))
    rows: dict[tuple[int, str], dict] = {}
    checks: list[str] = []  # "where: what OK|MISMATCH ..."
    errors: list[str] = []

    def attempt(where: str, fn) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 (report and go on)
            errors.append(f"{where}: {err_line(e)}")
            print(f"{where}: ERROR {e}", flush=True)
            return None

    def measured(key: tuple[int, str], plan_fn, with_torch: bool) -> None:
        row = measure_world(key[0], key[1], plan_fn(), args, batches, top, with_torch=with_torch)
        rows[key] = row
        checks.extend(f"world {key[0]} {key[1]}: {c}" for c in row["checks"])

    try:
        for world in args.worlds:
            attempt(f"world {world} zero3", lambda w=world: measured((w, "zero3"), lambda: compile_plan(graph, w), True))
        if 4 in args.worlds and not args.no_pp_tp:
            attempt("world 4 pp2xtp2", lambda: measured((4, "pp2xtp2"), lambda: compile_plan(
                graph, 4, dp=1, pp=2, tp=2, zero_stage=0, microbatch_size=GLOBAL_BATCH // 4, schedule="1f1b"), False))
        if not args.no_reshard:
            if (4, "zero3") not in rows:
                print("reshard: skipped (needs the world-4 zero3 checkpoint: --worlds ... 4)")
            else:
                got = attempt("reshard", lambda: measure_reshard(args, graph, batches, top, rows[(4, "zero3")]))
                checks.extend(f"reshard: {c}" for c in got or [])
    finally:
        if not args.dir:
            shutil.rmtree(top, ignore_errors=True)
    print(f"load average at end {load_average()}")
    failed = [c for c in checks if "MISMATCH" in c]
    if failed or errors:
        print(f"checks FAILED: {len(failed)} of {len(checks)} checks, {len(errors)} errors")
        for c in failed + errors:
            print(f"  {c}")
        return 1
    print(f"all {len(checks)} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
