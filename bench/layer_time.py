"""One transformer layer's training time on this device: the cost model's against the runtime's, measured.

    PYTHONPATH=. python bench/layer_time.py --device cuda                 # Llama-8B and -70B layers (H100/H200)
    PYTHONPATH=. python bench/layer_time.py --device cpu --shapes 512:256:1:1000

A Hugging Face Llama is compiled (world 1, bf16-mixed on GPUs, fp32 on CPU, no recomputation) and trained
in this process by the plan's own rank program, once with L layers and once with 2L: the difference over L
is one layer, free of the embedding, the LM head, the loss and per-step fixed costs. Printed per shape:
the plan's step time per layer without its optimizer step (forward, backward, and the engine's work on its
gradient buffers and fp32 masters) beside the measured one (the optimizer step's device time, read from
torch's profiler, taken out: its rate is the calibration's, not the layer model's), and the optimizer step
per layer, predicted and measured. The device preset's calibration is used unless
--calibration names a probe's file, so by default the figures say how far the presets are from this machine.

Shapes are `hidden:seq:L:vocab` (heads = hidden / 128 on GPUs, hidden / 64 on CPU; 8 kv heads; SwiGLU
width 3.5 x hidden, as Llama 3's). The defaults are a Llama-3-8B layer at seq 8192 and a Llama-3-70B
layer at seq 4096 (about 90 GB at L = 2 with Adam: an H200, or an H100 with --shapes of L = 1 only).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: the repository root

from cost_models.calibration import Calibration  # noqa: E402
from cost_models.optimizer import optimizer_bytes_per_s, optimizer_step_bytes  # noqa: E402
from partitioner import Topology, compile  # noqa: E402
from runtime.device import set_rank_device, synchronize  # noqa: E402
from runtime.launch.env import choose_device  # noqa: E402
from runtime.launch.measure import measure_step  # noqa: E402
from runtime.pipeline.program_module import exec_program  # noqa: E402

STEPS, TIMED = 6, 3  # the last TIMED of STEPS steps are timed; two more run under the profiler


def llama(hidden: int, layers: int, vocab: int, head_dim: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 7 // 2,
                                   num_attention_heads=hidden // head_dim, num_key_value_heads=8, vocab_size=vocab,
                                   max_position_embeddings=8192, use_cache=False, tie_word_embeddings=False,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def lm_loss(output, targets) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.logits.flatten(0, -2).float(), targets.flatten())


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)  # torch's default implementation for the device


def optimizer_seconds(runner, batches, device: torch.device) -> float:
    """Device (or CPU) seconds per step inside torch's Optimizer.step, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for b in batches:
            runner.step(b)
        synchronize()
    steps = [e for e in prof.events() if e.name.startswith("Optimizer.step")]
    if cuda:  # the annotation is on the host and on the device timeline, each with the kernels' time: one of them
        return sum(e.self_device_time_total for e in steps) / 1e6 / len(batches)
    return sum(e.cpu_time_total for e in steps) / 1e6 / len(batches)


def run_shape(hidden: int, seq: int, layers: int, vocab: int, device: torch.device, topology: str,
              calibration: str | None) -> dict:
    cuda = device.type == "cuda"
    fn = functools.partial(llama, hidden, layers, vocab, 128 if cuda else 64)
    with torch.device("meta"):
        meta = fn()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(1, vocab, (1, seq), generator=g), torch.randint(0, vocab, (1, seq), generator=g))
            for _ in range(STEPS + 2)]
    plan = compile(meta, topology, example_inputs=(data[0][0].to("meta"),), global_batch_size=1,
                   precision="bf16-mixed" if cuda else "fp32", alternatives=0, dp=1, tp=1, pp=1, zero_stage=0,
                   recompute="none", calibration=calibration)
    stage = plan.stages[0]
    runner = exec_program(plan.program(0).source, "<layer_time>", rank=0)["build"](fn, adamw, lm_loss)
    times = [measure_step(runner, b).seconds for b in data[:STEPS]]
    # the plan's optimizer step alone (its other per-step work, the engine's master copy and buffer zeroing, is in
    # the measured step outside Optimizer.step too, so it stays on the forward + backward side of both)
    topo = Topology.parse(topology)
    cal = Calibration.load(calibration) if calibration else Calibration.for_device(topo.device.name)
    plan_opt = stage.num_params * optimizer_step_bytes("adamw", plan.precision) / optimizer_bytes_per_s(
        "adamw", topo.device, cal)
    out = {"plan_step": plan.predicted.step_time_s, "plan_fb": plan.predicted.step_time_s - plan_opt,
           "step": statistics.median(times[-TIMED:]), "optim": optimizer_seconds(runner, data[STEPS:], device)}
    del runner
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--shapes", default=None, help="comma-separated hidden:seq:L:vocab (see the module docstring)")
    p.add_argument("--topology", default=None, help="the preset to predict with (default: this GPU's, or local:1)")
    p.add_argument("--calibration", default=None, help="a `partitioner probe` JSON to predict with (default: the preset's)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("layer_time: --device cuda, but this machine has no CUDA: pass --device cpu", file=sys.stderr)
        return 2
    shapes = args.shapes or ("4096:8192:2:32000,8192:4096:1:32000" if args.device == "cuda" else "512:256:1:1000")
    name, dev = choose_device(args.device, local_rank=0)
    set_rank_device(dev)
    dist.init_process_group(name, rank=0, world_size=1, store=dist.FileStore(tempfile.mktemp(), 1))
    if args.device == "cuda":
        gpu = torch.cuda.get_device_name(0)
        preset = "H200-141GB" if "H200" in gpu else "H100-80GB" if "H100" in gpu else "A100-80GB"
        topology = args.topology or f"1x{preset}"
    else:
        torch.set_num_threads(1)  # one rank of a local:N run has about one core
        gpu, topology = "cpu (1 thread)", args.topology or "local:1"
    print(f"# {gpu}, torch {torch.__version__}, predicted with {topology}; load {os.getloadavg()[0]:.2f}", flush=True)
    for spec in shapes.split(","):
        hidden, seq, layers, vocab = map(int, spec.split(":"))
        a = run_shape(hidden, seq, layers, vocab, dev, topology, args.calibration)
        b = run_shape(hidden, seq, 2 * layers, vocab, dev, topology, args.calibration)
        plan_fb = (b["plan_fb"] - a["plan_fb"]) / layers
        meas_fb = ((b["step"] - b["optim"]) - (a["step"] - a["optim"])) / layers
        plan_opt = ((b["plan_step"] - b["plan_fb"]) - (a["plan_step"] - a["plan_fb"])) / layers
        meas_opt = (b["optim"] - a["optim"]) / layers
        print(f"layer h{hidden} seq {seq}: forward+backward {meas_fb * 1e3:.2f} ms (plan {plan_fb * 1e3:.2f}, "
              f"measured/plan {meas_fb / plan_fb:.3f})  optimizer step {meas_opt * 1e3:.2f} ms (plan "
              f"{plan_opt * 1e3:.2f})", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
