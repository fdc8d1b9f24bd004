"""PowerSGD (runtime.compression.powersgd) and its Triton kernels (runtime.compression.powersgd_triton).

Tier (a) runs in this process, over a 1-rank Gloo group: exactness where the
gradient has rank <= r, the error-feedback invariant, zero and rank-deficient
gradients, the uncompressed part bit for bit, power-iteration convergence of
the warm start, batching, checkpoints, the Triton epilogue/prologue against
torch (interpreter on CPU; TRITON_INTERPRET=0 on a GPU machine tests the
compiled kernels). Tier (c) runs real Gloo groups of 2, 3 and 4 processes:
bitwise identical results on every rank, the exact mean where r >= min(n, m),
the invariant on every rank, and at most 3 all-reduces per call.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import itertools
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from runtime.comm.collectives import Collectives
from runtime.compression.powersgd import PowerSGD
from runtime.compression.powersgd_triton import powersgd_epilogue_triton, powersgd_prologue_triton
from ranks import gloo_group

INTERPRET = os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes")
DEVICE = "cpu" if INTERPRET else "cuda"

# (16, 24), (24, 16) and (6, 20) compress at r=2; (7,), (3, 4), (), (2, 50) do not (100 < 2 * 2 * 52)
MIXED = [(16, 24), (7,), (16, 24), (3, 4), (), (6, 5, 4), (24, 16), (2, 50), (16, 24)]
SMALL = [(5, 7), (3,), (7, 5), (4, 2, 3)]  # r=8 >= min(n, m) with min_compression=0: exact
OTHER = [(20, 12), (5,)]


class Counting(Collectives):
    """Records every all-reduce (its size) on top of the real one."""

    def __init__(self):
        super().__init__()
        self.calls: list[int] = []

    def all_reduce(self, t, group=None, **kwargs):
        self.calls.append(t.numel())
        return super().all_reduce(t, group, **kwargs)


def numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def grad(shapes, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel(shapes), generator=g).to(device)


def low_rank(n: int, m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) @ torch.randn(k, m, generator=g)  # (n, m), rank k


def compressed_mask(shapes, r: int, min_compression: float = 2.0) -> torch.Tensor:
    """True where x holds a tensor PowerSGD compresses (the rule, written again here)."""
    mask = []
    for s in shapes:
        k = math.prod(s)
        n = s[0] if len(s) >= 2 else 0
        m = k // n if n else 0
        re = min(r, n, m)
        mask += [len(s) >= 2 and k > 0 and n * m >= min_compression * re * (n + m)] * k
    return torch.tensor(mask, dtype=torch.bool)


def assert_ef_invariant(x, out, before, after, mask) -> None:
    """approx_t + residual_t == grad_t + residual_{t-1} where compressed (fp32 rounding); residual 0 elsewhere."""
    want = (x + before)[mask]
    scale = want.abs().max().item() + out[mask].abs().max().item()
    torch.testing.assert_close((out + after)[mask], want, rtol=0, atol=4 * 2**-23 * scale)
    assert bool((after[~mask] == 0).all()) and bool((before[~mask] == 0).all())


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu().view(torch.int32), b.cpu().view(torch.int32))


@pytest.fixture(scope="module")
def solo():
    """A 1-rank Gloo default group in this process, destroyed after the module."""
    if dist.is_initialized():  # a test before this module leaked its group: fail, never skip these tests
        raise RuntimeError("a default process group already exists in this process: an earlier test did not "
                           "destroy it (dist.destroy_process_group())")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ---------------------------------------------------------------- one process


def test_low_rank_gradient_is_reproduced_and_feedback_invariant_holds(solo):
    shapes = [(24, 40), (24, 40), (40, 16)]
    assert bool(compressed_mask(shapes, 4).all())
    x = torch.cat([low_rank(24, 40, 1, 1).reshape(-1), low_rank(24, 40, 3, 2).reshape(-1),
                   low_rank(40, 16, 4, 3).reshape(-1)])
    ps = PowerSGD(None, Counting(), rank=4)
    for _ in range(2):  # the first call already spans the gradient's range; the warm start keeps it
        out = ps.reduce(x, "w", shapes)
        torch.testing.assert_close(out, x, rtol=0, atol=1e-5 * x.abs().max().item())
        assert ps.residual("w").abs().max() <= 1e-5 * x.abs().max()

    shapes = [(16, 24), (16, 24), (6, 5, 4)]
    mask = compressed_mask(shapes, 2)
    assert bool(mask.all())
    ps = PowerSGD(None, Counting(), rank=2)
    before = torch.zeros(numel(shapes))
    for t in range(5):
        x = grad(shapes, seed=t)
        out = ps.reduce(x, "b", shapes)
        after = ps.residual("b")
        assert_ef_invariant(x, out, before, after, mask)
        assert after.abs().max() > 0.1  # full-rank gradients: rank 2 leaves something behind
        before = after


def test_zero_and_rank_deficient_gradients(solo):
    shapes = [(10, 12), (10, 12), (9,), (12, 10)]
    ps = PowerSGD(None, Counting(), rank=4, min_compression=1.0)
    assert bool(compressed_mask(shapes, 4, 1.0)[:240].all())
    for _ in range(2):
        out = ps.reduce(torch.zeros(numel(shapes)), "z", shapes)
        assert bool((out == 0).all()) and not out.isnan().any()
        assert bool((ps.residual("z") == 0).all())
    # after zero gradients (Q = M^T P = 0) a rank-1 gradient is reproduced at once: zero Q columns are redrawn
    # at random (an orthonormalised zero Q is the first r unit vectors: blind to these rows of M^T)
    first = low_rank(10, 12, 1, 5)
    first[:, :4] = 0
    x = torch.cat([first.reshape(-1), torch.zeros(120), torch.ones(9), low_rank(12, 10, 2, 6).reshape(-1)])
    for _ in range(3):  # r=4 > rank: P is rank-deficient, QR still gives orthonormal columns
        out = ps.reduce(x, "z", shapes)
        assert not out.isnan().any()
        torch.testing.assert_close(out, x, rtol=0, atol=1e-5 * x.abs().max().item())

    # r >= min(n, m): P's columns span all of R^n (or the range of M): the reduction is exact
    ps = PowerSGD(None, Counting(), rank=8, min_compression=0)
    for t in range(2):
        x = grad(SMALL, seed=10 + t)
        out = ps.reduce(x, "e", SMALL)
        torch.testing.assert_close(out, x, rtol=0, atol=1e-5 * x.abs().max().item())


def test_uncompressed_part_is_exact_and_bytes_are_counted(solo):
    coll = Counting()
    ps = PowerSGD(None, coll, rank=2)
    mask = compressed_mask(MIXED, 2)
    x = grad(MIXED, seed=3) * 10
    out = ps.reduce(x, "m", MIXED)
    rest = x[~mask].clone()
    Collectives().all_reduce(rest, None, op="avg")  # the plain fp32 mean over the group
    assert bits_equal(out[~mask], rest)
    # three all-reduces: the rest, every P (n r each), every Q (m r each)
    groups = {(16, 24): 3, (6, 20): 1, (24, 16): 1}
    want = [int((~mask).sum()), sum(b * n * 2 for (n, _), b in groups.items()),
            sum(b * m * 2 for (_, m), b in groups.items())]
    assert coll.calls == want
    assert ps.bytes_sent(MIXED) == 4 * sum(want) == sum(coll.bytes.values())
    # only 1-D tensors and small matrices: one all-reduce, exact
    coll.calls.clear()
    shapes = [(7,), (3, 4), ()]
    assert bits_equal(ps.reduce(grad(shapes, 1), "s", shapes), grad(shapes, 1)) and coll.calls == [20]


def test_warm_start_converges_and_feedback_bounds_the_accumulated_error(solo):
    n, m, r = 40, 30, 4
    gen = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(n, m, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64)).Q
    s = torch.tensor([10, 9, 8, 7] + [3 * 0.8**i for i in range(m - 4)], dtype=torch.float64)
    g = (u * s) @ v.T  # (n, m), singular values s
    best = (u[:, :r] * s[:r]) @ v[:, :r].T  # Eckart-Young: the best rank-r approximation
    x = g.float().reshape(-1)

    # without feedback the same M every call: the warm-started Q is a power iteration onto the top-r subspace
    ps = PowerSGD(None, Counting(), rank=r, feedback=False)
    errs = [((ps.reduce(x, "w", [(n, m)]).double().view(n, m) - best).norm() / best.norm()).item()
            for _ in range(10)]
    assert errs[0] > 0.1 and errs[-1] < 1e-5, errs
    assert all(b <= 1.05 * a + 1e-6 for a, b in itertools.pairwise(errs)), errs

    # with feedback what is not sent is sent later: the accumulated error stays bounded; without it grows
    drift = {}
    for feedback in (True, False):
        ps = PowerSGD(None, Counting(), rank=r, feedback=feedback)
        total, drift[feedback] = torch.zeros_like(g), []
        for t in range(30):
            total += ps.reduce(x, "w", [(n, m)]).double().view(n, m)
            drift[feedback].append(((total - (t + 1) * g).norm() / g.norm()).item())
    assert drift[False][-1] > 3 * drift[False][4]
    assert max(drift[True][15:]) < 1.3 * max(drift[True][:15])
    assert drift[True][-1] < 0.3 * drift[False][-1]


def test_same_shape_matrices_batched_equal_separate(solo):
    shapes = [(12, 16), (5,), (12, 16), (8, 2, 8), (12, 16)]
    offs = [0]
    for s in shapes:
        offs.append(offs[-1] + math.prod(s))
    coll = Counting()
    batched = PowerSGD(None, coll, rank=2)
    alone = [PowerSGD(None, Counting(), rank=2) for _ in shapes]
    for t in range(3):
        x = grad(shapes, seed=20 + t)
        coll.calls.clear()
        out = batched.reduce(x, "k", shapes)
        assert len(coll.calls) == 3
        for i, s in enumerate(shapes):
            want = alone[i].reduce(x[offs[i]:offs[i + 1]].clone(), "k", [s])
            torch.testing.assert_close(out[offs[i]:offs[i + 1]], want, rtol=0, atol=1e-5)
    assert batched.state["k"].qs[0].shape == (3, 16, 2)  # the three (12, 16) matrices in one batch


def test_state_dict_round_trip_and_mismatch(solo, caplog, tmp_path):
    a = PowerSGD(None, Counting(), rank=2, seed=7)
    for t in range(2):
        a.reduce(grad(MIXED, seed=t), "b0", MIXED)
        a.reduce(grad(OTHER, seed=t), "b/1", OTHER)  # a key with the separator in it
    sd = a.state_dict()
    assert {"b0/world", "b/1/world", "b/1/q/0", "b/1/residual/0"} <= set(sd)
    assert all(isinstance(t, torch.Tensor) for t in sd.values())
    torch.save(sd, tmp_path / "sd.pt")
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)  # tensors only: loads without pickled objects
    b = PowerSGD(None, Counting(), rank=2, seed=7)
    b.load_state_dict(sd)
    for t in range(2, 5):
        for key, shapes in (("b0", MIXED), ("b/1", OTHER)):
            x = grad(shapes, seed=t)
            assert bits_equal(a.reduce(x, key, shapes), b.reduce(x, key, shapes))

    other = [(16, 24), (16, 24)]
    x = grad(other, seed=9)
    fresh = PowerSGD(None, Counting(), rank=2, seed=7).reduce(x, "b0", other)
    with caplog.at_level(logging.WARNING, logger="runtime.compression.powersgd"):
        c = PowerSGD(None, Counting(), rank=2, seed=7)
        c.load_state_dict(sd)
        assert bits_equal(c.reduce(x, "b0", other), fresh)  # b0 was MIXED: dropped, fresh start
    assert any("'b0'" in r.message and "dropped" in r.message for r in caplog.records)

    caplog.clear()
    sd["b0/world"] = torch.tensor(2)
    x = grad(MIXED, seed=9)
    fresh = PowerSGD(None, Counting(), rank=2, seed=7).reduce(x, "b0", MIXED)
    with caplog.at_level(logging.WARNING, logger="runtime.compression.powersgd"):
        c = PowerSGD(None, Counting(), rank=2, seed=7)
        c.load_state_dict(sd)
        assert bits_equal(c.reduce(x, "b0", MIXED), fresh)
    assert any("'b0'" in r.message and "2 rank(s)" in r.message for r in caplog.records)

    with pytest.raises(ValueError, match="not a PowerSGD state tensor"):
        c.load_state_dict({"b0/momentum": torch.zeros(1)})


def test_bad_input(solo):
    ps = PowerSGD(None, Counting())
    with pytest.raises(ValueError, match=r"hold 10 elements but x has 12.*shapes of exactly the tensors"):
        ps.reduce(torch.zeros(12), "k", [(2, 5)])
    with pytest.raises(ValueError, match="flat fp32"):
        ps.reduce(torch.zeros(12, dtype=torch.float64), "k", [(12,)])
    with pytest.raises(ValueError, match="op='max'"):
        ps.reduce(torch.zeros(12), "k", [(12,)], op="max")
    for rank in (0, -1):
        with pytest.raises(ValueError, match=rf"rank={rank}.*r must be an int >= 1"):
            PowerSGD(None, Counting(), rank=rank)
    with pytest.raises(ValueError, match="min_compression=-1"):
        PowerSGD(None, Counting(), min_compression=-1)
    with pytest.raises(ValueError, match="kernel='cuda'"):
        PowerSGD(None, Counting(), kernel="cuda")
    with pytest.raises(KeyError, match="reduce it first"):
        ps.residual("nope")


# ---------------------------------------------------------------- Triton kernels

GUARD = 16  # elements each side of every buffer


def guarded(shape, fill: float, values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous view into a bigger buffer filled with ``fill`` (NaN around inputs, a sentinel around outputs)."""
    k = math.prod(shape)
    big = torch.full((k + 2 * GUARD,), fill, device=DEVICE)
    view = big[GUARD:GUARD + k].view(shape)
    if values is not None:
        view.copy_(values)
    return big, view


def guards_intact(big: torch.Tensor, fill: float) -> bool:
    return bool((big[:GUARD] == fill).all() and (big[-GUARD:] == fill).all())


@pytest.mark.parametrize("r", [1, 4])
@pytest.mark.parametrize("m", [1, 5, 17, 40])
@pytest.mark.parametrize("n", [1, 5, 17, 40])
@pytest.mark.parametrize("b", [1, 3])
def test_triton_epilogue_and_prologue_match_torch(b, n, m, r):
    gen = torch.Generator().manual_seed(n * 1000 + m * 10 + r)
    mm, p, q, e = (torch.randn(*s, generator=gen).to(DEVICE) for s in ((b, n, m), (b, n, r), (b, m, r), (b, n, m)))
    _, mv = guarded((b, n, m), float("nan"), mm)
    _, pv = guarded((b, n, r), float("nan"), p)
    _, qv = guarded((b, m, r), float("nan"), q)
    abig, approx = guarded((b, n, m), -1234.5)
    rbig, residual = guarded((b, n, m), -1234.5)
    got = powersgd_epilogue_triton(mv, pv, qv, approx_out=approx, residual_out=residual)
    assert got[0] is approx and got[1] is residual
    want = torch.bmm(p, q.transpose(1, 2))
    tol = 1e-5 * (1 + want.abs().max().item())
    torch.testing.assert_close(approx, want, rtol=0, atol=tol)
    torch.testing.assert_close(residual, mm - want, rtol=0, atol=tol)
    assert guards_intact(abig, -1234.5) and guards_intact(rbig, -1234.5)

    _, ev = guarded((b, n, m), float("nan"), e)
    mbig, mout = guarded((b, n, m), -1234.5)
    pbig, pout = guarded((b, n, r), -1234.5)
    powersgd_prologue_triton(mv, ev, qv, m_out=mout, p_out=pout)
    assert bits_equal(mout, mm + e)  # one fp32 add: bit for bit
    want = torch.bmm(mm + e, q)
    torch.testing.assert_close(pout, want, rtol=0, atol=1e-5 * (1 + want.abs().max().item()))
    assert guards_intact(mbig, -1234.5) and guards_intact(pbig, -1234.5)


def test_triton_in_place_and_bad_arguments():
    gen = torch.Generator().manual_seed(0)
    mm, p, q = (torch.randn(*s, generator=gen).to(DEVICE) for s in ((2, 9, 6), (2, 9, 3), (2, 6, 3)))
    m2 = mm.clone()
    _, residual = powersgd_epilogue_triton(m2, p, q, residual_out=m2)
    assert residual is m2
    torch.testing.assert_close(residual, mm - torch.bmm(p, q.transpose(1, 2)), rtol=0, atol=1e-5)
    m_same, p_noe = powersgd_prologue_triton(mm, None, q)
    assert m_same is mm
    torch.testing.assert_close(p_noe, torch.bmm(mm, q), rtol=0, atol=1e-5)

    cases = [
        ("M", lambda: powersgd_epilogue_triton(mm.double(), p, q)),
        ("M", lambda: powersgd_epilogue_triton(mm[0], p, q)),
        ("P", lambda: powersgd_epilogue_triton(mm, p[:, :8], q)),
        ("Q", lambda: powersgd_epilogue_triton(mm, p, q[:, :, :2])),
        ("Q", lambda: powersgd_epilogue_triton(mm, p, q.transpose(1, 2).contiguous().transpose(1, 2))),
        ("approx_out", lambda: powersgd_epilogue_triton(mm, p, q, approx_out=torch.empty(2, 9, 5, device=DEVICE))),
        ("residual_out", lambda: powersgd_epilogue_triton(mm, p, q, residual_out=mm.transpose(1, 2))),
        ("overlap", lambda: powersgd_epilogue_triton(mm, p, q, approx_out=m2, residual_out=m2)),
        ("E", lambda: powersgd_prologue_triton(mm, mm[:1], q)),
        ("p_out", lambda: powersgd_prologue_triton(mm, mm, q, p_out=torch.empty(2, 9, 4, device=DEVICE))),
        ("m_out without E", lambda: powersgd_prologue_triton(mm, None, q, m_out=m2)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()


def test_powersgd_triton_kernel_equals_torch(solo):
    torch_, triton_ = PowerSGD(None, Counting(), rank=2), PowerSGD(None, Counting(), rank=2, kernel="triton")
    for t in range(3):
        x = grad(MIXED, seed=40 + t, device=DEVICE)
        a, b = torch_.reduce(x, "k", MIXED), triton_.reduce(x, "k", MIXED)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * a.abs().max().item())
        torch.testing.assert_close(triton_.residual("k"), torch_.residual("k"), rtol=0, atol=1e-5 * a.abs().max().item())


# ---------------------------------------------------------------- real Gloo groups


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    with gloo_group(rank, world, store_path):
        out: dict = {"mixed": []}
        coll = Counting()
        ps = PowerSGD(None, coll, rank=2)
        before = torch.zeros(numel(MIXED))
        for t in range(3):
            x = grad(MIXED, seed=100 * t + rank) * (1 + rank)
            coll.calls.clear()
            y = ps.reduce(x, "mixed", MIXED)
            out["mixed"].append({"x": x, "y": y, "before": before, "after": ps.residual("mixed"),
                                 "calls": list(coll.calls)})
            before = ps.residual("mixed")
        rest = x[~compressed_mask(MIXED, 2)].clone()
        Collectives().all_reduce(rest, None, op="avg")  # a plain fp32 mean of the last call's uncompressed part
        out["rest"] = rest
        exact = PowerSGD(None, Counting(), rank=8, min_compression=0)
        out["exact"] = [exact.reduce(grad(SMALL, seed=10 * t + rank), "e", SMALL) for t in range(2)]
        out["exact_sum"] = PowerSGD(None, Counting(), rank=8, min_compression=0).reduce(
            grad(SMALL, seed=rank), "e", SMALL, op="sum")
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def worlds(spawned):
    return functools.partial(spawned, _worker)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_ranks_agree_and_reduce_exactly_where_rank_allows(worlds, world):
    ranks = worlds(world)
    mask = compressed_mask(MIXED, 2)
    bytes_sent = PowerSGD(None, Collectives(), rank=2).bytes_sent(MIXED)
    for t in range(3):
        for r in range(world):
            got = ranks[r]["mixed"][t]
            assert bits_equal(got["y"], ranks[0]["mixed"][t]["y"]), f"call {t}: rank {r} differs from rank 0"
            assert len(got["calls"]) <= 3 and 4 * sum(got["calls"]) == bytes_sent, got["calls"]
            assert_ef_invariant(got["x"], got["y"], got["before"], got["after"], mask)
        # uncompressed: the exact mean; compressed: the projected mean (rank 2 of full-rank gradients, not exact)
        mean = sum(ranks[r]["mixed"][t]["x"].double() for r in range(world)) / world
        y = ranks[0]["mixed"][t]["y"]
        torch.testing.assert_close(y[~mask].double(), mean[~mask], rtol=0, atol=1e-6 * world)
    assert bits_equal(ranks[0]["mixed"][2]["y"][~mask], ranks[0]["rest"])  # bit for bit a plain all-reduce mean

    for t in range(2):
        xs = [grad(SMALL, seed=10 * t + r).double() for r in range(world)]
        for r in range(world):
            assert bits_equal(ranks[r]["exact"][t], ranks[0]["exact"][t])
        torch.testing.assert_close(ranks[0]["exact"][t].double(), sum(xs) / world, rtol=0, atol=1e-5)
    xs = [grad(SMALL, seed=r).double() for r in range(world)]
    for r in range(world):
        assert bits_equal(ranks[r]["exact_sum"], ranks[0]["exact_sum"])
    torch.testing.assert_close(ranks[0]["exact_sum"].double(), sum(xs), rtol=0, atol=1e-5 * world)
