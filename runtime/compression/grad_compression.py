"""How one data-parallel group's gradients go on the wire: compressor per link level, hierarchy, warm-up.

`DataParallel` hands every bucket (DDP, ZeRO-1: an all-reduce) or flat
buffer (ZeRO-2/3: a reduce-scatter) to a `GradientReducer`, which applies
the plan's compression (`plan.compression`, cost_models/compression.py):

=============  ===========================================================================
compressor     on the wire
=============  ===========================================================================
none           fp32 (DataParallel keeps its own asynchronous all-reduce / reduce-scatter)
bf16           divided by the group size first (a 16-bit sum cannot overflow), then bf16
int8, int4     `runtime.compression.compressed_reduce`: blockwise absmax codes, error feedback on both
               phases; a reduce-scatter is its first phase only
powersgd       `runtime.compression.powersgd`: rank-r factors P and Q of every large matrix, error
               feedback, warm start (all-reduce only: ZeRO-2/3 refuse it)
=============  ===========================================================================

Hierarchical (`nodes`: the group spans N nodes with k ranks on each): the
gradient, divided by the group size, is reduce-scattered inside the node at
the intra-node compressor, each rank all-reduces its 1/k chunk with the ranks
at its local index on the other nodes at the inter-node compressor, and the
chunks are all-gathered inside the node again: only n/k elements per rank
cross the slow link, compressed. PowerSGD across nodes needs whole matrices,
not chunks: the node all-reduces in fp32 first, then every local index runs
the same PowerSGD across nodes. Every rank ends with the same bytes.

Warm-up: the first `warmup_steps` steps reduce in fp32 (compressors, and
error feedback, start from trained-in gradients rather than the first noisy
ones, as 1-bit Adam's warm-up and PowerSGD's `start_powerSGD_iter` do).

State (`state_dict`): the step count and world size, and every residual and
PowerSGD factor keyed by a stable name of what was reduced (its parameter
names), never by a bucket index; loading it under another group size drops
the residuals with a warning (they were for other chunks) and keeps the step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from cost_models.powersgd import POWERSGD_RANK
from runtime.comm.collectives import Collectives
from runtime.comm.groups import NodeGroups
from runtime.compression.compressed_reduce import CompressedReduce

__all__ = ["COMPRESSORS", "GradientReducer"]

COMPRESSORS = ("none", "bf16", "int8", "int4", "powersgd")
_BITS = {"int8": 8, "int4": 4}
log = logging.getLogger(__name__)


class GradientReducer:
    """Reduces one data-parallel group's gradients as the plan compresses them (module docstring).

    compression: one compressor for a flat group, or {"intra_node": ..., "inter_node": ...} with `nodes`.
    """

    def __init__(self, group, collectives: Collectives, *, compression: str | Mapping[str, str] = "none",
                 nodes: NodeGroups | None = None, zero_stage: int = 0, warmup_steps: int = 0,
                 powersgd_rank: int = POWERSGD_RANK):
        self.group, self.collectives, self.zero_stage = group, collectives, zero_stage
        self.world = dist.get_world_size(group)
        self.nodes = nodes
        if isinstance(compression, str):
            if nodes is not None:
                compression = {"intra_node": compression, "inter_node": compression}
        else:
            unknown = set(compression) - {"intra_node", "inter_node"}
            if unknown:
                raise ValueError(f"compression={dict(compression)}: unknown levels {sorted(unknown)}; the levels "
                                 "are 'intra_node' and 'inter_node'")
            if nodes is None:
                raise ValueError(f"compression={dict(compression)} names link levels, but the group is not split "
                                 "by node (nodes=None): pass one compressor, or the NodeGroups of "
                                 "runtime.comm.groups.make_node_groups")
            compression = {lv: compression.get(lv, "none") for lv in ("intra_node", "inter_node")}
        names = [compression] if isinstance(compression, str) else list(compression.values())
        for c in names:
            if c not in COMPRESSORS:
                raise ValueError(f"compression={c!r}: one of {', '.join(COMPRESSORS)}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r}: the number of first steps sent uncompressed, an int >= 0")
        if "powersgd" in names and zero_stage >= 2:
            raise ValueError(f"compression='powersgd' with zero_stage={zero_stage}: PowerSGD approximates whole "
                             "gradient matrices, which a ZeRO-2/3 reduce-scatter never holds; use int8/int4/bf16, "
                             "or zero_stage 0 or 1")
        if isinstance(compression, dict):
            ci, ce = compression["intra_node"], compression["inter_node"]
            if zero_stage >= 2 and ci != ce:
                raise ValueError(f"compression={compression} with zero_stage={zero_stage}: ZeRO-2/3 reduce-scatter "
                                 "over the whole group at one compressor; give the same one for both levels")
            if ci == "powersgd" and ce != "powersgd" or ce == "powersgd" and ci != "none" and ci != "powersgd":
                raise ValueError(f"compression={compression}: PowerSGD runs across nodes after a full-precision "
                                 "reduction inside the node, or over the whole group; use "
                                 "{'intra_node': 'none', 'inter_node': 'powersgd'} or 'powersgd' for both")
            if ci == ce and zero_stage < 2 and ci in ("none", "powersgd") or zero_stage >= 2:
                compression = ci  # one compressor everywhere: a flat reduction over the whole group
        self.compression = compression
        self.flat = compression if isinstance(compression, str) else None
        self.warmup_steps, self.steps = warmup_steps, 0
        self.powersgd_rank = powersgd_rank
        self._parts: dict[str, object] = {}  # name -> compressor state holder (residuals, factors)
        if self.flat is not None:
            self._add_part("flat", self.flat, group)
        else:
            ci, ce = compression["intra_node"], compression["inter_node"]
            self._add_part("intra", ci, nodes.intra)
            self._add_part("cross", ce, nodes.cross)

    def _add_part(self, name: str, compressor: str, group) -> None:
        if compressor in _BITS:
            self._parts[name] = CompressedReduce(group, self.collectives, bits=_BITS[compressor])
        elif compressor == "powersgd":
            from runtime.compression.powersgd import PowerSGD

            self._parts[name] = PowerSGD(group, self.collectives, rank=self.powersgd_rank)

    # ---- what DataParallel asks -------------------------------------------------------------
    @property
    def compressing(self) -> bool:
        """Whether this step's gradients are compressed (a compressor is set and warm-up is over)."""
        names = [self.flat] if self.flat is not None else list(self.compression.values())
        return self.steps >= self.warmup_steps and any(c != "none" for c in names)

    @property
    def quantized_weights(self) -> bool:
        """ZeRO-3 gathers int8-quantized weights this step (with an int8/int4 gradient compressor)."""
        return self.zero_stage == 3 and self.flat in _BITS and self.steps >= self.warmup_steps

    def step_done(self) -> None:
        self.steps += 1

    @torch.no_grad()
    def all_reduce_mean_(self, g: torch.Tensor, key: str, shapes: Sequence[tuple[int, ...]]) -> None:
        """g (a bucket: the parameters of `shapes` end to end) becomes the group's mean gradient, in place."""
        if not self.compressing:
            self.collectives.all_reduce(g, self.group, op="avg")
        elif self.flat is not None:
            g.copy_(self._all_reduce(self.flat, "flat", g, key, shapes, self.group, op="avg"))
        else:
            g.copy_(self._hierarchical(g / self.world, key, shapes))

    @torch.no_grad()
    def reduce_scatter_mean(self, inp: torch.Tensor, key: str) -> torch.Tensor:
        """This rank's shard (1/world of inp) of the group's mean of inp (ZeRO-2/3)."""
        p = self.world
        if not self.compressing:
            out = torch.empty(inp.numel() // p, device=inp.device)
            self.collectives.reduce_scatter(out, inp, self.group, op="avg")
            return out
        return self._reduce_scatter(self.flat, "flat", inp / p, key, self.group)

    # ---- the pieces ---------------------------------------------------------------------------
    def _all_reduce(self, c: str, part: str, x: torch.Tensor, key: str, shapes, group, *, op: str) -> torch.Tensor:
        p = dist.get_world_size(group)
        if c == "none":
            out = x.clone()
            self.collectives.all_reduce(out, group, op=op)
            return out
        if c == "bf16":
            t = (x / p if op == "avg" else x).to(torch.bfloat16)  # divide first: a 16-bit sum cannot overflow
            self.collectives.all_reduce(t, group, op="sum")
            return t.float()
        if c == "powersgd":  # its factors and residuals are fp32 whatever the gradients are (pure bf16: bf16)
            return self._parts[part].reduce(x.float(), key, shapes, op=op)
        return self._parts[part].reduce(x, key, op=op)

    def _reduce_scatter(self, c: str, part: str, y: torch.Tensor, key: str, group) -> torch.Tensor:
        p = dist.get_world_size(group)
        if c == "none":
            out = torch.empty(y.numel() // p, device=y.device)
            self.collectives.reduce_scatter(out, y, group, op="sum")
            return out
        if c == "bf16":
            out = torch.empty(y.numel() // p, dtype=torch.bfloat16, device=y.device)
            self.collectives.reduce_scatter(out, y.to(torch.bfloat16), group, op="sum")
            return out.float()
        return self._parts[part].reduce_scatter(y, key)

    def _all_gather(self, c: str, part: str, mine: torch.Tensor, key: str, group) -> torch.Tensor:
        p = dist.get_world_size(group)
        if c in _BITS:
            return self._parts[part].all_gather(mine, key)
        dtype = torch.bfloat16 if c == "bf16" else torch.float32
        out = torch.empty(p * mine.numel(), dtype=dtype, device=mine.device)
        self.collectives.all_gather(out, mine.to(dtype), group)
        return out.float()

    def _hierarchical(self, x: torch.Tensor, key: str, shapes) -> torch.Tensor:
        """The sum over the group of x (already divided by the group size), by node (module docstring)."""
        ci, ce = self.compression["intra_node"], self.compression["inter_node"]
        nodes = self.nodes
        if ce == "powersgd":
            self.collectives.all_reduce(x, nodes.intra, op="sum")
            return self._parts["cross"].reduce(x.float(), key, shapes, op="sum")
        k, n = len(nodes.intra_ranks), x.numel()
        c = math.ceil(n / k)
        y = torch.zeros(k * c, device=x.device)
        y[:n] = x.reshape(-1)
        mine = self._reduce_scatter(ci, "intra", y, key, nodes.intra)
        mine = self._all_reduce(ce, "cross", mine, key, None, nodes.cross, op="sum")
        return self._all_gather(ci, "intra", mine, key, nodes.intra)[:n].view_as(x)

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only: "steps", "world", and "<part>/<name>" for every residual and factor."""
        sd = {"steps": torch.tensor(self.steps), "world": torch.tensor(self.world)}
        for part, holder in self._parts.items():
            sd.update({f"{part}/{k}": v for k, v in holder.state_dict().items()})
        return sd

    def load_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        self.steps = int(sd["steps"])
        if int(sd["world"]) != self.world:
            log.warning("gradient compression: the checkpoint's residuals are for %d data-parallel ranks, this "
                        "group has %d: dropped, error feedback restarts from zero", int(sd["world"]), self.world)
            for holder in self._parts.values():
                holder.load_state_dict({})
            return
        for part, holder in self._parts.items():
            prefix = f"{part}/"
            holder.load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)})
