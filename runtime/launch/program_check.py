"""Start-up check that every rank runs a program of the same plan.

Ranks running programs of different plans would issue different collectives:
Gloo then pairs messages of different sizes and aborts the process, or,
worse, pairs messages of equal size and trains on garbage. Each generated
program carries PROGRAM_HASH (the SHA-256 of its plan's JSON); before any
other collective the ranks compare theirs in one all-gather of fixed size,
which cannot mismatch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.comm.collectives import Collectives
from runtime.device import place
from runtime.launch.env import LaunchError

__all__ = ["ProgramMismatchError", "check_same_program"]

_WIDTH = 64  # a SHA-256 in hex


class ProgramMismatchError(LaunchError):
    """Ranks of one job run programs generated from different plans."""


def check_same_program(program_hash: str, group=None) -> None:
    """Collective: raise ProgramMismatchError on every rank unless all ranks pass the same hash."""
    raw = program_hash.encode()[:_WIDTH].ljust(_WIDTH, b" ")
    mine = place(torch.frombuffer(bytearray(raw), dtype=torch.uint8))  # NCCL gathers device tensors only
    world = dist.get_world_size(group)
    out = torch.empty(world * _WIDTH, dtype=torch.uint8, device=mine.device)
    Collectives().all_gather(out, mine, group)
    hashes = [bytes(out[r * _WIDTH:(r + 1) * _WIDTH].cpu().tolist()).decode(errors="replace").strip() for r in range(world)]
    if len(set(hashes)) > 1:
        by: dict[str, list[int]] = {}
        for r, h in enumerate(hashes):
            by.setdefault(h, []).append(r)
        parts = "; ".join(f"ranks {ranks} run plan {h[:12] or '(no hash)'}" for h, ranks in by.items())
        raise ProgramMismatchError(
            f"the ranks run programs of different plans ({parts}): every rank must run a program generated from "
            "the same plan, or their collectives would not match; write all programs again from one plan "
            "(plan.write_programs(DIR)) and launch them together")
