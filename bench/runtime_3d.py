"""Step time of compiled pipeline and tensor-parallel programs vs torch's own, same model, same batches, same run.

Benchmark script, not a test: figures are printed, never asserted. Usage (from anywhere)::

    python bench/runtime_3d.py                                   # gpipe/1f1b at pp 2 and 4, tp 2 (a few minutes)
    python bench/runtime_3d.py --rows pp2-gpipe,tp2 --steps 20
    python bench/runtime_3d.py --rounds 3                        # alternate compiled/torch 3 times, pool the steps
    python bench/runtime_3d.py --torch-same-work                 # torch pipeline also sums the tie and the loss
    python bench/runtime_3d.py --rows tp2 --losses               # and print both sides' loss at every step
    python bench/runtime_3d.py --torch-keep-freed                # torch ranks on the compiled ranks' malloc setting

Rows (the name is what ``--rows`` takes):

    pp2-gpipe pp2-1f1b pp4-gpipe pp4-1f1b   pipeline, dp = tp = 1, 4 microbatches of 2
    pp2-zb-h1 pp4-zb-h1                     the same, zero bubble (torch: ScheduleInterleavedZeroBubble, one stage per rank)
    pp2-interleaved-zb                      two stages per rank at stage % pp (torch: ScheduleInterleavedZeroBubble)
    pp2-zb-v                                two stages per rank in a V, 0 and 3 on rank 0 (torch: ScheduleZBVZeroBubble)
    pp2-dualpipe-v                          the same V, DualPipe-V's order (torch: ScheduleDualPipeV; its overlapped
                                            F/B pairs run as forward then backward on both sides). In both V rows
                                            the losses part from step 2 (~1e-3): torch's split backward and the
                                            tied wte / lm_head held as one Parameter by two stages of rank 0
                                            (docs/benchmarks.md, zero-bubble rows)
    tp2                                     tensor parallel, pp = dp = 1, one microbatch of 8

Pipeline rows. Model: the benchmark model of docs/torch-notes.md,
``examples.training.gpt_small_seeded`` (4 blocks, d=256, 4 heads, seq 128,
vocab 8192, wte tied to lm_head), fp32, AdamW (``examples.training.adamw``),
global batch 8; step s uses ``examples.gpt.example_batch(model, 8, seed=s)``.

    compiled  g = trace(model, (example_batch(model, 2)[0],))      token ids only: a graph traced with
                                                                    targets holds the loss and cannot be cut
              plan = compile(g, f"local:{pp}", global_batch_size=8, pp=pp, dp=1, tp=1, schedule=kind,
                             microbatch_size=2, precision="fp32", recompute="none")
              launch_local(plan, gpt_small_seeded, adamw, gpt_loss, batches, timeout_s=300).step_times_s
    torch     torch.distributed.pipelining: PipelineStage + ScheduleGPipe / Schedule1F1B, n_microbatches=4,
              on the plan's own cut (``plan.stages[i].blocks``). Each stage module is built by hand from a
              gpt_small_seeded() model: the first holds wte + wpe (+ dropout) and its blocks, a middle one its
              blocks, the last its blocks + ln_f + lm_head. The last stage's lm_head is therefore an untied
              copy of wte (equal at step 0, drifting after): fine for timing. loss_fn = cross entropy over
              the logits (gpt_loss on logits); schedule.step(..., return_outputs=False), so the last stage
              does not concatenate the logits, which the compiled program does not do either.

Tensor-parallel row. Model: ``examples.training.hf_llama_seeded`` (HF Llama from a
config: 4 layers, d=64, 4 heads / 2 kv heads, SwiGLU 128, vocab 512, untied
lm_head), fp32, AdamW, loss ``examples.training.hf_loss``; step s uses 8 x 64
random tokens from ``torch.Generator().manual_seed(s)``, targets the next token.
Both ranks see the whole batch (tensor ranks share the data).

    compiled  plan = compile(hf_llama_seeded(), "local:2", example_inputs=(tokens (2, 64),), global_batch_size=8,
                             pp=1, dp=1, tp=2, microbatch_size=8, precision="fp32", recompute="none")
              launch_local(plan, hf_llama_seeded, adamw, hf_loss, batches, timeout_s=300).step_times_s
    torch     DTensor TP: parallelize_module on each decoder layer over init_device_mesh("cpu", (2,)) with
              torchtitan's Llama plan (q/k/v_proj, gate/up_proj ColwiseParallel; o_proj, down_proj
              RowwiseParallel); embedding, norms and lm_head replicated. HF attention reshapes with -1
              heads and the q/kv head ratio is unchanged, so no attribute needs adjusting; the two sides'
              first-step losses are printed to show it is the same model and data (equal to 1e-6), and the
              largest loss difference over all steps.

The torch harness copies what launch_local's workers do, as runtime_dp does:
spawned processes (``multiprocessing`` "spawn" context),
``torch.set_num_threads(1)`` per rank, Gloo over a FileStore in a temp dir with
the same timeout, the global batches loaded from a file, every rank timing each
step with ``time.perf_counter`` around the whole step: pipeline
``schedule.step(...)``, ``optimizer.step()``, ``zero_grad(set_to_none=True)``;
tensor parallel ``hf_loss(model(idx), targets)``, ``backward()``, the same
optimizer calls and ``float(loss)``. Reported is rank 0's time on both sides
(launch_local's ``step_times_s`` is rank 0's): on a pipeline that is the first
stage, which runs the last backward, so its step spans the whole pipeline.

Work the compiled pipeline step does that torch's does not (by default): it
sums the tied wte/lm_head gradient over the first and last stage (2.1M floats,
8 MB) and sums the scalar loss over the pipeline (its contract is to return the
global loss on every rank). ``--torch-same-work`` makes the torch pipeline do
both as well (then the two sides train the identical tied model and their
losses agree at every step), as a torch user would write them: after
``schedule.step``, a blocking ``all_reduce`` of the tied gradient, then the
optimizer, then a blocking ``all_reduce`` of the loss. Where the compiled step
places the same two reductions is its own decision (runtime/pipeline/runner.py):
the tied gradient goes to the first stage as one message whose receive is posted
before that stage's last backward, so it travels while that backward runs, and
the sum comes back as another; the loss's sum is launched as soon as the last
backward is done and waited for after the optimizer. In the V rows (zb-v,
dualpipe-v) both ends of the V are on rank 0, so neither side has a tied
gradient to exchange. Both sides size received activations without a message
(torch from its shape inference, the compiled program from the microbatch's
own sizes). The compiled TP plan shards the embedding by vocabulary rows
(a vocab-parallel embedding, one more all-reduce per step); the torch side
keeps it replicated.

Each reported time is the median over the steps after the first ``--warmup``
(default 2) of ``--steps`` (default 12) per launch, pooled over ``--rounds``
(default 1; each round runs compiled then torch, alternating which goes
first). ratio = compiled / torch (goal <= 1.0). "predicted" is
``plan.predicted.step_time_s``, printed next to the measurement to calibrate
the cost model for this CPU. Noise between runs here is about +-10 % (docs/torch-notes.md#the-benchmark-model-and-its-baseline-step-times).

The compiled ranks keep the host memory their steps free (runtime.device.keep_freed_host_memory); torch's
ranks run on glibc's malloc defaults, as a torch user's do, unless ``--torch-keep-freed`` gives them the same
setting (docs/benchmarks.md says what it is worth to each side).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from torch_ranks import err_line, load_average, ms, rank_main, ratio, spawn, torch_keeps_freed  # noqa: E402

GLOBAL_BATCH = 8
MICROBATCH = 2  # pipeline rows: 4 microbatches of 2
LLAMA_SEQ, LLAMA_VOCAB = 64, 512  # hf_llama_seeded: max_position_embeddings 64, vocab 512
TIMEOUT_S = 300
GOAL_RATIO = 1.0  # issue 22: at or below torch's own, every row


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One comparison: a compiled plan and torch's implementation of the same parallelism."""

    name: str
    schedule: str  # "gpipe", "1f1b", "zb-h1", "interleaved-zb", "zb-v" or "dualpipe-v"; the tp row: one microbatch
    pp: int
    tp: int
    interleave: int = 1  # virtual stages per pipeline rank

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages pipeline rank `rank` holds: rank + k pp, or the V (rank, 2 pp - 1 - rank) of
        zb-v and dualpipe-v."""
        if self.v_shaped:
            return (rank, 2 * self.pp - 1 - rank)
        return tuple(range(rank, self.pp * self.interleave, self.pp))

    @property
    def v_shaped(self) -> bool:
        return self.schedule in ("zb-v", "dualpipe-v")

    @property
    def world(self) -> int:
        return self.pp * self.tp

    @property
    def torch_name(self) -> str:
        if self.tp > 1:
            return "DTensor parallelize_module (Colwise q/k/v/gate/up, Rowwise o/down)"
        return {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zb-h1": "ScheduleInterleavedZeroBubble",
                "interleaved-zb": "ScheduleInterleavedZeroBubble", "zb-v": "ScheduleZBVZeroBubble", "dualpipe-v": "ScheduleDualPipeV"}[self.schedule] \
            + " + PipelineStage"


ROWS = {r.name: r for r in (
    Row(name="pp2-gpipe", schedule="gpipe", pp=2, tp=1),
    Row(name="pp2-1f1b", schedule="1f1b", pp=2, tp=1),
    Row(name="pp4-gpipe", schedule="gpipe", pp=4, tp=1),
    Row(name="pp4-1f1b", schedule="1f1b", pp=4, tp=1),
    Row(name="pp2-zb-h1", schedule="zb-h1", pp=2, tp=1),
    Row(name="pp4-zb-h1", schedule="zb-h1", pp=4, tp=1),
    Row(name="pp2-interleaved-zb", schedule="interleaved-zb", pp=2, tp=1, interleave=2),
    Row(name="pp2-zb-v", schedule="zb-v", pp=2, tp=1, interleave=2),
    Row(name="pp2-dualpipe-v", schedule="dualpipe-v", pp=2, tp=1, interleave=2),  # m = 4 >= 2 pp, as it needs
    Row(name="tp2", schedule="1f1b", pp=1, tp=2),
)}


def llama_batch(seed: int) -> tuple:
    """(idx, targets), each (8, 64): random tokens and the next token (the last one a fresh random token)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, LLAMA_VOCAB, (GLOBAL_BATCH, LLAMA_SEQ), generator=g)  # (B, T)
    nxt = torch.randint(0, LLAMA_VOCAB, (GLOBAL_BATCH, 1), generator=g)
    return idx, torch.cat([idx[:, 1:], nxt], dim=1)


# ------------------------------------------------------------------ torch baseline: pipeline stage modules


def _logits_loss(logits, targets):
    """examples.training.gpt_loss on bare logits (the last stage returns logits, not (logits, loss))."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def _gpt_stage(model, blocks: tuple[str, ...]):
    """The nn.Module for one pipeline stage of examples.gpt.GPT, sharing `model`'s parameters.

    blocks: a StagePlan's names, e.g. ("prefix", "transformer.h.0") or ("transformer.h.3", "suffix").
    """
    import torch
    from torch import nn

    class GPTStage(nn.Module):
        def __init__(self):
            super().__init__()
            t = model.transformer
            self.first, self.last = "prefix" in blocks, "suffix" in blocks
            if self.first:
                self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop
            self.h = nn.ModuleList(model.get_submodule(b) for b in blocks if b not in ("prefix", "suffix"))
            if self.last:
                self.ln_f, self.lm_head = t.ln_f, model.lm_head  # untied here: wte lives on the first stage

        def forward(self, x):
            if self.first:  # as GPT.forward: x is idx (b, t)
                pos = torch.arange(0, x.size(1), dtype=torch.long, device=x.device)  # (t,)
                x = self.drop(self.wte(x) + self.wpe(pos))  # (b, t, n_embd)
            for block in self.h:
                x = block(x)
            if self.last:
                x = self.lm_head(self.ln_f(x))  # (b, t, vocab_size)
            return x

    return GPTStage()


def _torch_pipeline(row: Row, rank: int, batches: list, stage_blocks: list, same_work: bool):
    """One pipeline rank: (losses or None per step, step times). Losses on the last stage (every rank if same_work)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    from examples.training import adamw, gpt_small_seeded

    pp, S = row.pp, row.pp * row.interleave
    mine = row.stages_of(rank)
    first, last = 0 in mine, S - 1 in mine
    model = gpt_small_seeded()  # one model per rank: the V's stages 0 and S - 1 share its tied wte / lm_head
    modules = [_gpt_stage(model, tuple(stage_blocks[s])) for s in mine]
    stages = [PipelineStage(mod, s, S, device=torch.device("cpu")) for mod, s in zip(modules, mine)]
    n = GLOBAL_BATCH // MICROBATCH
    if row.schedule in ("zb-h1", "interleaved-zb"):  # with one stage per rank torch's interleaved ZB is ZB-H1
        schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=n, loss_fn=_logits_loss)
    elif row.v_shaped:
        cls = ScheduleZBVZeroBubble if row.schedule == "zb-v" else ScheduleDualPipeV
        schedule = cls(stages, n_microbatches=n, loss_fn=_logits_loss)
    else:
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[row.schedule]
        schedule = cls(stages[0], n_microbatches=n, loss_fn=_logits_loss)
    params = list({id(p): p for mod in modules for p in mod.parameters()}.values())  # a shared tie once
    optimizer = adamw(params)
    ends = sorted({0, pp - 1} if not row.v_shaped else {0})  # the ranks holding stage 0 and stage S - 1
    tie_group = dist.new_group(ends) if same_work and len(ends) > 1 else None  # every rank calls new_group
    tied = (modules[0].wte.weight if first else modules[-1].lm_head.weight if last else None) \
        if tie_group is not None else None
    losses, times = [], []
    for idx, targets in batches:
        t0 = time.perf_counter()
        mb_losses: list = []
        if first and last:   # zb-v, dualpipe-v: the V's two ends on rank 0
            schedule.step(idx, target=targets, losses=mb_losses, return_outputs=False)
        elif first:
            schedule.step(idx, return_outputs=False)
        elif last:
            schedule.step(target=targets, losses=mb_losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        if same_work and tied is not None:
            dist.all_reduce(tied.grad, group=tie_group)  # as the compiled step: sum the tied gradient
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = None
        if last or same_work:
            lv = torch.stack(mb_losses).mean().detach().reshape(1) if last else torch.zeros(1)
            if same_work:
                dist.all_reduce(lv)  # as the compiled step: only the last stage knows the loss
            value = float(lv.item())
        times.append(time.perf_counter() - t0)
        losses.append(value)
    return losses, times


def _torch_tp(row: Row, rank: int, batches: list):
    """One tensor-parallel rank: (losses, step times)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from examples.training import adamw, hf_llama_seeded, hf_loss

    model = hf_llama_seeded()
    mesh = init_device_mesh("cpu", (row.tp,))
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    optimizer = adamw(model.parameters())
    losses, times = [], []
    for idx, targets in batches:
        t0 = time.perf_counter()
        loss = hf_loss(model(idx), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach().item())
        times.append(time.perf_counter() - t0)
        losses.append(value)
    return losses, times


# ------------------------------------------------------------------ torch baseline: harness


def _torch_worker(row: Row, rank: int, tmpdir: str, stage_blocks: list, same_work: bool) -> None:
    """One rank of the torch baseline; mirrors runtime.launch.local._worker (threads, store, timeout, batches, timing)."""
    import warnings

    warnings.filterwarnings("ignore")

    def body(rank: int, batches: list):
        if row.pp > 1:
            return _torch_pipeline(row, rank, batches, stage_blocks, same_work)
        return _torch_tp(row, rank, batches)

    rank_main(rank, row.world, tmpdir, TIMEOUT_S, body)


def run_torch(row: Row, batches: list, stage_blocks: list, same_work: bool) -> dict:
    """Spawn the torch baseline's ranks; the loss per step (last stage's / rank 0's) and every rank's step times."""
    res = spawn(row.name, row.world, _torch_worker, lambda r, tmp: (row, r, tmp, stage_blocks, same_work), batches,
                TIMEOUT_S)
    # The pipeline's loss is known on its last stage; tensor ranks all hold the same loss.
    loss_rank = next(r for r in range(row.pp) if row.pp * row.interleave - 1 in row.stages_of(r))
    losses = res[loss_rank]["losses"] if row.pp > 1 else res[0]["losses"]
    return {"losses": losses, "step_times_s": res[0]["step_times_s"],
            "rank_times_s": [x["step_times_s"] for x in res]}


# ------------------------------------------------------------------ compiled program


def make_plan(row: Row, gpt_graph):
    import torch

    from examples.training import hf_llama_seeded
    from partitioner import compile

    if row.pp > 1:
        return compile(gpt_graph, f"local:{row.world}", global_batch_size=GLOBAL_BATCH, pp=row.pp, dp=1, tp=1,
                       schedule=row.schedule, interleave=row.interleave, microbatch_size=MICROBATCH,
                       precision="fp32", recompute="none")
    tokens = torch.randint(0, LLAMA_VOCAB, (2, LLAMA_SEQ), generator=torch.Generator().manual_seed(0))  # (2, 64)
    return compile(hf_llama_seeded(), f"local:{row.world}", example_inputs=(tokens,), global_batch_size=GLOBAL_BATCH,
                   pp=1, dp=1, tp=row.tp, microbatch_size=GLOBAL_BATCH, precision="fp32", recompute="none")


def run_compiled(row: Row, plan, batches: list) -> dict:
    from examples.training import (
        adamw,
        gpt_loss,
        gpt_small_seeded,
        hf_llama_seeded,
        hf_loss,
    )
    from runtime.launch.local import launch_local

    model_fn, loss_fn = (gpt_small_seeded, gpt_loss) if row.pp > 1 else (hf_llama_seeded, hf_loss)
    out = launch_local(plan, model_fn, adamw, loss_fn, batches, timeout_s=TIMEOUT_S)
    return {"losses": list(out.losses), "step_times_s": list(out.step_times_s),
            "collective_counts": out.collective_counts[0] if out.collective_counts else {}}


# ------------------------------------------------------------------ parent: orchestrate, print


def measure_row(row: Row, gpt_graph, batches: list, ns) -> dict:
    out: dict = {"row": row, "compiled": [], "torch": [], "torch_ranks": [], "errors": []}
    stage_blocks: list = []
    try:
        plan = make_plan(row, gpt_graph)
        out["predicted_s"] = float(plan.predicted.step_time_s)
        out["config"] = str(plan.config)
        stage_blocks = [list(s.blocks) for s in plan.stages]
        out["cut"] = " | ".join(",".join(b.replace("transformer.", "") for b in s) for s in stage_blocks)
        if row.pp > 1 and len(stage_blocks) != row.pp * row.interleave:
            raise ValueError(f"the plan has {len(stage_blocks)} stages for pp={row.pp} x {row.interleave}")
        if row.tp > 1:
            out["sharded"] = sum(p.spec != "R" for p in plan.placements)
    except Exception as e:  # noqa: BLE001 (report and go on)
        out["errors"].append(f"compile: {err_line(e)}")
        plan = None
    for rnd in range(ns.rounds):
        order = ("compiled", "torch") if rnd % 2 == 0 else ("torch", "compiled")
        for side in order:
            if plan is None:
                continue  # the torch pipeline needs the plan's cut too
            if any(err.startswith(side) for err in out["errors"]):
                continue  # failed once: do not retry every round
            label = f"{row.name} {side} (round {rnd + 1}/{ns.rounds})"
            print(f"  running {label} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            res = None
            for attempt in (1, 2):  # one retry: a rare native crash of a run should not void the row
                try:
                    res = run_compiled(row, plan, batches) if side == "compiled" else \
                        run_torch(row, batches, stage_blocks, ns.torch_same_work)
                    break
                except Exception as e:  # noqa: BLE001
                    print(f"    FAILED (attempt {attempt}/2): {e}", file=sys.stderr, flush=True)
                    if attempt == 1:
                        out.setdefault("retried", []).append(f"{side}: {err_line(e)}")
                    else:
                        out["errors"].append(f"{side}: {err_line(e)}")
            if res is None:
                continue
            timed = res["step_times_s"][ns.warmup:]
            out[side].extend(timed)
            out.setdefault(f"{side}_losses", res["losses"])
            if side == "compiled":
                out["collective_counts"] = res.get("collective_counts", {})
            else:
                out["torch_ranks"].append([t[ns.warmup:] for t in res["rank_times_s"]])
            print(f"    done in {time.perf_counter() - t0:.1f} s: median {statistics.median(timed) * 1e3:.1f} ms "
                  f"over {len(timed)} steps", file=sys.stderr, flush=True)
    for side in ("compiled", "torch"):
        if out[side]:
            out[f"{side}_s"] = statistics.median(out[side])
    if "compiled_s" in out and "torch_s" in out:
        out["ratio"] = out["compiled_s"] / out["torch_s"]
    if "compiled_s" in out and out.get("predicted_s"):
        out["meas_over_pred"] = out["compiled_s"] / out["predicted_s"]
    if out.get("compiled_losses") and out.get("torch_losses"):
        pairs = [(a, b) for a, b in zip(out["compiled_losses"], out["torch_losses"]) if b is not None]
        out["first_losses"] = pairs[0]
        out["loss_diff"] = max(abs(a - b) for a, b in pairs)
    return out


def _row_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ROWS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown rows {bad or text!r}; choose from {', '.join(ROWS)} "
                                         "(comma-separated, e.g. pp2-gpipe,tp2)")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="steps per launch, warm-up included (default 12)")
    ap.add_argument("--warmup", type=int, default=2, help="leading steps per launch left out of the median (default 2)")
    ap.add_argument("--rows", type=_row_names, default=list(ROWS),
                    help=f"comma-separated subset of {','.join(ROWS)} (default: all)")
    ap.add_argument("--rounds", type=int, default=1, help="launches per side per row, alternating order, steps pooled")
    ap.add_argument("--torch-same-work", action="store_true",
                    help="torch pipeline also all-reduces the tied wte/lm_head gradient and the loss, as the "
                         "compiled step does")
    ap.add_argument("--torch-keep-freed", action="store_true",
                    help="torch ranks keep freed host memory as the compiled ranks do (glibc never trims its heap)")
    ap.add_argument("--losses", action="store_true", help="also print both sides' loss at every step")
    ns = ap.parse_args(argv)
    torch_malloc = torch_keeps_freed(ns.torch_keep_freed)
    if ns.steps - ns.warmup < 1:
        ap.error(f"--steps {ns.steps} leaves no timed step after --warmup {ns.warmup}")

    import platform
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    import examples.gpt
    from examples.training import gpt_small_seeded
    from partitioner import trace

    rows = [ROWS[n] for n in ns.rows]
    model = gpt_small_seeded()
    n_params = sum(p.numel() for p in model.parameters())
    gpt_batches = [examples.gpt.example_batch(model, GLOBAL_BATCH, seed=s) for s in range(ns.steps)]
    llama_batches = [llama_batch(s) for s in range(ns.steps)]
    graph = trace(model, (examples.gpt.example_batch(model, 2)[0],)) if any(r.pp > 1 for r in rows) else None
    del model

    timed = ns.steps - ns.warmup
    print(f"runtime_3d: pipeline rows gpt_small (4 blocks, d=256, seq 128, vocab 8192, {n_params / 1e6:.2f}M unique "
          f"params), 4 microbatches of {MICROBATCH}; tp row hf_llama_seeded (4 layers, d=64, seq {LLAMA_SEQ}, vocab "
          f"{LLAMA_VOCAB}), one microbatch of {GLOBAL_BATCH}; fp32, AdamW, global batch {GLOBAL_BATCH}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs; Gloo, "
          f"1 thread per rank; {ns.steps} steps per launch, median of the last {timed} (after {ns.warmup} warm-up)"
          f"{f' x {ns.rounds} rounds pooled' if ns.rounds > 1 else ''}; rank 0's times; torch pipeline "
          f"{'with' if ns.torch_same_work else 'without'} the tied-gradient and loss all-reduces"
          f"; {torch_malloc}", flush=True)
    print(f"load average at start {load_average()} (1/5/15 min; anything else running on these cores skews the figures)")
    if timed < 10:
        print(f"note: only {timed} timed steps per launch (the benchmark's standard is >= 10)")

    results = [measure_row(r, graph, llama_batches if r.pp == 1 else gpt_batches, ns) for r in rows]

    print()
    hdr = (f"{'row':<10} {'pp':>3} {'tp':>3} {'compiled ms':>12} {'torch ms':>10} {'ratio':>7} "
           f"{'predicted ms':>13} {'meas/pred':>10}")
    print(hdr + "   (ms: median per step, rank 0; ratio = compiled / torch; meas/pred = compiled / predicted)")
    print("-" * len(hdr))
    for o in results:
        r = o["row"]
        print(f"{r.name:<10} {r.pp:>3} {r.tp:>3} {ms(o.get('compiled_s')):>12} {ms(o.get('torch_s')):>10} "
              f"{ratio(o.get('ratio')):>7} {ms(o.get('predicted_s')):>13} {ratio(o.get('meas_over_pred')):>10}")
    print()
    for o in results:
        r = o["row"]
        parts = []
        for side in ("compiled", "torch"):
            if o[side]:
                parts.append(f"{side} min/max {min(o[side]) * 1e3:.0f}/{max(o[side]) * 1e3:.0f} ms")
        if o["torch_ranks"]:
            per_rank = [statistics.median(t for launch in o["torch_ranks"] for t in launch[k]) * 1e3
                        for k in range(r.world)]
            parts.append("torch per-rank medians " + "/".join(f"{v:.0f}" for v in per_rank) + " ms")
        if "first_losses" in o:
            a, b = o["first_losses"]
            parts.append(f"first-step loss compiled {a:.6f} torch {b:.6f} (diff {abs(a - b):.1e}); "
                         f"max |loss diff| over steps {o['loss_diff']:.1e}")
        if "cut" in o and r.pp > 1:
            parts.append(f"cut {o['cut']}")
        if "sharded" in o:
            parts.append(f"compiled shards {o['sharded']} parameters")
        if o.get("collective_counts"):
            parts.append(f"compiled rank-0 collectives {o['collective_counts']}")
        print(f"{r.name} ({o.get('config', '?')} vs {r.torch_name}): " + "; ".join(parts))
        if ns.losses:
            for side in ("compiled", "torch"):
                vals = o.get(f"{side}_losses") or []
                print(f"  {side} losses: " + " ".join("-" if v is None else f"{v:.6f}" for v in vals))
        for e in o.get("retried", []):
            print(f"  retried once after: {e}")
        for e in o["errors"]:
            print(f"  ERROR {e}")
    print(f"load average at end {load_average()}")
    print()
    for o in results:
        head = f"GOAL {o['row'].name}:"
        if "ratio" not in o:
            print(f"{head} no ratio ({'; '.join(o['errors']) or 'not measured'}): FAIL")
            continue
        print(f"{head} compiled / torch = {ms(o['compiled_s'])} / {ms(o['torch_s'])} ms = {o['ratio']:.3f} "
              f"(goal <= {GOAL_RATIO:.2f}): {'PASS' if o['ratio'] <= GOAL_RATIO else 'FAIL'}")
    ratios = [o["ratio"] for o in results if "ratio" in o]
    if ratios:
        print(f"SUMMARY: {sum(x <= GOAL_RATIO for x in ratios)}/{len(results)} rows within the goal; ratio "
              f"geometric mean {statistics.geometric_mean(ratios):.3f}, worst {max(ratios):.3f}")
    return 1 if any(o["errors"] for o in results) else 0


if __name__ == "__main__":
    sys.exit(main())
