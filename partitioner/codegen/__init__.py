"""The code generator: a `Plan` -> one `RankProgram` per rank (stage 3 of trace -> OpGraph -> Plan -> RankProgram).

In: a plan. Out: readable Python per rank that imports only torch and `runtime` and defines
`build(model_fn, optimizer_fn, loss_fn)`; every line says which plan decision it carries out.

Read first: `program.py` (`program(plan, rank)` picks the generator). The generators:
- `data_parallel.py`: pp = tp = 1, any ZeRO stage (one DataParallel engine);
- `pipeline.py`: pipeline, tensor-parallel and 3D plans (stages, schedule, tensor slices);
- `async_sgd.py`: replicas that step alone and average;
- `common.py`: what they share (reduction and compression choices, parameter table, recompute lines).
The model's own code for those programs: `segments.py` cuts the traced graph into prefix, block templates
and suffix; `segment_tp.py` rewrites them for tensor parallelism, `segment_cp.py` for context parallelism,
`segment_ep.py` for expert parallelism (each MoE layer's experts over the ep group).
"""

from partitioner.codegen.common import CodegenError
from partitioner.codegen.program import RankProgram, expected_collectives, program, write_programs

__all__ = ["CodegenError", "RankProgram", "expected_collectives", "program", "write_programs"]
