"""Compile the example GPT for 8 local processes as pipeline x data x tensor parallelism, run it, check it.

    python -m examples.train_3d            # pp 2 x dp 2 x tp 2, ZeRO-1, 1F1B, 4 steps (about a minute)
    python -m examples.train_3d --free     # let the planner choose (on 8 CPU processes it picks data parallelism)

Prints the plan, a glimpse of rank 5's generated program, the losses of the 8
processes next to those of one process training on the whole batch, and the
largest parameter difference after training.
"""

from __future__ import annotations

import argparse

import torch

from examples.training import adamw, gpt_4l_seeded, gpt_loss, train_one_process
from partitioner import compile
from runtime import launch_local


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--free", action="store_true", help="do not pin pp/dp/tp: the planner chooses")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    pins = {} if args.free else dict(pp=2, dp=2, tp=2, zero_stage=1, schedule="1f1b", microbatch_size=2)
    model = gpt_4l_seeded()
    plan = compile(model, "local:8", example_inputs=(torch.randint(0, 512, (2, 16)),), global_batch_size=8,
                   precision="fp32", **pins)
    print(plan)
    src = plan.program(5).source
    print("\n--- rank 5's program (first lines of its stage table) ---")
    print("\n".join(line for line in src.splitlines() if line.startswith(("STAGES", "    1:", "TIED", "ACTIONS"))))

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 512, (8, 16), generator=g), torch.randint(0, 512, (8, 16), generator=g))
               for _ in range(args.steps)]
    out = launch_local(plan, gpt_4l_seeded, adamw, gpt_loss, batches)

    want, ref, _ = train_one_process(gpt_4l_seeded, adamw, gpt_loss, batches)
    diff = max((out.state_dict[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    print(f"\n{plan.world_size} processes: losses {[round(v, 6) for v in out.losses]}")
    print(f"one process:  losses {[round(v, 6) for v in want]}")
    print(f"largest parameter difference after {args.steps} steps: {diff:.2e}")


if __name__ == "__main__":  # workers are spawned: guard the script's body
    main()
