"""`partitioner compile MODEL` and `partitioner show PLAN`: a plan chosen, printed, explained, verified."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from cost_models.errors import DeclarationError
from partitioner.cli.common import EXIT_OK, LOOPBACK, emit, info, plan_options


def compile_command(args: argparse.Namespace) -> int:
    from cost_models.topology import Topology
    from partitioner.compile import compile
    from partitioner.loading import load_model

    topology = Topology.coerce(args.topology)  # a bad topology fails before the model is built
    model, inputs, module = load_model(args.model, device=args.device, batch_size=2)
    if hasattr(module, "example_batch"):
        # an (inputs, targets) training batch: runtime.run calls model(inputs) and gives the targets to
        # the loss, so the plan's code is traced the same way
        inputs = inputs[:1]
    t0 = time.perf_counter()
    plan = compile(model, topology, example_inputs=inputs, global_batch_size=args.global_batch_size,
                   **plan_options(args))
    plan = dataclasses.replace(plan, model_source=args.model)  # so `partitioner run` needs no --model
    dt = time.perf_counter() - t0
    if args.verify:
        info(str(_verify(args, plan, model, inputs)))
    if args.output:
        plan.save(args.output)
    if args.programs:
        plan.write_programs(args.programs)
    if args.json:
        args.stdout.write(plan.to_json())
        return EXIT_OK
    print(plan)
    if args.explain:
        print("\n" + plan.explain())
    wrote = [f"plan written to {args.output}"] if args.output else []
    if args.programs:
        wrote.append(f"programs written to {args.programs}/ (run: torchrun --nproc-per-node {plan.world_size} "
                     f"{LOOPBACK} -m runtime.run {args.programs}/plan.json --model {args.model})")
    print(f"\ncompiled in {dt:.2f} s" + "".join("; " + w for w in wrote))
    return EXIT_OK


def _verify(args: argparse.Namespace, plan: Any, model: Any, inputs: tuple[Any, ...]) -> Any:
    """compile --verify: as compile(..., verify=True), on a copy of the model; a model built on meta (--device
    meta) is built again on the CPU from its factory, with random token ids for inputs."""
    import copy

    import torch

    from partitioner.loading import load_module
    from runtime.verify.check import MAX_VERIFY_ELEMENTS, num_parameters

    if not any(p.is_meta for p in model.parameters()):
        return plan.verify(lambda: copy.deepcopy(model), inputs)
    n = num_parameters(plan)
    if n > MAX_VERIFY_ELEMENTS:
        raise DeclarationError(f"--verify: {args.model} has {n:.3g} parameter elements; verifying builds it "
                               f"pp * tp + 1 times on the CPU (over {MAX_VERIFY_ELEMENTS:.3g} is refused): verify "
                               "a smaller configuration of the same model code, or drop --verify")
    module, name = load_module(args.model)
    factory = getattr(module, name)
    return plan.verify((lambda: copy.deepcopy(factory)) if isinstance(factory, torch.nn.Module) else factory)


def show_command(args: argparse.Namespace) -> int:
    from partitioner.planner.plan import Plan

    plan = Plan.load(args.plan)
    if args.rank is not None:
        if not 0 <= args.rank < plan.world_size:
            raise DeclarationError(f"--rank {args.rank}: {args.plan} has ranks 0..{plan.world_size - 1} "
                                   f"(world size {plan.world_size})")
        source = plan.program(args.rank).source
        if args.json:
            emit(args, {"rank": args.rank, "source": source})
        else:
            print(source, end="")
        return EXIT_OK
    if args.json:
        args.stdout.write(plan.to_json())
        return EXIT_OK
    print(plan)
    if args.explain:
        print("\n" + plan.explain())
    return EXIT_OK
