"""The closed lists of choices a user declares and every layer checks: written once, here.

Each is a `Literal` type (for signatures) and the tuple of its values (for checks, CLI choices and error
messages), the tuple taken from the type so the two cannot drift. Plain strings, not enums: they are
what plan JSON stores and what generated programs pass on (`precision='bf16-mixed'`), so a value prints
and compares as itself.

>>> PRECISIONS, SCHEDULES
(('fp32', 'bf16-mixed', 'fp16-mixed'), ('gpipe', '1f1b', 'interleaved-1f1b'))
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["Precision", "PRECISIONS", "ScheduleKind", "SCHEDULES", "Recompute", "RECOMPUTE_POLICIES",
           "OptimizerName", "OPTIMIZERS", "ZERO_STAGES"]

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed"]  # fp32 masters under both mixed precisions
PRECISIONS: tuple[str, ...] = get_args(Precision)

ScheduleKind = Literal["gpipe", "1f1b", "interleaved-1f1b"]
SCHEDULES: tuple[str, ...] = get_args(ScheduleKind)

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_POLICIES: tuple[str, ...] = get_args(Recompute)

OptimizerName = Literal["adam", "adamw", "sgd"]  # what a plan is compiled for (adamw keeps Adam's state)
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)

ZERO_STAGES = (0, 1, 2, 3)
