"""Megatron-LM tensor parallelism: autograd-correct collectives and parameter shards.

The building blocks of Shoeybi et al. 2019 ("Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", section 3),
written as `torch.autograd.Function`s over a tensor-parallel process group,
every collective through the counting shim (`runtime.comm.collectives`):

=====================  =========================  ============================
function               forward                    backward
=====================  =========================  ============================
`copy_to_tp`  ("f")    identity                   all-reduce (sum)
`reduce_from_tp` ("g") all-reduce (sum)           identity
`gather_from_tp`       all-gather along `dim`     reduce-scatter along `dim`
`scatter_to_tp`        reduce-scatter along `dim` all-gather along `dim`
=====================  =========================  ============================

`gather_from_tp`/`scatter_to_tp` are sequence parallelism's pair (Korthikanti
et al. 2022): the activation is split along the sequence outside the
tensor-parallel regions. Gloo's all-gather needs equal shards, so `dim` must
divide evenly.

A Megatron MLP on rank r of tp ranks, weights cut by `shard_parameter`::

    x = copy_to_tp(x, group, coll)                          # (B, T, h)      f
    a = F.gelu(F.linear(x, w_fc, b_fc))                      # (B, T, 4h/tp)  column: S(0)
    y = reduce_from_tp(F.linear(a, w_proj), group, coll)     # (B, T, h)      row: S(1), g
    y = y + b_proj                                           # replicated bias, added once

one all-reduce forward (g) and one backward (f) per block.

The vocabulary: `vocab_parallel_embedding` looks up this rank's rows of the
table and all-reduces; `vocab_parallel_cross_entropy` takes logits split
over the vocabulary and all-reduces three fp32 numbers per token (the max
logit, the sum of exp, the target logit), never the logits themselves.

A `group` of None means this rank is alone on the tensor axis (tp = 1, as in
`runtime.comm.groups.ProcessGroups`): the collectives are skipped, since c10d
would read None as the world group. A `runtime.verify.local_collectives.LocalGroup`
with a `LocalCollectives` per slice runs the same code in threads of one
process, with no process group (plan.verify).

Sharding is plain data: `shard_parameter(t, "S(0)", rank, world, fused=3)`
answers "which slice does rank r hold?" without a device or a process group
(STYLE 11), and `unshard_parameter` puts full tensors back together for
checkpoints.

>>> w = torch.arange(12.).view(6, 2)                 # a fused [q; k; v] weight, 2 rows each
>>> shard_parameter(w, "S(0)", rank=1, world=2, fused=3)[:, 0]     # rank 1: q1, k1, v1
tensor([ 2.,  6., 10.])
>>> shards = [shard_parameter(w, "S(0)", r, 2, fused=3) for r in range(2)]
>>> torch.equal(unshard_parameter(shards, "S(0)", fused=3), w)
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from cost_models.placements import REPLICATED, sharded_dim
from runtime.comm.collectives import Collectives
from runtime.comm.groups import group_size
from runtime.engines.evaluation import evaluating_now

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "copy_to_tp",
    "gather_from_tp",
    "keep_token_shards",
    "parse_spec",
    "reduce_from_tp",
    "scatter_to_tp",
    "shard_parameter",
    "sp_gather",
    "sp_scatter",
    "tp_forked",
    "sp_vocab_embedding",
    "TPContext",
    "tp_copy",
    "tp_reduce",
    "tp_vocab_embedding",
    "tp_cross_entropy",
    "tp_gather",
    "tp_chunk",
    "unshard_parameter",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]


# ---------------------------------------------------------------- collectives with their gradients

def _all_reduce(x: torch.Tensor, group, coll: Collectives, op: str = "sum") -> torch.Tensor:
    """A new tensor: the reduction over the group of x (x itself when alone)."""
    if group is None:
        return x
    out = x.contiguous().clone()
    coll.all_reduce(out, group, op=op)
    return out


def _all_gather(x: torch.Tensor, dim: int, group, coll: Collectives) -> torch.Tensor:
    """Every rank's x concatenated along dim, in group-rank order.

    Gathered as they are (rank k's x is block k of a (p, *x.shape) buffer), then laid out with one copy whose
    runs are the dims after `dim`, contiguous: moving `dim` to the front first and back after copied twice
    with a transposed read, 2.4x the time of a tensor-parallel forward on CPU where it gathers vocab-parallel
    logits along their last dim."""
    p = group_size(group)
    if p == 1:
        return x
    dim %= x.dim()  # a dim of x, also in the (p, *x.shape) view below
    x = x.contiguous()
    flat = x.new_empty((p * x.shape[0], *x.shape[1:]))  # the collective's layout: the blocks along dim 0
    coll.all_gather(flat, x, group)
    if dim == 0:
        return flat
    shape = list(x.shape)
    shape[dim] *= p
    # generated code views it as the traced (contiguous) tensor
    return flat.view(p, *x.shape).movedim(0, dim).reshape(shape)


def _reduce_scatter(x: torch.Tensor, dim: int, group, coll: Collectives) -> torch.Tensor:
    """This rank's 1/p slice along dim of the sum over ranks of x: rank k's slice is block k of x, cut along dim
    and laid out as (p, ...) with one copy whose runs are the dims after `dim`, so the slice arrives in its
    final (contiguous) layout."""
    p = group_size(group)
    if p == 1:
        return x
    dim %= x.dim()
    if x.shape[dim] % p:
        raise ValueError(f"reduce-scatter along dim {dim}: size {x.shape[dim]} is not divisible by the "
                         f"tensor-parallel degree {p}; pad that dim to a multiple of {p}")
    shape = list(x.shape)
    shape[dim] //= p
    blocks = x.reshape(*x.shape[:dim], p, *shape[dim:]).movedim(dim, 0).contiguous()  # (p, *shape)
    out = x.new_empty(shape)
    coll.reduce_scatter(out, blocks.view(p * shape[0], *shape[1:]), group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, coll):
        ctx.group, ctx.coll = group, coll
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.coll), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, coll):
        return _all_reduce(x, group, coll)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, coll):
        ctx.dim, ctx.group, ctx.coll = dim, group, coll
        return _all_gather(x, dim, group, coll)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.coll), None, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, coll):
        ctx.dim, ctx.group, ctx.coll = dim, group, coll
        return _reduce_scatter(x, dim, group, coll)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.coll), None, None, None


def copy_to_tp(x: torch.Tensor, group, collectives: Collectives) -> torch.Tensor:
    """Megatron's f, before column-parallel matmuls: identity forward, all-reduce (sum) of the gradient."""
    return _CopyToTP.apply(x, group, collectives)


def reduce_from_tp(x: torch.Tensor, group, collectives: Collectives) -> torch.Tensor:
    """Megatron's g, after a row-parallel matmul: all-reduce (sum) of partial sums, identity backward."""
    return _ReduceFromTP.apply(x, group, collectives)


def gather_from_tp(x: torch.Tensor, dim: int, group, collectives: Collectives) -> torch.Tensor:
    """Sequence parallelism's entry to a TP region: all-gather the shards along dim forward,
    reduce-scatter (sum) the gradient back to this rank's shard. Shards must be equal (Gloo)."""
    return _GatherFromTP.apply(x, dim % x.dim(), group, collectives)


def scatter_to_tp(x: torch.Tensor, dim: int, group, collectives: Collectives) -> torch.Tensor:
    """Sequence parallelism's exit from a TP region (instead of g): reduce-scatter the partial sums
    along dim forward (this rank keeps slice `rank` of the sum), all-gather the gradient backward."""
    return _ScatterToTP.apply(x, dim % x.dim(), group, collectives)


# ---------------------------------------------------------------- parameter shards



def parse_spec(spec: str) -> int | None:
    """The sharded dim of a placement spec: "S(1)" -> 1, "R" -> None (cost_models.placements)."""
    return sharded_dim(spec)


def _checked_dim(shape: torch.Size, spec: str, world: int, fused: int) -> int | None:
    dim = parse_spec(spec)
    if fused < 1:
        raise ValueError(f"fused={fused}: the number of chunks fused along the split dim must be >= 1")
    if world < 1:
        raise ValueError(f"world={world}: the tensor-parallel degree must be >= 1")
    if dim is None:
        return None
    if dim >= len(shape):
        raise ValueError(f"spec {spec} shards dim {dim} of a {len(shape)}-d tensor {tuple(shape)}; "
                         f"pick a dim below {len(shape)}")
    if shape[dim] % fused:
        raise ValueError(f"spec {spec} with fused={fused}: dim {dim} of {tuple(shape)} ({shape[dim]}) does not "
                         f"hold {fused} equal chunks; check the placement's fused count")
    if shape[dim] % (fused * world):
        raise ValueError(f"spec {spec} with fused={fused} over {world} ranks: dim {dim} of {tuple(shape)} "
                         f"({shape[dim]}) is not divisible by fused * world = {fused * world}; choose a "
                         f"tensor-parallel degree dividing {shape[dim] // fused}")
    return dim


def shard_parameter(tensor: torch.Tensor, spec: str, rank: int, world: int, fused: int = 1) -> torch.Tensor:
    """Rank `rank`'s slice of `tensor` under placement `spec`, as a new contiguous tensor.

    "R": a copy of the whole tensor. "S(d)": the rank-th of `world` equal blocks along d; with
    fused=k the tensor is k chunks along d (q, k, v of a fused qkv) and the rank takes its block
    of every chunk, concatenated, so that its local heads' q, k and v stay together.

    >>> shard_parameter(torch.arange(8), "S(0)", rank=1, world=2, fused=2)   # chunks [0..3], [4..7]
    tensor([2, 3, 6, 7])
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside 0..{world - 1} for a tensor-parallel degree of {world}")
    dim = _checked_dim(tensor.shape, spec, world, fused)
    if dim is None:
        return tensor.detach().clone()
    chunks = tensor.detach().chunk(fused, dim)
    return torch.cat([c.chunk(world, dim)[rank] for c in chunks], dim).contiguous()


def unshard_parameter(shards: Sequence[torch.Tensor], spec: str, fused: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard (in rank order): the inverse of `shard_parameter`.

    "R" returns the first shard (all are equal).
    """
    if not shards:
        raise ValueError("unshard_parameter: no shards given; pass one tensor per tensor-parallel rank")
    world = len(shards)
    full_shape = list(shards[0].shape)
    dim = parse_spec(spec)
    if dim is None:
        return shards[0].detach().clone()
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"unshard_parameter: shards differ in shape {[tuple(s.shape) for s in shards]}; "
                         f"shard_parameter makes equal shards")
    full_shape[dim] *= world
    _checked_dim(torch.Size(full_shape), spec, world, fused)
    per_rank = [s.detach().chunk(fused, dim) for s in shards]      # [rank][chunk]
    return torch.cat([torch.cat([per_rank[r][j] for r in range(world)], dim) for j in range(fused)], dim)


# ---------------------------------------------------------------- vocabulary parallelism

def vocab_parallel_embedding(ids: torch.Tensor, local_weight: torch.Tensor, vocab_start: int, group,
                             collectives: Collectives, *, padding_idx: int | None = None) -> torch.Tensor:
    """Embedding with the table split by rows (S(0)): this rank holds ids vocab_start ..
    vocab_start + local_weight.shape[0] - 1. Looks up the ids it holds, zeros the rows of the
    rest and all-reduces (g), so every rank gets the full lookup. (B, T) -> (B, T, h).
    padding_idx (a global id, as nn.Embedding's): its row gets no gradient, on the rank holding it."""
    return reduce_from_tp(_local_lookup(ids, local_weight, vocab_start, padding_idx), group, collectives)


def _local_lookup(ids: torch.Tensor, local_weight: torch.Tensor, vocab_start: int,
                  padding_idx: int | None) -> torch.Tensor:
    """This rank's rows of the lookup, zeros for the ids it does not hold: (B, T) -> (B, T, h) partial sums."""
    vocab_end = vocab_start + local_weight.shape[0]
    outside = (ids < vocab_start) | (ids >= vocab_end)           # (B, T)
    local_ids = (ids - vocab_start).masked_fill(outside, 0)
    pad = padding_idx - vocab_start if padding_idx is not None and vocab_start <= padding_idx < vocab_end else None
    out = F.embedding(local_ids, local_weight, padding_idx=pad)  # (B, T, h)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)           # also zeros the gradient to row 0


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy over tokens with logits split over the vocabulary.

    loss_i = log(sum_v exp(z_iv - m_i)) - (z_i,t_i - m_i), m_i = max_v z_iv, each sum over every
    rank's slice by an all-reduce. d loss / d z_iv = (softmax_iv - [v == t_i]) / N on this
    rank's v, with N the number of tokens not ignored (1 for the sum reduction); no collective in backward.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, ignore_index, group, coll, reduction="mean"):
        v_local = logits.shape[-1]
        z = logits.reshape(-1, v_local)                                          # (N, V/tp)
        z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z       # fp16/bf16 in fp32
        t = targets.reshape(-1)                                                  # (N,)
        m = _all_reduce(z.max(dim=-1).values, group, coll, op="max")             # (N,) max logit
        z = z - m.unsqueeze(-1)
        inside = (t >= vocab_start) & (t < vocab_start + v_local)
        local_t = (t - vocab_start).masked_fill(~inside, 0)
        picked = z.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~inside, 0.0)
        target_logit = _all_reduce(picked, group, coll)                          # (N,) z_t - m
        exp = z.exp()                                                            # (N, V/tp)
        sum_exp = _all_reduce(exp.sum(dim=-1), group, coll)                      # (N,)
        valid = t != ignore_index
        n = valid.sum()
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0).sum()
        if reduction == "mean":
            loss = loss / n
        else:  # the sum: N is 1 in the gradient
            n = torch.ones_like(n)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, inside & valid, valid, n)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, hit, valid, n = ctx.saved_tensors
        grad = softmax.clone()                                                   # (N, V/tp)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= hit.to(grad.dtype)
        grad *= (valid.to(grad.dtype) * (grad_loss.to(grad.dtype) / n)).unsqueeze(-1)
        return grad.to(ctx.logits_dtype).view(ctx.logits_shape), None, None, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group,
                                 collectives: Collectives, *, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """`F.cross_entropy(full_logits.view(-1, V), targets.view(-1), ignore_index=..., reduction=...)` (the mean
    over the tokens not ignored, or their sum) from this rank's vocabulary slice (..., V/tp) of the logits, which hold
    classes vocab_start .. vocab_start + V/tp - 1. Three all-reduces of one fp32 number per
    token (max, sum of exp, target logit); the full logits are never gathered. fp16/bf16 logits
    are computed in fp32, the gradient returned in their dtype.
    """
    if local_logits.shape[:-1] != targets.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(local_logits.shape)} need targets of "
                         f"shape {tuple(local_logits.shape[:-1])} (one class per row), got {tuple(targets.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r}: 'mean' or 'sum' (a per-token "
                         "loss, 'none', needs the full logits: gather them first)")
    return _VocabParallelCrossEntropy.apply(local_logits, targets, vocab_start, ignore_index, group, collectives,
                                            reduction)


# ---------------------------------------------------------------- layers

class ColumnParallelLinear(nn.Module):
    """nn.Linear with the output features split (weight and bias S(0)); input through f.

    `from_linear(full, rank, world, group, coll, fused=3)` for a fused qkv projection.
    Output (..., out/tp), split like the weight rows.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, collectives: Collectives):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.group, self.collectives = group, collectives

    @classmethod
    def from_linear(cls, full: nn.Linear, rank: int, world: int, group, collectives: Collectives,
                    fused: int = 1) -> ColumnParallelLinear:
        bias = None if full.bias is None else shard_parameter(full.bias, "S(0)", rank, world, fused)
        return cls(shard_parameter(full.weight, "S(0)", rank, world, fused), bias, group, collectives)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group, self.collectives), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """nn.Linear with the input features split (weight S(1), bias replicated); output through g.

    Input (..., in/tp) split like a column layer's output; output (..., out), the same on every rank.
    The bias is added once, after the all-reduce.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, collectives: Collectives):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.group, self.collectives = group, collectives

    @classmethod
    def from_linear(cls, full: nn.Linear, rank: int, world: int, group,
                    collectives: Collectives) -> RowParallelLinear:
        bias = None if full.bias is None else shard_parameter(full.bias, REPLICATED, rank, world)
        return cls(shard_parameter(full.weight, "S(1)", rank, world), bias, group, collectives)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group, self.collectives)
        return y if self.bias is None else y + self.bias


# ---------------------------------------------------------------- what generated code calls

class TPContext(NamedTuple):
    """The tensor-parallel group as generated stage code sees it (the `tp` argument of every
    segment function; None when tp = 1, where no segment calls these)."""

    group: object
    collectives: Collectives
    rank: int
    world: int


def tp_forked(slices: Any, op: str, *args: Any, **kwargs: Any) -> Any:
    """`op` ("dropout", "native_dropout", "attention", "shape_mask_attention") on a split activation, drawing
    from this slice's own stream (partitioner.codegen.segment_tp), as Megatron's model-parallel RNG tracker forks
    one per tensor slice: on the shared stream every slice would draw the same mask for its own heads or tokens.
    `slices`: the contexts whose groups split the activation, a TPContext (heads, or tokens under sequence
    parallelism), a CPContext (tokens under context parallelism), or a tuple of them (None where one does not).

    The slice's seed is one draw of the shared stream plus the slice's index: every slice draws it, so the shared
    stream stays alike on all of them (a replicated activation's dropout after this one still draws the same
    mask everywhere), and a recomputed forward draws the same masks again, since torch.utils.checkpoint puts the
    shared stream back as it was for the recomputation. The shared generators (the CPU's, and the activation's
    device's) are put back afterwards.

    >>> tp0, tp1 = TPContext(None, None, 0, 2), TPContext(None, None, 1, 2)
    >>> x = torch.ones(1000)
    >>> _ = torch.manual_seed(0); a = tp_forked(tp0, "dropout", x, 0.5, True); after = torch.rand(1)
    >>> _ = torch.manual_seed(0); b = tp_forked(tp1, "dropout", x, 0.5, True)
    >>> bool((a != b).any()), torch.equal(torch.rand(1), after)   # the slices' masks differ; the stream is alike
    (True, True)
    """
    fn = _forked_op(op)
    index, count = 0, 1
    # a context is a NamedTuple itself: a tuple of contexts is one without `world`
    for ctx in slices if isinstance(slices, tuple) and not hasattr(slices, "world") else (slices,):
        if ctx is not None:
            index, count = index + count * ctx.rank, count * ctx.world
    if count == 1 or evaluating_now():  # an evaluation draws nothing (runtime.engines.evaluation)
        return fn(*args, **kwargs)
    seed = (int(torch.randint(0, 2**62, ())) + 2718 * (index + 1)) % 2**63  # Megatron offsets its fork by 2718
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    accelerator = device.type not in ("cpu", "meta")
    with torch.random.fork_rng(devices=[device] if accelerator else [], device_type=device.type):
        torch.default_generator.manual_seed(seed)
        if accelerator:
            torch.get_device_module(device.type).manual_seed(seed)  # the current device's generator
        return fn(*args, **kwargs)


def _forked_op(op: str) -> Any:
    if op == "shape_mask_attention":
        from runtime.pipeline.attention import shape_mask_attention

        return shape_mask_attention
    ops = {"dropout": torch.ops.aten.dropout.default, "native_dropout": torch.ops.aten.native_dropout.default,
           "attention": torch.ops.aten.scaled_dot_product_attention.default}
    if op not in ops:
        raise ValueError(f"tp_forked: op {op!r} is not one of {sorted(ops) + ['shape_mask_attention']}")
    return ops[op]


def tp_copy(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """f at a column-parallel region's input (see `copy_to_tp`)."""
    return copy_to_tp(x, tp.group, tp.collectives)


def tp_reduce(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """g after a row-parallel matmul (see `reduce_from_tp`)."""
    return reduce_from_tp(x, tp.group, tp.collectives)


def tp_vocab_embedding(local_weight: torch.Tensor, ids: torch.Tensor, tp: TPContext,
                       padding_idx: int = -1) -> torch.Tensor:
    """aten.embedding(weight, ids, padding_idx) with the table split by rows over the group (see
    `vocab_parallel_embedding`); padding_idx -1 is none, as in aten."""
    return vocab_parallel_embedding(ids, local_weight, tp.rank * local_weight.shape[0], tp.group, tp.collectives,
                                    padding_idx=None if padding_idx < 0 else padding_idx)


def tp_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                     tp: TPContext) -> torch.Tensor:
    """aten.cross_entropy_loss (mean) over logits split by vocabulary (see `vocab_parallel_cross_entropy`)."""
    return vocab_parallel_cross_entropy(local_logits, targets, tp.rank * local_logits.shape[-1], tp.group,
                                        tp.collectives, ignore_index=ignore_index)


def sp_gather(x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
    """Sequence parallelism: a token-split value all-gathered along `dim` for a tensor-split reader (a
    column-parallel matmul replaces f by it); the gradient, a partial sum on each rank, reduce-scattered.

    What its readers save for backward of it (the matmul's input, or a view of it) is kept as this rank's
    tokens and all-gathered again when backward needs it (`keep_token_shards`), as Megatron-LM does: the
    activations of a sequence-parallel layer are then all 1/tp."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        # the readers compute in the autocast dtype: gather in it (half the bytes), and let them save this
        # tensor rather than a cast copy of it, so that it is what `keep_token_shards` keeps as a shard
        x = x.to(torch.get_autocast_dtype(device))
    full = gather_from_tp(x, dim, tp.group, tp.collectives)
    if _REGATHER_ON and group_size(tp.group) > 1:
        _GATHERED[full] = _Gathered(x.detach(), dim, tp)
    return full


class _Gathered:
    """One sp_gather's shard, and its all-gather again while backward still unpacks what its readers saved.

    Several readers save the same gathered tensor (the q, k and v projections of one normed input; a gated
    MLP's gate and up): the first unpack gathers, the others reuse it, and the last one packed lets it go,
    so backward re-gathers a value once, as Megatron-LM's fused qkv does. A tensor unpacked more often than
    it was packed (a split backward's I and then W run a node twice) is gathered again: every rank of the
    tensor group unpacks in the same order, so the gathers still pair up."""

    __slots__ = ("shard", "dim", "tp", "pending", "full")

    def __init__(self, shard: torch.Tensor, dim: int, tp: TPContext):
        self.shard, self.dim, self.tp = shard, dim, tp
        self.pending = 0  # saved tensors packed and not yet unpacked
        self.full: torch.Tensor | None = None

    def unpack(self) -> torch.Tensor:
        full = self.full if self.full is not None else \
            _all_gather(self.shard, self.dim, self.tp.group, self.tp.collectives)
        self.pending -= 1
        self.full = full if self.pending > 0 else None
        return full


class _Regather(NamedTuple):
    gathered: _Gathered
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


# tensors sp_gather made -> their _Gathered, for as long as they live
_GATHERED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_REGATHER_ON = True  # tests switch it off to measure what keeping the whole tokens costs


def _pack(t: torch.Tensor) -> Any:
    base = t if t in _GATHERED else t._base if t._base is not None and t._base in _GATHERED else None
    if base is None:
        return t
    gathered = _GATHERED[base]
    gathered.pending += 1
    return _Regather(gathered, tuple(t.size()), tuple(t.stride()), t.storage_offset())


def _unpack(p: Any) -> torch.Tensor:
    if not isinstance(p, _Regather):
        return p
    # the gather is contiguous, as the first one was: the saved view is the same window of it
    return p.gathered.unpack().as_strided(p.size, p.stride, p.offset)


def keep_token_shards() -> torch.autograd.graph.saved_tensors_hooks:
    """The context a sequence-parallel stage's forward runs in: tensors that sp_gather made (and views of
    them) are saved for backward as this rank's tokens only and all-gathered again when unpacked. Every rank
    of the tensor group unpacks the same saved tensors in the same order (one graph), so the gathers pair up.
    Under autocast sp_gather gathers in the autocast dtype, so its readers save what it made."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


def sp_scatter(x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
    """Sequence parallelism: a row-parallel matmul's partial sums reduce-scattered along the token dim `dim`
    (instead of g's all-reduce); this rank keeps its slice of the tokens."""
    return scatter_to_tp(x, dim, tp.group, tp.collectives)


def sp_vocab_embedding(local_weight: torch.Tensor, ids: torch.Tensor, dim: int, tp: TPContext,
                       padding_idx: int = -1) -> torch.Tensor:
    """`tp_vocab_embedding` whose output is reduce-scattered along the token dim `dim` (sequence parallelism)
    instead of all-reduced."""
    local = _local_lookup(ids, local_weight, tp.rank * local_weight.shape[0], None if padding_idx < 0 else padding_idx)
    return scatter_to_tp(local, dim, tp.group, tp.collectives)


class _GatherOutput(torch.autograd.Function):
    """All-gather along dim forward; backward keeps this rank's slice. For a model output every
    tensor rank computes the same function of: the gradient is the same on all, so no reduction."""

    @staticmethod
    def forward(ctx, x, dim, tp):
        ctx.dim, ctx.rank, ctx.world = dim, tp.rank, tp.world
        return _all_gather(x, dim, tp.group, tp.collectives)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.world, ctx.dim)[ctx.rank].contiguous(), None, None


class _ChunkOperand(torch.autograd.Function):
    """This rank's chunk along dim forward; the gradient all-gathered backward (Megatron's scatter to the
    model-parallel region). Generated code uses it on operands that need no gradient (a bias or mask with a
    heads dim), where the backward never runs; it is right for any replicated input all the same."""

    @staticmethod
    def forward(ctx, x, dim, tp):
        ctx.dim, ctx.tp = dim, tp
        return x.chunk(tp.world, dim)[tp.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad.contiguous(), ctx.dim, ctx.tp.group, ctx.tp.collectives), None, None


def tp_chunk(x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
    """A replicated tensor that spans the split dim of the values it meets (an attention bias per head),
    cut to this rank's part along `dim`."""
    dim %= x.dim()
    if x.shape[dim] % tp.world:
        raise ValueError(f"tp_chunk: dim {dim} of a {tuple(x.shape)} tensor does not divide over {tp.world} "
                         "tensor ranks; the plan's divisors should have refused this tp")
    return _ChunkOperand.apply(x, dim, tp)


def tp_gather(x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
    """A value split over the tensor group along `dim`, whole on every rank, for a reader that needs it whole (a
    model output split by tokens; vocab-split logits a loss_fn reads other than by a cross entropy:
    runtime.pipeline.vocab_logits). Backward keeps this rank's slice of the gradient, which every rank computes
    alike."""
    return _GatherOutput.apply(x, dim % x.dim(), tp)
