"""The ResNets that MXNet's CIFAR-10 example builds, to project the MXNet multi-GPU page on its own nets.

That page (beeva-poc-mxnet) ran MXNet 0.11's
``example/image-classification/train_cifar10.py --network resnet [--num-layers 50]`` (``--num-layers`` defaults
to 110) with ``image_shape = "3,28,28"``. Its ``symbols/resnet.py`` (``get_symbol``) then
takes the small-image branch (height <= 28): three stages of ``(num_layers - 2) // 6`` *basic* pre-activation units at
16/32/64 filters (``filter_list = [16, 16, 32, 64]``) when ``(num_layers - 2) % 6 == 0`` and ``num_layers < 164``;
bottleneck units only from 164 layers (not registered here). So the page's "resnet50" is a 0.76 M-parameter net, not
the 23.5 M bottleneck ``resnet50``, and its "resnet110" is not He et al.'s option-A ``resnet110`` either.

The symbol, mirrored here layer for layer:

* ``bn_data``: BatchNorm on the raw input with ``fix_gamma=True`` (gamma held at 1, only beta trains);
* ``conv0``: 3x3 stride-1 conv to 16 channels, no BN or ReLU after it (the units pre-activate);
* ``residual_unit(bottle_neck=False)``: BN-ReLU-conv3x3(stride)-BN-ReLU-conv3x3, summed with the input; the first
  unit of every stage (stage 1 included, though 16 -> 16) has ``dim_match=False``, so its shortcut is a bias-free
  1x1 conv (no BN) applied to the *pre-activated* input;
* ``bn1``-``relu1``, global average pool, ``fc1`` (with bias) to the classes.

Convs are bias-free; every BatchNorm has eps 2e-5 and MXNet momentum 0.9 (PyTorch momentum 0.1). Weights start as
the example's ``common/fit.py`` initialises them: ``Xavier(rnd_type="gaussian", factor_type="in", magnitude=2)``, i.e.
Kaiming-normal with fan-in, biases zero. Trainable parameters at 10 classes: 758,621 (``resnet50_mxnet``) and
1,730,781 (``resnet110_mxnet``); MXNet's own count is 3 higher (it lists ``bn_data``'s fixed gamma).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainscale.models.registry import register_model

BN_EPS = 2e-5  # MXNet symbol's eps for every BatchNorm
BN_MOMENTUM = 0.1  # PyTorch form of MXNet's bn_mom=0.9 (MXNet keeps 0.9 of the running stats, PyTorch 1 - 0.1)
FILTERS = (16, 16, 32, 64)  # filter_list for basic units at height <= 28: conv0, then the three stages
BOTTLENECK_FROM = 164  # from this depth MXNet switches to bottleneck units, which this module does not build


def batch_norm(channels: int) -> nn.BatchNorm2d:
    """BatchNorm with the symbol's eps and momentum, so running statistics evolve as MXNet's do."""
    return nn.BatchNorm2d(channels, eps=BN_EPS, momentum=BN_MOMENTUM)


def conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    """Bias-free 3x3 'same' conv: the symbol sets no_bias=True because a BatchNorm always follows or precedes it."""
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)


def units_per_stage(num_layers: int) -> int:
    """Basic units per stage for ``num_layers``, by get_symbol's rule; other depths MXNet builds differently or not."""
    if (num_layers - 2) % 6 != 0 or num_layers >= BOTTLENECK_FROM:
        raise ValueError(
            f"MXNet's CIFAR resnet builds basic units only for 6n+2 < {BOTTLENECK_FROM} layers, got {num_layers}"
        )
    return (num_layers - 2) // 6


class PreActUnit(nn.Module):
    """MXNet's basic ``residual_unit``: BN-ReLU-conv, BN-ReLU-conv, plus identity or a 1x1 conv of the activation."""

    def __init__(self, c_in: int, c_out: int, stride: int, dim_match: bool) -> None:
        super().__init__()
        self.bn1 = batch_norm(c_in)
        self.conv1 = conv3x3(c_in, c_out, stride)
        self.bn2 = batch_norm(c_out)
        self.conv2 = conv3x3(c_out, c_out)
        self.sc = None if dim_match else nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act1 = F.relu(self.bn1(x))
        out = self.conv2(F.relu(self.bn2(self.conv1(act1))))
        return out + (x if self.sc is None else self.sc(act1))


def stage(c_in: int, c_out: int, units: int, stride: int) -> nn.Sequential:
    """A projecting first unit (dim_match=False even when the widths agree, as in the symbol), then identity units."""
    blocks = [PreActUnit(c_in, c_out, stride, dim_match=False)]
    blocks += [PreActUnit(c_out, c_out, 1, dim_match=True) for _ in range(units - 1)]
    return nn.Sequential(*blocks)


class MXNetCifarResNet(nn.Module):
    """bn_data, conv0, three stages at 28/14/7 pixels, bn1-relu1, global average pool, fc1: the 28x28 symbol."""

    def __init__(self, num_layers: int, num_classes: int = 10) -> None:
        super().__init__()
        units = units_per_stage(num_layers)
        self.bn_data = batch_norm(3)
        self.bn_data.weight.requires_grad_(False)  # fix_gamma=True: gamma stays 1
        self.conv0 = conv3x3(3, FILTERS[0])
        self.stages = nn.Sequential(*(stage(FILTERS[i], FILTERS[i + 1], units, 1 if i == 0 else 2) for i in range(3)))
        self.bn1 = batch_norm(FILTERS[-1])
        self.fc1 = nn.Linear(FILTERS[-1], num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        """MXNet fit.py's Xavier(gaussian, in, magnitude 2) = Kaiming-normal fan-in on conv and FC weights."""
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
        nn.init.zeros_(self.fc1.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.conv0(self.bn_data(x)))
        x = F.relu(self.bn1(x))
        return self.fc1(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@register_model(
    "resnet50_mxnet",
    input_size=28,
    description="MXNet 0.11 CIFAR symbols/resnet.py at 50 layers: pre-activation, 8 basic units "
    "per stage (the MXNet multi-GPU page's 'resnet50', 758,621 params)",
    recipe="mxnet-cifar",
)
def resnet50_mxnet(num_classes: int = 10) -> nn.Module:
    """``train_cifar10.py --network resnet --num-layers 50`` (symbols/resnet.py, 3x28x28): the page's "resnet50"."""
    return MXNetCifarResNet(50, num_classes)


@register_model(
    "resnet110_mxnet",
    input_size=28,
    description="MXNet 0.11 CIFAR symbols/resnet.py at 110 layers: pre-activation, 18 basic units "
    "per stage (the MXNet multi-GPU page's 'resnet110', 1,730,781 params)",
    recipe="mxnet-cifar",
)
def resnet110_mxnet(num_classes: int = 10) -> nn.Module:
    """``train_cifar10.py --network resnet`` (110 layers by default; symbols/resnet.py, 3x28x28): "resnet110"."""
    return MXNetCifarResNet(110, num_classes)
