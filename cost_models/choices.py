"""The closed lists of choices a user declares and every layer checks: written once, here.

Each is a `Literal` type (for signatures) and the tuple of its values (for checks, CLI choices and error
messages), the tuple taken from the type so the two cannot drift. Plain strings, not enums: they are
what plan JSON stores and what generated programs pass on (`precision='bf16-mixed'`), so a value prints
and compares as itself.

>>> PRECISIONS, SCHEDULES
(('fp32', 'bf16-mixed', 'fp16-mixed', 'bf16', 'fp8-mixed'), ('gpipe', '1f1b', 'interleaved-1f1b', 'zb-h1', 'interleaved-zb', 'zb-v', 'dualpipe-v'))
>>> GRAD_REDUCE_DTYPES, OPTIMIZER_LAYOUTS
(('fp32', 'bf16'), ('replicated', 'distributed'))
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["Precision", "PRECISIONS", "ScheduleKind", "SCHEDULES", "Recompute", "RECOMPUTE_POLICIES",
           "SELECTIVE_RECOMPUTE", "OptimizerName", "OPTIMIZERS", "ZERO_STAGES", "GradReduceDtype", "GRAD_REDUCE_DTYPES",
           "OptimizerLayout", "OPTIMIZER_LAYOUTS", "LAYOUT_ZERO_STAGE", "CpKind", "CP_KINDS", "Zero3Unit",
           "ZERO3_UNITS"]

# fp32 masters under the mixed precisions; "bf16" is pure bf16 (Composer's PURE, FSDP with bf16 parameters):
# parameters, gradients and optimizer state all in bf16, no masters; "fp8-mixed" is bf16-mixed whose linear
# layers' GEMMs take float8 operands with per-tensor current scaling (cost_models.fp8, runtime.engines.fp8)
Precision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp8-mixed"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

# The dtype of the data-parallel gradient reduction under a mixed precision (gradients accumulate in fp32
# either way): fp32 (FSDP2's reduce_dtype=fp32, Megatron's default for bf16) or bf16 (half the bytes)
GradReduceDtype = Literal["fp32", "bf16"]
GRAD_REDUCE_DTYPES: tuple[str, ...] = get_args(GradReduceDtype)

# Where the fp32 masters and optimizer state live: on every data-parallel replica, or sharded over them
# (Megatron's distributed optimizer: ZeRO-1, parameters and gradients replicated)
OptimizerLayout = Literal["replicated", "distributed"]
OPTIMIZER_LAYOUTS: tuple[str, ...] = get_args(OptimizerLayout)
LAYOUT_ZERO_STAGE = {"replicated": 0, "distributed": 1}  # the ZeRO stage each layout is

# zb-h1: 1F1B with each backward split into input and weight gradients, the latter run in the bubble;
# interleaved-zb: interleaved 1F1B split the same way (torch's ScheduleInterleavedZeroBubble);
# zb-v: two stages per rank in a V, split the same way (torch's ScheduleZBVZeroBubble);
# dualpipe-v: the same V, DeepSeek's DualPipe folded onto it (torch's ScheduleDualPipeV): forward and backward
# of the rank's two stages paired in the steady state, split backwards only near the end
ScheduleKind = Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb", "zb-v", "dualpipe-v"]
SCHEDULES: tuple[str, ...] = get_args(ScheduleKind)

# selective: Korthikanti et al.'s (every matrix product's output kept, the rest recomputed); selective-op:
# torchtitan's per-op policy (fused attention's outputs and every second matrix product's kept, the other products
# and everything else recomputed); full: only each block's input kept (runtime.engines.recompute)
Recompute = Literal["none", "selective", "full", "selective-op"]
RECOMPUTE_POLICIES: tuple[str, ...] = get_args(Recompute)
# the modes run by torch's selective activation checkpointing: a policy per op, one backward per region
SELECTIVE_RECOMPUTE: tuple[str, ...] = ("selective", "selective-op")

OptimizerName = Literal["adam", "adamw", "sgd"]  # what a plan is compiled for (adamw keeps Adam's state)
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)

ZERO_STAGES = (0, 1, 2, 3)

# How attention sees the whole sequence under context parallelism: key/value blocks passed around the context
# group (ring attention), or heads re-sharded by all-to-alls (DeepSpeed-Ulysses)
CpKind = Literal["ring", "all-to-all"]
CP_KINDS: tuple[str, ...] = get_args(CpKind)

# What ZeRO-3 gathers and frees at once: "block", a whole repeated block (and the parameters outside the
# blocks as one more unit; FSDP2 wrapping each layer); "module", each module that holds parameters
# directly (a Linear, a norm, an embedding: DeepSpeed ZeRO-3's per-submodule fetch). Finer units hold less
# gathered at once and issue more, smaller collectives (each paying its latency).
Zero3Unit = Literal["block", "module"]
ZERO3_UNITS: tuple[str, ...] = get_args(Zero3Unit)
