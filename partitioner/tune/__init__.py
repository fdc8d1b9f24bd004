"""Autotune: compile candidate plans, run them as trials, fit the cost model to what they measured.

In: a model, a topology and a budget of trials. Out: the measured-fastest plan that fits, and a
calibration the next compile can use.

Read first: `autotune.py` (`autotune()`). Then `cluster.py` (trials as torchrun / SLURM jobs) and `db.py`
(the trial database that lets an interrupted autotune resume). Above the planner: it calls
`partitioner.compile` and `runtime.launch_local`.
"""
