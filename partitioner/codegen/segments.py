"""The model as code: prefix, one block, suffix, cut from the exported graph.

A pipeline stage runs the prefix (stage 0), a run of blocks, and the suffix
(the last stage). `extract(ep, g)` cuts those three pieces out of the
ExportedProgram the tracer captured (the model with its first blocks), and
writes each as a plain Python function over ATen ops. The block function is
a template: block 1's graph with its parameter names relative to the block,
so one function serves every block (the tracer checked they repeat). A stack
whose blocks are not all alike (alternating sliding-window and full
attention, a dense layer before MoE layers: `partitioner.tracer.block_kinds`) has one
template per kind of block (`block`, `block_1`, ...).

Only one tensor crosses a cut: the hidden state. Everything else a block
reads from outside is a parameter or buffer, a model input (every pipeline
rank has the batch: labels for an in-model loss, an attention mask), or
computed from *shapes alone* (sizes, an arange of positions, a causal mask
built from them, rotary tables from a buffer): those are recomputed inside
the segment from the hidden state's sizes. A block that reads any other
prefix value, or hands on more than the hidden state, is refused with the
nodes named.

With expert parallelism (ep > 1) each MoE layer's experts become one call over the ep group, and the
router logits a block hands on for the load-balancing loss go to the ep context instead of across the
cut: see `partitioner.codegen.segment_ep`.

With tensor parallelism (tp > 1) the copied code is rewritten as the tensor
splits say (Megatron f and g, local head counts, vocab-parallel embedding,
head and cross entropy): see `partitioner.codegen.segment_tp`. Casts to the traced
parameter dtype (fp32) become casts to the parameters' dtype at run time,
so the same code runs under bf16 mixed precision.

>>> from partitioner import trace
>>> from examples.gpt import gpt_small, example_batch
>>> model = gpt_small()
>>> g = trace(model, example_batch(model, 2))
>>> ep = g.graph_module                        # the ExportedProgram the tracer captured
>>> code = extract(ep, g)
>>> print(code.block.source)
def block(tp, x, ln_1_weight, ln_1_bias, attn_c_attn_weight, ...):
    layer_norm...: "f32[idx.0, idx.1, 256]" = torch.ops.aten.layer_norm.default(x, [256], ln_1_weight, ...)
...
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from partitioner.codegen.segment_attention import (ATTENTION_FUNCTIONS, attention_mask, mask_sources, shape_mask,
                                                   shape_mask_attention)
from partitioner.codegen.segment_carry import carry
from partitioner.codegen.segment_cp import CP_FUNCTIONS, ContextParallelRewrite, sequence_symbols
from partitioner.codegen.segment_ep import EP_FUNCTIONS, ExpertParallelRewrite, in_scope
from partitioner.codegen.segment_glue import NONE, find_glue
from partitioner.codegen.segment_tp import RUNTIME_FUNCTIONS, TensorParallelRewrite, fp8_linear, tp_chunk, unmangle
from partitioner.planner.model_code import ModelCode, Segment, SegmentError, describe
from partitioner.tracer.attention import shape_mask_key
from partitioner.tracer.capture import unwritten_buffers
from partitioner.tracer.upcasts import cast_dtype, casts_known, is_upcast
from partitioner.tracer.writes import mutates, nested_written, with_bases, written
from partitioner.tracer.blocks import block_index

__all__ = ["ModelCode", "Segment", "SegmentError", "extract", "reads_router_logits"]

_aten = torch.ops.aten
_CASTS = {_aten.to.dtype_layout, _aten.to.dtype, _aten._to_copy.default}


# in-place ops that change a tensor's metadata, not its values: a value made from it may still be recomputed
_METADATA_WRITES = frozenset({_aten.detach_.default})


def _argname(name: str) -> str:
    return re.sub(r"\W", "_", name)


def size_expression(n: fx.Node) -> Any:
    """The expression of the model's sizes that `n`, an integer an op computed, equals (sympy); None where it is
    no such integer (a tensor, a size read by sym_size, an integer computed from data)."""
    val = n.meta.get("val")
    if n.op != "call_function" or n.target is _aten.sym_size.int or not isinstance(val, torch.SymInt):
        return None
    expr = val.node.expr
    if not expr.free_symbols or not all(_SIZE_SYMBOL.fullmatch(str(s)) for s in expr.free_symbols):
        return None
    return expr if _emittable(expr) else None


_SIZE_SYMBOL = re.compile(r"s\d+")  # torch.export's symbols for input sizes (u0...: sizes computed from data)


def _size_ops() -> dict:
    """The sympy functions a size expression may hold, and the Python function that computes each."""
    import sympy

    from torch.utils._sympy import functions as f

    return {sympy.Add: operator.add, sympy.Mul: operator.mul, sympy.Min: torch.sym_min, sympy.Max: torch.sym_max,
            f.Min: torch.sym_min, f.Max: torch.sym_max, f.FloorDiv: operator.floordiv}


def _emittable(expr: Any) -> bool:
    import sympy

    if isinstance(expr, (sympy.Integer, sympy.Symbol)):
        return True
    return isinstance(expr, tuple(_size_ops())) and all(_emittable(a) for a in expr.args)


def _emit_size(graph: fx.Graph, expr: Any, sizes: dict) -> Any:
    """Nodes of `graph` computing `expr` from the size nodes `sizes` (one per symbol)."""
    import sympy

    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        return sizes[expr]
    fn = next(f for t, f in _size_ops().items() if isinstance(expr, t))
    args = [_emit_size(graph, a, sizes) for a in expr.args]
    out = args[0]
    for a in args[1:]:
        out = graph.call_function(fn, (out, a))
    return out


class _Source:
    """What every node of the exported graph is: parameter, buffer, input, shape-only, or in which segment."""

    def __init__(self, ep: Any, g: Any):
        self.ep, self.gm = ep, ep.graph_module
        canonical = {a: p.name for p in g.params for a in (p.name, *p.aliases)}
        self.param: dict[fx.Node, str] = {}
        # parameters that train nothing (requires_grad=False: RoFormer's sinusoidal position table), read like buffers
        self.frozen: set[fx.Node] = set()
        frozen = set(g.frozen_params)
        self.buffer: dict[fx.Node, str] = {}
        self.const: dict[fx.Node, tuple[str, Any]] = {}
        self.inputs: list[fx.Node] = []
        by_name = {n.name: n for n in self.gm.graph.nodes}
        for spec in ep.graph_signature.input_specs:
            node = by_name[spec.arg.name]
            kind = spec.kind.name
            if kind == "PARAMETER":
                self.param[node] = canonical.get(spec.target, spec.target)
                if self.param[node] in frozen:
                    self.frozen.add(node)
            elif kind == "BUFFER":
                self.buffer[node] = spec.target
            elif kind == "CONSTANT_TENSOR":  # a tensor made inside forward (torch.tensor([-1])), lifted by export
                self.const[node] = (spec.target, ep.constants.get(spec.target))
            elif kind == "USER_INPUT" and not isinstance(node.meta.get("val"), torch.Tensor):
                # a non-tensor argument of the traced call (use_cache=False): export specialised the graph on
                # its value, so nothing reads it and the stage code takes no such input
                if node.users:
                    raise SegmentError(f"input {spec.arg.name} is not a tensor ({node.meta.get('val')!r}) and the "
                                       "graph reads it: stage code takes tensors only; pass it as a tensor, or "
                                       "leave it out of the traced call")
            elif kind == "USER_INPUT":
                self.inputs.append(node)
            else:
                raise SegmentError(f"input {spec.arg.name} of kind {kind} is not supported in stage code")
        # buffers the graph never writes: a mask made from one runs the fused kernel's causal path where causal
        self.unwritten = frozenset(n for n in unwritten_buffers(ep) if n in self.buffer)
        self.stack = g.block_container
        self.shape_only: dict[fx.Node, bool] = {}
        self.input_only = self._input_only()
        self.segment: dict[fx.Node, Any] = {}  # "prefix" | block index | "suffix"
        seen_block = False
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                self.shape_only[n] = n in self.buffer or n in self.const
            elif n.op == "get_attr":  # a nested graph of a higher-order op (a no_grad or autocast region)
                self.shape_only[n] = True
                if not isinstance(getattr(self.gm, n.target), fx.GraphModule):
                    raise SegmentError(f"the graph reads attribute {n.target!r}, which is not a nested graph: "
                                       "stage code cannot hold it")
            elif n.op == "call_function":
                self.shape_only[n] = n.target is _aten.sym_size.int or \
                    all(self.shape_only[a] for a in n.all_input_nodes) or size_expression(n) is not None
                writes = mutates(n) or bool(nested_written(n, self.gm))
                if (self.shape_only[n] and not writes) or not (n.users or writes):
                    # an in-place write into a tensor (x[:, :k] = y) has no users and must stay; one into a buffer
                    # from buffers alone (BatchNorm's num_batches_tracked += 1) too, where its module runs; and a
                    # no_grad region that writes a buffer (a running statistic), which returns nothing
                    continue
                b = block_index(self._path(n), self.stack) if self.stack is not None else None
                if b is not None:
                    seen_block = True
                    self.segment[n] = b
                else:
                    self.segment[n] = "suffix" if seen_block else "prefix"
        # ops the layer loop runs for one block alone (Gemma 4's per_layer_inputs[:, :, i, :]) run in that block
        self.glue = find_glue(list(self.gm.graph.nodes), self.segment, self.input_only,
                              g.blocks[-1].index + 1 if g.blocks else 0, self.stack) if self.stack is not None else NONE
        self.segment.update(self.glue.owner)
        self.output = next(n for n in self.gm.graph.nodes if n.op == "output")
        # what the prefix hands on, when it is made from the inputs alone (an MLP's flattened input), is the hidden
        # state itself: handed on as it is, not computed again
        pre = set(self.members("prefix"))
        handed = {m for m in pre for u in m.users if u not in pre and (u.op == "output" or u in self.segment)}
        if len(handed) == 1 and all(m in self.input_only for m in handed):
            del self.input_only[next(iter(handed))]

    def _input_only(self) -> dict[fx.Node, bool]:
        """The values computed from the model's inputs, buffers, constants, frozen parameters and shapes alone (an
        attention mask made from the padding mask, shifted labels, RoFormer's sinusoidal table from its frozen
        embedding), which read no trainable parameter and no hidden state: like the
        shape-only ones, every other segment that reads one computes it again from the model inputs it takes
        (each stage has them), so only the hidden state crosses a cut (`crossing`). Not a value made from one
        the graph writes in place (a reader would recompute it without the write): a written tensor, the bases
        it views, and what is computed from them are not recomputed. A write that changes no value (XLM's
        `detach_` of a constant it made) counts for nothing; a written hidden state leaves the rest alone."""
        inputs = set(self.inputs)
        tainted = with_bases(a for n in self.gm.graph.nodes
                             if n.op == "call_function" and n.target not in _METADATA_WRITES
                             for a in (*written(n), *nested_written(n, self.gm)))
        only: dict[fx.Node, bool] = {}
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                only[n] = (n in inputs or n in self.buffer or n in self.const or n in self.frozen) and n not in tainted
            elif n.op == "get_attr":
                only[n] = True
            elif n.op == "call_function":
                only[n] = n not in tainted and all(only.get(a, False) for a in n.all_input_nodes)
        return {n: v for n, v in only.items() if v and n.op == "call_function"}

    @staticmethod
    def _path(n: fx.Node) -> str:
        stack = n.meta.get("nn_module_stack") or {}
        return list(stack.values())[-1][0] if stack else ""

    def members(self, seg: Any) -> list[fx.Node]:
        return [n for n, s in self.segment.items() if s == seg]

    def crossing(self, members: list[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
        """(outside values the members read, member values read outside), shape-only values excluded."""
        inside = set(members)
        reads = {a for m in members for a in m.all_input_nodes
                 if a not in inside and a.op != "placeholder" and not self.shape_only[a] and a not in self.input_only}
        out = {m for m in members for u in m.users if u not in inside and (u.op == "output" or u in self.segment)
               and m not in self.input_only}  # a value made from the inputs alone is computed again by its reader
        return reads, out


class _Builder(TensorParallelRewrite, ContextParallelRewrite, ExpertParallelRewrite):
    """Copies one segment's nodes into a fresh graph, recomputing shape-only values from its input."""

    def __init__(self, src: _Source, name: str, *, carried: fx.Node | None, block: int | None,
                 placements: dict[str, Any], dims: dict[str, int], chunks: dict[str, list[tuple[str, int]]],
                 tp: int, seq_dims: dict[str, int], scatters: dict[str, int],
                 seq_gathers: dict[str, list[tuple[str, int, str]]], seq_reduces: dict[str, list[str]],
                 fp8: bool = False, cp: int = 1,
                 seq_syms: frozenset[str] = frozenset(), ep: int = 1, moe: tuple[tuple[str, str, int], ...] = (),
                 routed: bool = False, side: tuple[tuple[fx.Node, str], ...] = ()):
        # side: values besides the hidden state this segment reads across its cut, and the argument named for
        # each (`_Carry`)
        self.src, self.name, self.carried, self.block = src, name, carried, block
        self.outputs: tuple[str, ...] = ()
        self.fp8 = fp8
        self.placements, self.dims, self.chunks, self.tp = placements, dims, chunks, tp
        self.seq_dims, self.scatters, self.seq_gathers, self.seq_reduces = seq_dims, scatters, seq_gathers, seq_reduces
        self.cut_dim: int | None = None  # under sequence parallelism: the token dim the carried input is split on
        self.seq_gathered: dict[tuple[fx.Node, str], fx.Node] = {}  # sp_gather / tp_gather per value and kind
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.params: dict[str, str] = {}
        self.buffers: dict[str, str] = {}
        self.copies: dict[fx.Node, fx.Node] = {}  # tp_copy per activation (one f per region input)
        self.param_copies: dict[fx.Node, fx.Node] = {}  # tp_copy per replicated parameter used on split values
        self.operand_chunks: dict[tuple[fx.Node, int], fx.Node] = {}  # tp_chunk per replicated operand and dim
        self.tp_arg = self.graph.placeholder("tp")
        # context parallelism (partitioner.codegen.segment_cp): the cp group, the sequence's size symbol, and
        # the whole-length and this-rank copies of shape-only values
        self.cp, self.seq_syms = cp, seq_syms
        self.cp_arg = self.graph.placeholder("cp") if cp > 1 else None
        self.full_env: dict[fx.Node, Any] = {}
        self.pos_env: dict[fx.Node, fx.Node] = {}
        # expert parallelism (partitioner.codegen.segment_ep): the ep group, the MoE layers' (module, experts
        # module), the experts regions found, the block's router logits and the suffix's reads of them. The ep
        # context is an argument under ep > 1, and (`routed`) wherever the model hands its routers' logits to
        # the suffix (the load-balancing loss), ep = 1 included
        self.ep, self.moe = ep, moe
        self.expert_scopes = tuple(x for _, x, _ in moe)
        self.ep_arg = self.graph.placeholder("ep") if ep > 1 or routed else None
        self.regions: dict[str, Any] = {}
        self.router_out: fx.Node | None = None
        self.router_values: list[fx.Node] = []
        self.aux_nodes: dict[fx.Node, bool] = {}
        if carried is None:
            self.input_names = tuple(n.name for n in src.inputs)
            for n in src.inputs:
                self.env[n] = self.graph.placeholder(n.name)
                self.env[n].meta = dict(n.meta)
        else:
            self.input_names = ("x", *(name for _, name in side))
            for node, name in ((carried, "x"), *side):
                self.env[node] = self.graph.placeholder(name)
                self.env[node].meta = dict(node.meta)
        self.model_inputs: list[str] = []  # model inputs a block or the suffix reads (every stage has them)
        self.block_index: fx.Node | None = None  # a block's own index, where the layer loop's ops read it
        self.dtype: fx.Node | None = None  # the parameters' dtype at run time, read from dtype_param
        self.dtype_param: fx.Node | None = None
        self._device: fx.Node | None = None  # the device of this segment's input at run time

    def _relative(self, name: str) -> str:
        if self.block is None:
            return name
        head = f"{self.src.stack}.{self.block}." if self.src.stack else f"{self.block}."
        return name.removeprefix(head)

    def _arg(self, n: fx.Node, full: str, table: dict[str, str]) -> fx.Node:
        rel = self._relative(full)
        arg = _argname(rel)
        if arg not in table:
            template = (f"{self.src.stack}.{{i}}.{rel}" if self.src.stack else f"{{i}}.{rel}") \
                if rel != full else full
            table[arg] = template
            self.env[n] = node = self.graph.placeholder(arg)
            node.meta = dict(n.meta)
        return self.env[n]

    def value(self, n: fx.Node) -> fx.Node:
        if n in self.env:
            return self.env[n]
        if n in self.router_values:  # ep > 1: a block's router logits, as this rank recorded them
            self.env[n] = self.router_logits_node(n)
            return self.env[n]
        if self.positional(n):  # cp > 1: a position-only tensor, at this rank's positions
            return self.at_positions(n)
        if n in self.src.param:
            return self._arg(n, self.src.param[n], self.params)
        if n in self.src.const and CONSTANTS_IN_CODE:
            self.env[n] = self._constant(*self.src.const[n])
            return self.env[n]
        if n in self.src.const:
            return self._arg(n, self.src.const[n][0], self.buffers)
        if n in self.src.buffer:
            return self._arg(n, self.src.buffer[n], self.buffers)
        if n in self.src.inputs:  # a model input read after the prefix (labels, an attention mask)
            self.env[n] = node = self.graph.placeholder(f"input_{n.name}")
            node.meta = dict(n.meta)
            self.model_inputs.append(n.name)
            return node
        if not (self.src.shape_only.get(n, False) or n in self.src.input_only):
            raise SegmentError(f"the {self.name} reads {describe(n)}, computed outside it: only the hidden state "
                               "may cross a stage boundary (plus values computed from shapes and inputs alone)"
                               f"{_returned_by_the_model([n])}")
        if n.target is _aten.sym_size.int and n.args[0] not in self.env and self.carried is not None:
            # a batch or sequence size read from a tensor this segment does not have: read it from its input
            want = str(n.meta.get("val"))
            size = self._carried_size(want, meta=n.meta)
            if size is None:
                raise SegmentError(f"the {self.name} needs size {want} ({n.name}), which its input "
                                   f"{self.carried.name} of shape {tuple(self.carried.meta['val'].shape)} does not "
                                   "carry")
            self.env[n] = size
            return size
        expr = size_expression(n)
        if expr is not None and not all(self.src.shape_only[a] for a in n.all_input_nodes):
            # a size a region computed besides tensors (min(tokens, top-k) from a no_grad indexer), which export
            # hands to every later op that needs it, later blocks too: computed here from the input's sizes
            sizes = {sym: self._input_size(str(sym), n) for sym in expr.free_symbols}
            self.env[n] = _emit_size(self.graph, expr, sizes)
            return self.env[n]
        cast = n.target in _CASTS and self._to_param_dtype(n)
        self.env[n] = self._copy_plain(n)
        if cast:
            self._retarget(self.env[n])
        return self.env[n]

    def _carried_size(self, want: str, meta: dict | None = None) -> fx.Node | None:
        """Size `want` (a symbol's name) read off this segment's input, the whole size where the input holds 1/tp
        of the tokens; None where the input has no such dim."""
        shape = self.carried.meta["val"].shape
        dims = [j for j, s in enumerate(shape) if str(s) == want]
        if not dims:
            return None
        size = self.graph.call_function(_aten.sym_size.int, (self.env[self.carried], dims[0]))
        if meta is not None:
            size.meta = dict(meta)
        if self.cut_dim == dims[0]:
            size = self.graph.call_function(operator.mul, (size, self.tp))
        return size

    def _input_size(self, want: str, reader: fx.Node) -> fx.Node:
        """Size `want` (a symbol's name) read off this segment's input, or off a model input where it has none."""
        size = self._carried_size(want) if self.carried is not None else None
        if size is not None:
            return size
        for x in self.src.inputs:
            dims = [j for j, s in enumerate(x.meta["val"].shape) if str(s) == want]
            if dims:
                return self.graph.call_function(_aten.sym_size.int, (self.value(x), dims[0]))
        raise SegmentError(f"the {self.name} needs size {want} for {describe(reader)}, which neither its input nor "
                           "a model input carries")

    def _copy_plain(self, n: fx.Node, lookup: Any = None) -> Any:
        """node_copy, except: a higher-order op's nested graph is inlined (its value: a tuple of nodes),
        and an item of such a tuple is that node. `lookup` maps an argument to its copy (`value`; under
        context parallelism `full` for values at the whole sequence length)."""
        lookup = self.value if lookup is None else lookup
        if n.target is operator.getitem and isinstance(lookup(n.args[0]), tuple):
            return lookup(n.args[0])[n.args[1]]
        sub = next((i for i, a in enumerate(n.args) if isinstance(a, fx.Node) and a.op == "get_attr"), None)
        if sub is None:
            return self._device_neutral(self.graph.node_copy(n, lookup))
        # wrap_with_set_grad_enabled / wrap_with_autocast: (flags..., graph, *inputs). Inlined, the region runs
        # in the caller's grad and autocast mode: the same values wherever (as here) it computes from shapes
        # and buffers, which need no gradient, and no autocast runs around generated code.
        split = [a.name for a in n.args[sub + 1:] if isinstance(a, fx.Node) and a.name in self.seq_dims]
        if split:
            # its ops run inlined on this rank's tokens while the sizes they read are the whole sequence's
            raise SegmentError(f"sequence parallelism: the {self.name} runs a nested region ({describe(n)}) on "
                               f"{', '.join(split)}, split along the tokens over the tensor group, which the "
                               "sequence split does not follow into it; pin sp=False")
        nested = getattr(self.src.gm, n.args[sub].target)
        env: dict[fx.Node, Any] = {}
        holes = [x for x in nested.graph.nodes if x.op == "placeholder"]
        # a no_grad region that reads a hidden state (a running statistic of it, written into a buffer) reads it
        # detached: nothing it computes, or writes, joins autograd's graph, as under torch.no_grad()
        no_grad = "set_grad_enabled" in str(n.target) and n.args[0] is False
        for ph, a in zip(holes, n.args[sub + 1:]):
            env[ph] = lookup(a) if isinstance(a, fx.Node) else a
            if no_grad and isinstance(env[ph], fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):  # not a size
                env[ph] = self.graph.call_function(_aten.detach.default, (env[ph],))
                env[ph].meta = dict(a.meta)
        out: Any = ()
        for x in nested.graph.nodes:
            if x.op == "call_function" and (x.users or mutates(x)):  # a write into a buffer has no users
                env[x] = self._device_neutral(self.graph.node_copy(x, lambda y: env[y]))
            elif x.op == "output":
                out = tuple(env[o] if isinstance(o, fx.Node) else o for o in x.args[0])
        return out

    def _device_neutral(self, new: fx.Node) -> fx.Node:
        """Replace the device the trace ran on (meta, cpu) in a copied node's arguments (a factory's
        `device=`, `aten.to.device`) by the device of the segment's input at run time: code compiled on
        meta or CPU must put its positions, masks and tables where its activations are."""
        if not DEVICE_NEUTRAL or not any(isinstance(a, torch.device) for a in pytree.tree_leaves((new.args, new.kwargs))):
            return new
        dev = self._device_node()
        swap = lambda a: dev if isinstance(a, torch.device) else a  # noqa: E731
        new.args = pytree.tree_map(swap, new.args)
        new.kwargs = pytree.tree_map(swap, new.kwargs)
        return new

    def _device_node(self) -> fx.Node:
        """`<input>.device`: the device the segment runs on, read from its input at run time."""
        if self._device is None:
            anchor = self.env[self.carried] if self.carried is not None else \
                next((self.env[n] for n in self.src.inputs if isinstance(n.meta.get("val"), torch.Tensor)), None)
            if anchor is None:
                raise SegmentError(f"the {self.name} creates tensors on a device but has no tensor input to take "
                                   "the device from")
            with self.graph.inserting_after(anchor):
                self._device = self.graph.call_function(getattr, (anchor, "device"))
        return self._device

    def _constant(self, target: str, value: Any) -> fx.Node:
        """A tensor the forward made itself (lifted by export): written into the code as a literal on the
        segment's device. Looking it up on the user's module by its exported name would fail (it is no
        attribute of the module), and a large one does not belong in generated source."""
        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            raise SegmentError(f"the {self.name} reads {target}, a tensor its forward makes on the activations' "
                               "device (e.g. by indexing with a Python list, x[..., [-2], :]); traced on the meta "
                               "device its value is unknown, so stage code cannot carry it: compile from the model "
                               "built on CPU, or pin pp=1 and tp=1 (data-parallel plans do not need stage code)")
        if value.numel() > _MAX_CONSTANT:
            raise SegmentError(f"the {self.name} reads {target}, a tensor of {value.numel()} elements made inside "
                               f"forward; stage code carries such constants only up to {_MAX_CONSTANT} elements: "
                               "register it as a buffer of its module (register_buffer) instead")
        node = self.graph.call_function(torch.tensor, (value.tolist(),),
                                        {"dtype": value.dtype, "device": self._device_node()})
        node.meta = {"val": value}
        return node

    def copy(self, n: fx.Node) -> None:
        """Copy member `n` into the segment: in its tensor-parallel form, or plain (casts retargeted,
        sizes on split dims divided by tp)."""
        indexed = self.src.glue.indexed.get(n, ()) if self.block is not None else ()
        if self.rewrite_ep(n) or self.rewrite_op(n) or self.rewrite_cp(n):
            if indexed:
                raise SegmentError(f"the {self.name} rewrites {describe(n)}, which takes the block's index, for its "
                                   "parallel plan; pin pp=1, tp=1")
            return
        if indexed and self.block_index is None:  # the layer loop's index (segment_glue): each block passes its own
            self.block_index = self.graph.placeholder("block_index")
        cast = n.target in _CASTS and self._to_param_dtype(n)
        new = self._copy_plain(n)
        if not isinstance(new, fx.Node):  # an inlined nested graph, or an item of one
            self.env[n] = new
            return
        if indexed:
            new.args = tuple(self.block_index if k in indexed else a for k, a in enumerate(new.args))
        if shape_mask(n, self.src.unwritten):  # the fused kernel's causal path where the mask is causal
            new.target = shape_mask_attention
            key = shape_mask_key(attention_mask(n), self.src.unwritten)
            sources = tuple(self.value(b) for b in mask_sources(n, self.src.unwritten))
            new.kwargs = {**new.kwargs, "site": f"{self.name}: {n.name} {key}",
                          **({"sources": sources} if sources else {})}
        if cast:
            self._retarget(new)
        self.resize(n, new)
        self.whole_lengths(n, new)
        self.sum_replicated_grads(n, new)
        self.chunk_replicated_operands(n, new)
        self.gather_sequence(n, new)
        self.reduce_broadcast_operands(n, new)
        self.fork_random(n, new)
        self.env[n] = new

    def _retarget(self, new: fx.Node) -> None:
        """Make cast `new` convert to the parameters' dtype as the code runs (`self.dtype`)."""
        if "dtype" in new.kwargs:
            new.kwargs = {**new.kwargs, "dtype": self.dtype}
        else:
            new.args = (new.args[0], self.dtype, *new.args[2:])

    def _to_param_dtype(self, n: fx.Node) -> bool:
        """Whether `n` casts to the traced parameter dtype (fp32; e.g. HF's `.to(inputs_embeds.dtype)`): that
        is a cast to whatever dtype the parameters have when the code runs (bf16 under mixed precision),
        so it is rewritten to read it (`self.dtype`, made here, before the cast's copy)."""
        traced = next(iter(self.src.param), None)
        want = cast_dtype(n)
        src = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        if traced is None or self.dtype_param is None or want != traced.meta["val"].dtype or \
                not isinstance(src, torch.Tensor) or not src.is_floating_point():
            return False  # integer positions cast to float stay fp32
        if is_upcast(n):
            return False  # the model's own upcast (a norm's statistics in fp32): tracer.upcasts
        if self.dtype is None:
            self.dtype = self.graph.call_function(getattr, (self.value(self.dtype_param), "dtype"))
        return True

    def finish(self, outputs: Any) -> Segment:
        self.graph.output(outputs)
        self.graph.eliminate_dead_code()
        if self.fp8:  # fp8-mixed: the linears' GEMMs take float8 operands (runtime.engines.fp8)
            for n in self.graph.nodes:
                if n.target is _aten.linear.default:
                    n.target = fp8_linear
        code = self.graph.python_code(root_module="self")
        src, globs = unmangle(code.src, dict(code.globals))
        _check_globals(globs, self.name)
        src = _annotate(src, self._shard_shapes())
        src = src.replace("def forward(self, ", f"def {self.name}(", 1).strip() + "\n"
        return Segment(name=self.name, source=src, inputs=self.input_names, model_inputs=tuple(self.model_inputs),
                       params=tuple(self.params.items()), buffers=tuple(self.buffers.items()), outputs=self.outputs,
                       indexed=self.block_index is not None)

    def _shard_shapes(self) -> dict[str, str]:
        """Each value's shape on this rank, as the fx printer's verbose form writes it ("f32[b, s, 192]"):
        the traced shape with the split dim divided by tp, sizes that follow the inputs named by them."""
        sizes = {str(d): f"{n.name}.{j}" for n in reversed(self.src.inputs)
                 for j, d in enumerate(n.meta["val"].shape)}
        out = {}
        whole = {v for v in self.full_env.values() if isinstance(v, fx.Node)}  # cp: at the whole sequence length
        for node in self.graph.nodes:
            val = node.meta.get("val")
            if node.op != "call_function":
                continue
            if not isinstance(val, torch.Tensor):
                # the tensor-parallel f and g (identity forward or backward) have their input's shape
                x = node.args[0] if node.args else None
                if getattr(node.target, "__name__", "") in _SAME_SHAPE and isinstance(x, fx.Node) and x.name in out:
                    out[node.name] = out[x.name]
                continue
            split = self.dims.get(node.name, self.seq_dims.get(node.name)) if self.tp > 1 else None
            dims = [_SYMBOL.sub(lambda m: sizes.get(m.group(0), m.group(0)), str(d))
                    + (f"*{self.cp}" if node in whole and str(d) in self.seq_syms else "") for d in val.shape]
            if split is not None and dims[split].isdigit():
                dims[split] = str(int(dims[split]) // self.tp)
            elif split is not None:  # a token dim of a traced size: this rank's share of it
                dims[split] = f"{dims[split]}/{self.tp}"
            out[node.name] = f"{_DTYPE_SHORT.get(val.dtype, str(val.dtype).removeprefix('torch.'))}[{', '.join(dims)}]"
        return out


_DTYPE_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
                torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.uint8: "u8", torch.int8: "i8"}
_SAME_SHAPE = ("tp_copy", "tp_reduce")
_SYMBOL = re.compile(r"\bs\d+\b")  # torch.export's size symbols (s0, s75, ...)
_ASSIGN = re.compile(r"^(    )([A-Za-z_]\w*) = ")


def _annotate(src: str, shapes: dict[str, str]) -> str:
    """Write each value's shape beside its name, as fx's verbose printer does (`x: "f32[4, 64]" = ...`)."""
    def one(line: str) -> str:
        m = _ASSIGN.match(line)
        if not m or m.group(2) not in shapes:
            return line
        return f'{m.group(1)}{m.group(2)}: "{shapes[m.group(2)]}" = {line[m.end():]}'
    return "\n".join(one(line) for line in src.split("\n"))


_MAX_CONSTANT = 256  # elements of a forward-made constant written into generated code

# Tests switch these off, one at a time, to check that plan.verify catches the fault each prevents:
# one template for blocks of different kinds, factories on the trace's device, constants looked up
# on the user's module by their exported name.
TEMPLATE_PER_KIND = True
DEVICE_NEUTRAL = True
CONSTANTS_IN_CODE = True

_KNOWN_GLOBALS = {"torch", "device", "inf", "nan", "fx_pytree", "pytree", "NoneType", "getattr", *RUNTIME_FUNCTIONS,
                  *CP_FUNCTIONS, *EP_FUNCTIONS, *ATTENTION_FUNCTIONS}


def _check_globals(globs: dict[str, Any], name: str) -> None:
    unknown = sorted(k for k in globs if k not in _KNOWN_GLOBALS)
    if unknown:
        raise SegmentError(f"the {name} code calls {unknown}, which a generated program cannot import; "
                           "the graph holds a non-ATen call")


def _returned_by_the_model(values) -> str:
    """Why a block hands on more than one value, where some are the model's outputs themselves: it returns a value
    from inside every block (each block's hidden state or attention weights)."""
    returned = sorted(v.name for v in values if any(u.op == "output" for u in v.users))
    if not returned:
        return ""
    return (f" ({', '.join(returned)} {'is' if len(returned) == 1 else 'are'} returned by the model itself: it returns "
            "a value from inside every block, as a Hugging Face model whose config sets output_hidden_states or "
            "output_attentions does; set them False for training, or train with data parallelism and ZeRO alone, "
            "where the module runs its own forward)")


def extract(ep: Any, g: Any, *, splits: Any = None, tp: int = 1, sp: bool = False, fp8: bool = False,
            cp: int = 1, expert_parallel: int = 1) -> ModelCode:
    """Cut `ep` (the ExportedProgram `trace` captured for OpGraph `g`) into prefix, block, suffix code;
    `sp`: with Megatron sequence parallelism in the tensor group (tp > 1); `fp8`: every `aten.linear` (the
    model's and the tensor-parallel rewrite's) becomes the runtime's `fp8_linear` (precision="fp8-mixed");
    `cp`: each rank runs its tokens of every sequence, attention over the context group
    (`partitioner.codegen.segment_cp`); `expert_parallel`: each MoE layer's experts over the ep group
    (`partitioner.codegen.segment_ep`)."""
    import torch.utils._pytree as pytree

    functions = getattr(g, "custom_functions", ())
    if functions:
        raise SegmentError(
            f"the model's forward applies {', '.join(functions[:3])}"
            f"{f' and {len(functions) - 3} more' if len(functions) > 3 else ''}: a torch.autograd.Function with "
            "its own backward, which the trace does not hold (torch.export keeps its forward's ops), so stage "
            "code would differentiate those ops instead (a straight-through estimator's gradient would be "
            "zero) and train differently from one process; plans that run the module's own forward (data "
            "parallelism and ZeRO, pp = tp = cp = ep = 1) keep the Function")
    src = _Source(ep, g)
    placements = {p.param: p for p in splits.placements} if splits is not None else {}
    dims = dict(splits.shard_dims) if splits is not None else {}
    exported = _exported_operand(src, g)
    chunks: dict[str, list[tuple[str, int]]] = {}
    for node, operand, dim in (splits.chunks if splits is not None else ()):
        chunks.setdefault(node, []).append((exported(node, operand), dim))
    if tp > 1 and splits is None:
        raise SegmentError("tp > 1 needs the tensor splits (partitioner.planner.tensor_split.find_splits)")
    sp = sp and tp > 1
    seq = splits.sequence if sp else None
    seq_gathers: dict[str, list[tuple[str, int, str]]] = {}
    for node, operand, dim, kind in (seq.gathers if seq else ()):
        seq_gathers.setdefault(node, []).append((exported(node, operand), dim, kind))
    for node, operand, dim in (seq.chunks if seq else ()):
        chunks.setdefault(node, []).append((exported(node, operand), dim))
    seq_reduces: dict[str, list[str]] = {}
    for node, operand in (seq.reduces if seq else ()):
        seq_reduces.setdefault(node, []).append(exported(node, operand))
    spec = pytree.treespec_dumps(ep.call_spec.out_spec)
    flat_out = src.output.args[0]
    blocks = sorted({s for s in src.segment.values() if isinstance(s, int)})
    kw = dict(placements=placements, dims=dims, chunks=chunks, tp=tp,
              seq_dims=dict(seq.dims) if seq else {}, scatters=dict(seq.scatters) if seq else {},
              seq_gathers=seq_gathers, seq_reduces=seq_reduces, fp8=fp8, cp=cp,
              seq_syms=sequence_symbols(src.inputs) if cp > 1 else frozenset(),
              ep=expert_parallel, moe=_moe_scopes(g))

    def run(b: _Builder, members: list[fx.Node]) -> None:
        members = sorted(members, key=_order(src))
        b.dtype_param = next((a for m in members for a in m.all_input_nodes
                              if a in src.param and a.meta["val"].is_floating_point()), None)
        for m in members:
            b.copy(m)

    if not blocks:
        b = _Builder(src, "prefix", carried=None, block=None, **kw)
        run(b, src.members("prefix") + src.members("suffix"))
        prefix = b.finish(tuple(b.output(x) for x in flat_out))
        return ModelCode(stack=None, num_blocks=0, tp=tp, prefix=prefix, block=None, suffix=None, output_spec=spec,
                         exact_casts=casts_known(ep.graph), seq_lengths=getattr(g, "seq_lengths", None))

    # prefix -> block 0: one tensor
    # the suffix reads the MoE layers' router logits (a load-balancing loss): they reach it through the ep
    # context, at any ep (partitioner.codegen.segment_ep)
    kw["routed"] = expert_parallel > 1 or _suffix_reads_routers(src, kw["moe"])
    kinds = tuple(b.kind for b in g.blocks) if g.blocks else ()
    kinds = kinds if len(set(kinds)) > 1 and TEMPLATE_PER_KIND else ()
    # more than the hidden state crosses the cuts (segment_carry): None where it alone does
    carried = carry(src, blocks, kinds, lambda values: _router_outs(values, kw["moe"]), src.stack)
    if carried is not None and cp > 1:
        raise SegmentError(f"context parallelism: besides the hidden state, {carried.side_names()} cross the cuts of "
                           f"{src.stack}, which the token split over the context group does not follow yet; pin cp=1")
    pre = src.members("prefix")
    reads, outs = src.crossing(pre)
    if carried is not None:
        outs = {carried.prefix_writes[0][0]}
    if not outs:
        # nothing before the blocks (a stack of residual blocks at the model's root): the prefix hands on the
        # model input the first block reads, as it is
        outs = _first_block_input(src, blocks[0])
    if len(outs) != 1:
        raise SegmentError(f"the prefix (before {src.stack}) hands {len(outs)} values to what follows "
                           f"({', '.join(sorted(o.name for o in outs))}); a pipeline cut passes exactly one tensor")
    hidden = next(iter(outs))
    b = _Builder(src, "prefix", carried=None, block=None, **kw)
    run(b, pre)
    template = blocks[1] if len(blocks) > 1 else blocks[0]
    template_reads = {carried.hidden(template)[0]} if carried is not None else src.crossing(src.members(template))[0]
    cut_dim = _sequence_cut_dim(kw["seq_dims"], template_reads) if seq else None
    if carried is not None and seq:
        carried.check_token_split(kw["seq_dims"], cut_dim)
    out = b.value(hidden)
    if cut_dim is not None and hidden.name not in kw["seq_dims"]:
        # the blocks take 1/tp of the tokens at every cut; the prefix's hidden state, whole when no
        # all-reduce made it (a replicated embedding), hands on this rank's slice
        out = b.graph.create_node("call_function", tp_chunk, (out, cut_dim, b.tp_arg), name=f"{hidden.name}_slice")
    if carried is not None:
        out = _returning(b, carried.prefix_writes, hidden=out)
    prefix = b.finish(out)

    # one template per kind of block (partitioner.tracer.block_kinds): its second traced block when there is
    # one (the tracer may lower the first block differently), else its first
    templates: list[Segment] = []
    cuts: list[fx.Node] = [hidden]
    for k in sorted(set(kinds)) if kinds else [0]:
        of_kind = [b for b in blocks if (kinds[b] if kinds else 0) == k]
        if not of_kind:
            raise SegmentError(f"no traced block of kind {k} in {src.stack}: trace the model with every block")
        t = of_kind[1] if len(of_kind) > 1 else of_kind[0]
        members = src.members(t)
        reads, outs = src.crossing(members)
        router = _router_outs(outs, kw["moe"])
        outs = outs - router
        if carried is not None:
            reads, outs = {carried.hidden(t)[0]}, {carried.hidden(t)[1]}
        if len(reads) != 1 or len(outs) != 1 or len(router) > 1:
            raise SegmentError(f"block {t} of {src.stack} reads {sorted(r.name for r in reads)} and hands on "
                               f"{sorted(o.name for o in outs)} across its boundary; a pipeline cut passes exactly "
                               f"one tensor{_returned_by_the_model(outs)}")
        (x_in,), (x_out,) = reads, outs
        if seq and (kw["seq_dims"].get(x_in.name) != cut_dim or kw["seq_dims"].get(x_out.name) != cut_dim):
            raise SegmentError(f"sequence parallelism: block {t} of {src.stack} takes {x_in.name} and hands on "
                               f"{x_out.name}, not both split along the same token dim; pin sp=False")
        side = carried.reads[t][1:] if carried is not None else ()
        b = _Builder(src, "block" if k == 0 else f"block_{k}", carried=x_in, block=t, side=side, **kw)
        b.cut_dim = cut_dim
        b.router_out = next(iter(router), None)
        run(b, members)
        b.record_router_logits()
        templates.append(b.finish(_returning(b, carried.writes[t]) if carried is not None else b.value(x_out)))
        cuts += [x_in, x_out]

    last = src.members(blocks[-1])
    _, last_outs = src.crossing(last)
    (last_out, *more) = last_outs - _router_outs(last_outs, kw["moe"])
    if carried is not None:
        last_out, more = carried.hidden("suffix")[0], []
    if more:
        raise SegmentError(f"the last block hands {1 + len(more)} values to the suffix; a pipeline cut passes one")
    suf = src.members("suffix")
    reads, _ = src.crossing(suf)
    routers = sorted(_router_outs(reads, kw["moe"]), key=_order(src))
    side = carried.suffix_reads[1:] if carried is not None else ()
    if reads - {last_out} - set(routers) - {v for v, _ in side}:
        raise SegmentError(f"the suffix reads {sorted(r.name for r in reads - {last_out})} besides the last block's "
                           "output; a pipeline cut passes exactly one tensor")
    b = _Builder(src, "suffix", carried=last_out, block=None, side=side, **kw)
    b.cut_dim = cut_dim
    b.router_values = routers
    b.mark_aux(suf)
    run(b, suf)
    suffix = b.finish(tuple(b.output(x) for x in flat_out))
    # more than one value crossing: each cut's message says its shapes (runtime.pipeline.carry)
    hidden_shape = _hidden_shape(src, *cuts) if carried is None else None
    if hidden_shape is not None and cut_dim is not None:  # each rank sends and receives its 1/tp of the tokens
        d = hidden_shape[cut_dim]
        hidden_shape = (*hidden_shape[:cut_dim], d // tp if isinstance(d, int) else (*d, tp),
                        *hidden_shape[cut_dim + 1:])
    return ModelCode(stack=src.stack, num_blocks=g.blocks[-1].index + 1 if g.blocks else len(blocks), tp=tp,
                     prefix=prefix, block=templates[0], suffix=suffix, output_spec=spec, sp_dim=cut_dim,
                     hidden_shape=hidden_shape, other_blocks=tuple(templates[1:]), block_kinds=kinds,
                     frozen=tuple(sorted(src.param[n] for n in src.frozen)), exact_casts=casts_known(ep.graph),
                     seq_lengths=getattr(g, "seq_lengths", None), **(_expert_fields(g) if kw["routed"] else {}))


def _exported_operand(src: _Source, g: Any) -> Any:
    """operand name -> the name the exported graph gives it, as read by node `node`. The splits name what the
    OpGraph's nodes read; past its traced blocks the OpGraph copies them (partitioner.tracer.blocks: `name__k`
    for block k), so a node after the stack reads the last block's copy there, and the last traced block's
    value in the exported graph. Matched in the order the node reads such values."""
    by_name = {n.name: n for n in src.gm.graph.nodes}
    ops = {n.name: n for n in getattr(g, "nodes", ())}

    def exported(node: str, operand: str) -> str:
        if operand in by_name or node not in by_name or node not in ops:
            return operand
        copies = [x for x in dict.fromkeys(ops[node].inputs) if x not in by_name]
        traced = [a.name for a in by_name[node].all_input_nodes if isinstance(src.segment.get(a), int)]
        return dict(zip(copies, traced)).get(operand, operand) if len(copies) == len(traced) else operand
    return exported


def _returning(b: _Builder, slots: tuple[tuple[fx.Node, str], ...], hidden: fx.Node | None = None
               ) -> tuple[fx.Node, ...]:
    """The values a segment returns where more than the hidden state crosses the cuts (segment_carry): each of
    its slots, the hidden state first (`hidden`, where the segment made it to hand on: this rank's tokens of
    it); their names go into `Segment.outputs`."""
    b.outputs = tuple(name for _, name in slots)
    values = [b.value(v) for v, _ in slots]
    return (hidden if hidden is not None else values[0], *values[1:])


def _first_block_input(src: _Source, first: int) -> set[fx.Node]:
    """The model input block `first` reads as its hidden state, when it reads exactly one floating-point input
    (token ids or masks are not a hidden state); else none."""
    read = {a for m in src.members(first) for a in m.all_input_nodes if a in src.inputs}
    floats = {a for a in read if a.meta["val"].is_floating_point()}
    return floats if len(floats) == 1 else set()


def reads_router_logits(ep: Any, g: Any) -> bool:
    """Whether what follows the layer stack of `ep` (the ExportedProgram `trace` captured for OpGraph `g`)
    reads the MoE layers' router logits: the model computes its routers' load-balancing loss (Hugging Face's
    `output_router_logits=True`), a statistic of the batch. False for a dense model, or a graph not cut here."""
    moe = _moe_scopes(g)
    if not moe:
        return False
    try:
        src = _Source(ep, g)
    except SegmentError:
        return False
    return _suffix_reads_routers(src, moe)


def _suffix_reads_routers(src: _Source, moe: tuple[tuple[str, str, int], ...]) -> bool:
    """Whether the suffix reads router logits the MoE layers `moe` compute (partitioner.codegen.segment_ep)."""
    return bool(_router_outs(src.crossing(src.members("suffix"))[0], moe))


def _moe_scopes(g: Any) -> tuple[tuple[str, str, int], ...]:
    """(MoE module, its experts module, E) of each MoE layer the tracer found (partitioner.tracer.experts)."""
    from partitioner.tracer.experts import common_prefix, find_experts

    return tuple((m.module, common_prefix([e.rsplit(".", 1)[0] for e in m.experts]), m.num_experts)
                 for m in find_experts(g))


def _expert_fields(g: Any) -> dict[str, Any]:
    """ModelCode's expert fields: the batched expert weights with their E, the MoE layers, the router's k."""
    from partitioner.tracer.experts import find_experts

    layers = find_experts(g)
    if len({m.top_k for m in layers}) != 1:
        raise SegmentError(f"the MoE layers route to {sorted({m.top_k for m in layers})} experts per token; the "
                           "ep context and the load-balancing loss over ranks take one k: compile with ep=1, and "
                           "without the loss (output_router_logits=False) to train on several ranks")
    return {"experts": tuple((p, m.num_experts) for m in layers for p in m.experts), "moe_layers": len(layers),
            "top_k": layers[0].top_k}


def _router_outs(values: set[fx.Node], moe: tuple[tuple[str, str, int], ...]) -> set[fx.Node]:
    """The values among `values` computed inside a MoE module (outside its experts) of shape
    (tokens, E): the router logits a block hands on for the load-balancing loss (partitioner.codegen.segment_ep)."""
    def logits(v: fx.Node, e: int) -> bool:
        val = v.meta.get("val")
        return isinstance(val, torch.Tensor) and val.dim() == 2 and str(val.shape[1]) == str(e)

    return {v for v in values for m, x, e in moe if in_scope(v, m) and not in_scope(v, x) and logits(v, e)}


def _sequence_cut_dim(seq_dims: dict[str, int], block_inputs: set[fx.Node]) -> int:
    """The token dim of the hidden state at every cut under sequence parallelism."""
    (x,) = block_inputs if len(block_inputs) == 1 else (None,)
    if x is None or x.name not in seq_dims:
        raise SegmentError("sequence parallelism: the blocks' input is not split along the tokens (no row-parallel "
                           "matmul or vocab-parallel embedding ahead of it); pin sp=False")
    return seq_dims[x.name]


def _hidden_shape(src: _Source, *values: fx.Node) -> tuple[int | tuple[str, int], ...] | None:
    """The shape every cut carries, in terms of the model inputs' sizes; None unless all cuts agree."""
    shapes = {tuple(str(d) for d in v.meta["val"].shape) for v in values}
    if len(shapes) != 1:
        return None
    sizes = {str(d): (n.name, j) for n in reversed(src.inputs) for j, d in enumerate(n.meta["val"].shape)}
    out: list[int | tuple[str, int]] = []
    for d in next(iter(shapes)):
        if d.isdigit():
            out.append(int(d))
        elif d in sizes:
            out.append(sizes[d])
        else:
            return None
    return tuple(out)


def _order(src: _Source):
    pos = {n: i for i, n in enumerate(src.gm.graph.nodes)}
    return lambda n: pos[n]

