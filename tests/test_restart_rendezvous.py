"""A torchrun restart meets in the agent's store, which still holds the dead attempt's keys.

torchrun (torch 2.13) keeps one store per agent across `--max-restarts` restarts. Without a namespace per
attempt, a restarted rank that starts before its peer reads the peer's *old* gloo address and fails with
"Connection refused" (the CI failure of test_killed_rank_restarts_from_the_last_checkpoint). Here the agent's
store is a real TCPStore hosted by the test, the ranks are real processes over gloo, and the second attempt's
rank 0 starts seconds after rank 1, so that rank 1 would read the stale address without the namespace.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from runtime.launch.rendezvous import attempt_prefix

WORKER = r"""
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from runtime.launch.env import discover
from runtime.launch.rendezvous import rendezvous_store
env = discover()
timeout = timedelta(seconds=30)
dist.init_process_group("gloo", store=rendezvous_store(env, timeout), rank=env.rank, world_size=env.world_size,
                        timeout=timeout)
t = torch.tensor([env.rank + 1.0])
dist.all_reduce(t)
print("sum", t.item(), flush=True)
dist.destroy_process_group()
"""


def _start(rank: int, port: int, attempt: int) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
               TORCHELASTIC_RESTART_COUNT=str(attempt), TORCHELASTIC_RUN_ID="restart-test")
    return subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen) -> str:
    try:
        out, _ = p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"a rank hung at the rendezvous:\n{out}")
    assert p.returncode == 0, out
    return out


def test_attempts_have_their_own_namespace():
    assert attempt_prefix({}) == "partitioner/attempt_0"
    assert attempt_prefix({"TORCHELASTIC_RESTART_COUNT": "2"}) == "partitioner/attempt_2"


@pytest.mark.slow
def test_a_restarted_rank_does_not_read_the_dead_attempts_addresses():
    agent = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60),
                     multi_tenant=True)  # stands in for torchrun's agent: it outlives the attempts
    first = [_start(r, agent.port, attempt=0) for r in (0, 1)]
    for p in first:
        assert "sum 3.0" in _finish(p)
    # the restart: rank 0 comes late, as a rank restarted on a loaded machine does
    late1 = _start(1, agent.port, attempt=1)
    time.sleep(6)  # gloo gives up on a refused peer after 3 retries (about 3 s), well within this
    late0 = _start(0, agent.port, attempt=1)
    assert "sum 3.0" in _finish(late1) and "sum 3.0" in _finish(late0)
