"""Repeated blocks: find the model's layer stack, trace a few layers, copy the rest.

A 175B GPT has 96 identical blocks; tracing each one costs time linear in
depth with a large constant (torch.export of HF GPT-3 175B alone takes about
16 s here). Blocks of one kind (partitioner.tracer.block_kinds) with no shared
tensors compute the same graph, so the tracer captures a shallow copy of the
model whose stack holds only its first blocks, checks that block 2's graph is
block 1's graph (same ops, shapes and wiring, with block 1's inputs from
block 0 becoming block 2's inputs from block 1), and writes the remaining
blocks as renamed copies.

A stack whose kinds repeat with a period after a head (Gemma3's alternating
sliding/full attention: kinds 0 1 0 1 ..., offset 0, period 2; DeepSeek-V3's
dense first layer: 0 1 1 1 ..., offset 1, period 1) is copied the same way
with *super-blocks* of `period` consecutive blocks in the role of blocks,
after `offset` head blocks that are traced and kept as they are:

    kinds     0 | 1 2 | 1 2 | 1 2 | 1 2 | 1 2      offset 1, period 2, N = 11
    traced    0 | 1 2 | 3 4 | 5 6                  Repeat(offset=1, period=2).traced = 7
    copied                      7 8 | 9 10          super-block 1 (blocks 3 4) to 7 8, 2 (5 6) to 9 10

`tests/test_trace.py` checks the copied graph against a full trace node by node.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

from torch import nn

from partitioner.tracer.opgraph import OpCost, TensorSpec

TRACED_BLOCKS = 3  # (super-)blocks captured before copying; see expand()

__all__ = ["TRACED_BLOCKS", "LayerStack", "Repeat", "find_layer_stack", "truncated", "block_index", "Costed", "expand",
           "NotRepeating"]


class NotRepeating(Exception):
    """Super-block 2's graph is not a copy of super-block 1's: trace the whole model instead."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Repeat:
    """How a stack repeats: `offset` head blocks, then super-blocks of `period` blocks, all alike.

    >>> Repeat(offset=1, period=2).traced     # the head, then super-blocks 0, 1 and 2
    7
    """

    offset: int = 0
    """Blocks before the first super-block (DeepSeek-V3's dense first layer: 1), traced and kept."""
    period: int = 1
    """Blocks per super-block (alternating sliding-window and full attention: 2)."""

    @property
    def traced(self) -> int:
        return self.offset + TRACED_BLOCKS * self.period

    def fits(self, kinds: tuple[int, ...]) -> bool:
        """Whether a stack of these block kinds can be traced as `traced` blocks and copied: kinds[i] ==
        kinds[i + period] from the offset on, whole super-blocks, and more blocks than are traced."""
        n, o, p = len(kinds), self.offset, self.period
        return n > self.traced and (n - o) % p == 0 and all(kinds[i] == kinds[i + p] for i in range(o, n - p))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerStack:
    path: str  # module path of the ModuleList/Sequential ("" for the root)
    size: int
    module_type: str
    uniform: bool  # same class, same parameter/buffer shapes, nothing shared
    shared: bool = False  # some parameter is held by two blocks (ALBERT-style): never copied


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
            uniform = len({_signature(c) for c in children}) == 1 and len(ids) == len(set(ids))
            types = Counter(type(c).__name__ for c in children).most_common(1)[0][0]
            best = LayerStack(path=path, size=len(children), module_type=types, uniform=uniform,
                              shared=len(ids) != len(set(ids)))
            best_key = key
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


def _shift(name: str, stack_path: str, lo: int, hi: int, delta: int) -> str:
    """`name` with its block index i moved to i + delta when lo <= i < hi (a module path or parameter
    name inside the stack); any other name unchanged."""
    i = block_index(name, stack_path)
    if i is None or not lo <= i < hi:
        return name
    old = f"{stack_path}.{i}" if stack_path else str(i)
    new = f"{stack_path}.{i + delta}" if stack_path else str(i + delta)
    return new + name[len(old):]


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
    # the node's number arguments: blocks that differ only in one (a scale folded into a fused attention,
    # partitioner.tracer.attention) compute different things and are not copies of one another
    scalars: tuple = ()


def expand(nodes: list[Costed], stack: LayerStack, repeat: Repeat = Repeat()) -> list[Costed]:
    """Copy a trace of the first `repeat.traced` blocks to all N blocks of the stack (see the module docstring).

    Super-block J holds blocks o + J p .. o + J p + p - 1 (offset o, period p); the o head blocks
    before super-block 0 stay as traced. Three super-blocks, not two: the tracer may lower the first
    differently from those after it (once block 0 has guarded a size, block 1 slices a mask buffer
    as a plain alias), so super-block 1 is the template for interior super-blocks and super-block 2,
    whose consumers are the suffix, the template for the last one. A copy of node `n` into block j
    is named `n__j` (super-block 1 keeps its traced names).
    """
    P, N, o, p = stack.path, stack.size, repeat.offset, repeat.period
    assert N > repeat.traced and (N - o) % p == 0, (N, repeat)
    count = (N - o) // p  # super-blocks
    b1, b2, b3 = o + p, o + 2 * p, o + 3 * p  # first blocks of super-blocks 1 and 2, end of the trace
    first: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n.block is not None and n.block not in first:
            first[n.block] = i
    if sorted(first) != list(range(b3)):
        raise NotRepeating(f"traced blocks {sorted(first)} instead of 0..{b3 - 1}")
    f1, f2 = first[b1], first[b2]
    length = f2 - f1
    seg1, seg2 = nodes[f1:f2], nodes[f2 : f2 + length]
    head, suffix = nodes[:f1], nodes[f2 + length :]

    def within(seg: list[Costed], lo: int, hi: int) -> bool:
        return all(n.block is None or lo <= n.block < hi for n in seg)

    if (len(seg2) != length or not within(head, 0, b1) or not within(seg1, b1, b2) or not within(seg2, b2, b3)
            or any(n.block is not None for n in suffix)):
        raise NotRepeating(f"blocks {b2}..{b3 - 1} are not laid out like blocks {b1}..{b2 - 1}")
    pos1 = {n.name: q for q, n in enumerate(seg1)}
    pos2 = {n.name: q for q, n in enumerate(seg2)}
    seg0_names = {n.name for n in head if n.block is not None and n.block >= o}
    # the block inside its super-block of each of super-block 1's nodes (glue goes with the block before it)
    within_block: list[int] = []
    for n in seg1:
        within_block.append(n.block - b1 if n.block is not None else within_block[-1] if within_block else 0)

    # How super-block 2 (and every later one) wires its inputs: ("local", q), ("prev", q) or ("shared", name).
    wiring: list[list[tuple[str, object]]] = []
    for a, c in zip(seg1, seg2):
        same = (a.op == c.op and a.target == c.target and a.output == c.output
                and a.scalars == c.scalars and a.cost.forward_flops == c.cost.forward_flops
                and _shift(a.module_path, P, b1, b2, p) == c.module_path and len(a.inputs) == len(c.inputs)
                and tuple(_shift(x, P, b1, b2, p) for x in a.params) == c.params)
        if not same:
            raise NotRepeating(f"{a.name} ({a.op}) in block {a.block} differs from {c.name} ({c.op}) in block {c.block}")
        w: list[tuple[str, object]] = []
        for x, y in zip(a.inputs, c.inputs):
            if y in pos2:
                if pos1.get(x) != pos2[y]:
                    raise NotRepeating(f"{c.name} reads {y} inside its super-block but {a.name} reads {x}")
                w.append(("local", pos2[y]))
            elif y in pos1:
                if x not in seg0_names:
                    raise NotRepeating(f"{c.name} reads the previous super-block's {y} where {a.name} reads {x}, "
                                       "not super-block 0")
                w.append(("prev", pos1[y]))
            else:
                if x != y:
                    raise NotRepeating(f"{c.name} reads {y} where {a.name} reads {x}")
                w.append(("shared", y))
        wiring.append(w)

    def name(J: int, q: int) -> str:
        return seg1[q].name if J == 1 else f"{seg1[q].name}__{o + J * p + within_block[q]}"

    out = list(head) + list(seg1)
    for J in range(2, count):
        # Interior super-blocks take super-block 1's costs (their consumers are blocks); the last
        # takes super-block 2's (its consumers are the suffix, as in the model).
        src, src_first = (seg1, b1) if J < count - 1 else (seg2, b2)
        delta = o + J * p - src_first
        for q, (n, w) in enumerate(zip(src, wiring)):
            inputs = tuple(name(J, r) if kind == "local" else name(J - 1, r) if kind == "prev" else r
                           for kind, r in w)
            out.append(dataclasses.replace(
                n, name=name(J, q), inputs=inputs,
                params=tuple(_shift(x, P, src_first, src_first + p, delta) for x in n.params),
                module_path=_shift(n.module_path, P, src_first, src_first + p, delta),
                block=n.block + delta if n.block is not None else None))
    for n in suffix:
        if any(x in seg0_names for x in n.inputs):
            raise NotRepeating(f"{n.name} after the stack reads super-block 0 directly")
        inputs = tuple(name(count - 1, pos2[x]) if x in pos2 else name(count - 2, pos1[x]) if x in pos1 else x
                       for x in n.inputs)
        out.append(dataclasses.replace(n, inputs=inputs))
    return out
