"""AlexNet variants for 32x32 CIFAR used in the layer-wise gradient-compression study.

``alexnet`` is torchvision's AlexNet shrunk to 32x32 input with its three FC layers kept: 23,272,266 params for 10
classes, about 21 M of them in the FC layers, which is what makes it interesting for compression (a few huge layers).
``alexnet_bn`` keeps the five conv layers (bias-free, each followed by BN) and replaces the FC head with global max
pooling and one Linear(256, classes): 2,255,306 params for 10 classes, a conv-dominated net in the cifar10-fast style.
"""

from __future__ import annotations

from torch import nn

from trainscale.models.registry import register_model

# (in, out, stride, max-pool after) for the five 3x3 conv layers shared by both variants.
CONV_LAYERS = ((3, 64, 2, True), (64, 192, 1, True), (192, 384, 1, False), (384, 256, 1, False), (256, 256, 1, True))


def conv_features(batch_norm: bool) -> nn.Sequential:
    """The five 3x3 conv layers; 32x32 input ends at 256x2x2. With BN the convs drop their redundant bias."""
    layers: list[nn.Module] = []
    for c_in, c_out, stride, pool in CONV_LAYERS:
        layers.append(nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=not batch_norm))
        if batch_norm:
            layers.append(nn.BatchNorm2d(c_out))
        layers.append(nn.ReLU(inplace=True))
        if pool:
            layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


def fc_head(num_classes: int, dropout: float) -> nn.Sequential:
    """AlexNet's 1024 -> 4096 -> 4096 -> classes head, with dropout before the first two FC layers."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(256 * 2 * 2, 4096),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(4096, 4096),
        nn.ReLU(inplace=True),
        nn.Linear(4096, num_classes),
    )


@register_model(
    "alexnet",
    input_size=32,
    description="torchvision-like AlexNet at 32x32 with 3 FC layers (23.3 M)",
    recipe="krizhevsky2012",
)
def alexnet(num_classes: int = 10, dropout: float = 0.5) -> nn.Module:
    """FC-heavy AlexNet (23,272,266 params at 10 classes): the layer-wise compression study's large-FC case."""
    return nn.Sequential(conv_features(batch_norm=False), fc_head(num_classes, dropout))


@register_model(
    "alexnet_bn",
    input_size=32,
    description="AlexNet convs with BN, global max pool, one Linear (2.26 M)",
    recipe="krizhevsky2012",
)
def alexnet_bn(num_classes: int = 10) -> nn.Module:
    """BN AlexNet (2,255,306 params at 10 classes): same convs, no FC stack, so conv layers dominate."""
    return nn.Sequential(
        conv_features(batch_norm=True),
        nn.AdaptiveMaxPool2d(1),
        nn.Flatten(),
        nn.Linear(256, num_classes),
    )
