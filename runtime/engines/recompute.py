"""Activation recomputation of a block, as the plan's `recompute` says: what backward gets again by running forward.

- "full": the block keeps only its inputs; backward runs the whole block
  again (torch.utils.checkpoint, non-reentrant).
- "selective": the block keeps the outputs of its matrix products and layer
  norms and recomputes everything else in backward: the cheap elementwise,
  softmax, dropout and copy ops, and every op that reads or writes an s x s
  tensor (the attention scores, s the block input's sequence length, dim 1),
  matrix products included. torch's selective activation checkpointing
  (non-reentrant checkpoint with a policy per op). As in Korthikanti et al.
  2022 the memory that grows with s^2 goes, for a few percent more compute;
  unlike there, the elementwise ops' activations go too (a policy sees ops,
  not which tensors autograd would keep, and caching every other output would
  keep more than no recomputation). The cost model counts the same
  (partitioner/planner/unit_costs.py, CostContext.unit_cost).
- "selective-op": torchtitan's per-op selective activation checkpointing. The
  block keeps fused attention's outputs and those of every second matrix
  product in its forward order (the first, third, ...) and recomputes the
  other products and every other op, norms included: more compute than
  "selective" (half the products run again), less memory. A product that
  reads or writes the attention scores is recomputed and not counted; the
  forward and the recomputation count their products apart, so both keep the
  same ones.

All three re-run the block's Python in backward with the forward's RNG state, so
dropout draws the same masks, and every rank issues the same collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from cost_models.choices import SELECTIVE_RECOMPUTE
from cost_models.memory import MATRIX_PRODUCTS, SELECTIVE_KEEPS
from runtime.engines.fp8 import FP8_LINEAR_OP

__all__ = ["MODES", "recompute_blocks", "run_recomputed"]

MODES = ("none", "selective", "full", "selective-op")
# cost_models.memory.SELECTIVE_KEEPS names the ops as the traced graph holds them; the checkpoint policy sees
# them as dispatched, where layer_norm arrives as native_layer_norm.
_DISPATCHED_AS = {"layer_norm": "native_layer_norm"}
# fp8-mixed's linear is one operator of its own (runtime.engines.fp8): kept like aten.linear
_SAVED = {getattr(torch.ops.aten, _DISPATCHED_AS.get(name, name)).default for name in SELECTIVE_KEEPS} | {FP8_LINEAR_OP}
_MATMULS = {getattr(torch.ops.aten, name).default for name in MATRIX_PRODUCTS} | {FP8_LINEAR_OP}
# fused attention as dispatched, by backend (the math backend decomposes into products and a softmax instead)
_FUSED_ATTENTION = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name)}


# The scores are batched, (..., s, s) with a batch or head dimension in front, as every attention computes them
# (bmm, baddbmm, a 4-d matmul): a 2-d operand is a weight or flattened tokens, which may be s wide by chance
# (hidden size = sequence length), and is never taken for them.
def _square(t: Any, s: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[-1] == s and t.shape[-2] == s


def _touches_scores(op, args: tuple, s: int) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(_square(t, s) for t in tensors):  # attention-probabilities @ v
        return True
    if op in _MATMULS and len(tensors) >= 2:  # q @ k^T writes the scores
        a, b = tensors[-2], tensors[-1]
        return a.dim() >= 3 and b.dim() >= 3 and a.shape[-2] == s and b.shape[-1] == s
    return False


def _policy(s: int):
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op not in _SAVED or _touches_scores(op, args, s):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE
    return policy


def _every_second_product(s: int):
    products = {False: 0, True: 0}  # counted apart in the forward and in the recomputation

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in _FUSED_ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if op not in _MATMULS or _touches_scores(op, args, s):
            return CheckpointPolicy.PREFER_RECOMPUTE
        products[ctx.is_recompute] += 1
        return CheckpointPolicy.MUST_SAVE if products[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def run_recomputed(mode: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), its activations kept as `mode` says (the first tensor argument is the block's
    input, (batch, sequence, ...), for "selective" and "selective-op")."""
    if mode == "none":
        return fn(*args, **kwargs)
    if mode == "full":
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    if mode not in SELECTIVE_RECOMPUTE:
        raise ValueError(f"recompute={mode!r}: one of {', '.join(MODES)}")
    x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if x is None or x.dim() < 2:
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)  # no sequence to tell the scores by
    policy = (_policy if mode == "selective" else _every_second_product)(x.shape[1])
    contexts = functools.partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def recompute_blocks(model: torch.nn.Module, names: Sequence[str], mode: str,
                     before: Callable[[torch.nn.Module], None] | None = None) -> None:
    """Make each named submodule of `model` (the plan's blocks) run under `run_recomputed(mode, ...)`, its
    module hooks still firing once around it; `before(module)`, if given, runs inside the checkpoint
    first, the recomputation in backward included (a ZeRO-3 engine re-installs the gathered parameters)."""
    if mode not in MODES:
        raise ValueError(f"recompute={mode!r}: one of {', '.join(MODES)}")
    if mode == "none":
        return
    for name in names:
        mod = model.get_submodule(name)
        if "forward" in vars(mod) and not getattr(vars(mod)["forward"], "recomputable", False):
            raise ValueError(f"recompute_blocks: {name!r} already has its own forward (recomputed twice, or "
                             "patched by the caller); wrap each block once")
        mod.forward = functools.partial(run_recomputed, mode, functools.partial(_rerun, before, mod, mod.forward))


def _rerun(before, mod, forward, *args, **kwargs):
    if before is not None:
        before(mod)
    return forward(*args, **kwargs)
