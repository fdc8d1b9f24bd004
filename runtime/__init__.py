"""runtime: what the generated per-rank programs link against.

Process groups from the plan's mesh, the collectives shim, data-parallel
engines (DDP, ZeRO-1/2/3), launch (torchrun, mpirun, SLURM, local spawn).
Never imports the planner (shared/DESIGN.md).
"""

from runtime.checkpoint import CheckpointError, load_full_state_dict, reshard
from runtime.launch import LaunchResult, launch_local
from runtime.trainer import Trainer

__all__ = ["launch_local", "LaunchResult", "Trainer", "reshard", "load_full_state_dict", "CheckpointError"]
