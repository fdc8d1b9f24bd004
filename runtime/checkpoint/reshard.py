"""Checkpoints read in one process, with no process group: the full state dict, and resharding for another plan.

    full = load_full_state_dict("ckpt/")          # the model's own state_dict keys: model.load_state_dict(full)
    reshard("ckpt/", plan_b, "ckpt_b/")            # rewritten chunked as plan B's ranks hold it

Any plan can load any checkpoint directly (runtime.checkpoint.save_load); resharding offline makes plan B's
load read only what it needs.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from cost_models.placements import REPLICATED, sharded_dim
from runtime.checkpoint.dcp_io import Boxes, SavePlanner, quiet, read_full
from runtime.checkpoint.layout import Box, local_to_full, range_boxes
from runtime.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    check_checkpoint_model,
    sha256_of,
    verify_checkpoint,
    write_text_atomic,
)

__all__ = ["load_full_checkpoint", "load_full_state_dict", "reshard"]


def load_full_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, unsharded, under its checkpoint key: "model/NAME", "optim/KEY/NAME",
    "buffer/NAME", "rng/RANK" (and "rng_cuda/RANK" when saved on GPUs: runtime.checkpoint.rng),
    "compression/RANK/KEY". One process, no group (for tests and tools)."""
    m = verify_checkpoint(path)
    return read_full(Path(m["path"]), ("model/", "optim/", "buffer/", "rng/", "rng_", "compression/"))


def load_full_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The unsharded model state (parameters in fp32 and buffers) under the model's own state_dict keys:
    `model.load_state_dict(load_full_state_dict(d))` works on the plain model. One process, no group."""
    m = verify_checkpoint(path)
    d = Path(m["path"])
    sd = read_full(d, ("model/", "buffer/"))
    out = {}
    for key, canon in m["state_keys"].items():
        t = sd.get(f"model/{canon}", sd.get(f"buffer/{canon}"))
        if t is None:
            raise CheckpointError(f"{d}: no tensor for state_dict key {key!r} (saved as {canon!r}): the checkpoint "
                                  "is incomplete")
        out[key] = t
    return out


def reshard(src: str | Path, plan_b: Any, dst: str | Path) -> Path:
    """Offline: rewrite checkpoint `src` chunked as plan B's ranks hold it (each box = one rank's tensor-parallel
    slice of one parameter, split over its data-parallel replicas when B shards with ZeRO), with B recorded in the
    manifest. One process, no process group. RNG and compression state (per rank of A) are dropped.
    Any plan can load any checkpoint directly; resharding offline makes B's load read only what it needs."""
    m = verify_checkpoint(src)
    d = Path(m.pop("path"))
    plan = _plan_dict(plan_b)
    placements = {p["param"]: p for p in plan.get("placements", [])}
    if placements:
        check_checkpoint_model(m, {n: p.get("shape", ()) for n, p in placements.items()}, str(d),
                               graph_hash=plan.get("graph_hash", ""))
    full = read_full(d, ("model/", "optim/", "buffer/"))
    cfg = plan.get("config", {})
    tp, dp = int(cfg.get("tp", 1)), int(cfg.get("dp", 1))
    zero = int(cfg.get("zero_stage", 0))
    sd: dict[str, Any] = {}
    for fqn, t in full.items():
        if fqn.startswith("buffer/"):
            sd[fqn] = t
            continue
        name = fqn.split("/", 1)[1] if fqn.startswith("model/") else fqn.split("/", 2)[2]
        p = placements.get(name, {"spec": REPLICATED, "fused": 1})
        d_ = sharded_dim(p.get("spec", REPLICATED))
        boxes: list[tuple[Box, torch.Tensor]] = []
        seen: set[tuple[int, ...]] = set()
        for t_rank in range(tp if d_ is not None else 1):
            local = _slice_shape(tuple(t.shape), d_, tp)
            n = math.prod(local)
            per = -(-n // dp) if zero > 0 else n
            for r in range(dp if zero > 0 else 1):
                for box in range_boxes(local, r * per, min(n, (r + 1) * per)):
                    for lb in local_to_full(box, local, d_, t_rank, tp, int(p.get("fused", 1))):
                        if lb.full.offsets not in seen:
                            seen.add(lb.full.offsets)
                            sl = tuple(slice(o, o + s) for o, s in zip(lb.full.offsets, lb.full.sizes))
                            boxes.append((lb.full, t[sl].contiguous()))
        sd[fqn] = Boxes(t.shape, t.dtype, boxes)
    out = Path(dst)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty: reshard writes a new checkpoint; pass a new directory")
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    quiet(dcp.save, sd, storage_writer=FileSystemWriter(str(tmp), sync_files=True), planner=SavePlanner(),
           no_dist=True)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = dict(m, world_size=int(plan.get("world_size", m["world_size"])), plan=plan,
                    graph_hash=plan.get("graph_hash", m["graph_hash"]), plan_hash="", compression=False, files=files,
                    extra=dict(m.get("extra", {}), resharded_from=str(d)), saved_at=time.time())
    write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return out


def _slice_shape(shape: tuple[int, ...], d: int | None, tp: int) -> tuple[int, ...]:
    if d is None:
        return shape
    if shape[d] % tp:
        raise CheckpointError(f"plan B splits a dim of size {shape[d]} over tp={tp}, which does not divide it")
    return tuple(s // tp if i == d else s for i, s in enumerate(shape))


def _plan_dict(plan: Any) -> dict[str, Any]:
    if hasattr(plan, "to_json"):
        return json.loads(plan.to_json())
    if isinstance(plan, Mapping):
        return dict(plan)
    p = Path(plan)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"plan B {p}: cannot read it as plan JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"plan B {p}: not a plan (a JSON object)")
    return data
