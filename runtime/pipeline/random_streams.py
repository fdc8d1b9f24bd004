"""Each pipeline rank draws its random numbers (dropout masks, sampled routes) from a stream of its own.

Every rank builds the whole model from the same seed, so that its parameters start equal everywhere, and
leaves the build with the same generator state. Without more, the second pipeline rank's layers would then
draw the masks the first rank's layers drew: a 4-layer model cut in two would drop layer 2 as layer 0 and
layer 3 as layer 1, where one process draws every layer's mask afresh. So after the build each pipeline rank
p > 0 seeds its generators (the CPU's and every device's, `torch.manual_seed`) with the build's seed
+ 100 p, Megatron's offset per pipeline rank; rank 0 keeps the stream the build left, as one process does.
The tensor slices and data-parallel replicas of a stage share its pipeline rank, hence its stream: a
replicated activation is dropped alike on every slice, as it must be.

>>> _ = torch.manual_seed(7)
>>> seed_pipeline_rank(2)
>>> torch.initial_seed()
207
"""

from __future__ import annotations

import torch

__all__ = ["SEED_STRIDE", "seed_pipeline_rank"]

SEED_STRIDE = 100  # Megatron's `seed + 100 * pipeline rank`


def seed_pipeline_rank(pp_rank: int) -> None:
    """Seed this process's generators for pipeline rank `pp_rank` (rank 0: left as they are)."""
    if pp_rank:
        torch.manual_seed(torch.initial_seed() + SEED_STRIDE * pp_rank)
