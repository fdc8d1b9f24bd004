"""A pipeline rank's model: its stages' parameters, tensor shards, and the generated code that runs them.

`StageModel` takes the user's full model (built by `model_fn` on every rank,
never re-traced) and the generated segment functions (prefix, block, suffix)
and keeps only what this rank's virtual stages need:

- blocks of other stages are replaced by empty modules, and parameters of the
  prefix/suffix this rank does not run are dropped (names of the rest are
  unchanged, so checkpoints and the plan speak the same names);
- tensor-parallel parameters are cut to this rank's shard (`shard_parameter`);
- each kept block's `forward` becomes the generated block function over its
  own parameters, so module hooks (ZeRO-3 gathers) still fire per block;
- the root's `forward(*inputs, _stage=s)` runs virtual stage s: the prefix
  on stage 0, its blocks, the suffix on the last stage;
- with recompute, each block runs under runtime.engines.recompute: "full" keeps only
  its input, "selective" the outputs of its matrix products and layer norms;
- with torch_compile, each segment function runs compiled (runtime.engines.compiled),
  inside the recomputation and the module hooks.

Parameters used by stages on different pipeline ranks (a tied embedding and
LM head) are *tied*: each holder keeps its copy outside the data-parallel
engine (`self.tied`); their gradients are summed over the holders and
averaged over the replicas by `PipelineRunner` (Megatron's embedding group).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from cost_models.placements import REPLICATED, is_sharded
from runtime.device import place, place_module, rank_device
from runtime.engines.compiled import compile_function
from runtime.engines.recompute import run_recomputed
from runtime.pipeline.carry import pack, unpack
from runtime.pipeline.tensor_parallel import keep_token_shards, shard_parameter

__all__ = ["StageModel", "StageSpec", "check_lengths"]

# stage index -> (first block, end block, runs prefix, runs suffix)
StageSpec = tuple[int, int, bool, bool]


def _split(name: str) -> tuple[str, str]:
    mod, _, attr = name.rpartition(".")
    return mod, attr


class _WithContext:
    """A segment function of a context-parallel plan, `fn(tp, cp, ...)`, called as `fn(tp, ...)`."""

    def __init__(self, fn: Callable, cp: Any):
        self.fn, self.cp = fn, cp

    def __call__(self, tp: Any, *args: Any, **kwargs: Any) -> Any:
        return self.fn(tp, self.cp, *args, **kwargs)


def check_lengths(named: Mapping[str, Any], lengths: tuple[int, int | None] | None, cp_world: int = 1) -> None:
    """Refuse token inputs (integer tensors of 2 or more dims, the sequence along dim 1, as traced) whose length
    lies outside `lengths` (ModelCode.seq_lengths; None: any): the code took one branch of a model that branches
    on its length, so at another it would compute something else than the module, silently. Under context
    parallelism a rank holds 1/cp_world of each row's tokens."""
    if lengths is None:
        return
    lo, hi = lengths
    for name, x in named.items():
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.dtype.is_floating_point or x.dtype == torch.bool:
            continue
        s = x.shape[1] * cp_world
        if s < lo or (hi is not None and s > hi):
            span = f"{lo} to {hi}" if hi is not None else f"{lo} or more"
            raise ValueError(f"input {name!r} has sequence length {s}, but the plan's code holds for lengths {span} "
                             "only, the range torch.export traced it for (the model reads a table of positions that "
                             "long, or branches on its length and the example's took one branch); compile with "
                             "example inputs of the length the training passes (one plan per range of lengths)")


class StageModel:
    """Prunes `model` in place to this rank's stages; `self.module` is what the engine wraps."""

    def __init__(self, model: nn.Module, *, functions: Mapping[str, Callable], stack: str | None,
                 input_names: Sequence[str], block_inputs: Sequence[Sequence[str]] = (),
                 block_kinds: Sequence[int] = (), suffix_inputs: Sequence[str] = (),
                 prefix_args: Sequence[tuple[str, str]], block_args: Sequence[Sequence[tuple[str, str]]],
                 suffix_args: Sequence[tuple[str, str]], output_spec: str | None, stages: Mapping[int, StageSpec],
                 placements: Mapping[str, tuple[str, int]], tied: Sequence[str], tp: Any = None,
                 tp_rank: int = 0, tp_world: int = 1, recompute: str = "none",
                 recompute_blocks: tuple[int, int] = (1, 1), cp: Any = None,
                 torch_compile: str = "", ep: Any = None, experts: Mapping[str, tuple[int, int]] | None = None,
                 seq_lengths: tuple[int, int | None] | None = None,
                 carry: Mapping[str, tuple[Sequence[str], Sequence[str]]] | None = None,
                 block_indexed: Sequence[bool] = ()):
        # torch_compile: the backend each segment function (prefix, every block kind, suffix) is compiled with
        # (runtime.engines.compiled); recomputation and the blocks' module hooks stay outside; "": eager
        if torch_compile:
            functions = {k: compile_function(f, torch_compile) for k, f in functions.items()}
        # ep / experts: an expert-parallel plan's group (runtime.experts.program.EPContext), bound like cp, and
        # the batched expert weights this rank holds: name -> its experts [lo, hi) along dim 0, kept apart from
        # the module (self.experts) as tied parameters are, for runtime.experts.engine.ExpertParallel
        experts = dict(experts or {})
        # cp: a context-parallel plan's group (runtime.context.program.CPContext); its code's functions take it
        # after `tp`, bound here so that every caller passes tp first as it does without cp
        functions = {k: _WithContext(f, cp) for k, f in functions.items()} if cp is not None else functions
        functions = {k: _WithContext(f, ep) for k, f in functions.items()} if ep is not None else functions
        self.has_ep = ep is not None  # the module's own forward computes neither ep nor the loss over ranks
        # the sequence lengths the code holds at (the model branched on its length while traced), and the
        # context-parallel degree that splits each row's tokens over ranks
        self.seq_lengths, self._cp_world = seq_lengths, getattr(cp, "world", 1)
        # the ep context sees each stage's forward start and end (a new record of router logits; under pp > 1
        # the load-balancing loss's sums carried from stage to stage: runtime.experts.pipeline_aux)
        self.ep = ep if hasattr(ep, "enter_stage") else None
        self.module, self.functions, self.stack, self.stages = model, dict(functions), stack, dict(stages)
        # where values besides the hidden state cross the cuts (partitioner.codegen.segment_carry): per function,
        # the names of those it takes and returns; the names of all, in the order a pipeline cut packs them
        self.carry = {k: (tuple(i), tuple(o)) for k, (i, o) in (carry or {}).items()}
        self.carried = ("x", *sorted({n for _, o in self.carry.values() for n in o} - {"x"},
                                     key=lambda n: int(n.rpartition("_")[2])))
        # per kind of block (kind 0 runs functions["block"], kind k functions[f"block_{k}"]): its
        # parameter arguments and the model inputs it reads; block_kinds: the kind of every block
        self.prefix_args, self.block_args, self.suffix_args = tuple(prefix_args), \
            tuple(tuple(a) for a in block_args), tuple(suffix_args)
        self.block_kinds = tuple(block_kinds)
        # per kind: whether its function takes the block's index (`block_index`: the layer loop's ops for one
        # block, run in it: partitioner.codegen.segment_glue)
        self.block_indexed = tuple(block_indexed)
        self.out_spec = pytree.treespec_loads(output_spec) if output_spec else None
        # recompute_blocks (k, n): only the first k of every n blocks (by index in the stack) recompute
        self.tp, self.recompute, self.recompute_blocks = tp, recompute, tuple(recompute_blocks)
        self.input_names, self.block_inputs, self.suffix_inputs = tuple(input_names), \
            tuple(tuple(x) for x in block_inputs), tuple(suffix_inputs)
        self.cast: torch.dtype | None = None  # mixed precision: tied parameters enter the code in this dtype
        # mixed precision: run the code under autocast to `cast` (set False by programs whose code casts as the
        # model does: partitioner.tracer.upcasts)
        self.autocast = True

        blocks = sorted({i for a, b, _, _ in self.stages.values() for i in range(a, b)})
        need = set()
        for a, b, pre, suf in self.stages.values():
            if pre:
                need |= {n for _, n in self.prefix_args}
            if suf:
                need |= {n for _, n in self.suffix_args}
            for i in range(a, b):
                need |= {n.format(i=i) for _, n in self.block_args[self.kind(i)]}
        aliases: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(n)
        first = {id(p): n for n, p in model.named_parameters()}

        # other stages' blocks: gone (their buffers too)
        container = model.get_submodule(stack) if stack is not None else None
        if container is not None:
            for i in range(len(container)):
                if i not in blocks:
                    container[i] = nn.Module()
        # what any stage reads: a parameter of this rank's part that none does (DeepSeek-V4's compressor, traced
        # below its window) trains nothing, as in one process, where it gets no gradient: kept, frozen, so the
        # engines hold it apart from the trained ones (and the state dict has it, unchanged)
        read = {n for _, n in (*self.prefix_args, *self.suffix_args)}
        if container is not None:
            read |= {n.format(i=i) for i in range(len(container)) for _, n in self.block_args[self.kind(i)]}
        # parameters no stage of this rank reads: dropped; tensor-parallel ones: cut to the shard
        self.tied: dict[str, nn.Parameter] = {}
        self.experts: dict[str, nn.Parameter] = {}
        self._alias_of: dict[str, str] = {}
        for pid, names in aliases.items():
            canon = first.get(pid, names[0])
            try:
                p = model.get_parameter(names[0])
            except AttributeError:
                continue  # lived in a removed block
            if not any(n in read for n in names):
                p.requires_grad_(False)
            elif not any(n in need for n in names):
                for n in names:
                    mod, attr = _split(n)
                    model.get_submodule(mod)._parameters[attr] = None
                continue
            spec, fused = placements.get(canon, (REPLICATED, 1))
            if is_sharded(spec) and tp_world > 1:
                p = nn.Parameter(shard_parameter(p.data, spec, tp_rank, tp_world, fused), requires_grad=p.requires_grad)
            if canon in experts:  # this rank's experts only, outside the data-parallel engine
                lo, hi = experts[canon]
                self.experts[canon] = nn.Parameter(p.data[lo:hi].clone(), requires_grad=p.requires_grad)
            if canon in tied:
                self.tied[canon] = p
            for n in names:
                mod, attr = _split(n)
                model.get_submodule(mod)._parameters[attr] = None if canon in tied or canon in experts else p
            for n in names:
                self._alias_of[n] = canon

        if container is not None:
            for i in blocks:
                container[i].forward = functools.partial(self._block, i)
                container[i].forward.recomputable = True  # runtime.engines.recompute may wrap it once
        model.forward = self._stage
        # What this rank keeps, on its device: after pruning and slicing, so no GPU holds the full model.
        place_module(model)
        for p in (*self.tied.values(), *self.experts.values()):
            p.data = place(p.data)
        # run_as_model only: the module runs its own forward, blocks included (the batch is not the traced one)
        self.eager = False
        # what the model's output passes through on the stage that makes it (a pipeline's fp16 loss scale)
        self.on_output: Callable[[Any], Any] | None = None

    # ---- what the generated functions read --------------------------------------------------
    def _get(self, name: str) -> torch.Tensor:
        canon = self._alias_of.get(name, name)
        if canon in self.experts:
            p = self.experts[canon]
            return p if self.cast is None else p.to(self.cast)
        if canon in self.tied:
            p = self.tied[canon]
            return p if self.cast is None else p.to(self.cast)
        mod, attr = _split(name)
        return getattr(self.module.get_submodule(mod), attr)  # a ZeRO-3 unit's gathered view, when sharded

    def _args(self, table: Sequence[tuple[str, str]], i: int | None = None) -> dict[str, torch.Tensor]:
        return {a: self._get(n if i is None else n.format(i=i)) for a, n in table}

    def kind(self, i: int) -> int:
        return self.block_kinds[i] if self.block_kinds else 0

    def _block(self, i: int, x: torch.Tensor, *args: Any, **model_inputs: Any) -> torch.Tensor:
        if self.eager:  # called by the module's own forward, with its own arguments
            block = self.module.get_submodule(self.stack)[i]
            return type(block).forward(block, x, *args, **model_inputs)
        k = self.kind(i)
        fn = self.functions["block" if k == 0 else f"block_{k}"]
        k_of, n_of = self.recompute_blocks
        mode = self.recompute if i % n_of < k_of else "none"
        if self.block_indexed and self.block_indexed[k]:
            model_inputs["block_index"] = i
        return run_recomputed(mode, fn, self.tp, x, *args, **model_inputs, **self._args(self.block_args[k], i))

    def named_inputs(self, inputs: Any) -> dict[str, Any]:
        """A microbatch's model inputs by the forward's argument names (a dict, a tuple, or one tensor)."""
        if isinstance(inputs, dict):
            return dict(inputs)
        values = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if len(values) != len(self.input_names):
            raise ValueError(f"the batch gives {len(values)} model input(s), but the plan's code was traced with "
                             f"{len(self.input_names)} ({', '.join(self.input_names)}): pass the inputs the model "
                             "was compiled with (e.g. (idx, targets) for a model that computes its own loss)")
        return dict(zip(self.input_names, values))

    def _stage(self, x: Any, inputs: Any, _stage: int = 0) -> Any:
        if self.tp is not None and self.tp.world > 1:  # sequence parallelism keeps its gathered inputs as shards
            with keep_token_shards():
                out = self._cast_stage(x, inputs, _stage)
        else:
            out = self._cast_stage(x, inputs, _stage)
        if self.on_output is not None and self.stages[_stage][3]:
            out = self.on_output(out)  # the model's output: fp16's loss scale enters here, once
        return out

    def _cast_stage(self, x: Any, inputs: Any, _stage: int = 0) -> Any:
        if self.cast is None or not self.autocast:
            return self._run_stage(x, inputs, _stage)
        # Code whose casts the tracer could not tell apart (partitioner.tracer.upcasts: the fp64 export failed):
        # a cast to the parameters' dtype that was a no-op at trace time may be missing (HF's rotary tables
        # `.to(x.dtype)`), so a table computed in fp32 meets 16-bit activations (SDPA refuses q/k in fp32 beside
        # a bf16 v). Autocast to the compute dtype puts matmuls and attention in it, as the model's casts did.
        # Programs whose code casts as the model does turn it off: on a GPU autocast also runs norms, softmax and
        # powers on an fp32 copy of their input, which backward keeps, where the module's own forward does not.
        with torch.autocast(device_type=rank_device().type, dtype=self.cast):
            return self._run_stage(x, inputs, _stage)

    def _run_stage(self, x: Any, inputs: Any, _stage: int = 0) -> Any:
        a, b, pre, suf = self.stages[_stage]
        named = self.named_inputs(inputs)
        check_lengths(named, self.seq_lengths, self._cp_world)
        if self.ep is not None:
            x = self.ep.enter_stage(_stage, x, first=pre)
        if self.carry:
            return self._run_carrying(x, named, _stage)
        if pre:
            x = self.functions["prefix"](self.tp, *(named[n] for n in self.input_names), **self._args(self.prefix_args))
        container = self.module.get_submodule(self.stack) if self.stack is not None else None
        for i in range(a, b):
            x = container[i](x, **{f"input_{n}": named[n] for n in self.block_inputs[self.kind(i)]})
        if self.ep is not None:
            x = self.ep.leave_stage(_stage, x, last=suf)
        if suf and "suffix" in self.functions:
            x = self.functions["suffix"](self.tp, x, **{f"input_{n}": named[n] for n in self.suffix_inputs},
                                         **self._args(self.suffix_args))
        if (suf or self.stack is None) and self.out_spec is not None:
            flat = list(x) if isinstance(x, (tuple, list)) else [x]
            return pytree.tree_unflatten(flat, self.out_spec)
        return x

    def _run_carrying(self, x: Any, named: dict[str, Any], stage: int) -> Any:
        """`_run_stage` where values besides the hidden state cross the cuts: the blocks read and write a state
        of named values; a stage before the last hands all of it on as one tensor (runtime.pipeline.carry)."""
        a, b, pre, suf = self.stages[stage]
        if pre:
            outs = self.functions["prefix"](self.tp, *(named[n] for n in self.input_names),
                                            **self._args(self.prefix_args))
            state = dict(zip(self.carry["prefix"][1], outs))
        else:
            state = dict(zip(self.carried, unpack(x, len(self.carried))))
        container = self.module.get_submodule(self.stack)
        for i in range(a, b):
            k = self.kind(i)
            reads, writes = self.carry["block" if k == 0 else f"block_{k}"]
            outs = container[i](*(state[n] if n in state else None for n in reads),
                                **{f"input_{n}": named[n] for n in self.block_inputs[k]})
            state.update(zip(writes, outs))
        if not suf:
            x = pack([state.get(n) for n in self.carried])
            return self.ep.leave_stage(stage, x, last=False) if self.ep is not None else x
        x = state["x"]
        if self.ep is not None:
            x = self.ep.leave_stage(stage, x, last=True)
        x = self.functions["suffix"](self.tp, *(state[n] if n in state else None for n in self.carry["suffix"][0]),
                                     **{f"input_{n}": named[n] for n in self.suffix_inputs},
                                     **self._args(self.suffix_args))
        if self.out_spec is not None:
            return pytree.tree_unflatten(list(x) if isinstance(x, (tuple, list)) else [x], self.out_spec)
        return x

    def run_as_model(self) -> None:
        """Make the module's forward take the model's own inputs and run its one stage (the whole model): a
        data-parallel program whose model runs the generated code (eager attention rewritten to a fused
        kernel) rather than its own forward, under an engine that calls it as the module.

        The code computes what the module computed for the traced inputs. A batch with other inputs (a model
        traced with its targets, trained without: its forward takes them as optional) runs the module's own
        forward from then on, with a warning: the same training, but its attention runs as written, not as
        the plan costed it. Not where the code takes the ep context (expert parallelism, or the router's
        load-balancing loss over every rank's tokens): the module's own forward would train otherwise, so such
        a batch is refused."""
        if len(self.stages) != 1 or not all(pre and suf for _, _, pre, suf in self.stages.values()):
            raise ValueError(f"run_as_model needs one stage holding the whole model, not stages {self.stages}")
        stage = next(iter(self.stages))
        own = type(self.module).forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            given = tuple(kwargs) if kwargs else len(args)
            if not self.eager and given not in (len(self.input_names), tuple(self.input_names)):
                if self.has_ep:
                    raise ValueError(
                        f"the batch gives {given if kwargs else f'{given} input(s)'}, but the plan's code was traced "
                        f"with {', '.join(self.input_names)}, and the model's own forward cannot stand in for it: "
                        "the code runs the experts over the ep group or the router's load-balancing loss over "
                        "every rank's tokens; compile with example inputs shaped as the training passes them")
                warnings.warn(f"the batch gives {given if kwargs else f'{given} input(s)'}, but the plan's code was "
                              f"traced with {', '.join(self.input_names)}: the model runs its own forward, so its "
                              "eager attention does not run fused as the plan's time and memory assume; trace "
                              "with the inputs the training passes", RuntimeWarning, stacklevel=2)
                self.eager = True
            if self.eager:  # frozen parameters the code never read would not train at a length that reads them
                check_lengths(kwargs or {f"input {i}": a for i, a in enumerate(args)}, self.seq_lengths, self._cp_world)
                return own(self.module, *args, **kwargs)
            return self._stage(None, kwargs if kwargs else args, stage)

        self.module.forward = forward

    def stage_callable(self, s: int) -> Callable:
        """What the pipeline executor runs for virtual stage s, as stage(x, model inputs): the root
        module's call, so the data-parallel engine's hooks fire."""
        return lambda x, inputs: self.module(x, inputs, _stage=s)


def state_keys(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """(state_dict key, the name its tensor is gathered under): tied aliases map to the first name."""
    first = {id(p): n for n, p in model.named_parameters()}
    alias = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    return tuple((k, alias.get(k, k)) for k in model.state_dict(keep_vars=True))
