"""``ImageTensors``: a whole labelled image set held as two tensors, plus the per-channel statistics.

Every in-memory dataset (CIFAR, synthetic, small image folders) is returned as one of these, so the
on-device loader only ever sees uint8 NCHW images and int64 labels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trainscale.errors import ConfigError

# Per-channel mean and standard deviation in 0..1 units, computed once over the 50,000 training
# images of the official sets (population std over every pixel of a channel) and hard-coded here.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
# The usual ImageNet statistics, used for image folders.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class ImageTensors:
    """``images``: uint8 (N, C, H, W); ``labels``: int64 (N,); ``mean``/``std``: per channel, 0..1 units."""

    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    name: str

    def __post_init__(self) -> None:
        if self.images.dim() != 4:
            raise ValueError(f"{self.name}: images must be N,C,H,W, got shape {tuple(self.images.shape)}")
        if self.labels.dim() != 1 or self.labels.shape[0] != self.images.shape[0]:
            raise ValueError(
                f"{self.name}: {self.images.shape[0]} images but labels of shape {tuple(self.labels.shape)}"
            )
        if len(self.mean) != self.images.shape[1] or len(self.std) != self.images.shape[1]:
            raise ValueError(f"{self.name}: mean/std need one value per channel ({self.images.shape[1]})")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one image."""
        c, h, w = self.images.shape[1:]
        return int(c), int(h), int(w)

    def subset(self, n: int) -> ImageTensors:
        """The first ``n`` samples (views, no copy); ``n`` beyond the data size is a ConfigError."""
        if n < 1:
            raise ConfigError(f"a subset of {self.name} needs at least 1 sample, got {n}")
        if n > len(self):
            raise ConfigError(
                f"asked for a subset of {n} samples but {self.name} has only {len(self)}; "
                f"use a subset size of at most {len(self)}"
            )
        return replace(self, images=self.images[:n], labels=self.labels[:n])

    def to(self, device: torch.device | str) -> ImageTensors:
        """A copy with both tensors on ``device`` (no copy when they are already there)."""
        return replace(self, images=self.images.to(device), labels=self.labels.to(device))
