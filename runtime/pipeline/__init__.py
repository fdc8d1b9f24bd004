"""Pipeline stages and their tensor slices: what pipeline, tensor-parallel and 3D programs run.

- `runner.py` (read first): `PipelineRunner`, one step of a pipeline plan on this rank;
- `executor.py`: runs the schedule's action list (forward, backward, send, receive per microbatch);
- `split_backward.py`: the zero-bubble schedules' backward in two actions, input gradient (I) then weight
  gradients (W);
- `stage.py`: `StageModel`, the generated segment functions of this stage over the rank's slice of the
  model's parameters;
- `random_streams.py`: each pipeline rank's own random stream (dropout masks), seeded after the build;
- `tensor_parallel.py`: the tensor group's collectives inside stage code (Megatron's f and g, the
  vocab-parallel embedding and cross entropy) and parameter sharding by placement.
- `vocab_logits.py`: the vocab-split logits a tensor-parallel model returns, handed to the user's loss_fn
  looking whole, so that its cross entropy runs vocab-parallel instead of gathering them.
"""
