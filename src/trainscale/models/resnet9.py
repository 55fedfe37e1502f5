"""ResNet9 from cifar10-fast (the 79 s DAWNBench entry): the small, fast baseline for CIFAR-10 scaling runs."""

from __future__ import annotations

import torch
from torch import nn

from trainscale.models.registry import register_model


def conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    """3x3 bias-free conv, BN, ReLU: the only building block of ResNet9 (BN makes a conv bias redundant)."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class Residual(nn.Module):
    """x + f(x) where f is two conv-BN-ReLU units at constant width (no projection needed)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(conv_bn(channels, channels), conv_bn(channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class Scale(nn.Module):
    """Multiply by a constant; ResNet9 scales logits by 0.125 so the summed-loss LR schedule works."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor}"


def build_resnet9(num_classes: int = 10) -> nn.Sequential:
    """Assemble the layer sequence; 6,573,120 parameters in 25 tensors for 10 classes."""
    return nn.Sequential(
        conv_bn(3, 64),
        conv_bn(64, 128),
        nn.MaxPool2d(2),
        Residual(128),
        conv_bn(128, 256),
        nn.MaxPool2d(2),
        conv_bn(256, 512),
        nn.MaxPool2d(2),
        Residual(512),
        nn.AdaptiveMaxPool2d(1),
        nn.Flatten(),
        nn.Linear(512, num_classes, bias=False),
        Scale(0.125),
    )


@register_model(
    "resnet9",
    input_size=32,
    description="cifar10-fast ResNet9 (6.57 M params, 79 s to 94% on a V100)",
    recipe="cifar10-fast",
)
def resnet9(num_classes: int = 10) -> nn.Module:
    """cifar10-fast ResNet9: the reference net for DAWNBench-style time-to-94% runs."""
    return build_resnet9(num_classes)
