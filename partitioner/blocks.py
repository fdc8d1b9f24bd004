"""Repeated blocks: find the model's layer stack, trace three layers, copy the rest.

A 175B GPT has 96 identical blocks; tracing each one costs time linear in
depth with a large constant (torch.export of HF GPT-3 175B alone takes about
16 s here). Blocks that are the same class with the same parameter shapes
and no shared tensors compute the same graph, so the tracer captures a
shallow copy of the model whose stack holds only its first three blocks,
checks that block 2's graph is block 1's graph (same ops, shapes and wiring,
with block 1's inputs from block 0 becoming block 2's inputs from block 1),
and writes the remaining blocks as renamed copies. `tests/test_trace.py` checks
the copied graph against a full trace node by node.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

from torch import nn

from partitioner.opgraph import TensorSpec, OpCost

TRACED_BLOCKS = 3  # blocks captured before copying; see expand()

__all__ = ["TRACED_BLOCKS", "LayerStack", "find_layer_stack", "truncated", "block_index", "Costed", "expand", "NotRepeating"]


class NotRepeating(Exception):
    """Block 1's graph is not a copy of block 0's: trace the whole model instead."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerStack:
    path: str  # module path of the ModuleList/Sequential ("" for the root)
    size: int
    module_type: str
    uniform: bool  # same class, same parameter/buffer shapes, nothing shared


def _signature(m: nn.Module) -> tuple:
    return (type(m),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()))


def find_layer_stack(model: nn.Module) -> LayerStack | None:
    """The ModuleList/Sequential with the longest run of same-class children holding parameters."""
    best, best_key = None, None
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
            continue
        children = list(m)
        with_params = [c for c in children if any(True for _ in c.parameters())]
        if not with_params:
            continue
        common = Counter(type(c) for c in with_params).most_common(1)[0][1]
        key = (common, sum(p.numel() for p in m.parameters()))
        if best_key is None or key > best_key:
            ids = [id(p) for c in children for p in c.parameters()]
            uniform = (len({_signature(c) for c in children}) == 1 and len(ids) == len(set(ids)))
            types = Counter(type(c).__name__ for c in children).most_common(1)[0][0]
            best, best_key = LayerStack(path=path, size=len(children), module_type=types, uniform=uniform), key
    return best


def truncated(model: nn.Module, stack: LayerStack, k: int, wrap=None) -> nn.Module:
    """A shallow copy of `model` whose layer stack keeps its first `k` blocks, each passed through
    `wrap` when given (block_kinds.recording); `model` is untouched."""
    container = model.get_submodule(stack.path)
    new: nn.Module = container[:k]
    if wrap is not None:
        for i in range(len(new)):
            new[i] = wrap(new[i])
    parts = stack.path.split(".") if stack.path else []
    for i in range(len(parts) - 1, -1, -1):
        parent = model.get_submodule(".".join(parts[:i]))
        clone = copy.copy(parent)
        clone._modules = dict(parent._modules)  # a fresh dict: the user's module keeps its own
        clone._modules[parts[i]] = new
        new = clone
    return new


def block_index(module_path: str, stack_path: str) -> int | None:
    if stack_path:
        if not module_path.startswith(stack_path + "."):
            return None
        module_path = module_path[len(stack_path) + 1 :]
    head = module_path.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _rename(name: str, stack_path: str, src: int, dst: int) -> str:
    old = f"{stack_path}.{src}" if stack_path else str(src)
    new = f"{stack_path}.{dst}" if stack_path else str(dst)
    if name == old:
        return new
    return new + name[len(old):] if name.startswith(old + ".") else name


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costed:
    """A traced node with its costs, before parameters and blocks are assigned."""

    name: str
    op: str
    target: str
    inputs: tuple[str, ...]
    params: tuple[str, ...]  # as traced (tied names not yet resolved)
    output: TensorSpec
    cost: OpCost
    requires_grad: bool
    module_path: str
    module_type: str
    block: int | None


def expand(nodes: list[Costed], stack: LayerStack) -> list[Costed]:
    """Copy a three-block trace to all N blocks of the stack (see the module docstring).

    Three, not two: the tracer may lower block 0 differently from the blocks
    after it (once block 0 has guarded a size, block 1 slices a mask buffer
    as a plain alias), so block 1 is the template for interior blocks and
    block 2, whose consumers are the suffix, the template for the last one.
    """
    P, N = stack.path, stack.size
    assert N >= TRACED_BLOCKS + 1
    first: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n.block is not None and n.block not in first:
            first[n.block] = i
    if sorted(first) != [0, 1, 2]:
        raise NotRepeating(f"traced blocks {sorted(first)} instead of [0, 1, 2]")
    f1, f2 = first[1], first[2]
    length = f2 - f1
    seg1, seg2 = nodes[f1:f2], nodes[f2 : f2 + length]
    head, suffix = nodes[:f1], nodes[f2 + length :]
    if len(seg2) != length or any(n.block in (1, 2) for n in suffix) or any(n.block == 1 for n in seg2):
        raise NotRepeating("block 2 is not laid out like block 1")
    pos1 = {n.name: p for p, n in enumerate(seg1)}
    pos2 = {n.name: p for p, n in enumerate(seg2)}
    seg0_names = {n.name for n in head if n.block == 0}

    # How block 2 (and every later block) wires its inputs: ("local", q), ("prev", q) or ("shared", name).
    wiring: list[list[tuple[str, object]]] = []
    for a, c in zip(seg1, seg2):
        same = (a.op == c.op and a.target == c.target and a.output == c.output
                and a.cost.forward_flops == c.cost.forward_flops
                and _rename(a.module_path, P, 1, 2) == c.module_path and len(a.inputs) == len(c.inputs)
                and tuple(_rename(x, P, 1, 2) for x in a.params) == c.params)
        if not same:
            raise NotRepeating(f"{a.name} ({a.op}) in block 1 differs from {c.name} ({c.op}) in block 2")
        w: list[tuple[str, object]] = []
        for x, y in zip(a.inputs, c.inputs):
            if y in pos2:
                if pos1.get(x) != pos2[y]:
                    raise NotRepeating(f"{c.name} reads {y} inside block 2 but {a.name} reads {x}")
                w.append(("local", pos2[y]))
            elif y in pos1:
                if x not in seg0_names:
                    raise NotRepeating(f"{c.name} reads block 1's {y} where {a.name} reads {x}, not block 0")
                w.append(("prev", pos1[y]))
            else:
                if x != y:
                    raise NotRepeating(f"{c.name} reads {y} where {a.name} reads {x}")
                w.append(("shared", y))
        wiring.append(w)

    def name(j: int, p: int) -> str:
        return seg1[p].name if j == 1 else f"{seg1[p].name}__{j}"

    out = list(head) + list(seg1)
    for j in range(2, N):
        # Interior blocks take block 1's costs (their consumers are blocks); the
        # last takes block 2's (its consumers are the suffix, as in the model).
        src, src_idx = (seg1, 1) if j < N - 1 else (seg2, 2)
        for p, (n, w) in enumerate(zip(src, wiring)):
            inputs = tuple(name(j, q) if kind == "local" else name(j - 1, q) if kind == "prev" else q
                           for kind, q in w)
            out.append(dataclasses.replace(
                n, name=name(j, p), inputs=inputs,
                params=tuple(_rename(x, P, src_idx, j) for x in n.params),
                module_path=_rename(n.module_path, P, src_idx, j),
                block=j if n.block is not None else None))
    for n in suffix:
        if any(x in seg0_names for x in n.inputs):
            raise NotRepeating(f"{n.name} after the stack reads block 0 directly")
        inputs = tuple(name(N - 1, pos2[x]) if x in pos2 else name(N - 2, pos1[x]) if x in pos1 else x
                       for x in n.inputs)
        out.append(dataclasses.replace(n, inputs=inputs))
    return out
