"""Random images with random labels, for shape checks and throughput runs only."""

from __future__ import annotations

import math

import torch

from trainscale.data.tensors import ImageTensors
from trainscale.errors import ConfigError

# Pixels uniform over 0..255: mean 127.5/255, std sqrt((256**2 - 1) / 12) / 255.
_UNIFORM_MEAN = 0.5
_UNIFORM_STD = math.sqrt((256**2 - 1) / 12) / 255


def synthetic_dataset(
    num_samples: int, image_size: int, num_classes: int = 10, channels: int = 3, seed: int = 0
) -> ImageTensors:
    """``num_samples`` uniform-noise uint8 images of ``channels`` x ``image_size`` x ``image_size`` with
    uniform random labels, reproducible from ``seed``.

    For measuring shapes, speed and scaling only: the labels carry no information, so NEVER use this
    for accuracy (a model can only memorise it).
    """
    for value, what in (
        (num_samples, "number of synthetic samples"),
        (image_size, "image size"),
        (num_classes, "number of classes"),
        (channels, "number of channels"),
    ):
        if value < 1:
            raise ConfigError(f"the {what} must be a positive integer, got {value}")
    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (num_samples, channels, image_size, image_size), generator=gen, dtype=torch.uint8)
    labels = torch.randint(0, num_classes, (num_samples,), generator=gen, dtype=torch.int64)
    return ImageTensors(
        images=images,
        labels=labels,
        num_classes=num_classes,
        mean=(_UNIFORM_MEAN,) * channels,
        std=(_UNIFORM_STD,) * channels,
        name="synthetic",
    )
