"""How a tensor-parallel split dim travels through ops: op classes and shape rules.

The tensor-split pass (`tensor_split.py`) follows a sharded dim from a
column-parallel matmul through the ops that read it. This module answers the
questions it asks of one op from shapes alone (the OpGraph records shapes,
not an op's dim arguments): which class is the op (elementwise, reshape,
transpose, split, batched matmul, norm, reduction...), and where does dim d
of the input land in the output, or does the shard stop being one
contiguous block per rank.

>>> _reshape_dim((Poly.const(8), Poly.const(768)), (Poly.const(8), Poly.const(12), Poly.const(64)), 1)
(1, 12)
"""

from __future__ import annotations

import operator
from functools import reduce
from typing import Iterable

from partitioner.tracer.symbolic import Poly

# ---------------------------------------------------------------- op classes

_EW = frozenset(
    "add sub rsub mul div true_divide neg pow exp log sqrt rsqrt abs reciprocal maximum minimum clamp where "
    "masked_fill relu gelu silu sigmoid tanh erf sin cos mish leaky_relu hardtanh elu softplus hardswish "
    "hardsigmoid log1p expm1 square sign floor ceil trunc round nan_to_num eq ne lt le gt ge logical_not "
    "logical_and logical_or bitwise_not floor_divide remainder and or xor invert dropout native_dropout "
    "feature_dropout alpha_dropout alias detach to to_copy type float half bfloat16 double contiguous clone "
    "type_as lift_fresh zeros_like ones_like empty_like full_like rand_like randn_like copy".split())
_FIRST_ONLY = frozenset({"type_as", "to", "view_as", "expand_as"})  # the second tensor gives a dtype or shape
_RESHAPES = frozenset("view reshape unsafe_view flatten unflatten squeeze unsqueeze view_as select".split())
_TRANSPOSES = frozenset("transpose t permute swapaxes movedim numpy_T".split())
_SAME_RANK = frozenset("slice narrow pad constant_pad_nd".split())  # shard-local if the split dim keeps its extent
_EXPANDS = frozenset("expand expand_as repeat".split())
_SPLITS = frozenset("split split_with_sizes chunk tensor_split".split())
_BATCHED_MM = frozenset("matmul bmm baddbmm mm".split())
_NORMS = frozenset({"layer_norm", "native_layer_norm", "rms_norm"})
_REDUCTIONS = frozenset("sum mean amax amin max min var std norm logsumexp any all prod var_mean argmax argmin".split())
_CROSS_ENTROPY = frozenset({"cross_entropy", "cross_entropy_loss"})
_NEW = frozenset("new_ones new_zeros new_empty new_full".split())  # read only a dtype/device
_INDEX_PATH = frozenset("view reshape unsafe_view flatten to contiguous clone slice getitem alias detach".split())
_WEIGHTED = frozenset({"linear", "addmm", "conv1d_hf", "mm", "matmul"})

_ONE = Poly.const(1)


# ---------------------------------------------------------------- shapes


def _prod(dims: Iterable[Poly]) -> Poly:
    return reduce(operator.mul, dims, _ONE)


def _const(p: Poly) -> int | None:
    if len(p.terms) == 1 and p.terms[0][0] == (0, 0) and p.terms[0][1] == int(p.terms[0][1]):
        return int(p.terms[0][1])
    return None


def _broadcasts(shape: tuple[Poly, ...], rank: int, od: int) -> bool:
    """Whether a tensor of `shape`, right-aligned to `rank` dims, is size 1 (or absent) at dim `od`."""
    i = od - (rank - len(shape))
    return i < 0 or shape[i] == _ONE


def _reshape_dim(ish: tuple[Poly, ...], osh: tuple[Poly, ...], d: int) -> tuple[int, int] | None:
    """Where split dim `d` lands after a reshape: (new dim, its extent), or None if the shard stops
    being one contiguous block per rank (features F -> (nh, hs) lands on nh; (nh, hs) -> F on F)."""
    e = _const(ish[d])
    if not e:
        return None
    outer, acc = _prod(ish[:d]), _ONE
    for j, x in enumerate(osh):
        if acc == outer and x != _ONE:
            k = _const(x)
            if not k:
                return None
            if e % k == 0:
                return j, k
            if k % e:
                return None
            group = Poly.const(e)  # the input dims merged into output dim j: e first, then inner ones
            for y in ish[d + 1:]:
                if group == x:
                    break
                group = group * y
            return (j, k) if group == x else None
        acc = acc * x
    return None


def _permute_dim(op: str, ish: tuple[Poly, ...], osh: tuple[Poly, ...], d: int) -> int | None:
    """Where dim `d` goes under a transpose/permute, inferred from shapes; None when ambiguous."""
    if len(ish) != len(osh):
        return None
    same = [j for j, x in enumerate(osh) if x == ish[d]]
    if len(same) == 1:
        return same[0]
    diffs = [j for j in range(len(ish)) if ish[j] != osh[j]]
    if op in ("transpose", "swapaxes", "t") and len(diffs) == 2:  # exactly two dims swapped
        return d if d not in diffs else diffs[1 - diffs.index(d)]
    return None


def _drop_dim(ish: tuple[Poly, ...], osh: tuple[Poly, ...], d: int) -> int | None | str:
    """Where dim `d` goes when dims are removed (a reduction, select, unbind): its new index,
    "dropped" if it is removed, None if shapes cannot tell."""
    if len(ish) == len(osh):  # keepdim: reduced dims become 1
        return "dropped" if osh[d] != ish[d] else d

    def greedy(a, b):
        out, j = [], 0
        for x in a:
            if j < len(b) and b[j] == x:
                out.append(j)
                j += 1
            else:
                out.append(None)
        return out if j == len(b) else None

    left = greedy(ish, osh)
    right = greedy(ish[::-1], osh[::-1])
    if left is None or right is None:
        return None
    r = right[len(ish) - 1 - d]
    r = None if r is None else len(osh) - 1 - r
    if left[d] != r:
        return None
    return "dropped" if r is None else r


def padded_dims(pad_node, ndim: int) -> set[int] | None:
    """The dims an fx pad op (aten.pad, constant_pad_nd, ...) pads or trims by a non-zero amount: its list holds
    (before, after) pairs from the last dim back. None where the node gives no such list."""
    pad = pad_node.args[1] if len(pad_node.args) > 1 else pad_node.kwargs.get("pad", pad_node.kwargs.get("padding"))
    if not isinstance(pad, (list, tuple)):
        return None
    return {ndim - 1 - k // 2 for k, amount in enumerate(pad) if not (isinstance(amount, int) and amount == 0)}
