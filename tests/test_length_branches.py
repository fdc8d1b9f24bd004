"""Models that branch on their sequence length (DeepSeek-V4's compressors summarise each window of tokens, from one
window's worth on): the trace takes the example's branch, so the code cut from it holds at some lengths only. The
graph records them (OpGraph.seq_lengths: torch.export's range for the sequence), and every program refuses a
batch of another length, where it computed something else than the module, silently. A parameter the traced
branch never reads trains nothing in one process (it gets no gradient): the programs keep it, frozen, outside
ZeRO's units, and the state dict has it unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.training import adamw, train_one_process
from partitioner import Plan, compile, trace
from ranks import assert_trains_like
from runtime import launch_local

WINDOW, VOCAB, H = 8, 64, 16


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.compress = nn.Linear(H, 2 * H), nn.Linear(2 * H, H), nn.Linear(H, H)

    def forward(self, x):
        x = x + self.down(torch.relu(self.up(x)))
        usable = x.shape[1] // WINDOW * WINDOW
        if usable > 0:  # one summary per window of tokens
            windows = self.compress(x[:, :usable]).view(x.shape[0], -1, WINDOW, H).mean(2)
            x = x + windows.mean(1, keepdim=True)
        return x


class _RMSNorm(nn.Module):  # spelled out as Hugging Face does: the tracer fuses it, so every plan runs code
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _Compressing(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(VOCAB, H), _RMSNorm(), nn.Linear(H, VOCAB)
        self.layers = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def compressing_seeded() -> _Compressing:
    torch.manual_seed(0)
    return _Compressing()


def token_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _tokens(seq: int, rows: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def short():
    """Traced below one window: the summaries are not in the code."""
    return trace(compressing_seeded(), (_tokens(4),))


def test_the_trace_records_the_lengths_its_branch_holds_at(short):
    from examples.training import gpt_tiny_seeded, hf_llama_seeded

    assert short.seq_lengths == (2, WINDOW - 1)
    assert trace(compressing_seeded(), (_tokens(16),)).seq_lengths == (WINDOW, None)
    tiny = gpt_tiny_seeded()  # a table of positions: as many as its rows
    assert trace(tiny, (torch.randint(0, 64, (2, 8)),)).seq_lengths == (2, tiny.config.block_size)
    assert trace(hf_llama_seeded(2), (torch.randint(0, 64, (2, 8)),)).seq_lengths is None  # rotary: any length


def test_the_programs_refuse_a_batch_of_another_length(short):
    """plan.verify refuses it before comparing anything, and so does the model a program runs, on every rank;
    the limits travel in the plan's JSON and show in the generated source."""
    plan = compile(short, "local:2", global_batch_size=2, microbatch_size=2, precision="fp32", tp=2, dp=1)
    assert plan.code.seq_lengths == (2, WINDOW - 1)
    assert Plan.from_json(plan.to_json()).code.seq_lengths == (2, WINDOW - 1)
    assert "SEQ_LENGTHS = (2, 7)" in plan.program(0).source
    plan.verify(compressing_seeded, (_tokens(4),))
    with pytest.raises(ValueError, match=r"sequence length 8, but the plan's code holds for lengths 2 to 7 only"):
        plan.verify(compressing_seeded, (_tokens(8),))

    pp = compile(short, "local:2", global_batch_size=2, microbatch_size=2, precision="fp32", pp=2, dp=1)
    stage = pp.program(0).namespace()["make_stage"](compressing_seeded(), None)  # as build() makes it
    assert stage.module(None, (_tokens(4),), _stage=0).shape == (2, 4, H)
    with pytest.raises(ValueError, match="holds for lengths 2 to 7 only"):
        stage.module(None, (_tokens(8),), _stage=0)


@pytest.mark.slow
@pytest.mark.parametrize("pins", [dict(dp=2, pp=1, zero_stage=3), dict(dp=1, pp=2)])
def test_parameters_the_branch_never_reads_stay_as_they_were(short, pins):
    """AdamW with weight decay, 2 steps: the summaries' weights get no gradient in one process, so they are not
    stepped (decay included); under ZeRO-3 its units used to name them after the stage had dropped them, and the
    engine refused to build."""
    data = [(_tokens(4, rows=4, seed=s), _tokens(4, rows=4, seed=10 + s)) for s in range(2)]
    plan = compile(short, "local:2", global_batch_size=4, microbatch_size=2, precision="fp32", tp=1, **pins)
    assert plan.code is not None  # the module's own forward would read them at another length
    out = launch_local(plan, compressing_seeded, adamw, token_loss, data, timeout_s=180)
    ref = train_one_process(compressing_seeded, adamw, token_loss, data)
    assert sorted(out.state_dict) == sorted(ref.model.state_dict())
    assert_trains_like(out, ref.losses, ref.model.state_dict(), adam_steps=2)
    start = compressing_seeded().state_dict()
    torch.testing.assert_close(out.state_dict["layers.1.compress.weight"], start["layers.1.compress.weight"])
