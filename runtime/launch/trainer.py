"""`Trainer`: run a plan inside your own training loop (under torchrun, mpirun or SLURM).

    trainer = Trainer(plan, model_fn, optimizer_fn, loss_fn)   # plan: a Plan or a directory from write_programs
    # scheduler_fn=lambda opt: LambdaLR(opt, ...): each rank's scheduler, stepped after each optimizer step
    for batch in loader:                                       # global batches: (inputs, targets)
        loss = trainer.step(batch)
    val = trainer.evaluate(held_out)                           # eval mode, no update: a collective on every rank
    full = trainer.state_dict()                                # on rank 0; None elsewhere

The process group is initialised from the launcher's environment when it is
not already. The trainer executes this rank's generated program; the runtime
never imports the planner: a Plan object is asked for its program (its own
method), a directory is read from disk.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from runtime.device import set_rank_device
from runtime.engines.lr_schedule import attach_lr_schedule
from runtime.launch.env import LaunchError, choose_device, discover
from runtime.launch.rendezvous import rendezvous_store
from runtime.pipeline.program_module import exec_program

__all__ = ["Trainer", "program_source"]


def program_source(plan: Any, rank: int) -> tuple[str, int]:
    """(source of rank's program, the plan's world size) from a Plan object or a programs directory."""
    if isinstance(plan, (str, Path)):
        d = Path(plan)
        d = d.parent if d.is_file() else d
        meta = d / "plan.json"
        src = d / f"rank_{rank}.py"
        if not meta.is_file() or not src.is_file():
            raise LaunchError(f"{d}: expected plan.json and rank_{rank}.py written by plan.write_programs(DIR) "
                              "(or `partitioner compile ... --programs DIR`)")
        return src.read_text(), int(json.loads(meta.read_text())["world_size"])
    return plan.program(rank).source, int(plan.world_size)


class Trainer:
    def __init__(self, plan: Any, model_fn: Callable, optimizer_fn: Callable, loss_fn: Callable, *,
                 timeout_s: float = 600, device: str | None = None, scheduler_fn: Callable | None = None):
        env = discover()
        if device is None and dist.is_initialized():  # the caller's group decides: NCCL works on GPUs only
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        name, dev = choose_device(device, env.local_rank)
        set_rank_device(dev)
        if not dist.is_initialized():
            timeout = datetime.timedelta(seconds=timeout_s)
            # not init_method="tcp://...": rank 0's store would listen on every interface (runtime.launch.rendezvous)
            dist.init_process_group(name, store=rendezvous_store(env, timeout), rank=env.rank,
                                    world_size=env.world_size, timeout=timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
        source, plan_world = program_source(plan, rank)
        if plan_world != world:
            raise LaunchError(f"the plan is for {plan_world} ranks, but this job has {world}; "
                              f"compile a plan for {world} devices or launch {plan_world} processes")
        ns = exec_program(source, f"<rank_{rank}.py>", rank=rank)
        self.runner = ns["build"](model_fn, optimizer_fn, loss_fn)
        attach_lr_schedule(self.runner, scheduler_fn)
        self.rank = rank

    def step(self, batch) -> float:
        """One optimizer step on a global batch; returns the global mean loss."""
        return self.runner.step(batch)

    def evaluate(self, batch) -> float:
        """The global mean loss on a global batch as one process computes it in eval mode (no dropout, nothing
        trained; runtime.engines.evaluation). A collective: call it on every rank with the same batch."""
        return self.runner.evaluate(batch)

    def predict(self, inputs):
        """Inference under the plan (no gradients)."""
        return self.runner.predict(inputs)

    def state_dict(self):
        """The full trained parameters under the model's names on rank 0 (a collective: call on every rank)."""
        return self.runner.full_state_dict()
