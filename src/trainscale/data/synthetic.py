"""Random images with random labels, for shape checks and throughput runs only."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from trainscale.data.tensors import ImageTensors
from trainscale.errors import ConfigError

# Pixels uniform over 0..255: mean 127.5/255, std sqrt((256**2 - 1) / 12) / 255.
_UNIFORM_MEAN = 0.5
_UNIFORM_STD = math.sqrt((256**2 - 1) / 12) / 255


MEMINFO = Path("/proc/meminfo")


def check_fits_in_memory(num_samples: int, channels: int, image_size: int) -> None:
    """Refuse, in one line, synthetic images that would not fit in this machine's free memory: the kernel's
    out-of-memory killer ended such a run (``--image-size 2048``: 25 GiB of test images) with no word."""
    need = num_samples * channels * image_size * image_size
    free = available_memory()
    if free is not None and need > free:
        raise ConfigError(
            f"{num_samples:,} synthetic images of {channels}x{image_size}x{image_size} take {need / 2**30:,.1f} GiB, "
            f"more than the {free / 2**30:,.1f} GiB this machine has free; give a smaller --image-size, or fewer "
            "images (--train-subset, --test-subset)"
        )


def available_memory() -> int | None:
    """The kernel's estimate of memory available to a new allocation (MemAvailable), in bytes; None where
    /proc/meminfo does not say (another OS)."""
    try:
        text = MEMINFO.read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith("MemAvailable:")), None)
    return int(line.split()[1]) * 1024 if line is not None else None


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
    check_fits_in_memory(num_samples, channels, image_size)
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
