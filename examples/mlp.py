"""A plain multilayer perceptron: ``nn.Sequential`` of Linear/ReLU layers.

>>> model = mlp()
>>> model(*example_inputs(model)).shape
torch.Size([8, 10])

Parameters for the default 784 -> 512 -> 512 -> 10:
784*512+512 + 512*512+512 + 512*10+10 = 669,706.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn


class MLP(nn.Module):
    """``in_features -> hidden[0] -> ... -> hidden[-1] -> out`` with a ReLU after every
    hidden Linear. Inputs of shape ``(B, in_features)``; images are flattened first."""

    def __init__(self, in_features: int = 784, hidden: Sequence[int] = (512, 512), out: int = 10):
        super().__init__()
        self.in_features = in_features
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, out))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        x = x.flatten(1)  # (B, in_features), e.g. (B, 1, 28, 28) -> (B, 784)
        return self.net(x)  # (B, out)


def mlp(in_features: int = 784, hidden: Sequence[int] = (512, 512), out: int = 10) -> MLP:
    """The default MNIST-sized MLP, built on the current default device."""
    return MLP(in_features=in_features, hidden=hidden, out=out)


def example_inputs(model: MLP, batch_size: int = 8, *, seed: int = 0) -> tuple[torch.Tensor]:
    """``(x,)`` with x of shape ``(batch_size, in_features)`` on the model's device."""
    device = next(model.parameters()).device
    if device.type == "meta":
        return (torch.empty(batch_size, model.in_features, device="meta"),)
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(batch_size, model.in_features, generator=g).to(device),)
