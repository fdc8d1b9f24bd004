"""Triton kernels for `runtime.compression.powersgd`: the error-feedback epilogue, and the prologue before the all-reduce.

For one batch of B matrices of ``n x m`` (fp32, contiguous) and rank ``r``:

- `powersgd_epilogue_triton`: ``approx = P @ Q^T`` and ``residual = M - approx``
  in one kernel, one program per ``(BM, BN)`` tile of one matrix: it loads the
  tile's rows of P ``(BM, r)`` and columns of Q^T ``(r, BN)``, multiplies them
  with ``tl.dot`` (``r`` zero-padded to at least 16, tl.dot's minimum), and
  writes both outputs; ``approx`` never goes back to memory before the subtract.
- `powersgd_prologue_triton`: ``M = G + E`` and ``P = M @ Q`` in one kernel, one
  program per ``BM`` rows of one matrix, looping over ``m`` in ``BK`` columns:
  each tile of M is written once and multiplied while in registers.

``tl.dot`` runs with ``input_precision="ieee"`` (full fp32 products: no TF32),
so the results match the torch ops (`PowerSGD(kernel="torch")`) to fp32
rounding, not bit for bit (the sums are in another order). Outputs may be
preallocated; an output may be an input of the same shape (``residual_out=M``,
``m_out=G``): every element is read before it is written, by the same program.

Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set
before triton is first imported). Importing `runtime.compression.powersgd` never needs
triton; this module does.

>>> import os
>>> import torch
>>> device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
>>> M, P, Q = (torch.randn(3, 40, 17, device=device), torch.randn(3, 40, 4, device=device),
...            torch.randn(3, 17, 4, device=device))
>>> approx, residual = powersgd_epilogue_triton(M, P, Q)
>>> torch.allclose(approx, P @ Q.transpose(1, 2), atol=1e-5)
True
>>> torch.allclose(residual, M - approx, atol=1e-5)
True
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["powersgd_epilogue_triton", "powersgd_prologue_triton"]

_MIN_DOT = 16  # tl.dot's smallest dimension
_MAX_TILE = 64  # tile rows/columns: (64, 64) fp32 accumulators, and few programs in the interpreter


@triton.jit
def _epilogue_kernel(m_ptr, p_ptr, q_ptr, approx_ptr, res_ptr, n, m, r,
                     BM: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)  # (BM,)
    cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)  # (BN,)
    ks = tl.arange(0, RP)  # (RP,): r padded with zeros
    p = tl.load(p_ptr + b * n * r + rows[:, None] * r + ks[None, :],
                mask=(rows[:, None] < n) & (ks[None, :] < r), other=0.0)  # (BM, RP)
    qt = tl.load(q_ptr + b * m * r + cols[None, :] * r + ks[:, None],
                 mask=(cols[None, :] < m) & (ks[:, None] < r), other=0.0)  # (RP, BN): Q^T
    approx = tl.dot(p, qt, input_precision="ieee")  # (BM, BN)
    offs = b * n * m + rows[:, None] * m + cols[None, :]  # (BM, BN)
    mask = (rows[:, None] < n) & (cols[None, :] < m)
    mt = tl.load(m_ptr + offs, mask=mask, other=0.0)  # read before any write: outputs may alias M
    tl.store(approx_ptr + offs, approx, mask=mask)
    tl.store(res_ptr + offs, mt - approx, mask=mask)


@triton.jit
def _prologue_kernel(g_ptr, e_ptr, q_ptr, m_ptr, p_ptr, n, m, r,
                     HAS_RESIDUAL: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)  # (BM,)
    ks = tl.arange(0, RP)  # (RP,)
    acc = tl.zeros((BM, RP), dtype=tl.float32)
    for k0 in range(0, m, BK):
        cols = k0 + tl.arange(0, BK)  # (BK,)
        mask = (rows[:, None] < n) & (cols[None, :] < m)
        offs = b * n * m + rows[:, None] * m + cols[None, :]  # (BM, BK)
        mt = tl.load(g_ptr + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            mt = mt + tl.load(e_ptr + offs, mask=mask, other=0.0)
            tl.store(m_ptr + offs, mt, mask=mask)
        q = tl.load(q_ptr + b * m * r + cols[:, None] * r + ks[None, :],
                    mask=(cols[:, None] < m) & (ks[None, :] < r), other=0.0)  # (BK, RP)
        acc = tl.dot(mt, q, acc, input_precision="ieee")  # (BM, RP)
    tl.store(p_ptr + b * n * r + rows[:, None] * r + ks[None, :], acc, mask=(rows[:, None] < n) & (ks[None, :] < r))


def _tile(size: int) -> int:
    return min(_MAX_TILE, max(_MIN_DOT, triton.next_power_of_2(max(size, 1))))


def _rank_pad(r: int) -> int:
    return max(_MIN_DOT, triton.next_power_of_2(r))


def _check_device(t: torch.Tensor) -> None:
    interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    if not t.is_cuda and not interpret:
        raise ValueError(
            f"Triton kernels need CUDA tensors, got one on {t.device}: move it to the GPU, use "
            "PowerSGD(kernel='torch') on CPU, or set TRITON_INTERPRET=1 before importing triton"
        )


def _check(name: str, t: object, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous() or t.device != like.device:
        raise ValueError(
            f"{name} must be a contiguous float32 tensor of shape {shape} on {like.device}, "
            f"got {t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()} on {t.device}"
        )
    return t


def _matrices(name: str, t: object) -> tuple[int, int, int]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be a batch of matrices (B, rows, cols), got shape {tuple(t.shape)}")
    return tuple(t.shape)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    lo_a, lo_b = a.data_ptr(), b.data_ptr()
    return a.numel() > 0 and b.numel() > 0 and lo_a < lo_b + 4 * b.numel() and lo_b < lo_a + 4 * a.numel()


def powersgd_epilogue_triton(
    M: torch.Tensor,
    P: torch.Tensor,
    Q: torch.Tensor,
    *,
    approx_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(approx, residual) = (P @ Q^T, M - P @ Q^T)`` for M ``(B, n, m)``, P ``(B, n, r)``, Q ``(B, m, r)``.

    ``approx_out`` / ``residual_out``: preallocated ``(B, n, m)`` outputs (either may be ``M`` itself; not each
    other)."""
    B, n, m = _matrices("M", M)
    _check("M", M, (B, n, m), M)
    _check_device(M)
    r = _matrices("P", P)[2]
    if r < 1:
        raise ValueError(f"P has shape {tuple(P.shape)}: rank r = P.shape[2] must be >= 1")
    _check("P", P, (B, n, r), M)
    _check("Q", Q, (B, m, r), M)
    approx_out = torch.empty_like(M) if approx_out is None else _check("approx_out", approx_out, (B, n, m), M)
    residual_out = torch.empty_like(M) if residual_out is None else _check("residual_out", residual_out, (B, n, m), M)
    if _overlap(approx_out, residual_out):
        raise ValueError("approx_out and residual_out overlap in memory: pass two separate buffers")
    if M.numel():
        BM, BN = _tile(n), _tile(m)
        grid = (triton.cdiv(n, BM), triton.cdiv(m, BN), B)
        _epilogue_kernel[grid](M, P, Q, approx_out, residual_out, n, m, r,
                               BM=BM, BN=BN, RP=_rank_pad(r))
    return approx_out, residual_out


def powersgd_prologue_triton(
    G: torch.Tensor,
    E: torch.Tensor | None,
    Q: torch.Tensor,
    *,
    m_out: torch.Tensor | None = None,
    p_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, P) = (G + E, (G + E) @ Q)`` for G, E ``(B, n, m)``, Q ``(B, m, r)``; ``E=None``: ``M`` is ``G``.

    ``m_out`` ``(B, n, m)`` (may be ``G`` or ``E``) and ``p_out`` ``(B, n, r)`` are optional preallocated outputs."""
    B, n, m = _matrices("G", G)
    _check("G", G, (B, n, m), G)
    _check_device(G)
    if E is not None:
        _check("E", E, (B, n, m), G)
    r = _matrices("Q", Q)[2]
    if r < 1:
        raise ValueError(f"Q has shape {tuple(Q.shape)}: rank r = Q.shape[2] must be >= 1")
    _check("Q", Q, (B, m, r), G)
    if E is None:
        if m_out is not None:
            raise ValueError("m_out without E: M is G itself when there is no residual; pass E or drop m_out")
        m_out = G
    else:
        m_out = torch.empty_like(G) if m_out is None else _check("m_out", m_out, (B, n, m), G)
    p_out = torch.empty(B, n, r, device=G.device) if p_out is None else _check("p_out", p_out, (B, n, r), G)
    if _overlap(p_out, G) or _overlap(p_out, m_out) or (E is not None and _overlap(p_out, E)):
        raise ValueError("p_out overlaps G, E or m_out in memory: pass a separate buffer")
    if p_out.numel():
        BM = _tile(n)
        _prologue_kernel[(triton.cdiv(n, BM), B)](G, G if E is None else E, Q, m_out, p_out, n, m, r,
                                                  HAS_RESIDUAL=E is not None, BM=BM, BK=_tile(m),
                                                  RP=_rank_pad(r))
    return m_out, p_out
