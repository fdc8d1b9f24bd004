"""Blockwise int8/int4 quantization (runtime.compression.quantize) and its Triton kernels (runtime.compression.quantize_triton).

Tier (a). The Triton kernels run in the interpreter on CPU tensors (set
TRITON_INTERPRET=0 on a GPU machine to test the compiled kernels on CUDA) and
must equal the torch reference bit for bit: codes, scales, residual and the
dequantized values. Error feedback is checked as an invariant per step and
over 200 steps against a no-feedback control.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import math

import pytest
import torch

from runtime.compression.quantize import (
    Quantized,
    dequantize,
    nbytes,
    pack_int4,
    quantize,
    unpack_int4,
)
from runtime.compression.quantize_triton import (
    dequantize_add_triton,
    dequantize_triton,
    quantize_triton,
)

INTERPRET = os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes")
DEVICE = "cpu" if INTERPRET else "cuda"
QMAX = {8: 127, 4: 7}
BLOCK = 64
SIZES = [0, 1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7, 1001, 3000]


def gradient(n: int, seed: int) -> torch.Tensor:
    """Random gradient-like fp32 vector: per-block magnitudes spread over 6 decades, some exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x *= torch.logspace(-4, 2, max(n, 1))[torch.randperm(max(n, 1), generator=g)][:n]
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    return x.to(DEVICE)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (distinguishes -0.0 from 0.0, compares NaN payloads)."""
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


def assert_same(q1: Quantized, q2: Quantized) -> None:
    assert (q1.numel, q1.bits, q1.block) == (q2.numel, q2.bits, q2.block)
    assert bits_equal(q1.codes, q2.codes), (q1.codes, q2.codes)
    assert bits_equal(q1.scales, q2.scales), (q1.scales, q2.scales)


# ---------------------------------------------------------------- Triton == torch, bit for bit


@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", SIZES)
def test_triton_matches_reference(n, bits, feedback):
    x = gradient(n, seed=n)
    residual = gradient(n, seed=n + 1) * 1e-2 if feedback else None
    q_ref, r_ref = quantize(x, bits=bits, block=BLOCK, residual=residual)
    q_tri, r_tri = quantize_triton(x, bits=bits, block=BLOCK, residual=residual)
    assert_same(q_ref, q_tri)
    assert q_ref.codes.shape == (math.ceil(n / 2) if bits == 4 else n,)
    assert q_ref.scales.shape == (math.ceil(n / BLOCK),)
    assert (r_ref is None) == (r_tri is None) == (not feedback)
    if feedback:
        assert bits_equal(r_ref, r_tri)
    deq = dequantize(q_ref)
    assert bits_equal(deq, dequantize_triton(q_ref))
    acc = gradient(n, seed=n + 2)
    expect = acc + deq
    assert dequantize_add_triton(q_ref, acc) is acc
    assert bits_equal(acc, expect)


@pytest.mark.parametrize("bits", [8, 4])
def test_larger_blocks_and_ties(bits):
    """block 1024 over a few thousand elements; exact .5 ties (scale 1) round half to even."""
    x = gradient(4099, seed=7)
    for block in (256, 1024):
        assert_same(quantize(x, bits=bits, block=block)[0], quantize_triton(x, bits=bits, block=block)[0])
    q = QMAX[bits]
    ties = torch.cat([torch.tensor([float(q)]), torch.arange(-2 * q, 2 * q + 1) / 2.0]).to(DEVICE)
    q_ref, _ = quantize(ties, bits=bits, block=512)  # one block
    q_tri, _ = quantize_triton(ties, bits=bits, block=512)
    assert_same(q_ref, q_tri)
    assert q_ref.scales[0] == 1.0
    assert torch.equal(dequantize(q_ref).cpu(), torch.round(ties).cpu())  # -2.5 -> -2, 0.5 -> 0, 1.5 -> 2


# ---------------------------------------------------------------- special blocks


@pytest.mark.parametrize("impl", [quantize, quantize_triton], ids=["torch", "triton"])
@pytest.mark.parametrize("bits", [8, 4])
def test_zero_and_single_element_blocks(impl, bits):
    x = torch.zeros(4 * BLOCK + 3, device=DEVICE)
    x[BLOCK : 2 * BLOCK] = -0.0
    x[2 * BLOCK + 5] = -3.0  # one nonzero element
    x[3 * BLOCK + 1] = 1e-45  # absmax / qmax underflows to 0: treated as an all-zero block
    q, r = impl(x, bits=bits, block=BLOCK, residual=torch.zeros_like(x))
    expect_scales = torch.tensor([0.0, 0.0, 3.0, 0.0, 0.0]) / QMAX[bits]  # fp32 division; +0.0, never -0.0
    assert bits_equal(q.scales, expect_scales)
    codes = unpack_int4(q.codes, q.numel) if bits == 4 else q.codes
    expect = torch.zeros(x.numel(), dtype=torch.int8)
    expect[2 * BLOCK + 5] = -QMAX[bits]
    assert torch.equal(codes.cpu(), expect)
    deq = dequantize(q)
    assert not deq.isnan().any() and not r.isnan().any()
    assert abs(float(deq[2 * BLOCK + 5]) + 3.0) <= 3.0 * 2.0**-23
    assert r[3 * BLOCK + 1] == 1e-45  # not transmitted, kept in the residual
    assert torch.count_nonzero(r) <= 2


@pytest.mark.parametrize("bits", [8, 4])
def test_error_within_half_step(bits):
    """|x - dequantize(quantize(x))| <= scale / 2 per block, plus fp32 rounding slack.

    Slack: y / scale, code * scale and the subtraction each round once (a
    relative 2**-24 of at most absmax = qmax * scale), so 4 * 2**-24 * absmax
    is a safe bound on the excess.
    """
    x = gradient(5000, seed=3)
    q, _ = quantize(x, bits=bits, block=BLOCK)
    err = (x - dequantize(q)).abs()  # (n,)
    scale = q.scales.repeat_interleave(BLOCK)[: x.numel()]
    assert (err <= scale / 2 + 4 * 2.0**-24 * QMAX[bits] * scale).all()
    assert (err > scale / 4).any()  # the bound is not vacuous


def test_nbytes_and_validation():
    x = torch.randn(1000, device=DEVICE)
    assert nbytes(quantize(x, bits=8, block=256)[0]) == 1000 + 4 * 4
    assert nbytes(quantize(x, bits=4, block=256)[0]) == 500 + 4 * 4
    assert nbytes(quantize(x[:999], bits=4, block=256)[0]) == 500 + 4 * 4
    with pytest.raises(ValueError, match="bits=3"):
        quantize(x, bits=3)
    with pytest.raises(ValueError, match="fp32"):
        quantize(x.double())
    with pytest.raises(ValueError, match="residual"):
        quantize(x, residual=torch.zeros(999, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        quantize_triton(x, block=100)
    assert quantize(x, block=100)[0].scales.shape == (10,)  # the reference takes any block


# ---------------------------------------------------------------- int4 packing


def test_int4_pack_unpack_exhaustive():
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = unpack_int4(every_byte, 512)
    assert codes.min() == -8 and codes.max() == 7
    assert torch.equal(pack_int4(codes), every_byte)
    lo, hi = torch.meshgrid(torch.arange(-8, 8), torch.arange(-8, 8), indexing="ij")
    pairs = torch.stack([lo.flatten(), hi.flatten()], dim=1).flatten().to(torch.int8)  # all 256 (lo, hi)
    packed = pack_int4(pairs)
    assert packed.shape == (256,) and len(set(packed.tolist())) == 256
    assert torch.equal(unpack_int4(packed, 512), pairs)
    assert pack_int4(torch.tensor([-8, 7, 1], dtype=torch.int8)).tolist() == [0xF0, 0x89]  # odd tail: high 8
    assert unpack_int4(torch.tensor([0xF0, 0x89], dtype=torch.uint8), 3).tolist() == [-8, 7, 1]
    assert pack_int4(torch.zeros(0, dtype=torch.int8)).shape == (0,)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([8], dtype=torch.int8))


# ---------------------------------------------------------------- guard bytes


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1, BLOCK - 1, 2 * BLOCK + 2, 2 * BLOCK + 3])
def test_kernels_stay_inside_their_buffers(n, bits):
    """Outputs are views into sentinel-filled tensors; inputs are followed by NaN guards.

    A write past a buffer changes a sentinel; an unmasked read past an input
    pulls a NaN into a block's absmax and breaks bit-equality with the reference.
    """
    g = BLOCK  # guard elements on each side: a whole block, so a stray write lands in them

    def guarded(size: int, dtype: torch.dtype, fill) -> tuple[torch.Tensor, torch.Tensor]:
        big = torch.full((size + 2 * g,), fill, dtype=dtype, device=DEVICE)
        return big, big[g : g + size]

    def guards_intact(big: torch.Tensor, fill) -> bool:
        ends = torch.cat([big[:g], big[-g:]]).cpu()
        return torch.equal(ends, torch.full_like(ends, fill))

    xbig, x = guarded(n, torch.float32, float("nan"))
    x.copy_(gradient(n, seed=11))
    rbig, residual = guarded(n, torch.float32, float("nan"))
    residual.copy_(gradient(n, seed=12) * 1e-2)
    ncodes = -(-n // 2) if bits == 4 else n
    code_dtype, code_fill = (torch.uint8, 0xA5) if bits == 4 else (torch.int8, 0x5A)
    cbig, codes = guarded(ncodes, code_dtype, code_fill)
    sbig, scales = guarded(-(-n // BLOCK), torch.float32, -1234.5)
    obig, rout = guarded(n, torch.float32, -1234.5)
    out = Quantized(codes=codes, scales=scales, numel=n, bits=bits, block=BLOCK)
    q, r = quantize_triton(x, bits=bits, block=BLOCK, residual=residual, out=out, residual_out=rout)
    assert q is out and r is rout
    q_ref, r_ref = quantize(x, bits=bits, block=BLOCK, residual=residual)
    assert_same(q_ref, q)
    assert bits_equal(r_ref, r)
    assert guards_intact(cbig, code_fill) and guards_intact(sbig, -1234.5) and guards_intact(obig, -1234.5)
    dbig, deq = guarded(n, torch.float32, -1234.5)
    dequantize_triton(q, out=deq)
    dequantize_add_triton(q, deq)
    assert guards_intact(dbig, -1234.5)
    assert bits_equal(deq, dequantize(q_ref) + dequantize(q_ref))


def test_residual_updated_in_place():
    x = gradient(300, seed=5)
    residual = gradient(300, seed=6) * 1e-2
    q_ref, r_ref = quantize(x, bits=4, block=BLOCK, residual=residual)
    q, r = quantize_triton(x, bits=4, block=BLOCK, residual=residual, residual_out=residual)
    assert r is residual
    assert_same(q_ref, q)
    assert bits_equal(r_ref, residual)


# ---------------------------------------------------------------- error feedback


@pytest.mark.parametrize("impl", [quantize, quantize_triton], ids=["torch", "triton"])
@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_is_bounded(impl, bits):
    """Each step: dequantize(q_t) + r_t == x_t + r_{t-1} up to two fp32 roundings.

    The two roundings are y = fl(x + r_{t-1}) and r_t = fl(y - dequantized);
    each is off by at most half an ulp, so per element the float64 difference is
    <= 2**-24 * (|y| + |r_t|). Summed over steps the transmitted total telescopes:
    sum(deq_t - x_t) = r_0 - r_T (+ those roundings), so its drift stays within
    the last step's half quantization step instead of growing with T.
    """
    n, steps = 256, 200
    g = torch.Generator().manual_seed(bits)
    residual = torch.zeros(n, device=DEVICE)
    drift = torch.zeros(n, dtype=torch.float64, device=DEVICE)  # sum of (dequantized - true)
    slack = torch.zeros(n, dtype=torch.float64, device=DEVICE)
    for _ in range(steps):
        x = (torch.randn(n, generator=g) * torch.rand(n, generator=g)).to(DEVICE)
        q, new = impl(x, bits=bits, block=BLOCK, residual=residual)
        deq = dequantize(q).double()
        y = x.double() + residual.double()
        bound = 2.0**-24 * (y.abs() + new.double().abs())
        assert ((deq + new.double() - y).abs() <= bound).all()
        drift += deq - x.double()
        slack += bound
        residual = new
    assert torch.allclose(drift, -residual.double(), rtol=0, atol=float(slack.max()))
    half_step = q.scales.double().repeat_interleave(BLOCK)[:n] / 2 * (1 + 2.0**-20)
    assert (residual.double().abs() <= half_step).all()
    assert (drift.abs() <= half_step + slack).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_no_feedback_control_accumulates_error(bits):
    """A constant gradient below the quantization step is never sent without feedback; with it, it is."""
    n, steps, small = 4 * BLOCK, 200, 1e-3
    x = torch.full((n,), small, device=DEVICE)
    x[::BLOCK] = 1.0  # absmax 1 per block: step 1/qmax > 2 * small, so `small` rounds to code 0
    residual = torch.zeros(n, device=DEVICE)
    sent_plain = torch.zeros(n, dtype=torch.float64, device=DEVICE)
    sent_feedback = torch.zeros(n, dtype=torch.float64, device=DEVICE)
    for _ in range(steps):
        sent_plain += dequantize(quantize(x, bits=bits, block=BLOCK)[0]).double()
        q, residual = quantize(x, bits=bits, block=BLOCK, residual=residual)
        sent_feedback += dequantize(q).double()
    true = x.double() * steps
    small_ones = x == small
    assert (sent_plain[small_ones] == 0).all()  # plain transmits 0 forever: error 0.2, growing with T
    assert ((true - sent_plain)[small_ones] > 0.99 * steps * small).all()
    # with feedback the error telescopes to -r_T: within the last half step (plus fp32 roundings of
    # 200 steps, each <= 2**-24 * |y| with |y| < 2), independent of T; for int4 0.071 vs plain 0.2
    feedback_error = (true - sent_feedback).abs()
    assert torch.allclose(feedback_error, residual.double().abs(), rtol=0, atol=steps * 2.0**-23)
    assert (feedback_error <= float(q.scales.max()) / 2 + steps * 2.0**-23).all()
    assert feedback_error.max() < 0.5 * steps * small


# ---------------------------------------------------------------- stochastic rounding


def stochastic_input(n: int, bits: int) -> torch.Tensor:
    """One absmax element per block (scale exactly 1), the rest with fractional parts spread in (0, 1)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(n, generator=g) * 2 - 1) * (QMAX[bits] - 1)
    x[::BLOCK] = QMAX[bits]
    return x.to(DEVICE)


def assert_unbiased(x: torch.Tensor, draws: list[torch.Tensor]) -> None:
    """mean(dequantized - x) over all draws and elements within 5 standard errors of 0."""
    err = torch.stack([d.double() - x.double() for d in draws])  # (draws, n)
    frac = x.double() - x.double().floor()
    assert ((err > -1) & (err < 1)).all()  # floor or ceil of v (scale is 1)
    se = math.sqrt(float((frac * (1 - frac)).mean()) / err.numel())
    assert abs(float(err.mean())) < 5 * se
    per_element = err.mean(dim=0)  # each element unbiased too, with a looser per-element check
    assert (per_element.abs() < 5 * torch.sqrt(frac * (1 - frac) / len(draws)) + 1e-9).float().mean() > 0.99


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased_torch(bits):
    x = stochastic_input(4096, bits)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    draws = [dequantize(quantize(x, bits=bits, block=BLOCK, stochastic=True, generator=gen)[0]) for _ in range(64)]
    assert_unbiased(x, draws)
    assert not torch.equal(draws[0], draws[1])


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased_triton(bits):
    x = stochastic_input(8192, bits)
    draws = [dequantize(quantize_triton(x, bits=bits, block=1024, stochastic=True, seed=s)[0]) for s in range(8)]
    assert_unbiased(x, draws)
    assert not torch.equal(draws[0], draws[1])


@pytest.mark.parametrize("impl", [quantize, quantize_triton], ids=["torch", "triton"])
def test_stochastic_with_residual_is_refused(impl):
    x = torch.randn(100, device=DEVICE)
    with pytest.raises(ValueError, match="stochastic"):
        impl(x, stochastic=True, residual=torch.zeros_like(x))
