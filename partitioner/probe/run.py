"""`probe(topology)`: every rank measures (measure.py), rank 0 fits (derive.py) and writes one JSON.

Where the ranks come from:
* `local:N` outside a launcher: N processes spawned here over Gloo, one thread each, as
  runtime.launch.local runs a plan's ranks (a FileStore in a temporary directory, no port opened);
* under torchrun, srun or mpirun (runtime.launch.env.discover sees the launcher's variables): this process
  is one rank of the job, which meets on runtime.launch.rendezvous's store with the backend the machine has
  (NCCL with CUDA, else Gloo): `torchrun --nproc-per-node 8 -m partitioner probe --topology 8xH100-80GB`.

>>> import tempfile, pathlib
>>> out = pathlib.Path(tempfile.mkdtemp()) / "cal.json"
>>> cal = probe("local:2", out=out, sweep=Sweep.quick())
>>> cal.source.startswith("partitioner probe local:2"), out.exists(), Calibration.load(out) == cal
(True, True, True)
>>> sorted(cal.probe)[:6]   # the evidence beside the factors
['attention', 'collectives', 'devices', 'elementwise_bytes_per_s', 'fixed_process_bytes', 'loss_bytes_per_s']
>>> sorted(cal.probe)[6:]
['lowrank_bytes_per_s', 'matmul', 'memory_bytes_per_s', 'op_overhead_s', 'optimizer_bytes_per_s', 'overlap', 'ranks']
>>> 0 < cal.optimizer_eff <= 1   # torch.optim.AdamW's step, as a fraction of the memory bandwidth
True
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from cost_models.calibration import Calibration
from cost_models.errors import PartitionerError
from cost_models.topology import Topology
from partitioner.probe.derive import derive_calibration, summarise
from partitioner.probe.sweep import Sweep, groups_by_level

__all__ = ["probe"]


def probe(topology: Topology | str, *, out: str | os.PathLike | None = None, sweep: Sweep | None = None,
          timeout_s: float = 300.0, progress: TextIO | None = None) -> Calibration:
    """Measure the machine for `topology`; return its Calibration and, on rank 0, write it to `out` (if given)."""
    from runtime.launch.env import discover

    topo = Topology.coerce(topology)
    env = discover()
    t0 = time.monotonic()
    if env.launcher == "none":
        if not topo.local and topo.world_size > 1:
            raise PartitionerError(
                f"probe for {topo} ({topo.world_size} ranks) needs those ranks: run it under the cluster's "
                f"launcher, e.g. `torchrun --nnodes {topo.nodes} --nproc-per-node {topo.devices_per_node} -m "
                f"partitioner probe --topology {topo}` or `srun -n {topo.world_size} python -m partitioner probe "
                f"--topology {topo}`; `local:N` spawns N processes here")
        records = _spawn(topo, sweep or Sweep(), timeout_s)
        rank = 0
    else:
        if env.world_size != topo.world_size:
            raise PartitionerError(f"the launcher started {env.world_size} ranks but the topology {topo} has "
                                   f"{topo.world_size}: start one process per device of the topology")
        records, rank = _in_job(topo, sweep, env, timeout_s), env.rank
    if records is None:  # not rank 0 of a job: rank 0 writes
        return Calibration.for_device(topo.device.name)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    cal = derive_calibration(topo, summarise(records), source=f"partitioner probe {topo} {stamp}")
    if out is not None and rank == 0:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        cal.save(out)
    if progress is not None:
        progress.write(f"probe {topo}: {len(records)} ranks measured in {time.monotonic() - t0:.1f} s\n")
    return cal


def _spawn(topo: Topology, sweep: Sweep, timeout_s: float) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    world = topo.world_size
    with tempfile.TemporaryDirectory(prefix="probe-") as tmp:
        ctx = mp.start_processes(_local_worker, args=(world, tmp, sweep, topo.to_dict(), timeout_s), nprocs=world,
                                 start_method="spawn", join=False)
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise PartitionerError(f"probe: the {world} ranks did not finish within timeout_s={timeout_s} s; "
                                           "a busy machine needs a longer one (--timeout-s)")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]


def _local_worker(rank: int, world: int, tmp: str, sweep: Sweep, topo: dict[str, Any], timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    from partitioner.probe.measure import measure_rank
    from runtime.device import keep_freed_host_memory

    torch.set_num_threads(1)  # as runtime.launch.local runs a plan's ranks: a few ranks share a few cores
    keep_freed_host_memory()  # and with their allocator setting: the rates measured are the ones they get
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), world), rank=rank,
                            world_size=world, timeout=timeout)
    try:
        rec = measure_rank(sweep, groups_by_level(Topology.from_dict(topo)), torch.device("cpu"))
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(rec))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _in_job(topo: Topology, sweep: Sweep | None, env, timeout_s: float) -> list[dict[str, Any]] | None:
    import torch
    import torch.distributed as dist

    from partitioner.probe.measure import measure_rank
    from runtime.device import keep_freed_host_memory
    from runtime.launch.env import backend
    from runtime.launch.rendezvous import rendezvous_store

    timeout = datetime.timedelta(seconds=timeout_s)
    name = backend()
    device = torch.device("cuda", env.local_rank) if name == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_host_memory()  # as runtime.run's CPU ranks
    sweep = sweep or (Sweep.for_gpu() if device.type == "cuda" else Sweep())
    dist.init_process_group(name, store=rendezvous_store(env, timeout), rank=env.rank, world_size=env.world_size,
                            timeout=timeout)
    try:
        rec = measure_rank(sweep, groups_by_level(topo), device)
        gathered: list[Any] = [None] * env.world_size
        dist.all_gather_object(gathered, rec)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return gathered if env.rank == 0 else None
