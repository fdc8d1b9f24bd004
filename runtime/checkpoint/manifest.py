"""What makes a checkpoint directory trustworthy: its manifest, the files' hashes, atomic writes, and finding one.

A checkpoint is `DIR/step_N/` holding DCP's files and `manifest.json`, written last: format version, step,
data position, world size, the plan (JSON) and the graph hash, every parameter's name and full shape, the
optimizer's type, scalar state and hyperparameters, and the size and SHA-256 of every file. `DIR/latest`
names the newest. A directory without a valid manifest is never loaded; before DCP reads anything every
file's size and hash are checked against it (a corrupted or truncated shard is refused, naming the file).
A checkpoint of another model (other parameter names or shapes, or another graph hash) is refused with an
error naming what differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cost_models.errors import PartitionerError

__all__ = [
    "FORMAT", "MANIFEST", "STEP_DIR", "VERSION", "CheckpointError", "build_manifest", "check_checkpoint_model",
    "fsync_dir", "latest_checkpoint", "read_manifest", "resolve_checkpoint", "sha256_of", "verify_checkpoint",
    "write_text_atomic",
]

FORMAT, VERSION = "partitioner-checkpoint", 1
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(PartitionerError):
    """A checkpoint that cannot be written or loaded as asked: the message names the file or field and the fix."""


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


def sha256_of(path: Path) -> str:
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
        if sha256_of(p) != want["sha256"]:
            raise CheckpointError(f"{p}: its SHA-256 differs from the manifest's: the file is corrupted; load an "
                                  "earlier checkpoint")


def fsync_dir(d: Path) -> None:
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


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def build_manifest(metas: Sequence[Mapping[str, Any]], *, step: int, world: int, plan_json: str | None,
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
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
             for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST}
    return {"format": FORMAT, "version": VERSION, "step": step, "world_size": world,
            "graph_hash": (plan or {}).get("graph_hash", ""), "plan_hash": hashes.pop() if len(hashes) == 1 else "",
            "plan": plan, "params": params, "state_keys": keys,
            "optimizer": {"type": metas[0]["optimizer"]["type"], "elementwise": sorted(elementwise),
                          "scalars": scalars, "param_groups": metas[0]["optimizer"]["param_groups"]},
            "compression": any(m["compression"] for m in metas), "files": files, "extra": dict(extra),
            "saved_at": time.time()}


# ---- finding checkpoints ------------------------------------------------------------------------


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `save_dir` (`latest`, else the highest step with a manifest)."""
    d = Path(save_dir)
    if not d.is_dir():
        return None
    pointer = d / "latest"
    if pointer.is_file():
        name = pointer.read_text().strip()
        if STEP_DIR.match(name) and (d / name / MANIFEST).is_file():
            return d / name
    steps = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := STEP_DIR.match(p.name))
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
