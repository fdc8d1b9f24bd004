"""Fit a Calibration to measurements by least squares: what closes autotune's loop.

Step time: the cost model is a black box `predict(calibration) -> step times`
(one pinned compile per measured configuration). The fit minimises the sum
of squared log ratios predicted / measured over the trials, so a 10 % miss
weighs the same on a 50 ms and a 5 s configuration, by Levenberg-Marquardt
on the logarithms of the factors (they are positive and span decades, e.g.
gemm_half_flops), with finite-difference Jacobians, each factor clipped to its
valid range. Factors the measurements do not move (no trial crosses a node,
none pipelines) keep their values.

Memory: linear. Per rank, measured = parameters and optimizer state +
grad_mem_scale x gradients + activation_mem_scale x activations +
buffer_mem_scale x buffers + memory_overhead_bytes (all modelled), solved by
non-negative least squares on relative error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from cost_models.calibration import Calibration

__all__ = ["TIME_FACTORS", "FitResult", "fit_memory", "fit_step_times"]

# factor -> (lowest, highest) value the fit may give it. "compute_eff" scales the three
# efficiency plateaus together (one op mix per model: they are not separable from step times).
TIME_FACTORS: dict[str, tuple[float, float]] = {
    "compute_eff": (1e-3, 1.0),
    "device_speed": (1e-2, 1e2),
    "gemm_half_flops": (1e3, 1e14),
    "mem_eff": (1e-3, 1.0),
    "launch_overhead_s": (1e-8, 1e-2),
    "intra_node_bw_eff": (1e-3, 1.0),
    "inter_node_bw_eff": (1e-3, 1.0),
    "intra_node_extra_latency_s": (1e-8, 0.1),
    "inter_node_extra_latency_s": (1e-8, 0.1),
    "collective_base_latency_s": (1e-7, 0.05),
    "dp_overlap": (1e-3, 1.0),
    "pipeline_idle_cost": (1e-3, 1.0),
}
_PLATEAUS = ("matmul_eff_max", "conv_eff_max", "attention_eff_max")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitResult:
    calibration: Calibration
    rms_log_error_before: float  # sqrt(mean(log(pred/meas)^2)) under the starting calibration
    rms_log_error_after: float
    fitted: tuple[str, ...]  # factors the measurements moved
    iterations: int


def _get(cal: Calibration, name: str) -> float:
    return max(getattr(cal, p) for p in _PLATEAUS) if name == "compute_eff" else getattr(cal, name)


def _set(cal: Calibration, values: dict[str, float]) -> Calibration:
    changes = {}
    for name, x in values.items():
        if name == "compute_eff":
            top = max(getattr(cal, p) for p in _PLATEAUS)
            changes.update({p: min(1.0, getattr(cal, p) * x / top) for p in _PLATEAUS})
        else:
            changes[name] = x
    return dataclasses.replace(cal, **changes)


def fit_step_times(predict: Callable[[Calibration], Sequence[float]], measured: Sequence[float],
                   start: Calibration, *, factors: Sequence[str] = tuple(TIME_FACTORS), max_iter: int = 30,
                   source: str = "autotune") -> FitResult:
    """Least-squares calibration of step times; `predict(cal)` returns one time per measurement."""
    y = np.log(np.asarray(measured, dtype=float))
    names = [f for f in factors if f in TIME_FACTORS]
    lo = np.log([TIME_FACTORS[f][0] for f in names])
    hi = np.log([TIME_FACTORS[f][1] for f in names])
    z = np.clip(np.log([max(_get(start, f), TIME_FACTORS[f][0]) for f in names]), lo, hi)

    def cal_at(z_: np.ndarray) -> Calibration:
        return _set(start, {f: float(math.exp(v)) for f, v in zip(names, z_)})

    def residual(z_: np.ndarray) -> np.ndarray:
        return np.log(np.asarray(predict(cal_at(z_)), dtype=float)) - y

    r = residual(z)
    before = float(np.sqrt(np.mean(r ** 2)))
    cost, lam, moved, it = float(r @ r), 1e-2, set(), 0
    h = 0.05
    for it in range(1, max_iter + 1):
        J = np.zeros((len(y), len(names)))
        for j in range(len(names)):
            zj = z.copy()
            # step inward at the upper bound so the difference is taken inside the valid range
            zj[j] = z[j] + h if z[j] + h <= hi[j] else z[j] - h
            J[:, j] = (residual(zj) - r) / (zj[j] - z[j])
        live = np.abs(J).max(axis=0) > 1e-4
        moved |= {n for n, ok in zip(names, live) if ok}
        if not live.any():
            break
        Jl = J[:, live]
        A, g = Jl.T @ Jl, Jl.T @ r
        improved = False
        for _ in range(8):
            step = np.linalg.solve(A + lam * (np.diag(np.diag(A)) + 1e-9 * np.eye(len(A))), -g)
            z_new = z.copy()
            z_new[live] = np.clip(z[live] + step, lo[live], hi[live])
            r_new = residual(z_new)
            c_new = float(r_new @ r_new)
            if c_new < cost:
                improved = cost - c_new > 1e-10 * max(cost, 1e-12)
                z, r, cost, lam = z_new, r_new, c_new, max(lam / 3, 1e-6)
                break
            lam *= 4
        if not improved:
            break
    cal = dataclasses.replace(cal_at(z), source=source)
    return FitResult(calibration=cal, rms_log_error_before=before, rms_log_error_after=float(np.sqrt(cost / len(y))),
                     fitted=tuple(n for n in names if n in moved), iterations=it)


MEMORY_FACTORS = ("grad_mem_scale", "activation_mem_scale", "loss_mem_scale", "buffer_mem_scale",
                  "memory_overhead_bytes")


def fit_memory(measured: Sequence[float], fixed: Sequence[float], terms: dict[str, Sequence[float]],
               start: Calibration) -> Calibration:
    """The memory factors from per-rank peaks, by least squares on relative error, all factors >= 0.

    Per rank: measured ~ fixed + sum over factors of factor x its term + memory_overhead_bytes, where
    `fixed` is what is allocated as modelled (parameters and optimizer state) and terms[f] the bytes
    factor f scales, modelled with f = 1 (a factor of MEMORY_FACTORS but the overhead). Each row is
    divided by its measurement, so a small rank's 10 % weighs what a large one's does. A factor whose
    term no rank has (no buffers anywhere) keeps its value; one the fit would make negative is 0.
    """
    y = np.asarray(measured, dtype=float)
    names = [f for f in MEMORY_FACTORS[:-1] if f in terms]
    if len(y) == 0:
        return start
    X = np.stack([np.asarray(terms[f], float) for f in names] + [np.ones(len(y))], axis=1) / y[:, None]
    names.append("memory_overhead_bytes")
    rhs = (y - np.asarray(fixed, dtype=float)) / y
    live = [j for j in range(X.shape[1]) if np.abs(X[:, j]).max() > 1e-12]
    coef = np.zeros(0)
    # active set: drop the most negative factor and refit until none is negative
    while live:
        coef = np.linalg.lstsq(X[:, live], rhs, rcond=None)[0]
        if (coef >= 0).all():
            break
        live.pop(int(np.argmin(coef)))
    values = {n: (0.0 if np.abs(X[:, j]).max() > 1e-12 or n == "memory_overhead_bytes" else getattr(start, n))
              for j, n in enumerate(names)}
    values.update({names[j]: float(c) for j, c in zip(live, coef)})
    return dataclasses.replace(start, **values)
