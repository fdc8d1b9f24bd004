"""What the user declares to `compile()`, checked before any search.

A value pins a dimension of the search, None leaves it to the planner. Every
refusal names the relation that fails and suggests values that hold
(docs/architecture.md#rules-of-the-house), raised as `DeclarationError` (a `ValueError`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from cost_models.calibration import Calibration
from cost_models.choices import GRAD_REDUCE_DTYPES, LAYOUT_ZERO_STAGE, OPTIMIZER_LAYOUTS, OPTIMIZERS, PRECISIONS
from cost_models.choices import RECOMPUTE_POLICIES as RECOMPUTE
from cost_models.choices import CP_KINDS, SCHEDULES, SELECTIVE_RECOMPUTE, ZERO3_UNITS
from cost_models.compression import COMPRESSORS, IMPLEMENTED, LEVELS
from cost_models.errors import DeclarationError

__all__ = [
    "ASYNC_SGD_FORCED",
    "Declarations",
    "PlannerOptions",
    "async_sgd_pin",
    "check_context",
    "check_declarations",
    "compression_pins",
    "compression_refusal",
    "divisors",
    "recompute_blocks_pin",
    "reduction_pins",
    "torch_compile_backend",
]

_BLOCK_INDEX = re.compile(r"\.\d+\.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Declarations:
    global_batch_size: int
    precision: str = "bf16-mixed"
    optimizer: str = "adam"
    # The dtype of the data-parallel gradient reduction under a mixed precision (gradients accumulate in fp32
    # either way): "fp32" reduces uncompressed, "bf16" runs the "bf16" compressor on every link level (divided
    # by the group size, summed in bf16, added into the fp32 gradients: `reduction_pins`). None: fp32, and the
    # planner may still choose a compressor, as without this declaration.
    grad_reduce_dtype: str | None = None
    # "replicated" (DDP: masters and optimizer state on every replica) or "distributed" (Megatron's
    # distributed optimizer: fp32 masters and optimizer state sharded over dp, parameters and gradients
    # replicated). Not a layout of its own: the ZeRO stage that is (LAYOUT_ZERO_STAGE: 0 and 1), pinned by
    # it; a contradicting zero_stage is refused. None: the planner chooses zero_stage.
    optimizer_layout: str | None = None
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero_stage: int | None = None
    microbatch_size: int | None = None
    schedule: str | None = None
    interleave: int | None = None
    recompute: str | None = None
    # Full recomputation of part of the blocks (ParallelConfig.recompute_blocks): (k, n), of every n consecutive
    # blocks the first k (pins recompute="full"). None: every block where recompute is pinned; unpinned, the
    # planner may recompute part of the blocks where that fits and full recomputation is the alternative.
    recompute_blocks: tuple[int, int] | None = None
    # Megatron sequence parallelism in each tensor group (partitioner.planner.sequence_split): True needs tp > 1,
    # False keeps the ops between tensor-split regions whole; None: on wherever tp > 1 and the model allows it
    # (Megatron-LM, torchtitan and NeMo turn it on with tensor parallelism).
    sp: bool | None = None
    # Context parallelism (partitioner.planner.context_split): the sequence split over cp ranks for the whole
    # layer, each rank holding 2 of its 2*cp chunks (the causal load balance); cp_kind "ring" passes key/value
    # blocks around the context group, "all-to-all" (DeepSpeed-Ulysses) re-shards heads. None: the planner's
    # choice (cp > 1 only for long sequences or where nothing fits without it; ring unless all-to-all is faster).
    cp: int | None = None
    cp_kind: str | None = None
    # Expert parallelism (partitioner.planner.expert_split): each MoE layer's experts divided over ep ranks of
    # the data-parallel group (ep divides dp and the number of experts). None: the planner's choice (MoE
    # models only); 1: experts replicated like any parameter.
    ep: int | None = None
    # What ZeRO-3 gathers and frees at once (cost_models.choices.Zero3Unit): "block" or "module" (each module
    # holding parameters, DeepSpeed's granularity; pins zero_stage=3). None: the planner's choice, "module"
    # only where the program runs the module's own forward (pp = tp = cp = 1, no attention rewritten), whose
    # module hooks gather each unit.
    zero3_unit: str | None = None
    # usable share of device memory; None: all of it, a plan's predicted peak times the caching allocator's slack
    # for its recompute mode (cost_models.memory.ALLOCATOR_SLACK) held against it
    max_memory_fraction: float | None = None
    # link level -> compressor of the data-parallel gradient reduction, for the levels pinned
    # (from `compression_pins`); levels absent are the planner's choice
    compression: dict[str, str] = dataclasses.field(default_factory=dict)
    # {"every": k} (local SGD) or {"staleness": s} (from `async_sgd_pin`); None: synchronous training.
    # Never chosen by the planner: it changes the training math, so it is used only when pinned.
    async_sgd: dict[str, int] | None = None
    # Eager attention (q k^T, mask, softmax, dropout, @ v) rewritten to one scaled_dot_product_attention where
    # that is the same math (partitioner.tracer.attention): costed, and run by every program, as a fused
    # kernel. False keeps the traced ops (and their s x s memory).
    rewrite_attention: bool = True
    # What the program does besides the plan's choices (recorded in the plan, not searched)
    clip_grad_norm: float | None = None
    compression_warmup: int = 0  # first steps that reduce uncompressed
    # torch.compile of the model code every program runs, by this backend ("inductor", "aot_eager", ...); "": eager.
    # compile() takes True for "inductor" (runtime.engines.compiled says what is compiled and what stays outside).
    torch_compile: str = ""

    def __post_init__(self) -> None:
        # optimizer_layout pins the ZeRO stage it is (contradictions: check_declarations, which names both)
        if self.zero_stage is None and self.optimizer_layout in LAYOUT_ZERO_STAGE:
            object.__setattr__(self, "zero_stage", LAYOUT_ZERO_STAGE[self.optimizer_layout])
        if self.zero_stage is None and self.zero3_unit == "module":  # units of ZeRO-3: it pins the stage
            object.__setattr__(self, "zero_stage", 3)
        if self.recompute is None and self.recompute_blocks is not None:  # part of the blocks, fully
            object.__setattr__(self, "recompute", "full")

    @classmethod
    def declare(cls, **values: Any) -> Declarations:
        """The user's declarations, as `compile()` takes them: `compression` and `async_sgd` in any form
        `compression_pins` / `async_sgd_pin` accept, every value checked for its type and range on its own
        (relations between values and the topology: `check_declarations`).

        >>> Declarations.declare(global_batch_size=8, tp=2, compression="int8").pinned()
        {'tp': 2, 'compression': {'intra_node': 'int8', 'inter_node': 'int8'}}
        """
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise DeclarationError(f"{', '.join(unknown)}: not a declaration; the declarations are "
                                   f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        if values.get("global_batch_size") is None:
            raise DeclarationError("global_batch_size: required, the samples per optimizer step over all replicas "
                                   "(e.g. global_batch_size=512)")
        clip = values.get("clip_grad_norm")
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                 or not 0 < clip <= 1e308):  # not inf, NaN or beyond float
            raise DeclarationError(f"clip_grad_norm={clip!r}: must be a finite number > 0 (e.g. 1.0), or None "
                                   "for no clipping")
        rewrite = values.get("rewrite_attention", True)
        if not isinstance(rewrite, bool):
            raise DeclarationError(f"rewrite_attention={rewrite!r}: must be True (eager attention runs as one fused "
                                   "scaled_dot_product_attention where that is exact) or False (as traced)")
        layout, zero = values.get("optimizer_layout"), values.get("zero_stage")
        if layout in LAYOUT_ZERO_STAGE and zero is not None and zero != LAYOUT_ZERO_STAGE[layout]:
            raise DeclarationError(_layout_contradiction(layout, zero))
        sp = values.get("sp")
        if sp is not None and not isinstance(sp, bool):
            raise DeclarationError(f"sp={sp!r}: must be True (sequence parallelism in every tensor group), False, or "
                                   "None (the planner's choice: on wherever tp > 1 allows it)")
        if sp and values.get("tp") == 1:
            raise DeclarationError("sp=True with tp=1: sequence parallelism splits the tokens over the tensor group, "
                                   "so it needs tp > 1; pin tp=2 or more, or drop sp")
        cp, kind = values.get("cp"), values.get("cp_kind")
        if cp is not None and (isinstance(cp, bool) or not isinstance(cp, int) or cp < 1):
            raise DeclarationError(f"cp={cp!r}: the context-parallel degree, an int >= 1 (e.g. cp=2: the sequence "
                                   "split over 2 ranks), or None for the planner's choice")
        if kind is not None and kind not in CP_KINDS:
            raise DeclarationError(f"cp_kind={kind!r}: must be one of {', '.join(map(repr, CP_KINDS))} (ring "
                                   "attention, or DeepSpeed-Ulysses' all-to-all), or None for the planner's choice")
        if kind is not None and cp == 1:
            raise DeclarationError(f"cp_kind={kind!r} with cp=1: there is no context group to run {kind} attention "
                                   "over; pin cp=2 or more, or drop cp_kind")
        unit = values.get("zero3_unit")
        if unit is not None and unit not in ZERO3_UNITS:
            raise DeclarationError(f"zero3_unit={unit!r}: must be one of {', '.join(map(repr, ZERO3_UNITS))} (what "
                                   "ZeRO-3 gathers at once: a whole block, or each module holding parameters), or "
                                   "None for the planner's choice")
        if unit == "module" and zero not in (None, 3):
            raise DeclarationError(f"zero3_unit='module' with zero_stage={zero}: units are what ZeRO-3 gathers, and "
                                   f"ZeRO-{zero} keeps parameters whole; pin zero_stage=3, or drop zero3_unit")
        ep = values.get("ep")
        if unit == "module" and isinstance(ep, int) and ep > 1:
            raise DeclarationError(f"zero3_unit='module' with ep={ep}: expert-parallel programs gather ZeRO-3 units "
                                   "per block (per module is not run with experts held apart yet); drop zero3_unit "
                                   "or pin ep=1")
        blocks = recompute_blocks_pin(values.get("recompute_blocks"))
        if blocks == (1, 1) and values.get("recompute") is not None:
            blocks = None  # every block: what the pinned recomputation does anyway
        if blocks is not None and values.get("recompute") not in (None, "full"):
            raise DeclarationError(f"recompute_blocks={values['recompute_blocks']!r} with recompute="
                                   f"{values['recompute']!r}: part of the blocks run under full recomputation, the "
                                   "others keep their activations; pin recompute='full' (or leave it out), or drop "
                                   "recompute_blocks")
        warmup = values.get("compression_warmup", 0)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise DeclarationError(f"compression_warmup={warmup!r}: the number of first steps that reduce "
                                   "uncompressed, an int >= 0 (e.g. compression_warmup=100)")
        tc = torch_compile_backend(values.get("torch_compile", ""))
        return cls(**{**values, "torch_compile": tc, "recompute_blocks": blocks,
                      "compression": compression_pins(values.get("compression")),
                      "async_sgd": async_sgd_pin(values.get("async_sgd")),
                      "clip_grad_norm": None if clip is None else float(clip)})

    def pinned(self) -> dict[str, Any]:
        """The declarations that pin something, for the plan's record."""
        names = ("dp", "tp", "pp", "cp", "cp_kind", "ep", "zero_stage", "microbatch_size", "schedule", "interleave",
                 "recompute", "recompute_blocks", "sp", "grad_reduce_dtype", "optimizer_layout", "zero3_unit")
        out = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.compression:
            out["compression"] = dict(self.compression)
        if self.async_sgd:
            out["async_sgd"] = dict(self.async_sgd)
        if not self.rewrite_attention:
            out["rewrite_attention"] = False
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """How `compile()` searches, as opposed to what it must satisfy (`Declarations`).

    calibration: the fitted cost factors (None: the device's defaults); cut_granularity: pipeline cuts
    between blocks ("block") or between any graph nodes ("node"); alternatives: how many runners-up the
    plan records; stage_bounds: a pinned pipeline cut, as graph node indices (an earlier plan's
    `stage_bounds`).
    """

    calibration: Calibration | None = None
    cut_granularity: str = "block"
    alternatives: int = 5
    stage_bounds: tuple[int, ...] | None = None

    @classmethod
    def declare(cls, *, calibration: Any = None, cut_granularity: str = "block", alternatives: int = 5,
                stage_bounds: Any = None, device: str) -> PlannerOptions:
        """Options as `compile()` takes them: `calibration` a Calibration, the path of its JSON, or None for
        `device`'s defaults (resolved here, once)."""
        if cut_granularity not in ("block", "node"):
            raise DeclarationError(f"cut_granularity={cut_granularity!r}: must be 'block' or 'node'")
        if isinstance(alternatives, bool) or not isinstance(alternatives, int) or alternatives < 0:
            raise DeclarationError(f"alternatives={alternatives!r}: how many runners-up to record, an int >= 0")
        if calibration is not None and not isinstance(calibration, (Calibration, str, os.PathLike)):
            raise DeclarationError(f"calibration={calibration!r}: pass a Calibration, the path of its JSON file "
                                   "(Calibration.save, `partitioner autotune --calibration-out`), or None for the "
                                   "device's defaults")
        cal = Calibration.load(calibration) if isinstance(calibration, (str, os.PathLike)) else \
            (calibration or Calibration.for_device(device))
        return cls(calibration=cal, cut_granularity=cut_granularity, alternatives=alternatives,
                   stage_bounds=stage_bounds if stage_bounds is None or not isinstance(stage_bounds, list)
                   else tuple(stage_bounds))


def compression_pins(value: Any) -> dict[str, str]:
    """`compile(compression=...)` -> the pinned levels: None pins nothing, a name pins every level.

    >>> compression_pins("int8")
    {'intra_node': 'int8', 'inter_node': 'int8'}
    >>> compression_pins({"inter_node": "int4"})
    {'inter_node': 'int4'}
    """
    if value is None:
        return {}
    if isinstance(value, str):
        pins = {level: value for level in LEVELS}
    elif isinstance(value, dict):
        bad = [k for k in value if k not in LEVELS]
        if bad:
            raise DeclarationError(f"compression: unknown link level(s) {', '.join(map(repr, bad))}; the levels are "
                                   f"{', '.join(map(repr, LEVELS))}, e.g. compression={{'inter_node': 'int8'}}")
        pins = {level: value[level] for level in LEVELS if level in value}
    else:
        raise DeclarationError(f"compression={value!r}: must be None (the planner chooses), a compressor name "
                               f"({', '.join(map(repr, IMPLEMENTED))}) for every level, or a dict link level -> "
                               "name such as {'inter_node': 'int8'}")
    for level, name in pins.items():
        where = "compression" if isinstance(value, str) else f"compression[{level!r}]"
        if name not in COMPRESSORS:
            raise DeclarationError(f"{where}={name!r}: must be one of {', '.join(map(repr, IMPLEMENTED))}")
    return pins


def reduction_pins(d: Declarations) -> dict[str, str]:
    """The compression pins the search honours: the user's `compression`, or what grad_reduce_dtype says for every
    link level ("fp32": uncompressed; "bf16": the "bf16" compressor, runtime.compression.grad_compression's
    divide-by-the-group-size, bf16 sum, fp32 result). check_declarations refuses the two together where they
    disagree, so at most one of them pins anything.

    >>> reduction_pins(Declarations(global_batch_size=8, grad_reduce_dtype="bf16"))
    {'intra_node': 'bf16', 'inter_node': 'bf16'}
    """
    if d.grad_reduce_dtype is None:
        return dict(d.compression)
    return {level: "none" if d.grad_reduce_dtype == "fp32" else "bf16" for level in LEVELS}


def _layout_contradiction(layout: str, zero_stage: int) -> str:
    want = LAYOUT_ZERO_STAGE[layout]
    what = {"replicated": "keeps the fp32 masters and optimizer state whole on every data-parallel replica (DDP, "
                          "ZeRO stage 0)",
            "distributed": "shards the fp32 masters and optimizer state over the data-parallel replicas and keeps "
                           "parameters and gradients replicated (Megatron's distributed optimizer, ZeRO stage 1)"}
    return (f"optimizer_layout={layout!r} with zero_stage={zero_stage}: the {layout} layout {what[layout]}, "
            f"but zero_stage={zero_stage} {'replicates the optimizer state' if zero_stage == 0 else 'shards more'}; "
            f"pin zero_stage={want}, or drop one of the two")


def _check_precision_recipe(d: Declarations) -> None:
    """grad_reduce_dtype and optimizer_layout against the precision, the ZeRO stage and the compression pins."""
    _choice("grad_reduce_dtype", d.grad_reduce_dtype, GRAD_REDUCE_DTYPES)
    _choice("optimizer_layout", d.optimizer_layout, OPTIMIZER_LAYOUTS)
    if d.optimizer_layout is not None and d.zero_stage != LAYOUT_ZERO_STAGE[d.optimizer_layout]:
        raise DeclarationError(_layout_contradiction(d.optimizer_layout, d.zero_stage))
    g = d.grad_reduce_dtype
    if g is None:
        return
    if d.precision not in ("bf16-mixed", "fp16-mixed", "fp8-mixed"):
        held = "fp32" if d.precision == "fp32" else "bf16"
        fix = ("pin compression='bf16' to send fp32 gradients as bf16" if held == "fp32" else
               "use precision='bf16-mixed' for fp32 gradients reduced in fp32 or bf16")
        raise DeclarationError(f"grad_reduce_dtype={g!r} with precision={d.precision!r}: the reduction dtype is a "
                               f"choice of the mixed precisions (bf16-mixed, fp16-mixed, fp8-mixed), whose gradients accumulate "
                               f"in fp32; precision={d.precision!r} holds {held} gradients and reduces them as such; "
                               f"drop grad_reduce_dtype, or {fix}")
    want = "none" if g == "fp32" else "bf16"
    other = {lv: c for lv, c in d.compression.items() if c != want}
    if other:
        raise DeclarationError(f"grad_reduce_dtype={g!r} with compression={d.compression}: grad_reduce_dtype says "
                               f"how every link level reduces gradients ({want!r} there), the compression pin "
                               f"says {other}; drop one of the two")
    if g == "bf16" and d.compression_warmup:
        raise DeclarationError(f"grad_reduce_dtype='bf16' with compression_warmup={d.compression_warmup}: the "
                               "warm-up would reduce the first steps in fp32; drop compression_warmup, or pin "
                               "compression='bf16' for a warm-up in fp32")


def compression_refusal(pins: dict[str, str], *, zero_stage: int, levels: tuple[str, ...]) -> str:
    """Why a data-parallel group crossing `levels` at `zero_stage` cannot run the pinned compressors, and the
    fix ("" when it can). Mirrors cost_models.compression.combinations.

    >>> compression_refusal({"intra_node": "powersgd", "inter_node": "powersgd"}, zero_stage=0,
    ...                     levels=("intra_node", "inter_node"))  # doctest: +ELLIPSIS
    "a group crossing both link levels runs PowerSGD only across nodes, ...; pin compression={'inter_node': 'powersgd'}"
    """
    used = {lv: pins[lv] for lv in levels if lv in pins}
    both = tuple(levels) == tuple(LEVELS)
    if zero_stage >= 2:
        if "powersgd" in used.values():
            return (f"ZeRO-{zero_stage} reduce-scatters gradients, and PowerSGD runs on the DDP/ZeRO-1 all-reduce "
                    "only; pin zero_stage=0 or 1, or compress with 'bf16', 'int8' or 'int4'")
        if both and len({pins.get(lv, "free") for lv in LEVELS} - {"free"}) > 1:
            return (f"ZeRO-{zero_stage} reduce-scatters flat over the group, which crosses both link levels: one "
                    f"compressor for both (e.g. compression={pins.get('inter_node', 'none')!r}), or zero_stage=0 or 1")
        return ""
    if both and "powersgd" in used.values() and (used.get("intra_node", "none"), used.get("inter_node", "powersgd")) \
            != ("none", "powersgd"):
        return ("a group crossing both link levels runs PowerSGD only across nodes, after an fp32 all-reduce "
                "inside each node; pin compression={'inter_node': 'powersgd'}")
    return ""


_ASYNC_KEYS = ("every", "staleness")
# What a pinned async_sgd implies for the search: replicas of the whole model, each stepping alone.
ASYNC_SGD_FORCED = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero_stage": 0}


def torch_compile_backend(value: Any) -> str:
    """`compile(torch_compile=...)` -> the backend name the programs compile with, "" for eager.

    >>> torch_compile_backend(True), torch_compile_backend(False), torch_compile_backend("aot_eager")
    ('inductor', '', 'aot_eager')
    """
    if value is None or value is False or value == "":
        return ""
    if value is True:
        return "inductor"
    usage = ("torch_compile must be False (eager), True (torch.compile with inductor) or a torch.compile backend "
             "name such as 'inductor' or 'aot_eager'")
    if not isinstance(value, str):
        raise DeclarationError(f"torch_compile={value!r}: {usage}")
    import torch._dynamo  # the backends torch knows, here: an unknown name is refused before any search

    known = torch._dynamo.list_backends(exclude_tags=())
    if value not in known:
        raise DeclarationError(f"torch_compile={value!r}: not a torch.compile backend; {usage} (known here: "
                               f"{', '.join(sorted(known))})")
    return value


def async_sgd_pin(value: Any) -> dict[str, int] | None:
    """`compile(async_sgd=...)` -> {"every": k} or {"staleness": s} (a fresh dict), or None.

    >>> async_sgd_pin(dict(every=4))
    {'every': 4}
    >>> async_sgd_pin({"staleness": 0})
    {'staleness': 0}
    """
    if value is None:
        return None
    usage = ("async_sgd must be None (synchronous), dict(every=k) (local SGD: replicas step alone and average "
             "parameters every k steps, k >= 1) or dict(staleness=s) (every step's update averaged "
             "asynchronously and applied s >= 0 steps later)")
    if not isinstance(value, dict):
        raise DeclarationError(f"async_sgd={value!r}: {usage}")
    keys = sorted(value)
    if len(keys) != 1 or keys[0] not in _ASYNC_KEYS:
        raise DeclarationError(f"async_sgd={value!r}: exactly one key, 'every' or 'staleness', not {keys}; {usage}")
    key = keys[0]
    v, lo = value[key], 1 if key == "every" else 0
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise DeclarationError(f"async_sgd[{key!r}]={v!r}: must be an integer >= {lo}, e.g. "
                               f"async_sgd=dict({key}={max(lo, 2 if key == 'every' else 1)})")
    return {key: v}


def _check_async_sgd(d: Declarations, world_size: int) -> None:
    """Async SGD runs on plain data parallelism only (runtime.engines.async_sgd): say which pin rules it out, and why."""
    a = d.async_sgd
    if not a:
        return
    fix = "drop async_sgd to train synchronously"
    if world_size == 1 or d.dp == 1:
        raise DeclarationError(f"async_sgd={a} with {'dp=1' if d.dp == 1 else 'one device'}: asynchronous SGD "
                               "averages data-parallel replicas, and one replica has nothing to average with; "
                               f"allow dp > 1 (leave dp unpinned on more than one device) or {fix}")
    why = {"pp": "a pipeline splits the model over ranks whose stages must step together",
           "tp": "tensor slices of one layer must be updated together",
           "cp": "the context slices of one sequence hold parts of the same gradient",
           "ep": "an expert-parallel group's ranks exchange tokens every step and hold different experts",
           "zero_stage": "ZeRO shards the optimizer state (from stage 1; gradients from 2, parameters at 3) over "
                         "the replicas, so no replica can step alone"}
    for name, ok in ASYNC_SGD_FORCED.items():
        v = getattr(d, name)
        if v is not None and v != ok:
            raise DeclarationError(f"async_sgd={a} with {name}={v}: each replica steps its own whole copy of the "
                                   f"model, but {why[name]}; pin {name}={ok} or {fix}")
    if d.dp is not None and d.dp != world_size:
        raise DeclarationError(f"async_sgd={a} with dp={d.dp}: async SGD plans are pure data parallel (tp = pp = 1), "
                               f"so dp must be the world size {world_size}; leave dp unpinned or {fix}")
    squeezed = {lv: c for lv, c in d.compression.items() if c != "none"}
    if squeezed:
        raise DeclarationError(f"async_sgd={a} with compression={squeezed}: gradient compression compresses the "
                               "gradient all-reduce, which async SGD replaces by averaging parameters; drop "
                               f"compression (or pin compression='none') or {fix}")
    if d.precision != "fp32":
        raise DeclarationError(f"async_sgd={a} with precision={d.precision!r}: the async SGD runtime steps the "
                               "model's own parameters on each replica and keeps no fp32 master weights, so it "
                               f"trains in fp32 only; pin precision='fp32' or {fix}")


# Bounds that keep the search finite and fast: the divisors of the batch are enumerated, and the schedule
# lists every microbatch of every rank (their instruction lists grow with the count).
MAX_GLOBAL_BATCH_SIZE = 2**32
# Schedules whose backward is split into I and W: the runtime does not run them under selective recompute
# (why: the DeclarationError in check_declarations); under ZeRO-3 only when pinned (search.py)
SPLIT_BACKWARD = frozenset({"zb-h1", "interleaved-zb", "zb-v", "dualpipe-v"})
# Schedules with several virtual stages per rank: interleave >= 2 of them (zb-v, dualpipe-v: exactly 2, in a V)
INTERLEAVED = frozenset({"interleaved-1f1b", "interleaved-zb", "zb-v", "dualpipe-v"})
MAX_MICROBATCHES = 2**16


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt(n)) steps (a global batch of 2**40 must not hang the search).

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    if n < 1:
        return []
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def recompute_blocks_pin(value: Any) -> tuple[int, int] | None:
    """A `recompute_blocks` declaration as (k, n): the first k of every n consecutive blocks recompute. Takes
    (k, n), "k/n", or None; k = n (every block) reads as (1, 1).

    >>> recompute_blocks_pin("1/2"), recompute_blocks_pin((3, 4)), recompute_blocks_pin("2/2")
    ((1, 2), (3, 4), (1, 1))
    """
    if value is None:
        return None
    parts = value.split("/") if isinstance(value, str) else value
    try:
        k, n = (int(x) if not isinstance(x, bool) and float(x) == int(x) else None for x in parts)
    except (TypeError, ValueError):
        k = n = None
    if k is None or n is None or not 1 <= k <= n:
        raise DeclarationError(f"recompute_blocks={value!r}: must be (k, n) or 'k/n' with 1 <= k <= n, the first k "
                               "of every n consecutive blocks recomputed (e.g. '1/2': every second block, torchtitan's "
                               "selective_ac_option=2; '3/4': three blocks in four)")
    return (1, 1) if k == n else (k, n)


def _int(name: str, v: Any, lo: int = 1) -> None:
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        raise DeclarationError(f"{name}={v!r}: must be an integer")
    if v < lo:
        raise DeclarationError(f"{name}={v}: must be >= {lo}")


def _choice(name: str, v: Any, valid: tuple) -> None:
    if v is not None and v not in valid:
        raise DeclarationError(f"{name}={v!r}: must be one of {', '.join(map(repr, valid))}")


def check_declarations(d: Declarations, *, world_size: int, topology_name: str, num_units: int,
                       unit_name: str, valid_tp: tuple[int, ...], tp_divisors: tuple[tuple[str, int], ...],
                       seq_len: int | None = None, heads: tuple[int, int] | None = None) -> None:
    """Raise DeclarationError for the first declaration that cannot hold.

    seq_len: the traced sequence length; heads: (query heads, key/value heads) of the model's attention,
    None where it has none (both for the context-parallel checks, `check_context`)."""
    _int("global_batch_size", d.global_batch_size)
    if d.global_batch_size > MAX_GLOBAL_BATCH_SIZE:
        raise DeclarationError(f"global_batch_size={d.global_batch_size}: more samples per step than the planner "
                               f"handles (at most {MAX_GLOBAL_BATCH_SIZE}); it counts samples (sequences), not tokens")
    for name in ("dp", "tp", "pp", "microbatch_size", "interleave"):
        _int(name, getattr(d, name))
    _int("zero_stage", d.zero_stage, lo=0)
    if d.zero_stage is not None and d.zero_stage > 3:
        raise DeclarationError(f"zero_stage={d.zero_stage}: must be 0 (DDP), 1, 2 or 3 (FSDP)")
    if d.torch_compile and ((d.tp or 1) > 1 or (d.cp or 1) > 1 or (d.ep or 1) > 1):
        what = " and ".join(f"{k}={v}" for k, v in (("tp", d.tp), ("cp", d.cp), ("ep", d.ep)) if v and v > 1)
        raise DeclarationError(f"torch_compile={d.torch_compile!r} with {what}: tensor-, context- and expert-parallel "
                               "programs call collectives inside their blocks, which are not compiled around yet; drop "
                               "torch_compile, or pin tp=1, cp=1 and ep=1 (data-parallel, ZeRO and pipeline plans "
                               "compile)")
    _choice("precision", d.precision, PRECISIONS)
    _choice("optimizer", d.optimizer, OPTIMIZERS)
    _check_precision_recipe(d)
    _choice("schedule", d.schedule, SCHEDULES)
    _choice("recompute", d.recompute, RECOMPUTE)
    if d.recompute_blocks is not None and (recompute_blocks_pin(d.recompute_blocks) != tuple(d.recompute_blocks)
                                           or d.recompute != "full"):
        raise DeclarationError(f"recompute_blocks={d.recompute_blocks!r} with recompute={d.recompute!r}: must be "
                               "(k, n) with 1 <= k < n (Declarations.declare reads 'k/n'), with recompute='full'")
    if d.max_memory_fraction is not None and (
            isinstance(d.max_memory_fraction, bool) or not isinstance(d.max_memory_fraction, (int, float))
            or not 0 < d.max_memory_fraction <= 1):
        raise DeclarationError(f"max_memory_fraction={d.max_memory_fraction!r}: must be in (0, 1], e.g. 0.9")

    squeezed = sorted({c for c in d.compression.values() if c != "none"})
    if squeezed and (d.dp == 1 or world_size == 1):
        raise DeclarationError(
            f"compression={d.compression} with dp=1: there is no data-parallel gradient reduction to compress; "
            "drop compression or allow dp > 1")
    low_rank = [level for level, c in d.compression.items() if c == "powersgd"]
    if low_rank and d.zero_stage is not None and d.zero_stage >= 2:
        raise DeclarationError(
            f"compression={d.compression} with zero_stage={d.zero_stage}: PowerSGD ({', '.join(low_rank)}) runs on "
            f"the DDP/ZeRO-1 gradient all-reduce only, not ZeRO-{d.zero_stage}'s reduce-scatter; pin zero_stage=0 "
            "or 1, or compress with 'bf16', 'int8' or 'int4'")
    _check_async_sgd(d, world_size)

    # dp * cp * tp * pp must be the world size.
    _int("cp", d.cp)
    pinned = {k: getattr(d, k) for k in ("dp", "cp", "tp", "pp") if getattr(d, k) is not None}
    prod = 1
    for v in pinned.values():
        prod *= v
    full = len(pinned) == 4 or (len(pinned) == 3 and "cp" not in pinned)  # cp unpinned with the rest: 1
    if full and prod != world_size:
        shown = " * ".join(f"{k}({v})" for k, v in pinned.items())
        rest = f"; with cp > 1 the dp left is {world_size * d.dp // prod}" if "cp" not in pinned and \
            world_size % prod == 0 else ""
        raise DeclarationError(
            f"{shown} = {prod} != world size {world_size} of topology {topology_name}; dp * cp * tp * pp must "
            f"multiply to the number of devices{rest}")
    if pinned and world_size % prod:
        shown = " * ".join(f"{k}({v})" for k, v in pinned.items())
        raise DeclarationError(
            f"{shown} = {prod} does not divide world size {world_size} of topology {topology_name}; "
            f"valid products: {', '.join(map(str, divisors(world_size)))}")

    check_context(d, seq_len=seq_len, heads=heads)
    if d.tp is not None and d.tp not in valid_tp:
        # Blocks repeat: "heads of h.0.attn", "heads of h.1.attn" -> "heads of h.*.attn" once.
        why = list(dict.fromkeys(f"{_BLOCK_INDEX.sub('.*.', what)} ({n})" for what, n in tp_divisors if n % d.tp))
        raise DeclarationError(
            f"tp={d.tp} does not divide {', '.join(why[:3]) or 'the split dimensions'}; "
            f"valid tp: {', '.join(map(str, valid_tp))}")
    if d.pp is not None and d.pp > num_units:
        raise DeclarationError(
            f"pp={d.pp} > {num_units} {unit_name}: a pipeline stage needs at least one; "
            f"valid pp: {', '.join(str(p) for p in divisors(world_size) if p <= num_units)}")
    if d.interleave is not None and d.interleave > 1 and d.schedule not in (None, *INTERLEAVED):
        raise DeclarationError(
            f"interleave={d.interleave} needs schedule='interleaved-1f1b' or 'interleaved-zb', not "
            f"{d.schedule!r}; drop interleave or change the schedule")
    if d.schedule in ("zb-v", "dualpipe-v") and d.interleave not in (None, 2):
        raise DeclarationError(f"schedule={d.schedule!r} places exactly 2 stages per pipeline rank, in a V; got "
                               f"interleave={d.interleave}: drop it or pass interleave=2")
    if d.schedule == "dualpipe-v" and None not in (d.pp, d.dp, d.microbatch_size) and d.cp in (None, 1) \
            and d.global_batch_size % (d.dp * d.microbatch_size) == 0 \
            and d.global_batch_size // (d.dp * d.microbatch_size) < 2 * d.pp:
        m = d.global_batch_size // (d.dp * d.microbatch_size)
        raise DeclarationError(
            f"schedule='dualpipe-v' needs at least 2 pp = {2 * d.pp} microbatches per replica (one per stage of its "
            f"V; torch's ScheduleDualPipeV checks the same), but global_batch_size={d.global_batch_size} / "
            f"(dp({d.dp}) * microbatch_size({d.microbatch_size})) = {m}: use microbatch_size <= "
            f"{max(1, d.global_batch_size // (d.dp * 2 * d.pp))}, a larger global batch, or schedule='zb-v'")
    if d.schedule in SPLIT_BACKWARD and d.recompute in SELECTIVE_RECOMPUTE:
        raise DeclarationError(
            f"schedule={d.schedule!r} with recompute={d.recompute!r}: a split backward runs autograd twice over each "
            "block (I, then W), and torch's selective checkpoint allows one backward per region; use "
            "recompute='full' or 'none', or schedule='1f1b'")
    if d.schedule in ("interleaved-1f1b", "interleaved-zb") and d.interleave == 1:
        plain = {"interleaved-1f1b": "1f1b", "interleaved-zb": "zb-h1"}[d.schedule]
        raise DeclarationError(f"schedule={d.schedule!r} with interleave=1 is plain {plain}: "
                               f"use interleave >= 2 or schedule={plain!r}")
    if d.schedule in INTERLEAVED and d.pp is not None and d.pp * (d.interleave or 2) > num_units:
        raise DeclarationError(
            f"{d.schedule} with pp={d.pp} x interleave={d.interleave or 2} needs "
            f"{d.pp * (d.interleave or 2)} {unit_name}, the model has {num_units}")
    if d.dp is not None and d.microbatch_size is not None:
        step = d.dp * d.microbatch_size
        if d.global_batch_size % step:
            lo = d.global_batch_size // step * step
            near = [x for x in (lo, lo + step) if x > 0]
            raise DeclarationError(
                f"global_batch_size={d.global_batch_size} is not divisible by dp({d.dp}) * "
                f"microbatch_size({d.microbatch_size}) = {step}; valid global batch sizes near it: "
                f"{', '.join(map(str, near))}")
    if d.dp is not None and d.global_batch_size % d.dp:
        lo = d.global_batch_size // d.dp * d.dp
        raise DeclarationError(
            f"global_batch_size={d.global_batch_size} is not divisible by dp({d.dp}); "
            f"valid global batch sizes near it: {', '.join(str(x) for x in (lo, lo + d.dp) if x > 0)}")
    if d.microbatch_size is not None:
        fewest = d.global_batch_size // ((d.dp or world_size) * d.microbatch_size)  # at the largest dp allowed
        if fewest > MAX_MICROBATCHES:
            raise DeclarationError(
                f"microbatch_size={d.microbatch_size} makes {fewest} microbatches per step of global_batch_size="
                f"{d.global_batch_size} (at dp={d.dp or world_size}): more than the {MAX_MICROBATCHES} the schedule "
                f"lists; pin microbatch_size >= {-(-d.global_batch_size // ((d.dp or world_size) * MAX_MICROBATCHES))}"
                " or leave it to the planner")


def check_context(d: Declarations, *, seq_len: int | None, heads: tuple[int, int] | None) -> None:
    """A pinned cp the model cannot run: the sequence must split into 2*cp equal chunks (each rank holds chunk
    r and chunk 2*cp-1-r, runtime.context.sequence), and Ulysses' all-to-all re-shards heads, so the query
    and key/value heads of each tensor rank must divide by cp.

    >>> check_context(Declarations(global_batch_size=8, cp=3), seq_len=128, heads=(4, 4))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    cost_models.errors.DeclarationError: cp=3: the sequence of 128 tokens does not split into 2*cp = 6 equal ...
    """
    if d.cp is None or d.cp == 1:
        return
    s = seq_len or 1
    if s % (2 * d.cp):
        valid = [c for c in divisors(s) if s % (2 * c) == 0 or c == 1]
        raise DeclarationError(
            f"cp={d.cp}: the sequence of {s} tokens does not split into 2*cp = {2 * d.cp} equal chunks (each rank "
            f"holds 2 of them, the causal load balance); valid cp: {', '.join(map(str, valid[:8]))}; or trace with "
            f"a sequence length divisible by {2 * d.cp}")
    if d.cp_kind == "all-to-all":
        if heads is None:
            raise DeclarationError(f"cp={d.cp} with cp_kind='all-to-all': the model has no "
                                   "scaled_dot_product_attention whose heads Ulysses could re-shard; use cp_kind='ring'")
        t = d.tp or 1
        bad = [f"{what} heads ({n})" for what, n in zip(("query", "key/value"), heads) if n % (t * d.cp)]
        if bad:
            ok = [c for c in divisors(min(heads) // t if min(heads) % t == 0 else 1) if c > 1]
            raise DeclarationError(
                f"cp={d.cp} with cp_kind='all-to-all' and tp={t}: Ulysses gives each of the cp ranks 1/cp of a "
                f"tensor rank's heads, but tp * cp = {t * d.cp} does not divide the {' and '.join(bad)}; use "
                f"cp_kind='ring'" + (f", or cp in {', '.join(map(str, ok))}" if ok else ""))
