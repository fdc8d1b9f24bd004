"""The pipeline event simulator against hand-computed step times."""

from __future__ import annotations

import itertools

import pytest

from partitioner.planner.schedule import Action, Op, Schedule, build_schedule, peak_inflight
from partitioner.planner.simulate import Durations, simulate


def _uniform(s: Schedule, **kw) -> Durations:
    return Durations.uniform(s.num_stages, **kw)


def _ends(result, rank: int) -> dict[str, tuple[float, float]]:
    return {e.action: (e.start, e.end) for e in result.events if e.rank == rank}


# --- makespans with p2p = 0 -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", range(1, 7))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12])
def test_gpipe_and_1f1b_makespan(kind, pp, m):
    # f = 1, b = 2 on every stage: (m + pp - 1)(f + b), bubble (pp - 1)/(m + pp - 1)
    s = build_schedule(kind, pp=pp, num_microbatches=m)
    r = simulate(s, _uniform(s, forward=1.0, backward=2.0))
    assert r.step_time_s == (m + pp - 1) * 3.0
    assert r.per_rank_busy_s == (3.0 * m,) * pp
    assert r.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaving_divides_the_bubble_by_v(pp, v, groups):
    # Narayanan et al. 2021, section 2.2: bubble time (pp - 1)(f + b) / v for
    # a rank's whole forward f and backward b, so the bubble fraction is
    # (pp - 1) / (m v) of the ideal time. Each of the v chunks costs 1/v:
    # chunk f = 1, b = 2, so a rank's f = v, b = 2v.
    m = pp * groups
    ideal = m * 3.0 * v
    one = build_schedule("1f1b", pp=pp, num_microbatches=m)
    inter = build_schedule("interleaved-1f1b", pp=pp, num_microbatches=m, interleave=v)
    t_one = simulate(one, _uniform(one, forward=1.0 * v, backward=2.0 * v)).step_time_s
    t_inter = simulate(inter, _uniform(inter, forward=1.0, backward=2.0)).step_time_s
    assert t_one - ideal == (pp - 1) * 3.0 * v
    assert t_inter - ideal == (pp - 1) * 3.0
    assert (t_inter - ideal) / ideal == pytest.approx((pp - 1) / (m * v))


# --- point-to-point delays ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_p2p_pp2_m1(kind):
    f, b, p = 1.0, 2.0, 0.5
    s = build_schedule(kind, pp=2, num_microbatches=1)
    r = simulate(s, _uniform(s, forward=f, backward=b, p2p=p))
    assert r.step_time_s == f + p + f + b + p + b
    rank1 = _ends(r, 1)
    assert rank1["1RECV_F0"] == (0.0, f + p)               # waits for the activation
    assert rank1["1F0"] == (f + p, 2 * f + p)
    assert _ends(r, 0)["0SEND_F0"] == (f, f + p)           # the transfer, on the sender
    assert _ends(r, 0)["0RECV_B0"] == (f, 2 * f + b + 2 * p)


def test_p2p_per_boundary():
    s = build_schedule("1f1b", pp=3, num_microbatches=1)
    d = Durations(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), p2p=(0.25, 0.5),
                  grad_sync=(0.0,) * 3, optim=(0.0,) * 3)
    assert simulate(s, d).step_time_s == 3 * 1.0 + 3 * 2.0 + 2 * (0.25 + 0.5)


def test_p2p_hidden_in_steady_state_gpipe():
    # GPipe pp=2, m=4, p2p=0.5: rank 1's forwards start at f + p and then run
    # back to back (each activation arrives while the previous forward runs);
    # the first gradient goes back p after rank 1's first backward.
    s = build_schedule("gpipe", pp=2, num_microbatches=4)
    r = simulate(s, _uniform(s, forward=1.0, backward=2.0, p2p=0.5))
    rank1 = _ends(r, 1)
    assert [rank1[f"1F{i}"][0] for i in range(4)] == [1.5, 2.5, 3.5, 4.5]
    assert rank1["1B3"][1] == 13.5
    assert r.step_time_s == 13.5 + 0.5 + 2.0


# --- gradient sync and optimizer --------------------------------------------------------------
@pytest.mark.parametrize("g,overlap,exposed", [
    (1.0, 1.0, 0.0),     # short and overlapped with the last backward: hidden
    (1.0, 0.0, 1.0),     # no overlap and nothing left to compute: all exposed
    (1.5, 0.5, 0.5),     # max(0, g - overlap * b)
    (5.0, 1.0, 3.0),     # long: g - b shows
])
def test_grad_sync_on_the_last_stage_of_a_rank(g, overlap, exposed):
    s = build_schedule("1f1b", pp=2, num_microbatches=4)
    base = (4 + 2 - 1) * 3.0
    r = simulate(s, _uniform(s, forward=1.0, backward=2.0, grad_sync=g, overlap=overlap))
    assert r.step_time_s == base + exposed
    sync = _ends(r, 0)["0GRAD_SYNC"]
    assert sync == (base - overlap * 2.0, base - overlap * 2.0 + g)


def test_grad_sync_hides_behind_later_backwards_when_interleaved():
    # Rank 0 holds stages 0 and 2; stage 2's last backward comes before
    # 0B0 and 0B1 (4 s of compute), so its sync hides unless it is longer.
    s = build_schedule("interleaved-1f1b", pp=2, num_microbatches=2, interleave=2)
    plain = simulate(s, _uniform(s, forward=1.0, backward=2.0)).step_time_s

    def step(g2: float) -> float:
        d = Durations(forward=(1.0,) * 4, backward=(2.0,) * 4, p2p=(0.0,) * 3,
                      grad_sync=(0.0, 0.0, g2, 0.0), optim=(0.0,) * 4)
        return simulate(s, d).step_time_s

    assert step(3.0) == plain
    r = simulate(s, _uniform(s, forward=1.0, backward=2.0))
    after = r.step_time_s - _ends(r, 0)["2GRAD_SYNC"][0]        # compute left on rank 0
    assert step(after + 1.5) == plain + 1.5


def test_grad_syncs_share_one_comm_stream():
    s = build_schedule("interleaved-1f1b", pp=2, num_microbatches=2, interleave=2)
    r = simulate(s, _uniform(s, forward=1.0, backward=2.0, grad_sync=10.0))
    sync2, sync0 = _ends(r, 0)["2GRAD_SYNC"], _ends(r, 0)["0GRAD_SYNC"]
    assert sync0[0] == sync2[1]                       # the second waits for the first
    assert r.step_time_s == sync0[1]
    assert _ends(r, 0)["2OPTIM"][0] == sync2[1]


def test_optim_adds_to_the_end_and_counts_as_busy():
    s = build_schedule("1f1b", pp=2, num_microbatches=2)
    r = simulate(s, _uniform(s, forward=1.0, backward=2.0, grad_sync=0.5, optim=0.25))
    assert r.step_time_s == 9.0 + 0.5 + 0.25
    assert r.per_rank_busy_s == (6.25, 6.25)
    assert r.bubble_fraction == pytest.approx(1 - 12.5 / (2 * 9.75))


# --- events -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_events_are_complete(kind, v):
    s = build_schedule(kind, pp=4, num_microbatches=8, interleave=v)
    r = simulate(s, _uniform(s, forward=1.0, backward=2.0, p2p=0.1, grad_sync=0.5, optim=0.2))
    kinds = {Op.F: "compute", Op.B: "compute", Op.SEND_F: "p2p", Op.RECV_F: "p2p",
             Op.SEND_B: "p2p", Op.RECV_B: "p2p", Op.GRAD_SYNC: "collective", Op.OPTIM: "optim"}
    expected = [(rank, str(a), kinds[a.op]) for rank, actions in enumerate(s.ranks) for a in actions]
    assert [(e.rank, e.action, e.kind) for e in r.events] == expected
    assert all(e.end >= e.start >= 0 for e in r.events)
    assert max(e.end for e in r.events) == r.step_time_s
    for rank in range(4):        # the compute stream runs one thing at a time
        busy = sorted((e.start, e.end) for e in r.events
                      if e.rank == rank and e.kind in ("compute", "optim"))
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(busy))
        assert sum(e - s for s, e in busy) == pytest.approx(r.per_rank_busy_s[rank])
    # data dependencies hold in time
    t = {(e.action): e for e in r.events}
    for st in range(s.num_stages - 1):
        for mb in range(8):
            assert t[f"{st + 1}F{mb}"].start >= t[f"{st}F{mb}"].end + 0.1 - 1e-12
            assert t[f"{st}B{mb}"].start >= t[f"{st + 1}B{mb}"].end + 0.1 - 1e-12


# --- errors -------------------------------------------------------------------------------
def test_deadlock_names_rank_and_action():
    s = build_schedule("1f1b", pp=2, num_microbatches=3)
    r0 = list(s.ranks[0])
    i, j = r0.index(Action.parse("0SEND_F0")), r0.index(Action.parse("0RECV_B0"))
    r0[i], r0[j] = r0[j], r0[i]
    broken = Schedule(kind="1f1b", pp=2, num_microbatches=3, interleave=1,
                      ranks=(tuple(r0), s.ranks[1]))
    with pytest.raises(ValueError, match="deadlock: rank 0 waits at 0RECV_B0 for 1SEND_B0") as e:
        simulate(broken, _uniform(s, forward=1.0, backward=2.0))
    assert "<-- ERROR HERE" in str(e.value)


def test_receive_without_send():
    s = build_schedule("gpipe", pp=2, num_microbatches=1)
    broken = Schedule(kind="gpipe", pp=2, num_microbatches=1, interleave=1,
                      ranks=(tuple(a for a in s.ranks[0] if str(a) != "0SEND_F0"), s.ranks[1]))
    with pytest.raises(ValueError, match="never sends it: add 0SEND_F0 after 0F0"):
        simulate(broken, _uniform(s, forward=1.0, backward=2.0))


@pytest.mark.parametrize("kwargs,message", [
    (dict(p2p=(0.0, 0.0)), r"Durations.p2p has 2 entries.*4 virtual stages.*3 in all"),
    (dict(forward=(1.0,) * 3), r"Durations.forward has 3 entries.*4 in all"),
    (dict(grad_sync=(0.0, 0.0, -1.0, 0.0)), r"Durations.grad_sync must hold finite seconds >= 0"),
    (dict(overlap=1.5), r"overlap=1.5 must lie in \[0, 1\]"),
    (dict(optim=[0.0] * 4), r"Durations.optim must be a tuple"),
])
def test_bad_durations(kwargs, message):
    s = build_schedule("interleaved-1f1b", pp=2, num_microbatches=2, interleave=2)
    fields = dict(forward=(1.0,) * 4, backward=(2.0,) * 4, p2p=(0.0,) * 3,
                  grad_sync=(0.0,) * 4, optim=(0.0,) * 4) | kwargs
    with pytest.raises(ValueError, match=message):
        simulate(s, Durations(**fields))


# --- a large case (not timed) ---------------------------------------------------------------
def test_large_interleaved_case_runs():
    pp, m, v = 16, 512, 2
    s = build_schedule("interleaved-1f1b", pp=pp, num_microbatches=m, interleave=v)
    r = simulate(s, _uniform(s, forward=1.0, backward=2.0))
    assert r.step_time_s == m * v * 3.0 + (pp - 1) * 3.0
    assert len(r.events) == sum(len(actions) for actions in s.ranks)


# --- zero bubble: ZB-H1 -------------------------------------------------------------------------------
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (2, 16), (4, 4), (4, 8), (4, 16), (8, 8), (8, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1bs_at_equal_peak_memory(pp, m):
    """Qi et al. 2023, section 3.1: with T_F = T_I = T_W (backward twice the forward, W half of it), 1F1B idles
    (pp - 1)(F + B) = 3 (pp - 1) F per rank and ZB-H1 (pp - 1)(F + I - W) = (pp - 1) F: a third (m >= pp:
    with fewer microbatches fewer W's are left to fill the drain)."""
    d = Durations.uniform(pp, forward=1.0, backward=2.0)   # weight_grad unset: half of the backward
    one, zb = (build_schedule(k, pp=pp, num_microbatches=m) for k in ("1f1b", "zb-h1"))
    t1, tz = simulate(one, d).step_time_s, simulate(zb, d).step_time_s
    assert (t1 - 3 * m, tz - 3 * m) == (3 * (pp - 1), pp - 1)
    assert simulate(zb, d).bubble_fraction < simulate(one, d).bubble_fraction
    assert max(peak_inflight(zb)) == max(peak_inflight(one))


def test_zb_h1_with_no_weight_gradient_time_is_1f1b():
    for pp, m in ((2, 4), (4, 8)):
        d = Durations.uniform(pp, forward=1.0, backward=2.0, p2p=0.1, weight_grad=0.0)
        assert simulate(build_schedule("zb-h1", pp=pp, num_microbatches=m), d).step_time_s == pytest.approx(
            simulate(build_schedule("1f1b", pp=pp, num_microbatches=m), d).step_time_s)


def test_split_backward_events_and_grad_sync_after_the_last_w():
    s = build_schedule("zb-h1", pp=2, num_microbatches=2)
    d = Durations.uniform(2, forward=1.0, backward=3.0, weight_grad=1.0, grad_sync=0.5, overlap=1.0)
    ev = {(e.rank, e.action): e for e in simulate(s, d).events}
    assert ev[(1, "1I0")].duration == 2.0 and ev[(1, "1W0")].duration == 1.0
    # the reduction overlaps the last W (overlap * W), not the backward that preceded it
    assert ev[(1, "1GRAD_SYNC")].start == ev[(1, "1W1")].end - 1.0


@pytest.mark.parametrize("kwargs,message", [
    (dict(weight_grad=(1.0,)), "weight_grad has 1 entries but backward 2"),
    (dict(weight_grad=(1.0, 3.0)), r"weight_grad\[1\]=3.0 exceeds backward\[1\]=2.0"),
])
def test_bad_weight_grad(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Durations(forward=(1.0, 1.0), backward=(2.0, 2.0), p2p=(0.0,), grad_sync=(0.0, 0.0), optim=(0.0, 0.0),
                  **kwargs)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("w", [0.5, 1.0])
def test_the_cut_searchs_closed_form_is_the_simulated_zb_h1_step(pp, m, w):
    """stage_costs.sum_weight: T = (m - 1) c + sum_weight * pp * c on uniform stages, as simulated."""
    from partitioner.planner.stage_costs import sum_weight
    f, b = 1.0, 2.0
    c = f + b
    d = Durations.uniform(pp, forward=f, backward=b, weight_grad=w)
    simulated = simulate(build_schedule("zb-h1", pp=pp, num_microbatches=m), d).step_time_s
    assert (m - 1) * c + sum_weight("zb-h1", pp, 1, m, w / c) * pp * c == pytest.approx(simulated)


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_zb_v_halves_zb_h1s_bubble_at_about_its_memory(pp, m):
    """ZB-V (Qi et al. 2023, section 6) on the same model: half a stage per virtual stage, T_F = T_I = T_W.
    Its bubble is about half ZB-H1's and a fifth of 1F1B's; each rank holds 2 pp + 1 half-stage
    microbatches at its peak, pp + 1/2 stages' worth against 1F1B's pp."""
    one_stage = Durations.uniform(pp, forward=1.0, backward=2.0, weight_grad=1.0)
    half = Durations.uniform(2 * pp, forward=0.5, backward=1.0, weight_grad=0.5)
    zbv = build_schedule("zb-v", pp=pp, num_microbatches=m, interleave=2)
    bubble = {k: simulate(build_schedule(k, pp=pp, num_microbatches=m), one_stage).bubble_fraction
              for k in ("1f1b", "zb-h1")}
    v = simulate(zbv, half).bubble_fraction
    assert v <= 0.55 * bubble["zb-h1"] and v <= 0.25 * bubble["1f1b"]
    per_rank = [sum(peak_inflight(zbv)[s] for s in zbv.stages_of(r)) for r in range(pp)]
    assert max(per_rank) == 2 * pp + 1


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)])
def test_dualpipe_v_run_pair_by_pair_has_zb_vs_bubble_and_memory(pp, m):
    """DualPipe-V with each forward / backward pair run in turn (this runtime's executor, and torch's without
    an overlap function) on the V of zb-v, T_F = T_I = T_W on half stages: the bubble and the per-rank peak of
    ZB-V (2 pp + 1 half-stage microbatches), about half ZB-H1's bubble. DualPipe's own gain, hiding one half
    of a pair's communication under the other's compute, is not modelled: the simulator runs one compute at a
    time per rank."""
    one_stage = Durations.uniform(pp, forward=1.0, backward=2.0, weight_grad=1.0)
    half = Durations.uniform(2 * pp, forward=0.5, backward=1.0, weight_grad=0.5)
    dual, zbv = (build_schedule(k, pp=pp, num_microbatches=m, interleave=2) for k in ("dualpipe-v", "zb-v"))
    got, want = simulate(dual, half), simulate(zbv, half)
    zb_h1 = simulate(build_schedule("zb-h1", pp=pp, num_microbatches=m), one_stage).bubble_fraction
    assert got.step_time_s == pytest.approx(want.step_time_s) and got.bubble_fraction <= 0.55 * zb_h1
    per_rank = [sum(peak_inflight(dual)[s] for s in dual.stages_of(r)) for r in range(pp)]
    assert max(per_rank) == 2 * pp + 1


# --- zero bubble: interleaved, and the closed forms of ZB-V and interleaved-zb -------------------------
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (8, 16)])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_zb_bubble_is_less_than_interleaved_1f1bs(pp, m, v):
    """torch's ScheduleInterleavedZeroBubble against Megatron's interleaved 1F1B on the same model cut in
    pp v chunks, T_F = T_I = T_W: the W's fill the bubble, (pp - 1)(F + B) / v becomes (pp - 1) F / v."""
    d = Durations.uniform(pp * v, forward=1.0 / v, backward=2.0 / v)   # W half the backward
    one, zb = (build_schedule(k, pp=pp, num_microbatches=m, interleave=v) for k in ("interleaved-1f1b", "interleaved-zb"))
    t1, tz = simulate(one, d).step_time_s, simulate(zb, d).step_time_s
    assert (t1 - 3 * m, tz - 3 * m) == pytest.approx((3 * (pp - 1) / v, (pp - 1) / v))
    assert simulate(zb, d).bubble_fraction < simulate(one, d).bubble_fraction


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_zb_v_bubble_is_less_than_1f1bs_at_equal_microbatches(pp, m):
    one_stage = Durations.uniform(pp, forward=1.0, backward=2.0)
    half = Durations.uniform(2 * pp, forward=0.5, backward=1.0)
    zbv = simulate(build_schedule("zb-v", pp=pp, num_microbatches=m, interleave=2), half)
    one = simulate(build_schedule("1f1b", pp=pp, num_microbatches=m), one_stage)
    assert zbv.bubble_fraction < one.bubble_fraction and zbv.step_time_s < one.step_time_s


@pytest.mark.parametrize("kind,v,pp,m", [("interleaved-zb", v, pp, m) for v in (2, 3) for pp in (2, 3, 4, 8)
                                         for m in (pp, 2 * pp, 3 * pp)]
                         + [("zb-v", 2, pp, m) for pp in (2, 3, 4, 8) for m in (2 * pp - 1, 2 * pp, 3 * pp)]
                         + [("dualpipe-v", 2, pp, m) for pp in (2, 3, 4, 8) for m in (2 * pp, 2 * pp + 1, 3 * pp)])
def test_the_cut_searchs_closed_form_is_the_simulated_step(kind, v, pp, m):
    """stage_costs.sum_weight for interleaved-zb, zb-v and dualpipe-v (charged zb-v's): T = (m v - 1) c +
    sum_weight * pp v c on uniform
    stages (c per virtual stage) with T_F = T_I = T_W, as simulated, where it claims to be exact."""
    from partitioner.planner.stage_costs import sum_weight
    c = 3.0 / v
    d = Durations.uniform(pp * v, forward=1.0 / v, backward=2.0 / v, weight_grad=1.0 / v)
    simulated = simulate(build_schedule(kind, pp=pp, num_microbatches=m, interleave=v), d).step_time_s
    assert (m * v - 1) * c + sum_weight(kind, pp, v, m, 1 / 3) * pp * v * c == pytest.approx(simulated)
