"""runtime: what the generated per-rank programs link against, and how ranks are started.

Read by stage of a step, bottom up:
- `comm/`: process groups from the plan's mesh, the collectives shim;
- `compression/`: compressed gradient reductions and their Triton kernels;
- `engines/`: one training step on a rank: data parallel (DDP, ZeRO-1/2/3), async SGD, mixed precision,
  recompute;
- `pipeline/`: pipeline stages, the schedule executor, tensor-parallel slices of stage code;
- `context/`: context parallelism: the load-balanced sequence split, ring and Ulysses attention;
- `experts/`: expert parallelism: token routing, the all-to-all MoE layer, the router's balancing loss;
- `checkpoint/`: sharded checkpoints any plan of the model can load;
- `verify/`: a plan's programs against the module, in one process;
- `launch/`: local processes, torchrun / mpirun / SLURM, rendezvous, measurement, `Trainer`;
- `run.py`: the torchrun entry point (`python -m runtime.run plan.json ...`).
Never imports the planner: a generated program needs torch and this package only.
"""

from runtime import moved
from runtime.checkpoint import CheckpointError, load_full_state_dict, reshard
from runtime.engines.token_loss import per_token, summed
from runtime.launch.local import LaunchResult, launch_local
from runtime.launch.trainer import Trainer

moved.install()

__all__ = ["launch_local", "LaunchResult", "Trainer", "reshard", "load_full_state_dict", "CheckpointError",
           "per_token", "summed"]
