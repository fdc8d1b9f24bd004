"""Which nodes of an exported graph write a tensor in place: copy_, index_put_, a running statistic's mul_
inside a torch.no_grad() region (a higher-order op whose nested graph writes its arguments).

torch.export lists the buffers its functionalisation writes in `graph_signature.buffers_to_mutate`; in-place ops
the training graph keeps, at the top level or inside a nested graph, are found here from the op schemas. Stage
code must keep every one of them (an op that writes has no users), and a value made from a written tensor must
not be computed again elsewhere without the write.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import fx

__all__ = ["mutates", "nested_written", "with_bases", "written"]


def mutates(n: fx.Node) -> bool:
    """Whether `n` writes into one of its inputs (copy_, index_put_): part of the block though unread."""
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def nested_written(n: fx.Node, gm: Any) -> list[fx.Node]:
    """The arguments a higher-order op's nested graph writes in place (a buffer updated under torch.no_grad(), which
    export wraps as wrap_with_set_grad_enabled(flag, graph, *inputs)); [] for any other node. `gm`: the module
    holding the nested graphs (the exported program's graph_module)."""
    sub = next((i for i, a in enumerate(n.args) if isinstance(a, fx.Node) and a.op == "get_attr"), None)
    nested = getattr(gm, n.args[sub].target, None) if sub is not None else None
    if not isinstance(nested, fx.GraphModule):
        return []
    holes = [x for x in nested.graph.nodes if x.op == "placeholder"]
    outer = dict(zip(holes, n.args[sub + 1:]))
    hit = with_bases(a for x in nested.graph.nodes if x.op == "call_function" for a in written(x))
    return [outer[h] for h in holes if h in hit and isinstance(outer.get(h), fx.Node)]


def with_bases(written_nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """The written nodes and, through every view among them, the tensors they view: a write into a view writes
    its base."""
    hit: set[fx.Node] = set()
    todo = list(written_nodes)
    while todo:
        x = todo.pop()
        if x not in hit:
            hit.add(x)
            if x.op == "call_function" and getattr(x.target, "is_view", False):
                todo.extend(x.all_input_nodes)
    return hit


def written(n: fx.Node) -> list[fx.Node]:
    """The arguments `n` writes into (copy_'s and index_put_'s self), read off its schema; [] if it writes none."""
    if not mutates(n):
        return []
    args = n.target._schema.arguments
    values = [n.args[i] if i < len(n.args) else n.kwargs.get(a.name) for i, a in enumerate(args)]
    return [v for a, v in zip(args, values)
            if a.alias_info is not None and a.alias_info.is_write and isinstance(v, fx.Node)]
