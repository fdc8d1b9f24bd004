"""Batch statistics the model's own forward turns non-linear: values that split batches cannot reproduce.

Data parallelism (and context parallelism) runs the forward on each rank's share of the batch and averages
the gradients, which equals one process only where the loss is a mean over the batch's rows. A model that
reduces over the batch (a mean over every token) and then combines such statistics non-linearly (a product of
two means, as Switch Transformer's load-balancing loss E * sum_e f_e * P_e) computes on each rank a value whose
mean over ranks is not the batch's. Hugging Face's router loss (`output_router_logits=True`) is recognised and
computed over every rank's tokens by the generated code (partitioner.codegen.segment_ep); any other such value
is found here, from the dataflow of the exported graph, so the planner can refuse to split the batch.

The rule, on floating-point values of the graph (integer ones, such as expert counts used to index, are left
out: they only route each rank's own tokens):
  - a *batch statistic* is a value without the batch size in its shape computed from values with it (a
    reduction over the batch: `probs.mean(0)` of (B*S, E) rows), or computed from batch statistics;
  - its linear uses keep the answer a mean of the ranks' (sums, differences, scaling by anything that is not
    itself a batch statistic, reshapes, further sums); any other use (a product or quotient of two batch
    statistics, a power, an exp, a softmax) makes the rank's value differ from the batch's.

>>> import torch
>>> class Aux(torch.nn.Module):
...     def forward(self, x):                                   # x (B, E)
...         p = torch.softmax(x, -1)
...         return (p.mean(0) * (p > 0.5).float().mean(0)).sum()
>>> ep = torch.export.export(Aux(), (torch.rand(4, 3),), dynamic_shapes=({0: torch.export.Dim("b")},))
>>> [n.name for n in nonlinear_batch_statistics(ep)]
['mul']
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["describe_statistic", "module_path", "nonlinear_batch_statistics", "training_batch_norms"]

_aten = torch.ops.aten
# Uses linear in their batch-statistic operand (each with at most one such operand for mul, div's numerator).
_LINEAR = {
    _aten.add.Tensor, _aten.sub.Tensor, _aten.neg.default, _aten.sum.default, _aten.sum.dim_IntList,
    _aten.mean.default, _aten.mean.dim, _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default,
    _aten.clone.default, _aten.expand.default, _aten.squeeze.dim, _aten.squeeze.dims, _aten.unsqueeze.default,
    _aten.select.int, _aten.slice.Tensor, _aten.cat.default, _aten.stack.default, _aten.permute.default,
    _aten.t.default, _aten.transpose.int, _aten.alias.default, _aten.detach.default, _aten.lift_fresh_copy.default,
    _aten.to.dtype, _aten.to.dtype_layout, _aten._to_copy.default, _aten.add.Scalar, _aten.sub.Scalar,
    _aten.mul.Scalar, _aten.div.Scalar, _aten.copy.default, _aten.copy_.default,
}
_ONE_SIDED = {_aten.mul.Tensor: (0, 1), _aten.div.Tensor: (0,)}  # where a batch statistic may stand alone


def nonlinear_batch_statistics(ep: torch.export.ExportedProgram) -> list[fx.Node]:
    """The nodes of `ep` that use a batch statistic non-linearly (module docstring) and whose value reaches the
    outputs, in graph order; [] where the batch size is not symbolic in the graph (then nothing can be told)."""
    batch = _batch_symbols(ep)
    if not batch:
        return []
    used = _reaching_outputs(ep.graph)  # a value the outputs do not read changes no training
    stat: set[fx.Node] = set()
    out = []
    for n in ep.graph.nodes:
        if n.op != "call_function" or n not in used:
            continue
        val = n.meta.get("val")
        ins = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        tainted = [a for a in ins if a in stat]
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        if tainted and not _linear(n, tainted):
            out.append(n)
            continue  # reported once, at the first non-linear use
        if _has(val, batch):
            continue
        if tainted or any(_has(a.meta["val"], batch) for a in ins):
            stat.add(n)
    return out


def training_batch_norms(graph_module: Any) -> list[fx.Node]:
    """The batch norms of the graph that normalise with the statistics of the batch they see (training mode):
    one op, so the rule above never sees its mean and variance. A plan that splits the batch (replicas, context
    slices, microbatches) has each normalise its own share, as torch's DDP does, not the whole batch."""
    graph = graph_module.graph if isinstance(graph_module, (torch.export.ExportedProgram, fx.GraphModule)) else None
    out = []
    for n in graph.nodes if graph is not None else ():
        if n.op != "call_function" or "batch_norm" not in str(n.target):
            continue
        schema = getattr(n.target, "_schema", None)
        names = [a.name for a in schema.arguments] if schema is not None else []
        if "training" in names:
            i = names.index("training")
            training = n.kwargs.get("training", n.args[i] if i < len(n.args) else False)
        else:
            training = "with_update" in str(n.target)  # _batch_norm_with_update: the training variant
        if training is True:
            out.append(n)
    return out


def _reaching_outputs(graph: fx.Graph) -> set[fx.Node]:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    seen, todo = set(), [out]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def _linear(n: fx.Node, tainted: list[fx.Node]) -> bool:
    if n.target in _LINEAR:
        return True
    sides = _ONE_SIDED.get(n.target)
    if sides is None:
        return False
    args = [a for a in n.args[:2]]
    return len(tainted) == 1 and any(i < len(args) and args[i] is tainted[0] for i in sides)


def _has(val: torch.Tensor, symbols: set) -> bool:
    return any(isinstance(d, torch.SymInt) and d.node.expr.free_symbols & symbols for d in val.shape)


def _batch_symbols(ep: torch.export.ExportedProgram) -> set:
    """The symbols of the user inputs' first dimension (the batch)."""
    kinds = torch.export.graph_signature.InputKind
    users = {s.arg.name for s in ep.graph_signature.input_specs
             if s.kind == kinds.USER_INPUT and hasattr(s.arg, "name")}
    out: set = set()
    for n in ep.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and n.name in users and isinstance(val, torch.Tensor) and val.dim() > 0:
            d = val.shape[0]
            if isinstance(d, torch.SymInt):
                out |= d.node.expr.free_symbols
    return out


def module_path(n: fx.Node) -> str:
    """The module `n` ran in ("" for the root's own forward)."""
    stack = n.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def describe_statistic(n: fx.Node) -> str:
    """`n` named for an error message: its op and the module it ran in."""
    where = module_path(n)
    return f"{n.name} ({n.target}{f' in {where}' if where else ''})"
