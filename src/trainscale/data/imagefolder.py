"""ImageNet-style image folders: ``root/train/<class>/*.JPEG`` and ``root/val/<class>/*``.

Classes are the sub-folder names in sorted order; images are files ending in .jpg, .jpeg or .png (any
case). Decoding is per image by nature (Pillow), so this is a ``torch.utils.data.Dataset`` fed through
a DataLoader with worker processes, wrapped by ``FolderBatches`` which shards like ``DeviceBatches``
and yields normalised float batches on the device. Small folders can instead be decoded once into
memory with ``load_folder_as_tensors`` and used with ``DeviceBatches``.

Geometry: the shorter side is resized to ``round(image_size * 8 / 7)`` (about 1.14x: 224 -> 256,
299 -> 342), then training takes a random ``image_size`` square of it plus a random horizontal flip,
and evaluation the centre square.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from trainscale.data.augment import normalize
from trainscale.data.sharding import (
    batches_per_epoch,
    check_world,
    eval_range,
    mix_seed,
    train_shard,
    train_shard_size,
)
from trainscale.data.tensors import IMAGENET_MEAN, IMAGENET_STD, ImageTensors
from trainscale.errors import ConfigError, DataError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
RESIZE_RATIO = 8 / 7
LAYOUT_HINT = "expected <root>/train/<class>/*.jpg|jpeg|png and <root>/val/<class>/..., one folder per class"


def resize_side(image_size: int) -> int:
    """Shorter-side length images are resized to before cropping ``image_size``."""
    return int(round(image_size * RESIZE_RATIO))


def find_classes(split_dir: Path) -> list[str]:
    """Sorted class folder names of ``split_dir``; DataError when there are none."""
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise DataError(f"image folder {split_dir} does not exist; {LAYOUT_HINT}")
    classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"no class folders in {split_dir}; {LAYOUT_HINT}")
    return classes


def list_samples(root: Path, split: str) -> tuple[list[tuple[Path, int]], list[str]]:
    """(path, class index) of every image of ``root/split`` (sorted), and the class names. The classes are the
    training split's, in every split: a class index means one class in training and evaluation, whatever folders
    another split lacks; a class folder of another split that training lacks, or a training class without
    images, is refused (either would shift every later class's index between the splits)."""
    split_dir = Path(root) / split
    classes = find_classes(Path(root) / "train")
    extra = sorted(set(find_classes(split_dir)) - set(classes))
    if extra:
        raise DataError(
            f"{split_dir} has class folder(s) the training split lacks: {', '.join(extra[:5])}; "
            f"every class needs training images in {Path(root) / 'train'}"
        )
    samples: list[tuple[Path, int]] = []
    for index, name in enumerate(classes):
        files = images_in(split_dir / name)
        if not files and split == "train":
            raise DataError(f"class folder {split_dir / name} holds no .jpg/.jpeg/.png images; add some or remove it")
        samples.extend((p, index) for p in files)
    if not samples:
        raise DataError(f"no .jpg/.jpeg/.png images under {split_dir}; {LAYOUT_HINT}")
    return samples, classes


def images_in(folder: Path) -> list[Path]:
    """The images of one class folder, sorted; none where the folder is absent (a class another split lacks)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def decode_image(path: Path, image_size: int, rng: random.Random | None = None) -> np.ndarray:
    """Decode to RGB, resize the shorter side, crop ``image_size`` (random + flip with ``rng``, else centre).

    Returns a (3, image_size, image_size) uint8 array.
    """
    from PIL import Image, UnidentifiedImageError

    side = resize_side(image_size)
    img: Image.Image
    try:
        with Image.open(path) as img:
            img.draft("RGB", (side, side))  # JPEG: decode at a reduced scale when that still covers `side`
            img = img.convert("RGB")
            w, h = img.size
            scale = side / min(w, h)
            new_w, new_h = max(side, round(w * scale)), max(side, round(h * scale))
            img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
            if rng is None:
                top, left = (new_h - image_size) // 2, (new_w - image_size) // 2
            else:
                top, left = rng.randint(0, new_h - image_size), rng.randint(0, new_w - image_size)
            img = img.crop((left, top, left + image_size, top + image_size))
            if rng is not None and rng.random() < 0.5:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            array = np.asarray(img, dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DataError(f"cannot decode image {path} ({exc}); remove or replace the file") from exc
    return np.ascontiguousarray(array.transpose(2, 0, 1))


class ImageFolderDataset(Dataset):
    """Decoded, cropped uint8 (3, S, S) tensors and int labels of ``root/split``.

    Training randomness for sample i in epoch e comes from a generator seeded by (seed, e, i), so it is
    the same whatever the number of workers. Call ``set_epoch`` before iterating an epoch.
    """

    def __init__(self, root: Path, split: str, image_size: int, *, train: bool | None = None, seed: int = 0) -> None:
        if image_size < 1:
            raise ConfigError(f"image size must be a positive integer, got {image_size}")
        self.root = Path(root)
        self.split = split
        self.image_size = image_size
        self.train = (split == "train") if train is None else train
        self.seed = seed
        self.epoch = 0
        self.samples, self.classes = list_samples(self.root, split)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        rng = random.Random(mix_seed(self.seed, self.epoch, index)) if self.train else None
        return torch.from_numpy(decode_image(path, self.image_size, rng)), label


class FolderBatches:
    """Batches of an image folder decoded by DataLoader workers; satisfies the ``Batches`` protocol.

    Sharding matches ``DeviceBatches``: training uses the (seed, epoch) permutation, drops
    ``n % world_size`` samples and takes ``perm[rank::world_size]``; evaluation takes a contiguous
    block per rank, in order, keeping the last partial batch. Yields (normalised ``dtype`` NCHW on
    ``device``, int64 labels on ``device``).
    """

    def __init__(
        self,
        root: Path | str,
        split: str,
        image_size: int,
        batch_size: int,
        *,
        train: bool | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        drop_last: bool | None = None,
        channels_last: bool = False,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch size must be a positive integer, got {batch_size}")
        if num_workers < 0:
            raise ConfigError(f"number of loader workers must be >= 0, got {num_workers}")
        self.dataset = ImageFolderDataset(Path(root), split, image_size, train=train, seed=seed)
        self.train = self.dataset.train
        self.classes = self.dataset.classes
        self.num_classes = len(self.classes)
        n = len(self.dataset)
        check_world(n, rank, world_size)
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_workers = num_workers
        self.drop_last = self.train if drop_last is None else drop_last
        self.channels_last = channels_last
        self.mean, self.std = tuple(mean), tuple(std)
        if self.train:
            self.shard_size = train_shard_size(n, world_size)
        else:
            start, stop = eval_range(n, rank, world_size)
            self._eval_indices = list(range(start, stop))
            self.shard_size = stop - start
        if self.drop_last and batch_size > self.shard_size:
            raise ConfigError(
                f"batch size {batch_size} is larger than the {self.shard_size} images rank {rank} of {world_size} "
                f"gets per epoch from {root}/{split}, so every batch would be dropped; use a batch size of at "
                f"most {self.shard_size}"
            )

    def __len__(self) -> int:
        return batches_per_epoch(self.shard_size, self.batch_size, self.drop_last)

    @property
    def num_samples(self) -> int:
        return len(self) * self.batch_size if self.drop_last else self.shard_size

    def indices(self, epoch: int) -> list[int]:
        """Dataset indices this rank reads in ``epoch``, in order."""
        if self.train:
            return train_shard(len(self.dataset), self.rank, self.world_size, self.seed, epoch).tolist()
        return self._eval_indices

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.dataset.set_epoch(epoch)  # copied into the workers when the DataLoader iterator starts
        loader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=self.indices(epoch),
            num_workers=self.num_workers,
            drop_last=self.drop_last,
            pin_memory=self.device.type == "cuda",
        )
        for images, labels in loader:
            x = normalize(images.to(self.device, non_blocking=True), self.mean, self.std, self.dtype)
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x, labels.to(self.device, dtype=torch.int64, non_blocking=True)


def load_folder_as_tensors(
    root: Path | str, split: str, image_size: int, limit: int | None = None, *, num_workers: int = 0
) -> ImageTensors:
    """Decode ``root/split`` once into uint8 tensors (centre crops, no randomness) for ``DeviceBatches``.

    With ``limit``, the first ``limit`` images in class-interleaved order are kept (image 0 of every
    class, then image 1 of every class, ...), so a small limit still covers the classes.
    """
    dataset = ImageFolderDataset(Path(root), split, image_size, train=False)
    ranks = _ranks_in_class(dataset.samples)
    order = sorted(range(len(dataset.samples)), key=lambda i: (ranks[i], dataset.samples[i][1]))
    if limit is not None:
        if limit < 1:
            raise ConfigError(f"image limit must be a positive integer, got {limit}")
        order = order[:limit]
    order.sort(key=lambda i: (dataset.samples[i][1], i))  # keep the on-disk (class, name) order
    images = torch.empty((len(order), 3, image_size, image_size), dtype=torch.uint8)
    labels = torch.empty(len(order), dtype=torch.int64)
    loader = DataLoader(dataset, batch_size=64, sampler=order, num_workers=num_workers)
    pos = 0
    for x, y in loader:
        images[pos : pos + len(x)] = x
        labels[pos : pos + len(x)] = y
        pos += len(x)
    return ImageTensors(
        images=images,
        labels=labels,
        num_classes=len(dataset.classes),
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        name="imagefolder",
    )


def _ranks_in_class(samples: list[tuple[Path, int]]) -> list[int]:
    """Position of every sample within its class (samples are grouped by class)."""
    ranks: list[int] = []
    seen: dict[int, int] = {}
    for _, label in samples:
        ranks.append(seen.get(label, 0))
        seen[label] = ranks[-1] + 1
    return ranks
