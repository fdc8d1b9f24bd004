"""The model as code that a plan carries: prefix, block templates and suffix (`ModelCode`), each a
plain Python function over ATen ops (`Segment`). `partitioner.codegen.segments.extract` cuts them from
the exported graph when a plan is compiled; the code generators write them into stage programs. Plain
data, so the plan (and its JSON) holds it without knowing how it was cut."""

from __future__ import annotations

import dataclasses

from torch import fx

from cost_models.errors import PartitionerError

__all__ = ["ModelCode", "Segment", "SegmentError", "describe"]


class SegmentError(PartitionerError):
    """The model's graph cannot be cut into prefix, block and suffix functions."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Segment:
    """One function of the model's code.

    source: `def <name>(tp, <inputs>, <model inputs>, <param and buffer arguments>)` returning one
        tensor (the suffix: the model's flat outputs, a tuple).
    inputs: argument names of what flows in (the prefix: the model's own inputs; else ("x",)).
    model_inputs: model inputs a block or the suffix reads besides (labels, an attention mask),
        passed as `input_<name>`: every pipeline rank has the batch, so no stage sends them.
    params/buffers: (argument, name in the model); a block's names hold "{i}" for its index.
    outputs: where values besides the hidden state cross the cuts (`ModelCode.carried`), the names of those the
        prefix or a block returns, in order (a tuple), the hidden state "x" first; () where it returns x alone.
    indexed: a block that takes its own index in the stack as `block_index` (the layer loop's ops for it:
        partitioner.codegen.segment_glue).
    """

    name: str
    source: str
    inputs: tuple[str, ...]
    model_inputs: tuple[str, ...]
    params: tuple[tuple[str, str], ...]
    buffers: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...] = dataclasses.field(default=(), metadata={"omit_default": True})
    indexed: bool = dataclasses.field(default=False, metadata={"omit_default": True})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelCode:
    """The model's code for one tensor-parallel degree. Without a layer stack the prefix is the
    whole model (block and suffix None, and only pp = 1 can run it)."""

    stack: str | None
    num_blocks: int
    tp: int
    prefix: Segment
    block: Segment | None  # the template of the blocks of kind 0 (of every block in a uniform stack)
    suffix: Segment | None
    output_spec: str  # torch.utils._pytree.treespec_dumps of the model's output structure
    # the hidden state's shape at every cut: an int, or (model input, dim) for a traced size, so a
    # receiving stage knows its buffer without a shape message; None when blocks change it
    # (model input, dim, k): that size divided by k (the tokens split over the tensor group under sequence
    # parallelism)
    hidden_shape: tuple[int | tuple[str, int] | tuple[str, int, int], ...] | None = None
    # a stack whose blocks are not all alike (partitioner.tracer.block_kinds): the templates of kinds 1, 2, ...
    # (functions block_1, block_2, ...) and the kind of every block; () when all are kind 0
    other_blocks: tuple[Segment, ...] = ()
    block_kinds: tuple[int, ...] = ()
    # Megatron sequence parallelism (partitioner.planner.sequence_split): the code runs the ops between tensor-split
    # regions on 1/tp of the tokens, and every cut carries this rank's slice along this dim; None without it
    sp_dim: int | None = None
    # expert parallelism (partitioner.codegen.segment_ep): the code runs each MoE layer's experts over the ep group;
    # experts: every batched expert weight (name, number of experts along dim 0), moe_layers: MoE layers per
    # forward, top_k: the router's k; all empty without ep, except where the model computes its routers'
    # load-balancing loss (at ep = 1 too: the code then takes the ep context and computes the loss over every
    # rank's tokens)
    experts: tuple[tuple[str, int], ...] = dataclasses.field(default=(), metadata={"omit_default": True})
    moe_layers: int = dataclasses.field(default=0, metadata={"omit_default": True})
    top_k: int = dataclasses.field(default=0, metadata={"omit_default": True})
    # the code casts as the model's forward does (partitioner.tracer.upcasts.casts_known): under mixed precision it
    # runs as it is, in the dtypes the module itself computes in; False (and plans saved before) under autocast to
    # the compute dtype, which makes up for casts to the parameters' dtype lost at trace time
    exact_casts: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # parameters that train nothing (requires_grad=False: RoFormer's sinusoidal position table), which every segment
    # reading them computes from as from a buffer: held by each stage that reads one, never tied between stages
    frozen: tuple[str, ...] = dataclasses.field(default=(), metadata={"omit_default": True})
    # the sequence lengths the code holds at (OpGraph.seq_lengths: a table of positions, or a branch on the length
    # that the trace took one way), (lo, hi) with hi None for no end; None: any
    seq_lengths: tuple[int, int | None] | None = dataclasses.field(default=None, metadata={"omit_default": True})

    @property
    def carried(self) -> tuple[str, ...]:
        """What crosses each cut between blocks: ("x",), the hidden state alone, unless values besides it do
        (Zamba's input embeddings that its hybrid layers read again, HunYuan's top-k indices that a layer hands to
        the next ones): then every name a function returns, "x" first, in the order a pipeline sends them. A
        block takes the ones it reads (`Segment.inputs`) and returns the ones it writes (`Segment.outputs`); a
        value no function has written yet crosses as None."""
        names = {n for s in (self.prefix, *self.templates) for n in s.outputs}
        return ("x", *sorted(names - {"x"}, key=lambda n: int(n.rpartition("_")[2])))

    @property
    def aux_loss(self) -> bool:
        """Whether the suffix computes the router's load-balancing loss over every rank's tokens (ep_aux_loss)."""
        return self.suffix is not None and "ep_aux_loss(" in self.suffix.source

    @property
    def templates(self) -> tuple[Segment, ...]:
        """One block function per kind, kind k at index k."""
        return ((self.block,) if self.block is not None else ()) + self.other_blocks

    def kind_of(self, i: int) -> int:
        return self.block_kinds[i] if self.block_kinds else 0

    def template(self, i: int) -> Segment | None:
        """The code block i runs."""
        return self.templates[self.kind_of(i)] if self.block is not None else None

    def block_params(self, i: int) -> tuple[str, ...]:
        t = self.template(i)
        return tuple(n.format(i=i) for _, n in t.params) if t is not None else ()

    def read_params(self) -> frozenset[str]:
        """The names under which the code reads parameters, every block's included. A parameter the traced
        forward never read (DeepSeek-V4's compressor below its window) is not among them: one process leaves it
        without a gradient, and the stages keep it frozen (runtime.pipeline.stage)."""
        edges = [s for s in (self.prefix, self.suffix) if s is not None]
        return frozenset({n for s in edges for _, n in s.params}
                         | {n for i in range(self.num_blocks) for n in self.block_params(i)})


def describe(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    where = list(stack.values())[-1][0] if stack else "the model's forward"
    return f"{n.name} ({n.target} in {where or 'the root module'})"
