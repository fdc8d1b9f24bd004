"""Sharded checkpoints that any plan of the same model can load (torch.distributed.checkpoint underneath).

Read `save_load.py` first: save a running job, load into a job of any plan and world size. Then
`layout.py`: every piece a rank holds as a box of the full tensor, which is what lets plan B read what
plan A wrote; `dcp_io.py`: those boxes handed to DCP, and its metadata read safely; `manifest.py`: what
makes a directory a trustworthy checkpoint (manifest, hashes, atomic writes, finding the latest);
`reshard.py`: one process, no group: the full state dict, and a checkpoint rewritten for another plan.
"""

from runtime.checkpoint.manifest import (
    FORMAT,
    VERSION,
    CheckpointError,
    latest_checkpoint,
    read_manifest,
    resolve_checkpoint,
    verify_checkpoint,
)
from runtime.checkpoint.reshard import load_full_checkpoint, load_full_state_dict, reshard
from runtime.checkpoint.save_load import CheckpointInfo, load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError", "CheckpointInfo", "FORMAT", "VERSION", "latest_checkpoint", "load_checkpoint",
    "load_full_checkpoint", "load_full_state_dict", "read_manifest", "reshard", "resolve_checkpoint",
    "save_checkpoint", "verify_checkpoint",
]
