"""torch.compile of the model code a rank runs, one block at a time (a plan's `torch_compile`).

What is compiled, and why at that granularity:

- a data-parallel or async SGD program running the module's own forward: each of the plan's blocks
  (`compile_blocks`: the block module's `forward` replaced by its compiled self). The module's `__call__`
  is not compiled, so its hooks run eagerly around the compiled forward: ZeRO-3's gathers and frees
  (runtime.engines.zero3, forward pre- and post-hooks of each unit's module) and the gradient hooks of the
  data-parallel buckets (hooks on parameters, fired by autograd after the compiled backward) keep firing
  as in eager mode, and every collective they issue runs outside the compiled graphs. What is outside the
  blocks (embeddings, the head, the loss) runs eagerly.
- a program running the plan's generated code (pipeline stages, and data-parallel programs of plans with
  code): each segment function, prefix, block and suffix (`compile_function`, applied by
  `runtime.pipeline.stage.StageModel`); the blocks' modules and their hooks again stay outside.

Recomputation wraps the compiled code, never the other way round: the recompute wrapper
(runtime.engines.recompute) is installed after, around the compiled forward, so torch.utils.checkpoint
still decides what a block keeps, exactly as the plan says, and backward re-runs the compiled forward.
Tensor- and context-parallel code calls collectives inside a block; such programs are refused
(`partitioner.codegen.program`), not compiled with graph breaks we have not tested.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["compile_blocks", "compile_function"]


def compile_function(fn: Callable, backend: str) -> Callable:
    """`fn` compiled by torch.compile with `backend` (static shapes: every microbatch of a plan has one shape)."""
    compiled = torch.compile(fn, backend=backend, dynamic=False)
    return functools.wraps(fn)(compiled) if not hasattr(compiled, "__wrapped__") else compiled


def compile_blocks(model: nn.Module, names: Sequence[str], backend: str) -> None:
    """Replace the `forward` of each named submodule of `model` (the plan's blocks) by its compiled self;
    `model.<name>(...)` still runs the module's hooks, eagerly, around it. Call before recomputation is
    installed (runtime.engines.recompute wraps the compiled forward once, as it wraps an eager one)."""
    if not backend:
        return
    for name in names:
        mod = model.get_submodule(name)
        own = vars(mod).get("forward")
        if own is not None and (getattr(own, "compiled", False) or not getattr(own, "recomputable", False)):
            raise ValueError(f"compile_blocks: {name!r} already has its own forward (compiled twice, or patched "
                             "by the caller); compile each block once, before recomputation wraps it")
        forward = compile_function(mod.forward, backend)
        forward.recomputable = True  # runtime.engines.recompute may wrap it once
        forward.compiled = True
        mod.forward = forward
