"""Inception-v3 (Szegedy et al. 2015, "Rethinking the Inception Architecture") for 299x299 input.

Written from the paper's structure: stem (five convs, two max-pools) to 35x35x192; three Inception-A modules (5x5
factorised as two 3x3); reduction B to 17x17x768; four Inception-C modules with 7x7 factorised into 1x7 and 7x1;
reduction D to 8x8x1280; two Inception-E modules with expanded 1x3/3x1 filter banks to 2048 channels; global average
pool, dropout, FC. Every conv is bias-free and followed by BN (eps 0.001) and ReLU. Without the auxiliary head the
net has 23,834,568 parameters for 1000 classes (21,806,058 for 10).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from trainscale.models.registry import register_model

Size = int | tuple[int, int]


class ConvBN(nn.Module):
    """Bias-free conv, BN (eps 0.001, as in the paper's TF code), ReLU: the unit every layer is built from."""

    def __init__(self, c_in: int, c_out: int, kernel: Size, stride: int = 1, padding: Size = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(c_out, eps=0.001)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


def conv_1x7(c_in: int, c_out: int) -> ConvBN:
    """Horizontal half of a factorised 7x7 conv."""
    return ConvBN(c_in, c_out, (1, 7), padding=(0, 3))


def conv_7x1(c_in: int, c_out: int) -> ConvBN:
    """Vertical half of a factorised 7x7 conv."""
    return ConvBN(c_in, c_out, (7, 1), padding=(3, 0))


class Branches(nn.Module):
    """Run parallel branches on the same input and concatenate along channels (the Inception pattern)."""

    def __init__(self, *branches: nn.Module) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x) for branch in self.branches], dim=1)


def pool_proj(c_in: int, c_out: int) -> nn.Sequential:
    """3x3 stride-1 average pool then a 1x1 projection: the pooling branch of the A, C and E modules."""
    return nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), ConvBN(c_in, c_out, 1))


def inception_a(c_in: int, pool_features: int) -> Branches:
    """35x35 module: 1x1; 1x1 -> 5x5; 1x1 -> 3x3 -> 3x3; avg-pool -> 1x1. Output 224 + pool_features."""
    return Branches(
        ConvBN(c_in, 64, 1),
        nn.Sequential(ConvBN(c_in, 48, 1), ConvBN(48, 64, 5, padding=2)),
        nn.Sequential(ConvBN(c_in, 64, 1), ConvBN(64, 96, 3, padding=1), ConvBN(96, 96, 3, padding=1)),
        pool_proj(c_in, pool_features),
    )


def reduction_b(c_in: int) -> Branches:
    """35 -> 17 grid reduction: stride-2 3x3 conv, stride-2 double 3x3, and stride-2 max-pool in parallel."""
    return Branches(
        ConvBN(c_in, 384, 3, stride=2),
        nn.Sequential(ConvBN(c_in, 64, 1), ConvBN(64, 96, 3, padding=1), ConvBN(96, 96, 3, stride=2)),
        nn.MaxPool2d(3, stride=2),
    )


def inception_c(c_in: int, c7: int) -> Branches:
    """17x17 module with 7x7 convs factorised into 1x7 and 7x1 (c7 inner channels). Output 768."""
    return Branches(
        ConvBN(c_in, 192, 1),
        nn.Sequential(ConvBN(c_in, c7, 1), conv_1x7(c7, c7), conv_7x1(c7, 192)),
        nn.Sequential(ConvBN(c_in, c7, 1), conv_7x1(c7, c7), conv_1x7(c7, c7), conv_7x1(c7, c7), conv_1x7(c7, 192)),
        pool_proj(c_in, 192),
    )


def reduction_d(c_in: int) -> Branches:
    """17 -> 8 grid reduction: 1x1 -> stride-2 3x3; 1x1 -> 1x7 -> 7x1 -> stride-2 3x3; stride-2 max-pool."""
    return Branches(
        nn.Sequential(ConvBN(c_in, 192, 1), ConvBN(192, 320, 3, stride=2)),
        nn.Sequential(ConvBN(c_in, 192, 1), conv_1x7(192, 192), conv_7x1(192, 192), ConvBN(192, 192, 3, stride=2)),
        nn.MaxPool2d(3, stride=2),
    )


def split_1x3_3x1(c_in: int, c_out: int) -> Branches:
    """Parallel 1x3 and 3x1 convs, concatenated: the expanded filter bank of the 8x8 modules."""
    return Branches(ConvBN(c_in, c_out, (1, 3), padding=(0, 1)), ConvBN(c_in, c_out, (3, 1), padding=(1, 0)))


def inception_e(c_in: int) -> Branches:
    """8x8 module with expanded filter banks. Output 320 + 768 + 768 + 192 = 2048."""
    return Branches(
        ConvBN(c_in, 320, 1),
        nn.Sequential(ConvBN(c_in, 384, 1), split_1x3_3x1(384, 384)),
        nn.Sequential(ConvBN(c_in, 448, 1), ConvBN(448, 384, 3, padding=1), split_1x3_3x1(384, 384)),
        pool_proj(c_in, 192),
    )


def stem() -> nn.Sequential:
    """299x299x3 -> 35x35x192 with plain convs and two max-pools."""
    return nn.Sequential(
        ConvBN(3, 32, 3, stride=2),
        ConvBN(32, 32, 3),
        ConvBN(32, 64, 3, padding=1),
        nn.MaxPool2d(3, stride=2),
        ConvBN(64, 80, 1),
        ConvBN(80, 192, 3),
        nn.MaxPool2d(3, stride=2),
    )


class AuxHead(nn.Module):
    """Auxiliary classifier on the 17x17x768 grid, a regulariser in the paper; used only in training mode."""

    def __init__(self, c_in: int, num_classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.AvgPool2d(5, stride=3), ConvBN(c_in, 128, 1), ConvBN(128, 768, 5), nn.AdaptiveAvgPool2d(1)
        )
        self.fc = nn.Linear(768, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.body(x), 1))


class InceptionV3(nn.Module):
    """Inception-v3; with ``aux_logits`` the training-mode forward returns ``(logits, aux_logits)``."""

    C7_WIDTHS: Sequence[int] = (128, 160, 160, 192)

    def __init__(self, num_classes: int = 10, aux_logits: bool = False, dropout: float = 0.5) -> None:
        super().__init__()
        self.stem = stem()
        self.grid35 = nn.Sequential(inception_a(192, 32), inception_a(256, 64), inception_a(288, 64))
        self.grid17 = nn.Sequential(reduction_b(288), *[inception_c(768, c7) for c7 in self.C7_WIDTHS])
        self.aux = AuxHead(768, num_classes) if aux_logits else None
        self.grid8 = nn.Sequential(reduction_d(768), inception_e(1280), inception_e(2048))
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(2048, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.grid17(self.grid35(self.stem(x)))
        aux = self.aux(x) if self.aux is not None and self.training else None
        logits = self.head(self.grid8(x))
        return logits if aux is None else (logits, aux)


@register_model(
    "inception_v3",
    input_size=299,
    description="Inception-v3 (Szegedy et al. 2015), BN after every conv, no aux head by default",
    default_dataset="imagefolder",
    recipe="keras-mxnet",
)
def inception_v3(num_classes: int = 10, aux_logits: bool = False, dropout: float = 0.5) -> nn.Module:
    """Inception-v3 for 299x299 input; 23,834,568 params at 1000 classes without the aux head."""
    return InceptionV3(num_classes, aux_logits=aux_logits, dropout=dropout)
