"""From the ranks' measurements to a Calibration: alpha-beta fits, and the cost models' factors fitted to them.

* A matmul of F FLOP takes t = F_half / P + F / P at a machine's plateau P FLOP/s (the saturating curve of
  calibration.saturating_efficiency: P F / (F + F_half) achieved), so the curve is the alpha-beta line of t
  over F: P = 1 / slope, F_half = intercept x P.
* A collective of n bytes takes t = alpha + n / B (Hockney); per (collective, level, group size) B is the
  algorithm bandwidth, and busbw = B x nccl-tests' bus factor (PERFORMANCE.md: 2(p-1)/p for all-reduce,
  (p-1)/p for all-gather, reduce-scatter and all-to-all, 1 for a send).
* The factors: device_speed, matmul_eff_by_dtype, mem_eff and gemm_half_flops from the curves and the
  elementwise ops' bytes/s against the device preset's peaks; optimizer_eff from torch.optim.AdamW's step
  (bytes as cost_models.optimizer counts them) against the same bandwidth; lowrank_eff from PowerSGD's product
  (a matrix by r columns) and loss_eff from a cross entropy's forward and backward against the elementwise ops'
  rate; attention_eff_max from the fused
  attention's rate (FLOP as the tracer counts them); launch_overhead_s the per-op overhead; dp_overlap
  the share of an all-reduce that hid behind matmuls; then per link level its bw_eff and
  extra latency, and collective_base_latency_s, fitted by cost_models.fit as
  cost_models.comm.CommModel prices it, to the all-reduces, so the planner's own formulas
  reproduce the sweep; last, each other collective's own bandwidth factor against that fit
  (collective_bw_eff: Gloo's all-gather and reduce-scatter are slower than its all-reduce, where the ring
  formulas price them alike).

>>> fit_alpha_beta([1e3, 1e6, 1e7], [1e-4 + 1e3 / 1e9, 1e-4 + 1e6 / 1e9, 1e-4 + 1e7 / 1e9])
(0.0001, 1000000000.0)
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from cost_models.calibration import Calibration
from cost_models.comm import CommModel
from cost_models.fit import TIME_FACTORS, fit_step_times
from cost_models.topology import Topology

__all__ = ["BUS_FACTOR", "derive_calibration", "fit_alpha_beta", "summarise"]


def BUS_FACTOR(op: str, p: int) -> float:
    """nccl-tests' busbw / algbw for `op` on p ranks."""
    return {"all_reduce": 2 * (p - 1) / p, "p2p": 1.0}.get(op, (p - 1) / p)


def fit_alpha_beta(x: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(alpha s, bandwidth x/s) of t = alpha + x / bandwidth, least squares on relative error (a 10 % miss on a
    4 KiB message weighs what it does on 16 MiB), both terms >= 0. rounded to 6 significant digits."""
    x_, t = np.asarray(x, float), np.asarray(seconds, float)
    A = np.stack([np.ones_like(x_), x_], axis=1) / t[:, None]
    coef = np.linalg.lstsq(A, np.ones_like(t), rcond=None)[0]
    if coef[1] <= 0:  # no size dependence seen: all latency
        coef = np.array([float(np.median(t)), 0.0])
    elif coef[0] < 0:  # through the origin: all bandwidth
        coef = np.array([0.0, float(np.linalg.lstsq(A[:, 1:], np.ones_like(t), rcond=None)[0][0])])
    alpha = float(f"{coef[0]:.6g}")
    return alpha, (float(f"{1 / coef[1]:.6g}") if coef[1] > 0 else float("inf"))


def summarise(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' records as the probe's evidence: medians over ranks, fitted curves and alpha-beta lines."""
    matmul: dict[tuple[str, float], list[float]] = defaultdict(list)
    for r in records:
        for m in r["matmul"]:
            matmul[m["dtype"], m["flops"]].append(m["seconds"])
    curves = {}
    for dtype in sorted({d for d, _ in matmul}):
        pts = sorted((f, statistics.median(s)) for (d, f), s in matmul.items() if d == dtype)
        alpha, flops_per_s = fit_alpha_beta([f for f, _ in pts], [s for _, s in pts])
        curves[dtype] = {"plateau_flops_per_s": flops_per_s, "half_flops": alpha * flops_per_s,
                         "points": [{"flops": f, "seconds": s} for f, s in pts]}
    comm: dict[tuple[str, str, int], list[tuple[int, float, list[int]]]] = defaultdict(list)
    for c in records[0]["collectives"]:  # the same on every rank: each point is the slowest rank's time
        comm[c["op"], c["level"], c["p"]].append((c["bytes"], c["seconds"], c["ranks"]))
    lines = []
    for (op, level, p), pts in sorted(comm.items()):
        alpha, algbw = fit_alpha_beta([b for b, _, _ in pts], [s for _, s, _ in pts])
        lines.append({"op": op, "level": level, "p": p, "ranks": pts[0][2], "alpha_s": alpha,
                      "algbw_bytes_per_s": algbw, "busbw_bytes_per_s": algbw * BUS_FACTOR(op, p),
                      "points": [{"bytes": b, "seconds": s} for b, s, _ in pts]})
    stream = statistics.median(r["stream"]["bytes"] / r["stream"]["seconds"] for r in records)
    elementwise = statistics.median(r["elementwise"]["bytes"] / r["elementwise"]["seconds"] for r in records)
    optimizer = statistics.median(r["optimizer"]["bytes"] / r["optimizer"]["seconds"] for r in records)
    lowrank = [r["lowrank"]["bytes"] / r["lowrank"]["seconds"] for r in records if "lowrank" in r]
    loss = [r["loss"]["bytes"] / r["loss"]["seconds"] for r in records if "loss" in r]
    ov = {k: statistics.median(r["overlap"][k] for r in records) for k in records[0]["overlap"]}
    return {"ranks": len(records), "devices": sorted({r["device"] for r in records}),
            "fixed_process_bytes": int(statistics.median(r["fixed_process_bytes"] for r in records)),
            "op_overhead_s": statistics.median(r["op_overhead_s"] for r in records),
            "memory_bytes_per_s": stream, "elementwise_bytes_per_s": elementwise, "optimizer_bytes_per_s": optimizer,
            **({"lowrank_bytes_per_s": statistics.median(lowrank)} if lowrank else {}),  # older records lack it
            **({"loss_bytes_per_s": statistics.median(loss)} if loss else {}),
            "overlap": {**ov, "hidden_fraction": min(1.0, max(0.0, (ov["compute_s"] + ov["comm_s"] - ov["both_s"])
                                                              / ov["comm_s"]))},
            "matmul": curves, "attention": _attention_summary(records), "collectives": lines}


def _attention_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    att = [r["attention"] for r in records if r.get("attention")]
    if not att:
        return None
    return {"dtype": att[0]["dtype"], "shape": att[0]["shape"], "flops": att[0]["flops"],
            "flops_per_s": statistics.median(a["flops"] / a["seconds"] for a in att)}


def _attention_eff_max(cal: Calibration, dev, attention: dict[str, Any] | None) -> float:
    """attention_eff_max such that the cost model prices the probe's attention at its measured rate: the
    saturating curve's F / (F + F_half) undone, and Calibration.plateau's scaling by the dtype's measured matmul
    plateau undone (it multiplies attention_eff_max by matmul_eff_by_dtype[dtype] / matmul_eff_max)."""
    if not attention or attention["dtype"] not in dev.peak_flops:
        return cal.attention_eff_max
    f = attention["flops"]
    eff = attention["flops_per_s"] / (dev.peak_flops[attention["dtype"]] * cal.device_speed)
    plateau = eff * (f + cal.gemm_half_flops) / f
    measured = dict(cal.matmul_eff_by_dtype).get(attention["dtype"])
    own = plateau * cal.matmul_eff_max / measured if measured else plateau
    return min(1.0, max(1e-4, own))


def derive_calibration(topo: Topology, evidence: dict[str, Any], *, source: str) -> Calibration:
    """The Calibration whose factors reproduce `evidence` (summarise's) under the cost models (module docstring)."""
    dev = topo.device
    curves = {d: c for d, c in evidence["matmul"].items() if d in dev.peak_flops}
    ratios = [c["plateau_flops_per_s"] / dev.peak_flops[d] for d, c in curves.items()]
    # the cost model's memory-bound ops are torch's elementwise kernels: their rate, not a copy's, is its mem_eff
    bw = evidence["elementwise_bytes_per_s"]
    speed = max([1.0, bw / dev.hbm_bytes_per_s, *ratios])
    lo, hi = TIME_FACTORS["gemm_half_flops"]
    half = [c["half_flops"] for c in curves.values() if c["half_flops"] > 0]
    start = Calibration.for_device(dev.name)
    cal = dataclasses.replace(
        # speed is the largest of these ratios, so each factor is at most 1 but for rounding (1.0000000000000002)
        start, device_speed=speed, mem_eff=min(1.0, bw / (dev.hbm_bytes_per_s * speed)),
        optimizer_eff=min(1.0, evidence["optimizer_bytes_per_s"] / (dev.hbm_bytes_per_s * speed)),
        # PowerSGD's products against the elementwise rate bw (= hbm x speed x mem_eff); older files lack them
        lowrank_eff=min(1.0, evidence.get("lowrank_bytes_per_s", bw) / bw),
        loss_eff=min(1.0, evidence["loss_bytes_per_s"] / bw) if "loss_bytes_per_s" in evidence else start.loss_eff,
        dp_overlap=evidence["overlap"]["hidden_fraction"],
        matmul_eff_by_dtype=tuple((d, min(1.0, r / speed)) for d, r in zip(curves, ratios)),
        gemm_half_flops=min(hi, max(lo, statistics.median(half))) if half else start.gemm_half_flops,
        launch_overhead_s=evidence["op_overhead_s"], probe=evidence, source=source)
    cal = dataclasses.replace(cal, attention_eff_max=_attention_eff_max(cal, dev, evidence.get("attention")))
    return _fit_links(topo, cal, evidence["collectives"])


_LINK_OPS = ("all_reduce",)  # what the links' factors are fitted to; each other collective gets its own


def _fit_links(topo: Topology, cal: Calibration, lines: list[dict[str, Any]]) -> Calibration:
    points = [(ln, pt) for ln in lines for pt in ln["points"] if ln["op"] in _LINK_OPS] \
        or [(ln, pt) for ln in lines for pt in ln["points"]]
    if not points:
        return cal
    levels = sorted({ln["level"] for ln in lines})
    factors = [f for lvl in levels for f in (f"{lvl}_bw_eff", f"{lvl}_extra_latency_s")]
    factors.append("collective_base_latency_s")

    def predict(c: Calibration) -> list[float]:
        m = CommModel(topo, c)
        return [_priced(m, ln["op"], ln["ranks"], pt["bytes"]) for ln, pt in points]

    # Start the extra latencies off their floor: the fit works on log factors, and a factor at 1e-8 s moves no
    # time enough for its effect to be seen. Many points per factor and no prior: the sweep is the truth.
    seeded = dataclasses.replace(cal, **{f"{lvl}_extra_latency_s": 1e-5 for lvl in levels})
    res = fit_step_times(predict, [pt["seconds"] for _, pt in points], seeded, factors=factors, prior_sigma=None,
                         max_free=len(factors), max_iter=40, source=cal.source)
    return _fit_collective_factors(topo, res.calibration, [ln for ln in lines if ln["op"] not in _LINK_OPS])


def _fit_collective_factors(topo: Topology, cal: Calibration, lines: list[dict[str, Any]]) -> Calibration:
    """Each measured collective's own bandwidth factor (Calibration.collective_bw_eff) on top of the shared fit.

    With the shared factors fixed, a point of `op` takes t(g) = l + g b, g = 1 / factor: b its bandwidth term
    (twice what halving the time's bandwidth term saves), l the rest. Over the points where b is at least
    half the modelled time, the g that minimises their squared relative error has a closed form."""
    factors = {}
    for op in sorted({ln["op"] for ln in lines}):
        num = den = 0.0
        for ln in (x for x in lines if x["op"] == op):
            for pt in ln["points"]:
                t1, t2 = (_op_time(topo, cal, op, ln["ranks"], pt["bytes"], f) for f in (1.0, 2.0))
                b = 2 * (t1 - t2)
                if b < t1 - b:
                    continue  # latency-bound: the shared fit's latencies price it, and noise would set the factor
                u, v = b / pt["seconds"], 1 - (t1 - b) / pt["seconds"]
                num, den = num + u * v, den + u * u
        if den > 0 and num > 0:
            factors[op] = float(f"{min(20.0, max(0.05, den / num)):.4g}")
    return dataclasses.replace(cal, collective_bw_eff=factors)


def _op_time(topo: Topology, cal: Calibration, op: str, ranks: list[int], nbytes: float, factor: float) -> float:
    return _priced(CommModel(topo, dataclasses.replace(cal, collective_bw_eff={op: factor})), op, ranks, nbytes)


def _priced(m: CommModel, op: str, ranks: list[int], nbytes: float) -> float:
    """What the comm model says one measured point of the sweep takes (a send goes between its two ranks)."""
    return m.p2p(nbytes, *ranks) if op == "p2p" else getattr(m, op)(nbytes, ranks)
