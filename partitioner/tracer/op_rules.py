"""Per-op cost rules: FLOPs, bytes, and what an op keeps for backward.

Counting conventions (the ones Megatron-LM, PaLM's MFU and
torch.utils.flop_counter use for the ops that dominate):
- a multiply-add is 2 FLOPs: linear/matmul `2*M*N*K`, convolution
  `2 * out_numel * Cin/groups * prod(kernel)`, attention
  `2*B*H*L*S*(E + Ev)`, the full L x S products also for causal attention (Megatron's and PaLM's
  model FLOPs, which MFU is quoted in); the time model runs a causal one at half of them
  (`OpCost.causal`);
- backward of a matmul-like op costs one forward for the input gradient
  (if the input requires grad) and one for the weight gradient (if the
  weight requires grad): the familiar 3x for a full training step;
- elementwise ops cost their arithmetic per output element (`_EW`), with a
  backward of twice that (derivative, then multiply by the incoming grad);
  they are memory-bound, so the exact count barely moves a roofline time;
- views move nothing; copies move bytes and compute nothing.

What an op saves for backward follows the autograd formulas in
torch/csrc/autograd/FunctionsManual.cpp and derivatives.yaml (linear saves
its input, softmax its output, gelu its input, dropout a 1-byte mask...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch

from partitioner.tracer.capture import RawArg, RawNode

__all__ = ["SymCost", "op_cost", "VIEW_OPS", "known_op"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SymCost:
    """Costs as sympy expressions in B and S, before lowering to Poly."""

    op_class: str
    forward_flops: sympy.Expr
    backward_flops: sympy.Expr
    bytes_read: sympy.Expr
    bytes_written: sympy.Expr
    saved_args: tuple[int, ...]  # indices into node.args kept for backward
    saves_output: bool
    extra_saved_bytes: sympy.Expr  # masks, statistics, inputs that are not nodes
    is_view: bool
    extra_fixed_bytes: sympy.Expr = sympy.Integer(0)  # the part of extra_saved_bytes that is boolean masks


ZERO = sympy.Integer(0)

VIEW_OPS = frozenset(
    "view reshape unsafe_view transpose t permute expand expand_as squeeze unsqueeze split split_with_sizes "
    "chunk getitem slice select unbind flatten unflatten narrow as_strided detach alias view_as movedim "
    "unfold numpy_T swapaxes real lift_fresh assert_tensor_metadata reshape_as".split()
)
_COPY_OPS = frozenset(
    "contiguous clone to to_copy type float half bfloat16 double repeat cat stack concat pad constant_pad_nd "
    "index_select gather index roll flip tril triu masked_select copy type_as repeat_interleave tile".split()
)
_CREATION_OPS = frozenset(
    "arange ones zeros full empty ones_like zeros_like full_like empty_like scalar_tensor rand randn randint "
    "tensor new_ones new_zeros new_empty new_full rand_like randn_like linspace".split()
)
_MATMUL_OPS = frozenset("matmul mm bmm addmm baddbmm addbmm".split())
_CONV_OPS = frozenset("conv1d conv2d conv3d convolution conv_transpose1d conv_transpose2d conv_transpose3d".split())
_NORM_FLOPS = {"layer_norm": 8, "native_layer_norm": 8, "rms_norm": 4, "group_norm": 8, "batch_norm": 8,
               "native_batch_norm": 8, "instance_norm": 8}
# Per-element arithmetic of the forward, and what backward needs kept:
# "none", "output", "input" (first tensor arg), "operands" (each operand the
# other's gradient needs), "mask" (a bool/1-byte mask per element).
_EW: dict[str, tuple[float, str]] = {
    "add": (1, "none"), "sub": (1, "none"), "rsub": (1, "none"), "neg": (1, "none"),
    "mul": (1, "operands"), "div": (1, "operands"), "true_divide": (1, "operands"),
    "pow": (1, "input"), "square": (1, "input"), "exp": (1, "output"), "log": (1, "input"), "sqrt": (1, "output"),
    "rsqrt": (1, "output"),
    "abs": (1, "input"), "reciprocal": (1, "output"), "maximum": (1, "operands"), "minimum": (1, "operands"),
    "clamp": (1, "input"), "where": (1, "mask"), "masked_fill": (1, "mask"), "relu": (1, "output"),
    "gelu": (8, "input"), "silu": (4, "input"), "sigmoid": (4, "output"), "tanh": (4, "output"),
    "erf": (4, "input"), "sin": (4, "input"), "cos": (4, "input"), "mish": (8, "input"),
    "leaky_relu": (1, "input"), "hardtanh": (1, "input"), "elu": (2, "output"), "softplus": (4, "input"),
    "eq": (1, "none"), "ne": (1, "none"), "lt": (1, "none"), "le": (1, "none"), "gt": (1, "none"),
    "ge": (1, "none"), "logical_not": (1, "none"), "logical_and": (1, "none"), "logical_or": (1, "none"),
    "bitwise_not": (1, "none"), "floor_divide": (1, "none"), "remainder": (1, "none"),
    "and": (1, "none"), "or": (1, "none"), "xor": (1, "none"), "invert": (1, "none"), "diff": (1, "none"),
    "bitwise_and": (1, "none"), "bitwise_or": (1, "none"),
}
# Higher-order ops wrapping a small no-grad region (HF's rotary frequencies under
# torch.no_grad export as wrap_with_set_grad_enabled): costed per output element.
_OPAQUE = frozenset({"wrap_with_set_grad_enabled", "wrap_with_autocast"})
# one matrix per group of rows (a mixture of experts' tokens sorted by expert): torch._grouped_mm and Hugging
# Face's fallback for it
_GROUPED_MM_OPS = frozenset({"grouped_mm", "_grouped_mm", "grouped_mm_fallback"})
# moving tokens to and from their experts: memory-bound, about one operation per element touched
ROUTING_OPS = frozenset("sort argsort histc bincount index_put index_add scatter scatter_add one_hot".split())
_REDUCTIONS = {"sum": "none", "mean": "none", "amax": "input", "amin": "input", "max": "input", "min": "input",
               "var": "input", "std": "input", "norm": "input", "logsumexp": "input", "cumsum": "none",
               "argmax": "none", "argmin": "none", "topk": "input", "any": "none", "all": "none",
               "var_mean": "input", "prod": "input"}
_POOL = {"max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
         "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_max_pool2d", "max_pool2d_with_indices"}


def known_op(op: str) -> bool:
    return (op in VIEW_OPS or op in _COPY_OPS or op in _CREATION_OPS or op in _MATMUL_OPS or op in _CONV_OPS
            or op in _NORM_FLOPS or op in _EW or op in _REDUCTIONS or op in _POOL or op in _OPAQUE
            or op in _GROUPED_MM_OPS or op in ROUTING_OPS or op == "einsum"
            or op in {"linear", "conv1d_hf", "embedding", "scaled_dot_product_attention", "softmax",
                      "log_softmax", "cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss_nd",
                      "dropout", "native_dropout", "feature_dropout"})


def _numel(a: RawArg | None) -> sympy.Expr:
    return a.spec.numel() if a is not None and a.spec is not None else ZERO


def _nbytes(a: RawArg | None) -> sympy.Expr:
    return _numel(a) * a.spec.itemsize if a is not None and a.spec is not None else ZERO


def op_cost(node: RawNode, arg_rg: list[bool]) -> SymCost:
    """The cost of `node`, given which of its tensor args require grad."""
    args, out = node.args, node.outputs[0]
    out_numel = out.numel()
    out_rg = any(arg_rg) and out.dtype.is_floating_point
    read = sum((_nbytes(a) for a in args), ZERO)
    written = sum((o.numel() * o.itemsize for o in node.outputs), ZERO)
    op = node.op

    def cost(op_class, fwd, bwd=ZERO, saved=(), saves_output=False, extra=ZERO, view=False, r=read, w=written,
             fixed=ZERO):
        return SymCost(op_class=op_class, forward_flops=sympy.sympify(fwd), backward_flops=sympy.sympify(bwd),
                       bytes_read=r, bytes_written=w, saved_args=tuple(saved), saves_output=saves_output,
                       extra_saved_bytes=sympy.sympify(extra), is_view=view, extra_fixed_bytes=sympy.sympify(fixed))

    if op in VIEW_OPS or (op in {"dropout", "feature_dropout", "alias"} and _dropout_p(node) == 0.0):
        return cost("other", ZERO, view=True, r=ZERO, w=ZERO)
    if op in _COPY_OPS:
        return cost("other", ZERO)
    if op in _CREATION_OPS:
        return cost("other", ZERO, r=ZERO)

    if op in ("linear", "conv1d_hf") or op in _MATMUL_OPS:
        # linear(x, W[, b]): K = W.shape[-1]; HF Conv1D(x, W[k, n], b): K = W.shape[0];
        # addmm/baddbmm(bias, a, b); matmul/mm/bmm(a, b): K = a.shape[-1].
        if op == "linear":
            a_i, b_i, bias_i, k = 0, 1, (2 if len(args) > 2 else None), args[1].spec.shape[-1]
        elif op == "conv1d_hf":
            a_i, b_i, bias_i, k = 0, 1, (2 if len(args) > 2 else None), args[1].spec.shape[0]
        elif op in ("addmm", "baddbmm", "addbmm"):
            a_i, b_i, bias_i, k = 1, 2, 0, args[1].spec.shape[-1]
        else:
            a_i, b_i, bias_i, k = 0, 1, None, args[0].spec.shape[-1]
        mm = 2 * out_numel * k
        fwd = mm + (out_numel if bias_i is not None else 0)
        bwd = (mm if arg_rg[a_i] else 0) + (mm if arg_rg[b_i] else 0) + (out_numel if bias_i is not None and arg_rg[bias_i] else 0)
        saved = ([a_i] if arg_rg[b_i] else []) + ([b_i] if arg_rg[a_i] else [])
        return cost("matmul", fwd, bwd, saved)

    if op == "einsum" and node.scalars and isinstance(node.scalars[0], str) and "->" in node.scalars[0]:
        # every combination of the indices is met once: 2 per product of the sizes of all of them (two operands)
        sizes = _einsum_sizes(node.scalars[0], [a.spec.shape for a in args])
        if sizes is not None and len(args) >= 2:
            mm = 2 * (len(args) - 1) * sympy.Mul(*sizes.values())
            bwd = sum(mm if rg else 0 for rg in arg_rg)
            return cost("matmul", mm, bwd, [i for i in range(len(args)) if any(arg_rg[:i] + arg_rg[i + 1:])])

    if op in _GROUPED_MM_OPS:
        # x (T, K) @ w[g] (K, N) for each group g of x's rows: every row meets one matrix, so 2 T K N
        mm = 2 * out_numel * args[0].spec.shape[-1]
        bwd = (mm if arg_rg[0] else 0) + (mm if arg_rg[1] else 0)
        return cost("matmul", mm, bwd, ([0] if arg_rg[1] else []) + ([1] if arg_rg[0] else []))

    if op in ROUTING_OPS:
        touched = sum((_numel(a) for a in args), ZERO)
        ints = [i for i, a in enumerate(args) if a.spec is not None and not a.spec.dtype.is_floating_point]
        return cost("other", touched, touched if out_rg else 0, ints if out_rg else [])

    if op in _CONV_OPS:
        x, w = args[0], args[1]
        transposed = "transpose" in op
        per_out = sympy.Mul(*w.spec.shape[1:])
        mm = 2 * (_numel(x) if transposed else out_numel) * per_out
        has_bias = len(args) > 2
        fwd = mm + (out_numel if has_bias else 0)
        bwd = (mm if arg_rg[0] else 0) + (mm if arg_rg[1] else 0) + (out_numel if has_bias and arg_rg[2] else 0)
        return cost("conv", fwd, bwd, [0] if arg_rg[1] else [])

    if op == "scaled_dot_product_attention":
        q, k, v = args[0].spec.shape, args[1].spec.shape, args[2].spec.shape
        rows = sympy.Mul(*q[:-1])  # B*H*L
        scores = rows * k[-2]  # B*H*L*S
        mm = 2 * scores * (q[-1] + v[-1])
        # Flash/efficient kernels keep q, k, v, the output and a logsumexp per row, not the L x S matrix.
        # A float attn_mask is kept as it is (counted once where several calls share it); a boolean one
        # is first turned into a float one in q's dtype, made (and kept) by each call.
        # A mask computed from shapes alone that is the causal one (node.causal_mask) is not passed: generated
        # code attends with is_causal (runtime.pipeline.attention.shape_mask_attention).
        saved, extra = [0, 1, 2], rows * 4
        mask = args[3] if len(args) > 3 and not node.causal_mask else None
        if mask is not None and mask.spec is not None and mask.spec.dtype == torch.bool:
            extra = extra + _numel(mask) * args[0].spec.itemsize
        elif mask is not None:
            saved.append(3)
        return cost("attention", mm + 5 * scores, 2 * mm + 5 * scores if out_rg else 0, saved,
                    saves_output=True, extra=extra)

    if op == "embedding":
        w_i = 0 if args[0].spec.dtype.is_floating_point else 1
        idx_i = 1 - w_i
        bwd = out_numel if arg_rg[w_i] else 0  # scatter-add into the table
        return cost("embedding", ZERO, bwd, [idx_i], r=_nbytes(args[idx_i]) + written)

    if op in _NORM_FLOPS:
        f = _NORM_FLOPS[op] * _numel(args[0])
        return cost("reduction", f, 2 * f if out_rg else 0, [0])

    if op in ("softmax", "log_softmax"):
        f = 5 * out_numel
        return cost("reduction", f, 2 * f if out_rg else 0, saves_output=True)

    if op in ("cross_entropy", "cross_entropy_loss"):
        # log_softmax over the logits (kept for backward), then a gather and a mean.
        logits = _numel(args[0])
        f = 5 * logits + out_numel
        return cost("reduction", f, 2 * logits if out_rg else 0, extra=logits * args[0].spec.itemsize)

    if op in ("nll_loss", "nll_loss_nd"):
        return cost("reduction", _numel(args[1]), _numel(args[0]) if out_rg else 0, [1])

    if op in ("dropout", "native_dropout", "feature_dropout"):
        # keeps a 1-byte mask per element (Korthikanti et al. 2022 count it so)
        return cost("elementwise", 2 * out_numel, out_numel if out_rg else 0, extra=out_numel, fixed=out_numel)

    if op in _EW:
        per, saves = _EW[op]
        f = per * out_numel
        bwd = 2 * f if out_rg else 0
        if saves == "output":
            return cost("elementwise", f, bwd, saves_output=out_rg)
        if saves == "input":
            return cost("elementwise", f, bwd, [0] if out_rg else [])
        if saves == "operands":
            saved = [i for i in range(len(args)) if any(arg_rg[j] for j in range(len(args)) if j != i)]
            return cost("elementwise", f, bwd, saved)
        if saves == "mask":
            mask = [i for i, a in enumerate(args) if a.spec is not None and a.spec.dtype == torch.bool]
            return cost("elementwise", f, bwd, mask if out_rg else [])
        return cost("elementwise", f, bwd)

    if op in _REDUCTIONS:
        f = _numel(args[0]) if args else out_numel
        return cost("reduction", f, f if out_rg else 0, [0] if _REDUCTIONS[op] == "input" and out_rg else [])

    if op in _POOL:
        f = _numel(args[0])
        keeps_input = op.startswith("max") or op.startswith("adaptive_max")
        return cost("reduction", f, f if out_rg else 0, [0] if keeps_input and out_rg else [])

    # Unknown op: one FLOP per output element and keep its input; OpGraph lists it.
    return cost("other", out_numel, 2 * out_numel if out_rg else 0, [0] if out_rg and args else [])


def _einsum_sizes(equation: str, shapes: list) -> dict[str, Any] | None:
    """Each index of `equation` (an ellipsis' dims counted from its right) and its size in `shapes`; None
    where they do not fit."""
    terms = equation.replace(" ", "").split("->")[0].split(",")
    if len(terms) != len(shapes):
        return None
    sizes: dict[str, Any] = {}
    for term, shape in zip(terms, shapes):
        head, _, tail = term.partition("...")
        ellipsis = len(shape) - len(head) - len(tail) if "..." in term else 0
        if ellipsis < 0 or ("..." not in term and len(term) != len(shape)):
            return None
        names = [*head, *(f"...{ellipsis - i}" for i in range(ellipsis)), *tail]
        for name, size in zip(names, shape):
            if sizes.get(name, 1) == 1:  # a broadcast 1 gives way to the other operand's size
                sizes[name] = size
    return sizes


def _dropout_p(node: RawNode) -> float | None:
    for x in node.scalars:
        if isinstance(x, float) and not isinstance(x, bool):
            return x
    return None
