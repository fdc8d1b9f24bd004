"""Which blocks of a layer stack compute the same thing: `attribute_kinds`, `graph_kinds`.

Blocks of one class with the same parameter shapes need not compute the same
graph. Gemma3 and GPT-OSS alternate sliding-window and full attention through
a plain attribute (`sliding_window`, `layer_type`); DeepSeek-V3's first layer
holds a dense MLP where the others hold experts. Generated code runs one
template per *kind* of block, so kinds must be decided from everything that
changes what a block computes:

- before tracing every block (`attribute_kinds`): the structure (module
  classes, parameter and buffer shapes) and the values of the attributes the
  traced code actually *read*, recorded while the first blocks were traced
  (`recording`). An attribute that differs between blocks but is never read
  (Hugging Face's `layer_idx` without a KV cache) does not make them differ;
  one that is read (`sliding_window`) does;
- from a full trace (`graph_kinds`): each block's graph in a canonical form
  (ops, scalar arguments, wiring inside the block, parameters relative to the
  block, and which outside values it reads), so that two blocks are of one
  kind only when their graphs are equal.

The example GPT with `local_window` alternates as Gemma3 does: `attn.window` is the window on
blocks 1, 3, ... and None on the others, and the attention code reads it:

>>> import torch
>>> from examples.gpt import GPT, GPTConfig
>>> from partitioner.tracer.blocks import find_layer_stack
>>> model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=64, local_window=4))
>>> stack = find_layer_stack(model)
>>> reads = set()
>>> _ = recording(model.transformer.h[0], reads)(torch.zeros(1, 8, 32))   # as the tracer runs a block
>>> ("attn", "window") in reads
True
>>> attribute_kinds(model, stack, reads)
(0, 1, 0, 1)
>>> attribute_kinds(model, stack, set())      # by structure alone the blocks are alike
(0, 0, 0, 0)

Kinds that repeat (`find_repeat`) let the tracer trace a few blocks and copy
the rest (partitioner.tracer.blocks.expand):

>>> find_repeat((0, 1, 0, 1, 0, 1, 0, 1))
Repeat(offset=0, period=2)
>>> find_repeat((0, 1, 1, 1, 1))
Repeat(offset=1, period=1)
>>> find_repeat((0, 0, 0, 0, 1)) is None        # only the last block differs: trace every block
True
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import fx, nn

from partitioner.tracer.blocks import TRACED_BLOCKS, LayerStack, Repeat, block_index
from partitioner.tracer.writes import mutates

__all__ = ["Reads", "recording", "attribute_kinds", "likely_kinds", "find_repeat", "graph_kinds", "number_kinds"]

# (module path inside the block, attribute name): attributes the traced forward read
Reads = set[tuple[str, str]]


def number_kinds(keys: list[Any]) -> tuple[int, ...]:
    """Kind ids in order of first appearance: ["a", "b", "a"] -> (0, 1, 0)."""
    ids: dict[Any, int] = {}
    return tuple(ids.setdefault(k, len(ids)) for k in keys)


# ---------------------------------------------------------------- attributes read while tracing


@functools.cache
def _recording_class(cls: type) -> type:
    """A subclass of `cls` that notes every plain instance attribute read (not parameters, buffers or
    submodules, which live in nn.Module's own dicts and are compared by shape). Same names, so the
    traced graph's module stack reads as the user's classes."""

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if not name.startswith("_") and name != "training":
            d = object.__getattribute__(self, "__dict__")
            if name in d:
                reads, rel = d["_partitioner_reads"]
                reads.add((rel, name))
        return value

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__qualname__": cls.__qualname__,
                                       "__module__": cls.__module__})


def recording(block: nn.Module, reads: Reads, rel: str = "") -> nn.Module:
    """A shallow copy of `block` and its submodules (parameters shared, nothing copied) that adds each
    attribute its code reads to `reads` as (path inside the block, name). The user's modules are untouched."""
    c = copy.copy(block)
    c._modules = {k: None if m is None else recording(m, reads, f"{rel}.{k}" if rel else k)
                  for k, m in block._modules.items()}
    c.__dict__["_partitioner_reads"] = (reads, rel)
    c.__class__ = _recording_class(type(block))
    return c


def _value_key(v: Any) -> Any:
    """A comparable stand-in for an attribute's value: plain data by value, tensors by content,
    functools.partial by its function and arguments, any other object by identity (a config shared by
    every block is one object)."""
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(v).__name__, v)
    if isinstance(v, (tuple, list, frozenset)):
        return (type(v).__name__, tuple(_value_key(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((str(k), _value_key(x)) for k, x in v.items())))
    if isinstance(v, functools.partial):  # HF's GELUTanh: one partial(gelu, approximate="tanh") per block
        return ("partial", _value_key(v.func), _value_key(v.args), _value_key(v.keywords))
    if isinstance(v, torch.Tensor):
        if v.device.type == "meta":
            return ("tensor", tuple(v.shape), str(v.dtype), id(v))
        return ("tensor", tuple(v.shape), str(v.dtype), tuple(v.detach().flatten().tolist()) if v.numel() <= 64
                else id(v))
    return ("object", id(v))


def _structure(m: nn.Module) -> tuple:
    return tuple((path, type(sub).__name__,
                  tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in sub.named_parameters(recurse=False)),
                  tuple((n, tuple(b.shape), str(b.dtype)) for n, b in sub.named_buffers(recurse=False)))
                 for path, sub in m.named_modules())


def attribute_kinds(model: nn.Module, stack: LayerStack, reads: Reads) -> tuple[int, ...]:
    """The kind of every block of `stack`: equal structure and equal values of the attributes in `reads`."""
    container = model.get_submodule(stack.path)
    keys = []
    for block in container:
        vals = []
        for rel, name in sorted(reads):
            try:
                sub = block.get_submodule(rel) if rel else block
            except AttributeError:
                vals.append(("missing module",))
                continue
            vals.append(_value_key(sub.__dict__[name]) if name in sub.__dict__ else ("missing",))
        keys.append((_structure(block), tuple(vals)))
    return number_kinds(keys)


def likely_kinds(model: nn.Module, stack: LayerStack) -> tuple[int, ...]:
    """A guess at the kinds before anything is traced, to trace enough blocks at the first attempt: the
    structure and every plain attribute of the blocks' modules whose values along the stack repeat by
    themselves (`sliding_window` alternating 4, None, ...; not `layer_idx`, 0 1 2 ..., which no
    repeated block could share). An attribute the code never reads can only make the tracer trace more
    blocks than needed; what is copied is decided by `attribute_kinds` from what the code read."""
    blocks = list(model.get_submodule(stack.path))
    attrs = [{(rel, name): v for rel, sub in b.named_modules() for name, v in vars(sub).items()
              if not name.startswith("_") and name != "training"} for b in blocks]
    columns = [number_kinds([_value_key(a[key]) if key in a else ("missing",) for a in attrs])
               for key in sorted(set().union(*attrs))]
    return number_kinds(list(zip(number_kinds([_structure(b) for b in blocks]),
                                 *(c for c in columns if find_repeat(c) is not None))))


def find_repeat(kinds: tuple[int, ...]) -> Repeat | None:
    """The offset o and period p with kinds[i] == kinds[i + p] for every i >= o, whole super-blocks
    ((N - o) % p == 0) and fewer traced blocks than N (o + 3p < N), tracing the fewest blocks (then the
    shortest period); None when there is none. (0, 0, 0, 0) is Repeat(offset=0, period=1)."""
    n = len(kinds)
    best: tuple[int, int, Repeat] | None = None
    for p in range(1, (n - 1) // TRACED_BLOCKS + 1):
        differ = [i for i in range(n - p) if kinds[i] != kinds[i + p]]
        o = differ[-1] + 1 if differ else 0
        o += (n - o) % p  # a whole number of super-blocks after the head; kinds stay periodic
        r = Repeat(offset=o, period=p)
        if r.fits(kinds) and (best is None or (r.traced, p) < best[:2]):
            best = (r.traced, p, r)
    return best[2] if best else None


# ---------------------------------------------------------------- kinds from a full trace


def graph_kinds(ep: Any, stack: LayerStack, num_blocks: int, canonical: dict[str, str]) -> tuple[int, ...]:
    """The kind of every block from an ExportedProgram holding all of them (see the module docstring).

    canonical: parameter name -> its first (tied) name. A value read from outside the block is named
    by what it is: the hidden state (the one value that is neither the block's own nor computed from
    shapes and inputs alone), a parameter or buffer relative to the block, a constant by value, anything
    else (a mask or position table computed from shapes, a mask made from the padding) by how it is computed.
    """
    gm = ep.graph_module
    sig = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    shape_only: dict[fx.Node, bool] = {}
    input_only: dict[fx.Node, bool] = {}  # computed from the model's inputs (and shapes) alone: a padding mask
    member: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            kind = sig[n.name].kind.name if n.name in sig else "USER_INPUT"
            shape_only[n] = kind in ("BUFFER", "CONSTANT_TENSOR")
            input_only[n] = shape_only[n] or kind == "USER_INPUT"
        elif n.op == "get_attr":
            shape_only[n] = input_only[n] = True
        elif n.op == "call_function":
            shape_only[n] = n.target is torch.ops.aten.sym_size.int or all(shape_only[a] for a in n.all_input_nodes)
            input_only[n] = shape_only[n] or all(input_only[a] for a in n.all_input_nodes)
            stack_meta = n.meta.get("nn_module_stack") or {}
            path = list(stack_meta.values())[-1][0] if stack_meta else ""
            b = block_index(path, stack.path)
            if b is not None and not shape_only[n] and (n.users or mutates(n)):
                member[n] = b
    by_block: dict[int, list[fx.Node]] = {}
    for n, b in member.items():
        by_block.setdefault(b, []).append(n)

    def param_name(n: fx.Node, b: int) -> tuple:
        s = sig.get(n.name)
        kind = s.kind.name if s is not None else "USER_INPUT"
        if kind == "USER_INPUT":
            return ("input", n.name)
        target = canonical.get(s.target, s.target) if kind == "PARAMETER" else s.target
        head = f"{stack.path}.{b}." if stack.path else f"{b}."
        if kind == "CONSTANT_TENSOR":
            v = ep.constants.get(s.target)
            return ("const", _value_key(v))
        return (kind, target[len(head):] if target.startswith(head) else ("outside", target))

    def form(b: int) -> tuple:
        nodes = by_block.get(b, [])
        pos = {n: i for i, n in enumerate(nodes)}

        shapes: dict[fx.Node, tuple] = {}

        def arg(a: Any) -> Any:
            if isinstance(a, fx.Node):
                if a in pos:
                    return ("local", pos[a])
                if a.op == "placeholder":
                    return param_name(a, b)
                if not input_only.get(a, False):
                    return ("hidden",)
                if a not in shapes:  # computed from shapes, buffers, constants, inputs: by how, not by name
                    # (two masks made from one padding mask, a sliding window's and the causal one, differ)
                    shapes[a] = ("shape", str(a.target), arg(a.args), arg(a.kwargs)) if a.op == "call_function" \
                        else ("attr", a.name)
                return shapes[a]
            if isinstance(a, (list, tuple)):
                return tuple(arg(x) for x in a)
            if isinstance(a, dict):
                return tuple(sorted((k, arg(x)) for k, x in a.items()))
            return repr(a)

        return tuple((str(n.target), arg(n.args), arg(n.kwargs)) for n in nodes)

    return number_kinds([form(b) for b in range(num_blocks)])


