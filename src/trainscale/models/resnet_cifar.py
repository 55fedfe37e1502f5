"""CIFAR ResNet-6n+2 (He et al. 2016, section 4.2) with parameter-free option-A shortcuts.

These are the nets the original paper reports on CIFAR-10 (ResNet-20 ... ResNet-110); option A keeps the parameter
counts equal to the paper's (ResNet-32: 464,154), which a 1x1 projection shortcut would not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainscale.models.registry import register_model


def kaiming_init_convs(model: nn.Module) -> None:
    """Kaiming-normal convs (He et al. 2015), the initialisation the ResNet papers train deep nets from."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


class ShortcutA(nn.Module):
    """Option-A shortcut: subsample spatially by ``stride`` and zero-pad the new channels (no parameters)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.pad = c_out - c_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride > 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.pad:
            before = self.pad // 2
            x = F.pad(x, (0, 0, 0, 0, before, self.pad - before))
        return x


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or option-A) shortcut, ReLU after the sum."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = ShortcutA(c_in, c_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2): 3x3 stem to 16 channels, three stages of n blocks at 16/32/64, global avg pool, Linear."""

    def __init__(self, n: int, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.stages = nn.Sequential(self._stage(16, 16, n, 1), self._stage(16, 32, n, 2), self._stage(32, 64, n, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        self._init_weights()

    @staticmethod
    def _stage(c_in: int, c_out: int, n: int, stride: int) -> nn.Sequential:
        blocks = [BasicBlock(c_in, c_out, stride)] + [BasicBlock(c_out, c_out) for _ in range(n - 1)]
        return nn.Sequential(*blocks)

    def _init_weights(self) -> None:
        kaiming_init_convs(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def _make_factory(depth: int) -> Callable[..., nn.Module]:
    """One registered factory per depth; depth must be 6n+2."""
    n = (depth - 2) // 6

    def factory(num_classes: int = 10) -> nn.Module:
        return CifarResNet(n, num_classes)

    factory.__name__ = f"resnet{depth}"
    factory.__doc__ = f"ResNet-{depth} for CIFAR (n={n}, option-A shortcuts)."
    return factory


_COUNTS = {20: "0.27 M", 32: "0.46 M", 44: "0.66 M", 56: "0.85 M", 110: "1.73 M"}

for _depth, _size in _COUNTS.items():
    register_model(
        f"resnet{_depth}",
        input_size=32,
        description=f"He et al. 2016 CIFAR ResNet-{_depth}, option-A shortcuts ({_size} params)",
        recipe="he2016-cifar",
    )(_make_factory(_depth))
