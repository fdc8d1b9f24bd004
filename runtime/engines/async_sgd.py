"""Asynchronous data parallelism: local SGD (every=k) and bounded-staleness averaging (staleness=s).

Each replica holds the whole model in fp32 and steps its own optimizer on
its own gradients (its rows of the global batch, as microbatches); replicas
meet only by averaging parameters, over the data-parallel group:

every=k, local SGD (Lin et al. 2020, "Don't use large mini-batches, use local
    SGD"): after every k-th optimizer step, one blocking all-reduce (avg) of
    the parameters, one flat buffer per dtype. torch's `PostLocalSGDOptimizer`
    with `PeriodicModelAverager(period=k, warmup_steps=k - 1)` is its oracle
    (torch counts steps from 0 and first averages at step `warmup_steps`).
    With k = 1 and SGD (momentum and weight decay included: both are linear
    in the gradient) it equals synchronous training up to fp32 rounding.

staleness=s: the replicas keep agreed parameters x, bitwise equal on every
    replica. Each step, a replica's update d = (parameters after its optimizer
    step) - (before) is all-reduced asynchronously (`async_op=True`) and waited
    for s steps later, when x += avg(d). In between, a replica trains on
    p = x + (its own updates still in flight, at most s), so replicas differ by
    at most their last s local updates and every update counts exactly once in
    x. Deterministic given the data: the values are fixed at launch. s = 0 is
    every=1. Why updates and not snapshots of the parameters: with
    p += avg(snapshot) - snapshot, each of the s snapshots in flight sees the
    same disagreement and corrects it again, overshooting; for s >= 2 the
    replicas never settle.

Optimizer state (momentum, Adam's moments) stays each replica's own: it is
never averaged nor reset, as in torch's PostLocalSGDOptimizer, so it follows
the replica's own gradients. `clip_grad_norm` clips each replica's gradients
by their local norm. Buffers (BatchNorm statistics) are broadcast from the
group's first rank at construction, with the parameters, and never averaged
(as `DataParallel`).

A program builds the runner with `runtime.comm.collectives.Collectives()` over its process group. Here
two replicas run as two threads of one process, whose collectives meet in memory (the in-process
group plan.verify uses, runtime.verify.local_collectives):

>>> import threading
>>> import torch
>>> from runtime.engines.unreplicated import Unreplicated
>>> from runtime.verify.local_collectives import LocalCollectives, LocalGroup
>>> class InMemory(LocalCollectives):
...     def broadcast_tensors(self, tensors, src, group):
...         pass                      # both replicas are built from one seed: nothing to send
>>> def seeded():
...     torch.manual_seed(0)
...     return torch.nn.Linear(4, 1)
>>> models = [seeded(), seeded()]
>>> x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.ones(8, 1)
>>> mse, group, losses, states = torch.nn.functional.mse_loss, LocalGroup(2), {}, {}
>>> def rank_main(rank):
...     model = models[rank]
...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
...     runner = AsyncSGDRunner(engine=Unreplicated(model), optimizer=opt, loss_fn=mse, collectives=InMemory(rank),
...                             dp_group=group, dp_ranks=(0, 1), dp_rank=rank, microbatch_size=4, num_microbatches=1,
...                             clip_grad_norm=None, program_hash="", async_sgd={"every": 4})
...     losses[rank] = [runner.step((x, y)) for _ in range(2)]   # global mean loss, on every rank
...     runner.sync_now(); states[rank] = runner.full_state_dict()   # collectives: every rank calls them
>>> threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in (0, 1)]
>>> for t in threads: t.start()
>>> for t in threads: t.join()
>>> losses[0] == losses[1], [round(loss, 3) for loss in losses[0]]
(True, [2.266, 0.971])
>>> sorted(states[0]), states[1]      # the averaged model on the group's first rank
(['bias', 'weight'], None)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from runtime.comm.collectives import Collectives
from runtime.device import place, rank_device
from runtime.engines.evaluation import evaluating
from runtime.engines.step import PeakHeld, _call, replica_microbatches
from runtime.engines.token_loss import PerToken
from runtime.engines.unreplicated import Unreplicated

__all__ = ["AsyncSGDRunner"]


class _Flat:
    """Parameters of one dtype seen as one flat buffer: what each averaging all-reduce sends."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.numels = [p.numel() for p in params]

    def gather(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    @torch.no_grad()
    def scatter(self, flat: torch.Tensor) -> None:
        for p, piece in zip(self.params, torch.split(flat, self.numels)):
            p.copy_(piece.view_as(p))


@dataclasses.dataclass
class _InFlight:
    """One step's update: this replica's own (`delta`) and the all-reduce averaging it (`reduced`, `work`)."""

    delta: list[torch.Tensor]  # per flat
    reduced: list[torch.Tensor]
    work: list[Any]


def _wait(u: _InFlight) -> None:
    """Wait for an update's all-reduces (once: a waited update keeps no work)."""
    for w in u.work:
        w.wait()
    u.work = []


class AsyncSGDRunner:
    """The object an async SGD program's `build()` returns: `runtime.engines.step.StepRunner`'s contract.

    step(batch) -> the global mean loss on every rank; predict(inputs): this replica's forward (its own
    parameters, which differ from the others' between averagings); full_state_dict(): collective, the
    parameters averaged over the replicas (no replica's parameters change) and rank 0's buffers, on the
    group's first rank, None elsewhere: one model; sync_now(): collective, averages the parameters in
    place now (the end of training calls it; a checkpoint does not: runtime.checkpoint saves each
    replica as it is, with consensus() and replica_state()); held_bytes(); collectives; program_hash;
    engine (a `runtime.engines.unreplicated.Unreplicated`); optimizer.
    """

    def __init__(self, *, engine: Unreplicated, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                 collectives: Collectives, dp_group, dp_ranks: tuple[int, ...], dp_rank: int, microbatch_size: int,
                 num_microbatches: int, clip_grad_norm: float | None, program_hash: str,
                 async_sgd: Mapping[str, int]):
        mode = dict(async_sgd)
        if len(mode) != 1 or not ({"every", "staleness"} & set(mode)):
            raise ValueError(f"async_sgd={mode!r}: pass {{'every': k}} (local SGD) or {{'staleness': s}}")
        (self.mode, self.k), = mode.items()
        if self.k < (1 if self.mode == "every" else 0):
            raise ValueError(f"async_sgd={mode!r}: every must be >= 1, staleness >= 0")
        if len(dp_ranks) < 2:
            raise ValueError(f"dp_ranks={tuple(dp_ranks)}: async SGD averages replicas and needs at least two")
        if isinstance(loss_fn, PerToken):
            raise ValueError("a per_token loss averages over every token of the global batch, and async SGD steps "
                             "each replica on its own rows: pass the loss function itself (loss_fn.loss_fn)")
        self.engine, self.optimizer, self.loss_fn = engine, optimizer, loss_fn
        self.collectives, self.dp_group, self.dp_ranks = collectives, dp_group, tuple(dp_ranks)
        self.dp_rank, self.dp_size = dp_rank, len(dp_ranks)
        self.microbatch_size, self.num_microbatches = microbatch_size, num_microbatches
        self.clip_grad_norm, self.program_hash = clip_grad_norm, program_hash
        self.async_sgd = mode
        self.last_grad_norm: float | None = None
        self.lr_schedule = None  # runtime.engines.lr_schedule: stepped after each optimizer step
        self.steps = 0
        self._broadcast_state()
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in engine.optimizer_params():
            by_dtype.setdefault(p.dtype, []).append(p)
        self._flats = [_Flat(ps) for ps in by_dtype.values()]
        # staleness: the agreed parameters (bitwise equal on every replica) and the updates in flight, oldest first
        self._agreed = [f.gather() for f in self._flats] if self.mode == "staleness" else []
        self._pending: list[_InFlight] = []
        self._peak = PeakHeld()

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        """Every replica starts from the group's first rank's parameters and buffers (as DataParallel does)."""
        module = self.engine.module
        tensors = [*dict(module.named_parameters()).values(), *(b for _, b in module.named_buffers())]
        self.collectives.broadcast_tensors(tensors, src=self.dp_ranks[0], group=self.dp_group)

    # ---- training ----------------------------------------------------------------------------
    def step(self, batch: tuple[Any, Any]) -> float:
        m = self.num_microbatches
        total = torch.zeros((), dtype=torch.float64, device=rank_device())
        for x, y in replica_microbatches(batch, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                         microbatch_size=self.microbatch_size, num_microbatches=m):
            x, y = place((x, y))  # only this replica's rows travel to the device
            loss = self.loss_fn(_call(self.engine.module, x), y)
            (loss / m).backward()  # local gradients only: nothing is reduced
            total += loss.detach().double()
        if self.clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.engine.optimizer_params(), self.clip_grad_norm)
            self.last_grad_norm = float(norm)
        before = [f.gather() for f in self._flats] if self.mode == "staleness" else []
        self.optimizer.step()
        if self.lr_schedule is not None:
            self.lr_schedule.step()
        self._peak.note(self.held_bytes_now())
        self.engine.zero_grad()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        if self.mode == "every":
            if self.steps % self.k == 0:
                self._average()
        else:
            self._launch(before)
            while len(self._pending) > self.k:
                self._apply_oldest()
            self._install()
        # The global loss: the mean over replicas of each replica's mean over its microbatches.
        mean = (total / m).to(torch.float32).reshape(1)
        self.collectives.all_reduce(mean, self.dp_group, op="avg")
        return float(mean.item())

    def evaluate(self, batch: tuple[Any, Any]) -> float:
        """Collective: the global mean loss on `batch` of the common model (the replicas' average, which
        full_state_dict returns; no replica's own parameters change) as one process computes it under
        `model.eval()` and `torch.no_grad()` (runtime.engines.evaluation)."""
        m = self.num_microbatches
        total = torch.zeros((), dtype=torch.float64, device=rank_device())
        with self.consensus_installed(), evaluating([self.engine.module]):
            for x, y in replica_microbatches(batch, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                             microbatch_size=self.microbatch_size, num_microbatches=m):
                x, y = place((x, y))
                total += self.loss_fn(_call(self.engine.module, x), y).double()
        mean = (total / m).to(torch.float32).reshape(1)
        self.collectives.all_reduce(mean, self.dp_group, op="avg")
        return float(mean.item())

    @torch.no_grad()
    def _average(self) -> None:
        """Blocking: every replica's parameters become the group's mean."""
        for f in self._flats:
            flat = f.gather()
            self.collectives.all_reduce(flat, self.dp_group, op="avg")
            f.scatter(flat)

    @torch.no_grad()
    def _launch(self, before: list[torch.Tensor]) -> None:
        delta = [f.gather().sub_(b) for f, b in zip(self._flats, before)]
        reduced = [d.clone() for d in delta]  # in flight until waited for: nothing else touches it
        work = [self.collectives.all_reduce(r, self.dp_group, op="avg", async_op=True) for r in reduced]
        self._pending.append(_InFlight(delta=delta, reduced=reduced, work=work))

    @torch.no_grad()
    def _apply_oldest(self) -> None:
        """Wait for the oldest update's all-reduce and fold its average into the agreed parameters."""
        done = self._pending.pop(0)
        _wait(done)
        for x, r in zip(self._agreed, done.reduced):
            x.add_(r)

    @torch.no_grad()
    def _install(self) -> None:
        """This replica's parameters: the agreed ones plus its own updates still in flight."""
        for i, f in enumerate(self._flats):
            p = self._agreed[i].clone()
            for u in self._pending:
                p.add_(u.delta[i])
            f.scatter(p)

    def sync_now(self) -> None:
        """Collective (every rank calls it, in the same order): average the parameters now. every=k: an
        all-reduce; staleness: wait for every update in flight and apply it, leaving the agreed parameters.
        Optimizer state stays as it is; the every=k step count is not reset."""
        if self.mode == "every":
            self._average()
            return
        while self._pending:
            self._apply_oldest()
        self._install()

    # ---- checkpoints (runtime.checkpoint) ------------------------------------------------------
    @torch.no_grad()
    def consensus(self) -> list[torch.Tensor]:
        """Collective: the replicas' common model (one flat per dtype), changing no replica. every=k: the
        mean of the replicas' parameters; staleness: the agreed parameters with every update in flight
        applied, in the order sync_now() would apply them."""
        if self.mode == "every":
            out = [f.gather() for f in self._flats]
            for t in out:
                self.collectives.all_reduce(t, self.dp_group, op="avg")
            return out
        out = [a.clone() for a in self._agreed]
        for u in self._pending:
            _wait(u)
            for x, r in zip(out, u.reduced):
                x.add_(r)
        return out

    def replica_state(self) -> dict[str, torch.Tensor]:
        """This replica's own state beyond its optimizer's: its parameters, its place in the every=k period,
        and under staleness the agreed parameters and the updates in flight (waited for: their averages are
        final, and waiting early changes no value). With it a resumed run continues as if never stopped."""
        sd = {"steps": torch.tensor(self.steps), "pending": torch.tensor(len(self._pending))}
        for i, f in enumerate(self._flats):
            sd[f"param/{i}"] = f.gather()
        for i, a in enumerate(self._agreed):
            sd[f"agreed/{i}"] = a.clone()
        for j, u in enumerate(self._pending):
            _wait(u)
            for i, (d, r) in enumerate(zip(u.delta, u.reduced)):
                sd[f"pending/{j}/delta/{i}"], sd[f"pending/{j}/reduced/{i}"] = d.clone(), r.clone()
        return sd

    @torch.no_grad()
    def load_replica_state(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Undo after_load(): become the replica replica_state() saved (same plan, same replica)."""
        for i, f in enumerate(self._flats):
            f.scatter(sd[f"param/{i}"])
        if self.mode == "staleness":  # a checkpoint is read into host memory: back onto the parameters' device
            self._agreed = [place(sd[f"agreed/{i}"]).clone() for i in range(len(self._flats))]
            self._pending = [_InFlight(delta=[place(sd[f"pending/{j}/delta/{i}"]).clone()
                                              for i in range(len(self._flats))],
                                       reduced=[place(sd[f"pending/{j}/reduced/{i}"]).clone()
                                                for i in range(len(self._flats))], work=[])
                             for j in range(int(sd["pending"]))]
        self.steps = int(sd["steps"])

    @contextlib.contextmanager
    def consensus_installed(self) -> Iterator[None]:
        """Collective: inside, this replica's parameters are the common model; after, its own again."""
        own = [f.gather() for f in self._flats]
        for f, c in zip(self._flats, self.consensus()):
            f.scatter(c)
        try:
            yield
        finally:
            for f, o in zip(self._flats, own):
                f.scatter(o)

    @torch.no_grad()
    def after_load(self) -> None:
        """The parameters were just overwritten (runtime.checkpoint loads into a fresh runner, then calls this):
        make them the agreed parameters and forget any update in flight. Local, no collective: every replica
        loads the same (averaged) parameters. The every=k count restarts here."""
        for u in self._pending:
            _wait(u)  # nothing may still write into a buffer about to be dropped
        self._pending.clear()
        if self.mode == "staleness":
            self._agreed = [f.gather() for f in self._flats]  # a copy: torch.cat allocates
        self.steps = 0

    # ---- the program contract ------------------------------------------------------------------
    def predict(self, inputs: Any) -> Any:
        """This replica's forward on `inputs` in eval mode, no gradients (its own parameters; call sync_now()
        first for the average)."""
        with evaluating([self.engine.module]):
            return _call(self.engine.module, place(inputs))

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective. The parameters averaged over the replicas (no replica's own change) under
        model.state_dict()'s keys, with the first rank's buffers, on the group's first rank; None elsewhere."""
        mean: dict[int, torch.Tensor] = {}
        for f in self._flats:
            flat = f.gather()
            self.collectives.all_reduce(flat, self.dp_group, op="avg")
            mean.update((id(p), v.view_as(p).clone()) for p, v in zip(f.params, torch.split(flat, f.numels)))
        if self.dp_rank != 0:
            return None
        module = self.engine.module
        out = self.engine.full_state_dict()
        for name, p in module.named_parameters(remove_duplicate=False):  # tied names share one parameter
            if id(p) in mean:
                out[name] = mean[id(p)]
        return {k: v.cpu() for k, v in out.items()}  # host copies: what a launcher saves or returns

    def held_bytes_now(self) -> dict[str, int]:
        held = self.engine.held_bytes(self.optimizer)
        extra = sum(t.numel() * t.element_size() for t in [*self._agreed, *(x for u in self._pending
                                                                              for x in (*u.delta, *u.reduced))])
        return {**held, "averaging": extra, "total": held["total"] + extra}

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state at this rank's peak so far; "averaging": the
        flat buffers staleness keeps (agreed parameters, updates in flight) at that peak."""
        return self._peak.note(self.held_bytes_now())

