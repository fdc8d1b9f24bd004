"""Trace time and peak memory of `partitioner.tracer.trace` on GPT-3-width models of growing depth.

Benchmark script, not a test. Usage (from anywhere)::

    python bench/trace_scale.py                              # everything (a few minutes)
    python bench/trace_scale.py --quick                      # 12 and 96 layers, no baselines
    python bench/trace_scale.py --layers 12 96 --models hf
    python bench/trace_scale.py --quick --models example alternating   # the two trace-speed goals

Models, all at GPT-3 width (h=12288, 96 heads, seq 2048, vocab 51200) on the meta device:

    example  examples.gpt.GPT(replace(CONFIGS["gpt3_175b"], n_layer=L)), traced with
             targets so the loss is in the graph: trace(model, (idx, idx))
    hf       transformers GPT2LMHeadModel(GPT2Config(...)), traced as
             trace(model, (), dict(input_ids=idx, labels=idx, use_cache=False))
    alternating  the example with local_window=LOCAL_WINDOW: blocks 1, 3, 5, ... attend to
             the last 256 positions only, as GPT-3 alternates dense and locally banded
             attention; same parameters, two kinds of block, traced as six blocks
             (three periods of two) and copied

Goals: the 96-layer example (GPT-3 175B) traced in <= GOAL_TIME_S with a peak
of <= GOAL_PEAK_MB; the 96-layer alternating stack in <= ALTERNATING_GOAL_RATIO
times the example's warm time measured in the same run.

Every measurement runs in its own fresh subprocess, so its peak RSS
(getrusage ru_maxrss) belongs to that trace alone. In the subprocess: import
torch and the partitioner, build the model, read the baseline peak RSS; then
one cold trace() call (pays one-time torch/export initialisation), then 3 timed
calls whose median is the "warm" time; the trace increment is the final peak
RSS minus the baseline. Only the trace() call is timed (time.perf_counter).

Baselines (skipped by --quick): the plain full trace (expand_repeated=False)
at 12 and 24 layers, and at 48 only if 24 took < 20 s warm; and raw
torch.export.export(model, (), kwargs, strict=False) of the 12-layer HF model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

WIDTH, HEADS, SEQ, VOCAB = 12288, 96, 2048, 51200
REPEATS = 3
CHILD_TIMEOUT_S = 3600
PLAIN_48_IF_24_UNDER_S = 20.0
GOAL_TIME_S = 5.0
GOAL_PEAK_MB = 1024.0
ALTERNATING_GOAL_RATIO = 2.0
LOCAL_WINDOW = 256  # positions a local block attends to; any value < SEQ gives the same trace time
MODELS = ["example", "hf", "alternating"]
MARK = "@@RESULT@@ "


def _peak_mb() -> float:
    """Peak resident set size of this process so far, in MB (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ------------------------------------------------------------------ child: one measurement


def _build(model_name: str, layers: int):
    import dataclasses

    import torch

    idx = torch.empty(1, SEQ, dtype=torch.long, device="meta")
    if model_name in ("example", "alternating"):
        from examples.gpt import CONFIGS, GPT

        window = LOCAL_WINDOW if model_name == "alternating" else None
        with torch.device("meta"):
            model = GPT(dataclasses.replace(CONFIGS["gpt3_175b"], n_layer=layers, local_window=window))
        return model, (idx, idx), {}
    if model_name == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=layers, n_embd=WIDTH, n_head=HEADS, n_positions=SEQ, vocab_size=VOCAB, use_cache=False)
        with torch.device("meta"):
            model = GPT2LMHeadModel(cfg)
        return model, (), dict(input_ids=idx, labels=idx, use_cache=False)
    raise ValueError(f"unknown model {model_name!r}")


def run_one(model_name: str, layers: int, mode: str, repeats: int) -> dict:
    """Measure in this (fresh) process; `mode` is expand | plain | export."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch  # noqa: F401
    import torch.export

    from partitioner import trace

    model, args, kwargs = _build(model_name, layers)
    model.eval()
    base_mb = _peak_mb()

    if mode == "export":
        def call():
            return torch.export.export(model, args, kwargs, strict=False)
    else:
        expand_repeated = mode == "expand"

        def call():
            return trace(model, args, kwargs, expand_repeated=expand_repeated)

    t0 = time.perf_counter()
    out = call()
    cold = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        del out
        t0 = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - t0)
    peak_mb = _peak_mb()

    if mode == "export":
        nodes = len(out.graph.nodes)
        params = sum(p.numel() for p in model.parameters())  # unique (tied counted once)
        method, expanded_from, gflops = "torch.export", None, None
    else:
        nodes = len(out.nodes)
        params = out.num_params
        method, expanded_from = out.method, out.expanded_from
        gflops = out.flops(batch_size=1) / 1e9
    return dict(model=model_name, layers=layers, mode=mode, params=params, nodes=nodes, method=method,
                expanded_from=expanded_from, cold_s=cold, warm_s=statistics.median(times), times=times,
                base_mb=base_mb, peak_mb=peak_mb, inc_mb=peak_mb - base_mb, gflops=gflops)


# ------------------------------------------------------------------ parent: orchestrate, print


def measure(model_name: str, layers: int, mode: str, repeats: int = REPEATS) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", model_name, str(layers), mode, "--repeats", str(repeats)]
    label = f"{model_name} L={layers} {mode}"
    print(f"  measuring {label} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=str(REPO_ROOT))
    except subprocess.TimeoutExpired:
        return dict(model=model_name, layers=layers, mode=mode, error=f"timed out after {CHILD_TIMEOUT_S} s")
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            res = json.loads(line[len(MARK):])
            print(f"    done in {time.perf_counter() - t0:.1f} s: warm {res['warm_s']:.2f} s, peak {res['peak_mb']:.0f} MB",
                  file=sys.stderr, flush=True)
            return res
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    err = "\n".join(tail[-25:]) if tail else f"exit code {proc.returncode}, no output"
    print(f"    FAILED (exit {proc.returncode}):\n{err}", file=sys.stderr, flush=True)
    return dict(model=model_name, layers=layers, mode=mode, error=err)


def _fmt_row(r: dict) -> str:
    kind = {"expand": "trace", "plain": "trace(expand_repeated=False)", "export": "raw torch.export"}[r["mode"]]
    head = f"{r['model']:<11} {r['layers']:>6}  {kind:<28}"
    if "error" in r:
        first = r["error"].strip().splitlines()[-1] if r["error"].strip() else "?"
        return f"{head} ERROR: {first[:160]}"
    ef = "-" if r["expanded_from"] is None else str(r["expanded_from"])
    return (f"{head} {r['params'] / 1e9:>10.3f} {r['nodes']:>7} {r['method']:>12} {ef:>8} "
            f"{r['cold_s']:>8.2f} {r['warm_s']:>8.2f} {r['peak_mb']:>9.0f} {r['base_mb']:>8.0f} {r['inc_mb']:>9.0f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48, 96])
    ap.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    ap.add_argument("--quick", action="store_true", help="12 and 96 layers only, no baselines")
    ap.add_argument("--repeats", type=int, default=REPEATS, help="timed warm calls per measurement (median reported)")
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "LAYERS", "MODE"), help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)

    if ns.one:
        res = run_one(ns.one[0], int(ns.one[1]), ns.one[2], ns.repeats)
        print(MARK + json.dumps(res), flush=True)
        return 0

    layers = [12, 96] if ns.quick else sorted(set(ns.layers))
    import platform

    import torch

    print(f"trace_scale: GPT-3 width h={WIDTH}, {HEADS} heads, seq {SEQ}, vocab {VOCAB}, meta device, batch 1")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs; "
          f"one fresh subprocess per row; warm = median of {ns.repeats} calls after one cold call; "
          f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    rows: list[dict] = []
    for m in ns.models:
        for L in layers:
            rows.append(measure(m, L, "expand", ns.repeats))
        if not ns.quick:
            for L in (12, 24):
                rows.append(measure(m, L, "plain", ns.repeats))
            r24 = rows[-1]
            if "error" not in r24 and r24["warm_s"] < PLAIN_48_IF_24_UNDER_S:
                rows.append(measure(m, 48, "plain", ns.repeats))
            else:
                print(f"  skipping {m} L=48 plain (24-layer plain trace took >= {PLAIN_48_IF_24_UNDER_S:.0f} s or failed)",
                      file=sys.stderr, flush=True)
            if m == "hf":
                rows.append(measure("hf", 12, "export", ns.repeats))

    print()
    print(f"{'model':<11} {'layers':>6}  {'what':<28} {'params(B)':>10} {'nodes':>7} {'method':>12} {'exp_from':>8} "
          f"{'cold s':>8} {'warm s':>8} {'peak MB':>9} {'base MB':>8} {'trace MB':>9}")
    print("-" * 143)
    for m in ns.models:
        for r in rows:
            if r["model"] == m:
                print(_fmt_row(r))
    print("(peak MB: peak RSS of the measuring process; base MB: its peak after importing torch and building the "
          "model; trace MB: peak - base)")
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"\nERROR {r['model']} L={r['layers']} {r['mode']}:\n{r['error']}")
    print()

    def row(m, L, mode):
        return next((r for r in rows if r["model"] == m and r["layers"] == L and r["mode"] == mode and "error" not in r), None)

    for m in ns.models:
        lo, hi = min(layers), max(layers)
        a, b = row(m, lo, "expand"), row(m, hi, "expand")
        if a and b and hi > lo:
            g = b["warm_s"] / a["warm_s"]
            lim = hi / lo
            print(f"growth {m}: warm time at {hi} layers / at {lo} layers = {b['warm_s']:.2f} / {a['warm_s']:.2f} = "
                  f"{g:.2f}x (goal <= {lim:.0f}x, i.e. at most linear): {'PASS' if g <= lim else 'FAIL'}")
        for L in (12, 24, 48):
            e, p = row(m, L, "expand"), row(m, L, "plain")
            if e and p:
                print(f"speedup {m} L={L}: plain {p['warm_s']:.2f} s / expanded {e['warm_s']:.2f} s = "
                      f"{p['warm_s'] / e['warm_s']:.1f}x (warm), {p['cold_s'] / e['cold_s']:.1f}x (cold)")
        if m == "hf":
            e, x = row("hf", 12, "expand"), row("hf", 12, "export")
            if e and x:
                print(f"reference hf L=12: raw torch.export {x['warm_s']:.2f} s warm ({x['cold_s']:.2f} s cold) vs "
                      f"trace {e['warm_s']:.2f} s warm ({e['cold_s']:.2f} s cold)")
    print()
    for m in ns.models:
        r = row(m, 96, "expand")
        if r is None:
            why = "not measured" if 96 not in layers else "trace failed"
            print(f"GOAL {m}: 96 layers {why}: FAIL")
            continue
        if m == "alternating":
            base = row("example", 96, "expand")
            if base is None:
                print(f"GOAL alternating: 96 layers traced in {r['warm_s']:.2f} s ({r['expanded_from']} blocks traced); "
                      "no uniform example measured to compare with (add --models example): FAIL")
                continue
            lim = ALTERNATING_GOAL_RATIO * base["warm_s"]
            print(f"GOAL alternating: 96 layers, two kinds of block, traced in {r['warm_s']:.2f} s "
                  f"({r['expanded_from']} blocks traced; cold {r['cold_s']:.2f} s) = {r['warm_s'] / base['warm_s']:.2f}x "
                  f"the uniform example's {base['warm_s']:.2f} s (goal <= {ALTERNATING_GOAL_RATIO:.0f}x = {lim:.2f} s): "
                  f"{'PASS' if r['warm_s'] <= lim else 'FAIL'}")
            continue
        ok = r["warm_s"] <= GOAL_TIME_S and r["peak_mb"] <= GOAL_PEAK_MB
        print(f"GOAL {m}: 175B (96 layers) traced in {r['warm_s']:.2f} s (goal <= {GOAL_TIME_S:.0f} s; cold {r['cold_s']:.2f} s), "
              f"peak {r['peak_mb']:.0f} MB (goal <= {GOAL_PEAK_MB:.0f} MB; trace increment {r['inc_mb']:.0f} MB): "
              f"{'PASS' if ok else 'FAIL'}")
    print(f"load average at the end (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
