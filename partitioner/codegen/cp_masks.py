"""The attention masks a context-parallel program passes whole, evaluated when compiling.

A mask computed from shapes alone (HF's causal or sliding-window mask, made from the sequence length) reaches
`cp_attention` whole (partitioner.codegen.segment_cp), and the runtime checks it is causal or full before it
attends (runtime.context.program.mask_kind): a sliding window, a prefix mask or a block mask stops the first
step's forward. That is after the ranks started. Since such a mask depends on the sequence length alone, it
can be computed here: the graph's nodes that make it, run on plain tensors, with the length at the traced one
(at most EVAL_TOKENS: a window shorter than that shows; a longer one is left to the runtime's check).

Anything this cannot run (a buffer on the meta device, a nested graph, an op that fails on the shapes chosen)
leaves the mask to the runtime's check: this only refuses earlier what would be refused anyway.
"""

from __future__ import annotations

import torch
from torch import fx

from partitioner.planner.model_code import describe
from runtime.context.program import mask_pattern

__all__ = ["EVAL_TOKENS", "unsplittable_mask"]

EVAL_TOKENS = 8192  # 8192^2 bool: 64 MiB; the sliding windows of Mistral, Gemma 2 and Cohere 2 (4096) show below
_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default
_MASK_ARG = 3  # query, key, value, attn_mask, ...


def unsplittable_mask(ep: torch.export.ExportedProgram, traced_len: int) -> str:
    """Why an attention's mask, computed from shapes, is neither causal nor full at the traced length (at most
    EVAL_TOKENS), "" where each is causal or full, or cannot be computed here."""
    length = min(traced_len, EVAL_TOKENS)
    seen: set[fx.Node] = set()  # a model makes one mask for all its layers (one per kind): computed once each
    for n in ep.graph_module.graph.nodes:
        if n.op != "call_function" or n.target is not _ATTENTION:
            continue
        mask = n.args[_MASK_ARG] if len(n.args) > _MASK_ARG else n.kwargs.get("attn_mask")
        if not isinstance(mask, fx.Node) or mask in seen:
            continue
        seen.add(mask)
        value = _evaluate(ep, mask, traced_len, length)
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() >= 2 \
                and tuple(value.shape[-2:]) == (length, length) and mask_pattern(value) == "other":
            return (f"context parallelism: attention {describe(n)} takes the mask {describe(mask)}, computed from the "
                    f"sequence length, which at {length} tokens is neither causal nor full (a sliding window, a "
                    "prefix or block mask); the ring and Ulysses kernels cannot split it over the sequence: "
                    "compile with cp=1")
    return ""


def _evaluate(ep: torch.export.ExportedProgram, target: fx.Node, traced_len: int, length: int):
    """`target` computed from shapes, the token dims at `length`; None where it cannot be."""
    need: set[fx.Node] = set()
    stack = [target]
    while stack:
        x = stack.pop()
        if x not in need:
            need.add(x)
            stack.extend(x.all_input_nodes)
    kinds = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    user = torch.export.graph_signature.InputKind.USER_INPUT
    env: dict[fx.Node, object] = {}
    try:
        for n in ep.graph_module.graph.nodes:
            if n not in need:
                continue
            if n.op == "placeholder":
                spec = kinds.get(n.name)
                if spec is None:
                    return None
                if spec.kind == user:
                    env[n] = _zeros_like_traced(n, traced_len, length)
                else:
                    t = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
                    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                        return None
                    env[n] = t
            elif n.op == "call_function":
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
                if "device" in kwargs:  # a factory of a graph traced on the meta device: its values here
                    kwargs = {**kwargs, "device": torch.device("cpu")}
                env[n] = n.target(*args, **kwargs)
            else:  # a nested graph (get_attr), or anything else this does not run
                return None
    except Exception:  # noqa: BLE001 (whatever fails here is left to the runtime's check)
        return None
    return env.get(target)


def _zeros_like_traced(n: fx.Node, traced_len: int, length: int) -> torch.Tensor:
    """A tensor of the input's traced shape (its sizes, read by the shape ops), the token dims at `length`."""
    val = n.meta.get("val")
    sizes = []
    for d in val.shape:
        hint = d if isinstance(d, int) else d.node.hint
        sizes.append(length if hint == traced_len else int(hint))
    return torch.zeros(sizes, dtype=val.dtype)
