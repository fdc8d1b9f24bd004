"""OpGraph: the traced model with, per node, what the cost models need.

Produced by `partitioner.tracer.trace`; consumed by the planner. Plain frozen data:
every node carries a typed `TensorSpec` and `OpCost` whose numbers are
`Poly`s in the microbatch size `b` and the sequence length `s`, so one trace
serves every candidate plan.

>>> import torch
>>> from partitioner import trace
>>> from examples.gpt import gpt_small, example_inputs
>>> with torch.device("meta"):                       # shapes are all it needs: nothing allocated
...     model = gpt_small()
>>> tokens, = example_inputs(model)
>>> g = trace(model, (tokens,))
>>> g.num_params, g.flops(batch_size=8)
(5289472, 34027503616.0)
>>> g.flops(batch_size=8, seq_len=64) < g.flops(batch_size=8) / 2   # every count is a polynomial in b and s
True
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import operator
from typing import Any, Iterable, Literal

from cost_models.errors import TraceError
from partitioner.tracer.attention import SDPA_NAME
from partitioner.tracer.opgraph_table import format_table
from partitioner.tracer.pointwise import FUSED_NAME
from partitioner.tracer.symbolic import Poly

__all__ = ["TensorSpec", "OpCost", "OpNode", "ParamSpec", "Block", "OpGraph"]

OpClass = Literal["matmul", "conv", "attention", "elementwise", "reduction", "embedding", "other"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """A tensor's shape (each dim a Poly in b and s) and dtype name."""

    shape: tuple[Poly, ...]
    dtype: str
    itemsize: int

    def numel(self, b: float = 1, s: float = 1) -> float:
        n = 1.0
        for d in self.shape:
            n *= d(b, s)
        return n

    def nbytes(self, b: float = 1, s: float = 1) -> float:
        return self.numel(b, s) * self.itemsize

    def nbytes_poly(self) -> Poly:
        """Bytes as a Poly in (b, s): the product of the dims times the item size."""
        return functools.reduce(operator.mul, self.shape, Poly.const(1)) * self.itemsize

    def __str__(self) -> str:
        return "(" + ", ".join(str(d) for d in self.shape) + ")"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpCost:
    """What one node costs, per microbatch, as Polys in (b, s).

    forward_flops / backward_flops: floating point operations (a multiply-add
        is 2). Backward includes input- and weight-gradient work, only for
        inputs that require grad.
    bytes_read / bytes_written: memory traffic of the forward at the traced
        dtype (views move nothing).
    activation_bytes: what this node adds to memory kept for backward: its
        output if a consumer saves it (views resolved to the tensor they
        view, so a tensor is counted once), plus internal state such as
        dropout masks.
    op_class: the compute model's class of the op.
    fixed_activation_bytes: the part of activation_bytes that is boolean masks, integer indices and values
        the model keeps fp32 on purpose (a norm's upcast: partitioner.tracer.upcasts), whose size does not
        follow the compute precision (a 16-bit run halves only the rest).
    causal: attention that attends causally (partitioner.tracer.attention.causal_attention): its FLOPs
        count the full L x S products (the model FLOPs of MFU), of which a causal kernel computes half
        (FlashAttention-2 skips the blocks above the diagonal; Dao 2023 counts it so): `executed`.
    """

    forward_flops: Poly
    backward_flops: Poly
    bytes_read: Poly
    bytes_written: Poly
    activation_bytes: Poly
    op_class: OpClass
    fixed_activation_bytes: Poly = Poly()
    causal: bool = False

    @property
    def executed(self) -> float:
        """The share of the counted FLOPs a kernel runs: 1/2 for causal attention, else 1."""
        return 0.5 if self.causal else 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """One unique parameter tensor; tied names listed in `aliases`."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    nbytes: int
    aliases: tuple[str, ...] = ()
    owner: str | None = None  # the first node that uses it
    block: int | None = None
    trainable: bool = True  # requires_grad: False for a frozen parameter (a fixed position table, LoRA's base)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpNode:
    """One operation of the traced graph, in topological order.

    op: canonical op name ("linear", "matmul", "softmax", "view", ...);
    target: the traced target as text; inputs: names of producer nodes;
    params: parameter names it reads (canonical, tied names resolved);
    param_count/param_bytes: parameters it owns (first user of a tied
    parameter owns it, so totals count each tensor once);
    module_path: the innermost module it was called from ("" = root);
    block: index into OpGraph.blocks, None for nodes outside every block.
    """

    name: str
    op: str
    target: str
    inputs: tuple[str, ...]
    output: TensorSpec | None
    cost: OpCost
    params: tuple[str, ...] = ()
    param_count: int = 0
    param_bytes: int = 0
    module_path: str = ""
    module_type: str = ""
    block: int | None = None
    requires_grad: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Block:
    """One repeated block (layer): a child of the model's main layer stack."""

    index: int
    name: str  # module path, e.g. "transformer.h.3"
    module_type: str
    first_node: int  # index into OpGraph.nodes
    last_node: int  # inclusive
    param_count: int
    # blocks of one kind compute the same graph (partitioner.tracer.block_kinds); generated code has one
    # template per kind
    kind: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpGraph:
    """The traced model: nodes in topological order, parameters, blocks.

    traced_batch_size / traced_seq_len: the example's sizes (seq_len None
    when there is no sequence dimension). batch_symbolic is False when the
    model specialised its batch size (e.g. `x.view(8, -1)`): its costs are
    then valid only at the traced batch. expanded_from is the number of
    blocks actually traced when repeated blocks were traced once and copied
    (None for a plain trace of every node).
    """

    nodes: tuple[OpNode, ...]
    params: tuple[ParamSpec, ...]
    blocks: tuple[Block, ...]
    inputs: tuple[TensorSpec, ...]
    dtype: str
    traced_batch_size: int
    traced_seq_len: int | None
    batch_symbolic: bool
    method: Literal["export", "fx"]
    model_name: str
    block_container: str | None = None
    expanded_from: int | None = None
    buffer_bytes: int = 0
    # torch.autograd.Function classes the forward applies (not torch's own) whose backward is not autograd of their
    # forward's ops, which the graph holds, so code cut from it would train differently (tracer.autograd_functions);
    # "module.Name (file:line)"
    custom_functions: tuple[str, ...] = ()
    # the sequence lengths the graph holds at, (lo, hi) with hi None for no end: torch.export's range for the
    # sequence symbol, where the model branches on its length (DeepSeek-V4's compressors run from a window's worth
    # of tokens on) and was traced down one branch; None where only torch.export's own s >= 2 bounds it
    seq_lengths: tuple[int, int | None] | None = None
    graph_module: Any = dataclasses.field(default=None, compare=False, repr=False, hash=False)

    # ---- totals ---------------------------------------------------------
    @property
    def num_params(self) -> int:
        """Unique parameters (tied ones counted once)."""
        return sum(p.numel for p in self.params)

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def frozen_params(self) -> tuple[str, ...]:
        """The parameters that train nothing (requires_grad=False), by name: held, with no gradient or state."""
        return tuple(p.name for p in self.params if not p.trainable)

    def _bs(self, batch_size: int | None, seq_len: int | None) -> tuple[int, int]:
        b = self.traced_batch_size if batch_size is None else batch_size
        if not self.batch_symbolic and b != self.traced_batch_size:
            raise TraceError(
                f"batch_size={b}: the model fixed its batch size to {self.traced_batch_size} while tracing "
                f"(a hard-coded shape such as x.view({self.traced_batch_size}, -1)); use batch_size="
                f"{self.traced_batch_size}, or write the model with x.size(0)/-1 so any batch works"
            )
        s = (self.traced_seq_len or 1) if seq_len is None else seq_len
        return b, s

    def _sum(self, field: str, batch_size: int | None, seq_len: int | None, nodes: Iterable[OpNode] | None = None) -> float:
        b, s = self._bs(batch_size, seq_len)
        return sum(getattr(n.cost, field)(b, s) for n in (self.nodes if nodes is None else nodes))

    def forward_flops(self, batch_size: int | None = None, seq_len: int | None = None) -> float:
        return self._sum("forward_flops", batch_size, seq_len)

    def backward_flops(self, batch_size: int | None = None, seq_len: int | None = None) -> float:
        return self._sum("backward_flops", batch_size, seq_len)

    def flops(self, batch_size: int | None = None, seq_len: int | None = None) -> float:
        """Forward plus backward FLOPs of one training step on `batch_size` samples."""
        return self.forward_flops(batch_size, seq_len) + self.backward_flops(batch_size, seq_len)

    def activation_bytes(self, batch_size: int | None = None, seq_len: int | None = None) -> float:
        """Bytes kept for backward (no recompute) at the traced dtype."""
        return self._sum("activation_bytes", batch_size, seq_len)

    @property
    def attention_rewrites(self) -> int:
        """Eager attentions the tracer rewrote to scaled_dot_product_attention (partitioner.tracer.attention),
        counted over every block."""
        return sum(1 for n in self.nodes if n.op == "scaled_dot_product_attention" and n.name.startswith(SDPA_NAME))

    @property
    def fused(self) -> dict[str, int]:
        """Chains of ops the tracer rewrote to one fused ATen op each (partitioner.tracer.pointwise: GELU and SiLU
        written out; partitioner.tracer.norms: RMSNorm), counted per fused op ({"rms_norm": 9, "silu": 4})."""
        out: dict[str, int] = {}
        for n in self.nodes:
            if n.name.startswith(FUSED_NAME):
                out[n.op] = out.get(n.op, 0) + 1
        return out

    @property
    def rewritten(self) -> bool:
        """Whether the graph runs other kernels than the module's own forward (attention_rewrites, fused): every
        program then runs its generated code, which the costs describe."""
        return bool(self.attention_rewrites or self.fused)

    # ---- structure --------------------------------------------------------
    def node(self, name: str) -> OpNode:
        return self._by_name[name]

    @functools.cached_property
    def _by_name(self) -> dict[str, OpNode]:
        return {n.name: n for n in self.nodes}

    def block_nodes(self, block: int) -> tuple[OpNode, ...]:
        blk = self.blocks[block]
        return self.nodes[blk.first_node : blk.last_node + 1]

    def segments(self) -> list[tuple[str, tuple[OpNode, ...]]]:
        """Consecutive runs of nodes: ("prefix"), each block by name, ("suffix")."""
        out: list[tuple[str, list[OpNode]]] = []
        seen_block = False
        for n in self.nodes:
            if n.block is not None:
                label, seen_block = self.blocks[n.block].name, True
            else:
                label = "suffix" if seen_block else "prefix"
            if not out or out[-1][0] != label:
                out.append((label, []))
            out[-1][1].append(n)
        return [(k, tuple(v)) for k, v in out]

    # ---- identity -------------------------------------------------------
    def fingerprint(self) -> str:
        """sha256 of the graph's structure and costs: plans are tied to it."""
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(json.dumps([n.op, n.inputs, n.params, n.module_path,
                                 [d.to_json() for d in n.output.shape] if n.output else None,
                                 n.cost.forward_flops.to_json()], separators=(",", ":")).encode())
        for p in self.params:
            h.update(f"{p.name}:{p.shape}:{p.dtype}".encode())
        return h.hexdigest()

    # ---- printing ---------------------------------------------------------
    def table(self, batch_size: int | None = None, seq_len: int | None = None, *, per: Literal["node", "block"] = "node") -> str:
        return format_table(self, batch_size=batch_size, seq_len=seq_len, per=per)

    def __str__(self) -> str:
        return self.table(per="block")
