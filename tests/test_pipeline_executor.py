"""The pipeline executor (runtime.pipeline.executor) trains the same as one process and as torch's pipelining.

Tier (a): action parsing, tags, `split_sequential`, argument errors, and two
virtual stages on one rank (no messages) in the pytest process. Tier (c):
real Gloo process groups (2 and 4 spawned processes, FileStore, 1 thread per
rank). Every spawned world runs a list of `Run`s in one process group; rank 0
saves what it saw and the tests compare it with single-process training of
the same model on the whole batch. The schedules come from
`partitioner.planner.schedule.build_schedule` (tests may import the planner; the
runtime may not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from partitioner.planner.schedule import Action, Op, build_schedule
from runtime.comm.collectives import Collectives
from runtime.pipeline.executor import (
    PipelineError,
    PipelineExecutor,
    message_tag,
    parse_action,
    split_sequential,
)
from examples.training import train_one_process
from ranks import gloo_group, init_gloo, spawn

D, CLASSES, BATCH, M, STEPS = 16, 5, 8, 4, 2
SGD = {"lr": 0.1, "momentum": 0.9}
RTOL, ATOL = 1e-5, 1e-6
BOUNDS = {2: [0, 4, 9], 4: [0, 2, 4, 6, 9], 8: [0, 1, 2, 3, 4, 5, 6, 7, 9]}   # 8 blocks + head, in 2, 4 or 8 stages


class Residual(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [Residual(nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))) for _ in range(8)]
    return nn.Sequential(*blocks, nn.Linear(D, CLASSES))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, D, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _shape(stage: int, microbatch: int):
    return (BATCH // M, D), torch.float32


@functools.cache
def _reference() -> dict:
    torch.set_num_threads(1)
    losses, model, _ = train_one_process(_model, functools.partial(torch.optim.SGD, **SGD), F.cross_entropy,
                                         [_batch(step) for step in range(STEPS)])
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _assert_trains_like_one_process(ex: PipelineExecutor, model: torch.nn.Module) -> None:
    """STEPS steps of `ex` over M microbatches each: the losses and `model`'s final state those of one process."""
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        losses.append(ex.run(list(x.chunk(M)), list(y.chunk(M))))
    want = _reference()
    torch.testing.assert_close(losses, want["losses"], rtol=RTOL, atol=ATOL)
    _assert_state_close(model.state_dict(), want["state"])


def _assert_state_close(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=RTOL, atol=ATOL, msg=functools.partial("{}: {}".format, k))


# ---- tier (a) ------------------------------------------------------------------------------------
def test_parses_actions_objects_and_strings():
    for text in ("2SEND_F0", "3RECV_B12", "0F7", "1B0", "4GRAD_SYNC", "0OPTIM"):
        assert parse_action(Action.parse(text)) == parse_action(text)
        assert str(parse_action(text)) == text
    assert parse_action(Action(op=Op.SEND_B, stage=3, microbatch=1)) == Action(op=Op.SEND_B, stage=3, microbatch=1)
    assert parse_action(types.SimpleNamespace(op="RECV_F", stage=1, microbatch=2)) == \
        Action(op=Op.RECV_F, stage=1, microbatch=2)
    with pytest.raises(ValueError, match="malformed"):
        parse_action(types.SimpleNamespace(op="F", stage=1, microbatch=None))
    for bad in ("2SEND0", "F0", "1GRAD_SYNC3", "2B"):
        with pytest.raises(ValueError, match="cannot parse pipeline action"):
            parse_action(bad)
    with pytest.raises(TypeError, match="neither a string"):
        parse_action(3)


def test_tags_are_unique_per_stage_microbatch_and_kind():
    S, m = 8, 16
    tags = [message_tag(s, i, k, S) for s in range(S) for i in range(m) for k in range(3)]
    assert len(set(tags)) == len(tags) and min(tags) == 0 and max(tags) == len(tags) - 1


def test_split_sequential_shares_modules_and_keeps_names():
    model = _model()
    stages = split_sequential(model, BOUNDS[4])
    assert [len(s) for s in stages] == [2, 2, 2, 3]
    assert stages[3][2] is model[8]
    merged = {k: v for s in stages for k, v in s.state_dict().items()}
    assert merged.keys() == model.state_dict().keys()
    x = torch.randn(3, D)
    torch.testing.assert_close(functools.reduce(lambda h, s: s(h), stages, x), model(x))
    for bad in ([0, 4], [1, 9], [0, 4, 4, 9], [0, 10]):
        with pytest.raises(ValueError, match="strictly increasing"):
            split_sequential(model, bad)


def test_refuses_bad_instruction_lists():
    stages = dict(enumerate(split_sequential(_model(), BOUNDS[2])))
    kw = {"num_stages": 2, "stage_to_rank": lambda s: s, "collectives": Collectives(),
          "loss_fn": F.cross_entropy, "num_microbatches": M}
    with pytest.raises(ValueError, match="this rank holds stages \\[0\\]"):
        PipelineExecutor(actions=["1F0"], stages={0: stages[0]}, **kw)
    with pytest.raises(ValueError, match="stage -1 does not exist"):
        PipelineExecutor(actions=["0SEND_B0"], stages={0: stages[0]}, **kw)
    with pytest.raises(ValueError, match="on this rank"):
        PipelineExecutor(actions=["1RECV_F0"], stages=stages, **kw)
    ex = PipelineExecutor(actions=["0F0"], stages={0: stages[0]}, **kw)
    with pytest.raises(ValueError, match="pass microbatches_in"):
        ex.run(None, None)
    ex = PipelineExecutor(actions=["0B0"], stages={0: stages[0]}, **kw)
    with pytest.raises(PipelineError, match="runs before its forward 0F0"):
        ex.run([torch.zeros(2, D)] * M, None)


def test_receives_are_posted_one_compute_early():
    """A RECV goes out before the compute ahead of it in the list (Gloo moves a message only once both ends are
    posted, so it then travels while that compute runs); a RECV_F only when no shape header must be waited for."""
    rank0 = build_schedule("zb-v", pp=2, num_microbatches=4, interleave=2).ranks[0]
    kw = {"actions": rank0, "stages": {0: nn.Identity(), 3: nn.Identity()}, "num_stages": 4,
          "stage_to_rank": lambda s: 0 if s in (0, 3) else 1, "collectives": Collectives(),
          "loss_fn": F.cross_entropy, "num_microbatches": 4}

    def early(ex):
        return {str(ex.actions[c]): [str(ex.actions[r]) for r in rs] for c, rs in ex._early_recvs.items()}

    assert " ".join(map(str, rank0[:9])) == "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 3RECV_F0 3F0 3I0"
    sized = early(PipelineExecutor(activation_shape=lambda s, i: ((2, D), torch.float32), **kw))
    assert sized["0F2"] == ["3RECV_F0"] and sized["0F3"] == ["0RECV_B0"]
    assert sorted(r for rs in sized.values() for r in rs) == sorted(str(a) for a in rank0 if a.op in (Op.RECV_F, Op.RECV_B))
    headers = early(PipelineExecutor(**kw))   # a header receive blocks: a RECV_F stays at its place
    assert "0F2" not in headers and headers["0F3"] == ["0RECV_B0"]


def test_the_list_places_every_data_parallel_action():
    """The executor runs UNSHARD, GRAD_SYNC, RESHARD and OPTIM where the list puts them, and only the rank's last
    B runs outside no_sync (the one that launches the gradient reductions)."""
    import contextlib

    from partitioner.planner.schedule import add_unshard_reshard

    seen = []

    @contextlib.contextmanager
    def no_sync():
        seen.append("no_sync")
        yield

    def stage(x):
        seen.append("F")
        return model(x)

    model = _model()
    actions = add_unshard_reshard(build_schedule("1f1b", pp=1, num_microbatches=3), zero_stage=3).ranks[0]
    assert " ".join(map(str, actions)) == "0UNSHARD 0F0 0B0 0F1 0B1 0F2 0B2 0GRAD_SYNC 0RESHARD 0OPTIM"
    ex = PipelineExecutor(actions=actions, stages={0: stage}, num_stages=1, stage_to_rank=lambda s: 0,
                          collectives=None, loss_fn=F.cross_entropy, num_microbatches=3, no_sync=no_sync,
                          **{name: functools.partial(lambda n, s: seen.append(f"{s}{n}"), name.upper())
                             for name in ("grad_sync", "optim", "unshard", "reshard")})
    ex.run([torch.randn(2, D) for _ in range(3)], [torch.randint(0, CLASSES, (2,)) for _ in range(3)])
    assert seen == ["0UNSHARD", "F", "no_sync", "F", "no_sync", "F", "0GRAD_SYNC", "0RESHARD", "0OPTIM"]


def test_two_virtual_stages_on_one_rank_train_like_one_process():
    """pp=1, interleave=2: stages hand activations and gradients over in memory, no messages."""
    schedule = build_schedule("interleaved-1f1b", pp=1, num_microbatches=M, interleave=2)
    model = _model()
    stages = dict(enumerate(split_sequential(model, BOUNDS[2])))
    opts = {s: torch.optim.SGD(m.parameters(), **SGD) for s, m in stages.items()}
    ex = PipelineExecutor(actions=schedule.ranks[0], stages=stages, num_stages=2, stage_to_rank=lambda s: 0,
                          collectives=None, loss_fn=F.cross_entropy, num_microbatches=M,
                          optim=lambda s: (opts[s].step(), opts[s].zero_grad()),
                          grad_sync=lambda s: held.append((s, ex.held())))
    held = []
    _assert_trains_like_one_process(ex, model)
    # activations are freed by their backward: after stage 1's last backward only 0F3's remain
    assert held == [(1, [(0, M - 1)]), (0, [])] * STEPS and ex.held() == []


def test_split_backward_on_one_rank_trains_like_one_process():
    """zb-h1 at pp=1: every backward split into I and W, the weight gradients those of the full backward,
    the W the one that launches the gradient reductions (the last W runs outside no_sync)."""
    schedule = build_schedule("zb-h1", pp=1, num_microbatches=M)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), **SGD)
    seen = []

    @contextlib.contextmanager
    def no_sync():
        seen.append("no_sync")
        yield

    ex = PipelineExecutor(actions=schedule.ranks[0], stages={0: model}, num_stages=1, stage_to_rank=lambda s: 0,
                          collectives=None, loss_fn=F.cross_entropy, num_microbatches=M, no_sync=no_sync,
                          optim=lambda s: (opt.step(), opt.zero_grad()))
    _assert_trains_like_one_process(ex, model)
    assert seen == ["no_sync"] * (2 * M - 1) * STEPS   # every I and W but the last W


def test_a_weight_gradient_before_its_input_gradient_is_refused():
    ex = PipelineExecutor(actions=["0F0", "0W0", "0I0", "0GRAD_SYNC", "0OPTIM"], stages={0: _model()},
                          num_stages=1, stage_to_rank=lambda s: 0, collectives=None, loss_fn=F.cross_entropy,
                          num_microbatches=1)
    with pytest.raises(PipelineError, match="0W0.*put the I first"):
        ex.run([torch.randn(2, D)], [torch.randint(0, CLASSES, (2,))])


# ---- tier (c): spawned Gloo worlds ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Run:
    kind: str            # "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "interleaved-zb"
    interleave: int = 1
    engine: str = "ours"  # or "torch": torch.distributed.pipelining on the same split
    shapes: str = "given"  # "given": activation_shape=; "header": shape header messages
    strings: bool = False  # pass the actions as compact strings
    microbatches: int = M


def _run_ours(run: Run, rank: int, pp: int) -> dict:
    S, m = pp * run.interleave, run.microbatches
    schedule = build_schedule(run.kind, pp=pp, num_microbatches=m, interleave=run.interleave)
    parts = split_sequential(_model(), BOUNDS[S])
    stages = {s: parts[s] for s in schedule.stages_of(rank)}
    opts = {s: torch.optim.SGD(m.parameters(), **SGD) for s, m in stages.items()}
    synced = []
    coll = Collectives()
    actions = [str(a) for a in schedule.ranks[rank]] if run.strings else schedule.ranks[rank]
    ex = PipelineExecutor(actions=actions, stages=stages, num_stages=S, stage_to_rank=schedule.rank_of,
                          collectives=coll, loss_fn=F.cross_entropy, num_microbatches=m,
                          grad_sync=synced.append, optim=lambda s: (opts[s].step(), opts[s].zero_grad()),
                          activation_shape=(lambda s, i: ((BATCH // m, D), torch.float32))
                          if run.shapes == "given" else None)
    losses, counts = [], []
    for step in range(STEPS):
        coll.reset()
        x, y = _batch(step)
        losses.append(ex.run(list(x.chunk(m)) if 0 in stages else None,
                             list(y.chunk(m)) if S - 1 in stages else None))
        counts.append(dict(coll.counts))
    want = schedule.counts()[rank]
    headers = want[Op.RECV_F] if run.shapes == "header" else 0
    expected = {"send": want[Op.SEND_F] + want[Op.SEND_B] + want[Op.SEND_F] * (run.shapes == "header"),
                "recv": want[Op.RECV_F] + want[Op.RECV_B] + headers}
    return {"losses": losses, "counts_ok": all({k: c.get(k, 0) for k in expected} == expected for c in counts),
            "counts": counts, "expected": expected, "synced": synced,
            "state": {k: v for m in stages.values() for k, v in m.state_dict().items()}}


def _run_torch(run: Run, rank: int, pp: int) -> dict:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    S, m = pp * run.interleave, run.microbatches
    parts = split_sequential(_model(), BOUNDS[S])
    # zb-v, dualpipe-v: two stages per rank, in a V (rank r holds r and 2 pp - 1 - r); the others: stage % pp
    v_shaped = run.kind in ("zb-v", "dualpipe-v")
    mine = (rank, S - 1 - rank) if v_shaped else tuple(range(rank, S, pp))
    stages = [PipelineStage(parts[s], s, S, device=torch.device("cpu")) for s in mine]
    order = None
    if v_shaped:
        cls = ScheduleZBVZeroBubble if run.kind == "zb-v" else ScheduleDualPipeV
        sched = cls(stages, n_microbatches=m, loss_fn=F.cross_entropy)
    elif run.kind in ("zb-h1", "interleaved-zb"):  # with one stage per rank torch's zero-bubble schedule is ZB-H1
        sched = ScheduleInterleavedZeroBubble(stages, n_microbatches=m, loss_fn=F.cross_entropy)
    else:
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[run.kind]
        sched = cls(stages[0], n_microbatches=m, loss_fn=F.cross_entropy)
    if run.kind in ("zb-v", "zb-h1", "interleaved-zb", "dualpipe-v"):
        # DualPipe-V's OVERLAP_F_B pairs as their sub-actions, forward then backward (the order torch runs them)
        order = [str(b) for a in sched.pipeline_order[rank] if a is not None for b in (a.sub_actions or (a,))]
    opt = torch.optim.SGD([p for s in mine for p in parts[s].parameters()], **SGD)
    first, last = 0 in mine, S - 1 in mine  # the rank feeding the inputs, the rank computing the loss
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        mb_losses = []
        sched.step(*((x,) if first else ()), **(dict(target=y, losses=mb_losses) if last else {}))
        opt.step()
        opt.zero_grad()
        losses.append(sum(l.item() for l in mb_losses) / m if last else None)
    return {"losses": losses, "state": {k: v for s in mine for k, v in parts[s].state_dict().items()},
            "order": order}


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    faulthandler.enable()   # a Gloo abort (SIGABRT) then shows the Python stack
    with gloo_group(rank, world, store_path, timeout_s=60):
        results = {}
        for run in RUNS[world]:
            got = (_run_torch if run.engine == "torch" else _run_ours)(run, rank, world)
            gathered = [None] * world
            dist.all_gather_object(gathered, got)  # test plumbing, outside the counting shim
            results[run] = {
                "losses": next(g["losses"] for g in gathered if g["losses"][0] is not None),
                "state": {k: v for g in gathered for k, v in g["state"].items()},
                "ranks": gathered,
                "orders": [g.get("order") for g in gathered],
            }
        if rank == 0:
            torch.save(results, Path(out_dir) / "rank0.pt")


RUNS = {
    2: [Run("gpipe"), Run("1f1b", strings=True), Run("interleaved-1f1b", interleave=2),
        Run("1f1b", shapes="header"), Run("zb-h1", strings=True), Run("gpipe", engine="torch"),
        Run("1f1b", engine="torch"), Run("zb-h1", engine="torch"), Run("zb-v", interleave=2),
        Run("zb-v", interleave=2, engine="torch"), Run("interleaved-zb", interleave=2),
        Run("interleaved-zb", interleave=2, engine="torch"), Run("dualpipe-v", interleave=2),
        Run("dualpipe-v", interleave=2, engine="torch")],
    4: [Run("gpipe", shapes="header"), Run("1f1b"), Run("zb-h1"), Run("zb-h1", engine="torch"),
        Run("zb-v", interleave=2), Run("zb-v", interleave=2, engine="torch"), Run("interleaved-zb", interleave=2),
        Run("interleaved-zb", interleave=2, engine="torch"), Run("dualpipe-v", interleave=2, microbatches=8),
        Run("dualpipe-v", interleave=2, microbatches=8, engine="torch")],
}
CASES = [(w, r) for w, runs in RUNS.items() for r in runs if r.engine == "ours"]


def _run_id(case) -> str:
    world, r = case
    return f"pp{world}-{r.kind}" + (f"-v{r.interleave}" if r.interleave > 1 else "") + \
        (f"-m{r.microbatches}" if r.microbatches != M else "") + \
        ("-header" if r.shapes == "header" else "") + ("-strings" if r.strings else "")


@pytest.fixture(scope="module")
def worlds(spawned):
    return lambda world: spawned(_worker, world)[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_run_id)
def test_trains_like_one_process(worlds, case):
    world, run = case
    got, want = worlds(world)[run], _reference()
    torch.testing.assert_close(got["losses"], want["losses"], rtol=RTOL, atol=ATOL)
    _assert_state_close(got["state"], want["state"])
    for rank, r in enumerate(got["ranks"]):
        assert r["counts_ok"], f"rank {rank}: sends/receives {r['counts']} != instruction lists {r['expected']}"
        mine = build_schedule(run.kind, pp=world, num_microbatches=run.microbatches,
                              interleave=run.interleave).stages_of(rank)
        assert sorted(r["synced"]) == sorted(list(mine) * STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
def test_trains_like_torch_pipelining(worlds, kind):
    ours, oracle = worlds(2)[Run(kind, strings=kind != "gpipe")], worlds(2)[Run(kind, engine="torch")]
    torch.testing.assert_close(ours["losses"], oracle["losses"], rtol=RTOL, atol=ATOL)
    _assert_state_close(ours["state"], oracle["state"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zb_h1_is_torchs_zero_bubble_order_and_loss(worlds, world):
    """torch's ScheduleInterleavedZeroBubble with one stage per rank: the same compute order per rank as
    our zb-h1 lists, and the same losses and parameters."""
    ours, oracle = worlds(world)[Run("zb-h1", strings=world == 2)], worlds(world)[Run("zb-h1", engine="torch")]
    schedule = build_schedule("zb-h1", pp=world, num_microbatches=M)
    computes = [[str(a) for a in actions if a.op in (Op.F, Op.I, Op.W)] for actions in schedule.ranks]
    assert oracle["orders"] == computes
    torch.testing.assert_close(ours["losses"], oracle["losses"], rtol=RTOL, atol=ATOL)
    _assert_state_close(ours["state"], oracle["state"])


# ---- a deadlocking list fails within the timeout -------------------------------------------------
TIMEOUT_S = 10


def _deadlock_worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    init_gloo(rank, world, store_path, timeout_s=TIMEOUT_S)
    schedule = build_schedule("1f1b", pp=2, num_microbatches=M)
    actions = list(schedule.ranks[rank])
    if rank == 0:   # hand-broken: 0B0 waits for stage 1's gradient before 0SEND_F0 feeds stage 1
        send = actions.pop(actions.index(Action(op=Op.SEND_F, stage=0, microbatch=0)))
        actions.insert(actions.index(Action(op=Op.B, stage=0, microbatch=0)) + 1, send)
        actions.insert(1, actions.pop(actions.index(Action(op=Op.RECV_B, stage=0, microbatch=0))))
        actions.insert(2, actions.pop(actions.index(Action(op=Op.B, stage=0, microbatch=0))))
    parts = split_sequential(_model(), BOUNDS[2])
    ex = PipelineExecutor(actions=actions, stages={rank: parts[rank]}, num_stages=2, stage_to_rank=lambda s: s,
                          collectives=Collectives(), loss_fn=F.cross_entropy, num_microbatches=M,
                          activation_shape=_shape)
    x, y = _batch(0)
    start, message = time.monotonic(), "no error"
    try:
        ex.run(list(x.chunk(M)), list(y.chunk(M)))
    except PipelineError as e:
        message = str(e)
    torch.save((time.monotonic() - start, message), Path(out_dir) / f"rank{rank}.pt")
    # the group is dead after a timeout (TORCH-NOTES): exit without a collective teardown


@pytest.mark.slow
def test_deadlocking_list_fails_with_a_clear_error(tmp_path):
    start = time.monotonic()
    results = spawn(_deadlock_worker, 2, tmp_path)
    assert time.monotonic() - start < 6 * TIMEOUT_S
    for rank, at in ((0, "action 2 (0B0), waiting for action 1 (0RECV_B0), failed waiting on stage 1 (rank 1)"),
                     (1, "action 1 (1F0), waiting for action 0 (1RECV_F0), failed waiting on stage 0 (rank 0)")):
        elapsed, message = results[rank]
        assert at in message and "deadlock" in message, message
        assert TIMEOUT_S - 1 < elapsed < 3 * TIMEOUT_S


def _assert_torchs_order_and_loss(worlds, world: int, kind: str, *, m: int = M, ops=(Op.F, Op.I, Op.W)) -> None:
    """Our `kind` list (two stages per rank) and torch's schedule of that kind run on the same stages: each rank's
    compute actions (`ops`) in the same order, and the same losses and parameters."""
    ours = worlds(world)[Run(kind, interleave=2, microbatches=m)]
    oracle = worlds(world)[Run(kind, interleave=2, microbatches=m, engine="torch")]
    schedule = build_schedule(kind, pp=world, num_microbatches=m, interleave=2)
    computes = [[str(a) for a in actions if a.op in ops] for actions in schedule.ranks]
    assert oracle["orders"] == computes
    torch.testing.assert_close(ours["losses"], oracle["losses"], rtol=RTOL, atol=ATOL)
    _assert_state_close(ours["state"], oracle["state"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zb_v_is_torchs_zbv_order_and_loss(worlds, world):
    """torch's ScheduleZBVZeroBubble: two stages per rank in a V, the same per-rank compute order as our
    zb-v lists, and the same losses and parameters (stage 0 and the loss's stage both on rank 0). At pp 4,
    m = 4 < 2 pp - 1: both build the V for 7 microbatches and drop the actions of the missing ones."""
    _assert_torchs_order_and_loss(worlds, world, "zb-v")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_interleaved_zb_is_torchs_interleaved_zero_bubble_order_and_loss(worlds, world):
    """torch's ScheduleInterleavedZeroBubble with two stages per rank (stage % pp): the same per-rank compute
    order as our interleaved-zb lists, and the same losses and parameters (at pp 4: eight stages, one round of
    m = pp microbatches)."""
    _assert_torchs_order_and_loss(worlds, world, "interleaved-zb")


@pytest.mark.slow
@pytest.mark.parametrize("world,m", [(2, M), (4, 8)])
def test_dualpipe_v_is_torchs_dualpipev_order_and_loss(worlds, world, m):
    """torch's ScheduleDualPipeV on Gloo: the same per-rank compute order as our dualpipe-v lists (its
    OVERLAP_F_B pairs as forward, then backward: how both runtimes run them), and the same losses and
    parameters; m >= 2 pp microbatches, as both require."""
    _assert_torchs_order_and_loss(worlds, world, "dualpipe-v", m=m, ops=(Op.F, Op.B, Op.I, Op.W))
