"""The first thing to run on a new cluster: every plan kind trains on the GPUs it finds, like one process.

    PYTHONPATH=. python bench/gpu_smoke.py --device cuda      # on a GPU node (1 GPU: world-1 plans)
    PYTHONPATH=. python bench/gpu_smoke.py --device cpu       # the same code over Gloo, world 2-4

For the example GPT and a Hugging Face Llama (built from a config, no download), each plan kind this
machine can hold (dp2, ZeRO-3, tp2, pp2, 3D; with one GPU the world-1 plans: the single-rank DDP and ZeRO-3
paths) is compiled for this machine's topology and run by `launch_local(device=...)`: real processes, NCCL
on GPUs, Gloo on CPU, every tensor on the rank's device (runtime.device). One line per case:

    gpt    zero3    world 1  bf16  loss match yes (max rel diff 3.1e-03)  step 41.2 ms (plan 38.0)  MFU 31.5% (plan 34.1%)  peak 2150 MiB (plan 1995)

- loss match: every step's loss against one process training the same model on the same device in fp32 on
  the whole batch: within 1e-4 relative in fp32 (GPU reductions sum in another order), 3e-2 in bf16
  (bf16 compute against the fp32 reference), 6e-2 in fp8-mixed (its GEMM operands rounded to 3 mantissa
  bits, 2^-4 relative each, on top of bf16's).
- --torch-compile [BACKEND] adds every case again with `compile(..., torch_compile=BACKEND)` (default
  inductor): each block's code under torch.compile (runtime.engines.compiled), named "dp2+tc" and so on, with
  the same loss-match check; tensor-parallel cases are refused under torch_compile and print "refused".
- step: the median step time of rank 0 after the first (warm-up) step; MFU: the plan's MFU scaled by its
  predicted step time over the measured one (the same FLOP count); peak: the most memory any rank's
  probed step held (on GPU the allocator's max_memory_allocated), against the plan's peak per rank.

Exit status 1 if any case's losses do not match or a case fails; a failure prints its error and goes on.
Runs on torch 2.11 and later; CUDA-only calls are reached only with --device cuda.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: the repository root

from examples import gpt  # noqa: E402
from partitioner import compile  # noqa: E402
from runtime import launch_local  # noqa: E402

SEQ = {"cpu": 32, "cuda": 256}
VOCAB = {"cpu": 512, "cuda": 32768}
BATCH = {"cpu": 8, "cuda": 16}
STEPS = 4  # step 1 warms up (allocator, kernels); step 2 is probed for memory; steps 2-4 are timed
TOLERANCE = {"fp32": 1e-4, "bf16-mixed": 3e-2, "fp8-mixed": 6e-2}


# ---- models: module level, so that worker processes can import them ---------------------------------------


def gpt_cpu() -> gpt.GPT:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=SEQ["cpu"], vocab_size=VOCAB["cpu"]))


def gpt_cuda() -> gpt.GPT:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(n_layer=6, n_head=12, n_embd=768, block_size=SEQ["cuda"], vocab_size=VOCAB["cuda"]))


def llama_cpu():
    return _llama(hidden=64, layers=4, heads=4, kv=2, vocab=VOCAB["cpu"])


def llama_cuda():
    return _llama(hidden=768, layers=6, heads=12, kv=4, vocab=VOCAB["cuda"])


def _llama(*, hidden: int, layers: int, heads: int, kv: int, vocab: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden,
                                   num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                   max_position_embeddings=512, use_cache=False, tie_word_embeddings=False,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def lm_loss(output, targets) -> torch.Tensor:
    """Cross-entropy of the logits (the GPT's (logits, loss) tuple's first, a HF output's .logits)."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    logits = getattr(output, "logits", output)
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


MODELS = {"gpt": {"cpu": gpt_cpu, "cuda": gpt_cuda}, "llama": {"cpu": llama_cpu, "cuda": llama_cuda}}


# ---- cases -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    pins: dict
    torch_compile: str = ""  # the torch.compile backend of the case's plan; "": eager

    @property
    def world(self) -> int:
        return self.pins.get("dp", 1) * self.pins.get("tp", 1) * self.pins.get("pp", 1)


def cases_for(world_max: int) -> list[Case]:
    """The plan kinds this many devices hold: world-1 plans on one device, up to dp2 x tp2 x pp2 on eight."""
    if world_max == 1:
        return [Case("single", dict(dp=1, tp=1, pp=1, zero_stage=0)),
                Case("zero3", dict(dp=1, tp=1, pp=1, zero_stage=3))]
    out = [Case("dp2", dict(dp=2, tp=1, pp=1, zero_stage=0)),
           Case("zero3", dict(dp=2, tp=1, pp=1, zero_stage=3)),
           Case("tp2", dict(dp=1, tp=2, pp=1, zero_stage=0)),
           Case("pp2", dict(dp=1, tp=1, pp=2, zero_stage=0, schedule="1f1b"))]
    if world_max >= 8:
        out.append(Case("3d", dict(dp=2, tp=2, pp=2, zero_stage=1, schedule="1f1b")))
    elif world_max >= 4:
        out.append(Case("pp2tp2", dict(dp=1, tp=2, pp=2, zero_stage=0, schedule="1f1b")))
    return out


def topology(device: str, world: int) -> str:
    """This machine as a topology: the preset of the GPU it has, or local CPU processes."""
    if device == "cpu":
        return f"local:{world}"
    name = torch.cuda.get_device_name(0)
    memory = torch.cuda.get_device_properties(0).total_memory
    for key, preset in (("H200", "H200-141GB"), ("H100", "H100-80GB"), ("A100", "A100-80GB" if memory > 50e9
                                                                         else "A100-40GB")):
        if key in name:
            return f"{world}x{preset}"
    print(f"# {name}: no preset of this GPU; predictions use H100-80GB's", flush=True)
    return f"{world}xH100-80GB"


def batches(model_name: str, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    vocab = VOCAB[device]
    shape = (BATCH[device], SEQ[device])
    out = []
    for _ in range(STEPS):
        x = torch.randint(1 if model_name == "llama" else 0, vocab, shape, generator=g)
        out.append((x, torch.randint(0, vocab, shape, generator=g)))
    return out


def reference(model_fn, data, device: str) -> list[float]:
    """One process, fp32, the whole batch, on this machine's first device: the losses every plan must match."""
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    model = model_fn().to(dev)
    opt = adamw(model.parameters())
    losses = []
    for x, y in data:
        loss = lm_loss(model(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return losses


def run_case(model_name: str, case: Case, precision: str, device: str, ref: list[float], data) -> bool:
    model_fn = MODELS[model_name][device]
    model = model_fn()
    plan = compile(model, topology(device, case.world), example_inputs=(data[0][0][:2],),
                   global_batch_size=BATCH[device], precision=precision, alternatives=0,
                   torch_compile=case.torch_compile, **case.pins)
    del model
    out = launch_local(plan, model_fn, adamw, lm_loss, data, timeout_s=300, probe_step=1, device=device)
    diffs = [abs(a - b) / max(abs(b), 1e-6) for a, b in zip(out.losses, ref)]
    ok = max(diffs) <= TOLERANCE[precision]
    step = statistics.median(out.step_times_s[1:])
    pred = plan.predicted
    mfu = pred.mfu * pred.step_time_s / step
    peak = max(out.peak_step_bytes or [0])
    dtype = {"fp32": "fp32", "fp8-mixed": "fp8"}.get(precision, "bf16")
    print(f"{model_name:6} {case.name:7} world {case.world}  {dtype:4}  loss match {'yes' if ok else 'NO '} "
          f"(max rel diff {max(diffs):.1e})  step {step * 1e3:.1f} ms (plan {pred.step_time_s * 1e3:.1f})  "
          f"MFU {mfu:.1%} (plan {pred.mfu:.1%})  peak {peak / 2**20:.0f} MiB (plan "
          f"{pred.peak_memory_bytes / 2**20:.0f})", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--world", type=int, help="the most ranks a case may use (default: the GPUs found; cpu: 4)")
    p.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama")
    p.add_argument("--precisions", default="fp32,bf16-mixed", help="comma-separated: fp32, bf16-mixed, fp8-mixed "
                   "(fp8 GEMMs on H100/H200; emulated on CPU)")
    p.add_argument("--torch-compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="also run every case with torch_compile=BACKEND (default when given: inductor)")
    args = p.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print(f"gpu_smoke: --device cuda, but this machine has no CUDA (torch {torch.__version__}): run it on a "
                  "GPU node, or pass --device cpu", file=sys.stderr)
            return 2
        # fp32 means fp32: TF32 matmuls would differ from the reference by ~1e-3 (set before any worker starts)
        os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        found = torch.cuda.device_count()
        print(f"# {found} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL", flush=True)
    else:
        found = 4  # processes: a few, on a few cores
        print(f"# cpu, torch {torch.__version__}, Gloo", flush=True)
    world_max = min(found, args.world or found)
    failed = 0
    t0 = time.perf_counter()
    for model_name in args.models.split(","):
        data = None
        for precision in args.precisions.split(","):
            cases = cases_for(world_max)
            if args.torch_compile:
                cases += [Case(f"{c.name}+tc", c.pins, args.torch_compile) for c in cases]
            for case in cases:
                if case.torch_compile and case.pins.get("tp", 1) > 1:
                    print(f"{model_name:6} {case.name:7} world {case.world}  {precision}: refused (torch_compile "
                          "with tp > 1: tensor-parallel blocks call collectives inside them)", flush=True)
                    continue
                try:
                    if data is None:
                        data = batches(model_name, args.device)
                        ref = reference(MODELS[model_name][args.device], data, args.device)
                    failed += not run_case(model_name, case, precision, args.device, ref, data)
                except Exception as exc:  # report and go on: one broken plan kind should not hide the others
                    failed += 1
                    print(f"{model_name:6} {case.name:7} world {case.world}  {precision}: FAILED "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
                    if os.environ.get("GPU_SMOKE_TRACEBACK"):
                        traceback.print_exc()
    print(f"# {failed} case(s) failed; {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
