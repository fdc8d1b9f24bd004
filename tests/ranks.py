"""What the multi-process tests share: a worker's Gloo group, the spawn that runs the workers, the
data-parallel training loop a rank runs, and the comparison of a launch with one-process training.

A worker is a top-level function worker(rank, world, store_path, out_dir, *args) (spawned processes
unpickle it by its module and name) that saves what the test compares as out_dir/rank{rank}.pt:

    def _worker(rank, world, store_path, out_dir):
        with gloo_group(rank, world, store_path):
            torch.save(run(rank), Path(out_dir) / f"rank{rank}.pt")

    results = spawn(_worker, 4, tmp_path)   # or the `spawned` fixture, once per module and world

Test modules import it by its bare name, as they import each other: pytest puts tests/ on sys.path
(there is no tests/__init__.py), and spawned processes start with the parent's sys.path.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.launch.local import fork_context

__all__ = ["init_gloo", "gloo_group", "group_teardown", "spawn", "free_port",
           "pattern_batches", "data_parallel_steps", "adam_atol", "assert_trains_like"]


def init_gloo(rank: int, world: int, store: str | os.PathLike | dist.Store, timeout_s: float = 120) -> None:
    """Join the default Gloo group through a FileStore at `store` (a path) or through `store` itself."""
    # One thread a rank: the ranks of a world share the machine's cores, and more threads only contend.
    torch.set_num_threads(1)
    if isinstance(store, (str, os.PathLike)):
        store = dist.FileStore(str(store), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


@contextlib.contextmanager
def group_teardown() -> Iterator[None]:
    """Leave the default group when the block ends, for a group initialised elsewhere (runtime.Trainer)."""
    try:
        yield
        dist.barrier()  # nobody tears Gloo down while a peer is still in its last collective
    finally:
        # Collect reference cycles while the group lives: without this about 1 in 30 processes
        # aborted at interpreter exit ("terminate called without an active exception", after
        # destroy_process_group and every result saved); with it 0 in 60.
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def gloo_group(rank: int, world: int, store: str | os.PathLike | dist.Store,
               timeout_s: float = 120) -> Iterator[None]:
    """The default Gloo group for the block (init_gloo), torn down when it ends (group_teardown)."""
    init_gloo(rank, world, store, timeout_s)
    with group_teardown():
        yield


def spawn(worker: Callable[..., None], world: int, tmp: str | os.PathLike, *args: Any) -> list[Any]:
    """Run worker(rank, world, tmp/"store", tmp, *args) in `world` new processes, and return what each rank
    saved as tmp/rank{rank}.pt (None for a rank that saved nothing). A worker that fails raises here
    (torch.multiprocessing.ProcessRaisedException, or ProcessExitedException for a crash)."""
    tmp = Path(tmp)
    # Not fork: a forked child inherits this process's threads (torch's pools, Gloo's) in whatever state they
    # were, and may hang on a lock one of them held. launch_local's fork server holds no threads and has
    # torch and the modules conftest preloads imported: a child starts in a fraction of a second, where a
    # spawned one imports torch for seconds. It forks with the server's environment: the child takes ours.
    method = fork_context().get_start_method()
    mp.start_processes(_in_environ, args=(dict(os.environ), worker, world, str(tmp / "store"), str(tmp), *args),
                       nprocs=world, start_method=method)
    paths = [tmp / f"rank{r}.pt" for r in range(world)]
    return [torch.load(p, weights_only=False) if p.exists() else None for p in paths]


def _in_environ(rank: int, environ: dict[str, str], worker: Callable[..., None], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(environ)
    worker(rank, *args)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pattern_batches(seed: int, steps: int, batch: int = 8, seq: int = 32,
                    vocab: int = 1024) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of next-token (inputs, targets), `batch` rows of `seq` tokens."""
    g = torch.Generator().manual_seed(seed)
    # a learnable stream: each sequence repeats a short random pattern, so the loss falls quickly
    out = []
    for _ in range(steps):
        pattern = torch.randint(0, vocab, (batch, 4), generator=g)
        tokens = pattern.repeat(1, seq // 4 + 1)[:, :seq + 1]
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def data_parallel_steps(engine, optimizer: torch.optim.Optimizer, collectives, loss_fn: Callable,
                        batches) -> list[float]:
    """One step of runtime.engines.data_parallel.DataParallel `engine` per global batch, on this rank's rows of
    it (the default group's ranks split the batch); each step's loss averaged over the ranks, as one process
    on the whole batch reports it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for x, y in batches:
        rows = x.shape[0] // world
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        loss = loss_fn(engine.module(x), y)
        loss.backward()
        engine.finish_gradients()
        optimizer.step()
        engine.after_step()
        engine.zero_grad()
        optimizer.zero_grad(set_to_none=True)
        t = loss.detach().reshape(1)
        collectives.all_reduce(t, op="avg")
        losses.append(t.item())
    return losses


# The rounding noise of a gradient element's reduction: a few ulp of its summands (|summand| up to ~1e-2 in
# these tiny models; ulp(1e-2) = 9.3e-10 in fp32). Where the gradient is near zero in exact arithmetic,
# AdamW's step lr * m / (sqrt(v) + eps) turns that noise into a step of up to lr * noise / eps, which
# one process and the ranks (another summation order) take differently. The bound depends on the CPU's
# kernels: an element that agreed to 7e-7 on one machine differed by 1.4e-6 on another after 3 steps.
_GRAD_NOISE = 3e-9


def adam_atol(steps: int) -> float:
    """The per-element tolerance of parameters after `steps` of examples.training.adamw: fp32 rounding (1e-6)
    plus the noise step lr * noise / eps of every step. Compare with SGD (linear in the gradient) to hold
    every element to 1e-6."""
    from examples.training import ADAMW_EPS, ADAMW_LR

    return 1e-6 + steps * ADAMW_LR * _GRAD_NOISE / ADAMW_EPS


def assert_trains_like(out, losses: list[float], state: dict[str, torch.Tensor], *, adam_steps: int = 0) -> None:
    """`out` (runtime.launch_local's result) has one process's losses and final parameters `state`, but for
    fp32 rounding (the ranks sum in another order). `adam_steps`: how many steps of examples.training.adamw
    made `state` (0 for SGD): each widens the parameters' tolerance by Adam's noise step (adam_atol)."""
    torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    atol = adam_atol(adam_steps) if adam_steps else 1e-6
    for k, v in state.items():
        torch.testing.assert_close(out.state_dict[k], v, rtol=1e-5, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def assert_plan_trains_like_one_process(plan, model_fn: Callable, optimizer_fn: Callable, loss_fn: Callable,
                                        data: list, *, timeout_s: float = 180):
    """Run `plan` on real Gloo processes (runtime.launch_local) and check it trains as one process does on the
    same data (examples.training.train_one_process): the same parameter names, losses and final parameters
    (`assert_trains_like`, SGD tolerances). A plan whose model computes a router's load-balancing loss with
    several microbatches a step computes it per microbatch, as it states (Plan.load_balancing_loss): one
    process then runs the same global microbatches, accumulating gradients. Returns launch_local's result."""
    from examples.training import train_one_process
    from runtime import launch_local

    out = launch_local(plan, model_fn, optimizer_fn, loss_fn, data, timeout_s=timeout_s)
    c = plan.config
    per_microbatch = dict(dp=c.dp, num_microbatches=c.num_microbatches) if plan.load_balancing_loss else {}
    trained = train_one_process(model_fn, optimizer_fn, loss_fn, data, **per_microbatch)
    assert sorted(out.state_dict) == sorted(trained.model.state_dict())
    assert_trains_like(out, trained.losses, trained.model.state_dict())
    return out
