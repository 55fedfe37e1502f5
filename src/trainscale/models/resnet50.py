"""Bottleneck ResNet-50 (He et al. 2016, [3, 4, 6, 3] blocks) with a CIFAR stem and with the ImageNet stem.

``resnet50`` is the 23.5 M-parameter bottleneck net on 32x32 input: 3x3 stride-1 stem, no max-pool, so the four
stages run at 32/16/8/4 pixels. It is *not* what MXNet's CIFAR example calls "resnet50" at 28x28 input: that one
resolves to a small pre-activation basic-block net (n=8, 758,621 params), registered as ``resnet50_mxnet``
(:mod:`trainscale.models.resnet_mxnet`). ``resnet50_imagenet`` is the standard ImageNet ResNet-50 (7x7 stride-2
stem and 3x3 max-pool, 224x224 input; 25,557,032 params for 1000 classes).
"""

from __future__ import annotations

import torch
from torch import nn

from trainscale.models.registry import register_model
from trainscale.models.resnet_cifar import kaiming_init_convs

EXPANSION = 4


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride), 1x1 expand by 4; 1x1 projection shortcut when the shape changes."""

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        c_out = width * EXPANSION
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


def cifar_stem() -> nn.Sequential:
    """3x3 stride-1 conv: keeps 32x32 resolution, since 32-pixel images cannot afford a 4x early downsample."""
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True))


def imagenet_stem() -> nn.Sequential:
    """7x7 stride-2 conv and 3x3 stride-2 max-pool: the original 4x downsample for 224x224 images."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    )


class ResNet50(nn.Module):
    """Stem, four bottleneck stages ([3, 4, 6, 3] blocks at widths 64/128/256/512), global avg pool, Linear."""

    def __init__(self, stem: nn.Module, num_classes: int = 10, blocks: tuple[int, ...] = (3, 4, 6, 3)) -> None:
        super().__init__()
        self.stem = stem
        stages, c_in = [], 64
        for i, n in enumerate(blocks):
            width = 64 * 2**i
            stages.append(self._stage(c_in, width, n, stride=1 if i == 0 else 2))
            c_in = width * EXPANSION
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)
        self._init_weights()

    @staticmethod
    def _stage(c_in: int, width: int, n: int, stride: int) -> nn.Sequential:
        c_out = width * EXPANSION
        return nn.Sequential(Bottleneck(c_in, width, stride), *[Bottleneck(c_out, width) for _ in range(n - 1)])

    def _init_weights(self) -> None:
        kaiming_init_convs(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


@register_model(
    "resnet50",
    input_size=32,
    description="bottleneck ResNet-50 with a 3x3 CIFAR stem (23.5 M params)",
    recipe="goyal2017",
)
def resnet50(num_classes: int = 10) -> nn.Module:
    """The 23,520,842-parameter bottleneck ResNet-50 for 32x32 input (not MXNet's 28x28 ~0.76 M "resnet50")."""
    return ResNet50(cifar_stem(), num_classes)


@register_model(
    "resnet50_imagenet",
    input_size=224,
    description="standard ImageNet ResNet-50 (7x7 stem + max-pool, 25.6 M params at 1000 classes)",
    default_dataset="imagefolder",
    recipe="goyal2017",
)
def resnet50_imagenet(num_classes: int = 10) -> nn.Module:
    """ResNet-50 with the ImageNet stem, for 224x224 image folders; 25,557,032 params at 1000 classes."""
    return ResNet50(imagenet_stem(), num_classes)
