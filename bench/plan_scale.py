"""End-to-end `compile()` time (trace included) over model size x device count.

Benchmark script, not a test: figures are printed, never asserted. Usage (from anywhere)::

    python bench/plan_scale.py                                   # full grid, 4 models x 4 device counts
    python bench/plan_scale.py --quick                           # 175B@1024 and 1T@3072 only
    python bench/plan_scale.py --models 13b 175b --devices 1024

Models (examples/gpt.py, built under ``with torch.device("meta"):``), with the
global batch sizes of Narayanan et al. 2021 (Megatron-LM at scale)::

    1.3b  gpt3_1_3b()   24 layers, h=2048     GB 512
    13b   gpt3_13b()    40 layers, h=5120     GB 512
    175b  gpt3_175b()   96 layers, h=12288    GB 1536
    1t    gpt_1t()     128 layers, h=25600    GB 3072

Device counts 8, 64, 1024, 3072 are the topologies 1x8, 8x8, 128x8 and 384x8
A100-80GB. Inputs: ``idx = torch.empty(1, 2048, dtype=torch.long, device="meta")``.

Every cell runs in its own fresh subprocess (timeout 600 s). In the
subprocess: import torch and the partitioner, build the model; time one
``trace(model, (idx, idx))`` (reported as "trace s", and it pays the one-time
torch/export initialisation so the compile figure does not); then time
``compile(model, topology, example_inputs=(idx, idx), global_batch_size=GB)``.
`compile` traces the model again itself, so "compile s" is the end-to-end
figure: trace + split analysis + candidate enumeration + search + plan
assembly. A cell where `compile` raises PlanInfeasibleError is reported as
infeasible, with the time it took to find out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SEQ = 2048
CHILD_TIMEOUT_S = 600
MARK = "@@RESULT@@ "

# name -> (builder in examples.gpt, layers, global batch size)
MODELS = {
    "1.3b": ("gpt3_1_3b", 24, 512),
    "13b": ("gpt3_13b", 40, 512),
    "175b": ("gpt3_175b", 96, 1536),
    "1t": ("gpt_1t", 128, 3072),
}
DEVICES = {8: "1x8xA100-80GB", 64: "8x8xA100-80GB", 1024: "128x8xA100-80GB", 3072: "384x8xA100-80GB"}
QUICK = [("175b", 1024), ("1t", 3072)]
GOALS = [("175b", 1024, "GPT-3 175B on 1024 devices", 10.0), ("1t", 3072, "1T on 3072 devices", 30.0)]


# ------------------------------------------------------------------ child: one cell


def run_one(model_key: str, devices: int) -> dict:
    """Measure one (model, device count) cell in this (fresh) process."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    import examples.gpt as gpt
    from partitioner import PlanInfeasibleError, compile, trace

    builder, layers, gb = MODELS[model_key]
    topology = DEVICES[devices]
    with torch.device("meta"):
        model = getattr(gpt, builder)()
    idx = torch.empty(1, SEQ, dtype=torch.long, device="meta")

    t0 = time.perf_counter()
    g = trace(model, (idx, idx))
    trace_s = time.perf_counter() - t0
    params = g.num_params
    del g

    res = dict(model=model_key, devices=devices, topology=topology, layers=layers, gb=gb, params=params,
               trace_s=trace_s)
    t0 = time.perf_counter()
    try:
        plan = compile(model, topology, example_inputs=(idx, idx), global_batch_size=gb)
    except PlanInfeasibleError as e:
        res.update(compile_s=time.perf_counter() - t0, infeasible=" ".join(str(e).split())[:100])
        return res
    res.update(compile_s=time.perf_counter() - t0, candidates=plan.candidates_evaluated, space=plan.search_space,
               config=str(plan.config), mfu=plan.predicted.mfu, peak_gib=plan.predicted.peak_memory_bytes / 2**30)
    return res


# ------------------------------------------------------------------ parent: orchestrate, print


def measure(model_key: str, devices: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", model_key, str(devices)]
    label = f"{model_key} on {devices} devices"
    print(f"  measuring {label} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=str(REPO_ROOT))
    except subprocess.TimeoutExpired:
        return dict(model=model_key, devices=devices, error=f"timed out after {CHILD_TIMEOUT_S} s")
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            res = json.loads(line[len(MARK):])
            what = "infeasible" if "infeasible" in res else f"{res['candidates']} candidates"
            print(f"    done in {time.perf_counter() - t0:.1f} s: compile {res['compile_s']:.2f} s, {what}",
                  file=sys.stderr, flush=True)
            return res
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    err = "\n".join(tail[-25:]) if tail else f"exit code {proc.returncode}, no output"
    print(f"    FAILED (exit {proc.returncode}):\n{err}", file=sys.stderr, flush=True)
    return dict(model=model_key, devices=devices, error=err)


def _fmt_row(r: dict) -> str:
    head = f"{r['model']:<5} {r['devices']:>6}"
    if "error" in r:
        last = r["error"].strip().splitlines()[-1] if r["error"].strip() else "?"
        return f"{head}  ERROR: {last[:160]}"
    head += f" {r['params'] / 1e9:>9.1f} {r['gb']:>5} {r['trace_s']:>8.2f} {r['compile_s']:>10.2f}"
    if "infeasible" in r:
        return f"{head}  infeasible: {r['infeasible']}"
    return (f"{head} {r['candidates']:>6} {r['space']:>7} {100 * r['mfu']:>6.1f} {r['peak_gib']:>8.1f}  "
            f"{r['config']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--devices", type=int, nargs="+", choices=list(DEVICES), default=list(DEVICES))
    ap.add_argument("--quick", action="store_true", help="175B on 1024 and 1T on 3072 devices only")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "DEVICES"), help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)

    if ns.one:
        res = run_one(ns.one[0], int(ns.one[1]))
        print(MARK + json.dumps(res), flush=True)
        return 0

    if ns.quick:
        cells = QUICK
    else:
        cells = [(m, d) for m in ns.models for d in sorted(set(ns.devices))]
    import platform

    import torch

    print("plan_scale: end-to-end compile() time (trace included) by model size x device count; A100-80GB, "
          f"seq {SEQ}, meta device")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs; "
          f"one fresh subprocess per cell (timeout {CHILD_TIMEOUT_S} s)", flush=True)

    rows = [measure(m, d) for m, d in cells]

    print()
    print(f"{'model':<5} {'devs':>6} {'params(B)':>9} {'GB':>5} {'trace s':>8} {'compile s':>10} {'evald':>6} "
          f"{'space':>7} {'MFU %':>6} {'peak GiB':>8}  config")
    print("-" * 150)
    for r in rows:
        print(_fmt_row(r))
    print("(trace s: a first trace() alone, cold; compile s: compile() end to end, which traces again, warm; "
          "evald: candidates evaluated exactly of space; MFU and peak GiB per rank as predicted)")
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"\nERROR {r['model']} on {r['devices']} devices:\n{r['error']}")
    print()

    def cell(m, d):
        return next((r for r in rows if r["model"] == m and r["devices"] == d and "error" not in r), None)

    for m, d, label, goal in GOALS:
        r = cell(m, d)
        if r is None:
            why = "not measured" if (m, d) not in cells else "compile failed"
            print(f"GOAL {label}: {why} (goal <= {goal:.0f} s): FAIL")
            continue
        note = " (infeasible)" if "infeasible" in r else ""
        print(f"GOAL {label}: {r['compile_s']:.2f} s{note} (goal <= {goal:.0f} s): "
              f"{'PASS' if r['compile_s'] <= goal else 'FAIL'}")

    a, b = cell("13b", 1024), cell("175b", 1024)
    if a and b:
        la, lb = MODELS["13b"][1], MODELS["175b"][1]
        growth = b["compile_s"] / a["compile_s"]
        ratio = growth / (lb / la)
        meaning = ("at most linear in depth" if ratio <= 1.0 else "faster than linear in depth (includes width: "
                   "175B is also 2.4x wider than 13B)")
        print(f"growth: compile 175B ({lb} layers) / 13B ({la} layers) on 1024 devices = {b['compile_s']:.2f} / "
              f"{a['compile_s']:.2f} = {growth:.2f}x; / layer ratio {lb}/{la} = {lb / la:.2f} -> {ratio:.2f} "
              f"(<= 1.0 means compile time grows at most linearly with layer count): {meaning}")
    else:
        print("growth: 13B and 175B on 1024 devices not both measured")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
