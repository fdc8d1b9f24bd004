"""The engines a rank's program builds: what one training step does on this rank.

- `step.py` (read first): `StepRunner`, one step (microbatches, loss, reduction, clipping, optimizer),
  the checks a program makes of the model it is given;
- `data_parallel.py`: DDP and ZeRO-1/2/3, the engine and what every stage shares; `dp_buckets.py`: the
  replicated stages' gradient buckets (DDP, ZeRO-1/2); `zero3.py`: ZeRO-3's units gathered just in time;
  `flat.py`: bucketing and the flat layout;
- `async_sgd.py`: replicas that step alone and average (local SGD, bounded staleness);
  `unreplicated.py`: a stage with no data parallelism;
- `mixed_precision.py`: bf16 / fp16 compute over fp32 masters, loss scaling; `recompute.py`: full and
  selective activation recomputation;
- `evaluation.py`: a forward in eval mode (dropout off, nothing trained) over code traced in training mode,
  what every runner's `evaluate` runs; `lr_schedule.py`: each rank's learning-rate scheduler.
"""
