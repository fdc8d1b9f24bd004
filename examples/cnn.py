"""A small CNN classifier for 3x32x32 images (CIFAR-10 sized), conv-bn-relu blocks.

Layout, for one 3x32x32 image::

    stem    ConvBlock(3 -> 64, 3x3, pad 1)          (64, 32, 32)
    pool    MaxPool2d(2)                           (64, 16, 16)
    blocks  4 x ConvBlock(64 -> 64, 3x3, pad 1)    (64, 16, 16)   identical, repeated
    avgpool AdaptiveAvgPool2d(1), flatten          (64,)
    head    Linear(64 -> 10)                       (10,)

Hand count of forward FLOPs for a 1x3x32x32 input. Conventions: FLOPs = 2 * MACs
(one multiply-add = 2 FLOPs) for convolutions and Linears only, the same as
``torch.utils.flop_counter.FlopCounterMode``; convolutions have no bias (a
BatchNorm follows); the Linear's bias, BatchNorm, ReLU and pooling are not
counted. A conv's MACs = H_out * W_out * C_out * C_in * k * k::

    stem    32*32 * 64 * 3*3*3          =  1,769,472 MACs
    blocks  4 * (16*16 * 64 * 64*3*3)   = 37,748,736 MACs   (9,437,184 each)
    head    64 * 10                     =        640 MACs
    total                                 39,518,848 MACs = 79,037,696 FLOPs

so ``FORWARD_FLOPS_PER_IMAGE = 79_037_696``; a batch of B costs B times that.

>>> model = cnn()
>>> model(*example_inputs(model)).shape
torch.Size([8, 10])
"""

from __future__ import annotations

import torch
import torch.nn as nn

FORWARD_FLOPS_PER_IMAGE = 79_037_696
"""Forward FLOPs of ``cnn()`` on one 3x32x32 image, hand-counted in the module docstring."""


class ConvBlock(nn.Module):
    """3x3 convolution (padding 1, no bias), BatchNorm, ReLU: keeps H and W."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


class CNN(nn.Module):

    def __init__(self, num_classes: int = 10, width: int = 64, depth: int = 4):
        super().__init__()
        self.stem = ConvBlock(3, width)
        self.pool = nn.MaxPool2d(2)
        self.blocks = nn.Sequential(*[ConvBlock(width, width) for _ in range(depth)])
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        x = self.stem(x)  # (B, width, 32, 32)
        x = self.pool(x)  # (B, width, 16, 16)
        x = self.blocks(x)  # (B, width, 16, 16)
        x = self.avgpool(x)  # (B, width, 1, 1)
        x = torch.flatten(x, 1)  # (B, width)
        return self.fc(x)  # (B, num_classes)


def cnn(num_classes: int = 10, width: int = 64, depth: int = 4) -> CNN:
    """The default CNN (the one hand-counted above), built on the current default device."""
    return CNN(num_classes=num_classes, width=width, depth=depth)


def example_inputs(model: CNN, batch_size: int = 8, *, seed: int = 0) -> tuple[torch.Tensor]:
    """``(x,)`` with x of shape ``(batch_size, 3, 32, 32)`` on the model's device."""
    device = next(model.parameters()).device
    if device.type == "meta":
        return (torch.empty(batch_size, 3, 32, 32, device="meta"),)
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(batch_size, 3, 32, 32, generator=g).to(device),)
