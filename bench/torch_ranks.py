"""The torch-baseline side of the runtime benchmarks: spawn ranks as launch_local does, collect their figures.

`bench/runtime_dp.py` and `bench/runtime_3d.py` give the torch baselines the
same treatment as the compiled programs' workers (`runtime.launch.local`): spawned
processes, one thread each, Gloo over a FileStore in a temp dir with the same
timeout, the global batches loaded from a file. A worker calls
`rank_main(rank, world, tmpdir, timeout_s, body)`, where `body(rank,
batches) -> (losses, step_times_s)` does the timed training; the parent calls
`spawn(...)` and gets every rank's result.

The compiled workers also keep the host memory a step frees (`runtime.device.keep_freed_host_memory`: glibc
never trims its heap, so a step in steady state takes no new pages); torch's ranks run with glibc's defaults,
as a torch user's would, unless `torch_keeps_freed(True)` is called before `spawn` (the benchmarks'
`--torch-keep-freed`), which gives them the same allocator setting.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

__all__ = ["rank_main", "spawn", "torch_keeps_freed", "err_line", "load_average", "ms", "ratio"]


KEEP_FREED = "BENCH_TORCH_KEEP_FREED"  # "1": the torch ranks keep freed host memory as the compiled ones do


def torch_keeps_freed(keep: bool) -> str:
    """With `keep`, the torch ranks spawned from now on call keep_freed_host_memory() at their start (an environment
    variable: spawned processes inherit it). Returns what a benchmark's header says of the torch ranks' malloc."""
    if not keep:
        return "torch ranks on glibc's malloc defaults (the compiled ranks keep freed host memory)"
    os.environ[KEEP_FREED] = "1"
    return "torch ranks keep freed host memory, as the compiled ranks do"


def rank_main(rank: int, world: int, tmpdir: str, timeout_s: float, body: Callable) -> None:
    """One rank: init Gloo, run body on the batches, write result_{rank}.json (or error_{rank}.json and exit)."""
    import torch
    import torch.distributed as dist

    d = Path(tmpdir)
    try:
        torch.set_num_threads(1)  # as launch_local: a few ranks share a few cores
        if os.environ.get(KEEP_FREED) == "1":
            from runtime.device import keep_freed_host_memory

            keep_freed_host_memory()
        timeout = timedelta(seconds=timeout_s)
        store = dist.FileStore(str(d / "store"), world)
        store.set_timeout(timeout)
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store, timeout=timeout)
        losses, times = body(rank, torch.load(d / "batches.pt", weights_only=True))
        tmp = d / f"result_{rank}.json.part"
        tmp.write_text(json.dumps({"losses": losses, "step_times_s": times}))
        os.replace(tmp, d / f"result_{rank}.json")
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001 (report, then leave without c10d teardown: peers may be blocked)
        (d / f"error_{rank}.json").write_text(json.dumps(
            {"type": type(exc).__qualname__, "message": str(exc), "traceback": traceback.format_exc()}))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()


def spawn(label: str, world: int, target: Callable, args: Callable[[int, str], Sequence], batches: list,
          timeout_s: float) -> list[dict]:
    """Start `world` processes running target(*args(rank, tmpdir)); every rank's {"losses", "step_times_s"}."""
    import torch
    import torch.multiprocessing as mp

    from runtime.launch.local import stop_processes

    tmp = Path(tempfile.mkdtemp(prefix="bench-torch-ranks-"))
    procs = []
    try:
        torch.save(batches, tmp / "batches.pt")
        ctx = mp.get_context("spawn")
        for r in range(world):
            p = ctx.Process(target=target, args=tuple(args(r, str(tmp))), name=f"torch-{label}-rank{r}")
            p.start()
            procs.append(p)
        deadline = time.time() + timeout_s + 60
        while any(p.exitcode is None for p in procs):
            if all((tmp / f"result_{r}.json").exists() for r in range(world)):
                break  # every rank measured; a crash in teardown after that does not void the figures
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                      and not (tmp / f"result_{r}.json").exists()]
            if failed or time.time() > deadline:
                errs = []
                for r in range(world):
                    f = tmp / f"error_{r}.json"
                    if f.exists():
                        e = json.loads(f.read_text())
                        errs.append(f"rank {r}: {e['type']}: {e['message']}\n{e['traceback']}")
                why = (f"ranks {failed} failed (exit codes {[procs[r].exitcode for r in failed]}; negative: "
                       "killed by that signal)") if failed else f"no finish within {timeout_s + 60} s"
                raise RuntimeError(f"torch {label} on {world} ranks: {why}\n" + "\n".join(errs[:1]))
            multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.1)
        for p in procs:
            p.join(5.0)  # let teardown finish before the temp dir goes
        missing = [r for r in range(world) if not (tmp / f"result_{r}.json").exists()]
        if missing:
            raise RuntimeError(f"torch {label} on {world} ranks: ranks {missing} exited without a result "
                               f"(exit codes {[p.exitcode for p in procs]})")
        return [json.loads((tmp / f"result_{r}.json").read_text()) for r in range(world)]
    finally:
        stop_processes(procs, grace_s=0.0)
        shutil.rmtree(tmp, ignore_errors=True)


def err_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]


def load_average() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def ratio(v) -> str:
    return "-" if v is None else f"{v:.3f}"
