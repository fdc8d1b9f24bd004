"""Pipeline schedules as data: compact strings, exact orders, validity, in-flight counts."""

from __future__ import annotations

import json

import pytest

from cost_models.actions import STAGE_OPS
from cost_models.memory import SCHEDULES, inflight_microbatches
from partitioner.planner.schedule import (
    SCHEDULE_KINDS,
    Action,
    chunk_peaks,
    Op,
    Schedule,
    add_unshard_reshard,
    build_schedule,
    peak_inflight,
    validate,
)
from partitioner.planner.simulate import Durations, simulate


def _grid():
    """(kind, pp, m, interleave) for every valid combination we check."""
    for pp in range(1, 9):
        for m in range(1, 17):
            yield "gpipe", pp, m, 1
            yield "1f1b", pp, m, 1
            if m % pp == 0:
                for v in (2, 3):
                    yield "interleaved-1f1b", pp, m, v


GRID = list(_grid())


def _compute(schedule: Schedule, rank: int) -> str:
    """A rank's forwards and backwards only, compact."""
    return " ".join(str(a) for a in schedule.ranks[rank] if a.op in (Op.F, Op.B))


def _with_rank_list(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(actions)
    return Schedule(kind=schedule.kind, pp=schedule.pp, num_microbatches=schedule.num_microbatches,
                    interleave=schedule.interleave, ranks=tuple(ranks))


# --- compact strings ----------------------------------------------------------
@pytest.mark.parametrize("op", list(Op))
def test_action_round_trip_every_op(op):
    mb = None if op in STAGE_OPS else 13
    a = Action(op=op, stage=12, microbatch=mb)
    assert str(a) == f"12{op.value}{'' if mb is None else 13}"
    assert Action.parse(str(a)) == a


@pytest.mark.parametrize("text,action", [
    ("2F0", Action(op=Op.F, stage=2, microbatch=0)),
    ("2B0", Action(op=Op.B, stage=2, microbatch=0)),
    ("2SEND_F0", Action(op=Op.SEND_F, stage=2, microbatch=0)),
    ("2RECV_F0", Action(op=Op.RECV_F, stage=2, microbatch=0)),
    ("2SEND_B0", Action(op=Op.SEND_B, stage=2, microbatch=0)),
    ("2RECV_B0", Action(op=Op.RECV_B, stage=2, microbatch=0)),
    ("2GRAD_SYNC", Action(op=Op.GRAD_SYNC, stage=2)),
    ("2OPTIM", Action(op=Op.OPTIM, stage=2)),
    (" 10F11 ", Action(op=Op.F, stage=10, microbatch=11)),
])
def test_action_parse(text, action):
    assert Action.parse(text) == action


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "2SEND_F", "2GRAD_SYNC3", "2OPTIM0",
                                  "-1F0", "2F0 2F1", "2f0"])
def test_action_parse_rejects_with_grammar(text):
    with pytest.raises(ValueError, match="cannot parse pipeline action") as e:
        Action.parse(text)
    assert repr(text) in str(e.value) and "<stage><op>" in str(e.value)


def test_action_rejects_bad_fields():
    with pytest.raises(ValueError, match="microbatch=None"):
        Action(op=Op.OPTIM, stage=0, microbatch=1)
    with pytest.raises(ValueError, match="needs microbatch"):
        Action(op=Op.F, stage=0)
    with pytest.raises(ValueError, match="stage=-1"):
        Action(op=Op.F, stage=-1, microbatch=0)
    with pytest.raises(ValueError, match="not an Op"):
        Action(op="F", stage=0, microbatch=0)


def test_peer():
    assert str(Action.parse("2SEND_F0").peer(4)) == "3RECV_F0"
    assert str(Action.parse("3RECV_F0").peer(4)) == "2SEND_F0"
    assert str(Action.parse("3SEND_B5").peer(4)) == "2RECV_B5"
    assert str(Action.parse("2RECV_B5").peer(4)) == "3SEND_B5"
    assert Action.parse("3SEND_F0").peer(4) is None
    with pytest.raises(ValueError, match="not a send or receive"):
        Action.parse("3F0").peer(4)


@pytest.mark.parametrize("kind,pp,m,v", [("gpipe", 3, 4, 1), ("1f1b", 4, 6, 1),
                                         ("interleaved-1f1b", 2, 4, 3), ("1f1b", 1, 2, 1)])
def test_schedule_prints_and_parses_back(kind, pp, m, v):
    s = build_schedule(kind, pp=pp, num_microbatches=m, interleave=v)
    text = str(s)
    assert text.splitlines()[0] == f"schedule kind={kind} pp={pp} num_microbatches={m} interleave={v}"
    assert text.splitlines()[1].startswith("rank 0: ")
    assert Schedule.parse(text) == s
    assert Schedule.from_json(s.to_json()) == s
    assert json.loads(s.to_json())["ranks"][0][0] == str(s.ranks[0][0])
    table = s.table().splitlines()
    assert table[0].split() == " ".join(f"rank {r}" for r in range(pp)).split()
    assert len(table) == 1 + max(len(actions) for actions in s.ranks)


def test_schedule_parse_errors():
    with pytest.raises(ValueError, match="schedule header"):
        Schedule.parse("rank 0: 0F0")
    with pytest.raises(ValueError, match="'rank 1:'"):
        Schedule.parse("schedule kind=1f1b pp=2 num_microbatches=1 interleave=1\nrank 0: 0F0\nrank 2: 1F0")
    with pytest.raises(ValueError, match="2 rank lists but pp=3"):
        Schedule.parse("schedule kind=1f1b pp=3 num_microbatches=1 interleave=1\nrank 0: 0F0\nrank 1: 1F0")
    with pytest.raises(ValueError, match="not a schedule JSON"):
        Schedule.from_json('{"format": "plan/1"}')


def test_kinds_match_the_memory_model():
    # every kind is a declared choice (the zero-bubble ones planned, generated and run too)
    assert SCHEDULE_KINDS == SCHEDULES
    assert {"zb-h1", "interleaved-zb", "zb-v"} <= set(SCHEDULES)


# --- exact orders ---------------------------------------------------------------
def test_1f1b_pp2_m3_full_lists():
    # Megatron-LM forward_backward_pipelining_without_interleaving: rank 0
    # warms up with pp - 0 - 1 = 1 forward, rank 1 (last) with none.
    s = build_schedule("1f1b", pp=2, num_microbatches=3)
    assert " ".join(map(str, s.ranks[0])) == (
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2 "
        "0GRAD_SYNC 0OPTIM")
    assert " ".join(map(str, s.ranks[1])) == (
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2 "
        "1GRAD_SYNC 1OPTIM")


def test_1f1b_pp4_m8_compute_order():
    s = build_schedule("1f1b", pp=4, num_microbatches=8)
    assert [_compute(s, r) for r in range(4)] == [
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7",
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7",
    ]


def test_1f1b_fewer_microbatches_than_stages():
    s = build_schedule("1f1b", pp=4, num_microbatches=2)
    assert [_compute(s, r) for r in range(4)] == [
        "0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1", "2F0 2F1 2B0 2B1", "3F0 3B0 3F1 3B1"]


def test_gpipe_pp2_m2_full_lists():
    s = build_schedule("gpipe", pp=2, num_microbatches=2)
    assert str(s).splitlines()[1:] == [
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0GRAD_SYNC 0OPTIM",
        "rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1 1GRAD_SYNC 1OPTIM",
    ]


def test_interleaved_pp2_m4_v2_compute_order():
    # Megatron-LM forward_backward_pipelining_with_interleaving: the k-th
    # forward runs chunk (k mod 4) // 2 on microbatch (k // 4) * 2 + k mod 2,
    # backwards the chunks reversed; warm-up (2 - r - 1) * 2 + (2 - 1) * 2.
    s = build_schedule("interleaved-1f1b", pp=2, num_microbatches=4, interleave=2)
    assert _compute(s, 0) == ("0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 "
                              "2B2 2B3 0B2 0B3")
    assert _compute(s, 1) == ("1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 "
                              "1B2 1B3")


def test_interleaved_syncs_and_steps_in_order_of_last_backward():
    s = build_schedule("interleaved-1f1b", pp=2, num_microbatches=2, interleave=2)
    tail = [str(a) for a in s.ranks[0] if a.op in (Op.GRAD_SYNC, Op.OPTIM)]
    assert tail == ["2GRAD_SYNC", "0GRAD_SYNC", "2OPTIM", "0OPTIM"]
    assert s.ranks[0][-2:] == (Action(op=Op.OPTIM, stage=2), Action(op=Op.OPTIM, stage=0))
    # GRAD_SYNC follows the last backward's SEND_B, so the gradient leaves first
    text = " ".join(map(str, s.ranks[0]))
    assert "2B1 2SEND_B1 2GRAD_SYNC" in text and "0B1 0GRAD_SYNC" in text


# --- validity over a grid ---------------------------------------------------------
@pytest.mark.parametrize("kind,pp,m,v", GRID)
def test_grid_is_valid(kind, pp, m, v):
    s = build_schedule(kind, pp=pp, num_microbatches=m, interleave=v)
    validate(s)
    assert s.num_stages == pp * v
    f = [(a.stage, a.microbatch) for actions in s.ranks for a in actions if a.op is Op.F]
    b = [(a.stage, a.microbatch) for actions in s.ranks for a in actions if a.op is Op.B]
    every = sorted((st, mb) for st in range(pp * v) for mb in range(m))
    assert sorted(f) == every and sorted(b) == every          # each exactly once
    for r, actions in enumerate(s.ranks):
        assert {a.stage for a in actions} == set(s.stages_of(r))
        assert [a.op for a in actions[-len(s.stages_of(r)):]] == [Op.OPTIM] * v


@pytest.mark.parametrize("kind,pp,m,v", [g for g in GRID if g[1] <= 4])
def test_counts(kind, pp, m, v):
    s = build_schedule(kind, pp=pp, num_microbatches=m, interleave=v)
    counts = s.counts()
    S = pp * v
    boundaries = S - 1 if pp > 1 else 0          # pp == 1: neighbours share the rank
    assert sum(c[Op.SEND_F] for c in counts) == sum(c[Op.RECV_F] for c in counts) == boundaries * m
    assert sum(c[Op.SEND_B] for c in counts) == sum(c[Op.RECV_B] for c in counts) == boundaries * m
    for r, c in enumerate(counts):
        assert c[Op.F] == c[Op.B] == m * v
        assert c[Op.GRAD_SYNC] == c[Op.OPTIM] == v
        assert set(c) == set(Op)
        stages = s.stages_of(r)
        if pp > 1:
            assert c[Op.SEND_F] == m * sum(st < S - 1 for st in stages)
            assert c[Op.RECV_F] == m * sum(st > 0 for st in stages)


def test_counts_1f1b_pp4():
    c = build_schedule("1f1b", pp=4, num_microbatches=8).counts()
    assert (c[0][Op.RECV_F], c[0][Op.SEND_F], c[0][Op.RECV_B], c[0][Op.SEND_B]) == (0, 8, 8, 0)
    assert (c[3][Op.RECV_F], c[3][Op.SEND_F], c[3][Op.RECV_B], c[3][Op.SEND_B]) == (8, 0, 0, 8)


def test_single_rank_sends_nothing():
    for s in (build_schedule("1f1b", pp=1, num_microbatches=3),
              build_schedule("interleaved-1f1b", pp=1, num_microbatches=3, interleave=3)):
        assert not any(a.op in (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B) for a in s.ranks[0])


# --- in-flight microbatches ---------------------------------------------------------
@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_peak_inflight_gpipe_and_1f1b(pp, m):
    assert peak_inflight(build_schedule("gpipe", pp=pp, num_microbatches=m)) == (m,) * pp
    assert peak_inflight(build_schedule("1f1b", pp=pp, num_microbatches=m)) == tuple(
        min(m, pp - s) for s in range(pp))


def test_peak_inflight_examples():
    assert peak_inflight(build_schedule("1f1b", pp=4, num_microbatches=8)) == (4, 3, 2, 1)
    assert peak_inflight(build_schedule("interleaved-1f1b", pp=4, num_microbatches=8,
                                        interleave=2)) == (8, 8, 7, 5, 4, 4, 3, 1)


def _rank_peak(schedule: Schedule, rank: int) -> int:
    live = peak = 0
    for a in schedule.ranks[rank]:
        live += (a.op is Op.F) - (a.op is Op.B)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("kind,pp,m,v", [g for g in GRID if g[2] % 4 == 0 or g[2] < 4])
def test_rank_peak_matches_memory_model(kind, pp, m, v):
    # cost_models.memory.inflight_microbatches counts, per rank, the
    # chunk-microbatches alive at the peak; it must agree with the lists.
    s = build_schedule(kind, pp=pp, num_microbatches=m, interleave=v)
    for r in range(pp):
        assert _rank_peak(s, r) == inflight_microbatches(kind, pp=pp, stage=r, num_microbatches=m,
                                                         interleave=v)


# --- bad arguments --------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    (dict(kind="zigzag", pp=2, num_microbatches=4), "unknown schedule kind='zigzag'.*gpipe.*zb-h1.*zb-v"),
    (dict(kind="zb-v", pp=2, num_microbatches=4), "zb-v' places exactly 2 stages per rank.*interleave=2"),
    (dict(kind="dualpipe-v", pp=2, num_microbatches=4), "dualpipe-v' places exactly 2 stages per rank.*interleave=2"),
    (dict(kind="dualpipe-v", pp=4, num_microbatches=7, interleave=2),
     "dualpipe-v needs at least as many microbatches as stages \\(2 pp = 8.*got num_microbatches=7"),
    (dict(kind="interleaved-zb", pp=2, num_microbatches=4), "needs interleave >= 2.*'zb-h1'"),
    (dict(kind="interleaved-zb", pp=4, num_microbatches=9, interleave=2),
     "rounds of about pp=4.*multiple of 2; got 9. Use num_microbatches=8"),
    (dict(kind="1f1b", pp=0, num_microbatches=4), "pp=0 must be an int >= 1"),
    (dict(kind="1f1b", pp=2, num_microbatches=0), "num_microbatches=0 must be an int >= 1"),
    (dict(kind="gpipe", pp=2, num_microbatches=2.0), "num_microbatches=2.0"),
    (dict(kind="interleaved-1f1b", pp=2, num_microbatches=4), "needs interleave >= 2.*'1f1b'"),
    (dict(kind="1f1b", pp=2, num_microbatches=4, interleave=2), "interleave must be 1.*interleaved-1f1b"),
    (dict(kind="gpipe", pp=2, num_microbatches=4, interleave=0), "interleave=0"),
    (dict(kind="interleaved-1f1b", pp=4, num_microbatches=10, interleave=2),
     "multiple of 4; got 10. Use num_microbatches=8 or 12"),
    (dict(kind="interleaved-1f1b", pp=4, num_microbatches=3, interleave=2),
     "got 3. Use num_microbatches=4,"),
])
def test_bad_arguments(kwargs, message):
    kind = kwargs.pop("kind")
    with pytest.raises(ValueError, match=message):
        build_schedule(kind, **kwargs)


# --- validate catches broken schedules -------------------------------------------------
def test_validate_catches_deadlock():
    # Move rank 0's 0SEND_F0 after its 0RECV_B0: rank 0 waits for the
    # gradient of microbatch 0, which rank 1 computes only after receiving
    # the activation that rank 0 has not sent yet.
    s = build_schedule("1f1b", pp=2, num_microbatches=3)
    r0 = list(s.ranks[0])
    i, j = r0.index(Action.parse("0SEND_F0")), r0.index(Action.parse("0RECV_B0"))
    r0[i], r0[j] = r0[j], r0[i]
    with pytest.raises(ValueError) as e:
        validate(_with_rank_list(s, 0, r0))
    msg = str(e.value)
    assert "deadlock" in msg and "rank 0 waits at 0RECV_B0 for 1SEND_B0" in msg
    assert "rank 1 waits at 1RECV_F0 for 0SEND_F0" in msg
    assert "0RECV_B0  <-- ERROR HERE" in msg and "1RECV_F0  <-- ERROR HERE" in msg


def test_validate_catches_missing_receive():
    s = build_schedule("1f1b", pp=2, num_microbatches=2)
    r1 = [a for a in s.ranks[1] if str(a) != "1RECV_F1"]
    with pytest.raises(ValueError, match="never receives it: add 1RECV_F1 before 1F1") as e:
        validate(_with_rank_list(s, 1, r1))
    assert "1F1  <-- ERROR HERE" in str(e.value)


def test_validate_catches_receive_after_use():
    s = build_schedule("gpipe", pp=2, num_microbatches=2)
    r1 = list(s.ranks[1])
    r1[0], r1[1] = r1[1], r1[0]                      # 1F0 before 1RECV_F0
    with pytest.raises(ValueError, match="1F0 runs before 1RECV_F0 delivers its input"):
        validate(_with_rank_list(s, 1, r1))


@pytest.mark.parametrize("edit,message", [
    (lambda r: r[:3] + r[4:], "no 0B0"),                                        # drop 0B0
    (lambda r: r[:2] + r[3:], "never receives it: add 0RECV_B0 before 0B0"),
    (lambda r: r + [Action.parse("0F0")], "0F0 appears twice"),
    (lambda r: [Action.parse("0B0")] + [a for a in r if str(a) != "0B0"], "0B0 comes before its forward"),
    (lambda r: [Action.parse("1F0")] + r, "1F0 runs on rank 0, but stage 1 lives on rank 1"),
    (lambda r: r + [Action.parse("0F5")], "microbatch 5"),
    (lambda r: [a for a in r if a.op is not Op.GRAD_SYNC], "no 0GRAD_SYNC"),
    (lambda r: r[-1:] + r[:-1], "0OPTIM comes before 0GRAD_SYNC"),
    (lambda r: r + [Action.parse("0RECV_F0")], "no peer on another rank"),
])
def test_validate_messages(edit, message):
    s = build_schedule("gpipe", pp=2, num_microbatches=1)   # rank 0: 0F0 0SEND_F0 0RECV_B0 0B0 ...
    with pytest.raises(ValueError, match=message) as e:
        validate(_with_rank_list(s, 0, edit(list(s.ranks[0]))))
    assert "<-- ERROR HERE" in str(e.value)


def test_error_listing_is_windowed_for_long_lists():
    s = build_schedule("1f1b", pp=2, num_microbatches=64)
    r0 = list(s.ranks[0])
    del r0[r0.index(Action.parse("0SEND_F40"))]
    with pytest.raises(ValueError) as e:
        validate(_with_rank_list(s, 0, r0))
    msg = str(e.value)
    assert "add 0SEND_F40 after 0F40" in msg and "earlier actions" in msg and "later actions" in msg
    assert len(msg.splitlines()) < 40


# --- the data-parallel collectives as actions (code generation's last lowering) ---------------------------
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind,pp,m,v", [("gpipe", 2, 3, 1), ("1f1b", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2),
                                         ("1f1b", 1, 3, 1)])
def test_unshard_reshard_lowering_is_valid_round_trips_and_costs_nothing(zero_stage, kind, pp, m, v):
    base = build_schedule(kind, pp=pp, num_microbatches=m, interleave=v)
    s = add_unshard_reshard(base, zero_stage=zero_stage)
    validate(s)
    assert Schedule.parse(str(s)) == s and Schedule.from_json(s.to_json()) == s
    for r, actions in enumerate(s.ranks):
        ops = [a.op for a in actions]
        assert [a for a in actions if a.op not in (Op.UNSHARD, Op.RESHARD)] == list(base.ranks[r])
        if zero_stage in (1, 2):   # the updated shards gathered after the rank's last optimizer step
            assert ops.count(Op.UNSHARD) == 1 and ops[-2:] == [Op.OPTIM, Op.UNSHARD] and Op.RESHARD not in ops
        elif zero_stage == 3:      # the first unit prefetched before anything; freed after the last reduction
            assert ops[0] is Op.UNSHARD and ops.count(Op.RESHARD) == 1
            assert ops[ops.index(Op.RESHARD) - 1] is Op.GRAD_SYNC and Op.GRAD_SYNC not in ops[ops.index(Op.RESHARD):]
        else:
            assert actions == base.ranks[r]
    d = Durations.uniform(base.num_stages, forward=1.0, backward=2.5, p2p=0.25, grad_sync=1.5, optim=0.5,
                          overlap=0.5)
    assert simulate(s, d).step_time_s == simulate(base, d).step_time_s


def test_unshard_reshard_example_and_refusals():
    s = add_unshard_reshard(build_schedule("1f1b", pp=1, num_microbatches=2), zero_stage=3)
    assert str(s).splitlines()[1] == "rank 0: 0UNSHARD 0F0 0B0 0F1 0B1 0GRAD_SYNC 0RESHARD 0OPTIM"
    with pytest.raises(ValueError, match="lower it once"):
        add_unshard_reshard(s, zero_stage=3)
    with pytest.raises(ValueError, match="zero_stage=4"):
        add_unshard_reshard(build_schedule("gpipe", pp=1, num_microbatches=1), zero_stage=4)


@pytest.mark.parametrize("edit,message", [
    (lambda r: r[:1] + [Action.parse("0UNSHARD")] + r[1:], "0UNSHARD falls inside stage 0's step"),
    (lambda r: [Action.parse("0RESHARD")] + r, "0RESHARD comes before stage 0's last backward"),
    (lambda r: r + [Action.parse("0UNSHARD"), Action.parse("0UNSHARD")], "0UNSHARD appears twice"),
])
def test_validate_places_unshard_and_reshard(edit, message):
    s = build_schedule("gpipe", pp=2, num_microbatches=1)
    with pytest.raises(ValueError, match=message) as e:
        validate(_with_rank_list(s, 0, edit(list(s.ranks[0]))))
    assert "<-- ERROR HERE" in str(e.value)


# --- zero bubble: ZB-H1 -------------------------------------------------------------------------------
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_zb_h1_is_valid_round_trips_and_holds_what_1f1b_holds_at_its_peak(pp, m):
    s = build_schedule("zb-h1", pp=pp, num_microbatches=m)
    validate(s)
    assert Schedule.parse(str(s)) == s and Schedule.from_json(s.to_json()) == s
    every = sorted((st, mb) for st in range(pp) for mb in range(m))
    for op in (Op.F, Op.I, Op.W):
        assert sorted((a.stage, a.microbatch) for r in s.ranks for a in r if a.op is op) == every
    assert not any(a.op is Op.B for r in s.ranks for a in r)
    # activations live until W: every rank holds min(m, pp), the most any 1F1B rank holds (rank 0)
    assert peak_inflight(s) == (min(m, pp),) * pp
    assert max(peak_inflight(s)) == max(peak_inflight(build_schedule("1f1b", pp=pp, num_microbatches=m)))
    for r, actions in enumerate(s.ranks):   # the gradient reduction waits for the last W, not the last I
        ops = [a.op for a in actions]
        assert ops[-3:] == [Op.W, Op.GRAD_SYNC, Op.OPTIM]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 16])
def test_zb_h1_computes_in_torchs_zero_bubble_order(pp, m):
    """torch's ScheduleInterleavedZeroBubble with one stage per rank builds its lists with this function."""
    from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops
    s = build_schedule("zb-h1", pp=pp, num_microbatches=m)
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        theirs = _get_1f1b_rank_ops(1, pp, warmup, m - warmup, warmup, r, lambda step, r=r: r,
                                    lambda step, r=r: r, num_1f1b_microbatches=r, enable_zero_bubble=True)
        ours = [str(a) for a in s.ranks[r] if a.op in (Op.F, Op.I, Op.W)]
        assert ours == [str(a) for a in theirs if a is not None]


def test_zb_h1_example():
    s = build_schedule("zb-h1", pp=2, num_microbatches=3)
    assert str(s) == (
        "schedule kind=zb-h1 pp=2 num_microbatches=3 interleave=1\n"
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0 0W0 0F2 0SEND_F2 0RECV_B1 0I1 0W1 0RECV_B2 0I2 0W2 "
        "0GRAD_SYNC 0OPTIM\n"
        "rank 1: 1RECV_F0 1F0 1I0 1SEND_B0 1RECV_F1 1F1 1I1 1SEND_B1 1W0 1RECV_F2 1F2 1I2 1SEND_B2 1W1 1W2 "
        "1GRAD_SYNC 1OPTIM")
    with pytest.raises(ValueError, match="interleave must be 1"):
        build_schedule("zb-h1", pp=2, num_microbatches=4, interleave=2)


@pytest.mark.parametrize("edit,message", [
    (lambda r: [a for a in r if str(a) != "1W0"], "1I0 has no 1W0"),
    (lambda r: [a for a in r if str(a) != "1I0"], "1W0 has no 1I0"),
    (lambda r: [Action.parse("1W0") if str(a) == "1I0" else Action.parse("1I0") if str(a) == "1W0" else a
                for a in r], "1W0 comes before 1I0"),
    (lambda r: r[:-2] + [Action.parse("1B0")] + r[-2:], "1B0 is the whole backward of microbatch 0"),
    (lambda r: r[:-3] + [r[-2], r[-3], r[-1]], "1GRAD_SYNC comes before stage 1's last backward 1W1"),
])
def test_validate_checks_split_backwards(edit, message):
    s = build_schedule("zb-h1", pp=2, num_microbatches=2)
    r1 = [a for a in s.ranks[1]]
    with pytest.raises(ValueError, match=message) as e:
        validate(_with_rank_list(s, 1, edit(r1)))
    assert "<-- ERROR HERE" in str(e.value)


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_zb_h1_lowers_the_data_parallel_actions(zero_stage):
    s = add_unshard_reshard(build_schedule("zb-h1", pp=4, num_microbatches=8), zero_stage=zero_stage)
    validate(s)
    assert Schedule.parse(str(s)) == s


# --- zero bubble: ZB-V ---------------------------------------------------------------------------------
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_zb_v_is_valid_round_trips_and_is_torchs_order(pp, m):
    """Two stages per rank in a V (rank r: r and 2 pp - 1 - r); the compute order of torch's
    ScheduleZBVZeroBubble._calculate_single_rank_operations, which needs no process group."""
    import types

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    s = build_schedule("zb-v", pp=pp, num_microbatches=m, interleave=2)
    validate(s)
    assert Schedule.parse(str(s)) == s and Schedule.from_json(s.to_json()) == s
    for r in range(pp):
        assert s.stages_of(r) == tuple(sorted((r, 2 * pp - 1 - r)))
        assert {a.stage for a in s.ranks[r]} == set(s.stages_of(r))
        theirs = ScheduleZBVZeroBubble._calculate_single_rank_operations(
            types.SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp), r)
        assert [str(a) for a in s.ranks[r] if a.op in (Op.F, Op.I, Op.W)] == [str(a) for a in theirs if a is not None]
    # the turn of the V (stages pp - 1 and pp) and both ends (0 and the loss's 2 pp - 1) stay on one rank
    actions = {str(a) for r in s.ranks for a in r}
    assert not any(f"{pp - 1}SEND_F{i}" in actions or f"{pp}SEND_B{i}" in actions for i in range(m))
    assert s.rank_of(0) == s.rank_of(2 * pp - 1) == 0


# --- DualPipe-V ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("extra", [0, 1, 3, 9])
def test_dualpipe_v_is_valid_round_trips_and_is_torchs_order(pp, extra):
    """m = 2 pp + extra microbatches, zb-v's V; the compute order of torch's
    ScheduleDualPipeV._calculate_single_rank_operations with each OVERLAP_F_B pair as its forward, then its
    backward (the order torch's runtime runs them in without a registered overlap function)."""
    import types

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV
    m = 2 * pp + extra
    s = build_schedule("dualpipe-v", pp=pp, num_microbatches=m, interleave=2)
    validate(s)
    assert Schedule.parse(str(s)) == s and Schedule.from_json(s.to_json()) == s
    for r in range(pp):
        assert s.stages_of(r) == tuple(sorted((r, 2 * pp - 1 - r)))
        theirs = ScheduleDualPipeV._calculate_single_rank_operations(
            types.SimpleNamespace(pp_group_size=pp, _n_microbatches=m), r)
        flat = [str(b) for a in theirs if a is not None for b in (a.sub_actions or (a,))]
        assert [str(a) for a in s.ranks[r] if a.op in (Op.F, Op.B, Op.I, Op.W)] == flat
        pairs = sum(1 for a in theirs if a is not None and a.sub_actions)
        assert pairs == 2 * (m - 2 * pp + r + 1) + (pp - r - 1) - (r == pp - 1)  # steps 4 and 5 of torch's
    ops = {a.op for r in s.ranks for a in r}
    assert {Op.B, Op.I, Op.W} <= ops if pp > 1 else Op.B in ops


def test_dualpipe_v_example():
    s = build_schedule("dualpipe-v", pp=2, num_microbatches=4, interleave=2)
    assert [_compute_all(s, r) for r in range(2)] == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3"]
    assert peak_inflight(s) == (4, 3, 2, 1)  # 1F1B's counts over the four stages


def _compute_all(schedule: Schedule, rank: int) -> str:
    return " ".join(str(a) for a in schedule.ranks[rank] if a.op in (Op.F, Op.B, Op.I, Op.W))


def test_zb_v_placement_is_checked():
    s = build_schedule("zb-v", pp=2, num_microbatches=2, interleave=2)
    with pytest.raises(ValueError, match="2F0 runs on rank 0, but stage 2 lives on rank 1 \\(its V\\)"):
        validate(_with_rank_list(s, 0, [Action.parse("2F0")] + list(s.ranks[0])))


# --- zero bubble: interleaved ------------------------------------------------------------------------
def _interleaved_zb_cases():
    for pp in (1, 2, 3, 4):
        for v in (2, 3):
            for m in (1, 2, 3, 4, 6, 8, 12):
                if m % max(1, m // pp) == 0:
                    yield pp, m, v


@pytest.mark.parametrize("pp,m,v", list(_interleaved_zb_cases()))
def test_interleaved_zb_is_valid_round_trips_and_is_torchs_order(pp, m, v):
    """v stages per rank at stage % pp, every backward split into I and W; the compute order of torch's
    ScheduleInterleavedZeroBubble._calculate_single_rank_operations, which needs no process group."""
    import types

    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble
    s = build_schedule("interleaved-zb", pp=pp, num_microbatches=m, interleave=v)
    validate(s)
    assert Schedule.parse(str(s)) == s and Schedule.from_json(s.to_json()) == s
    rounds = max(1, m // pp)
    for r in range(pp):
        assert s.stages_of(r) == tuple(range(r, pp * v, pp))
        ns = types.SimpleNamespace(n_local_stages=v, pp_group_size=pp, _n_microbatches=m,
                                   microbatches_per_round=m // rounds)
        theirs = ScheduleInterleavedZeroBubble._calculate_single_rank_operations(ns, r)
        assert [str(a) for a in s.ranks[r] if a.op in (Op.F, Op.I, Op.W)] == [str(a) for a in theirs if a is not None]
    counts = s.counts()
    assert all(c[Op.F] == c[Op.I] == c[Op.W] == m * v and c[Op.B] == 0 for c in counts)


def test_interleaved_zb_example():
    s = build_schedule("interleaved-zb", pp=2, num_microbatches=2, interleave=2)
    assert str(s) == (
        "schedule kind=interleaved-zb pp=2 num_microbatches=2 interleave=2\n"
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 2RECV_B0 2I0 2SEND_B0 "
        "2W0 2RECV_B1 2I1 2SEND_B1 2W1 2GRAD_SYNC 0RECV_B0 0I0 0W0 0RECV_B1 0I1 0W1 0GRAD_SYNC 2OPTIM 0OPTIM\n"
        "rank 1: 1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3I0 3SEND_B0 3RECV_F1 3F1 3I1 3SEND_B1 "
        "3W0 1RECV_B0 1I0 1SEND_B0 3W1 3GRAD_SYNC 1RECV_B1 1I1 1SEND_B1 1W0 1W1 1GRAD_SYNC 3OPTIM 1OPTIM")


@pytest.mark.parametrize("kind,pp,m", [("interleaved-zb", pp, m) for pp in (2, 3, 4) for m in (pp, 2 * pp, 3 * pp)]
                         + [("zb-v", pp, m) for pp in (2, 3, 4) for m in (1, pp, 2 * pp, 3 * pp)]
                         + [("dualpipe-v", pp, m) for pp in (2, 3, 4) for m in (2 * pp, 2 * pp + 1, 3 * pp)])
def test_chunk_peaks_are_the_lists_peaks(kind, pp, m):
    """What the cost model charges per stage (activations held until W; W's kept gradients between I and W)
    is what the lists hold at their peak."""
    s = build_schedule(kind, pp=pp, num_microbatches=m, interleave=2)
    live_peak = peak_inflight(s)
    for r in range(pp):
        live, held = chunk_peaks(kind, pp=pp, num_microbatches=m, interleave=2, rank=r)
        assert live == tuple(live_peak[st] for st in s.stages_of(r))
        for k, st in enumerate(s.stages_of(r)):
            between, most = 0, 0
            for a in s.ranks[r]:
                if a.stage == st and a.op in (Op.I, Op.W):
                    between += 1 if a.op is Op.I else -1
                    most = max(most, between)
            assert held[k] == most


@pytest.mark.parametrize("kind,v", [("zb-v", 2), ("interleaved-zb", 2), ("interleaved-zb", 3)])
@pytest.mark.parametrize("pp", [1, 2, 3, 5, 8])
def test_chunk_peaks_of_long_lists_are_the_full_lists_peaks(kind, v, pp):
    """chunk_peaks reads zb-v's first 4 pp and interleaved-zb's first 3 pp microbatches only: the lists repeat
    once the pipeline is full, so the peaks of the whole lists are the same."""
    for m in range(1, 9 * pp + 1):
        if kind == "interleaved-zb" and m % max(1, m // pp):
            continue
        s = build_schedule(kind, pp=pp, num_microbatches=m, interleave=v)
        live_peak = peak_inflight(s)
        for r in range(pp):
            live, held = chunk_peaks(kind, pp=pp, num_microbatches=m, interleave=v, rank=r)
            assert live == tuple(live_peak[st] for st in s.stages_of(r)), (m, r)
            for k, st in enumerate(s.stages_of(r)):
                between = most = 0
                for a in s.ranks[r]:
                    if a.stage == st and a.op in (Op.I, Op.W):
                        between += 1 if a.op is Op.I else -1
                        most = max(most, between)
                assert held[k] == most, (m, r, st)
