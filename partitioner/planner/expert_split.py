"""Expert parallelism as the planner costs it: which ep degrees a candidate may take, what a rank holds and sends.

The MoE layers are the tracer's (partitioner.tracer.experts.find_experts). Under ep > 1, as in
Megatron-Core, each MoE layer's E experts are divided over ep ranks taken inside the data-parallel group
(ep divides dp and E; there is no mesh axis of its own: an ep group is ep consecutive data-parallel ranks,
cp * tp ranks apart, so it stays inside a node while ep * cp * tp <= devices per node). Per rank:

- expert parameters, their gradients and optimizer state are E / ep experts' (1/ep of the whole); the
  expert gradients are reduced (and ZeRO shards them) over the dp * cp / ep ranks that hold the same
  experts (Megatron's expert-data-parallel group), the dense ones over dp * cp as without ep;
- expert FLOPs: the ep group's tokens x top_k / E per expert, times E / ep local experts, is this rank's
  own tokens x top_k at a balanced load, which is what the trace counts (its grouped GEMMs run on the
  routed tokens); the busiest rank sets the pace, so under ep > 1 the experts' ops (and the activations
  they keep) are that times `Calibration.expert_imbalance` (default 1.25, Switch Transformer's capacity
  factor; no token dropping);
- two all-to-alls forward per MoE layer (dispatch the routed tokens, combine them back) and two backward
  (their gradients), each of this rank's tokens x top_k x hidden x the compute dtype's bytes, (ep-1)/ep
  of it leaving the rank (`CommModel.all_to_all` over the link level the ep group spans), not overlapped;
  run again where the layer is recomputed.

Programs for ep > 1 are not generated yet (partitioner.codegen.program.not_runnable_ep).

Units: seconds and bytes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from cost_models.errors import DeclarationError
from cost_models.mesh import Mesh
from partitioner.planner.declarations import Declarations, divisors
from partitioner.tracer.experts import MoELayer, common_prefix, find_experts

if TYPE_CHECKING:
    from partitioner.planner.plan import ParallelConfig
    from partitioner.tracer.opgraph import OpGraph

__all__ = ["Experts", "MAX_EP_ACROSS_NODES", "check_experts", "edp_ranks", "ep_options", "ep_ranks", "exchange_bytes",
           "experts_of", "summary"]

MAX_EP_ACROSS_NODES = 2  # ep degrees searched beyond a node: the smallest and the largest (the search stays small)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experts:
    """What the planner needs of a graph's MoE layers.

    layers: the tracer's; params: expert parameter names; nodes: the ops that compute the experts (in the
    experts' module), whose time and kept activations the imbalance scales; exchanges: per MoE layer, its
    combine node and top_k (the all-to-all moves the combine's input tokens x top_k); why_not: why the
    experts cannot be divided over ranks ("" where they can)."""

    layers: tuple[MoELayer, ...] = ()
    params: frozenset[str] = frozenset()
    nodes: frozenset[str] = frozenset()
    exchanges: tuple[tuple[str, int], ...] = ()
    why_not: str = ""

    @property
    def num_experts(self) -> int:
        """The greatest common divisor of the layers' expert counts (what ep must divide); 0 for none."""
        return math.gcd(*(m.num_experts for m in self.layers)) if self.layers else 0

    def expert_params(self, numel: dict[str, int]) -> int:
        return sum(numel[p] for p in self.params)


def experts_of(g: "OpGraph") -> Experts:
    """The MoE layers of `g` as the planner uses them (Experts() for a dense model)."""
    if not any(n.op == "topk" for n in g.nodes):
        return Experts()
    layers = find_experts(g)
    if not layers:
        return Experts()
    odd = [m.module for m in layers if not m.uniform]
    no_combine = [m.module for m in layers if m.combine is None]
    why = ""
    if odd:
        why = (f"experts of different shapes in {', '.join(odd[:3])}{' ...' if len(odd) > 3 else ''}: ranks would "
               "hold unequal shares, which expert parallelism does not divide")
    elif no_combine:
        why = (f"no combine (the weighted sum of the experts' outputs back to tokens) found in "
               f"{', '.join(no_combine[:3])}: the all-to-alls that return the tokens cannot be placed")
    nodes: set[str] = set()
    for m in layers:
        scope = common_prefix([e.rsplit(".", 1)[0] for e in m.experts])
        if m.style == "module_list":  # "...experts.3.w1" -> "...experts"
            scope = scope.rsplit(".", 1)[0] if scope.rsplit(".", 1)[-1].isdigit() else scope
        if scope and scope != m.module:
            nodes.update(n.name for n in g.nodes if n.module_path == scope or n.module_path.startswith(scope + "."))
    return Experts(layers=layers, params=frozenset(p for m in layers for p in m.experts), nodes=frozenset(nodes),
                   exchanges=tuple((m.combine, m.top_k) for m in layers if m.combine is not None), why_not=why)


def check_experts(d: Declarations, experts: Experts) -> None:
    """A pinned ep the model cannot run, refused before anything is searched.

    >>> check_experts(Declarations(global_batch_size=8, ep=2), Experts())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    cost_models.errors.DeclarationError: ep=2: no MoE layer found in the graph: ...
    """
    ep = d.ep
    if ep is None:
        return
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise DeclarationError(f"ep={ep!r}: the expert-parallel degree, an int >= 1 (e.g. ep=4: each MoE layer's "
                               "experts divided over 4 data-parallel ranks), or None for the planner's choice")
    if ep == 1:
        return
    if not experts.layers:
        raise DeclarationError(
            f"ep={ep}: no MoE layer found in the graph: expert parallelism divides a mixture of experts' experts "
            "over ranks, and the tracer found no router (a top-k over a linear's E scores) whose choice reaches "
            "expert weights ([E, ...] tensors or E identical sibling modules); drop ep or pin ep=1")
    if experts.why_not:
        raise DeclarationError(f"ep={ep}: {experts.why_not}; pin ep=1 (the experts then replicate over data "
                               "parallelism like any other parameter)")
    e = experts.num_experts
    if e % ep:
        counts = sorted({m.num_experts for m in experts.layers})
        raise DeclarationError(
            f"ep={ep} does not divide the number of experts ({', '.join(map(str, counts))} per MoE layer): each "
            f"rank must hold the same number of whole experts; valid ep: "
            f"{', '.join(map(str, divisors(e)))}")
    if d.dp is not None and d.dp % ep:
        raise DeclarationError(
            f"ep={ep} does not divide dp={d.dp}: expert-parallel groups are taken inside the data-parallel group "
            f"(Megatron-Core's), so dp must be a multiple of ep; pin dp to a multiple of {ep}, or ep in "
            f"{', '.join(str(x) for x in divisors(math.gcd(d.dp, e)))}")


def ep_options(d: Declarations, experts: Experts, *, dp: int, tp: int, cp: int, devices_per_node: int
               ) -> tuple[int, ...]:
    """The ep a candidate of this (dp, tp, cp) may take: the pinned one where it divides dp; unpinned, 1 for
    a dense model or one whose experts cannot be divided, else 1, every degree dividing dp and E whose
    group stays in a node (ep * cp * tp <= devices per node), and the smallest and largest that do not.

    >>> m = Experts(layers=(MoELayer(module="m", block=0, num_experts=8, top_k=2, router="r", experts=("w",),
    ...     style="batched", uniform=True, expert_params=1, combine="c"),))
    >>> ep_options(Declarations(global_batch_size=8), m, dp=16, tp=2, cp=1, devices_per_node=8)
    (1, 2, 4, 8)
    """
    if d.ep is not None:
        return (d.ep,) if dp % d.ep == 0 else ()
    if not experts.layers or experts.why_not:
        return (1,)
    valid = [e for e in divisors(math.gcd(dp, experts.num_experts)) if e > 1]
    inside = [e for e in valid if e * cp * tp <= devices_per_node]
    across = [e for e in valid if e not in inside]
    return (1, *inside, *dict.fromkeys(across[:1] + across[-1:][:MAX_EP_ACROSS_NODES - 1]))


def ep_ranks(c: "ParallelConfig") -> tuple[int, ...]:
    """The first expert-parallel group: ep consecutive data-parallel ranks (cp * tp apart)."""
    return Mesh(c.pp, c.dp, c.tp, c.cp).dp_ranks()[:c.ep]


def edp_ranks(c: "ParallelConfig", pipeline_rank: int = 0) -> tuple[int, ...]:
    """The ranks that hold the same experts as the first rank of pipeline rank `pipeline_rank` and reduce their
    gradients together: the replicas (dp x cp) whose data-parallel index is a multiple of ep."""
    mesh = Mesh(c.pp, c.dp, c.tp, c.cp)
    return tuple(r for r in mesh.replica_ranks(pp=pipeline_rank) if mesh.coords4(r)[1] % c.ep == 0)


def exchange_bytes(out_bytes: float, top_k: int) -> float:
    """The send buffer of one all-to-all of a MoE layer: its tokens x top_k x hidden, from the combine's output
    bytes (tokens x hidden) on this rank."""
    return out_bytes * top_k


def summary(experts: Experts, c: "ParallelConfig", *, numel: dict[str, int], all_to_all_s: float, level: str,
            declared: bool, cal_imbalance: float) -> str:
    """One paragraph for explain(): what ep divides, what it sends, where its groups sit."""
    layers = experts.layers
    e = experts.num_experts
    total = experts.expert_params(numel)
    if c.ep == 1:
        why = experts.why_not or (
            "ep > 1 was not faster: its all-to-alls of routed tokens and the busiest rank's extra expert load cost "
            "more than the expert memory and gradient traffic it saves" if math.gcd(c.dp, e) > 1
            else f"no ep > 1 divides both dp={c.dp} and the {e} experts")
        return (f"expert parallelism: ep=1 ({'as declared' if declared else why}); the {len(layers)} MoE layers' "
                f"{_count(total)} expert parameters are held whole on every data-parallel rank")
    own = "as declared" if declared else "the planner's choice"
    return (f"expert parallelism over {c.ep} ranks ({own}): each rank holds {e // c.ep} of the {e} experts of each "
            f"of {len(layers)} MoE layers, {_count(total / c.ep)} of {_count(total)} expert parameters (their "
            f"gradients and optimizer state likewise 1/{c.ep}); per step 4 all-to-alls per MoE layer and microbatch "
            f"(dispatch, combine, and their gradients: tokens x top-k x hidden, {c.ep - 1}/{c.ep} leaving the rank) "
            f"take {all_to_all_s * 1e3:.2f} ms over the model's MoE layers"
            + (f" (~{all_to_all_s / c.pp * 1e3:.2f} ms per pipeline rank)" if c.pp > 1 else "")
            + f", groups of {c.ep} data-parallel ranks {c.cp * c.tp} apart, {level}; "
            + (f"expert gradients reduced over dp x cp / ep = {c.replicas // c.ep} ranks, dense ones over {c.replicas}"
               if c.replicas > c.ep else "expert gradients not reduced (no other rank holds the same experts)")
            + f"; expert FLOPs at the busiest rank's load ({cal_imbalance:g} x the mean, "
            "Calibration.expert_imbalance). Costed only: no per-rank program runs ep > 1 yet.")


def _count(n: float) -> str:
    """2.5e9 -> '2.5B', 24576 -> '24.6K'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"
