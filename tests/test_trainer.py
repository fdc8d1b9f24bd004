"""runtime.Trainer: a plan inside the user's own loop, the process group from the launcher's environment."""

from __future__ import annotations

import os

import pytest
import torch

from examples import gpt as gpt_mod
from examples import training
from partitioner import compile, trace
from ranks import free_port, group_teardown, spawn

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, _store_path: str, out_dir: str, port: int, programs: str, batches) -> None:
    # What torchrun sets; Trainer initialises the process group from it (not through the FileStore path spawn passes).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from runtime import Trainer

    trainer = Trainer(programs, training.gpt_tiny_seeded, training.sgd, training.gpt_loss, timeout_s=60,
                      scheduler_fn=training.warmup_cosine)  # a learning-rate schedule, stepped by each rank
    with group_teardown():
        losses = [trainer.step(b) for b in batches]
        x = batches[0][0]
        logits = trainer.predict(x[:2])[0]
        val = trainer.evaluate(batches[0])  # eval mode, nothing trained
        state = trainer.state_dict()
        if rank == 0:
            torch.save({"losses": losses, "state": state, "logits": logits, "val": val}, f"{out_dir}/rank0.pt")


def test_trainer_in_a_users_loop_trains_like_one_process(tmp_path):
    model = training.gpt_tiny_seeded()
    g = trace(model, gpt_mod.example_batch(model, 2, seq_len=32))
    plan = compile(g, "local:2", global_batch_size=8, pp=1, tp=1, zero_stage=1, precision="fp32")
    programs = str(plan.write_programs(tmp_path / "programs"))
    batches = [gpt_mod.example_batch(model, 8, seq_len=32, seed=s) for s in range(3)]
    got = spawn(_worker, 2, tmp_path, free_port(), programs, batches)[0]

    losses, ref, _ = training.train_one_process(training.gpt_tiny_seeded, training.sgd, training.gpt_loss, batches,
                                                scheduler_fn=training.warmup_cosine)
    assert got["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got["state"][name], p.detach(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], ref(batches[0][0][:2])[0], rtol=1e-5, atol=1e-5)
    assert got["val"] == pytest.approx(training.evaluate_one_process(ref, training.gpt_loss, batches[:1]), rel=1e-5)


def test_trainer_refuses_a_plan_for_another_world_size(tmp_path):
    from runtime.launch.env import LaunchError
    from runtime.launch.trainer import program_source

    model = training.gpt_tiny_seeded()
    g = trace(model, gpt_mod.example_batch(model, 2, seq_len=32))
    plan = compile(g, "local:2", global_batch_size=8, pp=1, tp=1, precision="fp32")
    d = plan.write_programs(tmp_path / "p")
    src, world = program_source(d, 1)
    assert world == 2 and "RANK = 1" in src
    with pytest.raises(LaunchError, match="expected plan.json and rank_0.py written by plan.write_programs"):
        program_source(tmp_path, 0)
