"""The split backward of the zero-bubble schedules: the input gradient now (I), the weight gradients later (W).

`backward_input` computes only the gradient of a stage's inputs, which the previous stage waits for, and
keeps what the weight gradients need: at each autograd node where a parameter's gradient path leaves the
input's path (an "intermediate": the matmul backward that yields both dx and dW), the gradient flowing
into it. `backward_weight` later runs autograd from those saved gradients down to the parameters only.
Together they compute what one `backward` does, node by node, so the parameter gradients are those of
the full backward.

This is torch's pipelining (`torch/distributed/pipelining/_backward.py`, `stage_backward_input` /
`stage_backward_weight`), whose graph helpers it uses. One difference, and why: torch's W takes
`torch.autograd.grad` and adds the result into `param.grad` itself, which runs no AccumulateGrad node
and so no post-accumulate-grad hook; here W runs `torch.autograd.backward(..., inputs=leaves)`, so the
data-parallel engine's hooks (bucket filling, and the reductions the rank's last W launches) fire as
they do in a full backward.

>>> lin = torch.nn.Linear(3, 2)
>>> x = torch.ones(4, 3, requires_grad=True)
>>> (dx,), pending = backward_input([lin(x).sum()], [None], [x])
>>> lin.weight.grad is None                      # I left the weight gradient for W
True
>>> backward_weight(pending)
>>> lin.weight.grad.tolist()
[[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    get_param_groups,
)

__all__ = ["PendingWeightGrad", "backward_input", "backward_weight"]


@dataclasses.dataclass(kw_only=True)
class PendingWeightGrad:
    """What W needs from I, held (with the activations the graph saved) until W runs.

    groups: per parameter group, its intermediates, the gradients that flowed into them during I, and
        the leaves (parameters) below them.
    full: when no input needed a gradient (the first stage, fed token ids), I had nothing to compute and
        W runs the whole backward from these (outputs, output gradients).
    """

    groups: list[tuple[list[Node], list[tuple[torch.Tensor | None, ...] | None], list[torch.Tensor]]]
    full: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None

    def params(self) -> list[torch.Tensor]:
        """The leaves W accumulates into (under ZeRO-3: the units' gathered buffers), each once; none for a
        `full` backward, which reaches its leaves through the module hooks of a plain backward."""
        seen: dict[int, torch.Tensor] = {}
        for _, _, leaves in self.groups:
            for t in leaves:
                seen.setdefault(id(t), t)
        return list(seen.values())


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[Any]) -> tuple[tuple[torch.Tensor | None, ...], PendingWeightGrad]:
    """The gradients of `inputs` (None for those that need none) from `outputs` and their gradients
    (None for a scalar loss), and what `backward_weight` needs to finish the backward."""
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    outs, out_grads = [o for o, _ in pairs], [g for _, g in pairs]
    wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not wanted or not outs:
        return tuple(None for _ in inputs), PendingWeightGrad(groups=[], full=(outs, out_grads))

    roots = [n for n in map(_get_grad_fn_or_grad_acc, outs) if n is not None]
    input_nodes = [n for n in map(_get_grad_fn_or_grad_acc, wanted) if n is not None]
    reverse = construct_reverse_graph(roots)
    skip = set(input_nodes)
    # every leaf the outputs reach, but the inputs: the stage's parameters (tied copies included),
    # found in the graph rather than passed in, so whatever the stage read is covered
    leaves = [n for n in list(reverse) if hasattr(n, "variable") and n not in skip]
    groups = get_param_groups(input_nodes, leaves, reverse)

    saved: list[tuple[list[Node], list[Any], list[torch.Tensor]]] = []
    handles = []
    try:
        for group in groups:
            inters = list(group["intermediates"])
            grads_in: list[Any] = [None] * len(inters)
            for k, node in enumerate(inters):
                def keep(grad_outputs, grads_in=grads_in, k=k):
                    grads_in[k] = grad_outputs
                handles.append(node.register_prehook(keep))
            saved.append((inters, grads_in, [n.variable for n in group["params"]]))
        dx = torch.autograd.grad(outs, wanted, out_grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    by_id = {id(x): g for x, g in zip(wanted, dx)}
    return tuple(by_id.get(id(x)) for x in inputs), PendingWeightGrad(groups=saved)


def backward_weight(pending: PendingWeightGrad) -> None:
    """Accumulate the parameter gradients that `backward_input` left, into `.grad` through AccumulateGrad
    (so post-accumulate-grad hooks fire); frees the graph."""
    if pending.full is not None:
        outs, grads = pending.full
        pending.full = None
        if outs:
            torch.autograd.backward(outs, grads)
        return
    groups, pending.groups = pending.groups, []
    for n, (inters, grads_in, leaves) in enumerate(groups):
        edges, values = [], []
        for node, grad_outputs in zip(inters, grads_in):
            for k, g in enumerate(grad_outputs or ()):
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    values.append(g)
        if not edges:
            continue  # no gradient reached these parameters in I: they get none, as in a full backward
        handles = []
        try:
            if len(inters) > 1:
                # an intermediate below another gets, during this backward, the gradient flowing from
                # above on top of its own saved one: replace what flows in by what I saw (torch does too)
                for node, grad_outputs in zip(inters, grads_in):
                    if grad_outputs is not None:
                        handles.append(node.register_prehook(lambda _, saved=grad_outputs: saved))
            # groups may share nodes below their intermediates: keep buffers until the last group
            torch.autograd.backward(edges, values, retain_graph=n < len(groups) - 1, inputs=leaves)
        finally:
            for h in handles:
                h.remove()
