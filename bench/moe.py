"""Step time of compiled expert-parallel programs vs the same model with its experts replicated (ep=1).

Benchmark script, not a test: figures are printed, never asserted. Usage (from anywhere)::

    python bench/moe.py                          # ep2 vs ep1 on 2 ranks (about a minute)
    python bench/moe.py --worlds 2 4 --steps 12  # and ep4 vs ep1 on 4 ranks

Model: a Hugging Face Mixtral from a config (``--layers`` 2, hidden ``--hidden`` 64, 8 experts of width
128, top-2, vocab 512, seq ``--seq`` 64, no load-balancing loss so both sides compute the same), fp32, SGD
with momentum, global batch 8; step s uses batch s of a fixed generator. Per world W, in this one run:

    ep=1   plan = compile(model, f"local:{W}", ..., dp=W, ep=1)   every rank holds every expert and runs the
           module's own forward (HF's grouped-mm experts on its tokens); gradients all-reduced over W
    ep=W   plan = compile(model, f"local:{W}", ..., dp=W, ep=W)   each rank holds E/W experts; each MoE layer's
           tokens travel to their experts and back by all-to-alls (runtime.experts) in the generated code

Each time is the median over the steps after the first ``--warmup`` (default 2) of ``--steps`` (default 10).
tokens/s = global batch x seq / median step. all-to-all share = the seconds rank 0 spent inside the blocking
all-to-alls (``Collectives.seconds``: dispatch, combine, their gradients and the count exchanges, waiting for
the slowest peer included) over the sum of its step times, every step counted (warm-up included). Ratios are
ep=W / ep=1. The two sides run different expert kernels: ep=1 Hugging Face's own (on CPU transformers'
grouped-mm fallback), ep=W the runtime's one matmul chain per local expert (runtime.experts.grouped_experts),
so the ratio mixes the kernels' speed with what dividing the experts saves and the all-to-alls cost. torch 2.13 ships no expert-parallel layer of its own to compare with (its MoE building blocks,
`torch._grouped_mm`, are single-device), so there is no torch baseline row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

GLOBAL_BATCH, VOCAB, EXPERTS = 8, 512, 8


def model_fn(layers: int = 2, hidden: int = 64):
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                     num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=512,
                                     use_cache=False, router_jitter_noise=0.0, tie_word_embeddings=False)
    return transformers.MixtralForCausalLM(cfg)


class _Model:
    """model_fn with the sizes bound, picklable for the spawned ranks."""

    def __init__(self, layers: int, hidden: int):
        self.layers, self.hidden = layers, hidden

    def __call__(self):
        return model_fn(self.layers, self.hidden)


def run(world: int, ep: int, args) -> dict:
    import torch

    from examples.training import hf_loss, sgd
    from partitioner import compile
    from runtime import launch_local

    build = _Model(args.layers, args.hidden)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, VOCAB, (GLOBAL_BATCH, args.seq), generator=g),
             torch.randint(0, VOCAB, (GLOBAL_BATCH, args.seq), generator=g)) for _ in range(args.steps)]
    plan = compile(build(), f"local:{world}", example_inputs=(torch.randint(0, VOCAB, (2, args.seq)),),
                   global_batch_size=GLOBAL_BATCH, precision="fp32", dp=world, ep=ep, zero_stage=0,
                   microbatch_size=GLOBAL_BATCH // world, alternatives=0)
    out = launch_local(plan, build, sgd, hf_loss, data, timeout_s=600)
    step = statistics.median(out.step_times_s[args.warmup:])
    a2a = out.collective_seconds[0].get("all_to_all", 0.0) if out.collective_seconds else 0.0
    return {"step": step, "tokens_s": GLOBAL_BATCH * args.seq / step, "a2a_share": a2a / sum(out.step_times_s),
            "predicted": plan.predicted.step_time_s, "losses": out.losses}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args(argv)
    print(f"Mixtral {args.layers} layers, hidden {args.hidden}, {EXPERTS} experts top-2, seq {args.seq}, "
          f"global batch {GLOBAL_BATCH}, fp32, {args.steps} steps ({args.warmup} warm-up)")
    print(f"{'world':>5} {'plan':>6} {'step ms':>9} {'tokens/s':>9} {'a2a share':>9} {'predicted ms':>12} "
          f"{'step ratio':>10} {'tok/s ratio':>11}")
    for w in args.worlds:
        base = run(w, 1, args)
        print(f"{w:>5} {'ep1':>6} {base['step'] * 1e3:>9.1f} {base['tokens_s']:>9.0f} {base['a2a_share']:>9.1%} "
              f"{base['predicted'] * 1e3:>12.2f} {1.0:>10.2f} {1.0:>11.2f}")
        r = run(w, w, args)
        print(f"{w:>5} {f'ep{w}':>6} {r['step'] * 1e3:>9.1f} {r['tokens_s']:>9.0f} {r['a2a_share']:>9.1%} "
              f"{r['predicted'] * 1e3:>12.2f} {r['step'] / base['step']:>10.2f} "
              f"{r['tokens_s'] / base['tokens_s']:>11.2f}")
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"]))
        print(f"      losses of ep{w} vs ep1: largest relative difference {diff:.1e}")


if __name__ == "__main__":
    main()
