"""Peak GPU memory of one training process: the planner's prediction against what CUDA's allocator reports.

Benchmark script, not a test: figures are printed, never asserted. The planner runs anywhere (meta-device
models); the measurement needs a CUDA device. Usage, from the project root::

    python bench/gpu_memory.py --predict pred.json            # here: the planner's world-1 plans, no GPU needed
    python bench/gpu_memory.py --measure meas.json            # on a GPU: the same cases trained for real
    python bench/gpu_memory.py --compare pred.json meas.json  # the table

Each case is a Hugging Face model built from a config (Llama with SDPA attention, GPT-2 with SDPA: the planner
rewrites eager attention to SDPA, so the runs measure that) trained on one device with the planner's recipe for
`precision="bf16-mixed"` and Adam, the recipe runtime.engines.mixed_precision runs: bf16 parameters and
gradients, fp32 master copies that Adam steps, gradients upcast to fp32 one parameter at a time; with
`recompute="full"` every decoder layer is checkpointed (only its input kept). Three steps, and the peaks
are those of the third (after a reset: the first steps allocate Adam's state).

The figures: `allocated` is torch.cuda.max_memory_allocated (the tensors), `reserved` max_memory_reserved (what
the caching allocator holds: allocated plus rounding and fragmentation), `fixed` the device memory in use
outside the allocator (CUDA context, kernels, cuBLAS workspace: total - free - reserved), and `predicted`
the plan's peak per rank, whose breakdown has the same parts (its fixed process bytes included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [
    # name, family, config, seq, microbatch, recompute
    ("llama-0.9B-s2048-mb4", "llama", dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
                                            num_attention_heads=16, num_key_value_heads=16), 2048, 4, "none"),
    ("llama-0.9B-s2048-mb16-full", "llama", dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
                                                  num_attention_heads=16, num_key_value_heads=16), 2048, 16, "full"),
    ("llama-1.9B-s4096-mb2", "llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=8,
                                            num_attention_heads=32, num_key_value_heads=8), 4096, 2, "none"),
    ("gpt2-0.8B-s1024-mb8", "gpt2", dict(n_embd=1536, n_layer=24, n_head=16), 1024, 8, "none"),
]
VOCAB = 32000


def build(family: str, cfg: dict, seq: int):
    import transformers as T

    if family == "llama":
        c = T.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=seq, use_cache=False, **cfg)
        c._attn_implementation = "sdpa"
        return T.LlamaForCausalLM(c)
    c = T.GPT2Config(vocab_size=VOCAB, n_positions=seq, use_cache=False, **cfg)
    c._attn_implementation = "sdpa"
    return T.GPT2LMHeadModel(c)


def predict(out: str) -> None:
    from partitioner import compile

    rows = {}
    for name, family, cfg, seq, mb, recompute in CASES:
        with torch.device("meta"):
            model = build(family, cfg, seq)
        idx = torch.zeros(mb, seq, dtype=torch.long, device="meta")
        t0 = time.perf_counter()
        plan = compile(model, "1xH100-80GB", example_inputs=(idx,), global_batch_size=mb, microbatch_size=mb,
                       dp=1, tp=1, pp=1, zero_stage=0, recompute=recompute, precision="bf16-mixed",
                       optimizer="adam", max_memory_fraction=1.0)
        m = plan.predicted.memory
        rows[name] = {"peak": plan.predicted.peak_memory_bytes,
                      "breakdown": {k: float(v) for k, v in vars(m).items() if isinstance(v, (int, float))},
                      "params": sum(p.numel() for p in model.parameters())}
        print(f"{name}: predicted peak {plan.predicted.peak_memory_bytes / 2**30:.2f} GiB "
              f"({time.perf_counter() - t0:.1f} s) {rows[name]['breakdown']}", flush=True)
    Path(out).write_text(json.dumps(rows, indent=1))


def measure(out: str, steps: int = 3) -> None:
    assert torch.cuda.is_available(), "--measure needs a CUDA device"
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    rows = {}
    for name, family, cfg, seq, mb, recompute in CASES:
        torch.manual_seed(0)
        with dev:  # initialised on the GPU: a CPU init of 2B parameters takes longer than the steps
            model = build(family, cfg, seq).to(torch.bfloat16)
        if recompute == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        masters = [p.detach().float() for p in params]
        for m in masters:
            m.requires_grad_(True)
        opt = torch.optim.Adam(masters, lr=1e-5)
        idx = torch.randint(0, VOCAB, (mb, seq), device=dev)
        for step in range(steps):
            if step == steps - 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = model(input_ids=idx, labels=idx).loss
            loss.backward()
            for m, p in zip(masters, params):  # upcast one at a time, as the engine does
                m.grad = p.grad.float()
                p.grad = None
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        free, total = torch.cuda.mem_get_info(dev)
        rows[name] = {"allocated": torch.cuda.max_memory_allocated(dev), "reserved": torch.cuda.max_memory_reserved(dev),
                      "fixed": total - free - torch.cuda.memory_reserved(dev), "step_s": dt,
                      "device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
        print(f"{name}: allocated {rows[name]['allocated'] / 2**30:.2f} GiB, reserved "
              f"{rows[name]['reserved'] / 2**30:.2f} GiB, fixed {rows[name]['fixed'] / 2**30:.2f} GiB, "
              f"step {dt * 1e3:.0f} ms", flush=True)
        del model, params, masters, opt, loss, idx
        torch.cuda.empty_cache()
    Path(out).write_text(json.dumps(rows, indent=1))


def compare(pred_path: str, meas_path: str) -> None:
    pred, meas = json.loads(Path(pred_path).read_text()), json.loads(Path(meas_path).read_text())
    g = 2 ** 30
    print(f"{'case':30} {'predicted':>9} {'allocated':>9} {'reserved':>9} {'fixed':>6} {'pred/(res+fixed)':>16} "
          f"{'reserved/alloc':>14}")
    for name in pred:
        if name not in meas:
            continue
        p, m = pred[name], meas[name]
        real = m["reserved"] + m["fixed"]
        print(f"{name:30} {p['peak'] / g:>9.2f} {m['allocated'] / g:>9.2f} {m['reserved'] / g:>9.2f} "
              f"{m['fixed'] / g:>6.2f} {p['peak'] / real:>16.3f} {m['reserved'] / m['allocated']:>14.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predict", metavar="OUT")
    ap.add_argument("--measure", metavar="OUT")
    ap.add_argument("--compare", nargs=2, metavar=("PRED", "MEAS"))
    args = ap.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.predict:
        predict(args.predict)
    if args.measure:
        measure(args.measure)
    if args.compare:
        compare(*args.compare)


if __name__ == "__main__":
    main()
