"""Context-parallel rewriting of segment code (cp > 1): each rank runs the model on its tokens of every
sequence, in the load-balanced layout (`runtime.context.sequence`: chunks r and 2cp-1-r of 2cp).

Used by `partitioner.codegen.segments` while it copies a segment's nodes. Every op of a transformer but
attention acts on each token alone, so it runs unchanged on this rank's tokens; what is rewritten:

- `aten.scaled_dot_product_attention` becomes `cp_attention` over the cp group (a ring attention or
  Ulysses' all-to-alls, as the plan's cp_kind says), causal or not as traced. A mask computed from shapes
  alone (a causal buffer sliced to the length) is passed whole, and the runtime checks it is causal or
  full before it attends; a mask read from the inputs (padding) is refused here;
- a value computed from shapes alone that has the sequence length among its sizes (an `arange` of
  positions, position ids, rotary cos/sin tables) is computed at the whole length (every size read from
  the inputs' token dim multiplied by cp) and read through `cp_positions`: this rank's positions along
  that dim. Sizes that shape activations (views) stay this rank's;
- an arithmetic op reading the sequence length as a number (x / T) reads the whole length;
- anything that mixes tokens otherwise (a matmul over two token-carrying operands, as in eager attention;
  a reduction, softmax, cumsum, concatenation or convolution along the token dim) is refused with the
  node named: it would see only this rank's tokens and train silently wrong.

With tensor parallelism the same builder applies the Megatron rewrite first: attention runs over the cp
group on this rank's heads; under sequence parallelism each rank's tokens are split again over the tensor
group, a size read from the hidden state's token dim is multiplied back by tp (this cp rank's length) and
then by cp here, and a positioned value is cut to the tensor slice by the sequence split's `tp_chunk`.

The loss is computed per rank on its tokens (the runtime shards targets the same way) and averaged
over dp x cp with the gradients: every rank holds as many tokens, so that is the one-process mean.

The functions named here live in `runtime.context.program`; stand-ins with the same names carry them
into the graph and the generated program imports the real ones.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from partitioner.planner.model_code import SegmentError, describe
from partitioner.planner.shard_dims import padded_dims

__all__ = ["CP_FUNCTIONS", "ContextParallelRewrite", "cp_attention", "cp_positions", "sequence_symbols"]

_aten = torch.ops.aten
_ATTENTION = _aten.scaled_dot_product_attention.default
_MATMULS = {_aten.mm.default, _aten.bmm.default, _aten.matmul.default, _aten.baddbmm.default,
            _aten.addbmm.default, _aten.einsum.default}
_ARITHMETIC = {_aten.mul.Tensor, _aten.mul.Scalar, _aten.div.Tensor, _aten.div.Scalar, _aten.add.Tensor,
               _aten.add.Scalar, _aten.sub.Tensor, _aten.sub.Scalar, _aten.rsub.Scalar, _aten.pow.Tensor_Scalar}
_SYMBOL = re.compile(r"\bs\d+\b")  # torch.export's size symbols
# ops whose `dim` moves or names a dim without mixing what lies along it
_DIM_LOCAL = {"unsqueeze", "squeeze", "flatten", "unflatten", "movedim"}
_CONVOLUTIONS = {_aten.convolution.default, _aten.conv1d.default, _aten.conv2d.default}


_REORDERS = {"roll", "flip", "rot90"}  # their `dims` move tokens to other positions (permute's only name the dims)
_PADS = {"pad", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d",
         "_pad_circular"}


def _whole_slice(n: fx.Node) -> bool:
    """aten.slice(x, dim, start, end) taking the whole dim (HF's `hidden[:, slice(-0, None), :]`)."""
    start = n.args[2] if len(n.args) > 2 else n.kwargs.get("start")
    end = n.args[3] if len(n.args) > 3 else n.kwargs.get("end")
    return start in (None, 0) and (end is None or isinstance(end, int) and end >= 2**62)


def cp_attention(q, k, v, attn_mask, is_causal, scale, cp):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


def cp_positions(x, dim, cp):
    raise NotImplementedError("a planner-side stand-in; the generated program imports the runtime's")


CP_FUNCTIONS = ("cp_attention", "cp_positions")


def sequence_symbols(inputs: list[fx.Node]) -> frozenset[str]:
    """The traced size symbols of the sequence: dim 1 of the integer token inputs (partitioner.tracer.capture),
    one per input when the exporter did not unify them (ids and targets)."""
    syms = {str(v.shape[1]) for n in inputs for v in [n.meta.get("val")]
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and not v.dtype.is_floating_point and v.dtype != torch.bool}
    if not syms or any(s.isdigit() for s in syms):
        raise SegmentError(f"context parallelism splits the token inputs' dim 1, but the trace has "
                           f"{'no token input' if not syms else f'token lengths {sorted(syms)}'} with a symbolic "
                           "sequence length (an example as long as the model's context fixes it): trace with "
                           "(batch, sequence) integer token inputs shorter than the context, or compile with cp=1")
    return frozenset(syms)


class ContextParallelRewrite:
    """Mixed into the segment builder, which provides graph, env, value(), src, _copy_plain(n, lookup), cp (the
    degree), cp_arg (the `cp` placeholder) and seq_syms (the sequence's size symbols); full_env and pos_env
    hold the whole-length and this rank's copies of shape-only values."""

    def _seq_dims(self, val: Any) -> list[int]:
        """The dims of `val` as long as the sequence: its size symbol, or a size the trace's shape environment
        proves equal to it (MPT slices its ALiBi bias to `64 - Max(0, 64 - s)`, s for every traced length)."""
        shape = getattr(val, "shape", ())
        lengths = [v.shape[1] for n in self.src.inputs for v in [n.meta.get("val")]
                   if isinstance(v, torch.Tensor) and v.dim() >= 2 and str(v.shape[1]) in self.seq_syms]
        return [d for d, s in enumerate(shape) if str(s) in self.seq_syms or
                (isinstance(s, torch.SymInt) and any(statically_known_true(s == n) for n in lengths))]

    def positional(self, n: fx.Node) -> bool:
        """Whether `n` is a tensor computed from shapes alone (read at this rank's positions under cp)."""
        return self.cp > 1 and n.op == "call_function" and self.src.shape_only.get(n, False) and \
            isinstance(n.meta.get("val"), torch.Tensor)

    def at_positions(self, n: fx.Node) -> fx.Node:
        """Shape-only tensor `n` as a token-local op reads it: computed at the whole length, this rank's rows
        along its token dim."""
        if n in self.pos_env:
            return self.pos_env[n]
        dims = self._seq_dims(n.meta["val"])
        if len(dims) > 1:
            raise SegmentError(f"context parallelism: the {self.name} reads {describe(n)}, of shape "
                               f"{tuple(n.meta['val'].shape)}, sequence by sequence (a mask relating tokens to "
                               "tokens) outside attention; only scaled_dot_product_attention may relate tokens "
                               "across ranks: compile with cp=1")
        out = self.full(n)
        if dims:
            out = self.graph.create_node("call_function", cp_positions, (out, dims[0], self.cp_arg),
                                         name=f"{n.name}_here")
            out.meta = dict(n.meta)  # this rank's shape: the traced one, its tokens this rank's
        self.pos_env[n] = out
        return out

    def full(self, n: Any) -> Any:
        """`n` at the whole sequence length: sizes read from the token dim times cp, shape-only ops copied
        over whole-length arguments; anything else as `value` gives it."""
        if not isinstance(n, fx.Node):
            return n
        if n in self.full_env:
            return self.full_env[n]
        if n.op != "call_function" or not self.src.shape_only.get(n, False):
            return self.value(n)
        if n.target is _aten.sym_size.int and str(n.meta.get("val")) in self.seq_syms:
            out = self.graph.call_function(operator.mul, (self.value(n), self.cp))
            out.meta = dict(n.meta)
        elif n.target is _aten.sym_size.int:
            out = self.value(n)
        else:
            out = self._copy_plain(n, self.full)
        self.full_env[n] = out
        return out

    def whole_lengths(self, n: fx.Node, new: fx.Node) -> None:
        """An arithmetic op that reads the sequence length as a number (x / T) reads the whole length, as one
        process does; sizes that shape this rank's values (views, expands) stay its own."""
        if self.cp == 1 or n.target not in _ARITHMETIC:
            return
        with self.graph.inserting_before(new):
            new.args = tuple(self.full(a) if self._is_length(a) else b for a, b in zip(n.args, new.args))

    def _is_length(self, a: Any) -> bool:
        val = a.meta.get("val") if isinstance(a, fx.Node) else None
        return isinstance(val, torch.SymInt) and bool(set(_SYMBOL.findall(str(val))) & self.seq_syms)

    def rewrite_cp(self, n: fx.Node) -> bool:
        """Copy `n` in its context-parallel form (attention); refuse what mixes tokens; False otherwise."""
        if self.cp == 1:
            return False
        if n.target is _ATTENTION:
            self.env[n] = self._attention(n)
            return True
        self._check_token_local(n)
        return False

    def _attention(self, n: fx.Node) -> fx.Node:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
        a = {**defaults, **dict(zip(names, n.args)), **n.kwargs}
        if a["dropout_p"]:
            raise SegmentError(f"context parallelism: attention {n.name} drops attention probabilities "
                               f"(dropout_p={a['dropout_p']}), which the ring and Ulysses kernels do not; "
                               "build the model with attention dropout 0, or compile with cp=1")
        mask = a["attn_mask"]
        if isinstance(mask, fx.Node):
            if not self.src.shape_only.get(mask, False):
                raise SegmentError(f"context parallelism: attention {n.name} takes the mask {describe(mask)}, "
                                   "computed from the inputs (padding), which the ring and Ulysses kernels cannot "
                                   "split; train without an attention mask (causal attention with is_causal), "
                                   "or compile with cp=1")
            mask = self.full(mask)  # whole: the runtime checks it is causal (or full) before attending
        q, k, v = (self.value(x) for x in (a["query"], a["key"], a["value"]))
        out = self.graph.create_node("call_function", cp_attention,
                                     (q, k, v, mask, bool(a["is_causal"]), a["scale"], self.cp_arg), name=n.name)
        out.meta = dict(n.meta)
        return out

    def _check_token_local(self, n: fx.Node) -> None:
        tensors = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        carrying = [a for a in tensors if self._seq_dims(a.meta["val"])]
        if n.target in _MATMULS and len(carrying) >= 2:
            why = "a product of two token-carrying values (eager attention: q @ k^T, p @ v)"
        elif n.target in _CONVOLUTIONS and carrying:
            why = "a convolution along the tokens"
        else:
            why = self._along_tokens(n)
        if why:
            raise SegmentError(f"context parallelism: the {self.name} computes {describe(n)}, {why}; each rank "
                               "holds only its tokens, so it would train wrong. Only scaled_dot_product_attention "
                               "may relate tokens across ranks (trace with rewrite_attention=True for eager "
                               "attention): compile with cp=1")

    def _along_tokens(self, n: fx.Node) -> str:
        """Why `n` reduces, scans or joins along the token dim of its first input ("" if it does not)."""
        schema = getattr(n.target, "_schema", None)
        x = n.args[0] if n.args else None
        if schema is None or not isinstance(x, fx.Node):
            return ""
        val = x.meta.get("val")
        if isinstance(val, (list, tuple)) and val and isinstance(val[0], torch.Tensor):  # cat, stack
            val = val[0]
        if not isinstance(val, torch.Tensor):
            return ""
        seq = self._seq_dims(val)
        name = n.target.overloadpacket.__name__
        if not seq or name in _DIM_LOCAL or (name == "slice" and _whole_slice(n)):
            return ""
        if name in _PADS and (padded_dims(n, val.dim()) or set()) & set(seq):
            # a shift: Hugging Face's causal-LM loss pads its labels by one and drops the first, so that each
            # token's target is the next token, which on a rank's tokens is another chunk's or none
            return f"a {name} along the token dim (a shift of the tokens)"
        for i, arg in enumerate(schema.arguments):
            if arg.name != "dim" and not (arg.name == "dims" and name in _REORDERS):
                continue
            d = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name, arg.default_value if arg.has_default_value()
                                                                   else None)
            dims = [d] if isinstance(d, int) else list(d) if isinstance(d, (list, tuple)) else []
            if not dims and d is None and "dim" in str(arg.type) and n.target.overloadpacket.__name__ in (
                    "sum", "mean", "amax", "amin", "std", "var"):
                continue  # a reduction over everything (a loss-like mean): a share of equal size per rank
            if any(dd % max(val.dim(), 1) in seq for dd in dims if isinstance(dd, int)):
                return f"a {n.target.overloadpacket.__name__} along the token dim"
        return ""
