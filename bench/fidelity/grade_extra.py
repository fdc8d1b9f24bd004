"""Grade the extra published training runs (bench/fidelity/published-extra.json) with the shared fidelity protocol.

The protocol (how a row becomes a Hugging Face model on the meta device, a Topology, pinned compile() arguments and a
measured iteration time) is ../shared/fidelity/grade.py's, imported by path and not copied: its model(), topology(),
pins() and measured_seconds() build every case. Grading is grade.py's too: predicted vs measured seconds per iteration,
a run refused as infeasible counts as a 100 % error, a run that needs a pin or precision compile() does not take yet
(fp8, context parallelism, a recompute mode) is listed as NEEDS and not graded.

usage (from the project root):
    python bench/fidelity/grade_extra.py                 # one line per run, then the summary
    python bench/fidelity/grade_extra.py --json out.json
    python bench/fidelity/grade_extra.py --group torchtitan-llama-a100
    python bench/fidelity/grade_extra.py --grade PATH    # another copy of grade.py
Exit status 0 always: this is a measurement, not a test.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_GRADE = ROOT.parent / "shared" / "fidelity" / "grade.py"


def load_protocol(path: Path):
    """grade.py as a module (importing it runs nothing: its main() is behind __name__)."""
    if not path.exists():
        sys.exit(f"grade_extra: the shared protocol is not at {path} (pass --grade PATH)")
    spec = importlib.util.spec_from_file_location("shared_fidelity_grade", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def needs(ex: Exception) -> bool:
    """An error that says compile() lacks a pin or precision, not that the run is wrong.

    grade.py lists a TypeError (an unknown keyword such as cp=) and a ValueError naming the precision as NEEDS; a
    recompute the row cannot state as a pin (torchtitan's per-layer AC without its N) is the same kind of
    missing pin."""
    if isinstance(ex, TypeError):
        return True
    msg = str(ex)
    return isinstance(ex, ValueError) and ("precision" in msg or msg.startswith("recompute="))


def grade(cases, g, compile, infeasible_error):
    rows, errs, needs_rows = [], [], []
    for case in cases:
        if case["kind"] not in ("throughput", "oom"):
            continue
        pc = case["published_config"]
        if not all(isinstance(pc.get(k), int) for k in ("t", "p", "d")):
            rows.append(f"{case['id']}: skipped, t/p/d not all stated")
            continue
        t0 = time.perf_counter()
        try:
            mod, x = g.model(case)
            topo = g.topology(case)
            kw = g.pins(case)
            gbs = case["model"]["global_batch"]
            try:
                plan = compile(mod, topo, example_inputs=x, global_batch_size=gbs, **kw)
                pred, infeasible = plan.predicted.step_time_s, False
            except infeasible_error:
                pred, infeasible = None, True
            if case["kind"] == "oom":
                rows.append(f"{case['id']}: OOM in reality, {'refused' if infeasible else 'NOT refused'}")
                continue
            meas = g.measured_seconds(case)
            if meas is None:
                rows.append(f"{case['id']}: no measured time")
                continue
            if infeasible:
                errs.append((case["id"], 1.0, True))
                rows.append(f"{case['id']}: ran in reality ({meas:.2f}s), planner says infeasible")
                continue
            e = (pred - meas) / meas
            errs.append((case["id"], abs(e), False))
            rows.append(f"{case['id']}: predicted {pred:.2f}s measured {meas:.2f}s error {e:+.1%} "
                        f"({time.perf_counter() - t0:.0f}s)")
        except Exception as ex:                      # noqa: BLE001 - every row gets a line
            if needs(ex):
                needs_rows.append(case["id"])
                rows.append(f"{case['id']}: NEEDS what compile() lacks: {str(ex)[:120]}")
            else:
                errs.append((case["id"], 1.0, False))
                rows.append(f"{case['id']}: ERROR {type(ex).__name__}: {str(ex)[:150]}")
    return rows, errs, needs_rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=str(HERE / "published-extra.json"), help="the rows to grade")
    ap.add_argument("--grade", default=str(DEFAULT_GRADE), help="the shared protocol, grade.py")
    ap.add_argument("--group", action="append", help="only rows of this group (repeatable)")
    ap.add_argument("--json", metavar="OUT", help="write rows and summary as JSON")
    args = ap.parse_args(argv)

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    g = load_protocol(Path(args.grade))
    cases = json.load(open(args.rows))
    if args.group:
        cases = [c for c in cases if c["group"] in args.group]
    rows, errs, needs_rows = grade(cases, g, g.compile, g.PlanInfeasibleError)
    for r in rows:
        print(r)
    vals = sorted(v for _, v, _ in errs)
    med = statistics.median(vals) if vals else float("nan")
    worst = max(vals) if vals else float("nan")
    worst_id = max(errs, key=lambda r: r[1])[0] if errs else None
    refused = sum(1 for _, _, inf in errs if inf)
    print(f"extra fidelity: {len(vals)} runs graded, median |error| {med:.1%}, worst {worst:.1%} ({worst_id}), "
          f"refused as infeasible {refused}, NEEDS (not graded) {len(needs_rows)}")
    if args.json:
        json.dump(dict(rows=rows, median=med, worst=worst, refused=refused, needs=needs_rows), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
