"""Sharded checkpoints that any plan of the same model can load: torch.distributed.checkpoint underneath.

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

Safe: the manifest is JSON; before DCP reads anything every file's size and
hash are checked against it (a corrupted or truncated shard is refused, naming
the file); DCP's `.metadata` is unpickled by an allow-list unpickler that
admits only DCP's metadata classes, torch.Size and dtypes, never arbitrary
objects; tensors are read as raw bytes (DCP) or with `torch.load(weights_only=True)`.
A checkpoint of another model (other parameter names or shapes, or another
graph hash) is refused with an error naming what differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from cost_models.errors import PartitionerError
from cost_models.placements import REPLICATED, sharded_dim
from runtime.checkpoint.layout import Box, full_shape, local_to_full, range_boxes

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "CheckpointInfo",
    "latest_checkpoint",
    "load_checkpoint",
    "load_full_state_dict",
    "read_manifest",
    "reshard",
    "resolve_checkpoint",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT, VERSION = "partitioner-checkpoint", 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(PartitionerError):
    """A checkpoint that cannot be written or loaded as asked: the message names the file or field and the fix."""


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
        tp_rank = next(tp for r, _pp, _dp, tp in runner.mesh if r == me)
    return engine, optimizer, placements, tp_rank, tp_world


def _pieces(runner: Any) -> tuple[list[_Piece], dict[str, tuple[int, ...]], list[torch.Tensor]]:
    """This rank's pieces, every parameter's full shape, and the holders in optimizer order."""
    engine, _opt, placements, tp_rank, tp_world = _runner_parts(runner)
    held = list(engine.master_pieces())
    for name, p in getattr(getattr(runner, "stage", None), "tied", {}).items():  # tied copies outside the engine
        held.append((p, ((name, tuple(p.shape), 0, p.numel(), 0),)))
    pieces: list[_Piece] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for holder, ranges in held:
        for name, local_shape, a, b, at in ranges:
            spec, fused = placements.get(name, (REPLICATED, 1))
            d = sharded_dim(spec)
            shapes[name] = full_shape(local_shape, d, tp_world)
            pos = at
            for box in range_boxes(local_shape, a, b):
                n = math.prod(box.sizes)
                for lb in local_to_full(box, local_shape, d, tp_rank, tp_world, fused):
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


# ---- DCP: many boxes of one tensor per rank ----------------------------------------------------


class _Boxes:
    """A rank's boxes of one full tensor, in the protocol DCP's planners use for DTensor shards."""

    def __init__(self, size: Sequence[int], dtype: torch.dtype, boxes: list[tuple[Box, torch.Tensor]]):
        self._size, self.dtype, self.boxes = torch.Size(size), dtype, boxes
        self._by_offset = {torch.Size(b.offsets): t for b, t in boxes}
        if len(self._by_offset) != len(boxes):
            raise CheckpointError("internal: two boxes of one tensor start at the same offset")

    def size(self) -> torch.Size:
        return self._size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(b.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)),
                              properties=TensorProperties(dtype=t.dtype), size=self._size))
                for b, t in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b, _ in self.boxes]

    def shard(self, offset: torch.Size) -> torch.Tensor:
        return self._by_offset[torch.Size(offset)]


class _SavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        return obj.shard(index.offset) if isinstance(obj, _Boxes) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # DefaultLoadPlanner first maps the state dict through _init_state_dict, which drops objects
        # that are not tensors (our _Boxes) to None; nothing here lives on the meta device.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.shard(index.offset) if isinstance(obj, _Boxes) else super().lookup_tensor(index)


# What DCP's `.metadata` pickle is made of; nothing else may be unpickled from a checkpoint.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64",
              "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "strided", "contiguous_format",
              "channels_last", "preserve_format", "dtype", "layout", "memory_format"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}


class _SafeUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; admit only the classes it is made of."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                md = _SafeUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: not a valid DCP metadata file ({e}); the checkpoint is corrupted or was "
                                  "not written by this project") from None
        md.storage_meta = getattr(md, "storage_meta", None)
        return md


# ---- manifest -----------------------------------------------------------------------------------


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The validated manifest of the checkpoint directory `path` (or of the manifest file itself)."""
    p = Path(path)
    f = p / MANIFEST if p.is_dir() else p
    try:
        text = f.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{f}: no checkpoint manifest; {p} is not a checkpoint (or its save did not finish). "
                              "Pass a directory written by save_checkpoint / launch_local(save_dir=...)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: cannot read the manifest ({e})") from None
    try:
        m = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError; an int of over 4300 digits; nesting too deep
        raise CheckpointError(f"{f}: the manifest is not JSON ({type(e).__name__}: {str(e)[:200]}); the checkpoint "
                              "is corrupted") from None
    _check_manifest(m, f)
    return m


def _check_manifest(m: Any, f: Path) -> None:
    def bad(field: str, want: str) -> CheckpointError:
        got = m.get(field, "<missing>") if isinstance(m, dict) else m
        return CheckpointError(f"{f}: manifest field {field!r} must be {want}, got {str(got)[:80]!r}; the "
                               "checkpoint is corrupted or not written by this project")

    if not isinstance(m, dict):
        raise bad("(top level)", "a JSON object")
    if m.get("format") != FORMAT:
        raise bad("format", repr(FORMAT))
    if m.get("version") != VERSION:
        raise CheckpointError(f"{f}: checkpoint format version {m.get('version')!r}; this project reads version "
                              f"{VERSION}")
    for field in ("step", "world_size"):
        v = m.get(field)
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if field == "world_size" else 0) or v > 2**53:
            raise bad(field, "a non-negative integer" if field == "step" else "a positive integer")
    for field in ("graph_hash", "plan_hash"):
        if not isinstance(m.get(field), str):
            raise bad(field, "a string")
    if m.get("plan") is not None and not isinstance(m["plan"], dict):
        raise bad("plan", "a JSON object or null")
    params = m.get("params")
    if not isinstance(params, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                                              and 0 <= d < 2**53 for d in v)
            for k, v in params.items()):
        raise bad("params", "an object mapping parameter names to shapes (lists of non-negative integers)")
    keys = m.get("state_keys")
    if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
        raise bad("state_keys", "an object mapping state_dict keys to parameter or buffer names")
    opt = m.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("type"), str) or \
            not isinstance(opt.get("elementwise"), list) or not all(isinstance(k, str) for k in opt["elementwise"]) \
            or not isinstance(opt.get("scalars"), dict) or not isinstance(opt.get("param_groups"), list):
        raise bad("optimizer", "an object with type, elementwise, scalars and param_groups")
    for k, v in opt["scalars"].items():
        if not isinstance(v, dict) or not isinstance(v.get("value"), (int, float)) or isinstance(v.get("value"), bool):
            raise bad("optimizer", f"scalars[{k!r}] an object with a numeric value")
    files = m.get("files")
    if not isinstance(files, dict) or not files or not all(
            isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("bytes"), int)
            and isinstance(v.get("sha256"), str) for k, v in files.items()):
        raise bad("files", "an object mapping file names to {bytes, sha256}")
    for name in files:
        if "/" in name or "\\" in name or name in ("", ".", "..") or name == MANIFEST:
            raise bad("files", f"plain file names inside the checkpoint (got {name!r})")
    if not isinstance(m.get("extra", {}), dict):
        raise bad("extra", "a JSON object")


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Resolve `path`, validate its manifest and every file's size and SHA-256; return the manifest (with "path")."""
    d = resolve_checkpoint(path)
    m = read_manifest(d)
    _verify_files(d, m)
    return dict(m, path=str(d))


def check_checkpoint_model(manifest: Mapping[str, Any], shapes: Mapping[str, Sequence[int]], where: str, *,
                           subset: bool = False, graph_hash: str = "") -> None:
    """Refuse a checkpoint whose parameters (names, full shapes) are not `shapes` (a plan's placements; with
    `subset`, the ones one rank holds), or that was saved for another graph than `graph_hash` (when both know it)."""
    saved = {n: tuple(s) for n, s in manifest["params"].items()}
    want = {n: tuple(s) for n, s in shapes.items()}
    only_ckpt = [] if subset else sorted(set(saved) - set(want))[:3]
    only_plan = sorted(set(want) - set(saved))[:3]
    differ = [f"{n} {want[n]} vs saved {saved[n]}" for n in want if n in saved and want[n] != saved[n]][:3]
    if only_ckpt or only_plan or differ:
        raise CheckpointError(f"{where}: a checkpoint of another model: the checkpoint and the plan are for different "
                              f"models (only in the checkpoint: {only_ckpt}; only in the plan: {only_plan}; shapes that "
                              f"differ: {differ}); use a checkpoint and a plan of the same model")
    if graph_hash and manifest["graph_hash"] and graph_hash != manifest["graph_hash"]:
        raise CheckpointError(f"{where}: a checkpoint of another model: saved for graph {manifest['graph_hash'][:12]}, "
                              f"the plan is for graph {graph_hash[:12]} (a changed model definition?)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verify_files(d: Path, m: Mapping[str, Any]) -> None:
    for name, want in m["files"].items():
        p = d / name
        if not p.is_file():
            raise CheckpointError(f"{p}: missing from the checkpoint (the manifest lists it); the checkpoint is "
                                  "incomplete: load an earlier one")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{p}: {size} bytes, the manifest says {want['bytes']}: the file is truncated or "
                                  "corrupted; load an earlier checkpoint")
        if _sha256(p) != want["sha256"]:
            raise CheckpointError(f"{p}: its SHA-256 differs from the manifest's: the file is corrupted; load an "
                                  "earlier checkpoint")


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# ---- finding checkpoints ------------------------------------------------------------------------


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `save_dir` (`latest`, else the highest step with a manifest)."""
    d = Path(save_dir)
    if not d.is_dir():
        return None
    pointer = d / "latest"
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _STEP_DIR.match(name) and (d / name / MANIFEST).is_file():
            return d / name
    steps = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_DIR.match(p.name))
                   and (p / MANIFEST).is_file())
    return steps[-1][1] if steps else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or the newest one in a save directory; CheckpointError if none."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    found = latest_checkpoint(p)
    if found is None:
        what = "does not exist" if not p.exists() else "holds no complete checkpoint (no step_N/manifest.json)"
        raise CheckpointError(f"{p} {what}: pass a directory written by save_checkpoint or "
                              "launch_local(save_dir=...), or one of its step_N subdirectories")
    return found


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
    dcp.save(sd, storage_writer=FileSystemWriter(str(tmp), sync_files=True), planner=_SavePlanner())
    # Rank 0 learns what every rank saw (scalar optimizer state must agree, every holder's names).
    metas: list[Any] = [None] * world
    dist.all_gather_object(metas, meta)
    if rank == 0:
        manifest = _manifest(metas, step=step, world=world, plan_json=plan_json, extra=extra, tmp=tmp)
        _write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if final.exists():  # the same step saved again (a restart): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_text_atomic(root / "latest", final.name + "\n")
        if keep_last:
            _prune(root, keep_last)
    dist.barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
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
        sd[f"model/{name}"] = _Boxes(shapes[name], torch.float32,
                                     [(pc.full, _view(pc.holder, pc).float().clone()) for pc in pcs])
        for key in elementwise:
            boxes = []
            for pc in pcs:
                st = optimizer.state.get(pc.holder, {}).get(key)
                if st is None:
                    continue
                boxes.append((pc.full, _view(st, pc).clone()))
            if boxes:
                sd[f"optim/{key}/{name}"] = _Boxes(shapes[name], boxes[0][1].dtype, boxes)
    module = engine.module
    buffers = {n: b for n, b in module.named_buffers() if b is not None and b.device.type != "meta"}
    persistent = set(module.state_dict().keys())
    for n, b in buffers.items():
        if n in persistent:
            sd[f"buffer/{n}"] = b.detach().clone()
    rank = dist.get_rank()
    sd[f"rng/{rank}"] = torch.get_rng_state()
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


def _manifest(metas: Sequence[Mapping[str, Any]], *, step: int, world: int, plan_json: str | None,
              extra: Mapping[str, Any], tmp: Path) -> dict[str, Any]:
    params: dict[str, list[int]] = {}
    keys: dict[str, str] = {}
    scalars: dict[str, Any] = {}
    elementwise: set[str] = set()
    for r, m in enumerate(metas):
        for n, s in m["params"].items():
            if params.setdefault(n, s) != s:
                raise CheckpointError(f"rank {r} holds {n} as a {s} tensor, another rank as {params[n]}: the ranks "
                                      "run programs of different plans")
        keys.update(m["state_keys"])
        elementwise |= set(m["optimizer"]["elementwise"])
        for k, v in m["optimizer"]["scalars"].items():
            if scalars.setdefault(k, v)["value"] != v["value"]:
                raise CheckpointError(f"optimizer state {k!r} differs between ranks ({scalars[k]['value']} vs "
                                      f"{v['value']})")
    hashes = {m["program_hash"] for m in metas}
    plan = json.loads(plan_json) if plan_json else None
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST}
    return {"format": FORMAT, "version": VERSION, "step": step, "world_size": world,
            "graph_hash": (plan or {}).get("graph_hash", ""), "plan_hash": hashes.pop() if len(hashes) == 1 else "",
            "plan": plan, "params": params, "state_keys": keys,
            "optimizer": {"type": metas[0]["optimizer"]["type"], "elementwise": sorted(elementwise),
                          "scalars": scalars, "param_groups": metas[0]["optimizer"]["param_groups"]},
            "compression": any(m["compression"] for m in metas), "files": files, "extra": dict(extra),
            "saved_at": time.time()}


# ---- load -------------------------------------------------------------------------------------


@torch.no_grad()
def load_checkpoint(runner: Any, path: str | Path, *, plan_json: str | None = None) -> CheckpointInfo:
    """Load a checkpoint (a step directory, or the newest in a save directory) into a freshly built runner.

    Not collective: each rank reads the boxes its plan needs. Parameters and optimizer state are restored
    exactly whatever plan wrote them; RNG and compression state only under the same plan and world size.
    """
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
    # Optimizer state is created lazily by torch.optim: create it now so the boxes can be read into it.
    for h in holders:
        st = optimizer.state[h]
        for key in m["optimizer"]["elementwise"]:
            st[key] = torch.zeros_like(h, dtype=torch.float32 if h.is_floating_point() else h.dtype)
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
        sd[fqn] = _Boxes(shapes[name], torch.float32, boxes)

    for name in by_name:
        boxes_for(f"model/{name}", name, lambda pc: pc.holder)
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
    comp: dict[str, torch.Tensor] = {}
    replica: dict[str, torch.Tensor] = {}
    try:
        md = _SafeReader(str(d)).read_metadata()

        def this_ranks(prefix: str, into: dict[str, torch.Tensor]) -> None:
            for fqn, meta in md.state_dict_metadata.items():
                if fqn.startswith(prefix) and hasattr(meta, "size"):
                    into[fqn[len(prefix):]] = sd[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)

        if same_plan and m["compression"]:
            this_ranks(f"compression/{rank}/", comp)
        if same_plan and hasattr(runner, "load_replica_state"):
            this_ranks(f"replica/{rank}/", replica)
        missing = [k for k in sd if k not in md.state_dict_metadata]
        if missing:
            raise CheckpointError(f"{d}: holds no {missing[:3]}: it was not written for this model (or by an older "
                                  "version of it)")
        _quiet(dcp.load, sd, storage_reader=_SafeReader(str(d)), planner=_LoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:  # DCP wraps reader errors in CheckpointException
        raise CheckpointError(f"{d}: reading the checkpoint failed: {type(e).__name__}: {str(e)[:400]}") from e
    for buf, dst in targets:
        dst.copy_(buf.to(dst.dtype))
    if same_plan:
        torch.set_rng_state(rng)
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


# ---- offline ------------------------------------------------------------------------------------


def _read_full(d: Path, prefixes: Iterable[str]) -> dict[str, torch.Tensor]:
    md = _SafeReader(str(d)).read_metadata()
    sd: dict[str, Any] = {}
    for fqn, meta in md.state_dict_metadata.items():
        if any(fqn.startswith(p) for p in prefixes) and hasattr(meta, "size"):
            sd[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        _quiet(dcp.load, sd, storage_reader=_SafeReader(str(d)), planner=_LoadPlanner(), no_dist=True)
    except Exception as e:
        raise CheckpointError(f"{d}: reading the checkpoint failed: {type(e).__name__}: {str(e)[:400]}") from e
    return sd


def load_full_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, unsharded, under its checkpoint key: "model/NAME", "optim/KEY/NAME",
    "buffer/NAME", "rng/RANK", "compression/RANK/KEY". One process, no group (for tests and tools)."""
    m = verify_checkpoint(path)
    return _read_full(Path(m["path"]), ("model/", "optim/", "buffer/", "rng/", "compression/"))


def load_full_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The unsharded model state (parameters in fp32 and buffers) under the model's own state_dict keys:
    `model.load_state_dict(load_full_state_dict(d))` works on the plain model. One process, no group."""
    m = verify_checkpoint(path)
    d = Path(m["path"])
    sd = _read_full(d, ("model/", "buffer/"))
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
    full = _read_full(d, ("model/", "optim/", "buffer/"))
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
        sd[fqn] = _Boxes(t.shape, t.dtype, boxes)
    out = Path(dst)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty: reshard writes a new checkpoint; pass a new directory")
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _quiet(dcp.save, sd, storage_writer=FileSystemWriter(str(tmp), sync_files=True), planner=_SavePlanner(),
           no_dist=True)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = dict(m, world_size=int(plan.get("world_size", m["world_size"])), plan=plan,
                    graph_hash=plan.get("graph_hash", m["graph_hash"]), plan_hash="", compression=False, files=files,
                    extra=dict(m.get("extra", {}), resharded_from=str(d)), saved_at=time.time())
    _write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return out


def _quiet(fn, *args: Any, **kwargs: Any) -> Any:
    """DCP warns that it assumes one process whenever no_dist=True: here that is the intent (each rank reads alone)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


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

