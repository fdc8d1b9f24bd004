"""The planner: an `OpGraph` and a topology -> a `Plan` (stage 2 of trace -> OpGraph -> Plan -> RankProgram).

In: the traced graph, the cluster (`cost_models.Topology`) and the user's declarations. Out: the `Plan`,
plain frozen data: mesh, stage cuts, tensor splits, ZeRO stage, microbatching, schedule, recompute,
compression, per-rank memory and predicted step time, the alternatives it beat, and the model's code
(`model_code.ModelCode`) the generator writes into programs. It serialises to JSON and back.

Read first: `plan.py` (what a plan holds). Then how one is chosen:
- `declarations.py`: the user's pins and constraints, checked;
- `tensor_split.py` (with `shard_dims.py`): which dimension of every tensor splits under tensor parallelism;
- `unit_costs.py`: each unit's (block's) time, activations and parameters under a setting;
  `stage_costs.py`: time and memory of a run of units on a stage under a config; `cut.py`: pipeline cuts;
- `search.py`: the configurations tried and the best kept; `comparisons.py`: the hand baselines;
- `schedule.py`: pipeline schedules as action lists; `simulate.py`: their timing;
- `plan_json.py`, `plan_check.py`: the JSON form and its validation.

`plan.program()`, `plan.explain()`, `plan.to_html()`, `plan.timeline()` are conveniences that hand the
plan to the stages above (`partitioner.codegen`, `partitioner.show`), imported when called; nothing else
here imports upward.
"""
