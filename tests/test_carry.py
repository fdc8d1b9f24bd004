"""Stacks that hand more than the hidden state across their cuts (partitioner.codegen.segment_carry): a value of
the prefix that later blocks read again (Zamba's input embeddings), and one a kind of block writes for the next
ones to reuse (HunYuan v4's top-k indices). Their tensor and pipeline programs compute what the module does
(plan.verify), and train like one process on real ranks; two values of one shape are refused."""

import pytest
import torch
from torch import nn

from cost_models.errors import DeclarationError
from partitioner import compile, trace
from partitioner.codegen.segments import extract
from runtime.pipeline.carry import pack, unpack


class _Layer(nn.Module):
    """A "full" layer picks two tokens by a score of its own; a "shared" one reuses the last full layer's pick.
    Some layers read the input embeddings again."""

    def __init__(self, d: int, full: bool, again: bool):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.score = nn.Linear(d, 1) if full else None
        self.again = nn.Linear(d, d) if again else None

    def forward(self, x, emb, idx):
        if self.score is not None:
            idx = self.score(x).squeeze(-1).topk(2, dim=-1).indices.to(torch.int32)
        picked = torch.gather(x, 1, idx.long().unsqueeze(-1).expand(-1, -1, x.shape[-1])).mean(1, keepdim=True)
        y = x + torch.tanh(self.fc(x)) + picked
        if self.again is not None:
            y = y + self.again(emb)
        return y, idx


class _Net(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16, pattern: str = "FSSFSS", again: tuple[int, ...] = (2, 5)):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Layer(d, c == "F", i in again) for i, c in enumerate(pattern))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        emb = self.emb(ids)
        x, idx = emb * 2.0, None
        for layer in self.layers:
            x, idx = layer(x, emb, idx)
        return self.head(x)


def _net():
    torch.manual_seed(0)
    return _Net()


def _loss(out, y):
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def _batch(rows: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (rows, 8), generator=g), torch.randint(0, 64, (rows, 8), generator=g)


def test_the_slots_that_cross_the_cuts():
    """The prefix hands on the hidden state and the embeddings; full layers write the indices, shared ones read
    them; the layers that read the embeddings take them; nothing else crosses."""
    g = trace(_net(), (_batch()[0],))
    code = extract(g.graph_module, g)
    assert code.carried == ("x", "x_1", "x_2")
    assert code.prefix.outputs == ("x", "x_1")  # the hidden state, the embeddings (no indices yet)
    io = [(code.template(i).inputs, code.template(i).outputs) for i in range(6)]
    full, shared, again = (("x",), ("x", "x_2")), (("x", "x_2"), ("x",)), (("x", "x_1", "x_2"), ("x",))
    assert io == [full, shared, again] * 2  # full layers write the indices, shared ones read them
    assert code.suffix.inputs == ("x",)
    assert code.hidden_shape is None  # each cut's message says its shapes


@pytest.mark.parametrize("pins", [dict(tp=2, pp=1), dict(pp=2, tp=1), dict(pp=3, tp=1), dict(pp=2, tp=2)])
def test_programs_compute_what_the_module_does(pins):
    x, y = _batch()
    plan = compile(_net(), f"local:{pins['tp'] * pins['pp']}", example_inputs=(x,), global_batch_size=4,
                   precision="fp32", microbatch_size=2, sp=False, alternatives=0, **pins)
    assert (plan.config.tp, plan.config.pp) == (pins["tp"], pins["pp"])
    report = plan.verify(_net, (x[:2],), loss_fn=_loss, targets=y[:2])
    assert "match the module" in str(report)
    program = plan.program(0).source
    assert "CARRY = {" in program and "carry=CARRY" in program


@pytest.mark.parametrize("pp", [1, 2])
def test_sequence_parallel_programs_compute_what_the_module_does(pp):
    """Under sp the hidden state crosses the cuts split along the tokens and the indices whole, as their
    writers (in regions gathered over the tokens) make them; the mean over the picked tokens, whole on every
    rank and added to each rank's tokens, has its gradient summed over the tensor group."""
    x, y = _batch()
    plan = compile(_net(), f"local:{2 * pp}", example_inputs=(x,), global_batch_size=4, precision="fp32",
                   microbatch_size=2, tp=2, pp=pp, sp=True, alternatives=0)
    assert plan.config.sp
    plan.verify(_net, (x[:2],), loss_fn=_loss, targets=y[:2])


def test_context_parallelism_is_refused_saying_why():
    x, _ = _batch()
    with pytest.raises(DeclarationError, match=r"cp=2: .*besides the hidden state, x_1 \(\w+\), x_2 \(\w+\) cross "
                                               r"the cuts of layers.*pin cp=1"):
        compile(_net(), "local:2", example_inputs=(x,), global_batch_size=4, precision="fp32", cp=2)


class _Reads(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, idx):
        picked = torch.gather(self.fc(x), 1, idx.long().unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return x + picked.mean(1, keepdim=True), idx


class _ReadsFirst(nn.Module):
    """The prefix picks tokens that every layer reads: a value of the prefix that crosses every cut."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(_Reads() for _ in range(3))

    def forward(self, ids):
        x = self.emb(ids)
        idx = x.detach().sum(-1).topk(2, dim=-1).indices.to(torch.int32)
        for layer in self.layers:
            x, idx = layer(x, idx)
        return x.sum(-1)


def test_a_value_of_the_prefix_crosses_every_cut():
    ids = torch.randint(0, 16, (2, 6))
    g = trace(_ReadsFirst(), (ids,))
    code = extract(g.graph_module, g)
    assert code.prefix.outputs == ("x", "x_1") and code.block.inputs == ("x", "x_1") and code.block.outputs == ("x",)


def test_pack_round_trips_and_sends_gradients_back():
    x = torch.randn(2, 3, 4, dtype=torch.bfloat16, requires_grad=True)
    e = torch.randn(2, 3, 4, dtype=torch.bfloat16, requires_grad=True)
    i = torch.randint(0, 9, (2, 3, 5), dtype=torch.int32)
    m = torch.rand(3) > 0.5
    packed = pack([x, e, i, None, m])
    received = packed.detach().requires_grad_()
    x2, e2, i2, none, m2 = unpack(received, 5)
    assert torch.equal(x2, x) and torch.equal(e2, e) and torch.equal(i2, i) and none is None and torch.equal(m2, m)
    (3 * x2.float().sum() + e2.float().sum()).backward()
    packed.backward(received.grad)
    assert torch.equal(x.grad, torch.full_like(x, 3)) and torch.equal(e.grad, torch.ones_like(e))
    with pytest.raises(TypeError, match="only values of the hidden state's dtype send their gradients back"):
        pack([x, torch.randn(2, requires_grad=True)])


@pytest.mark.slow
@pytest.mark.parametrize("pins", [dict(pp=2, tp=1, dp=1), dict(tp=2, pp=1, dp=1)])
def test_trains_like_one_process_on_real_ranks(pins):
    from examples.training import sgd
    from ranks import assert_plan_trains_like_one_process

    x, _ = _batch()
    plan = compile(_net(), "local:2", example_inputs=(x,), global_batch_size=4, precision="fp32",
                   microbatch_size=2, sp=False, alternatives=0, **pins)
    assert_plan_trains_like_one_process(plan, _net, sgd, _loss, [_batch(seed=s) for s in (1, 2)])
