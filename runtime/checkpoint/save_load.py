"""Save a running job's state, and load it into a job of any plan of the same model (torch.distributed.checkpoint).

    save_checkpoint(runner, "ckpt/", step=100, plan_json=plan.to_json())      # collective: every rank
    info = load_checkpoint(runner_b, "ckpt/")                                   # any plan, any world size
    full = load_full_state_dict("ckpt/")                                        # one process, model's own names
    reshard("ckpt/", plan_b, "ckpt_b/")                                         # offline, one process

What a checkpoint holds. Each rank writes only what it owns, in DCP's format
(`.metadata` and `__{rank}_*.distcp` files): its pieces of every parameter
(the fp32 masters or ZeRO shards its optimizer steps, not the 16-bit copies),
the optimizer's per-element state for the same pieces (Adam's exp_avg,
exp_avg_sq, SGD's momentum), as boxes of the *full* tensors
(`runtime.checkpoint.layout`), so the chunking of plan A says nothing plan B
must know: DCP's load reads, for each box plan B needs, the overlapping parts
of what plan A wrote. Besides: the model's buffers, each rank's RNG state and
gradient-compression residuals (restored only under the same plan and world
size: they are plan-specific), and a JSON manifest: format version, step, data
position, world size, the plan (JSON) and the graph hash, every parameter's
name and full shape, the optimizer's type, scalar state and hyperparameters,
and the size and SHA-256 of every file. Saves happen between steps, where no
gradient is held: there are no gradient accumulators to carry.

Atomic: ranks write into `DIR/.tmp-step_N`; when all are done rank 0 hashes
the files, writes `manifest.json` last, renames the directory to
`DIR/step_N` (one rename) and then points `DIR/latest` at it (write, fsync,
rename). A save killed at any moment leaves the previous checkpoint intact and
`latest` naming it; a directory without a valid manifest is never loaded.

Safe: the manifest and the files' hashes are checked before anything is read
(runtime.checkpoint.manifest), DCP's metadata is unpickled with an allow-list
(runtime.checkpoint.dcp_io), and a checkpoint of another model is refused naming what differs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from cost_models.placements import REPLICATED, sharded_dim
from runtime.checkpoint.dcp_io import Boxes, LoadPlanner, SafeReader, SavePlanner, quiet
from runtime.checkpoint.layout import Box, full_shape, local_to_full, range_boxes
from runtime.engines.optimizer_groups import segments_of
from runtime.checkpoint.manifest import (
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    build_manifest,
    check_checkpoint_model,
    fsync_dir,
    verify_checkpoint,
    write_text_atomic,
)
from runtime.checkpoint.rng import device_rng_key, device_rng_state, set_device_rng_state
from runtime.device import rank_device

__all__ = ["CheckpointInfo", "load_checkpoint", "save_checkpoint"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """What `load_checkpoint` restored: the step to continue from and where the checkpoint came from."""

    path: Path
    step: int
    world_size: int
    same_plan: bool  # saved under this very plan and world size: RNG and compression state restored too
    extra: dict[str, Any]


# ---- the pieces a rank holds ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Elements of parameter `name` held by `holder` (a tensor the optimizer steps): the full tensor's box
    `full`, found in the holder's flattening at [at, at + numel) reshaped to `local_box_shape` and then
    narrowed to `local` (when a fused tensor-parallel slice splits a box)."""

    name: str
    holder: torch.Tensor
    full: Box
    at: int
    region_sizes: tuple[int, ...]  # the contiguous local box the range forms
    local: Box  # inside that region: offsets relative to the region


def _runner_parts(runner: Any) -> tuple[Any, torch.optim.Optimizer, dict[str, tuple[str, int]], int, int]:
    engine = getattr(runner, "engine", None)
    optimizer = getattr(runner, "optimizer", None)
    if engine is None or not hasattr(engine, "master_pieces") or optimizer is None:
        raise CheckpointError(f"{type(runner).__name__} has no engine with master_pieces() and an optimizer: "
                              "checkpoints need a runner built by a generated program (StepRunner, PipelineRunner)")
    placements = dict(getattr(runner, "placements", {}) or {})
    tp_world = int(getattr(runner, "tp_size", 1) or 1)
    tp_rank = 0
    if tp_world > 1:
        me = dist.get_rank()
        tp_rank = next(m[3] for m in runner.mesh if m[0] == me)  # (rank, pp, dp, tp[, cp])
    return engine, optimizer, placements, tp_rank, tp_world


def _pieces(runner: Any) -> tuple[list[_Piece], dict[str, tuple[int, ...]], list[torch.Tensor]]:
    """This rank's pieces, every parameter's full shape, and the holders in optimizer order."""
    engine, _opt, placements, tp_rank, tp_world = _runner_parts(runner)
    held = list(engine.master_pieces())
    # expert slices (runtime.experts.engine) are blocks of the ep group along dim 0, not tensor-parallel slices
    slices = engine.expert_slices() if hasattr(engine, "expert_slices") else {}
    for name, p in getattr(getattr(runner, "stage", None), "tied", {}).items():  # tied copies outside the engine
        held.append((p, ((name, tuple(p.shape), 0, p.numel(), 0),)))
    pieces: list[_Piece] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for holder, ranges in held:
        for name, local_shape, a, b, at in ranges:
            if name in slices:
                (d, index, count), fused = slices[name], 1
            else:
                spec, fused = placements.get(name, (REPLICATED, 1))
                d, index, count = sharded_dim(spec), tp_rank, tp_world
            shapes[name] = full_shape(local_shape, d, count)
            pos = at
            for box in range_boxes(local_shape, a, b):
                n = math.prod(box.sizes)
                for lb in local_to_full(box, local_shape, d, index, count, fused):
                    rel = Box(tuple(o - r for o, r in zip(lb.local.offsets, box.offsets)), lb.local.sizes)
                    pieces.append(_Piece(name, holder, lb.full, pos, box.sizes, rel))
                pos += n
    return pieces, shapes, [h for h, _ in held]


def _view(t: torch.Tensor, pc: _Piece) -> torch.Tensor:
    """The piece's elements inside `t` (the holder or a same-shaped optimizer state), as a view."""
    region = t.detach().reshape(-1)[pc.at:pc.at + math.prod(pc.region_sizes)].view(pc.region_sizes)
    for dim, (o, s) in enumerate(zip(pc.local.offsets, pc.local.sizes)):
        if s != region.shape[dim]:
            region = region.narrow(dim, o, s)
    return region


# ---- save -------------------------------------------------------------------------------------


@torch.no_grad()
def save_checkpoint(runner: Any, save_dir: str | Path, *, step: int, plan_json: str | None = None,
                    extra: Mapping[str, Any] | None = None, keep_last: int | None = None) -> Path:
    """Collective: every rank of the job calls it between steps. Returns `save_dir/step_{step:08d}`.

    plan_json: the plan's JSON (recorded, and its graph hash checked on load); extra: JSON-able values to keep
    (e.g. the data position); keep_last: delete all but the newest `keep_last` checkpoints after saving.
    """
    if not dist.is_initialized():
        raise CheckpointError("save_checkpoint is collective: call it on every rank of an initialised process group")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step={step!r}: must be a non-negative int (the number of steps done)")
    _check_state_per_holder(runner)
    extra = dict(extra or {})
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra={extra!r} is not JSON-serialisable ({e}): keep plain numbers and strings") from None
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(save_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed before
        tmp.mkdir()
    dist.barrier()

    if hasattr(runner, "replica_state"):  # async SGD: replicas differ between averagings (_async_state)
        sd, meta = _async_state(runner, rank)
    else:
        sd, meta = _state(runner)
    dcp.save(sd, storage_writer=FileSystemWriter(str(tmp), sync_files=True), planner=SavePlanner())
    # Rank 0 learns what every rank saw (scalar optimizer state must agree, every holder's names).
    metas: list[Any] = [None] * world
    dist.all_gather_object(metas, meta)
    if rank == 0:
        manifest = build_manifest(metas, step=step, world=world, plan_json=plan_json, extra=extra, tmp=tmp)
        write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if final.exists():  # the same step saved again (a restart): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        write_text_atomic(root / "latest", final.name + "\n")
        if keep_last:
            _prune(root, keep_last)
    dist.barrier()
    return final


def _check_state_per_holder(runner: Any) -> None:
    """Checkpoints keep optimizer state per holder (a flat shard, a master): refuse an optimizer that steps runs
    of shards instead (runtime.engines.optimizer_groups), before anything is written or read."""
    optimizer = getattr(runner, "optimizer", None)
    if optimizer is not None and segments_of(optimizer):
        raise CheckpointError(
            "this run's optimizer_fn gives its parameter groups different hyperparameters, so under ZeRO its "
            "optimizer steps each group's runs of the flat shards (runtime.engines.optimizer_groups), and "
            "checkpoints keep optimizer state per shard: saving and loading it is not supported yet. To "
            "checkpoint, use one set of hyperparameters for every parameter, or zero_stage=0")


def _prune(root: Path, keep: int) -> None:
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))
    for _, p in steps[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def _state(runner: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's DCP state dict and what the manifest needs from it."""
    engine, optimizer, _pl, _tr, _tw = _runner_parts(runner)
    pieces, shapes, holders = _pieces(runner)
    sd: dict[str, Any] = {}
    by_name: dict[str, list[_Piece]] = {}
    for pc in pieces:
        by_name.setdefault(pc.name, []).append(pc)
    elementwise, scalars = _optimizer_kinds(optimizer, holders)
    for name, pcs in by_name.items():
        sd[f"model/{name}"] = Boxes(shapes[name], torch.float32,
                                     [(pc.full, _view(pc.holder, pc).float().clone()) for pc in pcs])
        for key in elementwise:
            boxes = []
            for pc in pcs:
                st = optimizer.state.get(pc.holder, {}).get(key)
                if st is None:
                    continue
                boxes.append((pc.full, _view(st, pc).clone()))
            if boxes:
                sd[f"optim/{key}/{name}"] = Boxes(shapes[name], boxes[0][1].dtype, boxes)
    module = engine.module
    buffers = {n: b for n, b in module.named_buffers() if b is not None and b.device.type != "meta"}
    persistent = set(module.state_dict().keys())
    for n, b in buffers.items():
        if n in persistent:
            sd[f"buffer/{n}"] = b.detach().clone()
    rank = dist.get_rank()
    sd[f"rng/{rank}"] = torch.get_rng_state()
    device = rank_device()
    key = device_rng_key(rank, device)
    if key is not None:  # dropout on a GPU draws from the device's generator (runtime.checkpoint.rng)
        sd[key] = device_rng_state(device)
    comp = engine.compression_state_dict() if hasattr(engine, "compression_state_dict") else {}
    for k, v in comp.items():
        sd[f"compression/{rank}/{k}"] = v.detach().clone()
    keys = _state_keys(runner, module)
    meta = {"params": {n: list(s) for n, s in shapes.items()}, "state_keys": keys,
            "optimizer": {"type": type(optimizer).__module__ + "." + type(optimizer).__qualname__,
                          "elementwise": sorted(elementwise), "scalars": scalars,
                          "param_groups": [_group_hparams(g) for g in optimizer.param_groups]},
            "program_hash": str(getattr(runner, "program_hash", "")), "compression": bool(comp)}
    return sd, meta


def _async_state(runner: Any, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Async SGD's state. Under the usual keys, what any other plan loads: the replicas' common model
    (runner.consensus: their mean, or the agreed parameters with the updates in flight applied) and one
    replica's optimizer state (DCP keeps one copy of boxes every replica writes). Under replica/RANK/, each
    replica's own parameters, optimizer state and averaging state, which a resume under the same plan and
    world size restores exactly. Saving changes nothing: the run goes on as if it had not saved."""
    own = runner.replica_state()
    with runner.consensus_installed():
        sd, meta = _state(runner)
    _e, optimizer, _pl, _tr, _tw = _runner_parts(runner)
    _p, _s, holders = _pieces(runner)
    for k, v in own.items():
        sd[f"replica/{rank}/{k}"] = v
    for i, h in enumerate(holders):
        for key in meta["optimizer"]["elementwise"]:
            st = optimizer.state.get(h, {}).get(key)
            if st is not None:
                sd[f"replica/{rank}/optim/{i}/{key}"] = st.detach().clone()
    return sd, meta


def _state_keys(runner: Any, module: torch.nn.Module) -> dict[str, str]:
    """state_dict key -> the name its tensor is saved under (tied aliases -> the first name)."""
    full_keys = getattr(runner, "full_keys", None)
    if full_keys:
        return {k: canon for k, canon in full_keys}
    if hasattr(runner.engine, "state_keys"):
        return runner.engine.state_keys()
    first: dict[int, str] = {}
    out = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        out[n] = first.setdefault(id(p), n)
    for n in module.state_dict():
        out.setdefault(n, n)
    return out


def _optimizer_kinds(optimizer: torch.optim.Optimizer, holders: Sequence[torch.Tensor]) -> tuple[set[str], dict]:
    """The optimizer's per-element state keys, and its scalar state (equal for every parameter, e.g. Adam's step)."""
    elementwise: set[str] = set()
    scalars: dict[str, dict[str, Any]] = {}
    for h in holders:
        for key, v in optimizer.state.get(h, {}).items():
            if torch.is_tensor(v) and v.dim() > 0:
                if v.shape != h.shape:
                    raise CheckpointError(f"optimizer state {key!r} has shape {tuple(v.shape)}, its parameter "
                                          f"{tuple(h.shape)}: checkpoints hold per-element state or scalars only")
                elementwise.add(key)
                continue
            value = float(v.item()) if torch.is_tensor(v) else v
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise CheckpointError(f"optimizer state {key!r} is a {type(v).__name__}: checkpoints hold tensors "
                                      "and numbers only")
            entry = {"value": value, "tensor": torch.is_tensor(v),
                     "dtype": str(v.dtype).removeprefix("torch.") if torch.is_tensor(v) else None}
            if key in scalars and scalars[key]["value"] != value:
                raise CheckpointError(f"optimizer state {key!r} differs between parameters ({scalars[key]['value']} "
                                      f"vs {value}): checkpoints keep one value per scalar state")
            scalars[key] = entry
    return elementwise, scalars


def _group_hparams(group: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[k] = v
        elif isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v):
            out[k] = list(v)
    return out


# ---- load -------------------------------------------------------------------------------------


@torch.no_grad()
def load_checkpoint(runner: Any, path: str | Path, *, plan_json: str | None = None) -> CheckpointInfo:
    """Load a checkpoint (a step directory, or the newest in a save directory) into a freshly built runner.

    Not collective: each rank reads the boxes its plan needs. Parameters and optimizer state are restored
    exactly whatever plan wrote them; RNG and compression state only under the same plan and world size.
    """
    _check_state_per_holder(runner)
    m = verify_checkpoint(path)
    d = Path(m["path"])
    engine, optimizer, _pl, _tr, _tw = _runner_parts(runner)
    pieces, shapes, holders = _pieces(runner)
    check_checkpoint_model(m, shapes, str(d), subset=True,
                           graph_hash=json.loads(plan_json).get("graph_hash", "") if plan_json else "")
    opt_type = type(optimizer).__module__ + "." + type(optimizer).__qualname__
    if m["optimizer"]["type"] != opt_type:
        raise CheckpointError(f"{d}: saved with optimizer {m['optimizer']['type']}, this run uses {opt_type}: "
                              "optimizer state cannot move between optimizer types; use the same optimizer_fn")
    # Optimizer state is created lazily by torch.optim: create it now so the boxes can be read into it (for the
    # tensors it steps: a frozen parameter, held whole, has none)
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for h in (h for h in holders if id(h) in stepped):
        st = optimizer.state[h]
        for key in m["optimizer"]["elementwise"]:
            st[key] = torch.zeros_like(h)  # torch.optim's state is in its parameter's dtype (bf16 under pure bf16)
        for key, v in m["optimizer"]["scalars"].items():
            st[key] = torch.tensor(v["value"], dtype=getattr(torch, v["dtype"] or "float32")) if v["tensor"] \
                else v["value"]
    if len(m["optimizer"]["param_groups"]) == len(optimizer.param_groups):
        for g, saved in zip(optimizer.param_groups, m["optimizer"]["param_groups"]):
            for k, v in saved.items():
                if k in g and isinstance(v, (int, float, bool)) and isinstance(g[k], (int, float, bool)):
                    g[k] = v  # a learning-rate schedule's current value
    by_name: dict[str, list[_Piece]] = {}
    for pc in pieces:
        by_name.setdefault(pc.name, []).append(pc)
    sd: dict[str, Any] = {}
    targets: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer read into, view to copy to)

    def boxes_for(fqn: str, name: str, tensor_of) -> None:
        seen: dict[tuple[int, ...], torch.Tensor] = {}
        boxes = []
        for pc in by_name[name]:
            dst = _view(tensor_of(pc), pc)
            buf = seen.get(pc.full.offsets)
            if buf is None:
                buf = torch.empty(pc.full.sizes, dtype=torch.float32)
                seen[pc.full.offsets] = buf
                boxes.append((pc.full, buf))
            targets.append((buf, dst))
        sd[fqn] = Boxes(shapes[name], torch.float32, boxes)

    for name in by_name:
        boxes_for(f"model/{name}", name, lambda pc: pc.holder)
        if any(id(pc.holder) not in stepped for pc in by_name[name]):
            continue  # frozen: no optimizer state
        for key in m["optimizer"]["elementwise"]:
            boxes_for(f"optim/{key}/{name}", name, lambda pc, key=key: optimizer.state[pc.holder][key])
    module = engine.module
    persistent = set(module.state_dict().keys())
    buffers = {n: b for n, b in module.named_buffers() if b is not None and n in persistent}
    for n, b in buffers.items():
        sd[f"buffer/{n}"] = b
    rank, world = dist.get_rank() if dist.is_initialized() else 0, dist.get_world_size() if dist.is_initialized() else 1
    same_plan = m["world_size"] == world and bool(m["plan_hash"]) and \
        m["plan_hash"] == str(getattr(runner, "program_hash", ""))
    rng = torch.empty_like(torch.get_rng_state())
    if same_plan:
        sd[f"rng/{rank}"] = rng
    device = rank_device()
    device_key = device_rng_key(rank, device) if same_plan else None
    device_rng: torch.Tensor | None = None
    comp: dict[str, torch.Tensor] = {}
    replica: dict[str, torch.Tensor] = {}
    try:
        md = SafeReader(str(d)).read_metadata()

        def this_ranks(prefix: str, into: dict[str, torch.Tensor]) -> None:
            for fqn, meta in md.state_dict_metadata.items():
                if fqn.startswith(prefix) and hasattr(meta, "size"):
                    into[fqn[len(prefix):]] = sd[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)

        if same_plan and m["compression"]:
            this_ranks(f"compression/{rank}/", comp)
        if same_plan and hasattr(runner, "load_replica_state"):
            this_ranks(f"replica/{rank}/", replica)
        if device_key is not None:
            if device_key in md.state_dict_metadata:
                device_rng = sd[device_key] = torch.empty(md.state_dict_metadata[device_key].size, dtype=torch.uint8)
            else:  # saved on a CPU, or before device generators were saved
                log.warning("%s: no state of the %s generator for rank %d: dropout on %s draws from its current "
                            "state, not as an unbroken run would", d, device.type, rank, device)
        missing = [k for k in sd if k not in md.state_dict_metadata]
        if missing:
            raise CheckpointError(f"{d}: holds no {missing[:3]}: it was not written for this model (or by an older "
                                  "version of it)")
        quiet(dcp.load, sd, storage_reader=SafeReader(str(d)), planner=LoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:  # DCP wraps reader errors in CheckpointException
        raise CheckpointError(f"{d}: reading the checkpoint failed: {type(e).__name__}: {str(e)[:400]}") from e
    for buf, dst in targets:
        dst.copy_(buf.to(dst.dtype))
    if same_plan:
        torch.set_rng_state(rng)
        if device_rng is not None:
            set_device_rng_state(device, device_rng)
        if comp and hasattr(engine, "load_compression_state_dict"):
            engine.load_compression_state_dict(comp)
    engine.refresh_params()
    if hasattr(runner, "after_load"):
        runner.after_load()
    if replica:  # async SGD under the same plan: this replica exactly as it was, not the common model
        for i, h in enumerate(holders):
            for key in m["optimizer"]["elementwise"]:
                if f"optim/{i}/{key}" in replica:
                    optimizer.state[h][key].copy_(replica[f"optim/{i}/{key}"])
        runner.load_replica_state(replica)
    return CheckpointInfo(path=d, step=m["step"], world_size=m["world_size"], same_plan=same_plan,
                          extra=dict(m.get("extra", {})))
