"""The user's optimizer over what a rank steps: its per-parameter choices kept, or refused where they cannot be.

A program builds its optimizer as ``optimizer_fn(params)``, where ``params`` are what the engine steps. Where
those are the model's parameters whole (pipeline stages, DDP, fp32 masters of the same shapes) the user's
optimizer sees what it would see in one process, and nothing here changes it. Two kinds of plan hand it
something else, and there an optimizer can silently train differently from one process:

- **ZeRO-1/2/3 steps flat shards**: each a 1-D slice of parameters laid end to end, cutting through them. An
  ``optimizer_fn`` that puts parameters in groups with their own hyperparameters (nanoGPT's
  ``p.dim() >= 2`` decays, the rest do not) would see only 1-D tensors and put everything in one group.
  `make_optimizer` asks ``optimizer_fn`` for its groups on stand-ins of the real parameters (their shapes,
  dtypes and devices, one element of memory each), and where they differ it steps, for each group, the runs of
  each shard that lie in that group's parameters (views of the shard, their gradients views of the shard's
  gradient), with that group's hyperparameters. Parameters the optimizer was not given are not stepped, as in
  one process.
- **Any split parameter** (flat shards, tensor-parallel slices, expert slices) is stepped in pieces. That is
  exact only for an optimizer whose update of an element depends on that element alone (SGD, Adam, AdamW,
  Adagrad, RMSprop, ...). One that reads the whole tensor (LAMB's and LARS' per-tensor trust ratio,
  Adafactor's factored second moment, Muon's orthogonalisation) would step each piece as if it were the
  tensor. `make_optimizer` checks this on a small parameter stepped whole and as two blocks of rows, and
  refuses a plan that splits parameters for an optimizer whose two updates differ, saying what to change.

Checkpoints (runtime.checkpoint) save an optimizer's state per shard; an optimizer stepping runs of shards
is refused there, before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from cost_models.placements import is_sharded

__all__ = ["OptimizerError", "check_optimizer", "differing_groups", "make_optimizer", "segments_of",
           "slices_parameters"]

_SEGMENTS = "_partitioner_segments"  # the attribute an optimizer stepping runs of shards carries


class OptimizerError(ValueError):
    """optimizer_fn's optimizer cannot step what this plan gives it and train as one process would."""


def make_optimizer(optimizer_fn: Callable, engine: Any, *, extra: Sequence[torch.Tensor] = (),
                   sliced: bool = False) -> torch.optim.Optimizer:
    """The optimizer a program steps: ``optimizer_fn`` over ``engine.optimizer_params()`` and `extra` (whole
    tensors stepped beside them: a pipeline stage's tied copies).

    sliced: the plan splits parameters between ranks (tensor-parallel or expert slices), so even a whole
    holder is a piece of its parameter. Flat shards (ZeRO) are found from ``engine.master_pieces()``.
    """
    params = [*engine.optimizer_params(), *extra]
    mine = {id(p) for p in params}
    pieces = [(h, ranges) for h, ranges in engine.master_pieces() if id(h) in mine]
    flat = [(h, ranges) for h, ranges in pieces if not _whole(h, ranges)]
    if not flat and not sliced:
        return optimizer_fn(params)
    _check_elementwise(optimizer_fn, why=_why_split(zero=bool(flat)), device=params[0].device if params else None)
    if not flat:
        return optimizer_fn(params)
    probe, order = _groups(optimizer_fn, _standins(pieces, extra))
    if probe is None:
        return optimizer_fn(params)
    return _segmented(probe, order, pieces, extra)


def slices_parameters(tp: int, ep: int, specs: Sequence[str]) -> bool:
    """Whether a plan gives ranks slices of parameters: tensor-parallel placements (`specs`, one per parameter)
    that shard some parameter, or expert parallelism (each rank holds its experts' slice)."""
    return (tp > 1 and any(is_sharded(s) for s in specs)) or ep > 1


def check_optimizer(optimizer_fn: Callable, *, zero_stage: int, sliced: bool) -> None:
    """What make_optimizer checks on every rank, for a launcher to check once before it starts any: under a plan
    that steps parameters in pieces (ZeRO flat shards, `sliced`: tensor-parallel or expert slices),
    optimizer_fn's optimizer must step a parameter's pieces as it steps the whole (raises OptimizerError)."""
    if zero_stage > 0 or sliced:
        _check_elementwise(optimizer_fn, why=_why_split(zero=zero_stage > 0), device=None)


def segments_of(optimizer: torch.optim.Optimizer) -> tuple | None:
    """The runs of shards `optimizer` steps as their own tensors, (segment, holder, start, stop) each; None
    where it steps the holders themselves."""
    return getattr(optimizer, _SEGMENTS, None)


def _whole(holder: torch.Tensor, ranges) -> bool:
    """The holder is one parameter, all of it, in its own shape."""
    if len(ranges) != 1:
        return False
    _name, shape, a, b, at = ranges[0]
    return a == 0 and at == 0 and b == holder.numel() and tuple(holder.shape) == tuple(shape)


def _why_split(*, zero: bool) -> str:
    if zero:
        return "the plan's ZeRO shards step each parameter as pieces of flat 1-D buffers"
    return "the plan's tensor-parallel or expert slices step each parameter as pieces on several ranks"


# ---- elementwise check -------------------------------------------------------------------------------------

def _check_elementwise(optimizer_fn: Callable, *, why: str, device: torch.device | None) -> None:
    """Refuse an optimizer whose step on a parameter differs from its step on that parameter's two halves."""
    dev = device if device is not None and device.type != "meta" else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    rows, cols = 8, 6
    w0 = torch.randn(rows, cols, generator=g)
    scale = torch.cat([torch.full((rows // 2, 1), 10.0), torch.full((rows - rows // 2, 1), 0.1)])
    grads = [torch.randn(rows, cols, generator=g) * scale for _ in range(3)]  # halves far apart in size
    whole = nn.Parameter(w0.clone().to(dev))
    halves = [nn.Parameter(w0[:rows // 2].clone().to(dev)), nn.Parameter(w0[rows // 2:].clone().to(dev))]
    try:
        one, two = optimizer_fn([whole]), optimizer_fn(halves)
        for gr in grads:
            whole.grad = gr.to(dev).clone()
            halves[0].grad, halves[1].grad = gr[:rows // 2].to(dev).clone(), gr[rows // 2:].to(dev).clone()
            one.step()
            two.step()
    except Exception as e:
        raise OptimizerError(
            f"could not check that optimizer_fn's optimizer steps a split parameter as it steps the whole one "
            f"({why}): stepping a {rows}x{cols} test parameter raised {type(e).__name__}: {str(e)[:200]}; "
            f"an optimizer that cannot step plain dense tensors cannot be split either: use zero_stage=0 and "
            f"tp=1 (ep=1), where each rank steps whole parameters") from e
    with torch.no_grad():
        step_one = (whole.detach() - w0.to(dev)).float()
        step_two = (torch.cat([h.detach() for h in halves]) - w0.to(dev)).float()
    if not torch.allclose(step_two, step_one, rtol=1e-4, atol=1e-6 * float(step_one.abs().max()) + 1e-12):
        name = type(one).__name__
        raise OptimizerError(
            f"optimizer_fn's {name} does not step a parameter's pieces as it steps the whole parameter: on a "
            f"{rows}x{cols} test parameter its update differs by up to "
            f"{float((step_two - step_one).abs().max()):.3g} when the parameter is given as two blocks of rows "
            f"(an update that reads the whole tensor: a per-tensor norm or trust ratio as in LAMB and LARS, a "
            f"factored moment as in Adafactor, an orthogonalisation as in Muon); {why}, so {name} would train "
            f"differently from one process. Use zero_stage=0 and tp=1 (ep=1) with {name}, where each rank steps "
            f"whole parameters (pipeline stages and plain data parallelism keep them whole), or an elementwise "
            f"optimizer (SGD, Adam, AdamW, Adagrad, RMSprop) with this plan")


# ---- parameter groups --------------------------------------------------------------------------------------

def _standins(pieces, extra: Sequence[torch.Tensor]) -> dict[str | int, nn.Parameter]:
    """A stand-in (`_standin`) of each parameter the pieces belong to (by name) and of each `extra` tensor (by
    index), in the order the engine lists them."""
    likes: dict[str | int, tuple[tuple[int, ...], torch.Tensor]] = {}
    tied = {id(t) for t in extra}
    for h, ranges in pieces:
        if id(h) not in tied:
            for name, shape, *_ in ranges:
                likes.setdefault(name, (tuple(shape), h))
    for k, t in enumerate(extra):
        likes[k] = (tuple(t.shape), t)
    return {n: _standin(shape, like.dtype, like.device) for n, (shape, like) in likes.items()}


def _standin(shape: Sequence[int], dtype: torch.dtype = torch.float32, device: Any = "cpu") -> nn.Parameter:
    """A parameter of this shape, dtype and device holding one element (a stride-0 view): what optimizer_fn
    reads to choose its groups, without the memory."""
    return nn.Parameter(torch.empty((), dtype=dtype, device=device).expand(tuple(shape)))


def differing_groups(optimizer_fn: Callable, shapes: Mapping[str, Sequence[int]]) -> bool:
    """Whether optimizer_fn gives parameters of these shapes (fp32) groups with different hyperparameters, or
    leaves some out: what makes make_optimizer step runs of ZeRO shards."""
    standins = {n: _standin(s) for n, s in shapes.items()}
    return _groups(optimizer_fn, standins)[0] is not None


def _groups(optimizer_fn: Callable, standins: Mapping[str | int, nn.Parameter]
            ) -> tuple[torch.optim.Optimizer | None, dict[str | int, int]]:
    """optimizer_fn's optimizer over the stand-ins, and the group of each stand-in's key; the optimizer None where
    one set of hyperparameters covers every parameter (the shards can then be stepped as one group)."""
    probe = optimizer_fn(list(standins.values()))
    of = {id(p): i for i, grp in enumerate(probe.param_groups) for p in grp["params"]}
    order = {n: of[id(p)] for n, p in standins.items() if id(p) in of}
    hyper = [{k: v for k, v in grp.items() if k != "params"} for grp in probe.param_groups]
    used = sorted(set(order.values()))
    if len(order) == len(standins) and all(_same(hyper[used[0]], hyper[i]) for i in used[1:]):
        return None, order
    return probe, order


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if torch.is_tensor(x) or torch.is_tensor(y):
            if not (torch.is_tensor(x) and torch.is_tensor(y) and x.shape == y.shape and bool(torch.equal(x, y))):
                return False
        elif x != y:
            return False
    return True


def _segmented(probe: torch.optim.Optimizer, order: dict[str | int, int], pieces, extra: Sequence[torch.Tensor]
               ) -> torch.optim.Optimizer:
    """optimizer_fn's own optimizer (built over stand-ins, so still without state) with group i stepping the
    runs of every holder that lie in parameters of group i (whole holders: themselves)."""
    per_group: list[list[torch.Tensor]] = [[] for _ in probe.param_groups]
    segments = []
    tied = {id(t) for t in extra}
    for h, ranges in pieces:
        if id(h) in tied:
            continue
        if _whole(h, ranges):
            i = order.get(ranges[0][0])
            if i is not None:
                per_group[i].append(h)
            continue
        run = None  # (group, start, stop) within the holder's flattening
        for name, _shape, a, b, at in sorted(ranges, key=lambda r: r[4]):
            i = order.get(name)
            if run is not None and run[0] == i and run[2] == at:
                run = (i, run[1], at + b - a)
                continue
            if run is not None and run[0] is not None:
                segments.append((run[0], h, run[1], run[2]))
            run = (i, at, at + b - a)
        if run is not None and run[0] is not None:
            segments.append((run[0], h, run[1], run[2]))
    views = []
    for i, h, lo, hi in segments:
        seg = nn.Parameter(h.detach().view(-1)[lo:hi])  # shares the holder's storage: the step updates it
        per_group[i].append(seg)
        views.append((seg, h, lo, hi))
    for k, t in enumerate(extra):  # tied copies: whole parameters the stage holds, in the group the probe gave them
        if order.get(k) is not None:
            per_group[order[k]].append(t)
    if probe.state:
        raise OptimizerError(
            f"optimizer_fn puts parameters in groups with different hyperparameters, and under ZeRO each group "
            f"steps its own runs of the flat shards; its {type(probe).__name__} made state for its parameters when "
            f"it was built, so they cannot be exchanged for the runs: use zero_stage=0, or one set of "
            f"hyperparameters for every parameter")
    for grp, ps in zip(probe.param_groups, per_group):
        grp["params"] = ps
    probe.param_groups = [grp for grp in probe.param_groups if grp["params"]]
    opt = probe

    def grads(_opt, _args, _kwargs) -> None:  # the shards' gradients are set anew each step
        for seg, h, lo, hi in views:
            seg.grad = None if h.grad is None else h.grad.view(-1)[lo:hi]

    opt.register_step_pre_hook(grads)
    setattr(opt, _SEGMENTS, tuple(views))
    return opt
