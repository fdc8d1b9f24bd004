"""Ops a layer loop runs between its blocks for one block alone (partitioner.codegen.segment_glue): each layer adds
its own slice of a tensor the prefix made, taken in the loop as Gemma 4 takes its per-layer inputs. They run in
the block they feed, with the block's index where they read it; the programs compute what the module does and
train like one process; work that is neither one number for every block nor the block's index is refused."""

import pytest
import torch
from torch import nn

from cost_models.errors import DeclarationError
from partitioner import compile, trace
from partitioner.codegen.segments import extract


class _Layer(nn.Module):
    def __init__(self, d: int, k: int):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.up = nn.Linear(k, d)

    def forward(self, x, mine):
        return x + torch.tanh(self.fc(x)) * self.up(mine)


class _Net(nn.Module):
    """`pick(i, n)`: which slice of the per-layer tensor layer i of n reads."""

    def __init__(self, pick=lambda i, n: i, layers: int = 4, d: int = 8, k: int = 4):
        super().__init__()
        self.pick = pick
        self.emb = nn.Embedding(16, d)
        self.per = nn.Linear(d, layers * k)
        self.layers = nn.ModuleList(_Layer(d, k) for _ in range(layers))
        self.head = nn.Linear(d, 16)

    def forward(self, ids):
        x = self.emb(ids)
        per = self.per(x).unflatten(-1, (len(self.layers), -1))
        for i, layer in enumerate(self.layers):
            x = layer(x, per[:, :, self.pick(i, len(self.layers))])
        return self.head(x)


def _net():
    torch.manual_seed(0)
    return _Net()


def _loss(out, y):
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def _batch(rows: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (rows, 6), generator=g), torch.randint(0, 16, (rows, 6), generator=g)


def test_each_block_takes_its_slice_by_its_index():
    g = trace(_net(), (_batch()[0],))
    code = extract(g.graph_module, g)
    assert code.block.indexed and "block_index" in code.block.source.split(")")[0]
    assert "aten.select.int" in code.block.source and "select" not in code.prefix.source
    assert code.prefix.outputs == ("x", "x_1") and code.block.inputs == ("x", "x_1")  # the per-layer tensor crosses


def test_one_slice_for_every_block_is_a_number_not_the_index():
    net = _Net(pick=lambda i, n: 1)
    g = trace(net, (_batch()[0],))
    code = extract(g.graph_module, g)
    assert not code.block.indexed and ", 1)" in code.block.source


@pytest.mark.parametrize("pins", [dict(pp=2, tp=1), dict(pp=2, tp=2), dict(tp=2, pp=1)])
def test_programs_compute_what_the_module_does(pins):
    x, y = _batch()
    plan = compile(_net(), f"local:{pins['tp'] * pins['pp']}", example_inputs=(x,), global_batch_size=4,
                   precision="fp32", microbatch_size=2, alternatives=0, **{"sp": False, **pins})
    assert "block_indexed=(True,)" in plan.program(0).source
    assert "match the module" in str(plan.verify(_net, (x[:2],), loss_fn=_loss, targets=y[:2]))


def test_work_that_is_not_the_blocks_index_is_refused_saying_why():
    x, _ = _batch()
    net = _Net(pick=lambda i, n: n - 1 - i)  # the layers read their slices backwards
    with pytest.raises(DeclarationError, match=r"runs .*select.* for each block with argument 2 3 for block 0 .*"
                                               r"neither one number nor the block's index"):
        compile(net, "local:2", example_inputs=(x,), global_batch_size=4, precision="fp32", pp=2)


@pytest.mark.slow
def test_trains_like_one_process_on_real_ranks():
    from examples.training import sgd
    from ranks import assert_plan_trains_like_one_process

    x, _ = _batch()
    plan = compile(_net(), "local:2", example_inputs=(x,), global_batch_size=4, precision="fp32",
                   microbatch_size=2, alternatives=0, pp=2, dp=1)
    assert_plan_trains_like_one_process(plan, _net, sgd, _loss, [_batch(seed=s) for s in (1, 2)])
