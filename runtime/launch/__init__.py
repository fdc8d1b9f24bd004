"""Starting ranks and watching them: local processes, torchrun / mpirun / SLURM, rendezvous, measurement.

- `local.py` (read first): `launch_local`, one process per rank on this machine, failures named;
- `env.py`: who am I (rank, world, master) under each launcher; `rendezvous.py`: the store, loopback by
  default; `heartbeat.py`: a lost peer noticed; `cluster.py`: jobs through torchrun or srun;
- `measure.py`, `memory_probe.py`: step times and peak memory as a rank reports them;
- `program_check.py`: every rank runs the same plan's program; `trainer.py`: `Trainer`, a plan in a loop.
The torchrun entry point is `runtime.run`, beside this package.
"""

from runtime.launch.local import LaunchResult, launch_local

__all__ = ["LaunchResult", "launch_local"]
