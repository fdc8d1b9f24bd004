"""How well the cost model predicts this machine after `partitioner probe` alone (no trials).

    python bench/probe_fidelity.py                          # probe local:4, the example GPT under 4 plans
    python bench/probe_fidelity.py --calibration cal.json   # reuse a probe's file

Probes local:4 (partitioner.probe), compiles examples/gpt.py:gpt_small with that calibration pinned to
dp4, dp2 x pp2, tp2 x dp2 and ZeRO-3 over dp4, runs each plan with runtime.launch_local for `warmup` +
`steps` steps, and prints per plan the predicted and measured step time (the median over the measured
steps of the slowest rank's) and their ratio, with the load average: this machine is shared and noisy.
The issue's goal: every ratio within 25 %.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_models.calibration import Calibration
from partitioner import compile
from partitioner.probe import probe
from partitioner.tracer.trace import trace
from runtime import launch_local
from runtime.launch.loading import load_callable
from runtime.run import default_loss, default_optimizer

PLANS = {"dp4": dict(dp=4, zero_stage=0), "dp2 x pp2": dict(dp=2, pp=2, zero_stage=0, schedule="1f1b"),
         "tp2 x dp2": dict(dp=2, tp=2, zero_stage=0), "zero3 dp4": dict(dp=4, zero_stage=3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="examples/gpt.py:gpt_small")
    ap.add_argument("--topology", default="local:4")
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calibration", default=None, help="a probe's JSON (default: probe now)")
    args = ap.parse_args()
    load = lambda: " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.calibration:
        cal = Calibration.load(args.calibration)
    else:
        path = Path(tempfile.mkdtemp(prefix="probe-bench-")) / "probe.json"
        t0 = time.perf_counter()
        cal = probe(args.topology, out=path, progress=sys.stderr)
        print(f"probe {args.topology}: {time.perf_counter() - t0:.1f} s (load {load()}), written to {path}")
    model_fn = load_callable(args.model, "model")
    module = sys.modules[model_fn.__module__]
    built = model_fn()
    g = trace(built, tuple(module.example_batch(built, 2))[:1])
    n = args.warmup + args.steps
    batches = [module.example_batch(built, args.global_batch_size, seed=s) for s in range(n)]
    rows = []
    for name, pins in PLANS.items():
        plan = compile(g, args.topology, global_batch_size=args.global_batch_size, precision=args.precision,
                       calibration=cal, alternatives=0, **pins)
        # verify=False: this bench measures time; the equivalence tests check what the programs compute
        res = launch_local(plan, model_fn, default_optimizer(plan.optimizer), default_loss, batches, verify=False)
        times = [max(r[k] for r in res.rank_step_times_s) for k in range(args.warmup, n)]
        measured = statistics.median(times)
        rows.append((name, str(plan.config), plan.predicted.step_time_s, measured, load()))
        print(f"  {name}: predicted {plan.predicted.step_time_s * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms",
              file=sys.stderr)
    print(f"\n{args.model} on {args.topology}, global batch {args.global_batch_size}, {args.precision}, "
          f"calibration: {cal.source}")
    print(f"factors: device_speed {cal.device_speed:.3g}, mem_eff {cal.mem_eff:.3g}, optimizer_eff "
          f"{cal.optimizer_eff:.3g}, loss_eff {cal.loss_eff:.3g}, dp_overlap {cal.dp_overlap:.3g}")
    print(f"{'plan':<11} {'config':<44} {'pred ms':>8} {'meas ms':>8} {'pred/meas':>9}  load avg")
    for name, config, pred, meas, la in rows:
        print(f"{name:<11} {config:<44} {pred * 1e3:>8.1f} {meas * 1e3:>8.1f} {pred / meas:>9.2f}  {la}")
    worst = max(abs(p / m - 1) for _, _, p, m, _ in rows)
    print(f"\nworst |pred/meas - 1|: {worst:.0%} (goal 25 %): {'PASS' if worst <= 0.25 else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
