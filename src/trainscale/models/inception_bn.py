"""MXNet's Inception-BN "28-small" for CIFAR-10 at 28x28 input (the seed's inception-bn-28-small symbol).

Layout: conv3x3 -> 96; simple modules (32,32), (32,48); downsample (80); simple (112,48), (96,64), (80,80), (48,96);
downsample (96); simple (176,160), (176,160); global average pool; Linear 336 -> classes. Spatial size 28 -> 14 -> 7.
1,651,114 parameters for 10 classes. Unlike the MXNet symbol, the convs here are bias-free because BN follows each
one (the bias would be redundant).
"""

from __future__ import annotations

import torch
from torch import nn

from trainscale.models.registry import register_model


def conv_bn_relu(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Sequential:
    """Bias-free conv with 'same'-style padding, BN, ReLU: MXNet's ConvFactory."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class SimpleModule(nn.Module):
    """Concatenate a 1x1 branch (c1 channels) and a 3x3 branch (c3 channels) at the same resolution."""

    def __init__(self, c_in: int, c1: int, c3: int) -> None:
        super().__init__()
        self.branch1 = conv_bn_relu(c_in, c1, 1)
        self.branch3 = conv_bn_relu(c_in, c3, 3)
        self.out_channels = c1 + c3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch3(x)], dim=1)


class DownsampleModule(nn.Module):
    """Halve the resolution: a 3x3 stride-2 conv branch (c3 channels) next to a 3x3 stride-2 max-pool of the input."""

    def __init__(self, c_in: int, c3: int) -> None:
        super().__init__()
        self.conv = conv_bn_relu(c_in, c3, 3, stride=2)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.out_channels = c3 + c_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.conv(x), self.pool(x)], dim=1)


# ("s", c1, c3) for a simple module, ("d", c3) for a downsample module, in network order.
LAYOUT = (
    ("s", 32, 32), ("s", 32, 48), ("d", 80),
    ("s", 112, 48), ("s", 96, 64), ("s", 80, 80), ("s", 48, 96), ("d", 96),
    ("s", 176, 160), ("s", 176, 160),
)  # fmt: skip


def build_modules(c_in: int) -> tuple[nn.Sequential, int]:
    """Instantiate LAYOUT from ``c_in`` input channels; returns the modules and their output width (336)."""
    modules: list[nn.Module] = []
    for kind, *widths in LAYOUT:
        module = SimpleModule(c_in, *widths) if kind == "s" else DownsampleModule(c_in, *widths)
        modules.append(module)
        c_in = module.out_channels
    return nn.Sequential(*modules), c_in


class InceptionBNSmall(nn.Module):
    """Stem conv to 96 channels, the ten inception modules, global average pool, Linear."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = conv_bn_relu(3, 96, 3)
        self.body, width = build_modules(96)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


@register_model(
    "inception_bn_small",
    input_size=28,
    description="MXNet Inception-BN 28-small for CIFAR at 28x28 (1.65 M params)",
    recipe="mxnet-cifar",
)
def inception_bn_small(num_classes: int = 10) -> nn.Module:
    """Inception-BN 28-small, the MXNet CIFAR seed's net (see module docstring for the exact count)."""
    return InceptionBNSmall(num_classes)
