"""Before training: is the user's loss one the plan averages as one process does?

A plan averages its pieces' losses, as Megatron and DeepSpeed do: each of m microbatches counts 1 / m, the replicas
and context slices are averaged. That is one process's loss only for a mean over the rows of a batch.

- A loss that sums its rows (`reduction="sum"`) would train on 1 / pieces of it: refused (`LaunchError`), with
  the fix, `runtime.summed(loss_fn)`.
- A mean over what the rows hold unequally (the tokens that count, with labels of -100 falling unevenly over a
  padded batch) weighs each piece alike where one process weighs each token: warned (UserWarning), with the
  fix, `runtime.per_token(loss_fn, count)`.

Told on the first rows of the first batch (`runtime.engines.step.reduction_over_rows`: the model in eval mode on
the rows together and on each alone), for models within verify's size. Both launchers run it before any step:
`launch_local` before it spawns the ranks, `runtime.run` (torchrun, srun) on rank 0 while the others wait.
Not where the model computes a router's load-balancing loss, which couples the rows on purpose (the runtime
reduces it over the replicas, runtime.experts).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from runtime.launch.env import LaunchError

__all__ = ["loss_check_applies", "check_loss_reduction"]


def _config(plan: Any) -> dict[str, int] | None:
    """dp, cp, num_microbatches and microbatch_size of a Plan or of its JSON (a dict); None without them."""
    c = plan.get("config") if isinstance(plan, Mapping) else getattr(plan, "config", None)
    if c is None:
        return None
    get = c.get if isinstance(c, Mapping) else (lambda k, d=None: getattr(c, k, d))
    try:
        return {k: int(get(k, 1)) for k in ("dp", "cp", "num_microbatches", "microbatch_size")}
    except (TypeError, ValueError):
        return None


def loss_check_applies(plan: Any, loss_fn: Callable) -> bool:
    """Whether `check_loss_reduction` has something to check: the plan splits the batch, the loss is not already
    a per_token or summed one, the model computes no load-balancing loss and is within verify's size. The same
    answer on every rank (a plan and a loss alone)."""
    from runtime.engines.token_loss import PerToken, Summed
    from runtime.verify.check import MAX_VERIFY_ELEMENTS, num_parameters

    c = _config(plan)
    if c is None or isinstance(loss_fn, (PerToken, Summed)) or c["dp"] * c["cp"] * c["num_microbatches"] == 1:
        return False
    aux = plan.get("load_balancing_loss", False) if isinstance(plan, Mapping) else \
        getattr(plan, "load_balancing_loss", False)
    n = num_parameters(plan)
    return not aux and n is not None and n <= MAX_VERIFY_ELEMENTS


def check_loss_reduction(plan: Any, model_fn: Callable, loss_fn: Callable, batch: Any) -> None:
    """Refuse a summed loss (LaunchError), warn of a loss that is not a mean over rows under a plan that splits the
    batch into rows (see the module docstring); nothing where `loss_check_applies` does not, or it cannot be
    told."""
    from runtime.engines.step import reduction_over_rows
    from runtime.verify.check import num_parameters

    if not loss_check_applies(plan, loss_fn):
        return
    c = _config(plan)
    found = reduction_over_rows(model_fn(), loss_fn, batch, rows=_rows_to_check(batch, num_parameters(plan) or 1))
    if c is None or found is None:
        return
    kind, whole, parts = found
    pieces, replicas, rows = c["num_microbatches"] * c["dp"] * c["cp"], c["dp"] * c["cp"], len(parts)
    if kind == "sum":
        raise LaunchError(
            f"loss_fn sums over the rows of its batch: on the first {rows} rows of batches[0] it gives {whole:.6g}, "
            f"the sum of the rows' own losses ({_listed(parts)}), not their mean. This plan splits each batch into "
            f"{pieces} pieces ({c['num_microbatches']} microbatch(es) on each of {replicas} replica(s)) and averages "
            f"their losses, as Megatron and DeepSpeed do, so it would train on 1/{pieces} of the loss one process "
            "computes. Pass runtime.summed(loss_fn), which counts every microbatch whole (one process's sum over the "
            "batch), or return a mean over the rows")
    row_pieces = c["num_microbatches"] * c["dp"]
    if kind != "weighted" or row_pieces == 1:
        return
    warnings.warn(
        f"loss_fn is not a mean over the rows of its batch: on the first {rows} rows of batches[0] it gives "
        f"{whole:.6g}, where the mean of the rows' own losses is {sum(parts) / rows:.6g} (rows: "
        f"{_listed(parts)}), as a mean over the tokens that count does when the labels of -100 fall unevenly. "
        f"This plan averages the losses of its {row_pieces} pieces of {c['microbatch_size']} row(s) "
        f"({c['num_microbatches']} microbatch(es) on each of {c['dp']} replica(s)), each weighed alike as "
        "Megatron and DeepSpeed do, so it trains on another loss than one process on the whole batch. Pass "
        "runtime.per_token(loss_fn, count), count(inputs, targets) giving what a piece's loss averages over "
        "(examples.training.target_tokens, labelled_tokens), and each piece weighs its share of the batch",
        stacklevel=3)


def _rows_to_check(batch: Any, parameters: int, flops: float = 4e10) -> int:
    """How many rows of the batch the check runs (together, then one by one): 8, fewer where their forwards would
    pass `flops` (about a second on a CPU; 2 FLOPs per parameter and token, twice), at least 2."""
    first = next((t for t in pytree.tree_leaves(batch[0]) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if first is None or first.shape[0] == 0:
        return 2
    tokens = max(1, first.numel() // first.shape[0])
    return max(2, min(8, int(flops // (4 * tokens * max(1, parameters)))))


def _listed(values: Sequence[float], most: int = 4) -> str:
    shown = ", ".join(f"{v:.6g}" for v in values[:most])
    return shown + (f", ... ({len(values)} in all)" if len(values) > most else "")
