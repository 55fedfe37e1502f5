"""Networks a user writes: plain functions returning an ``nn.Module``, none registered with trainscale."""

from __future__ import annotations

import torch
from torch import nn


def tiny(num_classes: int, width: int = 8, bias: bool = True) -> nn.Module:
    """A conv, a ReLU, global pooling and a linear layer: a few hundred parameters, no BatchNorm."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, stride=2, padding=1, bias=bias),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, num_classes),
    )


def ten_outputs(width: int = 4) -> nn.Module:
    """Takes no ``num_classes``: always ten outputs."""
    return tiny(10, width)


def not_a_module() -> int:
    return 3


class Exploding(nn.Sequential):
    """``tiny``, whose forward fails in training on real tensors: a bug in the user's code that the checks on
    PyTorch's meta device cannot see."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.device.type != "meta":
            raise RuntimeError("my layer exploded")
        return super().forward(x)


def exits(num_classes: int) -> nn.Module:
    """Script-style code that ends the process where it should raise."""
    raise SystemExit(3)


def explodes(num_classes: int) -> nn.Module:
    return Exploding(*tiny(num_classes))


class Block(nn.Module):
    """Pre-norm transformer block: attention, then an MLP of 4x the width, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A small vision transformer: patch embedding, a class token, learned positions, ``depth`` blocks."""

    def __init__(self, num_classes: int, image_size: int, patch: int, dim: int, depth: int, heads: int) -> None:
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image size {image_size} is not a multiple of the patch size {patch}")
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (image_size // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def vit(
    num_classes: int = 10, image_size: int = 32, patch: int = 4, dim: int = 128, depth: int = 6, heads: int = 4
) -> nn.Module:
    """ViT for CIFAR-sized images (patch 4: 64 tokens); ``dim=128, depth=6`` is about 1.2 M parameters."""
    return ViT(num_classes, image_size, patch, dim, depth, heads)
