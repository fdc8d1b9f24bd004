"""What a candidate's units cost: per-unit times, activation memory and parameters.

Units are what pipeline cuts move between stages: the repeated blocks (the
prefix rides with the first, the suffix with the last) or, at node
granularity, single nodes. For a setting (tp, microbatch, recompute) each
unit gets a forward and backward time per microbatch, the activation bytes
it keeps per in-flight microbatch, and its parameters per tensor rank
(`CostContext.unit_cost`); `UnitArrays` holds them, with prefix sums, for one
setting. `partitioner.planner.stage_costs` turns runs of units into stages.

Units of everything: seconds and bytes.
"""


from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

from cost_models.calibration import Calibration
from cost_models.choices import SELECTIVE_RECOMPUTE
from cost_models.comm import CommModel
from cost_models.compression import (
    LEVELS,
    WEIGHT_CODES,
    combinations,
    group_compressor,
    traffic_levels,
)
from cost_models.compute import RooflineCompute, dtype_for
from cost_models.fp8 import FP8_GEMM_OPS, FP8_PRECISIONS, cast_bytes, check_fp8, gemm_dtype
from cost_models.memory import MATRIX_PRODUCTS, SELECTIVE_KEEPS, allocator_slack
from cost_models.mesh import Mesh
from cost_models.placements import is_sharded
from cost_models.powersgd import LowRank, low_rank
from cost_models.topology import Topology
from partitioner.planner.context_split import (ATTENTION_OP, RING_MESSAGE_ITEMSIZE, all_to_all_time, attention_buffer_bytes,
                                               kv_blocks, local, ring_exposed)
from partitioner.planner.expert_split import Experts, exchange_bytes, experts_of, rank_imbalance
from partitioner.planner.plan import ParallelConfig
from partitioner.planner.tensor_split import WHAT_F, WHAT_G, WHAT_VOCAB_EMBEDDING, TPCollective, TensorSplits
from partitioner.tracer.opgraph import OpGraph
from partitioner.tracer.symbolic import Poly

__all__ = ["CostContext", "UnitArrays", "UnitCost", "units_of"]

_S = Poly.from_terms({(0, 1): 1.0})  # a dimension of the sequence's length
_SAVED_OPS = frozenset(SELECTIVE_KEEPS)  # what selective recomputation keeps, as the runtime's policy does
# Under sequence parallelism a column-parallel matmul keeps only this rank's tokens of its input for backward
# and all-gathers them again there, overlapped with its input-gradient matmul (half its backward)
_REGATHER = "sequence parallel: input all-gathered again for backward, behind the input-gradient matmul"


def units_of(g: OpGraph, granularity: str = "block") -> tuple[tuple[int, int], ...]:
    """Node ranges [start, end) of the units; the prefix joins the first block, the suffix the last."""
    if granularity == "node" or not g.blocks:
        return tuple((i, i + 1) for i in range(len(g.nodes)))
    starts = [0] + [b.first_node for b in g.blocks[1:]]
    ends = starts[1:] + [len(g.nodes)]
    return tuple(zip(starts, ends))


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnitCost:
    forward_s: float
    backward_s: float
    activation_bytes: float  # kept per in-flight microbatch
    working_bytes: float  # recomputation's working set (the unit's full activations), full recompute only
    params: float  # per tensor rank
    largest_output: float = 0.0  # bytes of its blocks' largest floating-point node output, per microbatch and tensor rank
    # of backward_s, the weight gradients' part (a split backward's W): the matmuls' dW = dy^T x, as many FLOPs
    # as their forward; other ops' weight gradients (norms, embedding rows) are small and counted with I
    weight_s: float = 0.0
    # what a split backward's I keeps for W per microbatch (runtime.pipeline.split_backward): the gradient
    # flowing into each of those matmuls, the size of its output (bytes per microbatch and tensor rank)
    weight_grad_bytes: float = 0.0
    # of params, the expert parameters' (per rank: 1/ep of them under expert parallelism)
    expert_params: float = 0.0
    # of params, the frozen ones' (requires_grad=False: no gradient, no optimizer state)
    frozen_params: float = 0.0
    # cp > 1: the largest buffers one of its attention nodes' context-parallel kernel holds while it runs, beyond
    # the activations (context_split.attention_buffer_bytes; bytes per microbatch and tensor rank)
    context_buffer_bytes: float = 0.0
    # recompute full/selective, a unit whose first node starts a block: what it holds beyond activation_bytes
    # when it is the first unit of its stage (bytes per microbatch and tensor rank). Its block's input is
    # activation_bytes' share only as far as the previous unit made it; tensors made before that and read on
    # (a mask, rotary tables every block reads) are one tensor each, held once per stage: here, at its start.
    stage_start_bytes: float = 0.0


class CostContext:
    """Everything fixed for one compile(): graph, splits, hardware, precision.

    Not a cache in disguise: unit costs are memoised per (unit shape, tp,
    microbatch, recompute), a key that fully determines them.
    """

    def __init__(self, g: OpGraph, topo: Topology, splits: TensorSplits, *, precision: str, optimizer: str,
                 seq_len: int | None, memory_cap: float, calibration: Calibration | None = None,
                 granularity: str = "block", compression: dict[str, str] | None = None,
                 async_sgd: dict[str, int] | None = None, experts: Experts | None = None,
                 allocator_slack: bool = False, compression_warmup: int = 0):
        """experts: the graph's MoE layers as compile() found them (with why they cannot be divided, where it
        found that out); default: expert_split.experts_of(g). allocator_slack: a plan fits when its peak times the
        caching allocator's slack for its recompute mode (cost_models.memory.ALLOCATOR_SLACK) is within
        memory_cap (compile(): where max_memory_fraction is not pinned); else when its peak is.
        compression_warmup: the first steps reduce uncompressed, in the engine's own buffers."""
        self.g, self.topo, self.splits = g, topo, splits
        self.compression_warmup = compression_warmup
        self.async_sgd = dict(async_sgd) if async_sgd else None  # {"every": k} or {"staleness": s}
        self.compression_pins = dict(compression or {})  # level -> compressor the user pinned
        self.precision = precision
        self.optimizer = "adam" if optimizer == "adamw" else optimizer  # same state: m and v
        self.seq = seq_len or 1
        self.memory_cap = memory_cap
        self.allocator_slack = allocator_slack
        self.cal = calibration or Calibration.for_device(topo.device.name)
        self.compute = RooflineCompute(device=topo.device, dtype=dtype_for(precision), calibration=self.cal)
        check_fp8(precision, topo.device, emulated=topo.local or topo.device.name == "CPU")
        # fp8-mixed: the linears' GEMMs at the fp8 peak (bf16's where fp8 is emulated), plus their casts
        self.fp8 = precision in FP8_PRECISIONS
        self.gemm = RooflineCompute(device=topo.device, dtype=gemm_dtype(precision, topo.device),
                                    calibration=self.cal) if self.fp8 else self.compute
        self.comm = CommModel(topo, self.cal)
        # Activations and traffic were traced at the model's dtype; mixed precision halves float tensors.
        traced = 4 if g.dtype == "float32" else 2 if g.dtype in ("bfloat16", "float16") else 8
        self.scale = (4 if precision == "fp32" else 2) / traced
        self._traced_itemsize = traced
        self.units = units_of(g, granularity)
        # per unit: the index of the block its nodes belong to (None: prefix or suffix nodes only), which
        # ParallelConfig.recompute_blocks tells recomputed blocks by
        self._unit_block = tuple(next((n.block for n in g.nodes[a:b] if n.block is not None), None)
                                 for a, b in self.units)
        self._unit_of = [0] * len(g.nodes)
        for u, (a, b) in enumerate(self.units):
            for i in range(a, b):
                self._unit_of[i] = u
        self._collectives: dict[str, list] = {}
        for c in splits.collectives:
            self._collectives.setdefault(c.node, []).append(c)
        self._seq = splits.sequence.nodes
        self._sp_collectives = self._sequence_collectives(g, splits, self._collectives, self._unit_of)
        # Units with the same nodes, costs and splits (copied blocks) share one id, so their
        # costs are evaluated once per setting and memo keys stay small.
        # mixture of experts (partitioner.planner.expert_split): under ep > 1 the expert parameters are 1/ep per
        # rank, the experts' ops run at the busiest rank's load, each MoE layer's combine node pays the all-to-alls;
        # an expert GEMM runs one GEMM per local expert and reads only the local experts' weights
        self.experts = experts_of(g) if experts is None else experts
        self._expert_param = self.experts.params
        self._exchange = dict(self.experts.exchanges)
        self._expert_w = {name: (w, k) for name, w, k in self.experts.weights}
        moe_nodes = self.experts.nodes | self._exchange.keys()
        # the units ep changes (their expert ops and all-to-alls); every other unit costs what it does at ep = 1
        self._moe_units = frozenset(u for u, (a, b) in enumerate(self.units)
                                    if any(n.name in moe_nodes for n in g.nodes[a:b]))
        self._outputs = {n.name: n.output for n in g.nodes}
        self._op_kept = self._every_second_product(g)
        ids: dict[tuple, int] = {}
        self._keys = [ids.setdefault(self._unit_key(a, b), len(ids)) for a, b in self.units]
        first: dict[int, int] = {}
        for u, k in enumerate(self._keys):
            first.setdefault(k, u)
        counts = collections.Counter(self._keys)
        self._unit_kinds = tuple((u, counts[k]) for k, u in first.items())  # (a unit of each kind, how many)
        self._boundary, self._boundary_new = self._boundary_bytes()
        self._memo: dict[tuple, UnitCost] = {}
        self._kv = kv_blocks(g)  # per attention node, the k and v a context-parallel kernel sends
        self._arrays: dict[tuple, UnitArrays] = {}
        self._bottlenecks: dict[tuple, float] = {}  # StageEvaluator.min_max_c
        self._engine_floors: dict[tuple, list[float]] = {}  # stage_costs._engine_floor
        self._comm_memos: dict[tuple, dict] = {}  # StageEvaluator._comm_memo
        self._p2p: dict[tuple | None, tuple[float, ...]] = {}
        self._codes: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        self._param_local = self._param_sizes()
        self._param_block = {p.name: p.block for p in g.params}
        # parameters that train nothing: held, but no gradient, master or optimizer state (the engine's buckets and
        # masters are the trainable parameters': runtime.engines.data_parallel)
        self._frozen = frozenset(g.frozen_params)
        self._sharded = {pl.param: is_sharded(pl.spec) for pl in splits.placements}
        self._low_rank: dict[int, tuple[list[LowRank], tuple]] = {}
        self._unit_low_rank: dict[int, tuple[LowRank, ...]] = {}
        self._params_of: dict[tuple[int, int, int], tuple[float, float, float]] = {}  # _unit_params
        self._layouts: dict[tuple[int, int], _ParamLayout] = {}  # _param_layout
        self._crossed: dict[tuple[int, int, int, int], tuple[str, ...]] = {}  # crossed_levels

    # ---- static structure ------------------------------------------------
    def _unit_key(self, a: int, b: int) -> tuple:
        nodes = self.g.nodes[a:b]
        return tuple((n.cost, n.op in FP8_GEMM_OPS, n.name in self.splits.sharded_nodes, n.name in self._seq,
                      tuple((c.phase, c.bytes) for c in self._collectives.get(n.name, ())),
                      tuple((c.phase, c.kind, c.bytes) for c in self._sp_collectives.get(n.name, ())),
                      n.output.nbytes(1, 1) if n.output else 0, self._expert_w.get(n.name), n.name in self._op_kept)
                     for n in nodes)

    @staticmethod
    def _sequence_collectives(g: OpGraph, splits: TensorSplits, tensor: dict[str, list[TPCollective]],
                              unit_of: Sequence[int]) -> dict[str, list[TPCollective]]:
        """Per node, the tensor group's collectives under sequence parallelism (partitioner.planner.sequence_split):
        those of `tensor` (the same per node without it) less the ones it replaces, and what it runs. A
        reduce-scatter where a row-parallel (or vocab embedding) output was all-reduced, its all-gather in
        backward; an all-gather before
        each tensor-split reader, and in backward a reduce-scatter of its gradient and the same all-gather again
        (the reader keeps only this rank's tokens for backward, Megatron's choice, so the activations are 1/tp);
        the gradients of replicated parameters applied to 1/tp of the tokens summed, and those of replicated values
        broadcast over them.

        A value several readers gather (the q, k and v projections of one normed input) is gathered once, its
        gradient reduce-scattered once and gathered again once, as the generated code does
        (partitioner.codegen.segment_tp: one gather per value and kind in a segment;
        runtime.pipeline.tensor_parallel: one re-gather for all its saved copies): charged at its first reader in
        each unit (`unit_of`: node index -> unit), a segment being whole units."""
        seq = splits.sequence
        out: dict[str, list[TPCollective]] = {}
        nbytes = {n.name: n.output.nbytes_poly() for n in g.nodes if n.output is not None}
        needs_grad = {n.name: n.requires_grad for n in g.nodes}

        def add(node: str, phase: str, kind: str, b: Poly, what: str) -> None:
            out.setdefault(node, []).append(TPCollective(node=node, phase=phase, kind=kind, bytes=b, what=what))

        scattered = {n for n, _ in seq.scatters}
        gathered_by_tp = {n for n, _, _, k in seq.gathers if k == "tp"}
        for n, _ in seq.scatters:
            add(n, "forward", "reduce_scatter", nbytes[n], "sequence parallel: output reduce-scattered over tokens")
            add(n, "backward", "all_gather", nbytes[n], "sequence parallel: its gradient all-gathered")
        index = {n.name: i for i, n in enumerate(g.nodes)}
        gathered: set[tuple[str, str, int]] = set()
        for n, x, _, kind in sorted(seq.gathers, key=lambda t: index[t[0]]):
            if (x, kind, unit_of[index[n]]) in gathered:
                continue
            gathered.add((x, kind, unit_of[index[n]]))
            add(n, "forward", "all_gather", nbytes[x], f"sequence parallel: {x} all-gathered over tokens")
            if kind == "tp" and needs_grad.get(x, False):
                add(n, "backward", "reduce_scatter", nbytes[x], "sequence parallel: input gradient reduce-scattered")
                add(n, "backward", "all_gather", nbytes[x], _REGATHER)
        for n, x, _ in seq.chunks:
            if needs_grad.get(x, False):
                add(n, "backward", "all_gather", nbytes[x], f"sequence parallel: gradient of {x} all-gathered")
        for n, b in seq.param_grads:
            add(n, "backward", "all_reduce", Poly.const(b), "sequence parallel: replicated parameter gradient")
        for n, x in seq.reduces:
            add(n, "backward", "all_reduce", nbytes[x], f"sequence parallel: gradient of {x}, broadcast over the "
                "tokens, summed")
        kept = {node: [c for c in cs if not (c.node in scattered and c.what in (WHAT_G, WHAT_VOCAB_EMBEDDING))
                       and not (c.node in gathered_by_tp and c.what == WHAT_F)] for node, cs in tensor.items()}
        return {node: kept.get(node, []) + out.get(node, []) for node in {*kept, *out}}

    def _boundary_bytes(self) -> tuple[list[Poly], list[Poly]]:
        """Bytes crossing each unit boundary (outputs made before it and read after it), and of those the
        ones the unit just before the boundary made."""
        last_use: dict[str, int] = {}
        for i, n in enumerate(self.g.nodes):
            for x in n.inputs:
                last_use[x] = max(last_use.get(x, -1), self._unit_of[i])
        diff = [Poly() for _ in range(len(self.units) + 1)]
        for i, n in enumerate(self.g.nodes):
            u, last = self._unit_of[i], last_use.get(n.name, -1)
            if last > u and n.output is not None:
                nbytes = n.output.nbytes_poly()
                diff[u] = diff[u] + nbytes
                diff[last] = diff[last] + nbytes * -1
        made = [Poly() for _ in self.units]
        for i, n in enumerate(self.g.nodes):
            u = self._unit_of[i]
            if last_use.get(n.name, -1) > u and n.output is not None:
                made[u] = made[u] + n.output.nbytes_poly()
        out, acc = [], Poly()
        for u in range(len(self.units) - 1):
            acc = acc + diff[u]
            out.append(acc)
        return out, made[:-1]

    def _param_sizes(self) -> dict[int, list[tuple[str, float]]]:
        """Per unit: (parameter, elements per tensor rank at tp=1) for each parameter its nodes read."""
        numel = {p.name: p.numel for p in self.g.params}
        per_unit: dict[int, list[tuple[str, float]]] = {}
        for u, (a, b) in enumerate(self.units):
            seen = dict.fromkeys(p for n in self.g.nodes[a:b] for p in n.params)
            per_unit[u] = [(p, numel[p]) for p in seen]
        return per_unit

    def low_rank_sums(self, tp: int) -> tuple[list[LowRank], tuple[tuple[tuple[int, LowRank], ...], ...]]:
        """PowerSGD's view of the gradients one tensor rank holds: prefix sums over units, and the
        parameters several units read ((unit, LowRank) each), to count once per stage as `stage` does.

        Shapes are the local ones: a parameter split on dim d holds shape[d] / tp there.
        """
        hit = self._low_rank.get(tp)
        if hit is None:
            per_param = self._param_low_ranks(tp)
            owners: dict[str, list[int]] = {}
            prefix = [LowRank()]
            for u in range(len(self.units)):
                acc = prefix[-1]
                for p, _ in self._param_local[u]:
                    acc = acc + per_param[p]
                    owners.setdefault(p, []).append(u)
                prefix.append(acc)
            shared = tuple(tuple((u, per_param[p]) for u in us) for p, us in owners.items() if len(us) > 1)
            hit = self._low_rank[tp] = (prefix, shared)
        return hit

    def boundary_bytes(self, u: int, mb: int, split: int = 1, cp: int = 1) -> float:
        """Activation bytes sent from unit u to unit u + 1 for one microbatch; `split`: the tensor degree under
        sequence parallelism, which cuts the hidden state at every cut over the tensor group; `cp`: the
        context degree, whose ranks each send their own tokens."""
        return local(self._boundary[u], mb, self.seq, cp) * self.scale / split

    def slack(self, cand: Any = None) -> float:
        """What candidate `cand`'s predicted peak is multiplied by before it is held against memory_cap: the
        caching allocator's slack for its recompute mode and share (cost_models.memory.allocator_slack; None:
        no recomputation), or 1 where the memory fraction was pinned."""
        if not self.allocator_slack:
            return 1.0
        return allocator_slack(cand.recompute, cand.recompute_blocks) if cand is not None else allocator_slack("none")

    def cap(self, cand: Any = None) -> float:
        """The predicted peak candidate `cand` may reach."""
        return self.memory_cap / self.slack(cand)

    # ---- per unit ----------------------------------------------------------
    def unit_cost(self, u: int, *, tp: int, mb: int, recompute: str, sp: bool = False, cp: int = 1,
                  cp_kind: str = "ring", ep: int = 1) -> UnitCost:
        sp = sp and tp > 1
        unit_ep = ep if u in self._moe_units else 1  # a unit without experts is evaluated once for every ep
        hit = self._raw_cost(u, tp, mb, recompute, sp, cp, cp_kind, unit_ep)
        if hit.stage_start_bytes:  # a unit starting a block under recomputation: its input, as it lies here
            made = local(self._boundary_new[u - 1], mb, self.seq, cp) * self.scale / (tp if sp else 1)
            held = local(self._boundary[u - 1], mb, self.seq, cp) * self.scale / (tp if sp else 1)
            hit = dataclasses.replace(hit, activation_bytes=hit.activation_bytes + made,
                                      stage_start_bytes=max(0.0, held - made))
        params, expert, frozen = self._unit_params(u, tp, ep)
        if not self._expert_param:
            return dataclasses.replace(hit, params=params, frozen_params=frozen)
        return dataclasses.replace(hit, params=params, expert_params=expert, frozen_params=frozen)

    def _raw_cost(self, u: int, tp: int, mb: int, recompute: str, sp: bool, cp: int, cp_kind: str,
                  ep: int) -> UnitCost:
        """_eval_unit, once per kind of unit and setting: what unit_cost adjusts for where the unit lies."""
        key = (self._keys[u], tp, mb, recompute, sp, cp, cp_kind if cp > 1 else "ring", ep)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._eval_unit(u, tp, mb, recompute, sp, cp, cp_kind, ep)
        return hit

    def _unit_params(self, u: int, tp: int, ep: int) -> tuple[float, float, float]:
        """(parameters, expert parameters, frozen parameters) of unit u per tensor and expert rank."""
        key = (u, tp, ep)
        hit = self._params_of.get(key)
        if hit is None:
            params = expert = frozen = 0.0
            for p, n in self._param_local[u]:
                local_n = n / (tp if self._sharded_param(p) else 1)
                if p in self._frozen:
                    frozen += local_n  # (not divided by ep)
                if p in self._expert_param:
                    local_n /= ep
                    expert += local_n
                params += local_n
            hit = self._params_of[key] = (params, expert, frozen)
        return hit

    def _sharded_param(self, name: str) -> bool:
        return self._sharded[name]

    def _every_second_product(self, g: OpGraph) -> frozenset[str]:
        """The nodes "selective-op" keeps, as runtime.engines.recompute's policy does: each block's fused
        attention and every second matrix product in its forward order, the first included, counting only the
        products that do not touch the attention scores."""
        kept, count, block = set(), 0, None
        for n in g.nodes:
            if n.block != block:
                block, count = n.block, 0
            if n.block is None:
                continue
            if n.op == ATTENTION_OP:
                kept.add(n.name)
            elif n.op in MATRIX_PRODUCTS and not self._touches_scores(n):
                count += 1
                if count % 2:
                    kept.add(n.name)
        return frozenset(kept)

    def _touches_scores(self, n) -> bool:
        """Whether op n reads or writes an s x s tensor (the attention scores): selective recomputes it."""
        specs = [n.output, *(self._outputs.get(i) for i in n.inputs)]
        return any(spec is not None and len(spec.shape) >= 2 and all(d == _S for d in spec.shape[-2:])
                   for spec in specs)

    def _fp8_linear_times(self, flops: float, bflops: float, moved: float, operands: float,
                          dy: float) -> tuple[float, float]:
        """(forward, backward) seconds of a linear under fp8-mixed (cost_models.fp8): its GEMMs at the fp8
        rate; forward casts x and W (`operands` elements, with the bias), backward the output gradient (`dy`
        elements) and x and W again (kept in bf16). All per rank. The casts are the fused kernel's where the
        GEMMs run on FP8 tensor cores, the torch ops' where fp8 is emulated."""
        fused = self.gemm.dtype == "fp8"
        tf = self.gemm.op_time(flops, moved, "matmul") + \
            self.compute.op_time(0.0, cast_bytes(operands, fused=fused), "elementwise")
        if not bflops:
            return tf, 0.0
        tb = self.gemm.op_time(bflops, 2 * moved, "matmul") + \
            self.compute.op_time(0.0, cast_bytes(dy + operands, fused=fused), "elementwise")
        return tf, tb

    def _expert_gemm_times(self, flops: float, bflops: float, moved: float, weight_bytes: float, held: int,
                           ep: int, imbalance: float) -> tuple[float, float]:
        """(forward, backward) seconds of an expert GEMM on one rank, traced as `flops` over this rank's own
        tokens x top_k rows, moving `moved` bytes of which `weight_bytes` are the weights of the `held` experts
        it reads. Under ep the rank reads 1/ep of the expert weights (a batched [E, ...] weight's E / ep local
        experts; of a module list's E expert linears it runs E / ep, ep times the rows each: summed over the
        E traced linears, 1/ep of each one's weight) and runs the busiest rank's rows (x `imbalance`, 1 at
        ep = 1). A batched weight's kernel is one GEMM per local expert (torch._grouped_mm, or Hugging Face's
        loop over experts), each at the efficiency of its own size, the rows routed to that expert: `groups`
        = held / ep GEMMs of 1/groups of the work, one launch.

        Mixtral-like (E = 8): at ep = 1, 8 GEMMs of 1/8 of the rank's routed rows each, all 8 experts' weights
        read; at ep = 8, 1 GEMM of every row the ep group routed to this rank's expert, 1/8 of the weights."""
        groups = max(1, held // ep)
        tokens = max(0.0, moved - weight_bytes) * imbalance  # activations in and out, at the busiest rank's load
        mine = tokens + weight_bytes / ep
        launch = self.compute.calibration.launch_overhead_s

        def run(f: float, b: float) -> float:
            return groups * (self.compute.op_time(f * imbalance / groups, b / groups, "matmul") - launch) + launch

        return run(flops, mine), (run(bflops, 2 * mine) if bflops else 0.0)

    def _eval_unit(self, u: int, tp: int, mb: int, recompute: str, sp: bool = False, cp: int = 1,
                   cp_kind: str = "ring", ep: int = 1) -> UnitCost:
        """One unit's costs on one rank. Under context parallelism (cp > 1) every token-dependent quantity is
        that rank's share (partitioner.planner.context_split.local), and each attention node pays its ring's
        exposed transfers or its Ulysses all-to-alls (as a collective: run again where it is recomputed).
        Under expert parallelism (ep > 1) the experts' ops run, and keep activations, at the busiest rank's
        load (Calibration.expert_imbalance times the balanced share, which is what the trace counts), and
        each MoE layer's combine node pays the dispatch and combine all-to-alls forward and their two
        gradients backward over the ep group (partitioner.planner.expert_split; a collective: run again
        where it is recomputed)."""
        a, b = self.units[u]
        s, sc = self.seq, self.scale
        tp_ranks = Mesh(1, 1, tp).tp_ranks()  # every tensor group sits alike: consecutive ranks
        cp_ranks = Mesh(1, 1, tp, cp).cp_ranks()  # ring neighbours tp ranks apart
        # ep consecutive data-parallel ranks, cp * tp apart; 1 where the layer has no experts
        imbalance = rank_imbalance(self.cal.expert_imbalance, self.experts.num_experts, ep)
        ep_ranks = tuple(range(0, ep * cp * tp, cp * tp)) if ep > 1 else ()

        def at(p: Poly) -> float:  # this rank's share of a per-microbatch quantity
            return p(mb, s) if cp == 1 else local(p, mb, s, cp)

        def nbytes(spec) -> float:
            return spec.nbytes(mb, s) if cp == 1 else local(spec.nbytes_poly(), mb, s, cp)

        fwd = bwd = act = biggest = wgt = wbytes = cp_buffers = 0.0
        # Recomputation (runtime.engines.recompute) runs inside the blocks only, never on the prefix or suffix
        # (the loss's inputs) a unit may also hold: their activations stay, their ops run once.
        # full: a block keeps its input; selective: the outputs of its matrix products and layer
        # norms that do not touch the s x s attention scores, every other op runs again in backward;
        # selective-op: fused attention's outputs and every second product's (_every_second_product).
        outside = block_f = kept_sel = recomputed_f = 0.0
        block_input = None  # the inputs of the blocks the unit holds (None: it holds none)
        starts_block = False  # its first node starts a block whose input comes from the unit before
        prev = self.g.nodes[a - 1] if a > 0 else None
        for i in range(a, b):
            n = self.g.nodes[i]
            c = n.cost
            d = tp if (tp > 1 and (n.name in self.splits.sharded_nodes or (sp and n.name in self._seq))) else 1
            if n.output is not None and n.output.dtype.startswith(("float", "bfloat")) and \
                    (n.block is not None or not self.g.blocks):  # the prefix's and suffix's are the loss's moment
                biggest = max(biggest, nbytes(n.output) * sc / d)
            flops = at(c.forward_flops) / d * c.executed  # causal attention: half the counted products run
            moved = (at(c.bytes_read) + at(c.bytes_written)) * sc / d
            tf = self.compute.op_time(flops, moved, c.op_class) if (flops or moved) else 0.0
            bflops = at(c.backward_flops) / d * c.executed
            tb = self.compute.op_time(bflops, 2 * moved, c.op_class) if bflops else 0.0
            if self.fp8 and n.op in FP8_GEMM_OPS:
                operands = at(c.bytes_read) / self._traced_itemsize / d  # elements of x, W (and the bias)
                dy = nbytes(n.output) / n.output.itemsize / d if n.output is not None else 0.0
                tf, tb = self._fp8_linear_times(flops, bflops, moved, operands, dy)
            expert_op = ep > 1 and n.name in self.experts.nodes
            if n.name in self._expert_w and not (self.fp8 and n.op in FP8_GEMM_OPS):
                w, held = self._expert_w[n.name]
                tf, tb = self._expert_gemm_times(flops, bflops, moved, w * sc / d, held, ep, imbalance)
            elif expert_op:
                tf, tb = tf * imbalance, tb * imbalance
            if c.op_class == "matmul" and n.params and bflops:
                wgt += tb * min(1.0, flops / bflops)
                wbytes += nbytes(n.output) * sc / d if n.output is not None else 0.0
            fixed = at(c.fixed_activation_bytes)  # masks and indices: the same size at any precision
            kept = ((at(c.activation_bytes) - fixed) * sc + fixed) / d
            if expert_op:
                kept *= imbalance
            collective_f = 0.0
            if ep > 1 and n.name in self._exchange and n.output is not None:
                t = self.comm.all_to_all(exchange_bytes(nbytes(n.output) * sc / d, self._exchange[n.name]), ep_ranks)
                collective_f += 2 * t
                bwd += 2 * t
            if cp > 1 and n.op == ATTENTION_OP and len(n.inputs) >= 3:
                sizes = [nbytes(t) * sc / d for t in self._context_tensors(n, d, cp, cp_kind)]
                held = sizes if cp_kind != "ring" else [x / sc * RING_MESSAGE_ITEMSIZE / self._traced_itemsize for x in sizes]
                cp_buffers = max(cp_buffers, attention_buffer_bytes(held, cp, cp_kind))
                if cp_kind == "ring":
                    ring_f, ring_b = ring_exposed(sum(sizes), tf, tb, self.comm, cp_ranks)
                    collective_f += ring_f
                    bwd += ring_b
                else:
                    t = all_to_all_time(sizes, self.comm, cp_ranks)
                    collective_f += t
                    bwd += t
            if tp > 1:
                for coll in (self._sp_collectives if sp else self._collectives).get(n.name, ()):
                    t = getattr(self.comm, coll.kind)(at(coll.bytes) * sc, tp_ranks)
                    if coll.phase == "forward":
                        collective_f += t
                    elif coll.what == _REGATHER:  # issued before the input-gradient matmul, as Megatron does
                        bwd += max(0.0, t - tb / 2)
                    else:
                        bwd += t
            if n.block is None:
                outside += kept
            else:
                if i == a or prev.block != n.block:  # a block starts: what is its input
                    if i == a:  # added by unit_cost: unit u's share depends on u, not only on the unit's shape
                        ins, starts_block = 0.0, u > 0
                    else:
                        ins = nbytes(prev.output) * sc / (tp if sp and prev.name in self._seq else 1) \
                            if prev.output is not None else 0.0
                    block_input = (block_input or 0.0) + ins
                block_f += tf + collective_f
                keeps = n.name in self._op_kept if recompute == "selective-op" else \
                    n.op in _SAVED_OPS and not self._touches_scores(n)
                if keeps and n.output is not None:
                    kept_sel += nbytes(n.output) * sc / d
                else:  # a collective is not kept either: it runs again with its op
                    recomputed_f += tf + collective_f
            fwd, bwd, act = fwd + tf + collective_f, bwd + tb, act + kept
            prev = n
        # a nonzero stage_start_bytes marks the unit for unit_cost, which fills in its input's bytes
        start = 1.0 if starts_block else 0.0
        if recompute in SELECTIVE_RECOMPUTE and block_input is not None:
            return UnitCost(forward_s=fwd, backward_s=bwd + recomputed_f, activation_bytes=outside + block_input + kept_sel,
                            working_bytes=max(0.0, act - outside - kept_sel), params=0.0, largest_output=biggest,
                            weight_s=wgt, weight_grad_bytes=wbytes, context_buffer_bytes=cp_buffers,
                            stage_start_bytes=start)
        if recompute == "full" and block_input is not None:
            return UnitCost(forward_s=fwd, backward_s=bwd + block_f, activation_bytes=outside + block_input,
                            working_bytes=act - outside, params=0.0, largest_output=biggest, weight_s=wgt,
                            weight_grad_bytes=wbytes, context_buffer_bytes=cp_buffers, stage_start_bytes=start)
        return UnitCost(forward_s=fwd, backward_s=bwd, activation_bytes=act, working_bytes=0.0, params=0.0,
                        largest_output=biggest, weight_s=wgt, weight_grad_bytes=wbytes, context_buffer_bytes=cp_buffers)

    def context_bytes(self, u: int, mb: int, tp: int, cp: int, cp_kind: str) -> float:
        """Bytes one rank sends to its context group per microbatch for unit u's attention nodes, forward and
        backward (partitioner.planner.context_split): a ring's cp - 1 k/v blocks forward, cp - 1 blocks of
        k/v and dk/dv (fp32, twice a 16-bit k/v) and a last dk/dv backward; Ulysses' eight all-to-alls of q,
        k, v, output (and gradients), (cp - 1)/cp of each."""
        if cp == 1:
            return 0.0
        a, b = self.units[u]
        out = 0.0
        for n in self.g.nodes[a:b]:
            if n.op != ATTENTION_OP or len(n.inputs) < 3:
                continue
            d = tp if tp > 1 and n.name in self.splits.sharded_nodes else 1
            sent = sum(local(t.nbytes_poly(), mb, self.seq, cp) * self.scale / d
                       for t in self._context_tensors(n, d, cp, cp_kind))
            out += (4 * (cp - 1) + 2) * sent if cp_kind == "ring" else 2 * (cp - 1) / cp * sent
        return out

    def _context_tensors(self, n, tp_div: int, cp: int, cp_kind: str) -> list:
        """The tensors (whole-sequence specs, before the rank's share) attention node n sends over its context
        group: a ring's k and v blocks, unrepeated under grouped-query attention; Ulysses' q, k, v and output,
        k and v repeated to every query head unless their heads per tensor rank split over cp
        (runtime.context.ulysses)."""
        q, k, v = (self._outputs.get(x) for x in n.inputs[:3])
        k0, v0 = self._kv[n.name]
        if cp_kind == "ring":
            return [t for t in (k0, v0) if t is not None]
        heads = k0.shape[1](1, 1) / tp_div if k0 is not None and len(k0.shape) == 4 else 0
        if heads and heads % cp == 0:
            k, v = k0, v0
        return [t for t in (q, k, v, n.output) if t is not None]

    def expert_bytes(self, u: int, mb: int, tp: int, cp: int, ep: int) -> float:
        """Bytes one rank sends to its expert-parallel group per microbatch for unit u's MoE layers, forward and
        backward: four all-to-alls of tokens x top_k x hidden each, (ep - 1)/ep of them leaving the rank."""
        if ep == 1 or not self._exchange:
            return 0.0
        a, b = self.units[u]
        out = 0.0
        for n in self.g.nodes[a:b]:
            if n.name in self._exchange and n.output is not None:
                d = tp if tp > 1 and n.name in self.splits.sharded_nodes else 1
                sent = exchange_bytes(local(n.output.nbytes_poly(), mb, self.seq, cp) * self.scale / d,
                                      self._exchange[n.name])
                out += 4 * (ep - 1) / ep * sent
        return out

    def expert_exchange_s(self, mb: int, tp: int, cp: int, ep: int) -> float:
        """Seconds of one microbatch's expert all-to-alls over every MoE layer of the model (dispatch and combine
        forward, their gradients backward), at ep consecutive data-parallel ranks; 0 at ep = 1."""
        if ep == 1 or not self._exchange:
            return 0.0
        ranks = tuple(range(0, ep * cp * tp, cp * tp))
        out = 0.0
        for n in self.g.nodes:
            if n.name in self._exchange and n.output is not None:
                d = tp if tp > 1 and n.name in self.splits.sharded_nodes else 1
                sent = exchange_bytes(local(n.output.nbytes_poly(), mb, self.seq, cp) * self.scale / d,
                                      self._exchange[n.name])
                out += 4 * self.comm.all_to_all(sent, ranks)
        return out

    def total_unit_time(self, tp: int, mb: int, recompute: str, sp: bool = False) -> float:  # at cp = 1
        """Forward and backward time of every unit, summed (`unit_arrays(...).total_c` without the arrays)."""
        sp = sp and tp > 1
        return sum(count * (c.forward_s + c.backward_s) for c, count in
                   ((self._raw_cost(u, tp, mb, recompute, sp, 1, "ring", 1), count) for u, count in self._unit_kinds))

    def unit_arrays(self, tp: int, mb: int, recompute: str, sp: bool = False, cp: int = 1,
                    cp_kind: str = "ring", ep: int = 1, recompute_blocks: tuple[int, int] = (1, 1)) -> UnitArrays:
        """The units' costs and their prefix sums for one setting; `recompute_blocks` (k, n): under "full", only
        the first k of every n blocks recompute (ParallelConfig.recompute_blocks), the others keep everything."""
        if recompute != "full":
            recompute_blocks = (1, 1)
        key = (tp, mb, recompute, sp and tp > 1, cp, cp_kind if cp > 1 else "ring", ep, recompute_blocks)
        hit = self._arrays.get(key)
        if hit is None:
            modes = self.unit_modes(recompute, recompute_blocks)
            uc = [self.unit_cost(u, tp=tp, mb=mb, recompute=modes[u], sp=sp, cp=cp, cp_kind=cp_kind, ep=ep)
                  for u in range(len(self.units))]
            if recompute_blocks != (1, 1):
                uc = self._mixed_boundaries(uc, modes, tp=tp, mb=mb, sp=sp, cp=cp)
            lay = self._param_layout(tp, ep)
            in_block = lay.in_block
            hit = self._arrays[key] = UnitArrays(
                costs=tuple(uc), f=tuple(_prefix([x.forward_s for x in uc])), b=tuple(_prefix([x.backward_s for x in uc])),
                act=tuple(_prefix([x.activation_bytes for x in uc])), par=tuple(_prefix([x.params for x in uc])),
                work=tuple(x.working_bytes for x in uc), shared=lay.shared, shared_in_block=lay.shared_in_block,
                block_par=in_block, max_param=lay.largest,
                rest=tuple(_prefix([x.params - x.frozen_params - y for x, y in zip(uc, in_block)])),
                biggest=tuple(x.largest_output for x in uc), unit_act=tuple(x.activation_bytes for x in uc),
                start=tuple(x.stage_start_bytes for x in uc),
                cp_buffers=tuple(x.context_buffer_bytes for x in uc),
                blocks=lay.blocks,
                total_c=sum(x.forward_s + x.backward_s for x in uc), total_w=sum(x.weight_s for x in uc),
                total_b=sum(x.backward_s for x in uc), wgrad=tuple(_prefix([x.weight_grad_bytes for x in uc])),
                max_unit_c=max(x.forward_s + x.backward_s for x in uc),
                epar=tuple(_prefix([x.expert_params for x in uc])) if ep > 1 else (),
                fpar=tuple(_prefix([x.frozen_params for x in uc])) if self._frozen else (),
                modules=lay.modules, max_module=lay.max_module)
        return hit

    def _param_layout(self, tp: int, ep: int) -> _ParamLayout:
        """Where the parameters lie among the units at tensor degree tp and expert degree ep (UnitArrays' fields of
        the same names): the same for every microbatch, recomputation and sequence split."""
        hit = self._layouts.get((tp, ep))
        if hit is not None:
            return hit
        owners: dict[str, list[tuple[int, float]]] = {}
        in_block = [0.0] * len(self.units)  # parameters of repeated blocks (ZeRO-3 gathers them block by block)
        largest = [0.0] * len(self.units)
        # ZeRO-3 per module (zero3_unit="module"): per unit, the parameters of each module holding some
        modules: list[dict[str, float]] = [{} for _ in self.units]
        for u in range(len(self.units)):
            for p, numel in self._param_local[u]:
                local = numel / (tp if self._sharded_param(p) else 1) / (ep if p in self._expert_param else 1)
                owners.setdefault(p, []).append((u, local))
                if p in self._frozen:  # held whole outside ZeRO's units: never gathered, no gradient
                    continue
                largest[u] = max(largest[u], local)
                mod = modules[u]
                mod[p.rpartition(".")[0]] = mod.get(p.rpartition(".")[0], 0.0) + local
                if self._param_block[p] is not None:
                    in_block[u] += local
        shared = [p for p, v in owners.items() if len(v) > 1]
        tied_modules = {p.rpartition(".")[0] for p in shared if self._param_block[p] is None}
        hit = self._layouts[tp, ep] = _ParamLayout(
            shared=tuple(tuple(owners[p]) for p in shared),
            shared_in_block=tuple(self._param_block[p] is not None for p in shared),
            in_block=tuple(in_block), largest=tuple(largest),
            blocks=tuple(_prefix([1.0 if x > 0 else 0.0 for x in in_block])),
            modules=tuple(_prefix([float(len(m)) for m in modules])),
            # a module whose parameter other units read too outside the blocks (a tied embedding) is the
            # root's unit (kept from forward to backward, StageEvaluator's `root`), not one gathered in turn
            max_module=tuple(max((v for mod, v in m.items() if mod not in tied_modules), default=0.0)
                             for m in modules))
        return hit

    def unit_modes(self, recompute: str, recompute_blocks: tuple[int, int] = (1, 1)) -> tuple[str, ...]:
        """Per unit, the recomputation it runs under: `recompute`, except under "full" with recompute_blocks (k, n)
        the units of a block whose index is not among the first k of every n, which keep everything ("none")."""
        k, n = recompute_blocks
        return tuple(recompute if recompute != "full" or b is None or b % n < k else "none" for b in self._unit_block)

    def _mixed_boundaries(self, uc: list[UnitCost], modes: tuple[str, ...], *, tp: int, mb: int, sp: bool,
                          cp: int) -> list[UnitCost]:
        """Where a recomputed block and one that keeps its activations meet, the tensor crossing between them
        counted once. A recomputed unit keeps its block's input (unit_cost adds the part the unit before made),
        and a unit that keeps everything counts its outputs that a later unit saves: after such a unit, the
        recomputed one's addition counts its input twice. A unit that keeps everything saves its input too,
        which a recomputed unit before it made inside its checkpoint and did not count: there it is added."""
        out = list(uc)
        for u in range(1, len(uc)):
            here, before = self._unit_block[u], self._unit_block[u - 1]
            if modes[u] == modes[u - 1] or here is None or here == before:
                continue  # no block starts here between a recomputed block and one that keeps everything
            made = local(self._boundary_new[u - 1], mb, self.seq, cp) * self.scale / (tp if sp and tp > 1 else 1)
            if modes[u] == "none" and modes[u - 1] == "full" and before is not None:
                out[u] = dataclasses.replace(uc[u], activation_bytes=uc[u].activation_bytes + made)
            elif modes[u] == "full" and modes[u - 1] == "none":
                out[u] = dataclasses.replace(uc[u], activation_bytes=max(0.0, uc[u].activation_bytes - made))
        return out

    def unit_low_ranks(self, tp: int) -> tuple[LowRank, ...]:
        """PowerSGD's view of each unit's gradients on one tensor rank (`low_rank_sums`, per unit, not as sums)."""
        hit = self._unit_low_rank.get(tp)
        if hit is None:
            per_param = self._param_low_ranks(tp)
            hit = self._unit_low_rank[tp] = tuple(sum((per_param[p] for p, _ in self._param_local[u]), LowRank())
                                                  for u in range(len(self.units)))
        return hit

    def _param_low_ranks(self, tp: int) -> dict[str, LowRank]:
        """PowerSGD's view of each parameter's gradient on one tensor rank: a parameter split on dim d holds
        shape[d] / tp there."""
        dims = {pl.param: pl.dim for pl in self.splits.placements} if tp > 1 else {}
        out = {}
        for p in self.g.params:
            shape, d = tuple(p.shape), dims.get(p.name)
            if d is not None:
                shape = shape[:d] + (max(1, shape[d] // tp),) + shape[d + 1:]
            out[p.name] = low_rank([shape])
        return out

    def range_codes(self, arrays: UnitArrays, p2p: tuple[float, ...],
                    low_ranks: tuple[LowRank, ...] | None = None) -> tuple[list[int], list[int]]:
        """Prefix codes of the units' contents, so that units [i, j) have the code
        `code[j] - code[i] * pow[j - i]`, equal for two ranges exactly when their units cost the same one by one
        (`StageEvaluator.stage` memoises on it).

        A unit's content is everything a stage's cost reads of it: its UnitCost (equal for the repeated blocks:
        `unit_cost` memoises per unit shape), its block's and largest parameter, the p2p time of its output, and
        where a compression option is PowerSGD, PowerSGD's view of its gradients (`low_ranks`). The codes are the ranges written as numbers in base (distinct contents + 1),
        digits from 1: exact, with no collision where a hash could have one. `arrays` and `p2p` are this
        context's memoised objects, so their identities key the codes for its life.
        """
        key = (id(arrays), id(p2p), id(low_ranks))
        hit = self._codes.get(key)
        if hit is None:
            ids: dict[tuple, int] = {}
            digits = [ids.setdefault((arrays.costs[u], arrays.block_par[u], arrays.max_param[u],
                                      arrays.modules[u + 1] - arrays.modules[u], arrays.max_module[u],
                                      p2p[u] if u < len(p2p) else None,
                                      low_ranks[u] if low_ranks is not None else None), len(ids) + 1)
                      for u in range(len(arrays.costs))]
            base, code, power = len(ids) + 1, [0], [1]
            for d in digits:
                code.append(code[-1] * base + d)
                power.append(power[-1] * base)
            hit = self._codes[key] = (code, power)
        return hit

    def p2p_times(self, pp: int, stride: int, mb: int, split: int = 1, cp: int = 1) -> tuple[float, ...]:
        """Time to send one microbatch's activations across each unit boundary.

        Pipeline neighbours sit dp*cp*tp ranks apart in the mesh (pp outermost). Where the stages span
        several nodes, some neighbours talk across a node boundary, and that link paces the pipeline (every
        microbatch crosses every boundary): each boundary is charged at the slowest pair's link, whichever
        stage it ends up between.
        """
        key = (pp, stride, mb, split, cp) if pp > 1 else None  # one object per key: range_codes keys on its identity
        hit = self._p2p.get(key)
        if hit is None:
            src = self._slowest_neighbour(pp, stride) if pp > 1 else 0
            hit = self._p2p[key] = tuple(self.comm.p2p(self.boundary_bytes(u, mb, split, cp), src, src + stride)
                                         if pp > 1 else 0.0 for u in range(len(self.units) - 1))
        return hit

    def _slowest_neighbour(self, pp: int, stride: int) -> int:
        """A rank whose next pipeline stage (`stride` ranks on) is across a node boundary where one is (the
        last rank of the first node, when it sends to a later stage), else 0."""
        per_node = self.topo.devices_per_node
        last = per_node - 1
        return last if stride < per_node and last < (pp - 1) * stride and last + stride < self.topo.world_size else 0

    def compression_options(self, cand: ParallelConfig) -> tuple[tuple[str, str], ...]:
        """The (intra_node, inter_node) compressors `cand` may use, the user's pins honoured.

        What the runtime runs on its data-parallel group (compression.combinations):
        levels the group does not cross stay "none"; at ZeRO-2/3 one compressor,
        never PowerSGD; PowerSGD across both levels only as ("none", "powersgd").
        A pin on a level the group does not cross is moot. Empty: `cand` cannot
        honour the pins.

        Policy: the planner never quantizes weights on its own. int8/int4 at
        ZeRO-3 gather int8 parameters, so the forward and backward compute with
        rounded weights (no error feedback repairs that, unlike the gradients'),
        a change of the model's numerics rather than of its gradient noise: it
        is considered only where the user pinned it. Nor does it compress
        anything on its own under precision="fp32": whoever declares fp32 asks
        for fp32 arithmetic end to end, the gradients' reduction included (a
        level they pinned compresses; the others stay "none").
        """
        if self.async_sgd:  # it averages parameters, uncompressed; no gradient all-reduce to compress
            return (("none", "none"),)
        crossed = self.crossed_levels(cand)
        pins = {lv: c for lv, c in self.compression_pins.items() if lv in crossed}
        if self.precision == "fp32":
            pins = {lv: pins.get(lv, "none") for lv in crossed}
        pinned = set(pins.values())
        return tuple(o for o in combinations(crossed, cand.zero_stage)
                     if all(o[LEVELS.index(lv)] == c for lv, c in pins.items())
                     and not (cand.zero_stage == 3 and group_compressor(o) in WEIGHT_CODES
                              and group_compressor(o) not in pinned))

    def crossed_levels(self, cand: ParallelConfig) -> tuple[str, ...]:
        """The link levels `cand`'s data-parallel gradient reduction (over dp x cp ranks) crosses (pipeline
        rank 0's group stands for all)."""
        if cand.replicas <= 1:
            return ()
        key = (cand.pp, cand.dp, cand.tp, cand.cp)
        hit = self._crossed.get(key)
        if hit is None:
            hit = self._crossed[key] = traffic_levels(self.comm, Mesh(*key).replica_ranks())
        return hit


class _ParamLayout(NamedTuple):
    """Where the parameters lie among the units at one (tp, ep): UnitArrays' fields of the same names (in_block
    is its block_par, largest its max_param)."""

    shared: tuple[tuple[tuple[int, float], ...], ...]
    shared_in_block: tuple[bool, ...]
    in_block: tuple[float, ...]
    largest: tuple[float, ...]
    blocks: tuple[float, ...]
    modules: tuple[float, ...]
    max_module: tuple[float, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnitArrays:
    """Prefix sums over units for one (tp, microbatch, recompute)."""

    costs: tuple[UnitCost, ...]
    f: tuple[float, ...]
    b: tuple[float, ...]
    act: tuple[float, ...]
    par: tuple[float, ...]
    work: tuple[float, ...]
    shared: tuple[tuple[tuple[int, float], ...], ...]  # parameters read by several units: (unit, size) each
    shared_in_block: tuple[bool, ...]  # per entry of `shared`: a parameter of a repeated block
    block_par: tuple[float, ...]  # per unit: its repeated block's parameters (per tensor rank)
    max_param: tuple[float, ...]  # per unit: its largest parameter (elements per tensor rank)
    rest: tuple[float, ...]  # prefix sums of the parameters outside the blocks (prefix, suffix)
    biggest: tuple[float, ...]  # per unit: its largest node output per microbatch (bytes)
    unit_act: tuple[float, ...]  # per unit: activation bytes kept per microbatch
    blocks: tuple[float, ...]  # prefix sums of the units holding a block's parameters
    total_c: float
    max_unit_c: float
    total_w: float = 0.0  # the weight-gradient part of the backward (UnitCost.weight_s), all units
    total_b: float = 0.0  # the backward, all units
    wgrad: tuple[float, ...] = (0.0,)  # prefix sums of UnitCost.weight_grad_bytes
    start: tuple[float, ...] = ()  # per unit: UnitCost.stage_start_bytes (held when a stage starts there)
    epar: tuple[float, ...] = ()  # prefix sums of UnitCost.expert_params under ep > 1 (empty at ep = 1)
    fpar: tuple[float, ...] = ()  # prefix sums of UnitCost.frozen_params (empty where nothing is frozen)
    # ZeRO-3 with zero3_unit="module": prefix sums of the modules holding parameters directly (its units), and
    # per unit the parameters of its largest such module (per tensor rank)
    modules: tuple[float, ...] = (0.0,)
    max_module: tuple[float, ...] = ()
    cp_buffers: tuple[float, ...] = ()  # per unit: UnitCost.context_buffer_bytes (0 at cp = 1)


def _prefix(xs: Sequence[float]) -> list[float]:
    out = [0.0]
    for x in xs:
        out.append(out[-1] + x)
    return out
