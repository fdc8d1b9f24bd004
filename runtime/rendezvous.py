"""`rendezvous_store(env, timeout)`: the c10d store a job's ranks meet on, listening on loopback by default.

Why not `init_process_group(init_method="tcp://ADDR:PORT")`: rank 0 then hosts a c10d TCPStore, and that
server listens on every interface whatever ADDR says (measured with torch 2.13: host "127.0.0.1" gives a
listener on [::]:PORT, both store backends), so the rendezvous port is open to the network on any
machine. Here rank 0 binds the listening socket itself, to MASTER_ADDR, after `check_bind_address` (loopback
unless PARTITIONER_ALLOW_EXTERNAL_BIND=1), and hands it to TCPStore (`master_listen_fd`, libuv backend);
the other ranks connect as clients. Under torchrun the agent already hosts the store
(TORCHELASTIC_USE_AGENT_STORE=True) and every rank is a client: nothing is bound here.

    store = rendezvous_store(discover(), timedelta(minutes=5))
    dist.init_process_group(backend(), store=store, rank=env.rank, world_size=env.world_size)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from datetime import timedelta

from runtime.env import DistEnv, LaunchError, check_bind_address

__all__ = ["rendezvous_store"]


def rendezvous_store(env: DistEnv, timeout: timedelta, environ: Mapping[str, str] = os.environ):
    """A TCPStore for `env`'s job: hosted by rank 0 on env.master_addr:env.master_port (loopback unless
    allowed), joined as a client by the others, or by everyone under torchrun's agent store."""
    from torch.distributed import TCPStore

    host, port = env.master_addr, env.master_port
    if env.rank != 0 or environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
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
