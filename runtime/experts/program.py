"""What an expert-parallel program's generated code calls: each MoE layer's experts over the ep group, and
the router's load-balancing loss over every rank's tokens.

The code generator (`partitioner.codegen.segment_ep`) rewrites the traced graph of an ep > 1 plan: the ops of
each MoE layer's experts module (Hugging Face's batched experts: sort the (token, choice) pairs by expert,
grouped matmuls, un-sort, weight and sum) become one `ep_experts` call on this rank's tokens, the router's
choice and this rank's slice of the batched `[E, ...]` expert weights, which runs `ep_moe` (the
all-to-alls) over the ep group. The router and shared experts stay as traced, replicated.

When the model computes the router's auxiliary load-balancing loss from every layer's router logits
(Hugging Face's `output_router_logits=True`), the layers' logits do not travel through the code from block to
block: `ep_experts` records them on the `EPContext`, and the suffix's loss computation becomes
`ep_aux_loss`, the loss over all ranks' tokens (`runtime.experts.aux_loss`), equal to one process's. A plan
that replicates the experts (ep = 1) over several data-parallel ranks runs the same loss: its code takes an
`EPContext` of one rank (group None, world 1), the experts run as traced, and each MoE layer hands its logits
over by `ep_record_router_logits`.

>>> ctx = EPContext(group=None, collectives=None, rank=0, world=1, num_experts=2, top_k=1, layers=1)
>>> gate_up, down = torch.ones(2, 2, 1), torch.ones(2, 1, 1)           # E=2, I=1, H=1
>>> x, idx, w = torch.tensor([[1.0], [2.0]]), torch.tensor([[0], [1]]), torch.tensor([[1.0], [0.5]])
>>> ep_experts(x, idx, w, gate_up, down, torch.zeros(2, 2), ctx)       # silu(x) * x per token, weighted
tensor([[0.7311],
        [1.7616]])
>>> round(float(ep_aux_loss(ctx)), 4)                                  # from the logits recorded above
1.0
"""

from __future__ import annotations

import dataclasses

import torch

from runtime.comm.collectives import Collectives
from runtime.comm.groups import group_size
from runtime.device import rank_device
from runtime.experts.aux_loss import load_balancing_loss, router_sums
from runtime.experts.expert_parallel import ep_moe
from runtime.experts.grouped_experts import batched_experts
from runtime.experts.pipeline_aux import AuxPipeline

__all__ = ["EPContext", "RouterLogitsElsewhere", "ep_aux_loss", "ep_experts", "ep_record_router_logits",
           "ep_router_logits"]


@dataclasses.dataclass(kw_only=True)
class EPContext:
    """The expert-parallel group as generated code sees it (the `ep` argument of every segment function of an
    ep > 1 plan). group / rank / world: the ep group and this rank's index in it (it holds experts
    rank*E/world .. (rank+1)*E/world - 1); token_group: the ranks whose tokens make one batch (the dp x cp
    group), over which the load-balancing loss is summed; router_logits: this forward's layers' logits,
    recorded by `ep_experts` (a forward's first layer starts a new record: `layers` per forward; a stage's
    forward starts one too, `enter_stage`) and read by `ep_aux_loss` and `ep_router_logits`. pipeline: under
    pp > 1 with the load-balancing loss, the links that carry each stage's sums to the last stage
    (runtime.experts.pipeline_aux); carried: the sums this forward's stage received (None on the first)."""

    group: object
    collectives: Collectives | None
    rank: int
    world: int
    num_experts: int
    top_k: int
    layers: int = 1
    token_group: object = None
    router_logits: list[torch.Tensor] = dataclasses.field(default_factory=list)
    pipeline: AuxPipeline | None = None
    carried: torch.Tensor | None = None

    def enter_stage(self, stage: int, x, first: bool):
        """`runtime.pipeline.stage.StageModel` starts virtual stage `stage`'s forward on input x (None on the
        stage running the prefix): a new record of router logits and, under pp > 1, the sums the stage before
        handed on, tied to x (runtime.experts.pipeline_aux). Returns x."""
        self.router_logits, self.carried = [], None
        if self.pipeline is None or first:
            return x
        x, self.carried = self.pipeline.enter(stage, x, size=2 * self.num_experts + 2)
        return x

    def leave_stage(self, stage: int, x, last: bool):
        """The end of stage `stage`'s forward with output x: under pp > 1 (not on the last stage) its layers'
        sums, with those carried in, handed to the next stage. Returns x, tied to them."""
        if self.pipeline is None or last:
            return x
        sums = router_sums(self.router_logits, self.num_experts, self.top_k, device=x.device)
        if self.carried is not None:
            sums = sums + self.carried
        return self.pipeline.leave(stage, x, sums)


def ep_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, gate_up_proj: torch.Tensor,
               down_proj: torch.Tensor, router_logits: torch.Tensor | None, ep: EPContext,
               limit: float | None = None, *, glu: str = "silu", alpha: float = 1.0, interleaved: bool = False,
               gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """A MoE layer's experts on this rank's tokens x (T, H): sum_j topk_weight[t, j] * expert_{topk_idx[t, j]}(x[t]),
    the experts spread over the ep group; gate_up_proj (E/ep, 2I, H) and down_proj (E/ep, H, I) (and their biases
    (E/ep, 2I) and (E/ep, H), where the model has them) are this rank's experts: SiLU-gated by default, as Mixtral,
    Qwen3-MoE and DeepSeek-V3 compute them, or as limit, glu, alpha and interleaved say
    (`grouped_experts.gated`). router_logits (T, E): recorded for `ep_aux_loss` (None when the model computes no
    auxiliary loss)."""
    if router_logits is not None:
        ep_record_router_logits(router_logits, ep)
    coll = ep.collectives if ep.collectives is not None else Collectives()
    group = ep.group if ep.world > 1 else None
    experts = batched_experts(gate_up_proj, down_proj, limit=limit, glu=glu, alpha=alpha, interleaved=interleaved,
                              gate_up_bias=gate_up_bias, down_bias=down_bias)
    return ep_moe(x, topk_idx, topk_weight, experts, ep.num_experts, group, coll)


def ep_record_router_logits(router_logits: torch.Tensor, ep: EPContext) -> None:
    """Record a MoE layer's router logits (T, E) of this forward for `ep_aux_loss` (a forward's first layer
    starts a new record: `ep.layers` per forward)."""
    if len(ep.router_logits) >= ep.layers:  # the first MoE layer of the next forward
        ep.router_logits = []
    ep.router_logits.append(router_logits)


class _GradTimes(torch.autograd.Function):
    """Identity forward; the gradient times `k` backward."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.k, None


def ep_aux_loss(ep: EPContext) -> torch.Tensor:
    """The router's load-balancing loss over every layer recorded in this forward and every rank's tokens of the
    batch (the same value on each rank, one process's).

    Its gradient reaches each rank's router logits for that rank's own rows (`runtime.experts.aux_loss`); the
    data-parallel engine then averages gradients over the token group's n ranks, as it must for the mean
    cross-entropy, which would leave this sum's share 1/n of one process's: the gradient is multiplied by n
    on the way in, so the average restores it."""
    layers = ep.router_logits
    before = 0 if ep.carried is None else int(ep.carried[-1].detach())  # the earlier stages' layers (pp > 1)
    if len(layers) + before != ep.layers:
        raise ValueError(f"ep_aux_loss: {len(layers) + before} MoE layers recorded their router logits in this "
                         f"forward ({before} on earlier pipeline stages), not the model's {ep.layers}; the code runs "
                         "ep_experts with the router logits before the loss, and only once per layer (no "
                         "recomputation)")
    coll = ep.collectives if ep.collectives is not None else Collectives()
    loss = load_balancing_loss(layers, ep.num_experts, ep.top_k, ep.token_group, coll, carried=ep.carried)
    n = group_size(ep.token_group)
    return _GradTimes.apply(loss, float(n)) if n > 1 else loss


def ep_router_logits(ep: EPContext, layer: int) -> torch.Tensor:
    """The router logits layer `layer` recorded in this forward (this rank's tokens), where the model returns them.
    Under pp > 1 the last stage holds its own layers' only: an earlier stage's layer gives an empty (0, E)
    `RouterLogitsElsewhere`, which refuses to be computed with (its logits stayed there; the load-balancing loss
    has their sums)."""
    first = ep.layers - len(ep.router_logits)  # the first MoE layer this stage ran (0 without pipelining)
    if layer < first:
        return RouterLogitsElsewhere.of(layer, ep.num_experts, rank_device())
    return ep.router_logits[layer - first]


class RouterLogitsElsewhere(torch.Tensor):
    """The place of an earlier pipeline stage's router logits in the last stage's model output: an empty (0, E)
    tensor that raises, naming the layer, when anything computes with it.

    A loss that reads the model's `router_logits` itself (Hugging Face's `load_balancing_loss_func` concatenates
    them) would otherwise run on the last stage's layers alone, the empty ones vanishing in the concatenation:
    another loss than one process's, silently. Looking at it (shape, dtype, repr) is allowed, and so is moving,
    casting or reshaping it (the traced code casts the logits it returns), which gives another such tensor."""

    layer: int

    @staticmethod
    def of(layer: int, num_experts: int, device: torch.device) -> "RouterLogitsElsewhere":
        return RouterLogitsElsewhere._wrap(torch.zeros(0, num_experts, device=device), layer)

    @staticmethod
    def _wrap(t: torch.Tensor, layer: int) -> "RouterLogitsElsewhere":
        t = torch.Tensor._make_subclass(RouterLogitsElsewhere, t)
        t.layer = layer
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(getattr(func, "overloadpacket", func), "__name__", str(func))
        if func in _LOOKS or name in _MOVES:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **(kwargs or {}))
            if name in _MOVES and isinstance(out, torch.Tensor):
                return cls._wrap(out, _layer_in(args))
            return out
        raise ValueError(
            f"the loss computes with the router logits of MoE layer {_layer_in(args)} ({name}), which stayed on an "
            "earlier pipeline stage: under pp > 1 the model's output holds the last stage's layers' router logits "
            "only. Let the model compute its load-balancing loss (Hugging Face: output_router_logits=True and "
            "labels; the generated code carries each stage's part to the last), or compile with pp=1")


def _layer_in(args) -> int | str:
    for a in args:
        for x in a if isinstance(a, (list, tuple)) else (a,):  # torch.cat takes a list
            if isinstance(x, RouterLogitsElsewhere):
                return x.layer
    return "?"


_LOOKS = {torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel,
          torch.Tensor.__len__, torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
          torch.Tensor.requires_grad.__get__, torch.Tensor.is_floating_point}
_MOVES = {"to", "_to_copy", "view", "reshape", "contiguous", "clone", "detach", "float", "type"}
