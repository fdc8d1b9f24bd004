"""PowerSGD: a rank-r data-parallel gradient reduction with error feedback (Vogels et al., 2019).

The scheme of torch's ``powerSGD_hook``, for one bucket ``x`` (a flat fp32
vector holding tensors of the given shapes, concatenated in order) over p
ranks. Each tensor with ndim >= 2 is viewed as a matrix ``(shape[0],
prod(shape[1:]))`` of ``n x m``; with ``r = min(rank, n, m)`` it is
*compressed* if ``n * m >= min_compression * r * (n + m)`` (its elements
against the ``r (n + m)`` of P and Q), the rest (1-D tensors, scalars, small matrices)
is *uncompressed*. Per call, for the compressed matrices, stacked by equal
``(n, m)`` and worked on batched (``torch.bmm``, batched QR):

1. ``M = G + E`` (the gradient plus this rank's residual, 0 at first);
2. ``P = M @ orth(Q)`` ``(n, r)``, with ``Q`` ``(m, r)`` the previous call's
   (warm start; at first random normal from a generator seeded by ``(seed,
   key, (n, m))``, the same on every rank and for every matrix of that shape),
   its columns orthonormalised first as torch's hook does (so P is no worse
   conditioned than M); every P of the bucket in ONE all-reduce, divided by p:
   the mean P;
3. ``P = orth(P)``, an orthonormal basis of P's columns (``orth`` is reduced
   Householder QR, ``torch.linalg.qr``: a zero or rank-deficient input still
   gives orthonormal columns, no NaN);
4. ``Q = M^T @ P`` ``(m, r)``; every Q in ONE all-reduce, divided by p: the
   mean Q, ``mean_i(M_i)^T P``; kept for the next call's warm start (a column
   that came out all zero, e.g. after a zero gradient, is drawn again from the
   seeded generator: orthonormalised as it is, it would become a fixed unit
   vector, blind to the rows of M^T it is orthogonal to);
5. ``approx = P @ Q^T`` = ``P P^T mean_i(M_i)``, the projection of the mean
   onto P's columns: the result (times p for ``op="sum"``); the residual
   ``E = M - approx`` stays on this rank. Steps 1-2 and this one are a fused
   Triton kernel each with ``kernel="triton"`` (`runtime.compression.powersgd_triton`).

The uncompressed part is all-reduced exactly in fp32 (no residual), while the
matrices are worked on. At most 3 all-reduces per call (P, Q, the rest),
whatever the number of tensors.

Bytes on the wire. A call all-reduces ``4 * (sum_i r_i (n_i + m_i) + u)``
bytes of fp32 buffers (``bytes_sent``; P has ``n r`` elements, Q ``m r``, ``u``
uncompressed elements) against ``4 * (sum_i n_i m_i + u)`` uncompressed; a ring
all-reduce sends ``2 (p - 1) / p`` of its buffer from each rank.

>>> PowerSGD(None, Collectives(), rank=4).bytes_sent([(256, 512), (512,)])  # 4 * (4 * (256 + 512) + 512)
14336

Why error feedback. A rank-r projection drops the rest of the gradient every
step, a biased compressor (SGD with it alone does not converge to the same
point). The residual ``E`` carries what was not sent into the next step, so
``approx_t + E_t == G_t + E_{t-1}`` on every rank: over steps everything is sent,
late (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD"). The warm-started
Q turns the single matrix product per step into a power iteration across steps,
tracking the gradient's top-r subspace (Vogels et al.'s "warm start"): a gradient
of rank <= r is sent exactly at once, and with ``r >= min(n, m)`` every matrix is.

Determinism. Every rank ends with bitwise identical results: ``approx`` is
computed from the all-reduced P and Q, which are the same bytes on every rank,
by the same operations (QR, bmm; ranks must run the same torch build and thread
count); the seeded Q is drawn on the CPU. Only the residuals differ per rank.

State (`state`, `state_dict`) is kept per ``key`` (a stable name of the bucket):
residuals and Qs, with the world size and shapes they are for. When either
changes, the key's state is dropped with a warning and it starts fresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import re
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from cost_models.powersgd import POWERSGD_RANK
from runtime.comm.collectives import Collectives
from runtime.device import place

__all__ = ["PowerSGD"]

log = logging.getLogger(__name__)

Kernel = Literal["torch", "triton"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Group:
    """Compressed matrices of one shape ``(n, m)``, worked on as one batch."""

    n: int
    m: int
    r: int  # min(rank, n, m)
    offsets: tuple[int, ...]  # where each matrix starts in x

    @property
    def batch(self) -> int:
        return len(self.offsets)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Layout:
    groups: tuple[_Group, ...]
    rest: tuple[tuple[int, int], ...]  # (offset, numel) of the uncompressed ranges of x, adjacent ones merged

    @property
    def rest_numel(self) -> int:
        return sum(k for _, k in self.rest)


@dataclasses.dataclass
class _KeyState:
    world: int
    shapes: tuple[tuple[int, ...], ...]
    qs: list[torch.Tensor]  # per group (B, m, r)
    residuals: list[torch.Tensor]  # per group (B, n, m); empty without feedback


def _layout(shapes: Sequence[tuple[int, ...]], rank: int, min_compression: float) -> _Layout:
    """Which tensors are compressed (grouped by matrix shape, in order of first appearance) and which are not."""
    groups: dict[tuple[int, int], list[int]] = {}
    rest: list[list[int]] = []
    off = 0
    for shape in shapes:
        numel = math.prod(shape)
        n = shape[0] if len(shape) >= 2 else 0
        m = numel // n if n else 0
        r = min(rank, n, m)
        if len(shape) >= 2 and numel > 0 and n * m >= min_compression * r * (n + m):
            groups.setdefault((n, m), []).append(off)
        elif rest and rest[-1][0] + rest[-1][1] == off:
            rest[-1][1] += numel
        elif numel:
            rest.append([off, numel])
        off += numel
    return _Layout(groups=tuple(_Group(n=n, m=m, r=min(rank, n, m), offsets=tuple(o)) for (n, m), o in groups.items()),
                   rest=tuple((o, k) for o, k in rest))


def _initial_q(seed: int, key: str, g: _Group, device: torch.device) -> torch.Tensor:
    """Random normal ``(B, m, r)``, the same draw for every matrix of the group and on every rank.

    Python's ``hash`` of a str changes per process (PYTHONHASHSEED): the seed is a blake2b digest instead."""
    digest = hashlib.blake2b(repr((seed, key, (g.n, g.m))).encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    q = torch.randn(g.m, g.r, generator=gen)  # (m, r)
    return place(q.expand(g.batch, g.m, g.r).contiguous(), device)  # (B, m, r)


def _check_shapes(x: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"x must be a flat fp32 vector (one bucket), got {x.dtype} of shape {tuple(x.shape)}: "
                         "pass the concatenated gradients, flattened, in fp32")
    shapes = tuple(tuple(int(d) for d in s) for s in shapes)
    if any(d < 0 for s in shapes for d in s):
        raise ValueError(f"shapes {list(shapes)} has a negative dimension")
    total = sum(math.prod(s) for s in shapes)
    if total != x.numel():
        raise ValueError(f"shapes {list(shapes)} hold {total} elements but x has {x.numel()}: pass the shapes of "
                         "exactly the tensors concatenated in x, in order, without padding")
    return shapes


def _encode_shapes(shapes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """int64 ``[count, ndim_0, dims_0..., ndim_1, dims_1..., ...]``."""
    flat = [len(shapes)]
    for s in shapes:
        flat += [len(s), *s]
    return torch.tensor(flat, dtype=torch.int64)


def _decode_shapes(t: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    flat, shapes, i = t.tolist(), [], 1
    for _ in range(flat[0]):
        shapes.append(tuple(flat[i + 1:i + 1 + flat[i]]))
        i += 1 + flat[i]
    return tuple(shapes)


_FIELD = re.compile(r"^(?P<key>.*)/(?:(?P<scalar>world|shapes)|(?P<list>q|residual)/(?P<index>\d+))$")


@dataclasses.dataclass
class PowerSGD:
    """`reduce(x, key, shapes)` -> the mean (or sum) over the group of every rank's x, rank-r matrices on the wire."""

    group: object
    """A torch.distributed process group; None is the default (world) group."""
    collectives: Collectives
    """Every all-reduce goes through it (and is counted there)."""
    rank: int = POWERSGD_RANK
    """r: columns of P and Q; a matrix is sent as ``r (n + m)`` numbers instead of ``n m``."""
    seed: int = 0
    """Seeds the first Q of each key and matrix shape (the same on every rank)."""
    min_compression: float = 2.0
    """A matrix is compressed only if ``n m >= min_compression * r (n + m)`` (torch's ``min_compression_rate``)."""
    feedback: bool = True
    """Error feedback (keep ``M - approx`` and add it next call); False only as a control in tests."""
    kernel: Kernel = "torch"
    """The ``approx = P Q^T``, ``residual = M - approx`` epilogue (and ``M = G + E``, ``P = M Q`` before it): torch
    ops, or the fused Triton kernels of `runtime.compression.powersgd_triton` (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
    state: dict = dataclasses.field(default_factory=dict)
    """key -> the key's residuals and warm-start Qs (see `state_dict`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank={self.rank!r}: PowerSGD sends a rank-r approximation, r must be an int >= 1 "
                             "(torch's default is 1, Vogels et al. use 1-4); to send gradients uncompressed, use a "
                             "plain all-reduce instead")
        if not self.min_compression >= 0:
            raise ValueError(f"min_compression={self.min_compression!r} must be >= 0 (a ratio of elements, "
                             "uncompressed over compressed; torch's default is 2)")
        if self.kernel not in ("torch", "triton"):
            raise ValueError(f"kernel={self.kernel!r}: one of 'torch', 'triton'")

    # ---- the reduction ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def reduce(self, x: torch.Tensor, key: str, shapes: Sequence[tuple[int, ...]], *,
               op: Literal["avg", "sum"] = "avg") -> torch.Tensor:
        """The mean (``op="avg"``) or sum (``"sum"``) over the group of x, a new flat tensor, the same on every rank."""
        if op not in ("avg", "sum"):
            raise ValueError(f"op={op!r}: PowerSGD reduces with 'avg' or 'sum'")
        shapes = _check_shapes(x, shapes)
        x = x.detach().contiguous()
        world = dist.get_world_size(self.group)
        lay = _layout(shapes, self.rank, self.min_compression)
        out = torch.empty_like(x)

        work = rest = None
        if lay.rest:  # exact, in flight while the matrices are worked on
            rest = torch.cat([x[o:o + k] for o, k in lay.rest])
            work = self.collectives.all_reduce(rest, self.group, op=op, async_op=True)

        st = self._state(key, world, shapes, lay, x.device)
        if lay.groups:
            ms, ps = [], []
            for g, grp in enumerate(lay.groups):
                gs = torch.stack([x[o:o + grp.n * grp.m].view(grp.n, grp.m) for o in grp.offsets])  # (B, n, m)
                q = torch.linalg.qr(st.qs[g]).Q.contiguous()  # (B, m, r), orthonormal: P as well-conditioned as M
                m, p = self._prologue(gs, st.residuals[g] if self.feedback else None, q)
                ms.append(m)  # (B, n, m)
                ps.append(p)  # (B, n, r)
            ps = self._mean([p.reshape(-1) for p in ps], [p.shape for p in ps])
            ps = [torch.linalg.qr(p).Q.contiguous() for p in ps]  # (B, n, r), orthonormal columns
            qs = self._mean([torch.bmm(m.transpose(1, 2), p).reshape(-1) for m, p in zip(ms, ps)],
                            [(grp.batch, grp.m, grp.r) for grp in lay.groups])  # (B, m, r) each
            for g, grp in enumerate(lay.groups):
                approx, residual = self._epilogue(ms[g], ps[g], qs[g])  # (B, n, m) each
                if self.feedback:
                    st.residuals[g] = residual
                st.qs[g] = self._revive(qs[g], key, grp)
                if op == "sum":
                    approx *= world
                for b, o in enumerate(grp.offsets):
                    out[o:o + grp.n * grp.m].view(grp.n, grp.m).copy_(approx[b])

        if work is not None:
            work.wait()
            i = 0
            for o, k in lay.rest:
                out[o:o + k] = rest[i:i + k]
                i += k
        return out

    def _mean(self, flats: list[torch.Tensor], shapes: list) -> list[torch.Tensor]:
        """ONE all-reduce of the concatenation, divided by the world size; views of the result, one per shape."""
        buf = torch.cat(flats)
        self.collectives.all_reduce(buf, self.group, op="avg")
        return [t.view(s) for t, s in zip(buf.split([math.prod(s) for s in shapes]), shapes)]

    def _prologue(self, gs: torch.Tensor, residual: torch.Tensor | None,
                  q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``M = G + E``, ``P = M @ Q``."""
        if self.kernel == "triton":
            from runtime.compression.powersgd_triton import powersgd_prologue_triton
            return powersgd_prologue_triton(gs, residual, q)
        m = gs if residual is None else gs + residual
        return m, torch.bmm(m, q)

    def _epilogue(self, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``approx = P @ Q^T``, ``residual = M - approx``."""
        if self.kernel == "triton":
            from runtime.compression.powersgd_triton import powersgd_epilogue_triton
            return powersgd_epilogue_triton(m, p, q, residual_out=m)  # M is ours and not needed after: in place
        approx = torch.bmm(p, q.transpose(1, 2))
        return approx, m - approx

    def _revive(self, q: torch.Tensor, key: str, grp: _Group) -> torch.Tensor:
        """Q for the next call: its all-zero columns drawn again (identically on every rank: Q is)."""
        dead = (q == 0).all(dim=1, keepdim=True)  # (B, 1, r)
        if bool(dead.any()):
            return torch.where(dead, _initial_q(self.seed, key, grp, q.device), q)
        return q

    def _state(self, key: str, world: int, shapes: tuple[tuple[int, ...], ...], lay: _Layout,
               device: torch.device) -> _KeyState:
        st = self.state.get(key)
        if st is not None:
            want_q = [(g.batch, g.m, g.r) for g in lay.groups]
            want_e = [(g.batch, g.n, g.m) for g in lay.groups] if self.feedback else []
            if (st.world, st.shapes) != (world, shapes) or [tuple(q.shape) for q in st.qs] != want_q \
                    or [tuple(e.shape) for e in st.residuals] != want_e:
                log.warning("PowerSGD: state of %r was for %d tensor(s) on %d rank(s), now %d tensor(s) on %d "
                            "rank(s) (shapes, world size, rank or min_compression changed): dropped, starting fresh "
                            "(zero residuals, new random Q)", key, len(st.shapes), st.world, len(shapes), world)
                st = None
        if st is None:
            st = _KeyState(world=world, shapes=shapes,
                           qs=[_initial_q(self.seed, key, g, device) for g in lay.groups],
                           residuals=[torch.zeros(g.batch, g.n, g.m, device=device) for g in lay.groups]
                           if self.feedback else [])
            self.state[key] = st
        st.qs = [place(q, device) for q in st.qs]  # a checkpoint's state is read into host memory
        st.residuals = [place(e, device) for e in st.residuals]
        return st

    def residual(self, key: str) -> torch.Tensor:
        """This rank's residual of ``key`` as a flat vector laid out like its x (0 where nothing is compressed)."""
        if key not in self.state:
            raise KeyError(f"PowerSGD has no state for key {key!r} (known: {sorted(self.state)}): reduce it first")
        st = self.state[key]
        lay = _layout(st.shapes, self.rank, self.min_compression)
        device = st.residuals[0].device if st.residuals else None
        out = torch.zeros(sum(math.prod(s) for s in st.shapes), device=device)
        for grp, e in zip(lay.groups, st.residuals):
            for b, o in enumerate(grp.offsets):
                out[o:o + grp.n * grp.m] = e[b].reshape(-1)
        return out

    # ---- cost and checkpoints -------------------------------------------------------------------------------
    def bytes_sent(self, shapes: Sequence[tuple[int, ...]]) -> int:
        """Bytes of fp32 buffers all-reduced per `reduce` of a bucket of these shapes (P, Q and the rest)."""
        lay = _layout(tuple(tuple(s) for s in shapes), self.rank, self.min_compression)
        return 4 * (sum(g.batch * g.r * (g.n + g.m) for g in lay.groups) + lay.rest_numel)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat, tensors only: ``{key}/world``, ``{key}/shapes`` (int64), ``{key}/q/{i}``, ``{key}/residual/{i}``
        (fp32, per matrix shape i in order of first appearance); copies on the CPU."""
        sd: dict[str, torch.Tensor] = {}
        for key, st in self.state.items():
            sd[f"{key}/world"] = torch.tensor(st.world, dtype=torch.int64)
            sd[f"{key}/shapes"] = _encode_shapes(st.shapes)
            for name, ts in (("q", st.qs), ("residual", st.residuals)):
                for i, t in enumerate(ts):
                    sd[f"{key}/{name}/{i}"] = t.detach().to("cpu", copy=True)
        return sd

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Replace the state with `state_dict`'s. A key whose shapes or world size then differ from a call's is
        dropped at that call, with a warning, and starts fresh."""
        parts: dict[str, dict] = {}
        for name, t in sd.items():
            hit = _FIELD.match(name)
            if hit is None or not isinstance(t, torch.Tensor):
                raise ValueError(f"state_dict entry {name!r} ({type(t).__name__}) is not a PowerSGD state tensor "
                                 "('{key}/world', '{key}/shapes', '{key}/q/{i}' or '{key}/residual/{i}')")
            p = parts.setdefault(hit["key"], {"q": {}, "residual": {}})
            if hit["scalar"]:
                p[hit["scalar"]] = t
            else:
                p[hit["list"]][int(hit["index"])] = t
        state = {}
        for key, p in parts.items():
            if "world" not in p or "shapes" not in p:
                raise ValueError(f"state_dict of key {key!r} lacks '{key}/world' or '{key}/shapes'")
            state[key] = _KeyState(world=int(p["world"]), shapes=_decode_shapes(p["shapes"]),
                                   qs=[p["q"][i].clone() for i in sorted(p["q"])],
                                   residuals=[p["residual"][i].clone() for i in sorted(p["residual"])])
        self.state = state
