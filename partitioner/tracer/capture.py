"""Capture a model as a flat list of operations with symbolic shapes.

Two mechanisms, one result (`Capture`): torch.export (non-strict), which
handles most real model code, and torch.fx symbolic tracing followed by
fake-tensor shape propagation, which needs no ATen lowering and keeps
modules as leaves. In both, the batch dimension (dim 0 of every tensor
input) and the sequence dimension (dim 1 of integer token inputs) are
symbolic, so shapes come out as sympy expressions in `symbolic.B`/`S`.
Nothing here leaves a change on the user's module (untouched.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import traceback
from typing import Any, Literal, Sequence

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from cost_models.errors import TraceError
from partitioner.tracer.attention import causal_attention, causal_shape_mask
from partitioner.tracer.attention import rewrite_attention as rewrite_attention_in
from partitioner.tracer.autograd_functions import Applied, differs_from_its_forward, recording
from partitioner.tracer.norms import fuse_norms
from partitioner.tracer.pointwise import fuse_activations
from partitioner.tracer.symbolic import B, S
from partitioner.tracer.untouched import untouched
from partitioner.tracer.upcasts import mark_upcasts, stays_fp32
from partitioner.tracer.writes import nested_written
from partitioner.tracer.writes import written as block_written

__all__ = ["RawSpec", "RawArg", "RawNode", "Capture", "capture"]

Method = Literal["export", "fx"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RawSpec:
    shape: tuple[sympy.Expr, ...]
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype, device="meta").element_size()

    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RawArg:
    """A tensor argument: produced by a node, a graph input, a parameter or a buffer."""

    kind: Literal["node", "input", "param", "buffer", "const"]
    ref: str
    spec: RawSpec | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RawNode:
    name: str
    op: str  # canonical op name, see op_rules
    target: str
    args: tuple[RawArg, ...]
    outputs: tuple[RawSpec, ...]
    module_path: str
    module_type: str
    scalars: tuple[Any, ...] = ()  # non-tensor positional args, for rules that need them (dropout p)
    causal: bool = False  # attention that attends causally (attention.causal_attention): half the products
    # attention whose mask, computed from shapes alone, is the causal one at the traced sizes
    # (attention.causal_shape_mask): generated code attends with is_causal and keeps no mask
    causal_mask: bool = False
    # the output is fp32 whatever the parameters' dtype (the model's upcast or what it computes from one:
    # tracer.upcasts.stays_fp32), so it is kept at 4 bytes an element under 16-bit recipes too
    fp32: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capture:
    nodes: tuple[RawNode, ...]
    inputs: tuple[tuple[str, RawSpec], ...]
    method: Method
    batch_symbolic: bool
    graph_module: Any
    # the sequence lengths the captured graph holds for (torch.export's range of its sequence symbol); None: not
    # known (fx), or no symbol
    seq_range: tuple[int, float] | None = None
    # torch.autograd.Function classes the forward applied (outside torch's own) whose backward is not autograd of
    # their forward's ops, which the graph holds (tracer.autograd_functions), "module.Name (file:line)"
    custom_functions: tuple[str, ...] = ()


# ---------------------------------------------------------------- helpers


def unwritten_buffers(ep: Any) -> dict[fx.Node, str]:
    """The placeholders of `ep`'s buffers (and lifted constant tensors) that its graph never writes, with their
    names in the state dict (or constants)."""
    kinds = torch.export.graph_signature.InputKind
    written = written_buffers(ep)
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    return {by_name[s.arg.name]: s.target for s in ep.graph_signature.input_specs
            if s.kind in (kinds.BUFFER, kinds.CONSTANT_TENSOR) and s.target not in written
            and (s.target in ep.state_dict or s.target in ep.constants)}


def written_buffers(ep: Any) -> dict[str, fx.Node]:
    """The buffers `ep`'s forward writes (its signature's mutations, and in-place writes at the top level or inside
    a no_grad region), by state-dict name, with the node that writes each (None where the signature says so)."""
    kinds = torch.export.graph_signature.InputKind
    names = {s.arg.name: s.target for s in ep.graph_signature.input_specs
             if s.kind == kinds.BUFFER and hasattr(s.arg, "name")}
    out: dict[str, Any] = {t: None for t in ep.graph_signature.buffers_to_mutate.values()}
    for n in ep.graph.nodes:
        if n.op == "call_function":
            for a in (*block_written(n), *nested_written(n, ep.graph_module)):
                if a.op == "placeholder" and a.name in names:
                    out.setdefault(names[a.name], n)
    return out


def _canonical(name: str) -> str:
    return name.strip("_").removesuffix("_")


def _module_path_and_type(node: fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, typ = list(stack.values())[-1]
    typ_name = typ if isinstance(typ, str) else getattr(typ, "__qualname__", str(typ))
    return path, typ_name.rsplit(".", 1)[-1]


def _to_expr(size: Any, symbols: dict[sympy.Symbol, sympy.Expr], hints: dict[sympy.Symbol, int]) -> sympy.Expr:
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        expr = expr.xreplace(symbols)
        extra = {f: hints[f] for f in expr.free_symbols if f not in (B, S) and f in hints}
        return expr.xreplace(extra) if extra else expr
    return sympy.Integer(int(size))


def _specs(val: Any, symbols, hints) -> tuple[RawSpec, ...]:
    if isinstance(val, torch.Tensor):
        return (RawSpec(shape=tuple(_to_expr(d, symbols, hints) for d in val.shape), dtype=val.dtype),)
    if isinstance(val, (tuple, list)):
        out: list[RawSpec] = []
        for v in val:
            out.extend(_specs(v, symbols, hints) if isinstance(v, torch.Tensor) else ())
        return tuple(out)
    return ()


def _dims_for(x: Any, dynamic_seq: bool) -> dict[int, str]:
    """Which dims of an example input are symbolic: 0 is batch, 1 is sequence for token ids."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return {}
    dims = {0: "b"}
    if dynamic_seq and x.dim() >= 2 and not x.dtype.is_floating_point and x.dtype != torch.bool:
        dims[1] = "s"
    return dims


def _user_frame(exc: BaseException) -> str:
    """The innermost frame of the user's code in a traceback, as 'file:line in func: code'."""
    frames = traceback.extract_tb(exc.__traceback__)
    skip = ("/torch/", "/partitioner/", "/sympy/", "<frozen", "/contextlib.py", "/functools.py")
    user = [f for f in frames if not any(s in f.filename for s in skip)]
    if not user:
        return ""
    f = user[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def _module_in_traceback(exc: BaseException, model: torch.nn.Module) -> str:
    names = {id(m): (n or type(model).__name__) for n, m in model.named_modules()}
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, torch.nn.Module) and id(obj) in names:
            found = f"{names[id(obj)]} ({type(obj).__name__})"
        tb = tb.tb_next
    return found


def trace_error(model: torch.nn.Module, method: str, exc: BaseException, *, other: str | None = None) -> TraceError:
    where = _user_frame(exc)
    mod = _module_in_traceback(exc, model)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    lines = [f"could not trace {type(model).__name__} with {method}: {type(exc).__name__}: {first}"]
    if mod:
        lines.append(f"  in module {mod}")
    if where:
        lines.append(f"  at {where}")
    if other:
        lines.append(f"  (the fallback also failed: {other})")
    lines.append(
        "  try: pass example_kwargs for optional forward arguments (e.g. targets=...), "
        "force the other mechanism with method='export' or method='fx', "
        "or keep the failing module whole with leaf_modules=(ItsClass,)"
    )
    return TraceError("\n".join(lines))


# ---------------------------------------------------------------- export


def _capture_export(model, args, kwargs, dynamic_seq: bool, rewrite: bool = False) -> Capture:
    from torch.export import Dim

    def spec_of(x):
        dims = _dims_for(x, dynamic_seq)
        return {d: Dim.AUTO for d in dims} if dims else None

    dyn_args = tuple(spec_of(a) for a in args)
    dyn_kwargs = {k: spec_of(v) for k, v in kwargs.items()}
    dynamic_shapes = {**{p: d for p, d in zip(_positional_names(model, len(args)), dyn_args)}, **dyn_kwargs}
    applied: dict[type, Applied] = {}
    with recording(applied):
        ep = torch.export.export(model, tuple(args), dict(kwargs), strict=False, dynamic_shapes=dynamic_shapes)
    functions = [a.name for a in applied.values() if differs_from_its_forward(a)]
    # before the rewrites, which leave casts alone but add nodes the probe's graph would not have
    mark_upcasts(ep, model, tuple(args), dict(kwargs),
                 lambda m, a, k: torch.export.export(m, a, k, strict=False, dynamic_shapes=dynamic_shapes))
    # before anything reads the graph, so costs and generated code see the same fused attention and activations
    if rewrite:
        user = frozenset(s.arg.name for s in ep.graph_signature.input_specs
                         if s.kind == torch.export.graph_signature.InputKind.USER_INPUT and hasattr(s.arg, "name"))
        rewrite_attention_in(ep.graph_module, user)  # OpGraph.attention_rewrites counts what it did
        fuse_activations(ep.graph_module)
        fuse_norms(ep.graph_module)
    sig = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    kinds = torch.export.graph_signature.InputKind

    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    # a non-tensor argument (use_cache=False) is a constant the graph was specialised on: no input of it
    user_inputs = [n for n in placeholders if sig[n.name].kind == kinds.USER_INPUT
                   and isinstance(n.meta.get("val"), torch.Tensor)]
    flat_examples = [x for x in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(x, torch.Tensor)]
    symbols, batch_symbolic = _symbol_map(
        [(n.meta.get("val"), _dims_for(ex, dynamic_seq)) for n, ex in zip(user_inputs, flat_examples)]
    )
    hints = _hints(ep.graph)
    examples = dict(zip(user_inputs, flat_examples))
    verdicts: dict[Any, bool] = {}  # per mask node: one mask is often every layer's (Hugging Face builds it once)
    # buffers the graph never writes, with their traced values: a mask made from one (a registered tril buffer) is
    # evaluated from them (attention.causal_shape_mask; meta values leave it charged as kept)
    buffers = unwritten_buffers(ep)
    for n, target in buffers.items():
        examples[n] = ep.state_dict[target] if target in ep.state_dict else ep.constants[target]

    refs: dict[str, RawArg] = {}
    inputs: list[tuple[str, RawSpec]] = []
    for n in placeholders:
        spec = sig[n.name]
        val = _specs(n.meta.get("val"), symbols, hints)
        kind = {kinds.PARAMETER: "param", kinds.BUFFER: "buffer", kinds.USER_INPUT: "input"}.get(spec.kind, "const")
        ref = spec.target if kind in ("param", "buffer", "const") and spec.target else n.name
        refs[n.name] = RawArg(kind=kind, ref=ref, spec=val[0] if val else None)
        if kind == "input" and val:
            inputs.append((n.name, val[0]))

    nodes: list[RawNode] = []
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        outs = _specs(n.meta.get("val"), symbols, hints)
        tgt = n.target
        if tgt is operator.getitem:
            op = "getitem"
        elif isinstance(tgt, torch._ops.OpOverload):
            op = _canonical(tgt.overloadpacket.__name__)
        else:
            op = _canonical(getattr(tgt, "__name__", str(tgt)))
        path, typ = _module_path_and_type(n)
        node_args, scalars = _collect_args(n, refs)
        attention = op == "scaled_dot_product_attention"
        causal_mask = attention and causal_shape_mask(n, examples, verdicts, buffers)
        raw = RawNode(name=n.name, op=op, target=str(tgt), args=node_args, outputs=outs,
                      module_path=path, module_type=typ, scalars=scalars,
                      causal=attention and (causal_mask or causal_attention(n)), causal_mask=causal_mask,
                      fp32=stays_fp32(n))
        if outs:
            refs[n.name] = RawArg(kind="node", ref=n.name, spec=outs[0])
            nodes.append(raw)
    return Capture(nodes=tuple(nodes), inputs=tuple(inputs), method="export",
                   batch_symbolic=batch_symbolic, graph_module=ep, seq_range=_seq_range(ep, symbols),
                   custom_functions=tuple(functions))


def _seq_range(ep: Any, symbols: dict[sympy.Symbol, sympy.Expr]) -> tuple[int, float] | None:
    """The lengths an exported graph's sequence symbol may take (its range constraint): a graph traced at one
    length is valid at another only inside it."""
    for sym, which in symbols.items():
        if which == S and sym in ep.range_constraints:
            vr = ep.range_constraints[sym]
            return _int_or(vr.lower, 0), _int_or(vr.upper, float("inf"))
    return None


def _int_or(x: Any, unbounded: float) -> float:
    """A range's end as an int, or `unbounded` for sympy's and torch's infinities."""
    try:
        return int(x)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return unbounded


def _positional_names(model: torch.nn.Module, n: int) -> list[str]:
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [p.name for p in params[:n]]


def _symbol_map(pairs) -> tuple[dict[sympy.Symbol, sympy.Expr], bool]:
    """Map the tracer's own size symbols to B (batch) and S (sequence)."""
    symbols: dict[sympy.Symbol, sympy.Expr] = {}
    batch_symbolic = False
    for val, dims in pairs:
        if not isinstance(val, torch.Tensor):
            continue
        for d, which in dims.items():
            size = val.shape[d]
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                symbols[size.node.expr] = B if which == "b" else S
                batch_symbolic |= which == "b"
    return symbols, batch_symbolic


def _var_values(env) -> dict:
    # torch 2.13 renamed var_to_val (deprecated) to backed_var_to_val.
    return getattr(env, "backed_var_to_val", None) or env.var_to_val


def _hints(graph: fx.Graph) -> dict[sympy.Symbol, int]:
    for n in graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and hasattr(val, "fake_mode") and val.fake_mode.shape_env is not None:
            return {k: int(v) for k, v in _var_values(val.fake_mode.shape_env).items()}
    return {}


def _collect_args(n: fx.Node, refs: dict[str, RawArg]) -> tuple[tuple[RawArg, ...], tuple[Any, ...]]:
    tensors: list[RawArg] = []
    scalars: list[Any] = []
    for a in pytree.tree_leaves((n.args, n.kwargs)):
        if isinstance(a, fx.Node):
            if a.name in refs:
                tensors.append(refs[a.name])
        elif isinstance(a, (int, float, bool, str)):  # str: einsum's equation
            scalars.append(a)
    return tuple(tensors), tuple(scalars)


# ---------------------------------------------------------------- fx


class _Tracer(fx.Tracer):
    # nanoGPT slices a mask buffer by x.size(): the buffer must be a proxy.
    proxy_buffer_attributes = True

    def __init__(self, leaf_modules: tuple[type, ...]):
        super().__init__()
        self._leaf_types = leaf_modules

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return isinstance(m, self._leaf_types) or super().is_leaf_module(m, qualname)


_FX_MODULE_OPS: dict[str, str] = {
    "Linear": "linear", "Conv1d": "convolution", "Conv2d": "convolution", "Conv3d": "convolution",
    "ConvTranspose1d": "convolution", "ConvTranspose2d": "convolution", "Embedding": "embedding",
    "LayerNorm": "layer_norm", "RMSNorm": "rms_norm", "GroupNorm": "group_norm",
    "BatchNorm1d": "batch_norm", "BatchNorm2d": "batch_norm", "BatchNorm3d": "batch_norm",
    "Dropout": "dropout", "ReLU": "relu", "GELU": "gelu", "SiLU": "silu", "Tanh": "tanh",
    "Sigmoid": "sigmoid", "Softmax": "softmax", "LogSoftmax": "log_softmax", "MaxPool2d": "max_pool2d",
    "AvgPool2d": "avg_pool2d", "AdaptiveAvgPool2d": "adaptive_avg_pool2d", "Flatten": "flatten",
    "Identity": "alias", "CrossEntropyLoss": "cross_entropy", "MultiheadAttention": "multihead_attention",
    "Conv1D": "conv1d_hf",  # Hugging Face GPT-2's transposed linear
}


def _capture_fx(model, args, kwargs, dynamic_seq: bool, leaf_modules: tuple[type, ...]) -> Capture:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    sig = inspect.signature(model.forward)
    bound = sig.bind_partial(*args, **kwargs)
    concrete = {name: p.default for name, p in sig.parameters.items()
                if name not in bound.arguments and p.default is not inspect.Parameter.empty}
    tracer = _Tracer(leaf_modules)
    graph = tracer.trace(model, concrete_args=concrete or None)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)

    env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    examples = list(bound.arguments.values())
    fakes, pairs = [], []
    for x in examples:
        if isinstance(x, torch.Tensor):
            dims = _dims_for(x, dynamic_seq)
            ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC
                                                          for d in range(x.dim())])
            fx_ = fake_mode.from_tensor(x, symbolic_context=ctx)
            fakes.append(fx_)
            pairs.append((fx_, dims))
        else:
            fakes.append(x)
    symbols, batch_symbolic = _symbol_map(pairs)

    class _Prop(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            n.meta["val"] = out
            return out

    with fake_mode:
        _Prop(gm).run(*fakes)
    hints = {k: int(v) for k, v in _var_values(env).items()}

    named_params = dict(model.named_parameters(remove_duplicate=False))
    named_buffers = dict(model.named_buffers(remove_duplicate=False))
    refs: dict[str, RawArg] = {}
    inputs: list[tuple[str, RawSpec]] = []
    nodes: list[RawNode] = []
    for n in gm.graph.nodes:
        outs = _specs(n.meta.get("val"), symbols, hints)
        if n.op == "placeholder":
            if outs:
                refs[n.name] = RawArg(kind="input", ref=n.name, spec=outs[0])
                inputs.append((n.name, outs[0]))
            continue
        if n.op == "get_attr":
            kind = "param" if n.target in named_params else "buffer" if n.target in named_buffers else "const"
            refs[n.name] = RawArg(kind=kind, ref=n.target, spec=outs[0] if outs else None)
            continue
        if n.op == "output" or not outs:
            continue
        path, typ = _module_path_and_type(n)
        node_args, scalars = _collect_args(n, refs)
        if n.op == "call_module":
            mod = gm.get_submodule(n.target)
            typ = type(mod).__name__
            path = n.target
            op = _FX_MODULE_OPS.get(typ, _canonical(typ.lower()))
            own = tuple(RawArg(kind="param", ref=f"{n.target}.{k}", spec=_specs(p, {}, {})[0])
                        for k, p in mod.named_parameters(remove_duplicate=False))
            node_args = node_args + own
            scalars = scalars + _module_scalars(mod)
            target = f"{typ}({n.target})"
        elif n.op == "call_method":
            op, target = _canonical(n.target), f"Tensor.{n.target}"
        else:
            name = "getitem" if n.target is operator.getitem else getattr(n.target, "__name__", str(n.target))
            op, target = _canonical(name), f"{getattr(n.target, '__module__', '')}.{name}".lstrip(".")
        nodes.append(RawNode(name=n.name, op=op, target=target, args=node_args, outputs=outs,
                             module_path=path, module_type=typ, scalars=scalars,
                             causal=op == "scaled_dot_product_attention" and causal_attention(n)))
        refs[n.name] = RawArg(kind="node", ref=n.name, spec=outs[0])
    return Capture(nodes=tuple(nodes), inputs=tuple(inputs), method="fx",
                   batch_symbolic=batch_symbolic, graph_module=gm)


def _module_scalars(mod: torch.nn.Module) -> tuple[Any, ...]:
    if isinstance(mod, torch.nn.Dropout):
        return (mod.p,)
    return ()


# ---------------------------------------------------------------- entry


def capture(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], *,
            method: Literal["auto", "export", "fx"] = "auto", dynamic_seq: bool = True,
            leaf_modules: tuple[type, ...] = (), rewrite_attention: bool = False) -> Capture:
    """Capture `model(*args, **kwargs)`; "auto" tries export, then fx. `rewrite_attention` rewrites eager
    attention in an exported graph to scaled_dot_product_attention (partitioner.tracer.attention); an fx
    graph, whose code no program runs, keeps it as traced."""
    order = {"auto": ("export", "fx"), "export": ("export",), "fx": ("fx",)}.get(method)
    if order is None:
        raise TraceError(f"method={method!r}: must be 'auto', 'export' or 'fx'")
    if leaf_modules and method == "auto":
        order = ("fx",)  # only fx can keep a module whole
    errors: list[tuple[str, BaseException]] = []
    for m in order:
        try:
            with untouched(model):  # hooks a traced forward installs (transformers' output capture) come off again
                if m == "export":
                    return _capture_export(model, args, kwargs, dynamic_seq, rewrite_attention)
                return _capture_fx(model, args, kwargs, dynamic_seq, leaf_modules)
        except (KeyboardInterrupt, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised below as one TraceError
            errors.append((m, exc))
    first_m, first = errors[0]
    other = None
    if len(errors) > 1:
        m2, e2 = errors[1]
        other = f"{m2}: {type(e2).__name__}: {(str(e2).strip().splitlines() or [''])[0][:200]}"
    raise trace_error(model, first_m, first, other=other) from first
