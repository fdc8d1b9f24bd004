"""`trace(model, example_inputs) -> OpGraph`: capture, cost, expand, assign.

    capture   torch.export or torch.fx, shapes symbolic in batch and sequence
    cost      per-op FLOPs, bytes and saved activations (op_rules)
    expand    copy a trace of the first blocks to every block of the layer stack (blocks):
              three when the stack is uniform, o + 3p when its kinds repeat with period p after
              o head blocks (block_kinds.find_repeat)
    assign    resolve tied parameters, give each to its first user, mark blocks

Pure: the user's module is never modified (the truncated model is a shallow
copy), and nothing is cached between calls.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Literal, Sequence

import torch
from torch import nn

from cost_models.errors import TraceError
from partitioner.tracer.block_kinds import attribute_kinds, find_repeat, graph_kinds, likely_kinds, recording
from partitioner.tracer.blocks import (
    TRACED_BLOCKS,
    Costed,
    LayerStack,
    NotRepeating,
    block_index,
    expand,
    find_layer_stack,
    truncated,
)
from partitioner.tracer.capture import Capture, RawSpec, capture
from partitioner.tracer.op_rules import known_op, op_cost
from partitioner.tracer.opgraph import Block, OpCost, OpGraph, OpNode, ParamSpec, TensorSpec
from partitioner.tracer.symbolic import DataDependentSize, S, to_poly

__all__ = ["trace"]


def trace(model: nn.Module, example_inputs: Sequence[Any] | torch.Tensor = (), example_kwargs: dict[str, Any] | None = None,
          *, method: Literal["auto", "export", "fx"] = "auto", expand_repeated: bool = True,
          dynamic_seq: bool = True, leaf_modules: Sequence[type] = (), rewrite_attention: bool = True) -> OpGraph:
    """Trace `model(*example_inputs, **example_kwargs)` into an OpGraph.

    Batch is dimension 0 of every tensor input; for integer token inputs
    dimension 1 is the sequence. `method` forces torch.export or torch.fx
    ("auto" tries export, then fx). `expand_repeated` traces three blocks of
    a uniform layer stack, or three periods of one whose kinds of block repeat,
    and copies them (much faster for deep models; the result equals a full
    trace). `leaf_modules` keeps modules of those
    classes whole (fx only). `rewrite_attention` replaces eager attention
    (q k^T, scale, additive mask, softmax, dropout, @ v) by one
    scaled_dot_product_attention where that is the same math
    (partitioner.tracer.attention), and a GELU or SiLU spelled as
    elementwise ops by aten.gelu / aten.silu (partitioner.tracer.pointwise):
    the graph is costed, and its code runs, as fused kernels; False keeps
    the traced ops. Works with a model on the meta device.

    >>> from examples.gpt import gpt_small, example_inputs
    >>> model = gpt_small()
    >>> tokens, = example_inputs(model)
    >>> g = trace(model, (tokens,))
    >>> g.num_params, len(g.blocks)
    (5289472, 4)
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"model: expected a torch.nn.Module, got {type(model).__name__}; pass the module itself, not its class or output")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise TraceError(f"example_inputs: expected a tuple of inputs, got {type(example_inputs).__name__}; wrap a single input as (x,)")
    kwargs = dict(example_kwargs or {})
    if not example_inputs and not kwargs:
        raise TraceError("example_inputs: empty; pass the inputs of one forward call, e.g. trace(model, (tokens,))")
    with _without_kv_cache(model, kwargs):
        args, kwargs = _batch_of_two(tuple(example_inputs), kwargs)
        tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        traced_b = int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 1
        seq = next((int(x.shape[1]) for x in tensors
                    if x.dim() >= 2 and not x.dtype.is_floating_point and x.dtype != torch.bool), None)
        seq = seq if dynamic_seq else None

        stack = find_layer_stack(model)
        leaf = tuple(leaf_modules)
        kw = dict(method=method, dynamic_seq=dynamic_seq, leaf_modules=leaf, rewrite_attention=rewrite_attention)
        costed, cap, expanded_from, kinds = None, None, None, None
        if expand_repeated and stack is not None and not stack.shared and stack.size > TRACED_BLOCKS:
            try:
                costed, cap, kinds, expanded_from = _expanded(model, stack, args, kwargs, seq, **kw)
            except (TraceError, NotRepeating):
                costed = None  # the model does not repeat, or its forward needs every block: trace all of it
        if costed is None:
            cap = _capture(model, args, kwargs, **kw)
            costed = _cost(cap, model, stack, seq)
            kinds = _full_trace_kinds(cap, model, stack)
        off = _dropouts_off(cap.graph_module) if any(not m.training for m in model.modules()) else []
        if off:
            warnings.warn(
                f"trace: the model is in eval mode (as Hugging Face's from_pretrained returns it) and its dropout "
                f"(p = {', '.join(f'{p:g}' for p in sorted(set(off)))}) was traced off: the plan's code runs it as the "
                "identity at every step, where a training loop (model.train()) drops out. Call model.train() before "
                "compiling to train with dropout; keep eval mode only to train without it", stacklevel=2)
        unknown = sorted({n.op for n in costed if not known_op(n.op)})
        if unknown:
            warnings.warn(f"trace: no cost rule for {unknown}; counted as one FLOP per output element", stacklevel=2)
        return _assemble(costed, cap, model, stack, traced_b, seq, expanded_from, kinds)


def _dropouts_off(gm) -> list[float]:
    """The rate p of each dropout an exported graph holds with p > 0 and train=False: the module was in eval mode
    (export specialises on it), so code cut from the graph never drops out."""
    if not isinstance(gm, torch.export.ExportedProgram):
        return []
    return [float(n.args[1]) for n in gm.graph.nodes
            if n.op == "call_function" and "dropout" in str(n.target) and len(n.args) >= 3
            and isinstance(n.args[1], (int, float)) and n.args[1] > 0 and n.args[2] is False]


@contextlib.contextmanager
def _without_kv_cache(model: nn.Module, kwargs: dict[str, Any]):
    """Trace with the model's `config.use_cache` False where it would return a key/value cache and the caller
    did not pass use_cache; restored after.

    A Hugging Face model whose config asks for a cache (its default: `config.use_cache` is True) returns one
    from forward, a DynamicCache object that export cannot hold as an output; training never reads it. So a
    model built from a default config traces as it trains. The config, not an argument: a forward may take
    use_cache only through **kwargs (GraniteMoE), where export cannot take a bool, and an encoder's (BERT's)
    takes it there and ignores it. An explicit use_cache in `kwargs` is kept.
    """
    config = getattr(model, "config", None)
    if "use_cache" in kwargs or getattr(config, "use_cache", None) is not True:
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def _expanded(model: nn.Module, stack: LayerStack, args: tuple, kwargs: dict, seq: int | None,
              **kw) -> tuple[list[Costed], Capture, tuple[int, ...], int]:
    """Trace the first blocks of the stack and copy them to all of it: (nodes, capture, block kinds,
    blocks traced). Raises NotRepeating when the kinds do not repeat or the copy would differ.

    How many blocks to trace follows from how the kinds repeat (Repeat, block_kinds.find_repeat):
    guessed from the structure and the attributes that repeat along the stack (block_kinds.likely_kinds:
    3 blocks for a uniform stack, 4 for a dense layer before MoE ones, 6 for alternating attention),
    then checked against the kinds from the attributes the traced code read (attribute_kinds). When
    those do not repeat that way, the blocks they need are traced once more, recording again. Blocks
    that differ in an attribute their code reads are never copied onto one another.
    """
    by_structure = find_repeat(attribute_kinds(model, stack, set()))
    if by_structure is None:
        raise NotRepeating(f"the blocks of {stack.path or 'the model'} differ in structure and do not repeat")
    repeat = find_repeat(likely_kinds(model, stack)) or by_structure
    for _ in range(2):
        reads: set[tuple[str, str]] = set()
        cap = _capture(truncated(model, stack, repeat.traced, wrap=lambda b: recording(b, reads)), args, kwargs, **kw)
        kinds = attribute_kinds(model, stack, reads)
        if repeat.fits(kinds):
            return expand(_cost(cap, model, stack, seq), stack, repeat), cap, kinds, repeat.traced
        repeat = find_repeat(kinds)  # the code read attributes the guess missed: trace the blocks they need
        if repeat is None:
            raise NotRepeating(f"blocks differ in attributes their code reads ({sorted(reads)[:5]}) and do not repeat")
    raise NotRepeating(f"block kinds {kinds} need a different number of blocks with each trace")


def _full_trace_kinds(cap: Capture, model: nn.Module, stack: LayerStack | None) -> tuple[int, ...] | None:
    """Block kinds from a graph holding every block (export); from structure alone under fx, whose
    graphs feed no generated code."""
    if stack is None:
        return None
    if isinstance(cap.graph_module, torch.export.ExportedProgram):
        canonical: dict[str, str] = {}
        first: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            canonical[name] = first.setdefault(id(p), name)
        return graph_kinds(cap.graph_module, stack, stack.size, canonical)
    return attribute_kinds(model, stack, set())


def _capture(model: nn.Module, args: tuple, kwargs: dict, **kw) -> Capture:
    """capture(), keeping the sequence symbolic when the example pins it.

    An example as long as the model's context (seq == block_size) lets the
    exporter prove `x[:, :, :T, :T]` is the whole buffer and fix T: the costs
    would lose their dependence on s, and with it what selective
    recomputation saves. Then capture with half the sequence, once, which
    keeps T symbolic; every cost is still evaluated at the user's length, and
    the shorter capture is taken only where its graph holds at that length
    (torch.export's range for T includes it). Where a buffer of the model is
    as long as the example's sequence (a causal mask of the model's context),
    the shorter capture comes first: the full one would be thrown away.
    """
    seq = _example_seq(args, kwargs)
    shorter = _halve_sequence(args, kwargs) if kw.get("dynamic_seq") and seq is not None else None
    if shorter is not None and _context_long_buffer(model, seq):
        short = _try_capture(model, shorter, seq, **kw)
        if short is not None:
            return short
    cap = capture(model, args, kwargs, **kw)
    if shorter is None or _has_seq_symbol(cap):
        return cap
    return _try_capture(model, shorter, seq, **kw) or cap


def _try_capture(model: nn.Module, shorter: tuple[tuple, dict], seq: int, **kw) -> Capture | None:
    """The capture of the shorter example, where it keeps the sequence symbolic and holds at length `seq`."""
    try:
        cap = capture(model, *shorter, **kw)
    except TraceError:
        return None
    ok = _has_seq_symbol(cap) and (cap.seq_range is None or cap.seq_range[0] <= seq <= cap.seq_range[1])
    return cap if ok else None


def _example_seq(args: tuple, kwargs: dict) -> int | None:
    """The sequence length of the example's token inputs (dim 1 of an integer tensor)."""
    return next((int(x.shape[1]) for x in (*args, *kwargs.values())
                 if isinstance(x, torch.Tensor) and x.dim() >= 2 and not x.dtype.is_floating_point
                 and x.dtype != torch.bool), None)


def _context_long_buffer(model: nn.Module, seq: int) -> bool:
    """Whether a buffer of the model has a dim of exactly `seq` (a mask or table of the model's context length)."""
    return any(seq in b.shape for b in model.buffers())


def _has_seq_symbol(cap: Capture) -> bool:
    """Every token input kept its sequence dimension symbolic."""
    tokens = [spec for _, spec in cap.inputs
              if len(spec.shape) >= 2 and not spec.dtype.is_floating_point and spec.dtype != torch.bool]
    return bool(tokens) and all(S in getattr(t.shape[1], "free_symbols", ()) for t in tokens)


def _halve_sequence(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    def cut(x):
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and not x.dtype.is_floating_point and x.dtype != torch.bool:
            return x[:, : max(2, x.shape[1] // 2)].contiguous()  # models call .view on their inputs
        return x
    new_args, new_kwargs = tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
    changed = any(a is not b for a, b in zip(args, new_args)) or any(kwargs[k] is not new_kwargs[k] for k in kwargs)
    return (new_args, new_kwargs) if changed else None


def _batch_of_two(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A batch of 1 would be specialised by the tracer (size-1 dims are static); trace 2 instead."""
    def grow(x):
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == 1:
            return torch.cat([x, x]) if x.device.type != "meta" else x.new_empty((2, *x.shape[1:]))
        return x
    return tuple(grow(a) for a in args), {k: grow(v) for k, v in kwargs.items()}


def _spec(raw: RawSpec, s_value: int | None) -> TensorSpec:
    return TensorSpec(shape=tuple(to_poly(d, s_value=s_value or 1) for d in raw.shape),
                      dtype=str(raw.dtype).removeprefix("torch."), itemsize=raw.itemsize)


def _cost(cap: Capture, model: nn.Module, stack: LayerStack | None, seq: int | None) -> list[Costed]:
    """Cost every node; work out which outputs backward keeps (views resolved to their base)."""
    rg_param = {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
    rg: dict[str, bool] = {}
    base: dict[str, str | None] = {}
    sym = {}
    kept: set[str] = set()
    extra: dict[str, Any] = {}
    fixed: dict[str, Any] = {}  # the masks and indices among extra
    for n in cap.nodes:
        arg_rg = [rg_param.get(a.ref, False) if a.kind == "param" else rg.get(a.ref, False) if a.kind == "node" else False
                  for a in n.args]
        c = op_cost(n, arg_rg)
        sym[n.name] = c
        rg[n.name] = any(arg_rg) and n.outputs[0].dtype.is_floating_point
        if c.is_view:
            src = next((a for a in n.args if a.kind == "node"), None)
            base[n.name] = base.get(src.ref, src.ref) if src is not None else None
        else:
            base[n.name] = n.name
        ex, fx_ = c.extra_saved_bytes, c.extra_fixed_bytes
        for i in c.saved_args:
            a = n.args[i]
            if a.kind == "node" and base.get(a.ref):
                kept.add(base[a.ref])
            elif a.kind == "input" and a.spec is not None:
                ex = ex + a.spec.numel() * a.spec.itemsize
                if not a.spec.dtype.is_floating_point:
                    fx_ = fx_ + a.spec.numel() * a.spec.itemsize
        if c.saves_output and base[n.name]:
            kept.add(base[n.name])
        extra[n.name], fixed[n.name] = ex, fx_

    s_value = seq or 1
    out: list[Costed] = []
    for n in cap.nodes:
        try:
            out.append(_costed(n, sym[n.name], extra[n.name], fixed[n.name], n.name in kept, rg, s_value, seq,
                               stack))
        except DataDependentSize as e:
            raise TraceError(
                f"{n.name} ({n.op}{' in ' + n.module_path if n.module_path else ''}): its size depends on the values "
                f"of the data ({', '.join(e.symbols)}: torch.where, nonzero or a boolean mask select how many "
                "elements), so its cost cannot be written in batch and sequence length; route with fixed-size ops "
                "(top-k over a capacity, one_hot, sort + grouped matmul as Hugging Face's MoE classes do)") from None
    return out


def _costed(n, c, extra_bytes, fixed_bytes, kept: bool, rg, s_value: int, seq: int | None,
            stack: LayerStack | None) -> Costed:
    out_bytes = n.outputs[0].numel() * n.outputs[0].itemsize if kept else 0
    act = extra_bytes + out_bytes
    # masks, indices and what the model keeps fp32 on purpose: the same size at any precision
    fixed_bytes = fixed_bytes + (0 if n.outputs[0].dtype.is_floating_point and not n.fp32 else out_bytes)
    cost = OpCost(forward_flops=to_poly(c.forward_flops, s_value=s_value),
                  backward_flops=to_poly(c.backward_flops, s_value=s_value),
                  bytes_read=to_poly(c.bytes_read, s_value=s_value),
                  bytes_written=to_poly(c.bytes_written, s_value=s_value),
                  activation_bytes=to_poly(act, s_value=s_value), op_class=c.op_class,
                  fixed_activation_bytes=to_poly(fixed_bytes, s_value=s_value), causal=n.causal)
    return Costed(
        name=n.name, op=n.op, target=n.target,
        inputs=tuple(a.ref for a in n.args if a.kind in ("node", "input")),
        params=tuple(dict.fromkeys(a.ref for a in n.args if a.kind == "param")),
        output=_spec(n.outputs[0], seq), cost=cost, requires_grad=rg[n.name],
        module_path=n.module_path, module_type=n.module_type, scalars=n.scalars,
        block=block_index(n.module_path, stack.path) if stack is not None else None)


def _assemble(costed: list[Costed], cap: Capture, model: nn.Module, stack: LayerStack | None,
              traced_b: int, seq: int | None, expanded_from: int | None, kinds: tuple[int, ...] | None) -> OpGraph:
    # Tied parameters: one tensor, several names; the first name is canonical.
    by_id: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    canonical = {n: names[0] for names in by_id.values() for n in names}

    # Glue between blocks (a tuple index on a block's output) travels with the block before it;
    # nodes before the first block are the prefix, after the last the suffix (block None).
    last_block = max((n.block for n in costed if n.block is not None), default=None)
    blocks_of: list[int | None] = []
    current: int | None = None
    for n in costed:
        if n.block is not None:
            current = n.block
        blocks_of.append(n.block if n.block is not None else None if current in (None, last_block) else current)
    id_of = {names[0]: i for i, names in by_id.items()}

    owner: dict[str, tuple[str, int | None]] = {}
    nodes: list[OpNode] = []
    for n, blk in zip(costed, blocks_of):
        params = tuple(dict.fromkeys(canonical.get(p, p) for p in n.params))
        mine = [p for p in params if p not in owner]
        for p in mine:
            owner[p] = (n.name, blk)
        owned = [tensors[id_of[p]] for p in mine if p in id_of]
        numel = sum(t.numel() for t in owned)
        nbytes = sum(t.numel() * t.element_size() for t in owned)
        nodes.append(OpNode(name=n.name, op=n.op, target=n.target, inputs=n.inputs, output=n.output, cost=n.cost,
                            params=params, param_count=numel, param_bytes=nbytes, module_path=n.module_path,
                            module_type=n.module_type, block=blk, requires_grad=n.requires_grad))

    unknown = [p for p in owner if p not in canonical]
    if unknown:
        raise TraceError(f"trace: the graph reads parameters the model does not have: {unknown[:5]}; "
                         "this is a tracer bug for this model, please report it with the model")
    params = []
    for names in by_id.values():
        p = tensors[id_of[names[0]]]
        own, blk = owner.get(names[0], (None, None))
        params.append(ParamSpec(name=names[0], shape=tuple(p.shape), dtype=str(p.dtype).removeprefix("torch."),
                                numel=p.numel(), nbytes=p.numel() * p.element_size(), aliases=tuple(names[1:]),
                                owner=own, block=blk, trainable=p.requires_grad))
    # Parameters no node reads keep owner None and still count in num_params.

    blocks = []
    if stack is not None:
        for i in sorted({b for b in blocks_of if b is not None}):
            idx = [k for k, b in enumerate(blocks_of) if b == i]
            blocks.append(Block(index=i, name=f"{stack.path}.{i}" if stack.path else str(i), module_type=stack.module_type,
                                first_node=idx[0], last_node=idx[-1],
                                param_count=sum(nodes[k].param_count for k in idx),
                                kind=kinds[i] if kinds and i < len(kinds) else 0))
    buffers = {id(b): b for b in model.buffers()}
    dtypes = [p.dtype for p in tensors.values()]
    dtype = str(max(set(dtypes), key=dtypes.count)).removeprefix("torch.") if dtypes else "float32"
    return OpGraph(nodes=tuple(nodes), params=tuple(params), blocks=tuple(blocks),
                   inputs=tuple(_spec(s, seq) for _, s in cap.inputs), dtype=dtype,
                   traced_batch_size=traced_b, traced_seq_len=seq, batch_symbolic=cap.batch_symbolic,
                   method=cap.method, model_name=type(model).__name__,
                   block_container=stack.path if stack is not None else None, expanded_from=expanded_from,
                   buffer_bytes=sum(b.numel() * b.element_size() for b in buffers.values()),
                   custom_functions=cap.custom_functions, seq_lengths=_seq_lengths(cap.seq_range),
                   graph_module=cap.graph_module)


def _seq_lengths(seq_range: tuple[int, float] | None) -> tuple[int, int | None] | None:
    """The capture's sequence range as OpGraph.seq_lengths: None where nothing but torch.export's 0/1
    specialisation (a symbol is never 0 or 1) bounds it, so that only a model's own branches on its length
    constrain the lengths it trains at."""
    if seq_range is None:
        return None
    lo, hi = seq_range
    if lo <= 2 and hi == float("inf"):
        return None
    return int(lo), None if hi == float("inf") else int(hi)
