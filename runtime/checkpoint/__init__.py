"""Sharded checkpoints that any plan of the same model can load (torch.distributed.checkpoint underneath).

`files.py` (read first): save, load into any plan, verify, reshard offline, load the full state dict in
one process; `layout.py`: every piece a rank holds as a box of the full tensor, which is what lets plan B
read what plan A wrote.
"""

from runtime.checkpoint.files import (
    FORMAT,
    VERSION,
    CheckpointError,
    CheckpointInfo,
    latest_checkpoint,
    load_checkpoint,
    load_full_state_dict,
    read_manifest,
    reshard,
    resolve_checkpoint,
    save_checkpoint,
)

__all__ = [
    "CheckpointError", "CheckpointInfo", "FORMAT", "VERSION", "latest_checkpoint", "load_checkpoint",
    "load_full_state_dict", "read_manifest", "reshard", "resolve_checkpoint", "save_checkpoint",
]
