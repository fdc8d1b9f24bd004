"""A tensor-parallel model's vocab-split logits reach the user's loss_fn ungathered (runtime.pipeline.vocab_logits).

Tier (a), in one process: the wrapper reports the full shape; the shape ops that keep the vocabulary dim
whole run on the slice (each rank's result is its slice of the op on the full logits) and stay wrapped;
in-place ops and targets outside the vocabulary are refused; repr and hash run no collective (a LocalGroup
with no peer breaks on one, as the ops that read the logits gathered show); the code returns vocab-split
logits wrapped and still gathers a token-split output; plan.verify hands the split logits to the loss_fn in
each slice's thread and compares them, and locates a wrong suffix, gathered there. Tier (c), 2 Gloo processes: a
loss_fn's cross entropy (mean or sum) through view/reshape/flatten/slicing, `nn.CrossEntropyLoss`,
`transformers`' causal-LM loss (with and without num_items_in_batch) and the fp16 loss scale gives the loss and
the gradient of the local logits of one process on the full logits (rtol 1e-5, atol 1e-6) with no fallback
warning; anything else (mse, argmax, sum, a cross entropy with smoothing or weights) reads them gathered,
exactly, and warns once. End to
end: tp2 plans of the example GPT (logits only) and a Hugging Face Llama (HF's shifted loss), trained 3 steps
with SGD (momentum), train as one process does, the cross entropy vocab-parallel in every worker.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import runtime.pipeline.vocab_logits as vocab_logits
from examples import gpt
from examples.training import hf_llama_seeded, sgd
from runtime.comm.collectives import Collectives
from runtime.engines.mixed_precision import LossScaler, scale_grad
from runtime.pipeline.tensor_parallel import TPContext
from runtime.pipeline.vocab_logits import VocabLogitsGatheredWarning, VocabSplitLogits, full_logits, tp_vocab_logits
from runtime.verify.local_collectives import LocalCollectiveError, LocalCollectives, LocalGroup
from ranks import assert_plan_trains_like_one_process, gloo_group

B, T, V, WORLD = 2, 6, 16, 2
RTOL, ATOL = 1e-5, 1e-6


def _case() -> tuple[torch.Tensor, torch.Tensor]:
    """The full logits (B, T, V) and targets (B, T), some ignored: the same in every process."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g) * 2
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 1] = targets[1, 4] = -100
    return logits, targets


def _slice(full: torch.Tensor, rank: int, world: int = WORLD) -> torch.Tensor:
    return full.chunk(world, -1)[rank]


def _local(x: VocabSplitLogits) -> torch.Tensor:
    local = x.to_local()
    assert type(local) is torch.Tensor
    return local


def _offline(rank: int) -> TPContext:
    """A tensor group with no peer, whose collectives fail at once: for what must run none."""
    return TPContext(LocalGroup(WORLD, timeout_s=0.1), LocalCollectives(rank), rank, WORLD)


# ---- (a) one process: shapes and the ops that run on the slice ------------------------------------------

def test_it_reports_the_full_shape_and_the_slices_metadata():
    full, _ = _case()
    out = tp_vocab_logits(_slice(full, 1).requires_grad_(), _offline(1))
    assert out.shape == out.size() == full.shape and out.size(-1) == out.size(dim=2) == V
    assert (out.dim(), out.ndim, out.numel(), out.nelement(), len(out)) == (3, 3, full.numel(), full.numel(), B)
    assert (out.dtype, out.device, out.requires_grad, out.is_floating_point()) == (torch.float32, full.device,
                                                                                    True, True)
    assert "full shape (2, 6, 16), vocabulary slice 1 of 2" in repr(out) and f"{out}" == repr(out)
    assert hash(out) == id(out)


SLICE_OPS = {
    "view(-1, V)": lambda o: o.view(-1, V),
    "view(B*T, V)": lambda o: o.view(B * T, V),
    "view((B, T, V))": lambda o: o.view((B, T, V)),
    "view(B, -1, V)": lambda o: o.view(B, -1, V),
    "view(-1, size(-1))": lambda o: o.view(-1, o.size(-1)),
    "view(B, T, -1)": lambda o: o.view(B, T, -1),
    "reshape(-1, shape[-1])": lambda o: o.reshape(-1, o.shape[-1]),
    "torch.reshape": lambda o: torch.reshape(o, (-1, V)),
    "view_as": lambda o: o.view_as(torch.empty(B * T, V)),
    "reshape_as": lambda o: o[:, 1:].reshape_as(torch.empty(B * (T - 1), V)),
    "flatten(0, 1)": lambda o: o.flatten(0, 1),
    "flatten(0, -2)": lambda o: o.flatten(0, -2),
    "torch.flatten": lambda o: torch.flatten(o, end_dim=1),
    "[:, :-1]": lambda o: o[:, :-1],
    "[..., :-1, :]": lambda o: o[..., :-1, :],
    "[:, :-1, :]": lambda o: o[:, :-1, :],
    "[1]": lambda o: o[1],
    "[:, 2]": lambda o: o[:, 2],
    "[None, ..., None, :]": lambda o: o[None, ..., None, :],
    "[:, ::2].contiguous()": lambda o: o[:, ::2].contiguous(),
    "float()": lambda o: o.double().float(),
    "to(float64)": lambda o: o.to(torch.float64),
    "to(device, dtype=)": lambda o: o.to("cpu", dtype=torch.float64),
    "type_as": lambda o: o.type_as(torch.zeros((), dtype=torch.float64)),
    "detach().clone()": lambda o: o.detach().clone(),
    "shifted, flattened": lambda o: o[:, :-1].contiguous().view(-1, o.size(-1)),
}


@pytest.mark.parametrize("op", SLICE_OPS.values(), ids=SLICE_OPS.keys())
@pytest.mark.parametrize("rank", range(WORLD))
def test_shape_ops_that_keep_the_vocabulary_whole_run_on_the_slice(op, rank):
    full, _ = _case()
    got = op(tp_vocab_logits(_slice(full, rank), _offline(rank)))
    want = op(full)
    assert isinstance(got, VocabSplitLogits) and got.shape == want.shape
    torch.testing.assert_close(_local(got), _slice(want, rank), rtol=0, atol=0)


def test_ops_that_merge_or_cut_the_vocabulary_do_not_stay_on_the_slice():
    """They read the logits gathered: with no peer in the group the gather breaks, which shows it ran."""
    full, _ = _case()
    for op in (lambda o: o.view(-1), lambda o: o.flatten(), lambda o: o.view(B, T * V), lambda o: o[..., :3],
               lambda o: o[:, :, 0], lambda o: o[..., None], lambda o: o.reshape(B, 2, -1),
               lambda o: o.view(5, V), lambda o: o.view(torch.int32), lambda o: o.transpose(1, 2)):
        vocab_logits._warned = True  # the warning is tested on real processes
        with pytest.raises(LocalCollectiveError):
            op(tp_vocab_logits(_slice(full, 0), _offline(0)))


def test_in_place_ops_are_refused_with_the_fix():
    full, _ = _case()
    out = tp_vocab_logits(_slice(full, 0).clone(), _offline(0))
    mask = torch.ones(B, T, V, dtype=torch.bool)
    for op in (lambda o: o.masked_fill_(mask, 0.0), lambda o: o.__setitem__((0, 0), 1.0), lambda o: o.add_(1),
               lambda o: o.retain_grad(), lambda o: torch.add(full[..., :8], 1, out=o)):
        with pytest.raises(RuntimeError, match=r"vocab-split logits.*out of place.*full_tensor\(\)"):
            op(out)


def test_a_target_outside_the_vocabulary_is_refused_as_f_cross_entropy_refuses_it():
    full, targets = _case()
    out = tp_vocab_logits(full, TPContext(None, Collectives(), 0, 1))
    with pytest.raises(RuntimeError, match="outside the classes 0..15"):
        F.cross_entropy(out.view(-1, V), torch.full((B * T,), V))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class _Hidden(torch.nn.Module):
    """Returns its hidden state, no LM head: under sequence parallelism the output is split by tokens."""

    def __init__(self):
        super().__init__()
        self.wte, self.h, self.ln = torch.nn.Embedding(64, 32), torch.nn.ModuleList([_Block(), _Block()]), \
            torch.nn.LayerNorm(32)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.h:
            x = b(x)
        return self.ln(x)


def _returns(model: torch.nn.Module, **degrees) -> list[str]:
    from partitioner import compile

    plan = compile(model, "local:2", example_inputs=(torch.randint(0, 64, (2, 8)),), global_batch_size=4,
                   precision="fp32", pp=1, dp=1, microbatch_size=2, **degrees)
    src = plan.program(0).source
    return [line.split("=", 1)[1].split(";")[0].strip() for line in src.splitlines()
            if "tp_gather(" in line or "tp_vocab_logits(" in line]


def test_the_code_returns_vocab_split_logits_wrapped_and_gathers_a_token_split_output():
    assert _returns(_gpt_logits(), tp=2, sp=False) == ["tp_vocab_logits(linear_8, tp)"]
    assert _returns(_gpt_logits(), tp=2, sp=True) == ["tp_vocab_logits(linear_8, tp)"]
    torch.manual_seed(0)
    assert _returns(_Hidden(), tp=2, sp=True) == ["tp_gather(layer_norm, 1, tp)"]  # split by tokens: gathered


# ---- (c) two Gloo processes: the loss and its gradient --------------------------------------------------

def _causal_lm_loss(out, y, **kwargs):
    from transformers.loss.loss_utils import ForCausalLMLoss

    # HF's shift: labels padded with -100, logits.view(-1, V); with num_items_in_batch, the sum over that count
    return ForCausalLMLoss(out, y, vocab_size=V, **kwargs)


FAST = {  # loss_fn(logits, targets): the vocab-parallel cross entropy, nothing gathered
    "flatten": lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()),
    "view(-1, size(-1))": lambda o, y: F.cross_entropy(o.view(-1, o.size(-1)), y.view(-1)),
    "reshape.float()": lambda o, y: F.cross_entropy(o.reshape(-1, o.shape[-1]).float(), y.reshape(-1)),
    "shifted [:, :-1]": lambda o, y: F.cross_entropy(o[:, :-1].contiguous().view(-1, V), y[:, 1:].reshape(-1)),
    "shifted [..., :-1, :]": lambda o, y: F.cross_entropy(o[..., :-1, :].reshape(-1, V), y[..., 1:].reshape(-1)),
    "ignore_index=3": lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten().clamp(min=0), ignore_index=3),
    "nn.CrossEntropyLoss": lambda o, y: torch.nn.CrossEntropyLoss()(o.view(B * T, V), y.view(B * T)),
    "transformers ForCausalLMLoss": _causal_lm_loss,
    "reduction='sum'": lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(), reduction="sum"),
    "sum, every token ignored": lambda o, y: F.cross_entropy(o.flatten(0, 1), torch.full_like(y.flatten(), -100),
                                                             reduction="sum"),
    "transformers ForCausalLMLoss, num_items_in_batch": lambda o, y: _causal_lm_loss(o, y, num_items_in_batch=5),
    "two cross entropies": lambda o, y: F.cross_entropy(o[0], y[0]) + 0.5 * F.cross_entropy(o[1, 1:], y[1, 1:]),
    "fp16 loss scale (x8)": lambda o, y: F.cross_entropy(scale_grad(o, LossScaler(scale=8.0)).flatten(0, 1),
                                                           y.flatten()) / 8,
}
GATHERED = {  # loss_fn(logits, targets) that reads the logits through something else: exact, warned
    "mse on float()": lambda o, y: F.mse_loss(o.float(), torch.ones(B, T, V)),
    "argmax and sum": lambda o, y: (o.argmax(-1) == y).float().mean() + o.sum() / o.numel(),
    "label_smoothing": lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(), label_smoothing=0.1),
    "class weights": lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(), weight=torch.linspace(0.5, 2, V)),
    "(B, V, T) input": lambda o, y: F.cross_entropy(o.transpose(1, 2), y),
    "log_softmax + nll": lambda o, y: F.nll_loss(F.log_softmax(o, -1).flatten(0, 1), y.flatten()),
    "z-loss beside the cross entropy": lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten())
    + 1e-2 * o.logsumexp(-1).square().mean(),
    "full_logits()": lambda o, y: F.cross_entropy(full_logits(o).flatten(0, 1), y.flatten()),
}


def _run_case(fn, logits: torch.Tensor, targets: torch.Tensor, tp: TPContext | None) -> dict:
    """loss_fn on the logits (this rank's slice wrapped, or the full ones): loss, gradient, warnings."""
    vocab_logits._warned = False
    z = (logits if tp is None else _slice(logits, tp.rank, tp.world)).clone().requires_grad_()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = fn(z * 1 if tp is None else tp_vocab_logits(z * 1, tp), targets)  # a non-leaf, as a model output
        loss.backward()
    return dict(loss=loss.detach(), grad=z.grad, plain=type(loss) is torch.Tensor,
                warned=[str(w.message) for w in seen if issubclass(w.category, VocabLogitsGatheredWarning)])


def _loss_worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    with gloo_group(rank, world, store_path):
        tp = TPContext(dist.group.WORLD, Collectives(), rank, world)
        logits, targets = _case()
        torch.save({name: _run_case(fn, logits, targets, tp) for name, fn in {**FAST, **GATHERED}.items()},
                   Path(out_dir) / f"rank{rank}.pt")


@functools.cache
def _reference(name: str) -> dict:
    logits, targets = _case()
    return _run_case({**FAST, **GATHERED}[name], logits, targets, None)


def _assert_like_one_process(ranks: list[dict], name: str) -> None:
    want = _reference(name)
    for rank, got in enumerate(r[name] for r in ranks):
        assert got["plain"], f"{name}: the loss is a {type(got['loss'])}, not a plain tensor"
        torch.testing.assert_close(got["loss"], want["loss"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got["grad"], _slice(want["grad"], rank), rtol=RTOL, atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAST)
def test_a_cross_entropy_runs_vocab_parallel_and_matches_one_process(spawned, name):
    ranks = spawned(_loss_worker, WORLD)
    _assert_like_one_process(ranks, name)
    assert all(not r[name]["warned"] for r in ranks), ranks[0][name]["warned"]


@pytest.mark.slow
@pytest.mark.parametrize("name", GATHERED)
def test_any_other_read_gathers_exactly_and_warns(spawned, name):
    ranks = spawned(_loss_worker, WORLD)
    _assert_like_one_process(ranks, name)
    if name == "full_logits()":  # gathered on purpose: no warning
        assert all(not r[name]["warned"] for r in ranks)
        return
    for r in ranks:
        assert len(r[name]["warned"]) == 1 and "vocab-parallel cross entropy" in r[name]["warned"][0]


# ---- (c) end to end: tp2 plans train as one process, the cross entropy vocab-parallel ----------------------

class _LogitsGPT(gpt.GPT):
    """The example GPT returning its logits alone: the loss is the user's."""

    def forward(self, idx):
        return super().forward(idx)[0]


def _gpt_logits() -> _LogitsGPT:
    torch.manual_seed(0)
    return _LogitsGPT(gpt.GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64))


def _llama() -> torch.nn.Module:
    return hf_llama_seeded(layers=2)


def _vocab_parallel_only(logits: torch.Tensor) -> None:
    """In a training worker (a process of the plan's group) the logits arrive split, and nothing has read them
    gathered in this process (each worker is a fresh one)."""
    if dist.is_initialized():
        assert isinstance(logits, VocabSplitLogits), f"the loss_fn got {type(logits).__name__}, not the split logits"
        assert not vocab_logits._warned, "the loss_fn's logits were gathered"


def _flat_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _vocab_parallel_only(out)
    loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
    _vocab_parallel_only(out)
    return loss


def _hf_shifted_loss(out, y: torch.Tensor) -> torch.Tensor:
    from transformers.loss.loss_utils import ForCausalLMLoss

    _vocab_parallel_only(out.logits)
    loss = ForCausalLMLoss(out.logits, y, vocab_size=out.logits.size(-1))
    _vocab_parallel_only(out.logits)
    return loss


def _batches(vocab: int, seq: int, steps: int = 3, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x, y = torch.randint(1, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)
        y[:, -2:] = -100  # padding, ignored by the loss; as many in every row, so a mean over microbatches' means
        # (what a plan with several microbatches computes) is the batch's mean
        out.append((x, y))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model_fn,loss_fn,vocab", [(_gpt_logits, _flat_loss, 64), (_llama, _hf_shifted_loss, 512)],
                         ids=["gpt-logits", "hf-llama-shifted"])
def test_a_tp2_plan_trains_as_one_process_with_its_cross_entropy_vocab_parallel(model_fn, loss_fn, vocab):
    from partitioner import compile

    data = _batches(vocab, seq=8)
    plan = compile(model_fn(), "local:2", example_inputs=(data[0][0][:2],), global_batch_size=4, precision="fp32",
                   tp=2, pp=1, dp=1, microbatch_size=2)
    assert "tp_vocab_logits(" in plan.program(0).source  # the logits returned split
    assert_plan_trains_like_one_process(plan, model_fn, sgd, loss_fn, data)


# ---- (a) plan.verify: the slices' threads hand their logits split to the loss_fn, compared gathered -----------

def _tp2_logits_plan():
    from partitioner import compile

    return compile(_gpt_logits(), "local:2", example_inputs=(torch.randint(0, 64, (2, 8)),), global_batch_size=4,
                   precision="fp32", tp=2, pp=1, dp=1, microbatch_size=2)


def test_verify_runs_the_loss_fn_on_the_split_logits_and_compares_them_whole():
    plan, x = _tp2_logits_plan(), torch.randint(0, 64, (2, 8))
    y = torch.randint(0, 64, (2, 8))
    for loss_fn, targets in ((lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()), y), (None, None)):
        report = plan.verify(_gpt_logits, (x,), loss_fn, targets=targets)
        assert report.checked and report.tp == 2 and report.outputs == 1


def test_verify_locates_a_wrong_suffix_without_reading_the_split_logits_outside_their_threads():
    from runtime.verify.run import VerifyError

    plan = _tp2_logits_plan()
    wrong = {r: plan.program(r).source.replace("tp_vocab_logits(linear_8, tp)", "tp_vocab_logits(linear_8 * 1.5, tp)")
             for r in range(2)}
    assert all("linear_8 * 1.5" in s for s in wrong.values())
    with pytest.raises(VerifyError, match="suffix"):
        plan.verify(_gpt_logits, (torch.randint(0, 64, (2, 8)),), sources=wrong)
