"""Megatron tensor parallelism (runtime.pipeline.tensor_parallel) computes what one process computes.

Tier (a): shard/unshard round trips and the fused-qkv layout as plain data;
the parallel cross entropy and embedding on one rank (group None) against
F.cross_entropy / F.embedding, and a float64 gradcheck. Tier (c): real Gloo
process groups (2 and 4 spawned processes, FileStore, 1 thread each). Every
rank builds the full reference model from the same seed, cuts its shards with
`shard_parameter` and runs the Megatron version; it saves its outputs and
local gradients, and the pytest process unshards the gradients and compares
them with the single-process model (and with torch's DTensor TP, run in the
same world) at rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.gpt import MLP, CausalSelfAttention, GPTConfig
from runtime.comm.collectives import Collectives
from runtime.pipeline.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tp,
    TPContext,
    gather_from_tp,
    keep_token_shards,
    parse_spec,
    reduce_from_tp,
    scatter_to_tp,
    shard_parameter,
    sp_gather,
    unshard_parameter,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from ranks import gloo_group

RTOL, ATOL = 1e-5, 1e-6
CFG = GPTConfig(n_embd=16, n_head=4, block_size=8, vocab_size=32, n_layer=1, dropout=0.0)
B, T = 2, 8
IGNORE = -100


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


# ---- the cases: built from fixed seeds, identically in every process ------------------------------
def _mlp_case():
    torch.manual_seed(0)
    mlp = MLP(CFG)
    x = torch.randn(B, T, CFG.n_embd)
    gy = torch.randn(B, T, CFG.n_embd)  # the upstream gradient
    return mlp, x, gy


def _attn_case():
    torch.manual_seed(1)
    attn = CausalSelfAttention(CFG)
    with torch.no_grad():  # nn.Linear's default init leaves biases small; make the bias gradients count
        attn.c_attn.bias.normal_()
        attn.c_proj.bias.normal_()
    x = torch.randn(B, T, CFG.n_embd)
    gy = torch.randn(B, T, CFG.n_embd)
    return attn, x, gy


def _vocab_case():
    torch.manual_seed(2)
    wte = torch.randn(CFG.vocab_size, CFG.n_embd) * 0.5
    ids = torch.randint(0, CFG.vocab_size, (B, T))
    targets = torch.randint(0, CFG.vocab_size, (B, T))
    targets[0, :2] = IGNORE  # ignored tokens count neither in the loss nor in the mean
    return wte, ids, targets


def _seq_case(seed: int, shape) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(shape)


# ---- single process: the truth -----------------------------------------------------------------
def _reference(module, x, gy) -> dict:
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(gy)
    return {"y": y.detach(), "x_grad": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


@functools.cache
def _mlp_reference() -> dict:
    return _reference(*_mlp_case())


@functools.cache
def _attn_reference() -> dict:
    return _reference(*_attn_case())


@functools.cache
def _vocab_reference() -> dict:
    wte, ids, targets = _vocab_case()
    wte = wte.clone().requires_grad_()
    logits = F.linear(F.embedding(ids, wte), wte)  # tied embedding / LM head
    logits.retain_grad()
    loss = F.cross_entropy(logits.view(-1, CFG.vocab_size), targets.view(-1), ignore_index=IGNORE)
    loss.backward()
    return {"loss": loss.detach(), "wte": wte.grad, "logits": logits.grad}


# ---- one rank: the Megatron versions -------------------------------------------------------------
def _run_mlp(rank: int, world: int, group, coll: Collectives) -> dict:
    """Column c_fc (S(0)), GELU, row c_proj (S(1), bias replicated): f before, g after."""
    mlp, x, gy = _mlp_case()
    fc = ColumnParallelLinear.from_linear(mlp.c_fc, rank, world, group, coll)
    proj = RowParallelLinear.from_linear(mlp.c_proj, rank, world, group, coll)
    x = x.clone().requires_grad_()
    coll.reset()
    y = proj(F.gelu(fc(x)))  # (B, T, h)
    counts_forward = dict(coll.counts)
    y.backward(gy)
    return {"y": y.detach(), "x_grad": x.grad, "counts_forward": counts_forward, "counts": dict(coll.counts),
            "c_fc.weight": fc.weight.grad, "c_fc.bias": fc.bias.grad,
            "c_proj.weight": proj.weight.grad, "c_proj.bias": proj.bias.grad}


def _run_attention(rank: int, world: int, group, coll: Collectives) -> dict:
    """nanoGPT attention on n_head / tp local heads: c_attn S(0) with fused=3, c_proj S(1)."""
    attn, x, gy = _attn_case()
    nh, hs = CFG.n_head // world, CFG.n_embd // CFG.n_head
    w_qkv = shard_parameter(attn.c_attn.weight, "S(0)", rank, world, fused=3).requires_grad_()  # (3 nh hs, h)
    b_qkv = shard_parameter(attn.c_attn.bias, "S(0)", rank, world, fused=3).requires_grad_()
    w_o = shard_parameter(attn.c_proj.weight, "S(1)", rank, world).requires_grad_()  # (h, nh hs)
    b_o = shard_parameter(attn.c_proj.bias, "R", rank, world).requires_grad_()
    x = x.clone().requires_grad_()
    coll.reset()
    q, k, v = F.linear(copy_to_tp(x, group, coll), w_qkv, b_qkv).split(nh * hs, dim=2)
    q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
    k = k.view(B, T, nh, hs).transpose(1, 2)
    v = v.view(B, T, nh, hs).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
    att = att.masked_fill(attn.bias[:, :, :T, :T] == 0, float("-inf")).softmax(dim=-1)
    y = (att @ v).transpose(1, 2).reshape(B, T, nh * hs)  # (B, T, nh hs)
    y = reduce_from_tp(F.linear(y, w_o), group, coll) + b_o  # (B, T, h)
    y.backward(gy)
    return {"y": y.detach(), "x_grad": x.grad, "counts": dict(coll.counts),
            "c_attn.weight": w_qkv.grad, "c_attn.bias": b_qkv.grad, "c_proj.weight": w_o.grad,
            "c_proj.bias": b_o.grad}


def _run_vocab(rank: int, world: int, group, coll: Collectives) -> dict:
    """Vocab-parallel embedding and tied LM head (wte S(0)), parallel cross entropy."""
    wte, ids, targets = _vocab_case()
    w = shard_parameter(wte, "S(0)", rank, world).requires_grad_()  # (V/tp, h)
    start = rank * w.shape[0]
    coll.reset()
    h = vocab_parallel_embedding(ids, w, start, group, coll)  # (B, T, h)
    logits = F.linear(copy_to_tp(h, group, coll), w)  # (B, T, V/tp)
    logits.retain_grad()
    loss = vocab_parallel_cross_entropy(logits, targets, start, group, coll, ignore_index=IGNORE)
    counts_forward = dict(coll.counts)
    loss.backward()
    return {"loss": loss.detach(), "wte": w.grad, "logits": logits.grad, "counts_forward": counts_forward,
            "counts": dict(coll.counts)}


def _run_sequence(rank: int, world: int, group, coll: Collectives) -> dict:
    """gather_from_tp / scatter_to_tp along the sequence (dim 1) with rank-dependent gradients."""
    full = _seq_case(10, (B, T, CFG.n_embd))
    x = full.chunk(world, dim=1)[rank].clone().requires_grad_()  # (B, T/tp, h)
    coll.reset()
    g = gather_from_tp(x, 1, group, coll)  # (B, T, h)
    g.backward(_seq_case(100 + rank, (B, T, CFG.n_embd)))
    z = _seq_case(200 + rank, (B, T, CFG.n_embd)).requires_grad_()  # each rank's partial sums
    s = scatter_to_tp(z, 1, group, coll)  # (B, T/tp, h)
    s.backward(_seq_case(300 + rank, (B, T // world, CFG.n_embd)))
    return {"gathered": g.detach(), "x_grad": x.grad, "scattered": s.detach(), "z_grad": z.grad,
            "counts": dict(coll.counts)}


def _shared_gather_case():
    torch.manual_seed(11)
    return torch.randn(B, T, CFG.n_embd), [torch.randn(CFG.n_embd, CFG.n_embd) for _ in range(3)]


def _run_shared_gather(rank: int, world: int, group, coll: Collectives) -> dict:
    """Three column-parallel readers (q, k, v) of one sequence-parallel value, as generated code runs them:
    one sp_gather, each reader saving the gathered tokens, kept as shards (keep_token_shards)."""
    full, weights = _shared_gather_case()
    x = full.chunk(world, dim=1)[rank].clone().requires_grad_()
    local = [w.chunk(world, dim=0)[rank].clone().requires_grad_() for w in weights]
    tp = TPContext(group, coll, rank, world)
    coll.reset()
    with keep_token_shards():
        gathered = sp_gather(x, 1, tp)
        outs = [F.linear(gathered, w) for w in local]
    counts_forward = dict(coll.counts)
    sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()
    return {"x_grad": x.grad, "w_grads": [w.grad for w in local], "counts_forward": counts_forward,
            "counts": dict(coll.counts)}


def _run_dtensor(rank: int, world: int) -> dict:
    """torch's DTensor TP on the same MLP: the oracle."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mlp, x, gy = _mlp_case()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(mlp, mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
    x = x.clone().requires_grad_()
    y = mlp(x)
    y.backward(gy)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in mlp.named_parameters()}
    y = y.full_tensor() if isinstance(y, DTensor) else y
    return {"y": y.detach(), "x_grad": x.grad, **grads}


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    with gloo_group(rank, world, store_path):
        group, coll = dist.group.WORLD, Collectives()
        results = {"mlp": _run_mlp(rank, world, group, coll),
                   "attn": _run_attention(rank, world, group, coll),
                   "vocab": _run_vocab(rank, world, group, coll),
                   "seq": _run_sequence(rank, world, group, coll),
                   "shared": _run_shared_gather(rank, world, group, coll),
                   "dtensor": _run_dtensor(rank, world)}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def worlds(spawned):
    return functools.partial(spawned, _worker)


# ---- tier (c): equivalence with one process and with torch -----------------------------------
MLP_SPECS = {"c_fc.weight": "S(0)", "c_fc.bias": "S(0)", "c_proj.weight": "S(1)", "c_proj.bias": "R"}
ATTN_SPECS = {"c_attn.weight": ("S(0)", 3), "c_attn.bias": ("S(0)", 3), "c_proj.weight": ("S(1)", 1),
              "c_proj.bias": ("R", 1)}


def _assert_replicated(ranks: list[dict], key: str, want: torch.Tensor) -> None:
    for r, got in enumerate(ranks):
        _close(got[key], want, f"{key} on rank {r}")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_megatron_mlp_matches_one_process(worlds, world):
    ranks = [w["mlp"] for w in worlds(world)]
    want = _mlp_reference()
    _assert_replicated(ranks, "y", want["y"])
    _assert_replicated(ranks, "x_grad", want["x_grad"])
    for name, spec in MLP_SPECS.items():
        _close(unshard_parameter([r[name] for r in ranks], spec), want[name], f"grad of {name}")
        if spec == "R":  # a replicated parameter's gradient is the same on every rank
            _assert_replicated(ranks, name, want[name])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_megatron_mlp_issues_one_all_reduce_each_way(worlds, world):
    for r, got in enumerate(worlds(world)):
        assert got["mlp"]["counts_forward"] == {"all_reduce": 1}, f"rank {r}: forward"  # g
        assert got["mlp"]["counts"] == {"all_reduce": 2}, f"rank {r}: forward + backward"  # g, then f


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fused_qkv_attention_split_by_heads_matches_one_process(worlds, world):
    ranks = [w["attn"] for w in worlds(world)]
    want = _attn_reference()
    _assert_replicated(ranks, "y", want["y"])
    _assert_replicated(ranks, "x_grad", want["x_grad"])
    for name, (spec, fused) in ATTN_SPECS.items():
        _close(unshard_parameter([r[name] for r in ranks], spec, fused), want[name], f"grad of {name}")
    assert ranks[0]["counts"] == {"all_reduce": 2}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_embedding_and_cross_entropy_match_one_process(worlds, world):
    ranks = [w["vocab"] for w in worlds(world)]
    want = _vocab_reference()
    _assert_replicated(ranks, "loss", want["loss"])
    _close(unshard_parameter([r["wte"] for r in ranks], "S(0)"), want["wte"], "grad of the tied wte")
    _close(unshard_parameter([r["logits"] for r in ranks], "S(2)"), want["logits"], "grad of the logits")
    # embedding g; cross entropy's max, sum of exp and target logit; the head's f in backward
    assert ranks[0]["counts_forward"] == {"all_reduce": 4}
    assert ranks[0]["counts"] == {"all_reduce": 5}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_gather_and_scatter(worlds, world):
    ranks = [w["seq"] for w in worlds(world)]
    full = _seq_case(10, (B, T, CFG.n_embd))
    upstream = sum(_seq_case(100 + r, (B, T, CFG.n_embd)) for r in range(world))  # summed by reduce-scatter
    partial = sum(_seq_case(200 + r, (B, T, CFG.n_embd)) for r in range(world))
    gathered_grads = torch.cat([_seq_case(300 + r, (B, T // world, CFG.n_embd)) for r in range(world)], dim=1)
    for r, got in enumerate(ranks):
        _close(got["gathered"], full, f"all-gather on rank {r}")
        _close(got["x_grad"], upstream.chunk(world, dim=1)[r], f"reduce-scattered gradient on rank {r}")
        _close(got["scattered"], partial.chunk(world, dim=1)[r], f"reduce-scatter on rank {r}")
        _close(got["z_grad"], gathered_grads, f"all-gathered gradient on rank {r}")
        assert got["counts"] == {"all_gather": 2, "reduce_scatter": 2}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_readers_of_one_sequence_parallel_value_gather_it_once_each_way(worlds, world):
    """q, k and v read one gathered value: forward gathers it once, backward once (for all three saved
    copies), and its gradient is reduce-scattered once, as Megatron-LM's fused qkv does."""
    full, weights = _shared_gather_case()
    x = full.clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in weights]
    sum((F.linear(x, w) * (i + 1)).sum() for i, w in enumerate(ws)).backward()
    for r, got in enumerate(w["shared"] for w in worlds(world)):
        _close(got["x_grad"], x.grad.chunk(world, dim=1)[r], f"input gradient on rank {r}")
        for i, g in enumerate(got["w_grads"]):
            _close(g, ws[i].grad.chunk(world, dim=0)[r], f"grad of weight {i} on rank {r}")
        assert got["counts_forward"] == {"all_gather": 1}
        assert got["counts"] == {"all_gather": 2, "reduce_scatter": 1}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_megatron_mlp_matches_dtensor_tp(worlds, world):
    results = worlds(world)
    oracle = results[0]["dtensor"]
    for r, got in enumerate(w["mlp"] for w in results):
        _close(got["y"], oracle["y"], f"output on rank {r} vs DTensor")
        _close(got["x_grad"], oracle["x_grad"], f"input gradient on rank {r} vs DTensor")
    for name, spec in MLP_SPECS.items():
        got = unshard_parameter([w["mlp"][name] for w in results], spec)
        _close(got, oracle[name], f"grad of {name} vs DTensor")


# ---- tier (a): shards as data, one-rank numerics ---------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("shape,spec,fused", [
    ((24, 8), "S(0)", 1), ((24, 8), "S(1)", 1), ((24, 8), "S(0)", 3), ((8, 24), "S(1)", 3),  # Conv1D qkv
    ((24,), "S(0)", 3), ((4, 24, 2), "S(1)", 2), ((24, 8), "R", 1)])
def test_shard_unshard_round_trip(world, shape, spec, fused):
    t = torch.randn(shape)
    shards = [shard_parameter(t, spec, r, world, fused) for r in range(world)]
    dim = parse_spec(spec)
    for s in shards:
        want = list(shape)
        if dim is not None:
            want[dim] //= world
        assert list(s.shape) == want and s.is_contiguous()
    assert torch.equal(unshard_parameter(shards, spec, fused), t)


@pytest.mark.parametrize("conv1d", [False, True])
def test_fused_qkv_shard_holds_its_own_heads(conv1d):
    """Rank r's slice of a fused [q; k; v] is [q_r; k_r; v_r]: its heads of each, in that order."""
    h, world = 8, 4
    w = torch.randn(3 * h, h)  # nn.Linear [out, in]
    q, k, v = w.split(h, dim=0)
    for r in range(world):
        rows = slice(r * h // world, (r + 1) * h // world)
        want = torch.cat([q[rows], k[rows], v[rows]])
        if conv1d:  # HF Conv1D stores [in, out]: the same split on dim 1
            assert torch.equal(shard_parameter(w.T, "S(1)", r, world, fused=3), want.T)
        else:
            assert torch.equal(shard_parameter(w, "S(0)", r, world, fused=3), want)


@pytest.mark.parametrize("call,match", [
    (lambda: shard_parameter(torch.zeros(6, 4), "S(0)", 0, 4), "not divisible by fused \\* world = 4"),
    (lambda: shard_parameter(torch.zeros(12, 4), "S(0)", 0, 2, fused=4), "fused \\* world = 8; .* dividing 3"),
    (lambda: shard_parameter(torch.zeros(10, 4), "S(0)", 0, 1, fused=3), "does not hold 3 equal chunks"),
    (lambda: shard_parameter(torch.zeros(4, 4), "S(2)", 0, 2), "shards dim 2 of a 2-d tensor"),
    (lambda: shard_parameter(torch.zeros(4, 4), "Shard(0)", 0, 2), "neither 'R'"),
    (lambda: shard_parameter(torch.zeros(4, 4), "S(0)", 2, 2), "rank 2 is outside 0..1"),
    (lambda: unshard_parameter([], "S(0)"), "no shards"),
])
def test_shard_errors_say_what_and_how(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_shard_parameter_copies():
    t = torch.randn(4, 4, requires_grad=True)
    s = shard_parameter(t, "R", 0, 1)
    assert not s.requires_grad and s.data_ptr() != t.data_ptr()


def test_cross_entropy_alone_matches_torch():
    """group None (tp = 1): the whole vocabulary on one rank is F.cross_entropy, ignore_index too."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    targets[1, 2] = IGNORE
    coll = Collectives()
    loss = vocab_parallel_cross_entropy(logits * 3, targets, 0, None, coll, ignore_index=IGNORE)
    (g,) = torch.autograd.grad(loss, logits)
    ref = F.cross_entropy((logits * 3).view(-1, 11), targets.view(-1), ignore_index=IGNORE)
    (g_ref,) = torch.autograd.grad(ref, logits)
    _close(loss, ref, "loss")
    _close(g, g_ref, "gradient")
    assert not coll.counts  # alone on the tensor axis: no collective


def test_cross_entropy_gradcheck():
    torch.manual_seed(0)
    logits = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 6, 3, IGNORE, 2, 2])
    assert torch.autograd.gradcheck(lambda z: vocab_parallel_cross_entropy(z, targets, 0, None, Collectives()),
                                    (logits,))


def test_cross_entropy_bf16_logits_computed_in_fp32():
    torch.manual_seed(0)
    logits = torch.randn(4, 9).bfloat16().requires_grad_()
    targets = torch.tensor([1, 8, 0, 4])
    loss = vocab_parallel_cross_entropy(logits, targets, 0, None, Collectives())
    loss.backward()
    ref = logits.detach().float().requires_grad_()
    F.cross_entropy(ref, targets).backward()
    assert loss.dtype == logits.grad.dtype == torch.bfloat16
    # The gradient comes back in bf16 (8 mantissa bits: relative rounding up to 2**-8 = 3.9e-3),
    # compared with an fp32 reference: 1e-2 is bf16's precision, not a looser check of the math;
    # atol 1e-3 covers entries near 0 (softmax of bf16-rounded logits), where relative error is undefined.
    torch.testing.assert_close(logits.grad.float(), ref.grad, rtol=1e-2, atol=1e-3)


def test_cross_entropy_shape_error():
    with pytest.raises(ValueError, match="need targets of shape \\(2, 3\\)"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3, 5), torch.zeros(6, dtype=torch.long), 0, None, Collectives())


def test_cross_entropy_sum_matches_torch_and_per_token_is_refused():
    logits, targets = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 4, IGNORE, 2, 1, IGNORE])
    z, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    vocab_parallel_cross_entropy(z, targets, 0, None, Collectives(), ignore_index=IGNORE, reduction="sum").backward()
    F.cross_entropy(ref, targets, ignore_index=IGNORE, reduction="sum").backward()
    torch.testing.assert_close(z.grad, ref.grad)
    with pytest.raises(ValueError, match="reduction='none': 'mean' or 'sum'"):
        vocab_parallel_cross_entropy(logits, targets, 0, None, Collectives(), reduction="none")


def test_embedding_alone_matches_torch():
    wte, ids, _ = _vocab_case()
    w = wte.clone().requires_grad_()
    out = vocab_parallel_embedding(ids, w, 0, None, Collectives())
    out.sum().backward()
    w_ref = wte.clone().requires_grad_()
    ref = F.embedding(ids, w_ref)
    ref.sum().backward()
    assert torch.equal(out, ref) and torch.equal(w.grad, w_ref.grad)


def test_embedding_zeros_rows_it_does_not_hold():
    """On a rank holding ids 8..15 only those positions are looked up; the rest are zero, with no gradient."""
    wte = torch.randn(8, 3, requires_grad=True)  # rows 8..15 of a 16-row table
    ids = torch.tensor([[0, 8, 15, 7, 16]])
    out = vocab_parallel_embedding(ids, wte, 8, None, Collectives())  # no group: no all-reduce
    assert torch.equal(out[0, [0, 3, 4]], torch.zeros(3, 3))
    assert torch.equal(out[0, 1], wte[0]) and torch.equal(out[0, 2], wte[7])
    out.sum().backward()
    assert torch.equal(wte.grad.sum(dim=1) != 0, torch.tensor([True] + [False] * 6 + [True]))
