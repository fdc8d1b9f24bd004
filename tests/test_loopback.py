"""Issue 8: the rendezvous binds to loopback by default; another address needs PARTITIONER_ALLOW_EXTERNAL_BIND=1.

Real c10d stores and process groups (no mocks); the listening addresses are read from /proc/net/tcp{,6},
what `ss -ltn` shows.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from runtime.launch.env import (
    ALLOW_EXTERNAL_BIND,
    DistEnv,
    LaunchError,
    check_bind_address,
    discover,
    is_loopback,
)
from runtime.launch.rendezvous import attempt_prefix, rendezvous_store
from ranks import free_port, gloo_group, spawn

TIMEOUT = timedelta(seconds=20)
ANY4, ANY6, LOOPBACK4 = "0.0.0.0", "::", "127.0.0.1"


def listening(port: int) -> set[str]:
    """The local addresses with a socket listening on `port` (state 0A in /proc/net/tcp and tcp6)."""
    out = set()
    for name, size in (("tcp", 4), ("tcp6", 16)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                raw = bytes.fromhex(addr)
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
                out.add(socket.inet_ntop(socket.AF_INET if size == 4 else socket.AF_INET6, raw))
    return out


def _env(rank: int = 0, world: int = 1, addr: str = LOOPBACK4, port: int | None = None) -> DistEnv:
    return DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world, master_addr=addr,
                   master_port=port or free_port(), launcher="none")


# ---- the defaults ---------------------------------------------------------------------------------------


def test_every_launcher_defaults_to_loopback():
    assert discover({}).master_addr == "127.0.0.1"
    assert discover({"RANK": "1", "WORLD_SIZE": "2"}).master_addr == "127.0.0.1"  # torchrun without MASTER_ADDR
    assert discover({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}).master_addr == "127.0.0.1"
    assert discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu1"}).master_addr \
        == "127.0.0.1"  # one node


def test_loopback_addresses():
    assert all(map(is_loopback, ("127.0.0.1", "127.1.2.3", "localhost", "::1")))
    assert not any(map(is_loopback, (ANY4, ANY6, "10.0.0.1", "", "no-such-host.invalid")))


def test_binding_beyond_loopback_needs_the_flag():
    check_bind_address("127.0.0.1", {})
    with pytest.raises(LaunchError, match=rf"MASTER_ADDR='0.0.0.0' is not a loopback.*{ALLOW_EXTERNAL_BIND}=1"):
        check_bind_address(ANY4, {})
    with pytest.raises(LaunchError, match=rf"MASTER_ADDR='10.1.2.3'.*{ALLOW_EXTERNAL_BIND}=1"):
        check_bind_address("10.1.2.3", {ALLOW_EXTERNAL_BIND: "0"})
    with pytest.raises(LaunchError, match=rf"{ALLOW_EXTERNAL_BIND}='yes': set it to 1"):
        check_bind_address(ANY4, {ALLOW_EXTERNAL_BIND: "yes"})
    check_bind_address(ANY4, {ALLOW_EXTERNAL_BIND: "1"})


# ---- what c10d does on its own, and what the project's store does ---------------------------------------


def test_c10d_tcpstore_alone_listens_on_every_interface():
    """The measured fact behind runtime.launch.rendezvous: TCPStore(host="127.0.0.1", is_master=True) listens on [::]
    (every interface, IPv4 too on a dual-stack host). If this starts failing, torch binds the host it is given
    and the listening-socket workaround could go."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT)
    try:
        assert listening(port) & {ANY4, ANY6}, listening(port)
    finally:
        del store


def test_the_project_store_listens_on_loopback_only():
    env = _env(world=2)
    store = rendezvous_store(env, TIMEOUT, environ={})
    try:
        assert listening(env.master_port) == {LOOPBACK4}
        client = rendezvous_store(dataclasses.replace(env, rank=1), TIMEOUT, environ={})
        store.set("hello", "rank 0")
        assert client.get("hello") == b"rank 0"
        del client
    finally:
        del store
    assert listening(env.master_port) == set()  # closed with the store


def test_the_project_store_refuses_other_addresses_without_the_flag():
    env = _env(addr=ANY4)
    with pytest.raises(LaunchError, match=ALLOW_EXTERNAL_BIND):
        rendezvous_store(env, TIMEOUT, environ={})
    assert listening(env.master_port) == set()
    store = rendezvous_store(env, TIMEOUT, environ={ALLOW_EXTERNAL_BIND: "1"})  # explicitly allowed
    try:
        assert listening(env.master_port) == {ANY4}
    finally:
        del store


def test_under_torchrun_every_rank_joins_the_agent_store():
    host = _env(world=2)
    agent = rendezvous_store(host, TIMEOUT, environ={})  # stands in for torchrun's agent
    try:
        # rank 0 with the agent store, even at a non-loopback MASTER_ADDR, binds nothing: it is a client
        worker = rendezvous_store(host, TIMEOUT, environ={"TORCHELASTIC_USE_AGENT_STORE": "True"})
        worker.set("joined", "yes")
        # under this attempt's namespace: a restart must not read the keys of the attempt before it
        assert agent.get(attempt_prefix({}) + "/joined") == b"yes" and listening(host.master_port) == {LOOPBACK4}
        del worker
    finally:
        del agent


def test_a_port_in_use_is_a_launch_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(LaunchError, match=r"cannot listen on 127.0.0.1:\d+.*MASTER_PORT"):
            rendezvous_store(_env(port=s.getsockname()[1]), TIMEOUT, environ={})


def _all_reduce_worker(rank: int, world: int, _store_path: str, out_dir: str, port: int) -> None:
    # the group meets through the rendezvous's TCP store on `port`, not a FileStore
    env = _env(rank=rank, world=world, port=port)
    with gloo_group(rank, world, rendezvous_store(env, TIMEOUT, environ={}), timeout_s=TIMEOUT.total_seconds()):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        if rank == 0:
            torch.save(f"{t.item()} {sorted(listening(port))}", Path(out_dir) / "rank0.pt")


@pytest.mark.slow
def test_a_process_group_over_the_loopback_store(tmp_path):
    port = free_port()
    assert spawn(_all_reduce_worker, 2, tmp_path, port)[0] == "3.0 ['127.0.0.1']"


# ---- the commands the CLI prints --------------------------------------------------------------------------


def test_the_printed_torchrun_line_stays_on_loopback_for_one_node(meta_gpt_graph, tmp_path, capsys):
    from partitioner import compile
    from partitioner.cli import main

    for topology, single in (("8xH100", True), ("2x4xA100-80GB", False)):
        plan = compile(meta_gpt_graph, topology, global_batch_size=8, alternatives=0)
        path = tmp_path / f"{topology}.json"
        dataclasses.replace(plan, model_source="examples/gpt.py:gpt_tiny").save(path)
        assert main(["run", str(path), "--print-command", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        if single:
            assert "--master-addr 127.0.0.1 --master-port 29500" in doc["torchrun"], doc["torchrun"]
            assert ALLOW_EXTERNAL_BIND not in doc["srun"]
        else:  # over nodes, rank 0's node listens for the others: the command says so explicitly
            assert "--master-addr $MASTER_ADDR" in doc["torchrun"]
            assert doc["srun"].startswith(f"{ALLOW_EXTERNAL_BIND}=1 srun "), doc["srun"]
