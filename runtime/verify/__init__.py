"""`plan.verify`: a plan's generated programs against the unmodified module, in one process.

`check.py` (read first): `verify_plan` builds replica 0's stages with their own programs, runs one
microbatch forward and backward, and compares outputs, loss and every gradient. Then:
- `run.py`: running generated stage code with no process group (tensor slices as threads);
- `local_collectives.py`: the collectives of those threads, met in memory;
- `compare.py`: what is compared and how (ties, shards, replicated gradients);
- `locate.py`: where a difference first appears (block, sub-module, parameter);
- `no_randomness.py`: randomness off on both sides (dropout the identity, every random draw a fixed value).
"""

from runtime.verify.check import (
    MAX_VERIFY_ELEMENTS,
    VerifyError,
    VerifyReport,
    first_microbatch,
    num_parameters,
    verify_plan,
    verify_skip_reason,
)

__all__ = [
    "MAX_VERIFY_ELEMENTS", "VerifyError", "VerifyReport", "first_microbatch", "num_parameters", "verify_plan",
    "verify_skip_reason",
]
