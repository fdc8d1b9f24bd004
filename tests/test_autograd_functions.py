"""Which torch.autograd.Function classes keep their gradient in code cut from the traced graph
(partitioner.tracer.autograd_functions): those whose backward is the derivative of their forward."""

from __future__ import annotations

import torch

from partitioner.tracer.autograd_functions import Applied, differs_from_its_forward, recording


class TanhGelu(torch.autograd.Function):
    """BLOOM's pattern: the tanh GELU with its derivative written out."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return g * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class Straight(torch.autograd.Function):
    """A straight-through rounding: the traced forward's derivative is zero."""

    @staticmethod
    def forward(x):
        return torch.round(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g


class Gate(torch.autograd.Function):
    """A gradient for an argument the forward does not read (as PhiMoE's router estimator), and an index."""

    @staticmethod
    def forward(ctx, scores, weight, index):
        ctx.save_for_backward(weight, index)
        return weight * 2

    @staticmethod
    def backward(ctx, g):
        weight, index = ctx.saved_tensors
        return torch.zeros_like(g).expand(-1, 4).scatter_add(-1, index, g), g * 2, None


def test_a_backward_that_is_the_forwards_derivative_is_kept_and_estimators_are_not():
    x = torch.randn(3, 5)
    found: dict = {}
    with recording(found):
        TanhGelu.apply(x)
        Straight.apply(x)
        Gate.apply(torch.randn(6, 4), torch.randn(6, 1), torch.zeros(6, 1, dtype=torch.long))
        torch.utils.checkpoint.checkpoint(torch.tanh, x.requires_grad_(), use_reentrant=True)  # torch's own
    assert list(found) == [TanhGelu, Straight, Gate]
    assert found[TanhGelu].args == (((3, 5), torch.float32),)
    assert [differs_from_its_forward(found[c]) for c in (TanhGelu, Straight, Gate)] == [False, True, True]
    assert "test_autograd_functions.Straight (" in found[Straight].name


def test_a_function_that_cannot_run_on_made_up_values_counts_as_differing():
    class Picky(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            if float(x.sum()) != 42.0:
                raise ValueError("only for the real data")
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    assert differs_from_its_forward(Applied(Picky, (torch.zeros(2, 2),)))
