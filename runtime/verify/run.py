"""plan.verify's first half: replica 0's programs built on fresh models and run in one process.

Every (pipeline rank, tensor slice) program of replica 0 is executed and its
own `make_stage(model, tp)` prunes a fresh `model_fn()` to its stages (the
code `build()` runs, without process groups: the stage construction is the
program's, never re-implemented here). Tensor slices run as threads of this
process whose collectives meet in a `LocalGroup` (runtime.verify.local_collectives);
`run_generated` runs virtual stages 0..S-1 in order on one microbatch, hands
the hidden state on as the pipeline executor does (detached, its gradient
sent back), then the loss and backward. Randomness is off on both sides
(`runtime.verify.no_randomness`): dropout is the identity and every draw a fixed value, since the module's
draws and the code's cannot agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from cost_models.errors import PartitionerError
from runtime.engines.step import check_parameters
from runtime.pipeline.program_module import exec_program
from runtime.pipeline.stage import check_lengths
from runtime.pipeline.tensor_parallel import TPContext
from runtime.pipeline.vocab_logits import full_logits
from runtime.verify.local_collectives import LocalCollectiveError, LocalCollectives, LocalGroup
from runtime.verify.no_randomness import NoRandomness

__all__ = ["Facts", "Setup", "VerifyError", "build_module", "call_module", "generic_loss", "on_slices", "plan_facts",
           "program_hash", "run_generated", "setup", "zero_grads"]


class VerifyError(PartitionerError):
    """The generated programs do not compute what the module computes: the message says where."""


# ---- the plan, duck-typed ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Facts:
    """What verify reads from a plan (a Plan, or its JSON dict)."""

    pp: int
    tp: int
    dp: int
    microbatch_size: int
    seq_len: int | None
    ranks: tuple[tuple[int, int, int], ...]  # (rank, pp, tp) of replica 0's ranks
    # the programs run generated model code: always with pp or tp > 1; with pp = tp = 1 when the plan's
    # attention was rewritten to a fused kernel (else they run the module itself)
    has_code: bool = True
    # under sequence parallelism: the dim of the hidden state every cut splits over the tensor slices
    cut_dim: int | None = None


def plan_facts(plan: Any) -> Facts:
    get = (lambda o, k: o[k]) if isinstance(plan, Mapping) else getattr
    c, mesh = get(plan, "config"), get(plan, "mesh")
    ranks = tuple(sorted((get(m, "rank"), get(m, "pp"), get(m, "tp")) for m in mesh if get(m, "dp") == 0))
    code = plan.get("code") if isinstance(plan, Mapping) else getattr(plan, "code", None)
    pp, tp = get(c, "pp"), get(c, "tp")
    cut_dim = None if code is None else code.get("sp_dim") if isinstance(code, Mapping) else code.sp_dim
    return Facts(pp=pp, tp=tp, dp=get(c, "dp"), microbatch_size=get(c, "microbatch_size"),
                 seq_len=get(plan, "seq_len"), ranks=ranks, has_code=code is not None or pp > 1 or tp > 1,
                 cut_dim=cut_dim)


# ---- the setup: the module and every program's stages ------------------------------------


@dataclasses.dataclass(kw_only=True)
class _Rank:
    """One program of replica 0, built: its namespace and StageModel."""

    rank: int
    pp: int
    tp: int
    ns: dict[str, Any]
    source: str
    stage: Any  # runtime.pipeline.stage.StageModel, from the program's make_stage
    params: dict[str, nn.Parameter]  # what it holds, by the module's names (tied copies included)


@dataclasses.dataclass(kw_only=True)
class Setup:
    facts: Facts
    reference: nn.Module
    ranks: dict[tuple[int, int], _Rank]  # (pp, tp) -> built program
    stage_pp: tuple[int, ...]  # virtual stage -> pipeline rank
    group: LocalGroup | None
    inputs: Any
    targets: Any
    loss_fn: Callable | None
    rtol: float
    atol: float

    @property
    def num_stages(self) -> int:
        return len(self.stage_pp)

    def stage_of(self, s: int, t: int) -> Any:
        return self.ranks[(self.stage_pp[s], t)].stage

    def loss(self, out: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(out, self.targets) if self.targets is not None else self.loss_fn(out)
        # a weighting of every element reads vocab-split logits whole: gathered on purpose, not warned about
        return generic_loss(full_logits(out))


def generic_loss(out: Any) -> torch.Tensor:
    """Any output as a scalar: the sum of every floating leaf times fixed random weights (scaled by
    1/size, so a gradient is of the order of a mean's)."""
    total = None
    for i, leaf in enumerate(pytree.tree_leaves(out)):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            g = torch.Generator().manual_seed(1000 + i)
            w = torch.randn(leaf.shape, generator=g, dtype=torch.float32).to(leaf.dtype) / max(1, leaf.numel())
            term = (leaf * w).sum()
            total = term if total is None else total + term
    if total is None:
        raise VerifyError("the model's output holds no floating tensor to take a loss of: pass loss_fn=")
    return total


def build_module(model_fn: Callable) -> nn.Module:
    # seeded as launch_local's workers build it, and without moving the caller's random state
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise VerifyError(f"model_fn() returned {type(model).__name__}, not a torch.nn.Module")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise VerifyError("model_fn() builds the model on the meta device: verify runs it, so pass a model_fn "
                          "that builds it on the CPU (outside `with torch.device('meta')`)")
    return model.float().cpu().train()  # verify runs on the CPU, in fp32, as the module trains (dropout aside)


def _same_start(reference: nn.Module, model: nn.Module, rank: int) -> None:
    ref = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        if n in ref and not torch.equal(p, ref[n]):
            raise VerifyError(f"model_fn() built different weights on two calls (parameter {n}, for the program of "
                              f"rank {rank}), even seeded with torch.manual_seed(0): verify and training build the "
                              "model once per rank and need the same start; make model_fn deterministic")


def _exec(source: str, rank: int) -> dict[str, Any]:
    ns = exec_program(source, f"<program of rank {rank}>", rank=rank, __file__=f"<program of rank {rank}>")
    if not callable(ns.get("make_stage")):
        raise VerifyError(f"the program of rank {rank} defines no make_stage(model, tp): generated by an older "
                          "partitioner? Regenerate it (plan.program(rank)) to verify it")
    return ns


def _held(model: nn.Module, stage: Any) -> dict[str, nn.Parameter]:
    out = dict(model.named_parameters())
    out.update(stage.tied)
    return out


def setup(plan: Any, model_fn: Callable, inputs: Any, targets: Any, loss_fn: Callable | None,
          sources: Mapping[int, str] | None, rtol: float, atol: float) -> Setup:
    facts = plan_facts(plan)
    srcs = {r: (sources[r] if sources is not None else plan.program(r).source) for r, _, _ in facts.ranks}
    hashes = {r: program_hash(s) for r, s in srcs.items()}
    if len(set(hashes.values())) > 1:
        raise VerifyError(f"the programs come from different plans (PROGRAM_HASH per rank: "
                          f"{ {r: h[:12] for r, h in hashes.items()} }); generate every rank's program from one plan")
    reference = build_module(model_fn)
    group = LocalGroup(facts.tp) if facts.tp > 1 else None
    ranks: dict[tuple[int, int], _Rank] = {}
    for r, p, t in facts.ranks:
        ns = _exec(srcs[r], r)
        model = build_module(model_fn)
        _same_start(reference, model, r)
        if "PARAMS" in ns:
            check_parameters(model, ns["PARAMS"])
        tp = TPContext(group, LocalCollectives(t), t, facts.tp) if group is not None else None
        stage = ns["make_stage"](model, tp)
        ranks[(p, t)] = _Rank(rank=r, pp=p, tp=t, ns=ns, source=srcs[r], stage=stage, params=_held(model, stage))
    owner: dict[int, int] = {}
    for (p, t), rk in ranks.items():
        for s in rk.stage.stages:
            if owner.setdefault(s, p) != p:
                raise VerifyError(f"virtual stage {s} is in the programs of pipeline ranks {owner[s]} and {p}: each "
                                  "stage must run on one pipeline rank")
    if sorted(owner) != list(range(len(owner))):
        raise VerifyError(f"the programs run virtual stages {sorted(owner)}, not 0..{len(owner) - 1} each once")
    if inputs is None:
        inputs = default_inputs(facts, reference, next(iter(ranks.values())).stage.input_names)
    elif isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    first = next(iter(ranks.values())).stage
    check_lengths(first.named_inputs(inputs), first.seq_lengths)  # bad input, not a difference: refused first
    return Setup(facts=facts, reference=reference, ranks=ranks, stage_pp=tuple(owner[s] for s in range(len(owner))),
                  group=group, inputs=_cpu(inputs), targets=_cpu(targets), loss_fn=loss_fn, rtol=rtol, atol=atol)


def _cpu(x: Any) -> Any:
    return pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, x)


def program_hash(source: str) -> str:
    """A generated program's PROGRAM_HASH ("" when it has none)."""
    for line in source.splitlines():
        if line.startswith("PROGRAM_HASH = "):
            return line.split("=", 1)[1].strip().strip("'\"")
    return ""


def default_inputs(facts: Facts, model: nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """One microbatch of random token ids for every model input, below the smallest embedding table's rows."""
    tables = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    if not tables:
        raise VerifyError(f"verify cannot make inputs for {type(model).__name__}: it has no embedding table to draw "
                          f"token ids for ({', '.join(names)}); pass inputs=(...) (the model's forward arguments)")
    g = torch.Generator().manual_seed(0)
    shape = (facts.microbatch_size or 2, facts.seq_len or 8)
    return tuple(torch.randint(0, min(tables), shape, generator=g) for _ in names)


# ---- running -----------------------------------------------------------------------------------


def call_module(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(*inputs)


def on_slices(st: Setup, fn: Callable[[int], Any]) -> list[Any]:
    """fn(t) for every tensor slice t, each in its own thread (the main thread when tp = 1), randomness off."""
    tp = st.facts.tp
    if st.group is None:
        with NoRandomness():
            return [fn(0)]
    st.group.reset()
    results: list[Any] = [None] * tp
    errors: list[BaseException | None] = [None] * tp

    def run(t: int) -> None:
        try:
            with NoRandomness():
                results[t] = fn(t)
        except BaseException as exc:  # reported by the caller, after every slice has stopped
            errors[t] = exc
        finally:
            st.group.leave(t, errors[t])

    threads = [threading.Thread(target=run, args=(t,), name=f"verify-slice{t}") for t in range(tp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    raised = [e for e in errors if e is not None]
    if not raised:
        return results
    first = next((e for e in raised if not isinstance(e, LocalCollectiveError)), None)
    if first is not None:  # the slice that failed, not those whose collectives broke because of it
        raise first
    raise VerifyError(f"the tensor slices' programs do not issue the same collectives, so on real process groups "
                      f"they would pair unrelated tensors or hang: {raised[0]}. Every slice must run the same code; "
                      "regenerate the programs from one plan") from raised[0]


def run_generated(st: Setup, t: int) -> tuple[Any, torch.Tensor]:
    """Slice t's stages 0..S-1 on the microbatch, as the pipeline runs them; then loss and backward."""
    ins, outs = [], []
    x = None
    for s in range(st.num_stages):
        inp = None if s == 0 else x.detach().requires_grad_(x.is_floating_point())
        with _raising(st, s, t, "forward"):
            x = st.stage_of(s, t).stage_callable(s)(inp, st.inputs)
        ins.append(inp)
        outs.append(x)
    with _raising(st, st.num_stages - 1, t, "loss and backward"):
        loss = st.loss(x)
        loss.backward()
        # vocab-split logits (runtime.pipeline.vocab_logits) gathered here, in every slice's thread: the caller
        # compares the outputs outside them, where a gather would wait for ever for the other slices
        with torch.no_grad():
            x = full_logits(x)
    for s in range(st.num_stages - 2, -1, -1):
        nxt = ins[s + 1]
        if outs[s].requires_grad:
            with _raising(st, s, t, "backward"):
                outs[s].backward(nxt.grad if nxt.grad is not None else torch.zeros_like(outs[s]))
    return x, loss.detach()


@contextlib.contextmanager
def _raising(st: Setup, s: int, t: int, what: str) -> Iterator[None]:
    """An error inside generated code becomes a VerifyError naming the block and the generated line."""
    try:
        yield
    except (VerifyError, LocalCollectiveError):
        raise
    except Exception as exc:
        rk = st.ranks[(st.stage_pp[s], t)]
        raise VerifyError(f"plan.verify: the generated code of virtual stage {s} (the program of rank {rk.rank}, tensor slice {t}) "
                          f"fails in its {what} {_where(exc, rk)}: {type(exc).__name__}: {exc}. The module itself "
                          "runs this microbatch, so the code generator rewrote something it does not handle; "
                          "compile this model with pp=1 and tp=1 (data parallelism runs the module as it is) and "
                          "report the model") from exc


def _where(exc: BaseException, rk: _Rank) -> str:
    """'in block 3 (model.layers.3), generated function block_1, line 12: `...`' from the traceback."""
    block, func, line = None, None, None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        code = frame.f_code
        if code.co_name == "_block" and isinstance(frame.f_locals.get("i"), int):
            block = frame.f_locals["i"]
        if code.co_filename == f"<program of rank {rk.rank}>":
            func, line = code.co_name, lineno
    parts = []
    stack = rk.stage.stack
    if block is not None:
        parts.append(f"in block {block} ({stack}.{block})" if stack else f"in block {block}")
    elif func in ("prefix", "suffix"):
        parts.append(f"in the {func} (before the blocks)" if func == "prefix" else "in the suffix (after the blocks)")
    if func is not None:
        lines = rk.source.splitlines()
        text = lines[line - 1].strip() if line is not None and 0 < line <= len(lines) else "?"
        parts.append(f"generated function {func}, line {line}: `{text}`")
    return ", ".join(parts) if parts else "(outside the generated code)"


def zero_grads(st: Setup) -> None:
    for p in st.reference.parameters():
        p.grad = None
    for rk in st.ranks.values():
        for p in rk.params.values():
            p.grad = None
