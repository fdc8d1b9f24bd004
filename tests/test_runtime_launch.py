"""runtime.launch.local, runtime.comm.groups and runtime.run: real processes over Gloo with hand-written rank programs.

The programs here follow the contract codegen's programs follow: `build(model_fn,
optimizer_fn, loss_fn)` returns a runner with step / full_state_dict /
held_bytes / collectives / program_hash.
"""

import dataclasses
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from examples.training import evaluate_one_process, train_one_process
from runtime.launch.env import LaunchError
from runtime.comm.groups import grid, group_ranks
from runtime.launch.local import launch_local
from runtime.run import main as run_main
from ranks import free_port

# ---- a model, an optimizer and a loss the workers import by reference ---------------------


def tiny_model() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


def other_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def no_params() -> torch.nn.Module:
    return torch.nn.Identity()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def mse(output, target):
    return F.mse_loss(output, target)


def batches(n=3, size=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 4, generator=g), torch.randn(size, 2, generator=g)) for _ in range(n)]


def one_process(batches, scheduler_fn=None):
    """The truth: the same seed and data in one process."""
    losses, model = one_process_model(batches, scheduler_fn)
    return losses, model.state_dict()


def one_process_model(batches, scheduler_fn=None):
    torch.manual_seed(0)
    trained = train_one_process(tiny_model, sgd, mse, batches, scheduler_fn=scheduler_fn)
    return trained.losses, trained.model


DP_PROGRAM = '''\
"""A hand-written data-parallel rank program: all-reduce (average) every gradient and the loss."""
import os
import signal
import time

import torch
import torch.distributed as dist

from runtime.comm.collectives import Collectives


class Runner:
    program_hash = "hand-written-dp"

    def __init__(self, model, optimizer, loss_fn):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.collectives = Collectives()
        self.steps = 0
        self.lr_schedule = None  # the program contract: a runner steps it after its optimizer, where one is given

    def step(self, batch):
        rank, world = dist.get_rank(), dist.get_world_size()
        self.steps += 1
        # HOOK
        x, y = (t.chunk(world)[rank] for t in batch)   # this replica's slice of the global batch
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        for p in self.model.parameters():
            self.collectives.all_reduce(p.grad, op="avg")
        self.optimizer.step()
        if self.lr_schedule is not None:
            self.lr_schedule.step()
        loss = loss.detach()
        self.collectives.all_reduce(loss, op="avg")
        return loss.item()

    @torch.no_grad()
    def evaluate(self, batch):
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = (t.chunk(world)[rank] for t in batch)
        loss = self.loss_fn(self.model(x), y)
        self.collectives.all_reduce(loss, op="avg")
        return loss.item()

    def predict(self, inputs):
        return self.model(inputs)

    def full_state_dict(self):
        if dist.get_rank() != 0:
            return None
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def held_bytes(self):
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
        params = nbytes(self.model.parameters())
        state = nbytes(t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
        return {"params": params, "grads": params, "optimizer": state}


def build(model_fn, optimizer_fn, loss_fn):
    torch.manual_seed(0)
    model = model_fn()
    return Runner(model, optimizer_fn(model.parameters()), loss_fn)
'''


def dp_program(hook: str = "") -> str:
    return DP_PROGRAM.replace("# HOOK", hook)


@dataclasses.dataclass(frozen=True)
class Placement:
    param: str
    shape: tuple


@dataclasses.dataclass(frozen=True)
class PlanStandIn:
    """What launch_local reads from a Plan: world_size, placements, program(rank).source."""

    world_size: int
    placements: tuple
    source: str

    def program(self, rank):
        return types.SimpleNamespace(source=self.source)


def dp_plan(world_size=2, hook=""):
    return PlanStandIn(world_size, (Placement("weight", (2, 4)), Placement("bias", (2,))), dp_program(hook))


# ---- launch_local: results ------------------------------------------------------------------


@pytest.mark.slow
def test_launch_local_trains_like_one_process():
    data = batches()
    result = launch_local(dp_plan(), tiny_model, sgd, mse, data, timeout_s=60)
    losses, state = one_process(data)
    assert result.losses == pytest.approx(losses, rel=1e-5, abs=1e-7)
    assert result.state_dict.keys() == state.keys()
    for k in state:
        torch.testing.assert_close(result.state_dict[k], state[k], rtol=1e-5, atol=1e-6)
    # per step: one all-reduce per parameter (2) and one for the loss, on every rank
    assert result.collective_counts == [{"all_reduce": 9}] * 2
    assert len(result.step_times_s) == 3 and all(0 < t < 30 for t in result.step_times_s)
    assert result.held_bytes == [{"params": 40, "grads": 40, "optimizer": 40}] * 2  # 10 floats, SGD momentum
    assert result.peak_memory_bytes == [120, 120]  # the most held at once: params + grads + momentum
    assert len(result.peak_rss_bytes) == 2 and all(m > 10 * 2**20 for m in result.peak_rss_bytes)


def nan_mse(output, target):
    return F.mse_loss(output, target) * float("nan")


@pytest.mark.slow
def test_a_loss_that_is_nan_on_every_rank_is_returned_as_one_process_would_return_it():
    """The ranks agree (nan on each: a diverged run): the losses come back as one process's would, not as a broken
    program contract."""
    result = launch_local(dp_plan(), tiny_model, sgd, nan_mse, batches(), timeout_s=60)
    assert len(result.losses) == 3 and all(x != x for x in result.losses)


# ---- launch_local: refused before anything starts -----------------------------------------


def test_world_size_mismatch_is_refused():
    plan = PlanStandIn(8, (), dp_program())
    with pytest.raises(LaunchError, match="plan is for 8 ranks, launched on 4"):
        launch_local(plan, no_params, sgd, mse, [], world_size=4)


def test_lambda_is_refused_naming_the_argument():
    with pytest.raises(LaunchError, match="loss_fn=.*lambdas and local functions cannot be sent"):
        launch_local(dp_plan(), tiny_model, sgd, lambda o, t: (o - t).sum(), [])

    def local_optimizer(params):
        return torch.optim.SGD(params, lr=0.1)

    with pytest.raises(LaunchError, match="optimizer_fn=.*define it at module level"):
        launch_local(dp_plan(), tiny_model, local_optimizer, mse, [])


def test_model_that_does_not_match_the_plan_is_refused():
    with pytest.raises(LaunchError) as info:
        launch_local(dp_plan(), other_model, sgd, mse, [])
    msg = str(info.value)
    assert "missing from the model: weight, bias" in msg
    assert "not in the plan: 0.weight, 0.bias, 1.weight, 1.bias" in msg
    assert "compiled for another model" in msg
    plan = PlanStandIn(2, (Placement("weight", (2, 5)), Placement("bias", (2,))), dp_program())
    with pytest.raises(LaunchError, match=r"shapes that differ: weight model \(2, 4\) vs plan \(2, 5\)"):
        launch_local(plan, tiny_model, sgd, mse, [])


def test_programs_must_cover_every_rank_and_compile():
    with pytest.raises(LaunchError, match=r"missing \[1\]"):
        launch_local(dp_plan(), tiny_model, sgd, mse, [], programs={0: dp_program()})
    with pytest.raises(LaunchError, match="program for rank 1 does not compile"):
        launch_local(dp_plan(), tiny_model, sgd, mse, [], programs={0: dp_program(), 1: "def build(:\n"})


# ---- launch_local: failing workers --------------------------------------------------------


@pytest.mark.slow
def test_worker_exception_names_the_rank_and_carries_its_traceback():
    plan = dp_plan(hook='if rank == 1 and self.steps == 2:\n            raise ValueError("bad batch on purpose")')
    with pytest.raises(LaunchError) as info:
        launch_local(plan, tiny_model, sgd, mse, batches(), timeout_s=30)
    msg = str(info.value)
    assert "rank 1 raised ValueError: bad batch on purpose (in step 2 of 3)" in msg
    assert "rank_1.py" in msg and 'raise ValueError("bad batch on purpose")' in msg  # the worker's traceback


@pytest.mark.slow
def test_worker_killed_by_signal_is_reported_quickly():
    timeout_s = 30
    plan = dp_plan(hook="if rank == 1 and self.steps == 2:\n            os.kill(os.getpid(), signal.SIGKILL)")
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 died from SIGKILL \(exit code -9\) in step 2 of 3"):
        launch_local(plan, tiny_model, sgd, mse, batches(), timeout_s=timeout_s)
    assert time.monotonic() - t0 < timeout_s  # rank 0, blocked in its all-reduce, was killed, not waited for


@pytest.mark.slow
def test_survivor_blocked_in_a_collective_does_not_hang_the_parent():
    timeout_s = 4
    plan = dp_plan(hook="if rank == 1 and self.steps == 2:\n            time.sleep(600)")  # never reaches all_reduce
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="rank 0 .*step 2 of 3|no progress") as info:
        launch_local(plan, tiny_model, sgd, mse, batches(), timeout_s=timeout_s)
    assert time.monotonic() - t0 < timeout_s + 30
    assert "rank 1 in step 2 of 3" in str(info.value)  # where the silent rank was


# ---- process groups from the mesh ----------------------------------------------------------


def test_group_ranks_of_a_3d_mesh():
    # rank = pp * 4 + dp * 2 + tp: pp 2 x dp 2 x tp 2
    mesh = [(r, r // 4, r // 2 % 2, r % 2) for r in range(8)]
    assert group_ranks(mesh) == {"dp": [(0, 2), (1, 3), (4, 6), (5, 7)],
                                 "tp": [(0, 1), (2, 3), (4, 5), (6, 7)],
                                 "pp": [(0, 4), (1, 5), (2, 6), (3, 7)],
                                 "cp": [(r,) for r in range(8)]}  # no context axis: one rank each, created by no one
    coords = [types.SimpleNamespace(rank=r, pp=pp, dp=dp, tp=tp, node=0) for r, pp, dp, tp in mesh]
    assert group_ranks(coords) == group_ranks(mesh)


def test_group_ranks_of_a_mesh_with_context_parallelism():
    # rank = dp * 4 + cp * 2 + tp: dp 2 x cp 2 x tp 2 (cost_models.mesh's order pp, dp, cp, tp)
    mesh = grid(pp=1, dp=2, tp=2, cp=2)
    assert mesh[6] == (6, 0, 1, 0, 1)  # (rank, pp, dp, tp, cp)
    groups = group_ranks(mesh)
    assert groups["cp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]  # ring neighbours tp ranks apart
    assert groups["tp"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert groups["dp"] == [(0, 2, 4, 6), (1, 3, 5, 7)]  # gradients reduced over dp x cp, as Megatron's
    assert groups["pp"] == [(r,) for r in range(8)]


def test_group_ranks_refuses_broken_meshes():
    with pytest.raises(ValueError, match="not 0..1 once each"):
        group_ranks([(0, 0, 0, 0), (0, 0, 1, 0)])
    with pytest.raises(ValueError, match="not a full pp x dp x cp x tp grid"):
        group_ranks([(0, 0, 0, 0), (1, 0, 0, 0)])
    with pytest.raises(ValueError, match="not a full pp x dp x cp x tp grid"):
        group_ranks([(0, 0, 0, 0), (1, 0, 1, 0), (2, 0, 1, 1)])


GROUPS_PROGRAM = '''\
"""Each rank all-reduces 2**rank in its dp, tp and pp groups of a dp 2 x tp 2 mesh."""
import torch
import torch.distributed as dist

from runtime.comm.collectives import Collectives
from runtime.comm.groups import make_groups

MESH = [(0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 1, 0), (3, 0, 1, 1)]   # (rank, pp, dp, tp)


class Runner:
    program_hash = "groups"

    def __init__(self):
        self.collectives = Collectives()
        self.groups = make_groups(dist.get_rank(), MESH)
        self.sums = torch.zeros(3)

    def step(self, batch):
        for i, axis in enumerate(("dp", "tp", "pp")):
            t = torch.tensor([2.0 ** dist.get_rank()])
            if self.groups.group(axis) is not None:   # None: alone on that axis
                self.collectives.all_reduce(t, self.groups.group(axis))
            self.sums[i] = t[0]
        loss = torch.ones(1)
        self.collectives.all_reduce(loss, op="avg")
        return loss.item()

    def full_state_dict(self):
        world = dist.get_world_size()
        sums = torch.zeros(world * 3)
        self.collectives.all_gather(sums, self.sums)
        g = self.groups
        ranks = torch.tensor(list(g.dp_ranks) + list(g.tp_ranks) + list(g.pp_ranks) + [-1])   # 2 + 2 + 1 + pad
        all_ranks = torch.zeros(world * 6, dtype=torch.long)
        self.collectives.all_gather(all_ranks, ranks)
        return {"sums": sums.view(world, 3), "ranks": all_ranks.view(world, 6)} if dist.get_rank() == 0 else None

    def held_bytes(self):
        return {"params": 0, "grads": 0, "optimizer": 0}


def build(model_fn, optimizer_fn, loss_fn):
    return Runner()
'''


@pytest.mark.slow
def test_groups_of_a_2x2_mesh_sum_the_right_ranks():
    plan = PlanStandIn(4, (), GROUPS_PROGRAM)
    result = launch_local(plan, no_params, sgd, mse, [None], timeout_s=60)
    # rank = dp * 2 + tp; dp groups {0, 2} {1, 3}; tp groups {0, 1} {2, 3}; pp alone
    assert result.state_dict["sums"].tolist() == [[5, 3, 1], [10, 3, 2], [5, 12, 4], [10, 12, 8]]
    assert result.state_dict["ranks"].tolist() == [[0, 2, 0, 1, 0, -1], [1, 3, 0, 1, 1, -1],
                                                   [0, 2, 2, 3, 2, -1], [1, 3, 2, 3, 3, -1]]
    # 2 group all-reduces and the loss's, then 2 all-gathers; the pp group (alone) issued nothing
    assert result.collective_counts == [{"all_reduce": 3, "all_gather": 2}] * 4


# ---- python -m runtime.run under torchrun ----------------------------------------------------

TOY = '''\
import torch


def model():
    return torch.nn.Linear(4, 2)


def data(step, rank, world_size):
    g = torch.Generator().manual_seed(1)
    xs = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(step + 1)]
    return xs[step]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def held_out(k, rank, world_size):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
'''


def write_job(tmp_path: Path, world_size: int = 2, programs: bool = True) -> Path:
    (tmp_path / "toy.py").write_text(TOY)
    plan = tmp_path / "plan.json"
    plan.write_text(f'{{"world_size": {world_size}, "optimizer": "sgd", "global_batch_size": 8}}\n')
    if programs:
        for r in range(world_size):
            (tmp_path / f"rank_{r}.py").write_text(dp_program())
    return plan


@pytest.mark.slow
def test_run_under_torchrun_trains_like_one_process(tmp_path):
    """With a learning-rate schedule (--scheduler): each rank steps its own after each optimizer step; and
    evaluations (--eval-every) after step 2 and the last, on 2 held-out batches."""
    write_job(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "runtime.run", "plan.json", "--model", "toy.py:model", "--data", "toy.py:data",
           "--optimizer", "toy.py:sgd", "--loss", "torch.nn.functional:mse_loss", "--steps", "3",
           "--scheduler", "toy.py:halving", "--save", "trained.pt", "--timeout-s", "60",
           "--eval-every", "2", "--eval-batches", "2", "--eval-data", "toy.py:held_out"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(", lr ")[1] for line in steps] == ["0.1", "0.05", "0.025"]  # each step's rate, rank 0's
    printed = [float(line.split()[3]) for line in steps]
    losses, state = one_process(batches(), scheduler_fn=_halving)
    assert printed == pytest.approx(losses, abs=2e-6)  # printed with 6 decimals, by rank 0 only
    trained = torch.load(tmp_path / "trained.pt", weights_only=True)
    for k in state:
        torch.testing.assert_close(trained[k], state[k], rtol=1e-5, atol=1e-6)
    evals = [line.split() for line in proc.stdout.splitlines() if line.startswith("eval after step ")]
    assert [e[3] for e in evals] == ["2:", "3:"]
    held_out = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))
                for g in (torch.Generator().manual_seed(100 + k) for k in range(2))]
    for e, steps in zip(evals, (2, 3)):
        _, model = one_process_model(batches()[:steps], scheduler_fn=_halving)
        assert float(e[5]) == pytest.approx(evaluate_one_process(model, mse, held_out), abs=2e-6)


def test_run_refuses_a_world_size_other_than_the_plans(tmp_path, monkeypatch):
    plan = write_job(tmp_path, world_size=2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(LaunchError, match=r"is for 2 ranks, but this job has 3 \(torchrun\)"):
        run_main([str(plan), "--model", f"{tmp_path}/toy.py:model"])


def test_run_says_how_to_write_missing_programs(tmp_path, monkeypatch):
    plan = write_job(tmp_path, world_size=2, programs=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchError, match=r"rank_1.py does not exist.*plan.write_programs\(DIR\)"):
        run_main([str(plan), "--model", f"{tmp_path}/toy.py:model"])


@pytest.mark.slow
def test_run_under_an_open_mpi_environment(tmp_path):
    """What mpirun -np 2 gives each process: OMPI_COMM_WORLD_* only; rank 0 hosts the store on loopback."""
    write_job(tmp_path)
    cmd = [sys.executable, "-m", "runtime.run", "plan.json", "--model", "toy.py:model", "--data", "toy.py:data",
           "--optimizer", "toy.py:sgd", "--loss", "torch.nn.functional:mse_loss", "--steps", "3", "--timeout-s", "60"]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "SLURM_"))}
    base.update(OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()), OMPI_COMM_WORLD_SIZE="2",
                OMPI_COMM_WORLD_LOCAL_SIZE="2")
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**base, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r)})
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    printed = [float(line.split()[3]) for line in outs[0].splitlines() if line.startswith("step ")]
    assert printed == pytest.approx(one_process(batches())[0], abs=2e-6)
    assert "step " not in outs[1]  # rank 0 prints
