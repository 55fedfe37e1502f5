"""Data a user brings: the same small labelled image set as tensors and as ``torch.utils.data.Dataset`` objects.

Four classes of 16x16 RGB images, each class brighter in its own channel, so a tiny net learns them in an epoch.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

CLASSES = 4
SIDE = 16


def _images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % CLASSES
    images = torch.randint(0, 128, (n, 3, SIDE, SIDE), generator=gen, dtype=torch.uint8)
    for c in range(3):
        images[labels == c, c] += 100
    return images, labels


def tensors() -> dict:
    """(images, labels) tensors: uint8 N x 3 x 16 x 16 and int64 labels."""
    return {"train": _images(512, 0), "test": _images(128, 1)}


class Pictures(Dataset):
    """Float 0..1 images with the dataset's own augmentation (a random horizontal flip in training)."""

    classes = ["red", "green", "blue", "grey"]

    def __init__(self, n: int, seed: int, train: bool) -> None:
        self.images, self.labels = _images(n, seed)
        self.train = train

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index].float() / 255
        if self.train and torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image, int(self.labels[index])


def datasets() -> dict:
    """torch Datasets (the class count comes from ``Pictures.classes``), normalised by the mean and std given."""
    train, test = Pictures(512, 0, train=True), Pictures(128, 1, train=False)
    return {"train": train, "test": test, "mean": (0.35, 0.35, 0.35), "std": (0.2, 0.2, 0.2)}
