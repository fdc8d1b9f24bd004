"""Mixture-of-experts layers, found in the traced dataflow (not by class names).

A MoE layer is read off the graph as four parts:

* the router: a `topk` over E scores (softmax, sigmoid, bias or group masks in between) that come from a
  linear layer whose weight is E x H; when a router takes several top-k's (DeepSeek-V3's groups), the
  last one whose indices reach the experts is the routing one, and its k is the layer's top-k;
* the experts: the parameters read by the ops that depend on the router's choice (its indices or weights):
  batched weights whose first dimension is E (`[E, ...]`, as Hugging Face's grouped-mm MoE classes keep
  them), or E sibling modules of one container whose parameters have the same names and shapes (a
  ModuleList of MLPs);
* the dispatch and combine: the ops between the router and the experts that sort, count, index or scatter
  tokens by expert (sort, histc, one_hot, index, scatter, ...), and the first op after the experts whose
  output has the shape of the layer's input again (the weighted sum back to tokens);
* shared experts: the other parameters of the module that holds the router and the experts (a dense MLP
  every token goes through, as DeepSeek-V3's and Qwen2-MoE's shared experts).

Nothing here changes a plan: the planner reports what it found (print(graph), print(plan)); planning expert
parallelism on it is the planner's.

>>> import torch
>>> from partitioner import trace
>>> from examples.hf_families import deepseek_v3_seeded
>>> g = trace(deepseek_v3_seeded(), (torch.zeros(2, 16, dtype=torch.long),))
>>> [(m.module, m.num_experts, m.top_k, m.style) for m in find_experts(g)][:1]
[('model.layers.1.mlp', 4, 2, 'batched')]
>>> print(experts_text(g))
3 MoE layers (model.layers.1-3.mlp) of 4 experts, top-2, batched expert weights [E, ...], shared experts; 1 dense block (0)
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import TYPE_CHECKING, Literal

from partitioner.tracer.op_rules import ROUTING_OPS

if TYPE_CHECKING:
    from partitioner.tracer.opgraph import OpGraph, OpNode

__all__ = ["MoELayer", "common_prefix", "find_experts", "experts_text"]

# ops that move tokens to or from their experts by the router's choice: those the cost rules price as routing,
# and the gathers, selections and counts around them
_DISPATCH_OPS = ROUTING_OPS | {"index", "index_select", "gather", "nonzero", "where", "masked_select", "cumsum"}
_LINEAR_OPS = frozenset({"linear", "matmul", "mm"})
_REDUCING = frozenset({"sum", "mean", "amax", "amin", "prod", "logsumexp", "bmm", "baddbmm", "einsum", "norm"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoELayer:
    """One mixture-of-experts layer of the traced graph.

    module: the module holding router and experts ("model.layers.3.mlp"); block: its block index (None
    outside the layer stack); num_experts / top_k: E and k of the routing top-k; router: the router's weight;
    experts: the expert parameters (batched `[E, ...]` tensors, or every sibling module's parameters);
    style: "batched" or "module_list"; uniform: every expert has the same parameter shapes (so experts can
    be divided over ranks); expert_params: their element count, all experts together; shared: parameters of
    shared experts; dispatch / combine: the ops that route tokens (names of op kinds) and the node where
    the experts' outputs are summed back per token.
    """

    module: str
    block: int | None
    num_experts: int
    top_k: int
    router: str
    experts: tuple[str, ...]
    style: Literal["batched", "module_list"]
    uniform: bool
    expert_params: int
    shared: tuple[str, ...] = ()
    shared_params: int = 0
    dispatch: tuple[str, ...] = ()
    combine: str | None = None


def find_experts(g: "OpGraph") -> tuple[MoELayer, ...]:
    """Every MoE layer of `g`, in graph order (see the module docstring); () for a dense model."""
    nodes = {n.name: n for n in g.nodes}
    order = {n.name: i for i, n in enumerate(g.nodes)}
    users: dict[str, list[str]] = defaultdict(list)
    for n in g.nodes:
        for i in n.inputs:
            users[i].append(n.name)
    params = {p.name: p for p in g.params}
    for p in g.params:
        for a in p.aliases:
            params.setdefault(a, p)

    def param_of(name: str) -> tuple[str, ...]:
        """Parameters a node reads, directly or through parameter-only ops (casts, transposes)."""
        n = nodes[name]
        out = list(n.params)
        for i in n.inputs:
            src = nodes.get(i)
            if src is not None and src.params and all(j not in nodes or nodes[j].params for j in src.inputs):
                out.extend(param_of(i))
        return tuple(dict.fromkeys(out))

    def descendants(start: str, keep) -> set[str]:
        """Nodes that depend on `start` through nodes `keep` accepts (the walk stops where it leaves them)."""
        seen, stack = set(), [start]
        while stack:
            for u in users[stack.pop()]:
                if u not in seen and keep(nodes[u]):
                    seen.add(u)
                    stack.append(u)
        return seen

    layers: list[MoELayer] = []
    claimed: set[str] = set()
    for t in (n for n in g.nodes if n.op == "topk"):
        if t.name in claimed or not t.inputs or t.output is None:
            continue
        router = _router_weight(nodes, params, t, param_of)
        if router is None:
            continue
        weight, num_experts, module, token_shape = router
        router_owner = weight.rsplit(".", 1)[0]
        mine = lambda p: p == weight or p.startswith(router_owner + ".")  # noqa: E731  the router's own (its bias)
        # the layer is the nearest module above the router's that holds experts the choice reaches: its owner's
        # parent ("...mlp" for "...mlp.gate.weight"), or higher where the router sits deeper ("...mlp.gate.wg.weight",
        # HunYuan's); what the choice reaches outside it (the residual stream, later layers) is not this layer's
        for scope in _ancestors(router_owner):
            reach = descendants(t.name, lambda n, scope=scope: n.block == t.block and (
                not scope or n.module_path == scope or n.module_path.startswith(scope + ".")))
            expert_params = [p for x in sorted(reach, key=order.__getitem__) for p in param_of(x) if not mine(p)]
            experts, style = _experts(params, list(dict.fromkeys(expert_params)), num_experts)
            if experts:
                break
        else:
            continue
        # the routing top-k: the last of this router's top-k's over the E scores (not a capacity's over tokens)
        topks = [x for x in reach if nodes[x].op == "topk" and nodes[x].inputs and nodes[x].inputs[0] in nodes
                 and nodes[nodes[x].inputs[0]].output is not None
                 and _static(nodes[nodes[x].inputs[0]].output.shape[-1]) == num_experts] + [t.name]
        claimed.update(topks)
        last = max(topks, key=order.__getitem__)
        top_k = int(_static(nodes[last].output.shape[-1]) or 0)
        holder = scope or common_prefix([module, *(e.rsplit(".", 1)[0] for e in experts)])
        users_of_experts = sorted((x for x in reach if any(p in experts for p in param_of(x))), key=order.__getitem__)
        combine = _combine(nodes, order, reach, users_of_experts, token_shape)
        dispatch = tuple(sorted({nodes[x].op for x in reach if nodes[x].op in _DISPATCH_OPS}))
        shared = tuple(p.name for p in g.params if holder and p.name.startswith(holder + ".")
                       and not mine(p.name) and p.name not in experts)
        layers.append(MoELayer(
            module=holder or module, block=nodes[last].block, num_experts=num_experts, top_k=top_k, router=weight,
            experts=tuple(experts), style=style, uniform=_uniform(params, experts, style),
            expert_params=sum(params[e].numel for e in experts), shared=shared,
            shared_params=sum(params[p].numel for p in shared), dispatch=dispatch, combine=combine))
    return tuple(sorted(layers, key=lambda m: (m.block is None, m.block or 0, m.module)))


def _static(d) -> int | None:
    """A dimension's value when it is a constant (not a multiple of b or s)."""
    try:
        v0, v1 = d(1, 1), d(2, 3)
    except TypeError:
        return int(d)
    return int(v0) if v0 == v1 else None


def _router_weight(nodes, params, t: "OpNode", param_of):
    """(weight name, E, module) of the linear whose E scores `t` selects from, walking back through the
    score ops (activations, bias adds, masks, views); None when the top-k is not over a linear's outputs."""
    inp = nodes.get(t.inputs[0])
    if inp is None or inp.output is None:
        return None
    e = _static(inp.output.shape[-1])
    if not e or e < 2:
        return None
    seen, stack = set(), [inp.name]
    while stack:
        n = nodes[stack.pop()]
        if n.name in seen or n.block != t.block:
            continue
        seen.add(n.name)
        if n.op in _LINEAR_OPS:
            for p in param_of(n.name):
                spec = params.get(p)
                if spec is not None and len(spec.shape) == 2 and spec.shape[0] == e:
                    x = nodes.get(n.inputs[0]) if n.inputs else None
                    return p, e, n.module_path, (tuple(x.output.shape) if x is not None and x.output else None)
            continue  # a linear without an E x H weight is not a router's: stop this path
        if n.op in _REDUCING:
            # what a sum or product over a dim makes is not the E scores of what it reads (a sparse attention's
            # indexer sums its heads' weights times q.k into scores over keys, then takes their top-k)
            continue
        stack.extend(i for i in n.inputs if i in nodes)
    return None


def _experts(params, names: list[str], e: int) -> tuple[list[str], str]:
    """The expert parameters among `names`: batched ([E, ...]) or E sibling modules of one container."""
    batched = [n for n in names if len(params[n].shape) >= 2 and params[n].shape[0] == e]
    if any(len(params[n].shape) >= 3 for n in batched):  # weights [E, ...] (and their biases [E, out])
        return batched, "batched"
    by_container: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for n in names:
        m = re.match(r"(.*)\.(\d+)\.(.+)$", n)
        if m:
            by_container[m.group(1)][int(m.group(2))].append(n)
    for container, members in by_container.items():
        if len(members) == e and set(members) == set(range(e)):
            return [p for i in range(e) for p in sorted(members[i])], "module_list"
        # experts that got no token in the traced batch are not on the traced path: take the container's
        if len(members) >= 2:
            siblings = [p for p in params if p.startswith(container + ".")]
            idx = {int(re.match(re.escape(container) + r"\.(\d+)\.", p).group(1)) for p in siblings
                   if re.match(re.escape(container) + r"\.(\d+)\.", p)}
            if idx == set(range(e)):
                return sorted(siblings, key=lambda p: (int(p[len(container) + 1:].split(".")[0]), p)), "module_list"
    return [], "batched"


def _uniform(params, experts: tuple[str, ...] | list[str], style: str) -> bool:
    if style == "batched":
        return True  # one tensor per kind of weight: every expert's slice has the same shape
    shapes: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    counts: dict[int, int] = defaultdict(int)
    for p in experts:
        m = re.match(r".*\.(\d+)\.(.+)$", p)
        if m:
            shapes[m.group(2)].add(tuple(params[p].shape))
            counts[int(m.group(1))] += 1
    return all(len(s) == 1 for s in shapes.values()) and len(set(counts.values())) <= 1


def _combine(nodes, order, reach, expert_users: list[str], token_shape) -> str | None:
    """The first node after the experts whose output has the router input's token shape again."""
    if not expert_users or token_shape is None:
        return None
    last = order[expert_users[-1]]
    for x in sorted((x for x in reach if order[x] > last), key=order.__getitem__):
        n = nodes[x]
        if n.output is not None and tuple(n.output.shape) == token_shape:
            return n.name
    return None


def _ancestors(path: str) -> list[str]:
    """The modules above `path`, nearest first, the root ("") last: "a.b.c" -> ["a.b", "a", ""]."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def common_prefix(paths: list[str]) -> str:
    """The longest dotted module path every one of `paths` starts with ("" when they share none)."""
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return ""
    out = []
    for segs in zip(*parts):
        if len(set(segs)) != 1:
            break
        out.append(segs[0])
    return ".".join(out)


def experts_text(g: "OpGraph") -> str:
    """One line on the MoE layers: how many, where, E and k, the experts' form, shared experts, dense blocks."""
    layers = find_experts(g)
    if not layers:
        return ""
    kinds = sorted({(m.num_experts, m.top_k, m.style, bool(m.shared), m.uniform) for m in layers})
    where = _modules_text([m.module for m in layers])
    parts = []
    for e, k, style, shared, uniform in kinds:
        form = "batched expert weights [E, ...]" if style == "batched" else "a list of expert modules"
        parts.append(f"{e} experts, top-{k}, {form}" + (", shared experts" if shared else "")
                     + ("" if uniform else ", experts of different shapes"))
    dense = [b.index for b in g.blocks if b.index not in {m.block for m in layers}]
    tail = f"; {len(dense)} dense block{'s' if len(dense) != 1 else ''} ({_ranges(dense)})" if dense and g.blocks else ""
    return f"{len(layers)} MoE layer{'s' if len(layers) != 1 else ''} ({where}) of " + "; ".join(parts) + tail


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def _modules_text(mods: list[str]) -> str:
    """'model.layers.1-3.mlp' for modules that differ only in one index."""
    pat = [re.match(r"(.*?)\.(\d+)\.(.*)$", m) for m in mods]
    if all(pat) and len({(p.group(1), p.group(3)) for p in pat}) == 1:
        r = _ranges(sorted(int(p.group(2)) for p in pat))
        return f"{pat[0].group(1)}.{r if ',' not in r else '{' + r + '}'}.{pat[0].group(3)}"
    return ", ".join(mods)
