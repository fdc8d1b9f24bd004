"""Where this process sits in the job, read from whatever launched it.

torchrun, Open MPI's mpirun, MPICH/Intel MPI (PMI) and SLURM's srun each
describe the job in their own environment variables; `discover` reads them
into one `DistEnv`. MASTER_ADDR / MASTER_PORT, when set, override what the
launcher implies. With no launcher the job is one process on loopback.

Binding: loopback by default. Any port this project listens on (the c10d
store rank 0 hosts, runtime.launch.rendezvous) is bound to 127.0.0.1 unless the
job explicitly allows another address with the environment variable
PARTITIONER_ALLOW_EXTERNAL_BIND=1 (`check_bind_address`); a multi-node job
sets it on the rank-0 node, e.g. `PARTITIONER_ALLOW_EXTERNAL_BIND=1 srun ...`
or `mpirun -x PARTITIONER_ALLOW_EXTERNAL_BIND=1 ...`. An environment variable,
not a command-line flag, because launchers pass the environment to every rank
unchanged. Connecting to a remote MASTER_ADDR needs no flag: only listening
does. torchrun's own agent store is torchrun's, not ours: it listens on every
interface whatever --master-addr says (measured, torch 2.13).

>>> discover({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, master_addr='127.0.0.1', master_port=29500, launcher='mpirun')
>>> expand_nodelist("node[01-03,07],gpu5")
['node01', 'node02', 'node03', 'node07', 'gpu5']
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

# cost_models imports nothing of the project, so the runtime may share its base error (one direction holds).
from cost_models.errors import PartitionerError

if TYPE_CHECKING:  # the launcher imports torch only where it runs (backend, choose_device)
    import torch

__all__ = ["DistEnv", "LaunchError", "Launcher", "backend", "choose_device", "discover", "expand_nodelist", "check_bind_address",
           "is_loopback", "DEFAULT_MASTER_ADDR", "DEFAULT_MASTER_PORT", "ALLOW_EXTERNAL_BIND"]

Launcher = Literal["torchrun", "mpirun", "slurm", "none"]

# Loopback unless told otherwise: the project's rule for any port it opens.
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
# The explicit opt-in to listen on an address other than loopback (set to 1).
ALLOW_EXTERNAL_BIND = "PARTITIONER_ALLOW_EXTERNAL_BIND"


class LaunchError(PartitionerError):
    """A job that cannot start as launched: the message names the variable or argument and the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistEnv:
    """One process's place in the job.

    rank/world_size: global; local_rank/local_world_size: on this node.
    master_addr/master_port: where rank 0 hosts the rendezvous store.
    launcher: which launcher's variables these came from.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: Launcher


# (launcher, rank, size, local rank, local size): the first whose rank variable is set wins.
# MPI before SLURM: mpirun inside an sbatch allocation inherits the batch step's SLURM_PROCID.
_SOURCES: tuple[tuple[Launcher, str, str, str, str], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpirun", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


def discover(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """Read rank, world size and rendezvous address from the launcher's variables.

    Raises LaunchError for a half-set or inconsistent environment (rank >= world
    size, a non-integer), naming the variable and its value.
    """
    for launcher, k_rank, k_size, k_lrank, k_lsize in _SOURCES:
        if k_rank in environ:
            break
    else:
        return DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1,
                       master_addr=environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
                       master_port=_port(environ), launcher="none")
    if k_size not in environ:
        raise LaunchError(f"{k_rank}={environ[k_rank]!r} is set but {k_size} is not: the {launcher} environment "
                          f"is incomplete; launch with {launcher} itself, or set {k_size} to the number of processes")
    rank, world = _int(environ, k_rank, lo=0), _int(environ, k_size, lo=1)
    if rank >= world:
        raise LaunchError(f"{k_rank}={rank} is not below {k_size}={world}: ranks run 0..{world - 1}; "
                          "check the launcher's process counts")
    local_rank = _int(environ, k_lrank, lo=0) if k_lrank in environ else None
    local_size = _local_size(environ, launcher, k_lsize)
    if local_rank is None:  # no per-node variables: assume one node
        local_rank = rank
    local_size = local_size or world  # unknown: assume one node
    if local_rank >= local_size:
        raise LaunchError(f"{k_lrank}={local_rank} is not below the processes on this node ({local_size}): "
                          "the launcher's per-node variables disagree")
    if local_size > world:
        raise LaunchError(f"{local_size} processes on this node ({k_lsize}) but {k_size}={world} in all: "
                          "the launcher's variables disagree")
    addr = environ.get("MASTER_ADDR") or (_slurm_master(environ) if launcher == "slurm" else None)
    if addr is None and launcher == "mpirun" and local_size < world:
        raise LaunchError(f"{world} MPI ranks over several nodes ({local_size} on this one) but MASTER_ADDR is not "
                          "set, so the other nodes cannot find rank 0: export MASTER_ADDR=<rank 0's host> "
                          "(and pass it on: mpirun -x MASTER_ADDR -x MASTER_PORT)")
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_size,
                   master_addr=addr or DEFAULT_MASTER_ADDR, master_port=_port(environ), launcher=launcher)


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback one (127.0.0.0/8, ::1; "localhost").

    >>> is_loopback("127.0.0.1"), is_loopback("localhost"), is_loopback("0.0.0.0")
    (True, True, False)
    """
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError, ValueError):
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_bind_address(host: str, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse to listen on `host` unless it is loopback or PARTITIONER_ALLOW_EXTERNAL_BIND=1 allows it.

    Raises LaunchError naming MASTER_ADDR and the two fixes.
    """
    if is_loopback(host):
        return
    flag = environ.get(ALLOW_EXTERNAL_BIND, "")
    if flag == "1":
        return
    if flag not in ("", "0"):
        raise LaunchError(f"{ALLOW_EXTERNAL_BIND}={flag!r}: set it to 1 to allow listening beyond loopback, or "
                          "unset it")
    raise LaunchError(f"MASTER_ADDR={host!r} is not a loopback address, and rank 0 would listen there for the "
                      f"rendezvous, reachable from the network: this project binds 127.0.0.1 unless told otherwise. "
                      f"For a job over several machines, allow it on rank 0's node with {ALLOW_EXTERNAL_BIND}=1 "
                      f"(e.g. `{ALLOW_EXTERNAL_BIND}=1 srun ...`, `mpirun -x {ALLOW_EXTERNAL_BIND}=1 ...`); on one "
                      "machine, unset MASTER_ADDR or set it to 127.0.0.1")


def backend() -> str:
    """The c10d backend for this machine: "nccl" with CUDA, else "gloo"."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def choose_device(requested: str | None, local_rank: int) -> tuple[str, "torch.device"]:
    """(c10d backend, device) of this rank: one device per rank, which every tensor it trains with lives on.

    requested: None picks the machine's (cuda:LOCAL_RANK over NCCL where CUDA is, else cpu over Gloo);
    "cuda" means cuda:LOCAL_RANK; "cuda:N" and "cpu" are taken as they are. A device this process cannot
    use raises LaunchError now, at start-up, not inside NCCL at step 1.

    >>> choose_device("cpu", local_rank=3)
    ('gloo', device(type='cpu'))
    """
    import torch

    from runtime.device import DeviceError, check_device

    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        requested = f"cuda:{local_rank}"
    try:
        dev = check_device(requested)
    except DeviceError as exc:
        raise LaunchError(str(exc)) from None
    return ("nccl" if dev.type == "cuda" else "gloo"), dev


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list, expanded in order (what `scontrol show hostnames` prints).

    >>> expand_nodelist("a[1-2]-ib,b[08-10]")
    ['a1-ib', 'a2-ib', 'b08', 'b09', 'b10']
    """
    hosts: list[str] = []
    for item in _split_top(nodelist):
        parts = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            parts = [p + text for p in parts]
            if ranges:
                parts = [p + n for p in parts for n in _expand_ranges(ranges, nodelist)]
        hosts.extend(parts)
    return [h for h in hosts if h]


# ---- helpers -----------------------------------------------------------------


def _int(environ: Mapping[str, str], key: str, *, lo: int) -> int:
    raw = environ[key]
    try:
        value = int(raw.strip())
    except ValueError:
        raise LaunchError(f"{key}={raw!r} is not an integer: the launcher sets it to a process count or "
                          "index; unset it or fix its value") from None
    if value < lo:
        raise LaunchError(f"{key}={value} is below {lo}: it is a process {'count' if lo else 'index'}")
    return value


def _port(environ: Mapping[str, str]) -> int:
    if "MASTER_PORT" not in environ:
        return DEFAULT_MASTER_PORT
    port = _int(environ, "MASTER_PORT", lo=1)
    if port > 65535:
        raise LaunchError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    return port


def _local_size(environ: Mapping[str, str], launcher: Launcher, key: str) -> int | None:
    if key in environ:
        return _int(environ, key, lo=1)
    if launcher == "slurm" and "SLURM_TASKS_PER_NODE" in environ:
        # "2(x3),1": two tasks on each of the first three nodes, one on the fourth.
        counts = []
        for item in environ["SLURM_TASKS_PER_NODE"].split(","):
            m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
            if not m:
                raise LaunchError(f"SLURM_TASKS_PER_NODE={environ['SLURM_TASKS_PER_NODE']!r} is not of the form "
                                  "'2(x3),1'")
            counts += [int(m[1])] * int(m[2] or 1)
        node = _int(environ, "SLURM_NODEID", lo=0) if "SLURM_NODEID" in environ else 0
        if node >= len(counts):
            raise LaunchError(f"SLURM_NODEID={node} but SLURM_TASKS_PER_NODE lists {len(counts)} nodes")
        return counts[node]
    return None


def _slurm_master(environ: Mapping[str, str]) -> str | None:
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    hosts = expand_nodelist(nodelist)
    if len(hosts) <= 1:  # one node: stay on loopback
        return None
    return hosts[0]


def _split_top(s: str) -> list[str]:
    """Split on commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    out, depth, cur = [], 0, ""
    for ch in s:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise LaunchError(f"SLURM node list {s!r} has an unclosed '['")
    return [x.strip() for x in out + [cur] if x.strip()]


def _expand_ranges(ranges: str, whole: str) -> list[str]:
    out = []
    for r in ranges.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", r)
        if not m:
            raise LaunchError(f"SLURM node list {whole!r}: {r!r} is not a number or a range like 01-03")
        lo, hi = m[1], m[2] or m[1]
        if int(hi) < int(lo):
            raise LaunchError(f"SLURM node list {whole!r}: range {lo}-{hi} runs backwards")
        out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return out
