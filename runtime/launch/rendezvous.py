"""`rendezvous_store(env, timeout)`: the c10d store a job's ranks meet on, listening on loopback by default.

Why not `init_process_group(init_method="tcp://ADDR:PORT")`: rank 0 then hosts a c10d TCPStore, and that
server listens on every interface whatever ADDR says (measured with torch 2.13: host "127.0.0.1" gives a
listener on [::]:PORT, both store backends), so the rendezvous port is open to the network on any
machine. Here rank 0 binds the listening socket itself, to MASTER_ADDR, after `check_bind_address` (loopback
unless PARTITIONER_ALLOW_EXTERNAL_BIND=1), and hands it to TCPStore (`master_listen_fd`, libuv backend);
the other ranks connect as clients. Under torchrun the agent already hosts the store
(TORCHELASTIC_USE_AGENT_STORE=True) and every rank is a client: nothing is bound here.

torchrun's agent keeps that one store across restarts (torch 2.13 creates it once per agent), so the
keys of a dead attempt are still there when the restarted ranks meet: gloo's peer addresses among them.
A restarted rank that reads its peer's old address fails to connect ("Connection refused", measured in
CI) or reaches whatever now holds that port. Every attempt therefore gets its own namespace,
`partitioner/attempt_{TORCHELASTIC_RESTART_COUNT}`. The count is the agent's: one node's ranks always
agree on it, but agents of a multi-node job can disagree after a partial failure (torch issue 135712),
so multi-node jobs with --max-restarts should set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which gives
every attempt a fresh store hosted by rank 0 (the non-agent path below).

    store = rendezvous_store(discover(), timedelta(minutes=5))
    dist.init_process_group(backend(), store=store, rank=env.rank, world_size=env.world_size)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from datetime import timedelta

from runtime.launch.env import DistEnv, LaunchError, check_bind_address

__all__ = ["attempt_prefix", "rendezvous_store"]


def attempt_prefix(environ: Mapping[str, str] = os.environ) -> str:
    """The namespace of this torchrun attempt's keys in the agent's store (see the module docstring)."""
    return f"partitioner/attempt_{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def rendezvous_store(env: DistEnv, timeout: timedelta, environ: Mapping[str, str] = os.environ):
    """A TCPStore for `env`'s job: hosted by rank 0 on env.master_addr:env.master_port (loopback unless
    allowed), joined as a client by the others, or by everyone under torchrun's agent store."""
    from torch.distributed import PrefixStore, TCPStore

    host, port = env.master_addr, env.master_port
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = TCPStore(host, port, env.world_size, is_master=False, timeout=timeout)
        return PrefixStore(attempt_prefix(environ), store)
    if env.rank != 0:
        return TCPStore(host, port, env.world_size, is_master=False, timeout=timeout)
    check_bind_address(host, environ)
    listener = _listen(host, port)
    try:
        # libuv backend: the legacy one aborts the process when given a listening fd (measured, torch 2.13)
        store = TCPStore(host, port, env.world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.fileno(), use_libuv=True)
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store serves on this very fd (libuv does not duplicate it) and closes it when done
    return store


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`:`port` itself (not on every interface)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise LaunchError(f"MASTER_ADDR={host!r} does not resolve ({e}): set it to rank 0's address, or unset "
                          "it for a job on one machine") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted job reuses its port at once
        sock.bind(addr)
        sock.listen(max(128, socket.SOMAXCONN))
    except OSError as e:
        sock.close()
        raise LaunchError(f"rank 0 cannot listen on {host}:{port} for the rendezvous ({e.strerror or e}): "
                          "pick a free MASTER_PORT, or check that MASTER_ADDR is this machine's address") from None
    return sock
