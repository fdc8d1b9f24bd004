"""plan.verify's second half: the plan's reductions applied to the generated code's gradients, and the comparisons.

`gathered_grads` puts every parameter's gradient together as the plan's
runtime would: tied copies summed over their pipeline holders (and their
tie group checked), tensor-parallel shards put back together with
`unshard_parameter`, replicated parameters required to agree on every
tensor slice (a slice holding only its share of a gradient would drift).
`compare` is `torch.isclose` with the largest absolute and relative error.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.utils._pytree as pytree

from runtime.pipeline.tensor_parallel import unshard_parameter
from runtime.verify.run import Setup, VerifyError

__all__ = ["ROUNDING_FACTOR", "Diff", "compare", "compare_all", "gathered_grads", "leaves", "within_rounding"]

# A difference up to this many times the module's own fp32 rounding (its fp32 result against its fp64 one) is
# rounding: two fp32 orders of the same sums differ by about twice it, and a wrong program by the values' scale.
ROUNDING_FACTOR = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class Diff:
    """One comparison: ok, and the largest absolute and relative (to the reference's scale) error."""

    what: str
    ok: bool
    max_abs: float
    max_rel: float
    note: str = ""

    def __str__(self) -> str:
        extra = f" ({self.note})" if self.note else ""
        return f"{self.what}: max abs error {self.max_abs:.3g}, max rel error {self.max_rel:.3g}{extra}"


def compare(what: str, got: torch.Tensor | None, want: torch.Tensor | None, rtol: float, atol: float) -> Diff:
    """`got` (the generated code's) against `want` (the module's); a missing one counts as zeros."""
    if got is None and want is None:
        return Diff(what=what, ok=True, max_abs=0.0, max_rel=0.0)
    if got is None or want is None:
        t = got if want is None else want
        got, want = (torch.zeros_like(t) if got is None else got), (torch.zeros_like(t) if want is None else want)
        missing = "the generated code gives none" if got is not t else "the module gives none"
    else:
        missing = ""
    if got.shape != want.shape:
        return Diff(what=what, ok=False, max_abs=math.inf, max_rel=math.inf,
                    note=f"shape {tuple(got.shape)} != the module's {tuple(want.shape)}")
    got, want = got.detach().float(), want.detach().float()
    # An element's rounding error follows the magnitude of the terms summed into it, not its own value (a
    # logit near 0 is a sum of terms of the tensor's scale): elements are held to rtol of the tensor's rms as
    # well as of themselves. Generated code may compute in another order than the module (a fused attention
    # for an eager one), so atol alone would fail sound code on elements that cancel.
    atol = max(atol, rtol * float(want.square().mean().sqrt())) if want.numel() else atol
    ok = bool(torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True).all())
    d = (got - want).abs()
    d = torch.where(torch.isnan(got) & torch.isnan(want), torch.zeros_like(d), d)
    max_abs = float(d.max()) if d.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    return Diff(what=what, ok=ok, max_abs=max_abs, max_rel=rel, note=missing if not ok else "")


def leaves(out: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def gathered_grads(st: Setup, names: list[str]) -> tuple[dict[str, torch.Tensor | None], list[Diff]]:
    """Every parameter's gradient as the plan's reductions make it: tied copies summed over their pipeline
    holders, shards put back together, replicated ones checked equal on every slice."""
    out: dict[str, torch.Tensor | None] = {}
    disagree: list[Diff] = []
    for name in names:
        per_slice: list[torch.Tensor | None] = []
        like: list[torch.Tensor] = []  # each slice's copy of the parameter (a zero gradient's shape)
        spec, fused = "R", 1
        for t in range(st.facts.tp):
            holders = [rk for (p, tt), rk in sorted(st.ranks.items()) if tt == t and name in rk.params]
            if not holders:
                per_slice.append(None)
                continue
            tied = holders[0].ns.get("TIED", ())
            # a parameter that trains nothing has no gradient to keep in step: each holder keeps its own copy
            frozen = not holders[0].params[name].requires_grad
            if len(holders) > 1 and name not in tied and not frozen:
                raise VerifyError(f"parameter {name} is read by pipeline ranks {[h.pp for h in holders]} but is not "
                                  f"in their programs' TIED {tuple(tied)}: its copies would get separate gradients "
                                  "and drift apart; the codegen must list it as tied")
            groups = holders[0].ns.get("TIE_GROUPS")
            ranks = tuple(sorted(h.rank for h in holders))
            if len(holders) > 1 and groups is not None and ranks not in groups and not frozen:
                raise VerifyError(f"tied parameter {name} is held by ranks {ranks}, but the programs sum tied "
                                  f"gradients over TIE_GROUPS {tuple(groups)}, which has no such group: the copies "
                                  "would drift apart; the codegen's tie groups are wrong")
            spec, fused = holders[0].ns.get("PLACEMENTS", {}).get(name, ("R", 1))
            like.append(holders[0].params[name])
            grads = [h.params[name].grad for h in holders if h.params[name].grad is not None]
            per_slice.append(sum(grads[1:], grads[0].clone()) if grads else None)
        if all(g is None for g in per_slice):
            out[name] = None
            continue
        if len(like) < st.facts.tp:
            raise VerifyError(f"parameter {name} is held on {len(like)} of the {st.facts.tp} tensor slices: every "
                              "slice's programs must hold every parameter they compute with")
        per_slice = [g if g is not None else torch.zeros_like(p) for g, p in zip(per_slice, like)]
        if spec != "R" and st.facts.tp > 1:
            out[name] = unshard_parameter(per_slice, spec, fused)
            continue
        out[name] = per_slice[0]
        for t in range(1, st.facts.tp):
            d = compare(f"gradient of replicated {name}, tensor slice {t} vs slice 0", per_slice[t], per_slice[0],
                        st.rtol, st.atol)
            if not d.ok:  # each slice holds only its share: the sum over the tensor group (tp_copy) is missing
                disagree.append(dataclasses.replace(d, note="the slices must agree on a replicated parameter's "
                                                            "gradient, or its copies drift apart: is an all-reduce "
                                                            "over the tensor group (tp_copy) missing?"))
    return out, disagree


def compare_all(st: Setup, ref_out: Any, ref_loss: torch.Tensor, outs: list[Any], losses: list[torch.Tensor],
                ) -> tuple[list[Diff], list[Diff], int]:
    """(mismatches, all comparisons, gradients compared)."""
    diffs: list[Diff] = []
    want = leaves(ref_out)
    for t, (out, loss) in enumerate(zip(outs, losses)):
        got = leaves(out)
        if len(got) != len(want):
            diffs.append(Diff(what=f"model outputs (tensor slice {t})", ok=False, max_abs=math.inf, max_rel=math.inf,
                              note=f"{len(got)} floating tensors, the module returns {len(want)}"))
        for i, (a, b) in enumerate(zip(got, want)):
            diffs.append(compare(f"model output {i} (tensor slice {t})", a, b, st.rtol, st.atol))
        diffs.append(compare(f"loss (tensor slice {t})", loss, ref_loss, st.rtol, st.atol))
    names = [n for n, _ in st.reference.named_parameters()]
    grads, disagree = gathered_grads(st, names)
    ref = dict(st.reference.named_parameters())
    n = 0
    for name in names:
        if grads[name] is None and ref[name].grad is None:
            continue
        n += 1
        diffs.append(compare(f"gradient of {name}", grads[name], ref[name].grad, st.rtol, st.atol))
    diffs += disagree
    return [d for d in diffs if not d.ok], diffs, n


def within_rounding(bad: list[Diff], floor: dict[str, float]) -> list[Diff]:
    """Of the mismatches `bad`, those beyond `ROUNDING_FACTOR` times the module's own fp32 rounding error of the
    same value (`floor`: "model output i", "loss", "gradient of name" -> the largest |fp32 - fp64| of the module):
    a model that amplifies rounding (Gemma 4's, by 5x past rtol over four layers) is not failed for it, where a
    wrong program, off by its values' scale, still is. A value with no floor, or one off by inf, stays."""
    out = []
    for d in bad:
        key = d.what.split(" (tensor slice")[0]
        limit = ROUNDING_FACTOR * floor.get(key, 0.0)
        if not (math.isfinite(d.max_abs) and d.max_abs <= limit):
            out.append(d)
    return out
