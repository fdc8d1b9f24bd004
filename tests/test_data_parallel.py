"""DDP and ZeRO-1/2/3 (runtime.engines.data_parallel) train the same as one process and as torch's own.

Tier (a): flat layouts, buckets and units as plain data. Tier (c): real Gloo
process groups (2 and 4 spawned processes, FileStore). Every spawned world
runs a list of `Run`s in one process group, rank 0 saves what it saw, and the
tests compare it with single-process training of the same model (a 2-layer
tiny GPT with a tied embedding / LM head) on the whole global batch, run here
in the pytest process. Ranks build their models from different seeds: only
the engine's start-up broadcast makes them equal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from examples.gpt import gpt_tiny
from runtime.comm.collectives import Collectives
from runtime.engines.data_parallel import DataParallel
from runtime.engines.flat import FlatLayout, bucket, default_units, resolve_units
from runtime.engines.mixed_precision import LossScaler, policy
from examples.training import ADAMW_EPS, ADAMW_LR
from ranks import adam_atol, gloo_group

STEPS = 4
GLOBAL_BATCH = 8
SEQ = 16
BUCKET_BYTES = 2**18  # 256 KiB: the tiny GPT (2.2 MB of fp32) then has several buckets
RTOL, ATOL = 1e-5, 1e-6


@dataclasses.dataclass(frozen=True)
class Run:
    stage: int  # 0-3, or "ddp" / "zero" / "fsdp" for torch's oracles
    opt: str  # "sgd" (momentum 0.9) or "adamw"
    microbatches: int = 1
    clip: float | None = None
    precision: str = "fp32"
    rs_impl: str = "reduce_scatter"
    data: str = "steps"  # "steps": a new batch every step; "fixed": the same batch (loss must fall)
    steps: int = STEPS
    units: str | None = None  # ZeRO-3: None (default units) or "fine" (`_fine_units`)
    subgroups: bool = False  # 4 ranks as two dp groups {0, 2} and {1, 3}, each training alone
    checkpoint: bool = False  # blocks recomputed in backward (activation checkpointing)


class _Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (non-reentrant checkpoint)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _model(seed: int, checkpoint: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = gpt_tiny(n_layer=2)
    if checkpoint:
        model.transformer.h = nn.ModuleList(_Checkpointed(b) for b in model.transformer.h)
    return model


def _fine_units(model: nn.Module) -> list[list[str]]:
    """Per block: its two LayerNorms (whose smallest common module is the block, so this unit
    nests the next two), its attention, its MLP; the rest is left for `resolve_units` to add."""
    names = [n for n, _ in model.named_parameters()]

    def inner(n: str, i: int) -> str:  # the name inside block i (checkpointed blocks add "block.")
        return n.removeprefix(f"transformer.h.{i}.").removeprefix("block.")

    return [[n for n in names if n.startswith(f"transformer.h.{i}.") and inner(n, i).startswith(part)]
            for i in range(2) for part in ("ln_", "attn.", "mlp.")]


EVAL_TOKENS = torch.randint(0, 1024, (2, SEQ), generator=torch.Generator().manual_seed(7))


def _batch(step: int, data: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + (0 if data == "fixed" else step))
    idx = torch.randint(0, 1024, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


SGD = {"lr": 0.05, "momentum": 0.9}
# eps=1e-6 and lr=5e-4, not torch's 1e-8 and 1e-3: Adam divides by sqrt(v) + eps, so where
# the true gradient is ~0 (the attention key bias: softmax ignores a per-row constant) it
# turns rounding noise of the reduction order into an lr-sized step. Measured, 4 steps:
# at lr 1e-3, eps 1e-8 torch's own DDP differs from one process by up to 1.1e-5 (136
# elements past rtol 1e-5 / atol 1e-6), and this engine by exactly the same amounts; at
# eps 1e-6 still 1.35e-6 on one element at 4 ranks (both); at lr 5e-4 at most 6.7e-7 on one machine and
# 1.1e-6 on another (another CPU's kernels): parameters after AdamW are compared within adam_atol.
ADAMW = {"lr": ADAMW_LR, "weight_decay": 0.1, "eps": ADAMW_EPS}


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, **SGD) if kind == "sgd" else torch.optim.AdamW(params, **ADAMW)


# ---- single process: the truth -----------------------------------------------------------------
@functools.cache
def _reference(opt: str, clip: float | None, data: str, steps: int = STEPS, checkpoint: bool = False) -> dict:
    torch.set_num_threads(2)
    model = _model(0, checkpoint)
    optimizer = _optimizer(opt, model.parameters())
    losses, norms = [], []
    for step in range(steps):
        x, y = _batch(step, data)
        _, loss = model(x, y)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        logits, _ = model(EVAL_TOKENS)
    return {"losses": losses, "norms": norms, "logits": logits,
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


# ---- one rank ---------------------------------------------------------------------------------
def _local_microbatches(run: Run, step: int, rank: int, world: int):
    """This data-parallel rank's rows of the global batch, cut into microbatches."""
    x, y = _batch(step, run.data)
    n = GLOBAL_BATCH // world
    x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    return list(zip(x.chunk(run.microbatches), y.chunk(run.microbatches)))


def _mean_over_ranks(value: float, world: int, group=None) -> float:
    t = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(t, group=group)  # test bookkeeping, outside the counting shim
    return t.item() / world


def _run_ours(run: Run, rank: int, world: int) -> dict:
    group, ranks = None, tuple(range(world))
    if run.subgroups:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both, same order
        group, ranks = groups[rank % 2], ((0, 2), (1, 3))[rank % 2]
    dp_rank, world = ranks.index(rank), len(ranks)
    # only the group's first rank starts from the reference model: the engine must broadcast it
    model = _model(seed=0 if dp_rank == 0 else 100 + rank, checkpoint=run.checkpoint)
    coll = Collectives(reduce_scatter_impl=run.rs_impl)
    dp = DataParallel(model, group=group, ranks=ranks, zero_stage=run.stage, collectives=coll,
                      bucket_bytes=BUCKET_BYTES, precision=run.precision,
                      units=_fine_units(model) if run.units == "fine" else None)
    optimizer = _optimizer(run.opt, dp.optimizer_params())
    out = {"losses": [], "norms": [], "counts": [], "buckets": dp.buckets, "units": dp.units,
           "master_dtypes": {p.dtype for p in dp.optimizer_params()}}
    for step in range(run.steps):
        coll.reset()
        mbs = _local_microbatches(run, step, dp_rank, world)
        total = 0.0
        for i, (x, y) in enumerate(mbs):
            with dp.no_sync() if i < len(mbs) - 1 else contextlib.nullcontext():
                _, loss = dp.module(x, y)
                (loss / len(mbs)).backward()
            total += loss.item() / len(mbs)
        dp.finish_gradients()
        if run.clip is not None:
            out["norms"].append(dp.clip_grad_norm_(run.clip))
        optimizer.step()
        dp.after_step()
        if step == run.steps - 1:
            out["held"] = dp.held_bytes(optimizer)
            out["compute_dtypes"] = {t.dtype for t in dp.module.parameters()}
        dp.zero_grad()
        out["counts"].append(dict(coll.counts))
        out["losses"].append(_mean_over_ranks(total, world, group))
    out["state"] = dp.full_state_dict()
    with torch.no_grad():  # an evaluation forward after training (ZeRO-3: gathers without backward)
        out["logits"], _ = dp.module(EVAL_TOKENS)
    if run.subgroups:  # bring the other group's result to rank 0 (test plumbing, world group)
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, out["state"])
        out["other_group_state"] = states[1]
    out["scaler"] = dataclasses.asdict(dp.scaler) if dp.scaler else None
    return out


def _run_torch(run: Run, rank: int, world: int) -> dict:
    """torch's own wrappers on the same data: the oracles."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(seed=0)  # FSDP2 shards each rank's own copy: start them equal
    if run.stage == "fsdp":
        for block in model.transformer.h:
            fully_shard(block)
        wrapped = fully_shard(model)
        optimizer = _optimizer(run.opt, model.parameters())
        no_sync = contextlib.nullcontext  # FSDP2 reduce-scatters every microbatch
    else:
        wrapped = DDP(model)
        if run.stage == "zero":
            cls, kw = (torch.optim.SGD, SGD) if run.opt == "sgd" else (torch.optim.AdamW, ADAMW)
            optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=cls, **kw)
        else:
            optimizer = _optimizer(run.opt, wrapped.parameters())
        no_sync = wrapped.no_sync
    losses = []
    for step in range(run.steps):
        mbs = _local_microbatches(run, step, rank, world)
        total = 0.0
        for i, (x, y) in enumerate(mbs):
            with no_sync() if i < len(mbs) - 1 else contextlib.nullcontext():
                _, loss = wrapped(x, y)
                (loss / len(mbs)).backward()
            total += loss.item() / len(mbs)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean_over_ranks(total, world))
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
             for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state if rank == 0 else None}


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    with gloo_group(rank, world, store_path):
        results = {}
        for run in _world_runs(world):
            go = _run_torch if isinstance(run.stage, str) else _run_ours
            results[run] = go(run, rank, world)
        if rank == 0:
            torch.save(results, Path(out_dir) / "rank0.pt")


# ---- the runs -----------------------------------------------------------------------------------
def _equivalence_runs() -> list[Run]:
    runs = []
    for stage in (0, 1, 2, 3):
        runs.append(Run(stage, "sgd", clip=0.5, rs_impl="all_reduce_slice"))
        runs.append(Run(stage, "adamw", microbatches=2))
    runs.append(Run(3, "sgd", microbatches=2, clip=0.5, units="fine"))
    runs += [Run(s, "sgd", units="fine" if s == 3 else None, checkpoint=True) for s in (0, 2, 3)]
    return runs


def _run_id(r: Run) -> str:
    return f"zero{r.stage}-{r.opt}-mb{r.microbatches}" + (f"-{r.units}-units" if r.units else "") + \
        ("-subgroups" if r.subgroups else "") + ("-checkpointed" if r.checkpoint else "")


SUBGROUP_RUNS = [Run(s, "adamw", microbatches=2, subgroups=True) for s in (1, 3)]  # 4 ranks only


ORACLES = {0: Run("ddp", "adamw", microbatches=2), 1: Run("zero", "adamw", microbatches=2),
           3: Run("fsdp", "adamw", microbatches=2)}
MIXED = [Run(s, "adamw", precision="bf16-mixed", data="fixed", steps=6) for s in (0, 1, 2, 3)] + \
        [Run(s, "adamw", precision="fp16-mixed", data="fixed", steps=6) for s in (0, 3)]


def _world_runs(world: int) -> list[Run]:
    """What one spawned world of `world` ranks runs, in one process group."""
    return _equivalence_runs() + list(ORACLES.values()) + (MIXED if world == 2 else SUBGROUP_RUNS)


@pytest.fixture(scope="module")
def worlds(spawned):
    return lambda world: spawned(_worker, world)[0]


def _state_atol(run: Run) -> float:
    return adam_atol(run.steps) if run.opt == "adamw" else ATOL


def _assert_state_close(got: dict, want: dict, rtol=RTOL, atol=ATOL) -> None:
    assert list(got) == list(want)
    for k, w in want.items():
        torch.testing.assert_close(got[k].float(), w.float(), rtol=rtol, atol=atol,
                                   msg=functools.partial("{}: {}".format, k))


# ---- tier (c): equivalence with one process and with torch -----------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("run", _equivalence_runs(), ids=_run_id)
def test_trains_like_one_process(worlds, world, run):
    got, want = worlds(world)[run], _reference(run.opt, run.clip, run.data, checkpoint=run.checkpoint)
    torch.testing.assert_close(got["losses"], want["losses"], rtol=RTOL, atol=ATOL)
    _assert_state_close(got["state"], want["state"], atol=_state_atol(run))
    # the logits of the trained model carry its parameters' tolerance
    torch.testing.assert_close(got["logits"], want["logits"], rtol=RTOL, atol=_state_atol(run))
    if run.clip is not None:  # the global norm over all shards is the single-process norm
        torch.testing.assert_close(got["norms"], want["norms"], rtol=RTOL, atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("run", SUBGROUP_RUNS, ids=_run_id)
def test_trains_in_a_subgroup(worlds, run):
    """Two dp groups of 2 inside 4 ranks ({0, 2} and {1, 3}, global ranks in `ranks`): each
    trains like one process, from its own first rank's model."""
    got, want = worlds(4)[run], _reference(run.opt, run.clip, run.data)
    torch.testing.assert_close(got["losses"], want["losses"], rtol=RTOL, atol=ATOL)
    _assert_state_close(got["state"], want["state"], atol=_state_atol(run))
    _assert_state_close(got["other_group_state"], want["state"], atol=_state_atol(run))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", sorted(ORACLES), ids=lambda s: f"zero{s}-vs-{ORACLES[s].stage}")
def test_trains_like_torch(worlds, world, stage):
    oracle = worlds(world)[ORACLES[stage]]
    ours = worlds(world)[Run(stage, "adamw", microbatches=2)]
    torch.testing.assert_close(ours["losses"], oracle["losses"], rtol=RTOL, atol=ATOL)
    _assert_state_close(ours["state"], oracle["state"], atol=_state_atol(ORACLES[stage]))


def _param_count() -> int:
    return sum(p.numel() for p in _model(0).parameters())


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_held_bytes_match_zero_formula(worlds, world, stage):
    """fp32 AdamW (two fp32 moments): params 4P, grads 4P, state 8P, divided by dp as ZeRO says."""
    held = worlds(world)[Run(stage, "adamw", microbatches=2)]["held"]
    P = _param_count()
    want = {"params": 4 * P / (world if stage >= 3 else 1),
            "grads": 4 * P / (world if stage >= 2 else 1),
            "optimizer": 8 * P / (world if stage >= 1 else 1)}
    for k, v in want.items():
        assert abs(held[k] - v) <= 0.1 * v, f"{k}: held {held[k]} bytes, formula {v:.0f} (P={P}, dp={world})"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("run", _equivalence_runs(), ids=_run_id)
def test_collective_counts_per_step(worlds, world, run):
    got = worlds(world)[run]
    B, U, m = len(got["buckets"]), len(got["units"]), run.microbatches
    clip = 1 if run.clip is not None and run.stage > 0 else 0
    want = {
        0: {"all_reduce": B},
        1: {"all_reduce": B + clip, "all_gather": 1},
        2: {"reduce_scatter": B * m, "all_gather": B, "all_reduce": clip},
        # forward: every unit; backward: all but the root's, which stays gathered (FSDP2's root)
        3: {"all_gather": (2 * U - 1) * m, "reduce_scatter": U * m, "all_reduce": clip},
    }[run.stage]
    want = {k: v for k, v in want.items() if v}
    assert all(c == want for c in got["counts"]), (got["counts"], want)
    if run.stage < 3:
        assert B > 1 and U == 0
    else:  # the rest (embeddings, ln_f, tied LM head) + 2 blocks, or 3 units per block
        assert U == (7 if run.units == "fine" else 3)


@pytest.mark.slow
@pytest.mark.parametrize("run", MIXED, ids=lambda r: f"zero{r.stage}-{r.precision}")
def test_mixed_precision_trains(worlds, run):
    """Loss falls on a fixed batch; masters are fp32, the model computes in 16-bit; final
    parameters within 2e-2 (max) / 2e-3 (mean) of fp32 training: 6 AdamW steps of lr 5e-4 move
    a weight by at most 3e-3, and 16-bit gradients may flip Adam's normalised step for tiny ones.
    Losses within 0.1: the 16-bit loss itself is rounded to 2**-5 = 0.03 near 7 in bf16."""
    got = worlds(2)[run]
    want = _reference(run.opt, None, run.data, run.steps)
    assert got["losses"][-1] < got["losses"][0] - 0.05, got["losses"]
    assert got["master_dtypes"] == {torch.float32}
    if run.stage < 3:
        assert got["compute_dtypes"] == {policy(run.precision).param_dtype}
    torch.testing.assert_close(got["losses"], want["losses"], rtol=0, atol=0.1)
    diffs = torch.cat([(got["state"][k] - want["state"][k]).abs().flatten() for k in want["state"]])
    assert diffs.max() < 2e-2 and diffs.mean() < 2e-3, (diffs.max(), diffs.mean())
    if run.precision == "fp16-mixed":
        assert got["scaler"]["skipped_steps"] <= 2, got["scaler"]


# ---- tier (a): layouts as data -------------------------------------------------------------------
def test_flat_layout_slices_parameters_not_whole_tensors():
    lay = FlatLayout(names=("w", "b"), shapes=((2, 3), (3,)), world=4)
    assert (lay.numel, lay.padded_numel, lay.shard_numel) == (9, 12, 3)
    assert [lay.owned_pieces(r) for r in range(4)] == [
        (("w", 0, 3),), (("w", 3, 6),), (("b", 0, 3),), ()]
    flat = lay.flatten([torch.arange(6.0).view(2, 3), torch.tensor([6.0, 7, 8])], torch.float32)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0]
    assert [v.shape for v in lay.split(flat)] == [(2, 3), (3,)]
    assert str(lay) == "Flat[w(2, 3)@0 b(3,)@6] 9 -> 12 = 4 x 3"


def test_bucket_caps_bytes_and_isolates_large_parameters():
    assert bucket(["a", "b", "c", "d"], [2, 2, 10, 1], bucket_bytes=16) == (("a", "b"), ("c",), ("d",))
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket(["a"], [1], bucket_bytes=0)


def test_default_units_are_the_blocks_plus_the_rest():
    model = _model(0)
    units = default_units(model)
    assert [len(u) for u in units] == [4, 12, 12]
    assert units[0] == ("transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
                        "transformer.ln_f.bias")
    assert all(n.startswith("transformer.h.1.") for n in units[2])
    assert "lm_head.weight" not in {n for u in units for n in u}  # tied: under its first name only


def test_resolve_units_accepts_aliases_and_rejects_overlap():
    model = _model(0)
    units = resolve_units(model, [["lm_head.weight"], ["transformer.h.0.ln_1.weight"]])
    assert units[0] == ("transformer.wte.weight",) and len(units) == 3
    with pytest.raises(ValueError, match="exactly one unit"):
        resolve_units(model, [["lm_head.weight"], ["transformer.wte.weight"]])
    with pytest.raises(ValueError, match="not a parameter"):
        resolve_units(model, [["nope"]])


def test_loss_scaler_backs_off_and_grows():
    s = LossScaler(scale=8.0, growth_interval=2)
    s.update(found_inf=True)
    s.update(found_inf=False)
    s.update(found_inf=False)
    assert (s.scale, s.skipped_steps) == (8.0, 1)
