"""Expert-parallel rewriting of segment code (ep > 1): each MoE layer's experts run over the ep group.

Used by `partitioner.codegen.segments` while it copies a segment's nodes. The MoE layers are the tracer's
(`partitioner.tracer.experts.find_experts`); the experts module of each (the one holding its batched
`[E, ...]` weights, Hugging Face's `...mlp.experts`) is read off the graph as one region whose inputs are
this rank's tokens x (T, H), the router's top-k indices (T, k, integer) and weights (T, k), and the two
expert weights `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I), and whose one output is the layer's
(T, H). That whole region (sorting by expert, grouped matmuls, un-sorting, weighting and summing) becomes
one call:

    ep_experts(x, topk_idx, topk_weight, experts_gate_up_proj, experts_down_proj, router_logits, ep)

with, where the experts are gated otherwise than SiLU(gate) * up on the two halves, the unit's form as keywords
(`_gated_form`: GPT-OSS's `limit=7.0, glu='sigmoid', alpha=1.702, interleaved=True`) and their biases
(`gate_up_bias=..., down_bias=...`); the region check (`ep_region_check`) runs the region against that form.

which runs `runtime.experts.expert_parallel.ep_moe` over the ep group on the rank's slice of the expert
weights (the program passes slices; `runtime.experts.program`). The router, its top-k and the shared
experts stay as traced: replicated, on the rank's own tokens.

The router's load-balancing loss (a model traced with `output_router_logits=True`): each block hands its
router logits on besides the hidden state, and the model's suffix computes one scalar from all of them.
Under ep the block passes its logits to `ep_experts` (recorded on the ep context) and hands on the hidden
state only; in the suffix, the router logits read from the blocks become `ep_router_logits(ep, i)` and
the scalar computed from them becomes `ep_aux_loss(ep)`: the same loss over every rank's tokens, as one
process computes it (Switch Transformer's, as Hugging Face's `load_balancing_loss_func`; `plan.verify` and
the equivalence tests check it is the model's).

The loss is a statistic of the batch at any ep: with the experts replicated (ep = 1) over several
data-parallel ranks, the model's own loss would be each rank's, and their mean is not one process's. So
wherever the suffix reads the router logits the code takes the ep context (at ep = 1 a group of one,
`runtime.experts.program.EPContext`), each MoE block records its logits there
(`ep_record_router_logits(router_logits, ep)`, its experts as traced), and the suffix computes
`ep_aux_loss(ep)` as above. Per forward, that is per microbatch: with several microbatches a step, the
step's loss is the mean of theirs (as Megatron-Core computes it), which the plan states.

Refused, with the node named: experts of another form (a list of expert modules, other weights, an activation
other than those units), a region that computes other than the form read off it, a region with other inputs or
outputs, a suffix that computes anything but one scalar from the router logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from partitioner.codegen.ep_region_check import region_mismatch
from partitioner.planner.model_code import SegmentError, describe

__all__ = ["EP_FUNCTIONS", "ExpertParallelRewrite", "ep_aux_loss", "ep_experts", "ep_record_router_logits",
           "ep_router_logits", "in_scope"]

_aten = torch.ops.aten


def ep_experts(x, topk_idx, topk_weight, gate_up_proj, down_proj, router_logits, ep, limit=None):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def ep_aux_loss(ep):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def ep_router_logits(ep, layer):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


@fx.node.has_side_effect  # returns nothing: dead-code elimination must keep it
def ep_record_router_logits(router_logits, ep):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


EP_FUNCTIONS = ("ep_experts", "ep_aux_loss", "ep_router_logits", "ep_record_router_logits")


def _swiglu_limit(nodes: list[fx.Node]) -> float | None:
    """The limit L of a clamped SwiGLU (gate clamped to at most L, up to [-L, L]) read off the region's two
    clamps; None where they are not two such clamps. The region check then runs the experts against it."""
    bounds = []
    for m in nodes:
        if m.target is _aten.clamp.default:
            bounds.append((m.args[1] if len(m.args) > 1 else m.kwargs.get("min"),
                           m.args[2] if len(m.args) > 2 else m.kwargs.get("max")))
    if len(bounds) != 2 or not all(isinstance(hi, (int, float)) for _, hi in bounds):
        return None
    (lo1, hi1), (lo2, hi2) = sorted(bounds, key=lambda b: b[0] is not None)
    if lo1 is None and hi1 == hi2 and lo2 == -hi2 and hi2 > 0:
        return float(hi2)
    return None


_BIASES = ("gate_up_proj_bias", "down_proj_bias")
_GATES = (_aten.silu.default, _aten.gelu.default, _aten.relu.default, _aten.sigmoid.default, _aten.tanh.default,
          _aten.clamp.default)


def _gated_form(nodes: list[fx.Node]) -> dict[str, Any] | str:
    """The gated unit the region's activations spell, as ep_experts' keywords (`grouped_experts.gated`): SiLU
    alone, or a sigmoid, each with two clamps (limit) or none; a sigmoid of a product with a number takes that as
    alpha; gate and up interleaved where the region slices with a step of 2. A guess from the ops, which the
    region check then runs; the activations in words where they are neither."""
    acts = {m.target for m in nodes if m.target in _GATES}
    clamped = _aten.clamp.default in acts
    limit = _swiglu_limit(nodes) if clamped else None
    gates = acts - {_aten.clamp.default}
    if (clamped and limit is None) or gates not in ({_aten.silu.default}, {_aten.sigmoid.default}):
        return str(sorted(str(a) for a in acts) or "no activation")
    form: dict[str, Any] = {"limit": limit} if limit is not None else {}
    if _aten.sigmoid.default in acts:
        form["glu"] = "sigmoid"
        sig = next(m for m in nodes if m.target is _aten.sigmoid.default)
        scale = sig.args[0]
        if isinstance(scale, fx.Node) and scale.target is _aten.mul.Tensor and isinstance(scale.args[1], (int, float)):
            form["alpha"] = float(scale.args[1])
    if any(m.target is _aten.slice.Tensor and len(m.args) > 4 and m.args[4] == 2 for m in nodes):
        form["interleaved"] = True
    return form


def _describe(unit: dict[str, Any], biases: tuple) -> str:
    """The gated unit in words, for a refusal."""
    halves = "the even and odd columns" if unit.get("interleaved") else "the two halves"
    glu = (f"gate * sigmoid({unit.get('alpha', 1.0):g} gate) * (up + 1)" if unit.get("glu") == "sigmoid"
           else "silu(gate) * up")
    clamp = f", clamped at {unit['limit']:g}" if unit.get("limit") else ""
    bias = ", with biases" if any(b is not None for b in biases) else ""
    return f"gated(h) = {glu}, gate and up {halves} of h{clamp}{bias}"


def _transposed(form: str, gate_up: torch.Size, down: torch.Size) -> bool:
    """Whether the expert weights are stored (E, H, 2I) and (E, I, H) rather than (E, 2I, H) and (E, H, I);
    refused where the shapes are neither."""
    if len(gate_up) == 3 and len(down) == 3 and gate_up[0] == down[0]:
        if gate_up[1] == 2 * down[2] and gate_up[2] == down[1]:
            return False
        if gate_up[2] == 2 * down[1] and gate_up[1] == down[2]:
            return True
    raise SegmentError(f"expert parallelism: {form} keep gate_up_proj {tuple(gate_up)} and down_proj {tuple(down)}, "
                       "neither (E, 2I, H) and (E, H, I) nor their transposes; compile with ep=1")


def path_of(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def in_scope(n: fx.Node, scope: str) -> bool:
    p = path_of(n)
    return p == scope or p.startswith(scope + ".")


class ExpertParallelRewrite:
    """Mixed into the segment builder, which provides graph, env, value(), src, ep (the degree), ep_arg (the
    `ep` placeholder, None where the code takes no ep context), expert_scopes (the experts modules of the MoE
    layers), router_out (block builder: this block's router logits handed on, or None) and router_values (suffix
    builder: the blocks' router logits, in layer order)."""

    def scope_of(self, n: fx.Node) -> str | None:
        if self.ep == 1:
            return None
        return next((s for s in self.expert_scopes if in_scope(n, s)), None)

    def rewrite_ep(self, n: fx.Node) -> bool:
        """Copy `n` in its expert-parallel form: the experts region as one ep_experts call at its output node,
        its other nodes dropped; the suffix's use of the router logits; False otherwise."""
        if self.ep_arg is None:
            return False
        if n in self.aux_nodes:
            self._aux(n)
            return True
        scope = self.scope_of(n)
        if scope is None:
            return False
        if scope not in self.regions:
            self.regions[scope] = self._region(scope)
        exit_node, call_args, kept, transposed, form, biases = self.regions[scope]
        if n in kept:
            return False
        if n is exit_node:
            args = [self.value(a) for a in call_args]
            if transposed:  # stored (E, H, 2I) and (E, I, H), as Aria's experts: the runtime takes their transposes
                args[3:] = [self._transpose(a) for a in args[3:]]
            given = zip(("gate_up_bias", "down_bias"), biases)
            kwargs = {**form, **{k: self.value(b) for k, b in given if b is not None}}
            out = self.graph.create_node("call_function", ep_experts, (*args, self._router_arg(), self.ep_arg),
                                         kwargs, name=n.name)
            out.meta = dict(n.meta)
            self.env[n] = out
        return True

    def _transpose(self, a: fx.Node) -> fx.Node:
        t = self.graph.create_node("call_function", _aten.transpose.int, (a, -2, -1), name=f"{a.name}_t")
        if isinstance(a.meta.get("val"), torch.Tensor):
            t.meta["val"] = a.meta["val"].transpose(-2, -1)
        return t

    def record_router_logits(self) -> None:
        """At ep = 1, a block that hands its router logits on records them on the ep context (under ep > 1
        ep_experts does)."""
        if self.ep == 1 and self.router_out is not None:
            self.graph.create_node("call_function", ep_record_router_logits, (self.value(self.router_out), self.ep_arg),
                                   name="record_router_logits")

    def _router_arg(self):
        return self.value(self.router_out) if self.router_out is not None else None

    def _region(self, scope: str) -> tuple[fx.Node, tuple[fx.Node, ...], frozenset[fx.Node], bool, dict,
                                           tuple[fx.Node | None, fx.Node | None]]:
        """The experts region's output node, (x, topk_idx, topk_weight, gate_up_proj, down_proj), the shape
        arithmetic in it that is copied as it is (see `_kept_shapes`), whether the two weights are stored
        transposed, the gated unit's form (`_gated_form`: ep_experts' keywords) and the two biases (None where
        the experts have none). The region is run on random values against what replaces it
        (`ep_region_check`)."""
        nodes = [m for m in self.src.gm.graph.nodes if m.op == "call_function" and in_scope(m, scope)]
        inside = set(nodes)
        kept = self._kept_shapes(nodes, inside)
        outs = [m for m in nodes if m not in kept and any(u not in inside for u in m.users)]
        ins = {a for m in nodes for a in m.all_input_nodes
               if a not in inside and not self.src.shape_only.get(a, False) and a not in self.src.param}
        params = sorted({self.src.param[a] for m in nodes for a in m.all_input_nodes if a in self.src.param})
        form = f"the experts of {scope}"
        short = {p.rsplit(".", 1)[-1]: p for p in params}
        if not {"gate_up_proj", "down_proj"} <= set(short) or set(short) - {"gate_up_proj", "down_proj", *_BIASES}:
            raise SegmentError(f"expert parallelism runs batched gated experts (gate_up_proj (E, 2I, H) and "
                               f"down_proj (E, H, I), as Mixtral, Qwen3-MoE and DeepSeek-V3 keep them, with biases "
                               f"{' and '.join(_BIASES)} or without), but {form} "
                               f"read {', '.join(params[:4])}{f' and {len(params) - 4} more' if len(params) > 4 else ''} "
                               "(a list of expert modules or other weights are not run yet); compile with ep=1")
        if len(outs) != 1:
            raise SegmentError(f"expert parallelism: {form} hand on {len(outs)} values "
                               f"({', '.join(o.name for o in outs)}), not one (T, H) output; compile with ep=1")
        unit = _gated_form(nodes)
        if isinstance(unit, str):
            raise SegmentError(f"expert parallelism runs experts gated as SiLU(gate) * up or as GPT-OSS's gate * "
                               f"sigmoid(alpha gate) * (up + 1) (either clamped, as DeepSeek-V4's and GPT-OSS's, or "
                               f"not), but {form} compute {unit}; compile with ep=1")
        tensors = {a: a.meta.get("val") for a in ins}
        x = [a for a, v in tensors.items() if isinstance(v, torch.Tensor) and v.dim() == 2 and v.is_floating_point()
             and v.shape[1] == outs[0].meta["val"].shape[-1]]
        idx = [a for a, v in tensors.items() if isinstance(v, torch.Tensor) and v.dim() == 2
               and not v.is_floating_point()]
        w = [a for a, v in tensors.items() if isinstance(v, torch.Tensor) and v.dim() == 2 and v.is_floating_point()
             and a not in x]
        if len(ins) != 3 or len(x) != 1 or len(idx) != 1 or len(w) != 1:
            raise SegmentError(f"expert parallelism: {form} read {sorted(describe(a) for a in ins)}, not the "
                               "tokens (T, H), the router's top-k indices and weights (T, k); compile with ep=1")
        p_node = {self.src.param[a]: a for m in nodes for a in m.all_input_nodes if a in self.src.param}
        gate_up, down = p_node[short["gate_up_proj"]], p_node[short["down_proj"]]
        biases = tuple(p_node[short[b]] if b in short else None for b in _BIASES)
        transposed = _transposed(form, gate_up.meta["val"].shape, down.meta["val"].shape)
        why = region_mismatch(nodes, outs[0], x[0], idx[0], w[0], gate_up, down, transposed=transposed, biases=biases,
                              **unit)
        if why:
            raise SegmentError(f"expert parallelism runs batched experts, down(gated(gate_up x)) with "
                               f"{_describe(unit, biases)}, weighted by the router; {form} compute something else: "
                               f"{why}; compile with ep=1")
        return outs[0], (x[0], idx[0], w[0], gate_up, down), kept, transposed, unit, biases

    def _kept_shapes(self, nodes: list[fx.Node], inside: set[fx.Node]) -> frozenset[fx.Node]:
        """The region's shape arithmetic on sizes known outside it (export computes a product of sizes such as
        b * s once and hands it to every later op that needs it: DeepSeek-V2's later layers read the products its
        first MoE layer's experts computed): copied as it is, so that those later ops still find it, rather than
        taken for an output of the experts."""
        kept: set[fx.Node] = set()
        for m in nodes:
            if self.src.shape_only.get(m, False) and all(a not in inside or a in kept for a in m.all_input_nodes):
                kept.add(m)
        return frozenset(kept)

    # ---- the suffix: the router logits and the load-balancing loss --------------------------------------
    def router_logits_node(self, n: fx.Node) -> fx.Node:
        """`n`, a block's router logits read in the suffix, as this rank's recorded copy."""
        i = self.router_values.index(n)
        out = self.graph.create_node("call_function", ep_router_logits, (self.ep_arg, i), name=f"{n.name}_local")
        out.meta = dict(n.meta)
        return out

    def mark_aux(self, members: list[fx.Node]) -> None:
        """The scalar the suffix computes from the blocks' router logits (the load-balancing loss) becomes
        ep_aux_loss; what else reads them (the logits returned as outputs) is copied over this rank's."""
        if not self.router_values:
            return
        inside = set(members)
        dep: set[fx.Node] = set()
        for m in members:
            if any(a in self.router_values or a in dep for a in m.all_input_nodes):
                dep.add(m)
        scalars = [m for m in dep if isinstance(m.meta.get("val"), torch.Tensor) and m.meta["val"].dim() == 0
                   and any(u.op == "output" or (u in inside and u not in dep) for u in m.users)]
        if len(scalars) > 1 or (not scalars and self.ep > 1):
            fix = "compile with ep=1" if self.ep > 1 else \
                "build the model without it (output_router_logits=False), or compile for one rank"
            raise SegmentError(f"the model computes {len(scalars)} scalars from its layers' router logits "
                               f"({', '.join(describe(m) for m in scalars)}), where one (the load-balancing loss) is "
                               f"computed over every rank's tokens; {fix}")
        self.aux_nodes = {scalars[0]: True} if scalars else {}

    def _aux(self, n: fx.Node) -> None:
        if self.aux_nodes[n]:
            out = self.graph.create_node("call_function", ep_aux_loss, (self.ep_arg,), name=n.name)
            out.meta = dict(n.meta)
            self.env[n] = out
