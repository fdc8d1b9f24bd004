"""Which casts of an fp32 trace are the model's own upcasts to fp32, and which follow the parameters' dtype.

A model traced with fp32 parameters writes two different things as the same op. Hugging Face's RMSNorm

    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)          # upcast: the norm's statistics in fp32
    ...
    return self.weight * hidden_states.to(input_dtype)       # back to the compute dtype

traces both casts as `aten.to.dtype(x, torch.float32)`. Code generated for a 16-bit plan must keep the first (the
model asks for fp32 there: a variance of 4e-4 under rsqrt's backward overflows fp16) and make the second read the
parameters' dtype at run time. Nothing in the fp32 graph tells them apart; the dtype the code names does, once the
parameters have another dtype. So the forward is exported once more with every fp32 parameter, buffer and float
input as fp64 (parameters as uninitialised storage: export runs on fake tensors). A cast that still names fp32
there is the model's own (`is_upcast`); a value that is fp32 there is fp32 under any recipe (`stays_fp32`: the
cost model charges it 4 bytes an element). fp64 as the probe, not a 16-bit dtype: model code branches on fp16
and bf16 (clamps, finfo tables), almost never on fp64, so the two graphs are the same ops in the same order,
which is checked node by node before anything is marked.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

__all__ = ["CASTS", "cast_dtype", "mark_upcasts", "is_upcast", "stays_fp32", "casts_known"]

# Node marks, in meta["custom"], which torch.export's serializer keeps: a cached trace (tracer.cache) carries them
_UPCAST = "partitioner_upcast"  # the model casts to fp32 here on purpose
_FP32 = "partitioner_fp32"  # the output is fp32 whatever the parameters' dtype (an upcast, or made from one)
_UNKNOWN = "partitioner_casts_unknown"  # on the output node: the probe failed, upcasts and casts back look alike

_aten = torch.ops.aten
CASTS = frozenset({_aten.to.dtype, _aten._to_copy.default, _aten.to.dtype_layout, _aten.to.device})
_TRACED, _PROBE = torch.float32, torch.float64


def cast_dtype(n: fx.Node) -> torch.dtype | None:
    """The dtype a cast node converts to (None: not a cast, or one that keeps the dtype: `.to(device)`)."""
    if n.op != "call_function" or n.target not in CASTS:
        return None
    if "dtype" in n.kwargs:
        return n.kwargs["dtype"]
    if n.target is _aten.to.dtype and len(n.args) > 1:
        return n.args[1]
    if n.target is _aten.to.device and len(n.args) > 2:
        return n.args[2]
    return None


def _ambiguous(graph: fx.Graph) -> list[fx.Node]:
    """The casts to fp32 of a floating tensor: the model's upcast, or a cast to the (fp32) parameters' dtype."""
    out = []
    for n in graph.nodes:
        src = n.args[0].meta.get("val") if n.args and isinstance(n.args[0], fx.Node) else None
        if cast_dtype(n) == _TRACED and isinstance(src, torch.Tensor) and src.is_floating_point():
            out.append(n)
    return out


@contextlib.contextmanager
def _as_probe_dtype(model: nn.Module) -> Iterator[None]:
    """Every fp32 parameter of `model` swapped for uninitialised fp64 storage of its shape on its device (export
    reads no parameter's values), every fp32 buffer for its values in fp64 (tied tensors stay one tensor), and
    put back on exit: the user's module ends as it began."""
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    new: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for k, t in table.items():
                if isinstance(t, torch.Tensor) and t.dtype == _TRACED:
                    swapped.append((table, k, t))
    try:
        for table, k, t in swapped:
            if id(t) not in new and isinstance(t, nn.Parameter):
                new[id(t)] = nn.Parameter(torch.empty(t.shape, dtype=_PROBE, device=t.device), t.requires_grad)
            elif id(t) not in new:  # a buffer's values may steer the forward (a table, a mask): kept
                new[id(t)] = t.to(_PROBE)
            table[k] = new[id(t)]
        yield
    finally:
        for table, k, t in swapped:
            table[k] = t


def _probe_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example with its fp32 tensors as fp64 (floats a model takes, such as embeddings or pixels, are
    activations in the compute dtype)."""
    def cast(x: Any) -> Any:
        return x.to(_PROBE) if isinstance(x, torch.Tensor) and x.dtype == _TRACED else x
    return pytree.tree_map(cast, (tuple(args), dict(kwargs)))


def _ops(graph: fx.Graph) -> list[tuple[str, Any]]:
    return [(n.name, n.target) for n in graph.nodes if n.op == "call_function"]


def _alias_of(n: fx.Node, name: str) -> bool:
    """Whether `n` is `name` seen through casts to fp32 that were no-ops at trace time (an fp32 `x.to(float32)`
    returns x itself, so the code after it reads the cast where the probe's reads x)."""
    while cast_dtype(n) == _TRACED and isinstance(n.args[0], fx.Node):
        n = n.args[0]
        if n.name == name:
            return True
    return False


def _rewire(ep: Any, probe: Any) -> bool:
    """Give every node of `ep` the inputs its twin in `probe` has: a read of a no-op cast where the probe reads the
    cast's source reads the source. False, with `ep` untouched, where the graphs differ in any other way."""
    mine = {n.name: n for n in ep.graph.nodes}
    edits = []
    for twin in probe.graph.nodes:
        if twin.op not in ("call_function", "output"):
            continue
        n = mine.get(twin.name)
        if n is None:
            return False
        leaves, spec = pytree.tree_flatten((n.args, n.kwargs))
        theirs, their_spec = pytree.tree_flatten((twin.args, twin.kwargs))
        if spec != their_spec:
            return False
        new = []
        for a, b in zip(leaves, theirs):
            if isinstance(a, fx.Node) != isinstance(b, fx.Node):
                return False
            if isinstance(a, fx.Node) and a.name != b.name:
                if not _alias_of(a, b.name):
                    return False
                a = mine[b.name]
            new.append(a)
        if any(x is not y for x, y in zip(new, leaves)):
            edits.append((n, pytree.tree_unflatten(new, spec)))
    for n, (args, kwargs) in edits:
        n.args, n.kwargs = args, kwargs
    if edits:
        ep.graph_module.recompile()
    return True


def mark_upcasts(ep: Any, model: nn.Module, args: tuple, kwargs: dict,
                 export: Callable[[nn.Module, tuple, dict], Any]) -> int:
    """Mark the model's own upcasts among the fp32 casts of `ep` (exported from `model(*args, **kwargs)` with fp32
    parameters; `export` exports again as `ep` was), and make the code after a cast that was a no-op read what
    the model reads (`_rewire`). Returns how many were marked. Where the probe cannot be exported, or exports a
    different graph, nothing changes and a warning says what 16-bit plans then run."""
    casts = set(_ambiguous(ep.graph))
    params = [p.dtype for p in model.parameters()]
    if not casts or not params or max(set(params), key=params.count) != _TRACED:
        return 0
    try:
        with _as_probe_dtype(model):
            probe = export(model, *_probe_inputs(args, kwargs))
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - only the marks are lost; the fp32 graph stands
        return _unmarked(ep, type(model).__name__, f"exporting it with fp64 parameters failed ({type(exc).__name__})")
    if _ops(probe.graph) != _ops(ep.graph) or not _rewire(ep, probe):
        return _unmarked(ep, type(model).__name__, "its code traces a different graph when the parameters are fp64")
    by_name = {n.name: n for n in probe.graph.nodes}
    marked = 0
    for n in ep.graph.nodes:
        val = by_name[n.name].meta.get("val") if n.op == "call_function" else None
        if isinstance(val, torch.Tensor) and val.dtype == _TRACED:
            n.meta.setdefault("custom", {})[_FP32] = True
        if n in casts and cast_dtype(by_name[n.name]) == _TRACED:
            n.meta["custom"][_UPCAST] = True
            marked += 1
    return marked


def is_upcast(n: fx.Node) -> bool:
    """Whether `n` is a cast the model makes to fp32 on purpose (`mark_upcasts`), kept fp32 under 16-bit recipes."""
    return bool(n.meta.get("custom", {}).get(_UPCAST))


def stays_fp32(n: fx.Node) -> bool:
    """Whether `n`'s output is fp32 at any parameter dtype (`mark_upcasts`): its size does not follow the
    recipe's compute dtype."""
    return bool(n.meta.get("custom", {}).get(_FP32))


def casts_known(graph: fx.Graph) -> bool:
    """Whether every cast of `graph` converts as the model's code does (`mark_upcasts` told them apart, or none was
    ambiguous): generated code then runs without autocast, in the dtypes the model's own forward computes in."""
    return not any(n.op == "output" and n.meta.get("custom", {}).get(_UNKNOWN) for n in graph.nodes)


def _unmarked(ep: Any, model: str, why: str) -> int:
    """Say that the casts could not be told apart, and mark the graph so (`casts_known`)."""
    out = next(n for n in ep.graph.nodes if n.op == "output")
    out.meta.setdefault("custom", {})[_UNKNOWN] = True
    warnings.warn(
        f"trace: could not tell {model}'s own casts to fp32 (such as a norm's upcast) from casts to its parameters' "
        f"dtype: {why}. Under bf16-mixed and fp16-mixed, stage code runs both in the compute dtype, under autocast; "
        "compile with precision='fp32', or pin pp=1 and tp=1 (data-parallel plans run the model's own code)",
        stacklevel=4)
    return 0
