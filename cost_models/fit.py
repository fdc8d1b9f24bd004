"""Fit a Calibration to measurements by least squares: what closes autotune's loop.

Step time: the cost model is a black box `predict(calibration) -> step times`
(one pinned compile per measured configuration). The fit minimises the sum
of squared log ratios predicted / measured over the trials, so a 10 % miss
weighs the same on a 50 ms and a 5 s configuration, by Levenberg-Marquardt
on the logarithms of the factors (they are positive and span decades, e.g.
gemm_half_flops), with finite-difference Jacobians, each factor clipped to its
valid range.

A few trials cannot pin a dozen factors: fitted freely, 3 trials are matched
exactly (rms 0) by factors that then mispredict the next configuration. So the
fit generalises in two ways (`select_factors`, the prior rows of the residual):
  * it frees only the factors the trials identify: greedily, the factor whose
    effect on the trials' log times is largest and least like the already
    chosen ones' (Gram-Schmidt with pivoting on the Jacobian), chosen again where
    the fit stands after each round (at the start a slow device can hide what
    the links cost), at most `max_free` of them in all, by default one fewer
    than the trials (so a fit
    always leaves a residual that says how well the model explains them);
    factors the measurements do not move (no trial crosses a node, none
    pipelines) or move only as a chosen factor does keep their values;
  * the freed factors are pulled toward the start (a probe's calibration, or
    the literature defaults): a Gaussian prior of width `prior_sigma` in log
    space against measurement noise `noise`, i.e. residual rows
    (noise / prior_sigma) * (log f - log f_start) beside the trials' rows.
`leave_one_out` refits without each trial in turn and predicts it: the
held-out error, what the fit will do on the next configuration.

Memory: linear. Per rank, measured = parameters and optimizer state +
grad_mem_scale x gradients + activation_mem_scale x activations +
buffer_mem_scale x buffers + memory_overhead_bytes (all modelled), solved by
non-negative least squares on relative error.

>>> import dataclasses
>>> work = [1.0, 2.0, 4.0]                                   # seconds at device_speed 1
>>> measured = [w / 2 for w in work]                         # a machine twice as fast
>>> predict = lambda cal: [w / cal.device_speed for w in work]
>>> res = fit_step_times(predict, measured, Calibration(), factors=("device_speed",), prior_sigma=None)
>>> round(res.calibration.device_speed, 4), res.fitted
(2.0, ('device_speed',))
>>> [round(e, 6) for e in leave_one_out(lambda cal, i: predict(cal)[i], measured, Calibration(),
...                                     factors=("device_speed",), prior_sigma=None)]
[0.0, 0.0, 0.0]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from cost_models.calibration import Calibration

__all__ = ["TIME_FACTORS", "FitResult", "fit_memory", "fit_step_times", "leave_one_out", "select_factors"]

# factor -> (lowest, highest) value the fit may give it. "compute_eff" scales the three
# efficiency plateaus together (one op mix per model: they are not separable from step times).
# A link's bw_eff may pass 1 where a probe found it faster than its preset (calibration.py).
TIME_FACTORS: dict[str, tuple[float, float]] = {
    "compute_eff": (1e-3, 1.0),
    "device_speed": (1e-2, 1e2),
    "gemm_half_flops": (1e3, 1e14),
    "mem_eff": (1e-3, 1.0),
    # the optimizer step: trials separate it where they shard or split the parameters differently (ZeRO >= 1,
    # pp, tp: its share of the step moves) from the compute that scales with FLOPs per rank
    "optimizer_eff": (1e-3, 1.0),
    "launch_overhead_s": (1e-8, 1e-2),
    "intra_node_bw_eff": (1e-3, 1e2),
    "inter_node_bw_eff": (1e-3, 1e2),
    "intra_node_extra_latency_s": (1e-8, 0.1),
    "inter_node_extra_latency_s": (1e-8, 0.1),
    "collective_base_latency_s": (1e-7, 0.05),
    "dp_overlap": (1e-3, 1.0),
    "pipeline_idle_cost": (1e-3, 1.0),
    "expert_imbalance": (1.0, 8.0),
}
_PLATEAUS = ("matmul_eff_max", "conv_eff_max", "attention_eff_max")
_SENSITIVE = 1e-4  # |d log t / d log f| below this on every trial: the trials do not see the factor
_STEP = 0.05  # finite-difference step in log f


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitResult:
    calibration: Calibration
    rms_log_error_before: float  # sqrt(mean(log(pred/meas)^2)) under the starting calibration
    rms_log_error_after: float
    fitted: tuple[str, ...]  # factors the fit was free to move (those the trials identify)
    iterations: int


def _get(cal: Calibration, name: str) -> float:
    return max(getattr(cal, p) for p in _PLATEAUS) if name == "compute_eff" else getattr(cal, name)


def _set(cal: Calibration, values: dict[str, float]) -> Calibration:
    changes = {}
    for name, x in values.items():
        if name == "compute_eff":
            top = max(getattr(cal, p) for p in _PLATEAUS)
            changes.update({p: min(1.0, getattr(cal, p) * x / top) for p in _PLATEAUS})
            # the probe's per-dtype plateaus move with them: one op mix, one scale
            changes["matmul_eff_by_dtype"] = tuple((d, min(1.0, e * x / top)) for d, e in cal.matmul_eff_by_dtype)
        else:
            changes[name] = x
    return dataclasses.replace(cal, **changes)


def select_factors(J: np.ndarray, limit: int, *, tol: float = 1e-3) -> list[int]:
    """Columns of J (trials x factors) the rows identify, at most `limit`, most informative first.

    Greedy pivoted Gram-Schmidt: take the column of largest norm, remove its direction from the
    rest, repeat; stop when no remaining column keeps `tol` of the largest norm (it only repeats
    what the chosen ones do, or the trials do not see it).

    >>> select_factors(np.array([[1.0, 2.0, 0.0], [1.0, 2.0, 0.0]]), 3)   # the 2nd twice the 1st, the 3rd unseen
    [1]
    """
    R = np.array(J, dtype=float, copy=True)
    norms = np.linalg.norm(R, axis=0)
    if R.size == 0 or norms.max(initial=0.0) < _SENSITIVE:
        return []
    floor = max(tol * norms.max(), _SENSITIVE)
    chosen: list[int] = []
    while len(chosen) < limit:
        left = np.linalg.norm(R, axis=0)
        left[chosen] = 0.0
        j = int(np.argmax(left))
        if left[j] < floor:
            break
        chosen.append(j)
        q = R[:, j] / left[j]
        R -= np.outer(q, q @ R)
    return chosen


_RESELECT = 3  # rounds of choosing the free factors and fitting them


def _levenberg_marquardt(residual: Callable[[np.ndarray], np.ndarray],
                         jacobian: Callable[[np.ndarray, np.ndarray], np.ndarray], z: np.ndarray, zs: np.ndarray,
                         lo: np.ndarray, hi: np.ndarray, w: float, max_iter: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Minimise |residual(z)|^2 + w^2 |z - zs|^2 within [lo, hi]: (z, its residual, iterations)."""
    r = residual(z)

    def augmented(r_: np.ndarray, z_: np.ndarray) -> np.ndarray:
        return np.concatenate([r_, w * (z_ - zs)])

    cost, lam, it = float(augmented(r, z) @ augmented(r, z)), 1e-2, 0
    for it in range(1, max_iter + 1):
        J = np.vstack([jacobian(z, r), w * np.eye(len(z))])
        ra = augmented(r, z)
        A, g = J.T @ J, J.T @ ra
        improved = False
        for _ in range(8):
            step = np.linalg.solve(A + lam * (np.diag(np.diag(A)) + 1e-9 * np.eye(len(A))), -g)
            z_new = np.clip(z + step, lo, hi)
            r_new = residual(z_new)
            c_new = float(augmented(r_new, z_new) @ augmented(r_new, z_new))
            if c_new < cost:
                improved = cost - c_new > 1e-10 * max(cost, 1e-12)
                z, r, cost, lam = z_new, r_new, c_new, max(lam / 3, 1e-6)
                break
            lam *= 4
        if not improved:
            break
    return z, r, it


def fit_step_times(predict: Callable[[Calibration], Sequence[float]], measured: Sequence[float],
                   start: Calibration, *, factors: Sequence[str] = tuple(TIME_FACTORS), max_iter: int = 30,
                   source: str = "autotune", prior_sigma: float | None = 0.5, noise: float = 0.05,
                   max_free: int | None = None) -> FitResult:
    """Regularised least-squares calibration of step times; `predict(cal)` returns one time per measurement.

    prior_sigma: width of the prior around `start`'s factors, in log space (0.5: a factor of ~1.6 is one
    sigma); None fits without a prior. noise: the measurements' own spread in log space (5 %).
    max_free: at most this many factors move (default: one fewer than the measurements, at least one).
    """
    if prior_sigma is not None and not prior_sigma > 0:
        raise ValueError(f"prior_sigma={prior_sigma!r}: must be > 0 (log-space width), or None for no prior")
    y = np.log(np.asarray(measured, dtype=float))
    names = [f for f in factors if f in TIME_FACTORS]
    lo = np.log([TIME_FACTORS[f][0] for f in names])
    hi = np.log([TIME_FACTORS[f][1] for f in names])
    z0 = np.clip(np.log([max(_get(start, f), TIME_FACTORS[f][0]) for f in names]), lo, hi)

    def cal_at(z_: np.ndarray, idx: Sequence[int]) -> Calibration:
        return _set(start, {names[j]: float(math.exp(z_[k])) for k, j in enumerate(idx)})

    def residual(z_: np.ndarray, idx: Sequence[int]) -> np.ndarray:
        return np.log(np.asarray(predict(cal_at(z_, idx)), dtype=float)) - y

    def jacobian(z_: np.ndarray, r_: np.ndarray, idx: Sequence[int]) -> np.ndarray:
        J = np.zeros((len(y), len(idx)))
        for k, j in enumerate(idx):
            zk = z_.copy()
            # step inward at the upper bound so the difference is taken inside the valid range
            zk[k] = z_[k] + _STEP if z_[k] + _STEP <= hi[j] else z_[k] - _STEP
            J[:, k] = (residual(zk, idx) - r_) / (zk[k] - z_[k])
        return J

    every = list(range(len(names)))
    r = residual(z0[every], every)
    before = float(np.sqrt(np.mean(r ** 2))) if len(y) else 0.0
    limit = max(1, len(y) - 1) if max_free is None else max_free
    w = 0.0 if prior_sigma is None else noise / prior_sigma
    z_all, free, it = z0.copy(), [], 0
    # The factors the trials identify are chosen where the fit stands, again after each fit: at the start a
    # slow device can hide what launches and links cost, which the trials show once compute is fitted. The
    # free set only grows, to at most `limit` factors.
    for _ in range(_RESELECT):
        if not len(y):
            break
        r_all = residual(z_all, every) if free else r  # r: the start's residual, before any round
        more = [j for j in select_factors(jacobian(z_all, r_all, every), limit) if j not in free]
        if not more or len(free) >= limit:
            break
        free = sorted(free + more[:limit - len(free)])
        z, r, n = _levenberg_marquardt(lambda z_: residual(z_, free), lambda z_, r_: jacobian(z_, r_, free),
                                       z_all[free], z0[free], lo[free], hi[free], w, max_iter)
        z_all[free], it = z, it + n
    cal = dataclasses.replace(cal_at(z_all[free], free), source=source)
    after = float(np.sqrt(np.mean(r ** 2))) if len(y) else 0.0
    return FitResult(calibration=cal, rms_log_error_before=before, rms_log_error_after=after,
                     fitted=tuple(names[j] for j in free), iterations=it)


def leave_one_out(predict_one: Callable[[Calibration, int], float], measured: Sequence[float], start: Calibration,
                  **fit_options) -> tuple[float, ...]:
    """Held-out log errors: for each measurement i, fit to the others (fit_step_times with `fit_options`) and
    return log(predicted_i / measured_i) under that fit. Their rms is what the fit would miss on a trial it has
    not seen; with one measurement, its prediction under `start`. `predict_one(cal, i)` is trial i's time."""
    out = []
    for i, m in enumerate(measured):
        keep = [j for j in range(len(measured)) if j != i]
        cal = start
        if keep:
            cal = fit_step_times(lambda c: [predict_one(c, j) for j in keep], [measured[j] for j in keep], start,
                                 **fit_options).calibration
        out.append(math.log(predict_one(cal, i) / m))
    return tuple(out)


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
