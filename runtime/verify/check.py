"""plan.verify: run a plan's generated stage code in one process and compare it with the module.

Before training, the per-rank programs of a pipeline / tensor-parallel plan
are checked against the user's unmodified module, in one process, with no
torch.distributed process group:

- the program of every (pipeline rank, tensor slice) of replica 0 is
  executed and its `make_stage(model, tp)` builds that rank's StageModel on a
  fresh `model_fn()` (the code `build()` runs, without process groups);
- each tensor slice runs in its own thread, the tensor-parallel collectives
  meeting in memory (runtime.verify.local_collectives), in rank order;
- each thread runs virtual stages 0..S-1 in order on one microbatch, hands
  the hidden state on as the pipeline does (detached, gradient sent back),
  computes the loss and runs backward;
- the plan's reductions are applied: tied parameters summed over their
  holders, sharded ones put back together (`unshard_parameter`), replicated
  ones required to agree on every slice;
- outputs, loss and every parameter's gradient are compared with the module's
  (fp32, rtol 1e-5). A mismatch raises `VerifyError` naming where the first
  difference appears (runtime.verify.locate): the block, the sub-module or
  generated node inside it, and the parameters whose gradients differ.

Dropout is switched off on both sides (a TorchFunctionMode), so a model that
trains with dropout is compared deterministically.

>>> from partitioner import compile
>>> from examples.gpt import example_batch
>>> from examples.training import gpt_4l_seeded, gpt_loss
>>> model = gpt_4l_seeded()
>>> x, y = example_batch(model, 8)
>>> plan = compile(model, "local:4", example_inputs=(x,), global_batch_size=8, pp=2, tp=2)
>>> x, y = first_microbatch(plan, (x, y))
>>> report = verify_plan(plan, gpt_4l_seeded, (x,), loss_fn=gpt_loss, targets=y)
>>> print(report)
verified pp2 tp2 (2 stages, 4 programs): outputs, loss and 52 gradients match the module (max abs error \
..., max rel error ...) in ... s

`runtime` must not import the planner: the plan is read duck-typed (its
`.config`, `.mesh`, `.seq_len`, `.placements`, `.program(rank)`) or as its
JSON dict (runtime.run).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from runtime.engines.fp8 import exact_gemms
from runtime.verify.compare import ROUNDING_FACTOR, compare_all, leaves, within_rounding
from runtime.verify.no_randomness import NoRandomness
from runtime.verify.run import (
    Facts,
    VerifyError,
    build_module,
    call_module,
    on_slices,
    plan_facts,
    program_hash,
    run_generated,
    setup,
)

__all__ = ["MAX_VERIFY_ELEMENTS", "VerifyError", "VerifyReport", "first_microbatch", "num_parameters", "verify_plan",
           "verify_skip_reason", "program_hash"]

# Launchers verify by default up to this many parameter elements: verify builds the model pp * tp + 1
# times on the CPU (1.6 GB of fp32 each at this size) and runs one microbatch.
MAX_VERIFY_ELEMENTS = 2e8


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """What plan.verify compared.

    checked: False when the plan has no model code to check (pp = tp = 1); note says why.
    outputs: floating output tensors compared (on every tensor slice); parameters: gradients compared.
    max_abs_error / max_rel_error: the largest over outputs, loss and gradients (rel: over the
        reference tensor's largest magnitude).
    """

    checked: bool
    note: str = ""
    pp: int = 1
    tp: int = 1
    stages: int = 0
    programs: int = 0
    outputs: int = 0
    parameters: int = 0
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    seconds: float = 0.0

    def __str__(self) -> str:
        if not self.checked:
            return f"nothing to verify: {self.note}"
        stages = f"{self.stages} stage" + "s" * (self.stages != 1)
        note = f"; {self.note}" if self.note else ""
        return (f"verified pp{self.pp} tp{self.tp} ({stages}, {self.programs} programs): outputs, loss "
                f"and {self.parameters} gradients match the module (max abs error {self.max_abs_error:.2g}, "
                f"max rel error {self.max_rel_error:.2g}{note}) in {self.seconds:.2f} s")


# ---- launchers ----------------------------------------------------------------------------


def num_parameters(plan: Any) -> int | None:
    """Parameter elements of the plan's model, from its parameter table (None when it has none)."""
    placements = plan.get("placements") if isinstance(plan, Mapping) else getattr(plan, "placements", None)
    if placements is None:
        return None
    shape = (lambda p: p["shape"]) if isinstance(plan, Mapping) else (lambda p: p.shape)
    return sum(math.prod(shape(p)) for p in placements)


def _degree(plan: Any, axis: str) -> int:
    """The plan's degree along `axis` ("cp", "ep"; a Plan, or its JSON as a dict): 1 without the axis."""
    config = plan.get("config", {}) if isinstance(plan, dict) else getattr(plan, "config", None)
    return int(config.get(axis, 1) if isinstance(config, dict) else getattr(config, axis, 1))


def verify_skip_reason(plan: Any, *, max_elements: float = MAX_VERIFY_ELEMENTS) -> str:
    """Why a launcher should not verify `plan` by default ("" when it should)."""
    try:
        f = plan_facts(plan)
    except (AttributeError, KeyError, TypeError):
        return "the plan has no configuration and mesh to verify"
    if _degree(plan, "cp") > 1:
        return "cp > 1: the code's attention runs over the context group, which one process does not have"
    if _degree(plan, "ep") > 1:
        return "ep > 1: the code's experts run over the ep group, which one process does not have"
    aux = plan.get("load_balancing_loss", False) if isinstance(plan, dict) else \
        getattr(plan, "load_balancing_loss", False)
    if _degree(plan, "pp") > 1 and aux:
        return ("pp > 1 with the routers' load-balancing loss: its sums travel between the pipeline ranks "
                "(runtime.experts.pipeline_aux), which plan.verify builds apart")
    if not f.has_code:
        return "pp = tp = 1: the programs hold no model code"
    n = num_parameters(plan)
    if n is None:
        return "the plan has no parameter table"
    if n > max_elements:
        return (f"{n:.3g} parameter elements > {max_elements:.3g}: verifying builds the model pp * tp + 1 times on "
                "the CPU; call plan.verify(model_fn) with a smaller model of the same code")
    return ""


def first_microbatch(plan: Any, batch: Any) -> tuple[Any, Any]:
    """(inputs, targets) of the first microbatch (microbatch_size rows) of a global (inputs, targets) batch:
    what replica 0 runs first. Non-tensor values pass through."""
    n = plan_facts(plan).microbatch_size
    x, y = batch if isinstance(batch, (tuple, list)) and len(batch) == 2 else (batch, None)
    return _rows(x, n), _rows(y, n)


def _rows(x: Any, n: int) -> Any:
    return pytree.tree_map(lambda v: v[:n] if isinstance(v, torch.Tensor) and v.dim() > 0 else v, x)


def _traced_inputs(plan: Any, inputs: Any) -> bool:
    """Whether `inputs` (None: made to fit) are what the plan's code was traced with: a data-parallel program
    runs its code only then (runtime.pipeline.stage.StageModel.run_as_model), the module's forward otherwise."""
    if inputs is None:
        return True
    code = plan.get("code") if isinstance(plan, Mapping) else getattr(plan, "code", None)
    prefix = code["prefix"] if isinstance(code, Mapping) else code.prefix
    names = tuple(prefix["inputs"] if isinstance(prefix, Mapping) else prefix.inputs)
    if isinstance(inputs, Mapping):
        return tuple(inputs) == names
    return (len(inputs) if isinstance(inputs, (tuple, list)) else 1) == len(names)


# ---- the entry point -----------------------------------------------------------------------


def verify_plan(plan: Any, model_fn: Callable[[], nn.Module], inputs: Any = None, loss_fn: Callable | None = None, *,
                targets: Any = None, sources: Mapping[int, str] | None = None, rtol: float = 1e-5,
                atol: float = 1e-6) -> VerifyReport:
    """Run `plan`'s generated stage code for replica 0 in this process and compare with `model_fn()`'s module.

    inputs: the model's forward arguments (a tuple, one tensor, or a kwargs dict) for one microbatch;
        None: random token ids, microbatch_size x seq_len, for every model input.
    loss_fn: loss_fn(output, targets) (targets given) or loss_fn(output); None: a fixed random weighting of
        every floating output (`generic_loss`).
    sources: rank -> program source, instead of plan.program(rank).source (what a launcher will run).
    Raises VerifyError naming where the first difference appears; returns a VerifyReport.
    """
    start = time.perf_counter()
    cp = _degree(plan, "cp")
    if cp > 1:
        raise VerifyError(f"plan.verify replays a plan's code in one process, without the cp={cp} context group "
                          "its attention runs over; context-parallel plans are checked by running them "
                          "(tests/test_context_run.py compares them with one process), not by plan.verify")
    facts = plan_facts(plan)
    if facts.pp == 1 and facts.tp == 1 and facts.has_code and not _traced_inputs(plan, inputs):
        return VerifyReport(checked=False, note="pp = tp = 1 and the batch is not the inputs the code was traced "
                                                "with: the programs run the module's own forward (data parallelism)")
    if not facts.has_code:
        return VerifyReport(checked=False, note="pp = tp = 1: the programs hold no model code, they run the module "
                                                "itself (data parallelism only)")
    threads = torch.get_num_threads()
    torch.set_num_threads(_intra_op_threads(threads, facts.tp, num_parameters(plan)))
    try:
        # fp8-mixed code calls fp8_linear: checked here as the plain linear (the split, not the recipe, is on
        # trial against the fp32 module); test_fp8 checks the fp8 numerics against one process
        with exact_gemms():
            return _verify(facts, plan, model_fn, inputs, loss_fn, targets, sources, rtol, atol, start)
    finally:
        torch.set_num_threads(threads)


# Below this many parameter elements verify runs its ops on one intra-op thread: they are too small to gain
# from OpenMP, whose spinning threads cost 10x on busy cores (the example GPT, pp2, on 2 shared cores:
# 1-3 s with 2 threads, 0.1 s with 1).
_SMALL_MODEL_ELEMENTS = 5e7


def _intra_op_threads(threads: int, tp: int, elements: int | None) -> int:
    """The slices' threads already run in parallel: each gets its share of the intra-op threads."""
    if elements is not None and elements < _SMALL_MODEL_ELEMENTS:
        return 1
    return max(1, threads // tp)


def _verify(facts: Facts, plan: Any, model_fn: Callable, inputs: Any, loss_fn: Callable | None, targets: Any,
            sources: Mapping[int, str] | None, rtol: float, atol: float, start: float) -> VerifyReport:
    st = setup(plan, model_fn, inputs, targets, loss_fn, sources, rtol, atol)
    with NoRandomness():
        ref_out = call_module(st.reference, st.inputs)
        ref_loss = st.loss(ref_out)
        ref_loss.backward()
    results = on_slices(st, lambda t: run_generated(st, t))
    bad, diffs, n = compare_all(st, ref_out, ref_loss.detach(), [o for o, _ in results], [lo for _, lo in results])
    note = ""
    if bad and all(math.isfinite(d.max_abs) for d in bad):
        floor = _fp64_floor(st, model_fn, ref_out, ref_loss)
        if floor is not None:
            bad = within_rounding(bad, floor)
            note = "" if bad else (f"some beyond rtol, within {ROUNDING_FACTOR}x the module's own fp32 rounding there "
                                   "(its fp32 against its fp64 result)")
    if bad:
        from runtime.verify.locate import locate

        raise VerifyError(locate(st, bad))
    finite = [d for d in diffs if math.isfinite(d.max_abs)]
    return VerifyReport(checked=True, pp=facts.pp, tp=facts.tp, stages=st.num_stages, programs=len(st.ranks),
                        outputs=len(leaves(ref_out)), parameters=n,
                        max_abs_error=max((d.max_abs for d in finite), default=0.0),
                        max_rel_error=max((d.max_rel for d in finite if math.isfinite(d.max_rel)), default=0.0),
                        seconds=time.perf_counter() - start, note=note)


def _fp64_floor(st: Any, model_fn: Callable, ref_out: Any, ref_loss: torch.Tensor) -> dict[str, float] | None:
    """The module's own fp32 rounding error: the largest |fp32 - fp64| of each of its outputs, its loss and every
    gradient ("model output i", "loss", "gradient of name"), the fp32 run being `st.reference`'s; None where the
    module does not run in fp64."""
    try:
        exact = build_module(model_fn).double()
        with NoRandomness():
            out = call_module(exact, _doubled(st.inputs))
            loss = st.loss(out)
            loss.backward()
    except Exception:  # noqa: BLE001 - no fp64 run, no floor: the mismatches stand as they are
        return None

    def gap(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
        if a is None or b is None or a.shape != b.shape:
            return 0.0
        return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0

    floor = {f"model output {i}": gap(a, b) for i, (a, b) in enumerate(zip(leaves(ref_out), leaves(out)))}
    floor["loss"] = gap(ref_loss, loss)
    exact_params = dict(exact.named_parameters())
    for name, p in st.reference.named_parameters():
        floor[f"gradient of {name}"] = gap(p.grad, exact_params[name].grad)
    return floor


def _doubled(x: Any) -> Any:
    """Floating tensors of `x` (a tuple, dict or tensor of model inputs) in float64; token ids as they are."""
    return pytree.tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, x)
