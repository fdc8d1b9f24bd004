"""A trace kept on disk, so that re-planning (an elastic restart at a new world size) does not trace again.

    key = source_key("examples/gpt.py:gpt_small")
    g = load_trace(d, key)              # None: nothing cached for this model source here
    if g is None:
        g = trace(model, inputs)
        save_trace(g, d, key)
    plan = compile(g, topology, ...)

What is kept: the OpGraph as JSON (it is pure data: nodes, costs as polynomials, parameters, blocks) and
the ExportedProgram code generation reads, in torch.export's own archive (`graph.pt2`). A trace made with
torch.fx (export failed) has no such archive: it is not cached, since an OpGraph without its graph could
not generate pipeline or tensor-parallel code and the plans would differ.

The key is a hash of the model spec, the bytes of the file the factory lives in and torch's version: an
edited model traces again. A damaged or foreign entry is a miss (traced again), never an error.

Trust: torch.export.load may unpickle the archive's tensor entries. A trace directory sits beside the
rank programs in SAVE_DIR/plans, which the ranks execute: whoever can write there can already run code,
so it is trusted as code, and is not a checkpoint (those are read without unpickling: runtime.checkpoint.dcp_io).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from partitioner.tracer.opgraph import Block, OpCost, OpGraph, OpNode, ParamSpec, TensorSpec
from partitioner.tracer.symbolic import Poly

__all__ = ["load_trace", "save_trace", "source_key"]

_FORMAT = 15  # 2: OpCost.fixed_activation_bytes; 3: OpCost.causal; 4: one shared attention mask;
# 5: no mask kept where a shape-only mask is the causal one; 6: cost rules for square, repeat_interleave, tile;
# 7: no attention rewrite under a mask read from the inputs; block kinds tell masks made from the inputs apart;
# 8: ParamSpec.trainable, causal masks made from buffers, reshape_as a view; 9: ALiBi folded into q and k, long
# causal masks judged at a shorter length; 10: GELU and SiLU spelled as elementwise ops fused
# (tracer.pointwise); 11: OpGraph.custom_functions; 12: the model's own upcasts marked, reads of a no-op cast
# rewired, values kept fp32 on purpose charged as fixed (tracer.upcasts); 13: RMSNorms fused (tracer.norms), fused
# nodes named so; 14: string arguments among a node's scalars (einsum's equation, costed as products);
# 15: OpGraph.seq_lengths
_GRAPH, _ARCHIVE = "opgraph.json", "graph.pt2"


def source_key(spec: str) -> str:
    """sha256 of the spec, the source file it names and torch's version."""
    target = spec.rsplit(":", 1)[0]
    h = hashlib.sha256(f"{_FORMAT}\0{torch.__version__}\0{spec}\0".encode())
    if target.endswith(".py"):
        path = Path(target)
    else:
        try:
            found = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            found = None
        path = Path(found.origin) if found is not None and found.origin else None
    if path is not None and path.is_file():
        h.update(path.read_bytes())
    return h.hexdigest()


def save_trace(g: OpGraph, directory: str | os.PathLike, key: str) -> bool:
    """Write `g` under `directory` (whole: a reader sees it complete or not at all); False if it cannot be kept."""
    if not isinstance(g.graph_module, torch.export.ExportedProgram):
        return False
    d = Path(directory)
    tmp = d.with_name(f".tmp-{d.name}-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    torch.export.save(g.graph_module, tmp / _ARCHIVE)
    (tmp / _GRAPH).write_text(json.dumps({"format": _FORMAT, "key": key, "graph": _graph_to_json(g)}))
    if d.exists():  # another key's trace: this one replaces it
        old = d.with_name(f".old-{d.name}-{os.getpid()}")
        os.replace(d, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, d)
    return True


def load_trace(directory: str | os.PathLike, key: str) -> OpGraph | None:
    """The OpGraph saved under `directory` for `key`, its ExportedProgram attached; None on a miss."""
    d = Path(directory)
    try:
        data = json.loads((d / _GRAPH).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("key") != key:
        return None
    try:
        g = _graph_from_json(data["graph"])
        ep = torch.export.load(d / _ARCHIVE)
    except Exception as exc:  # noqa: BLE001 -- a damaged entry: trace again rather than fail the restart
        warnings.warn(f"trace cache {d}: unreadable ({type(exc).__name__}: {exc}); tracing again", stacklevel=2)
        return None
    return g.__class__(**{**_fields(g), "graph_module": ep})


def _fields(obj: Any) -> dict[str, Any]:
    return {f: getattr(obj, f) for f in obj.__dataclass_fields__}


# ---- OpGraph <-> JSON ---------------------------------------------------------------------------------------

def _spec_to_json(t: TensorSpec | None) -> dict | None:
    return None if t is None else {"shape": [d.to_json() for d in t.shape], "dtype": t.dtype, "itemsize": t.itemsize}


def _spec_from_json(d: dict | None) -> TensorSpec | None:
    if d is None:
        return None
    return TensorSpec(shape=tuple(Poly.from_json(x) for x in d["shape"]), dtype=d["dtype"], itemsize=d["itemsize"])


_COST_POLYS = ("forward_flops", "backward_flops", "bytes_read", "bytes_written", "activation_bytes",
               "fixed_activation_bytes")


def _node_to_json(n: OpNode) -> dict:
    d = _fields(n)
    d["output"] = _spec_to_json(n.output)
    d["cost"] = {**{k: getattr(n.cost, k).to_json() for k in _COST_POLYS}, "op_class": n.cost.op_class,
                 "causal": n.cost.causal}
    return d


def _node_from_json(d: dict) -> OpNode:
    cost = d["cost"]
    return OpNode(**{**d, "inputs": tuple(d["inputs"]), "params": tuple(d["params"]),
                     "output": _spec_from_json(d["output"]),
                     "cost": OpCost(**{k: Poly.from_json(cost[k]) for k in _COST_POLYS}, op_class=cost["op_class"],
                                    causal=cost.get("causal", False))})


def _graph_to_json(g: OpGraph) -> dict:
    d = {k: v for k, v in _fields(g).items() if k != "graph_module"}
    d["nodes"] = [_node_to_json(n) for n in g.nodes]
    d["params"] = [_fields(p) for p in g.params]
    d["blocks"] = [_fields(b) for b in g.blocks]
    d["inputs"] = [_spec_to_json(t) for t in g.inputs]
    return d


def _graph_from_json(d: dict) -> OpGraph:
    params = tuple(ParamSpec(**{**p, "shape": tuple(p["shape"]), "aliases": tuple(p["aliases"])}) for p in d["params"])
    lengths = d.get("seq_lengths")
    return OpGraph(**{**d, "custom_functions": tuple(d.get("custom_functions", ())),
                      "seq_lengths": tuple(lengths) if lengths is not None else None,
                      "nodes": tuple(_node_from_json(n) for n in d["nodes"]), "params": params,
                      "blocks": tuple(Block(**b) for b in d["blocks"]),
                      "inputs": tuple(_spec_from_json(t) for t in d["inputs"])})
