"""Does a MoE layer's traced experts region compute what `ep_experts` will compute in its place?

The expert-parallel rewrite (`partitioner.codegen.segment_ep`) drops the ops of an experts module and calls
the runtime's batched experts instead:

    out[t] = sum_j w[t, j] * down_e(gated(gate_up_e x[t])),   e = idx[t, j]

with `runtime.experts.grouped_experts.gated` the gated unit of the two parts of `gate_up_proj[e]`'s 2I rows: by
default SiLU(gate) * up, gate and up the first and second halves; or a form the rewrite read off the region
(clamped, GPT-OSS's gate * sigmoid(alpha gate) * (up + 1), interleaved halves, biases). Names and shapes alone
cannot tell that a model's experts compute this: the halves may come in the other order or interleaved, a
scale or a bias may sit inside, the router's weights may be renormalised there. Any of those would train
silently wrong under ep > 1. So the region itself is run, op for op as traced, on random tokens, a random
routing (distinct top-k choices, some experts idle) and random weights, and compared with that formula (the
runtime's own `gated`, in float64); the rewrite is taken only where they agree to the dtype's rounding. A
clamped unit is checked on tokens scaled by its limit, so that the clamps act.

Sizes: every size the trace left symbolic (the tokens) is set small, so a 671B model's layer checks in a
moment. Expert weights beyond `_DISTINCT_ELEMENTS` are one expert's random weights repeated over the E
experts (an expanded view, one expert's memory): the formula is still checked, the experts' identities not.
A region's check is kept by its structure (ops, wiring, shapes), so the layers of a model check once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

__all__ = ["region_mismatch"]

_DISTINCT_ELEMENTS = 1 << 24   # expert weights up to this many elements are drawn expert by expert
_SMALL_SIZE = 3                # what every symbolic size (batch, sequence) is set to
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}
_checked: dict[tuple, str | None] = {}


def region_mismatch(nodes: list[fx.Node], exit_node: fx.Node, x: fx.Node, idx: fx.Node, w: fx.Node,
                    gate_up: fx.Node, down: fx.Node, *, transposed: bool,
                    biases: tuple[fx.Node | None, ...] = (None, None), **form: Any) -> str | None:
    """None where the region `nodes` (in graph order, output `exit_node`) computes the batched experts of its
    tokens `x`, routing `idx`, `w` and weights `gate_up` (E, 2I, H) and `down` (E, H, I) (each stored as its
    transpose where `transposed`), `biases` (E, 2I) and (E, H) (or None), gated as `form` (the keywords of
    `runtime.experts.grouped_experts.gated`: limit, glu, alpha, interleaved) says; else what differs, in words."""
    key = (_signature(nodes, exit_node, (x, idx, w, gate_up, down, *biases)), transposed, tuple(sorted(form.items())))
    if key not in _checked:
        if len(_checked) > 256:
            _checked.clear()
        _checked[key] = _check(nodes, exit_node, x, idx, w, gate_up, down, biases, transposed, form)
    return _checked[key]


def _signature(nodes: list[fx.Node], exit_node: fx.Node, inputs: tuple[fx.Node, ...]) -> tuple:
    """The region up to renaming: each op's target, its arguments as positions in the region (or which input,
    or an outer size), the shapes it was traced with."""
    pos = {n: i for i, n in enumerate(nodes)}
    role = {a: f"in{i}" for i, a in enumerate(inputs) if a is not None}

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return pos.get(a, role.get(a, f"outer:{a.meta.get('val')}"))
        if isinstance(a, (list, tuple)):
            return tuple(arg(b) for b in a)
        return repr(a)

    return (tuple((str(n.target), arg(n.args), arg(tuple(sorted(n.kwargs.items()))), str(n.meta.get("val")))
                  for n in nodes), pos[exit_node],
            tuple(str(a.meta.get("val")) if a is not None else "-" for a in inputs))


def _check(nodes, exit_node, x, idx, w, gate_up, down, biases, transposed, form) -> str | None:
    sizes = _small_sizes(nodes, x)
    gen = torch.Generator().manual_seed(0)
    # at a clamp's scale, so that about a third of the gate and up values lie beyond it
    xv = _random(x.meta["val"], sizes, gen) * (form.get("limit") or 1.0)
    t, k = (_concrete(d, sizes) for d in idx.meta["val"].shape)
    gu_val, down_val = gate_up.meta["val"], down.meta["val"]
    num_experts = int(gu_val.shape[0])
    # distinct choices per token; expert E-1 left idle where there are enough experts (an empty group)
    pool = max(num_experts - 1, k)
    idxv = torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(t)]).to(idx.meta["val"].dtype)
    wv = torch.rand(t, k, generator=gen).to(w.meta["val"].dtype) + 0.1
    guv, downv = _weights(gu_val, gen), _weights(down_val, gen)
    bv = tuple(None if b is None else _weights(b.meta["val"], gen) for b in biases)
    device = _device(x.meta["val"])
    xv, idxv, wv, guv, downv = (v.to(device) for v in (xv, idxv, wv, guv, downv))
    bv = tuple(None if v is None else v.to(device) for v in bv)
    given = {x: xv, idx: idxv, w: wv, gate_up: guv, down: downv, **{b: v for b, v in zip(biases, bv) if b is not None}}
    try:
        got = _run(nodes, exit_node, given, sizes, device)
    except Exception as e:  # noqa: BLE001 - any failure to run means the rewrite is not known to be exact
        return f"running it on {t} random tokens failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    if transposed:
        guv, downv = guv.transpose(-2, -1), downv.transpose(-2, -1)
    got, xv, idxv, wv, guv, downv = (v.cpu() if isinstance(v, torch.Tensor) else v
                                     for v in (got, xv, idxv, wv, guv, downv))
    want = _reference(xv, idxv, wv, guv, downv, tuple(None if v is None else v.cpu() for v in bv), form)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return f"it hands on {getattr(got, 'shape', type(got).__name__)} where (T, H) = {tuple(want.shape)}"
    diff = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    tol = _TOLERANCE.get(want.dtype, 1e-4)
    if not diff <= tol * max(scale, 1e-6):
        return (f"on {t} random tokens it differs from down(gated(gate_up x)) weighted by the router by up to "
                f"{diff:.3g} (outputs up to {scale:.3g})")
    return None


def _device(val: torch.Tensor) -> torch.device:
    """Where the region runs: the device it was traced for (a CUDA-only kernel, torch._grouped_mm, may be among
    its ops), else the CPU (traced on the meta device, or for a device this process does not have)."""
    d = val.device
    if d.type == "cuda" and torch.cuda.is_available():
        return d
    return torch.device("cpu")


def _reference(x, idx, w, gate_up, down, biases, form) -> torch.Tensor:
    """The runtime's experts (`gated`, the same function ep_experts runs), token by token, in float64."""
    from runtime.experts.grouped_experts import gated

    def bias(b, e):
        return None if b is None else b[e].double()

    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = F.linear(x[t].double(), gate_up[e].double(), bias(biases[0], e))
            out[t] += float(w[t, j]) * F.linear(gated(h, **form), down[e].double(), bias(biases[1], e))
    return out.to(x.dtype)


def _weights(val: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    shape = [int(d) for d in val.shape]
    if val.numel() <= _DISTINCT_ELEMENTS:
        return torch.randn(shape, generator=gen).to(val.dtype) / shape[-1] ** 0.5
    one = torch.randn([1, *shape[1:]], generator=gen).to(val.dtype) / shape[-1] ** 0.5
    return one.expand(shape)


def _random(val: torch.Tensor, sizes: dict, gen: torch.Generator) -> torch.Tensor:
    return torch.randn([_concrete(d, sizes) for d in val.shape], generator=gen).to(val.dtype)


def _small_sizes(nodes: list[fx.Node], x: fx.Node) -> dict:
    """Every free symbol of the region's shapes (and the tokens') set to a small size."""
    symbols = set()
    for n in [x, *nodes]:
        val = n.meta.get("val")
        for v in (val if isinstance(val, (list, tuple)) else [val]):
            dims = list(v.shape) if isinstance(v, torch.Tensor) else [v]
            for d in dims:
                if isinstance(d, torch.SymInt):
                    symbols |= d.node.expr.free_symbols
    return {s: _SMALL_SIZE for s in symbols}


def _concrete(d: Any, sizes: dict) -> Any:
    if isinstance(d, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        value = d.node.expr.subs(sizes)
        return int(value) if isinstance(d, torch.SymInt) else (float(value) if isinstance(d, torch.SymFloat)
                                                               else bool(value))
    return d


def _ints_as_float(args: Any) -> Any:
    if isinstance(args, torch.Tensor) and not args.is_floating_point() and args.dtype != torch.bool:
        return args.double()
    if isinstance(args, (list, tuple)):
        return type(args)(_ints_as_float(a) for a in args)
    return args


def _run(nodes: list[fx.Node], exit_node: fx.Node, given: dict, sizes: dict, device: torch.device) -> Any:
    """The region's ops as traced, on `given` values; a size read from outside it is the small size; a value
    computed outside it from sizes alone is computed here too; a tensor made on a device (the meta device of a
    model planned there) is made on `device`."""
    env = dict(given)

    def value(a: fx.Node) -> Any:
        if a in env:
            return env[a]
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor) and a.op != "placeholder":
            env[a] = _concrete(val, sizes)
        elif a.op == "call_function":
            env[a] = _call(a)
        else:
            raise LookupError(f"{a.name} is read from outside the region")
        return env[a]

    def _call(n: fx.Node) -> Any:
        args = fx.node.map_arg(n.args, value)
        kwargs = fx.node.map_arg(n.kwargs, value)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": device}
        try:
            return n.target(*args, **kwargs)
        except NotImplementedError:
            # an integer kernel this device lacks, where the trace was for another (histc of int counts, which
            # Hugging Face takes off the CPU): the same values through float64, in the traced dtype
            out = n.target(*_ints_as_float(args), **kwargs)
            val = n.meta.get("val")
            return out.to(val.dtype) if isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor) else out

    for n in nodes:
        env[n] = _call(n)
    return env[exit_node]
