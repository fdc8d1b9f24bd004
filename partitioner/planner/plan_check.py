"""`check_plan(plan)`: the relations between a plan's fields that its types alone do not say.

`plan_json.decode` checks each value against its declared type; a file edited by hand (or damaged)
can still hold well-typed values that contradict each other: a mesh for 3 ranks in a plan for 4,
dp * tp * pp that is not the world size, a stage list one short. Code generation and the runtime
index by these relations, so a broken one would surface there as an IndexError or KeyError far from
the cause. `Plan.from_json` runs this after decoding and raises `PlanFormatError` naming the fields
that disagree, e.g.

    plan.mesh: 3 entries, but world_size is 4: one MeshCoord per rank; recompile the plan

What `compile` produces always passes (tests/test_fuzz_inputs.py checks both directions).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from cost_models.errors import DeclarationError, TopologyError
from cost_models.placements import sharded_dim
from cost_models.topology import Topology
from partitioner.planner.declarations import ASYNC_SGD_FORCED, OPTIMIZERS, async_sgd_pin
from partitioner.planner.plan_json import PlanFormatError
from partitioner.planner.schedule import stage_rank

if TYPE_CHECKING:
    from partitioner.planner.plan import Plan

__all__ = ["check_plan"]

_FIX = "recompile the plan (partitioner compile ...) rather than editing it"


def check_plan(plan: Plan) -> None:
    """Raise PlanFormatError for the first relation between fields that does not hold."""
    _check_scalars(plan)
    topo = _check_topology(plan)
    _check_config(plan)
    _check_mesh(plan, topo)
    _check_schedule(plan)
    _check_stages(plan)
    _check_placements(plan)
    _check_async_sgd(plan)


def _fail(where: str, what: str) -> None:
    raise PlanFormatError(f"plan.{where}: {what}; {_FIX}")


def _at_least(where: str, value: Any, lo: int) -> None:
    if value < lo:
        _fail(where, f"{value!r} must be >= {lo}")


def _check_scalars(p: Plan) -> None:
    _at_least("world_size", p.world_size, 1)
    _at_least("global_batch_size", p.global_batch_size, 1)
    _at_least("bucket_bytes", p.bucket_bytes, 1)
    _at_least("compression_warmup", p.compression_warmup, 0)
    _at_least("candidates_evaluated", p.candidates_evaluated, 0)
    _at_least("search_space", p.search_space, 0)
    if p.seq_len is not None:
        _at_least("seq_len", p.seq_len, 1)
    if p.clip_grad_norm is not None and not (math.isfinite(p.clip_grad_norm) and p.clip_grad_norm > 0):
        _fail("clip_grad_norm", f"{p.clip_grad_norm!r} must be a finite number > 0, or null (no clipping)")
    if not isinstance(p.torch_compile, str):
        _fail("torch_compile", f"{p.torch_compile!r} must be a torch.compile backend name, or \"\" (eager)")
    if p.optimizer not in OPTIMIZERS:
        _fail("optimizer", f"{p.optimizer!r} is not one of {', '.join(map(repr, OPTIMIZERS))}")


def _check_topology(p: Plan) -> Topology:
    try:
        topo = Topology.from_dict(p.topology)
    except TopologyError as e:
        raise PlanFormatError(f"plan.topology: {e}; {_FIX}") from None
    if topo.world_size != p.world_size:
        _fail("world_size", f"{p.world_size} but plan.topology has {topo.world_size} devices ({topo})")
    return topo


def _check_config(p: Plan) -> None:
    c = p.config
    for name in ("dp", "tp", "pp", "cp", "ep", "microbatch_size", "num_microbatches", "interleave"):
        _at_least(f"config.{name}", getattr(c, name), 1)
    if c.dp % c.ep:
        _fail("config.ep", f"ep={c.ep} does not divide dp={c.dp}: expert-parallel groups are taken inside the "
                           "data-parallel group")
    if c.zero_stage not in (0, 1, 2, 3):
        _fail("config.zero_stage", f"{c.zero_stage!r} is not 0, 1, 2 or 3")
    if c.dp * c.cp * c.tp * c.pp != p.world_size:
        _fail("config", f"dp({c.dp}) * cp({c.cp}) * tp({c.tp}) * pp({c.pp}) = {c.dp * c.cp * c.tp * c.pp} != "
                        f"world_size {p.world_size}")
    if (c.schedule in ("interleaved-1f1b", "interleaved-zb", "zb-v", "dualpipe-v")) != (c.interleave > 1) or (
            c.schedule in ("zb-v", "dualpipe-v") and c.interleave != 2):
        _fail("config.interleave", f"interleave={c.interleave} with schedule {c.schedule!r}: interleaved-1f1b and "
                                   "interleaved-zb run interleave >= 2 virtual stages per rank, zb-v and dualpipe-v "
                                   "exactly 2, the others exactly 1")
    per_step = c.dp * c.microbatch_size * c.num_microbatches
    if per_step != p.global_batch_size:
        _fail("global_batch_size", f"{p.global_batch_size} != dp({c.dp}) * config.microbatch_size"
                                   f"({c.microbatch_size}) * config.num_microbatches({c.num_microbatches}) = {per_step}")


def _check_mesh(p: Plan, topo: Topology) -> None:
    c = p.config
    if len(p.mesh) != p.world_size:
        _fail("mesh", f"{len(p.mesh)} entries, but world_size is {p.world_size}: one MeshCoord per rank")
    coords = set()
    for r, m in enumerate(p.mesh):
        if m.rank != r:
            _fail(f"mesh[{r}].rank", f"{m.rank!r}: the mesh lists ranks in order 0..{p.world_size - 1}")
        for axis, size in (("pp", c.pp), ("dp", c.dp), ("cp", c.cp), ("tp", c.tp)):
            if not 0 <= getattr(m, axis) < size:
                _fail(f"mesh[{r}].{axis}", f"{getattr(m, axis)!r} is outside 0..{size - 1} (config.{axis}={size})")
        if m.node != topo.node_of(r):
            _fail(f"mesh[{r}].node", f"{m.node!r}, but rank {r} is on node {topo.node_of(r)} of plan.topology")
        coords.add((m.pp, m.dp, m.cp, m.tp))
    if len(coords) != p.world_size:
        _fail("mesh", "two ranks share a (pp, dp, cp, tp) coordinate: each coordinate belongs to exactly one rank")


def _check_schedule(p: Plan) -> None:
    c, s = p.config, p.instructions
    for name, want in (("kind", c.schedule), ("pp", c.pp), ("num_microbatches", c.num_microbatches),
                       ("interleave", c.interleave)):
        have = getattr(s, name)
        if have != want:
            _fail("instructions", f"the schedule's {name}={have!r} but config.{'schedule' if name == 'kind' else name}"
                                  f"={want!r}")
    stages = s.num_stages
    for r, actions in enumerate(s.ranks):
        for a in actions:
            if not 0 <= a.stage < stages or (a.microbatch is not None and not 0 <= a.microbatch < c.num_microbatches):
                _fail("instructions", f"rank {r}'s action {a} names a stage or microbatch outside this plan's "
                                      f"{stages} stages x {c.num_microbatches} microbatches")


def _check_stages(p: Plan) -> None:
    c = p.config
    want = c.pp * c.interleave
    if len(p.stages) != want:
        _fail("stages", f"{len(p.stages)} stages, but pp({c.pp}) * interleave({c.interleave}) = {want}")
    for k, st in enumerate(p.stages):
        if st.index != k:
            _fail(f"stages[{k}].index", f"{st.index!r}: stages are listed in order 0..{want - 1}")
        rank = stage_rank(c.schedule, c.pp, k)
        ranks = tuple(m.rank for m in p.mesh if m.pp == rank)
        if tuple(st.ranks) != ranks:
            _fail(f"stages[{k}].ranks", f"{list(st.ranks)}, but the mesh puts pipeline rank {rank} on {list(ranks)}")
        if not 0 <= st.first_node <= st.last_node:
            _fail(f"stages[{k}].first_node", f"{st.first_node}..{st.last_node} is not a range of graph nodes")
        _at_least(f"stages[{k}].num_params", st.num_params, 0)


def _check_placements(p: Plan) -> None:
    seen = set()
    for i, pl in enumerate(p.placements):
        if pl.param in seen:
            _fail(f"placements[{i}].param", f"{pl.param!r} is placed twice")
        seen.add(pl.param)
        if any(d < 0 for d in pl.shape):
            _fail(f"placements[{i}].shape", f"{list(pl.shape)} has a negative size")
        try:
            dim = sharded_dim(pl.spec)
        except ValueError:
            dim = len(pl.shape)  # not a spec: refused below, as a dim out of range is
        if dim is not None and dim >= len(pl.shape):
            _fail(f"placements[{i}].spec", f"{pl.spec!r} is not 'R' (replicated) or 'S(d)' with d a dim of "
                                           f"shape {list(pl.shape)}")
        _at_least(f"placements[{i}].fused", pl.fused, 1)
        bad = [s for s in pl.stages if not 0 <= s < len(p.stages)]
        if bad:
            _fail(f"placements[{i}].stages", f"{bad} are not stages of this plan (0..{len(p.stages) - 1})")


def _check_async_sgd(p: Plan) -> None:
    if p.async_sgd is None:
        return
    try:
        async_sgd_pin(p.async_sgd)  # the declaration's own rule: {"every": k >= 1} or {"staleness": s >= 0}
    except DeclarationError as e:
        raise PlanFormatError(f"plan.async_sgd: {e}; {_FIX}") from None
    c = p.config
    have = {name: getattr(c, name) for name in ASYNC_SGD_FORCED}
    if have != ASYNC_SGD_FORCED:
        _fail("async_sgd", f"{p.async_sgd} with config {have}: async SGD plans are plain data parallel "
                           f"({ASYNC_SGD_FORCED})")
