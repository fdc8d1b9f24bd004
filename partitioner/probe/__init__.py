"""`partitioner probe`: measure the machine the job runs on and write a Calibration for it.

In: a Topology (its world of ranks, spawned here for `local:N`, or the ranks of a torchrun / srun job).
Out: a Calibration (cost_models/calibration.py) whose factors are fitted to what the ranks measured, with
the measurements themselves under its `probe` key: one JSON for the whole topology, that
`compile(..., calibration=PATH)`, `partitioner compile --calibration PATH` and autotune (as its starting
point and prior) take.

Read first: `run.py` (`probe`). Then `sweep.py` (what is measured: sizes, groups by link level),
`measure.py` (what one rank runs: matmuls, a stream copy, the fixed process memory, collectives through the
runtime's collectives shim), `derive.py` (alpha-beta fits and the Calibration factors, no torch).
"""

from partitioner.probe.run import probe
from partitioner.probe.sweep import Sweep

__all__ = ["Sweep", "probe"]
