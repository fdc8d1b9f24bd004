"""Megatron rewriting of segment code for tensor parallelism (tp > 1), as the tensor splits say.

Used by `partitioner.codegen.segments` while it copies a segment's nodes:

- a column-parallel matmul (and a vocab-parallel LM head) reads its input
  through `tp_copy` ("f": identity forward, all-reduce backward), one per
  distinct input;
- a row-parallel matmul drops its bias, all-reduces its partial output
  (`tp_reduce`, "g") and adds the bias after;
- a vocab-parallel embedding becomes `tp_vocab_embedding` (padding_idx kept);
- a cross entropy over vocab-split logits becomes `tp_cross_entropy`: three
  all-reduces of one number per token, never the logits;
- a view, reshape, expand or split of a split tensor has its size on the
  split dim divided by tp (12 heads -> 12/tp; a fused 3*768 qkv split at 768
  -> split at 768/tp);
- a model output split along its last dim by the tensor splits
  (vocab-parallel logits) is returned as this rank's slice, wrapped by
  `tp_vocab_logits` (runtime.pipeline.vocab_logits): the user's loss_fn
  sees the full logits, and its cross entropy runs vocab-parallel on the
  slice, never gathering them, as the plan's memory assumes; any other use
  reads them all-gathered. Any other split output (a token-split one under
  sequence parallelism, a split along another dim) is gathered by
  `tp_gather`;
- a replicated operand that needs no gradient and spans the split dim (an
  ALiBi bias or a mask with a heads dim) is read by `tp_chunk`: this rank's
  chunk along that dim, no communication;
- a replicated parameter read by an op on a split activation (a per-head
  q/k norm's weight, a scale broadcast over heads) is read through
  `tp_copy`: each rank's gradient for it is only its own heads' share, and
  f's backward sums the shares over the tensor group (Megatron does the same
  for the layer norms that see sequence-parallel activations).

- a random draw on a split activation (a dropout with p > 0, attention's
  dropout_p over a slice's heads, a dropout on a slice's tokens under
  sequence or context parallelism) runs as `tp_forked(slices, op, ...)`:
  from this slice's own stream, as Megatron's model-parallel RNG tracker
  forks one per slice. On the stage's shared stream every slice would draw
  the same mask for its own heads or tokens, correlated where one process
  draws each element apart. A draw on a replicated activation stays on the
  shared stream, so it is the same on every slice, as it must be.

Under sequence parallelism (`partitioner.planner.sequence_split`, the plan's sp) the
ops between the regions run on this rank's tokens: a row-parallel output is
reduce-scattered over them (`sp_scatter`) instead of all-reduced, a column
input all-gathered (`sp_gather`) instead of read through f, the vocab-parallel
embedding reduce-scattered (`sp_vocab_embedding`); a replicated reader that is
not token-local reads the tokens gathered (`tp_gather`), a replicated operand
that meets them is read by chunk (`tp_chunk`), and a replicated parameter
applied to them through f.

The functions named here live in `runtime.pipeline.tensor_parallel` (`tp_vocab_logits` in
`runtime.pipeline.vocab_logits`); the planner must
not import the runtime, so stand-ins with the same names carry them into the
graph and the generated program imports the real ones.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from cost_models.placements import is_sharded
from partitioner.codegen.segment_attention import shape_mask_attention
from partitioner.planner.model_code import SegmentError, describe
from partitioner.tracer.writes import written

__all__ = ["RUNTIME_FUNCTIONS", "TensorParallelRewrite", "unmangle"]

_aten = torch.ops.aten
MATMULS = {_aten.linear.default: (0, 1, 2), _aten.addmm.default: (1, 2, 0),  # (activation, weight, bias)
           _aten.mm.default: (0, 1, None), _aten.matmul.default: (0, 1, None)}
_SIZED = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.expand.default}
_SPLITS = {_aten.split.Tensor, _aten.split_with_sizes.default}


def tp_copy(x, tp):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def tp_reduce(x, tp):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def tp_vocab_embedding(weight, ids, tp, padding_idx=-1):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def tp_cross_entropy(local_logits, targets, ignore_index, tp):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def tp_gather(x, dim, tp):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def tp_vocab_logits(x, tp):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def tp_chunk(x, dim, tp):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def sp_gather(x, dim, tp):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def sp_scatter(x, dim, tp):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def sp_vocab_embedding(weight, ids, dim, tp, padding_idx=-1):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def tp_forked(slices, op, *args, **kwargs):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def fp8_linear(x, weight, bias=None):
    """precision="fp8-mixed": the linear with float8 GEMM operands (runtime.engines.fp8), whatever splits it."""
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


# Tests switch this off to check that plan.verify catches the partial gradients it prevents.
SUM_REPLICATED_GRADS = True

RUNTIME_FUNCTIONS = ("tp_copy", "tp_reduce", "tp_vocab_embedding", "tp_cross_entropy", "tp_gather", "tp_vocab_logits",
                     "tp_chunk", "sp_gather", "sp_scatter", "sp_vocab_embedding", "tp_forked", "fp8_linear")


def _drawn(n: fx.Node) -> str | None:
    """The name `tp_forked` runs `n`'s op by, where `n` draws random numbers (a dropout in training with p > 0,
    attention with dropout_p > 0); None otherwise."""
    if n.target in (_aten.dropout.default, _aten.native_dropout.default):
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.0)
        train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
        return n.target._opname if isinstance(p, (int, float)) and p > 0 and train is not False else None
    if n.target in (_aten.scaled_dot_product_attention.default, shape_mask_attention):
        p = n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p", 0.0)
        return ("attention" if n.target is _aten.scaled_dot_product_attention.default else "shape_mask_attention") \
            if isinstance(p, (int, float)) and p > 0 else None
    return None


def unmangle(src: str, globs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """fx names a non-torch function by its module path; the program imports these bare."""
    from partitioner.codegen import segment_attention, segment_cp, segment_ep

    for module, fns in ((__name__, RUNTIME_FUNCTIONS), (segment_cp.__name__, segment_cp.CP_FUNCTIONS),
                        (segment_ep.__name__, segment_ep.EP_FUNCTIONS),
                        (segment_attention.__name__, segment_attention.ATTENTION_FUNCTIONS)):
        for fn in fns:
            mangled = f"{module.replace('.', '_')}_{fn}"
            src = src.replace(mangled, fn)
            if mangled in globs:
                globs[fn] = globs.pop(mangled)
    return src, globs


class TensorParallelRewrite:
    """Mixed into the segment builder, which provides graph, env, value(), src, placements, dims, chunks, tp,
    tp_arg and operand_chunks (the tp_chunk made per value and dim); under sequence parallelism also seq_dims,
    scatters, seq_gathers and seq_gathered (the gather made per value and kind), and seq_reduces (node -> the
    replicated operands it broadcasts over the tokens), all empty without it; and, for
    `fork_random`, cp, cp_arg and _seq_dims (partitioner.codegen.segment_cp)."""

    def _role(self, n: fx.Node) -> str | None:
        w = n.args[MATMULS[n.target][1]] if n.target in MATMULS else \
            (n.args[0] if n.target is _aten.embedding.default else None)
        if not isinstance(w, fx.Node) or w not in self.src.param:
            return None
        p = self.placements.get(self.src.param[w])
        return p.role if p is not None else None

    def rewrite_op(self, n: fx.Node) -> bool:
        """Copy `n` as its tensor-parallel form when it has one; False when a plain copy will do."""
        if self.tp == 1:
            return False
        if n.target is _aten.cross_entropy_loss.default and n.args[0].name in self.dims:
            self.env[n] = self._parallel_cross_entropy(n)
            return True
        role = self._role(n)
        # a vocab-parallel LM head (its weight maybe tied with a vocab-parallel embedding) is column-parallel
        if role in ("column", "vocab_head", "vocab_embedding") and n.target in MATMULS:
            a = MATMULS[n.target][0]
            act = self.value(n.args[a])
            if act not in self.copies:
                d = self._seq_gather_dim(n, n.args[a])
                self.copies[act] = self.graph.create_node("call_function", tp_copy, (act, self.tp_arg), name="f") \
                    if d is None else \
                    self.graph.create_node("call_function", sp_gather, (act, d, self.tp_arg), name="gathered")
            new = self.graph.node_copy(n, self.value)
            new.args = tuple(self.copies[act] if i == a else x for i, x in enumerate(new.args))
            self.env[n] = new
            return True
        if role == "row" and n.target in MATMULS:
            a, w, b = MATMULS[n.target]
            x, weight = self.value(n.args[a]), self.value(n.args[w])
            op = _aten.mm.default if n.target is _aten.addmm.default else n.target
            partial = self.graph.call_function(op, (x, weight))
            partial.meta = dict(n.meta)  # the partial sums have the full output's shape
            d = self.scatters.get(n.name)
            out = self.graph.create_node("call_function", tp_reduce, (partial, self.tp_arg), name="g") if d is None \
                else self.graph.create_node("call_function", sp_scatter, (partial, d, self.tp_arg), name="scattered")
            bias = n.args[b] if b is not None and len(n.args) > b else None
            if bias is not None:  # on 1/tp of the tokens under sequence parallelism: its gradient summed by f
                bias = self.value(bias) if d is None else self._param_f(self.value(bias))
                out = self.graph.call_function(_aten.add.Tensor, (out, bias))
            out.meta = dict(n.meta)
            self.env[n] = out
            return True
        if role == "vocab_embedding" and n.target is _aten.embedding.default:
            pad = n.args[2] if len(n.args) > 2 else n.kwargs.get("padding_idx", -1)
            d = self.scatters.get(n.name)
            w, ids = self.value(n.args[0]), self.value(n.args[1])
            self.env[n] = self.graph.create_node("call_function", tp_vocab_embedding, (w, ids, self.tp_arg, pad),
                                                 name=n.name) if d is None else \
                self.graph.create_node("call_function", sp_vocab_embedding, (w, ids, d, self.tp_arg, pad), name=n.name)
            self.env[n].meta = dict(n.meta)
            return True
        return False

    def fork_random(self, n: fx.Node, new: fx.Node) -> None:
        """A draw on a split activation from this slice's own stream (see the module docstring): `new` (the copy
        of `n`) becomes tp_forked(slices, op, *its arguments), `slices` the tensor group where it splits the
        activation, the context group where the activation holds this rank's tokens (cp > 1), or both."""
        op = _drawn(new)
        x = n.args[0] if n.args else None
        if op is None or not isinstance(x, fx.Node):
            return
        by_tp = self.tp > 1 and (x.name in self.dims or x.name in self.seq_dims)
        by_cp = self.cp > 1 and bool(self._seq_dims(x.meta.get("val")))
        if not (by_tp or by_cp):
            return
        slices = self.tp_arg if not by_cp else self.cp_arg if not by_tp else (self.tp_arg, self.cp_arg)
        new.args = (slices, op, *new.args)
        new.target = tp_forked

    def sum_replicated_grads(self, n: fx.Node, new: fx.Node) -> None:
        """Read each replicated parameter of an op on split activations through f (see the module docstring):
        the parameter itself, or a value computed from replicated parameters alone (Gemma's `1 + weight`)."""
        if self.tp == 1 or not SUM_REPLICATED_GRADS:
            return
        if n.name not in self.dims and n.name not in self.seq_dims and \
                not any(a.name in self.dims for a in n.all_input_nodes):
            return
        chunked = {x for x, _ in self.chunks.get(n.name, ())}  # read by chunk: its gradient is gathered whole
        for a in n.all_input_nodes:
            if a.name in self.dims or a.name in self.seq_dims or a.name in chunked or \
                    not self._replicated_parameter_value(a):
                continue
            old = self.value(a)
            with self.graph.inserting_before(new):
                new.replace_input_with(old, self._param_f(old))

    def _param_f(self, old: fx.Node) -> fx.Node:
        """f on a replicated parameter's value: one per value and segment, made before its first use."""
        if old not in self.param_copies:
            self.param_copies[old] = self.graph.create_node("call_function", tp_copy, (old, self.tp_arg),
                                                            name=f"{old.name}_f")
        return self.param_copies[old]

    def _seq_gather_dim(self, n: fx.Node, operand: fx.Node) -> int | None:
        """The token dim along which `n` reads `operand` all-gathered for a tensor-split reader, if it does."""
        return next((d for x, d, kind in self.seq_gathers.get(n.name, ()) if x == operand.name and kind == "tp"), None)

    def gather_sequence(self, n: fx.Node, new: fx.Node) -> None:
        """Read each token-split operand the sequence splits name for `n` all-gathered (partitioner.planner.
        sequence_split): sp_gather for a tensor-split reader, tp_gather (the gradient's slice back) for a
        replicated one. One gather per value, kind and segment, before its first use."""
        for operand, dim, kind in self.seq_gathers.get(n.name, ()):
            old = next(a for a in n.all_input_nodes if a.name == operand)
            if old in written(n):
                # the write would land in the gathered copy, and the tensor it writes into would never see it
                raise SegmentError(f"sequence parallelism: {describe(n)} writes in place into {old.name}, split "
                                   "along the tokens over the tensor group, where the op needs every token; "
                                   "pin sp=False")
            v = self.value(old)
            if (v, kind) not in self.seq_gathered:
                fn = sp_gather if kind == "tp" else tp_gather
                with self.graph.inserting_before(new):
                    self.seq_gathered[v, kind] = self.graph.create_node("call_function", fn, (v, dim, self.tp_arg),
                                                                        name=f"{v.name}_gathered")
            new.replace_input_with(v, self.seq_gathered[v, kind])

    def reduce_broadcast_operands(self, n: fx.Node, new: fx.Node) -> None:
        """Under sequence parallelism: each replicated operand that `n` broadcasts over the split tokens
        (partitioner.planner.sequence_split, "reduces") is read through Megatron's f (`tp_copy`), whose backward
        sums its gradient, made from this rank's tokens alone, over the tensor group."""
        for operand in self.seq_reduces.get(n.name, ()):
            old = next(a for a in n.all_input_nodes if a.name == operand)
            v = self.value(old)
            if v not in self.copies:
                with self.graph.inserting_before(new):
                    self.copies[v] = self.graph.create_node("call_function", tp_copy, (v, self.tp_arg),
                                                            name=f"{v.name}_f")
            new.replace_input_with(v, self.copies[v])

    def chunk_replicated_operands(self, n: fx.Node, new: fx.Node) -> None:
        """Read this rank's chunk of each replicated operand the splits name for `n` (see the module docstring)."""
        if self.tp == 1:
            return
        for operand, dim in self.chunks.get(n.name, ()):
            old = next(a for a in n.all_input_nodes if a.name == operand)
            if old in written(n):  # the write would land in the chunk, a copy
                raise SegmentError(f"tensor parallelism: {describe(n)} writes in place into {old.name}, whole on "
                                   "every rank, from values split over the tensor group; pin tp=1 (or sp=False)")
            v = self.value(old)
            if (v, dim) not in self.operand_chunks:  # one per value, dim and segment, before its first use
                with self.graph.inserting_before(new):
                    self.operand_chunks[v, dim] = self.graph.create_node("call_function", tp_chunk,
                                                                         (v, dim, self.tp_arg), name=f"{v.name}_chunk")
            new.replace_input_with(v, self.operand_chunks[v, dim])

    def _replicated_parameter_value(self, a: fx.Node) -> bool:
        """Whether `a` is a replicated parameter, or computed from such parameters (and shapes) alone."""
        if a in self.src.param:
            p = self.placements.get(self.src.param[a])
            return p is None or not is_sharded(p.spec)
        if a.op != "call_function" or self.src.shape_only.get(a, False):
            return False
        inputs = [x for x in a.all_input_nodes if not self.src.shape_only.get(x, False)]
        return bool(inputs) and all(self._replicated_parameter_value(x) for x in inputs)

    def resize(self, n: fx.Node, new: fx.Node) -> None:
        """Divide the split dim's size by tp in a copied view, reshape, expand or split of a split tensor."""
        if self.tp == 1:
            return
        if n.target in _SIZED and n.name in self.seq_dims:  # a token-split view: sizes from the input's are whole
            d, sizes = self.seq_dims[n.name], list(new.args[1])
            if isinstance(sizes[d], fx.Node):
                with self.graph.inserting_before(new):
                    sizes[d] = self.graph.call_function(operator.floordiv, (sizes[d], self.tp))
            elif sizes[d] != -1:
                sizes[d] //= self.tp
            new.args = (new.args[0], sizes, *new.args[2:])
        elif n.target in _SIZED and n.name in self.dims:
            d, sizes = self.dims[n.name], list(new.args[1])
            if isinstance(sizes[d], int) and sizes[d] != -1:
                sizes[d] //= self.tp
                new.args = (new.args[0], sizes, *new.args[2:])
        elif n.target in _SPLITS and n.args[0].name in self.dims:
            x = n.args[0]
            dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
            if dim % len(x.meta["val"].shape) == self.dims[x.name]:
                size = new.args[1]
                size = [s // self.tp for s in size] if isinstance(size, (list, tuple)) else size // self.tp
                new.args = (new.args[0], size, *new.args[2:])

    def _parallel_cross_entropy(self, n: fx.Node) -> fx.Node:
        args = list(n.args) + [None, 1, -100, 0.0][len(n.args) - 2:]
        weight, reduction, ignore_index, smoothing = args[2:6]
        if weight is not None or reduction != 1 or smoothing:
            raise SegmentError(f"{describe(n)}: a vocab-parallel cross entropy is generated for the mean "
                               "reduction without class weights or label smoothing; pin tp=1 for this model")
        out = self.graph.create_node("call_function", tp_cross_entropy,
                                     (self.value(n.args[0]), self.value(n.args[1]), ignore_index, self.tp_arg),
                                     name=n.name)
        out.meta = dict(n.meta)
        return out

    def output(self, x: Any) -> Any:
        """A model output. One split over the tensor group along its last dim (vocab-parallel logits) is returned
        as this rank's slice, which the loss_fn's cross entropy reads without a gather (`tp_vocab_logits`); one
        split otherwise (by tokens, or along another dim) is gathered for it (`tp_gather`)."""
        if not isinstance(x, fx.Node):
            return x
        v = self.value(x)
        if self.tp == 1:
            return v
        d = self.dims.get(x.name)
        nd = getattr(x.meta.get("val"), "ndim", None)
        if d is not None and nd and d % nd == nd - 1:
            return self.graph.create_node("call_function", tp_vocab_logits, (v, self.tp_arg), name=f"{x.name}_logits")
        d = self.seq_dims.get(x.name) if d is None else d
        if d is not None:
            v = self.graph.create_node("call_function", tp_gather, (v, d, self.tp_arg), name=f"{x.name}_full")
        return v
