"""A user's own data, by import path: ``--dataset my_pkg.data:build``.

The function (called with no argument, or with ``data_dir=`` when it takes that parameter: ``--data-dir`` or
``$TRAINSCALE_DATA``) returns a dict (or a ``UserData``) with:

- ``train`` and ``test``: either a pair of tensors ``(images, labels)``: images N x C x H x W, uint8 (0..255) or
  float (0..1, or already normalised), labels N integers in 0..num_classes-1 (numpy arrays are taken too); they
  go through trainscale's on-device pipeline like CIFAR (sharding, crops, flips, cutout, normalisation).
  Or a ``torch.utils.data.Dataset`` whose items are ``(image C x H x W tensor, integer label)``: it is read by a
  ``DataLoader`` with a ``DistributedSampler`` (loader worker processes, pinned memory on a GPU), and its own
  transform is the augmentation (trainscale adds none). Both splits are of the same kind.
- ``num_classes`` (optional): default the largest label + 1 (tensors), or ``len(dataset.classes)`` (Datasets).
- ``mean`` and ``std`` (optional, per channel, in the images' units: 0..1 for uint8): tensors default to the
  training images' own statistics; Dataset items are normalised only when they are given (a float image from
  the dataset's transform is used as it is; uint8 is scaled to 0..1).

Every problem (a wrong type, shape, dtype, a label out of range, splits that differ) is one ``DataError`` line
naming the split and what to change; the launcher loads the data once before any worker starts, so it is said
there. Each process calls the function itself (a worker's data is its own, like CIFAR's).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from trainscale.data.augment import normalize
from trainscale.data.sharding import batches_per_epoch, check_world, eval_range, train_shard_size
from trainscale.data.tensors import ImageTensors
from trainscale.errors import ConfigError, DataError
from trainscale.registry import load_object

KEYS = ("train", "test", "num_classes", "mean", "std")
STATS_CHUNK = 4096  # images per step of the mean/std pass (bounds its float copy)


class UserData(NamedTuple):
    """What a dataset function returns (a dict with these keys does as well); see the module docstring."""

    train: Any
    test: Any
    num_classes: int | None = None
    mean: Sequence[float] | None = None
    std: Sequence[float] | None = None


@dataclass
class DatasetSplit:
    """One split given as a ``torch.utils.data.Dataset``: what the loaders and checks need to know of it."""

    dataset: Dataset
    num_classes: int
    image_shape: tuple[int, int, int]
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    name: str

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def subset(self, n: int) -> DatasetSplit:
        """The first ``n`` items, like ``ImageTensors.subset``."""
        if not 1 <= n <= len(self):
            raise ConfigError(f"asked for a subset of {n} samples but {self.name} has {len(self)}; use 1..{len(self)}")
        return replace(self, dataset=Subset(self.dataset, range(n)))

    def known_labels(self) -> torch.Tensor | None:
        """The split's labels where the dataset lists them without reading its images (torchvision's ``targets``);
        None where it does not, or lists something else."""
        subset = self.dataset if isinstance(self.dataset, Subset) else None
        indices = None if subset is None else list(subset.indices)
        targets: Any = getattr(self.dataset if subset is None else subset.dataset, "targets", None)
        if targets is None:
            return None
        try:
            labels = torch.as_tensor(targets if indices is None else [targets[i] for i in indices])
        except (TypeError, ValueError, IndexError, RuntimeError):
            return None
        return labels if labels.dim() == 1 and len(labels) == len(self) and not labels.is_floating_point() else None

    def first_images(self, n: int) -> torch.Tensor:
        """The first ``n`` images stacked (a model's data-based initialisation)."""
        return torch.stack([torch.as_tensor(self.dataset[i][0]) for i in range(min(n, len(self)))])


UserSplit = ImageTensors | DatasetSplit


def load_user_data(path: str, data_dir: str | None = None) -> tuple[UserSplit, UserSplit]:
    """(train, test) of the dataset function at ``path``, checked (see the module docstring)."""
    factory = load_object(path, "dataset")
    takes_dir = "data_dir" in _parameters(factory)
    try:
        raw = factory(data_dir=data_dir) if takes_dir else factory()
    except (DataError, ConfigError):
        raise
    except Exception as exc:  # noqa: BLE001  (the user's function: say what it raised, in one line)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise DataError(f"dataset {path} failed: {type(exc).__name__}: {first}") from None
    data = _as_user_data(raw, path)
    if _is_dataset(data.train) != _is_dataset(data.test):
        raise DataError(f"dataset {path}: train and test must be of one kind (both tensors or both Datasets)")
    if _is_dataset(data.train):
        return _dataset_splits(data, path)
    return _tensor_splits(data, path)


def _parameters(factory: Callable[..., Any]) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return ()


def _as_user_data(raw: Any, path: str) -> UserData:
    if isinstance(raw, UserData):
        return raw
    if not isinstance(raw, dict):
        raise DataError(
            f"dataset {path} returned {type(raw).__name__}; return a dict with 'train' and 'test' (each "
            "(images, labels) tensors or a torch Dataset), optionally 'num_classes', 'mean', 'std'"
        )
    unknown = sorted(set(raw) - set(KEYS))
    missing = [k for k in ("train", "test") if k not in raw]
    if unknown or missing:
        what = f"unknown key(s) {', '.join(map(repr, unknown))}" if unknown else f"no {' or '.join(missing)}"
        raise DataError(f"dataset {path} returned a dict with {what}; its keys are {', '.join(KEYS)}")
    return UserData(**raw)


def _is_dataset(split: Any) -> bool:
    return isinstance(split, Dataset) and not isinstance(split, (tuple, list))


# ----------------------------------------------------------------------------------------------- tensors


def _tensor_splits(data: UserData, path: str) -> tuple[ImageTensors, ImageTensors]:
    train_x, train_y = _pair(data.train, path, "train")
    test_x, test_y = _pair(data.test, path, "test")
    if train_x.shape[1:] != test_x.shape[1:]:
        raise DataError(
            f"dataset {path}: train images are {_shape(train_x.shape[1:])} but test images "
            f"{_shape(test_x.shape[1:])}; both splits need one image shape"
        )
    top = int(max(train_y.max(), test_y.max())) + 1
    classes = _num_classes(data.num_classes, top, path)
    channels = int(train_x.shape[1])
    mean, std = _stats(data, train_x, channels, path)
    return (
        ImageTensors(train_x, train_y, classes, mean, std, name=f"{path} (train)"),
        ImageTensors(test_x, test_y, classes, mean, std, name=f"{path} (test)"),
    )


def _pair(split: Any, path: str, which: str) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"dataset {path}: {which}"
    if not isinstance(split, (tuple, list)) or len(split) != 2:
        raise DataError(f"{where} must be (images, labels) or a torch Dataset, got {type(split).__name__}")
    images, labels = (_tensor(v, f"{where} {part}") for v, part in zip(split, ("images", "labels")))
    if images.dim() != 4:
        hint = " (add the channel axis: images[:, None])" if images.dim() == 3 else ""
        raise DataError(f"{where} images must be N x C x H x W, got shape {_shape(images.shape)}{hint}")
    if images.shape[0] == 0 or min(images.shape[1:]) < 1:
        raise DataError(f"{where} images are empty (shape {_shape(images.shape)})")
    if images.shape[1] > 4 and images.shape[-1] in (1, 3, 4):
        raise DataError(
            f"{where} images of shape {_shape(images.shape)} look channels-last (N x H x W x C); give N x C x H x W: "
            "images.permute(0, 3, 1, 2)"
        )
    if images.dtype != torch.uint8 and not images.is_floating_point():
        raise DataError(f"{where} images must be uint8 (0..255) or float (0..1), got {images.dtype}")
    if images.is_floating_point():
        images = images.float()
        if not bool(torch.isfinite(images).all()):
            raise DataError(f"{where} images hold NaN or infinite values")
    if labels.dim() != 1 or labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise DataError(
            f"{where} labels must be one integer class index per image (shape N), got {labels.dtype} of "
            f"shape {_shape(labels.shape)}"
        )
    if labels.shape[0] != images.shape[0]:
        raise DataError(f"{where} has {images.shape[0]} images but {labels.shape[0]} labels")
    labels = labels.long()
    if int(labels.min()) < 0:
        raise DataError(f"{where} labels must be >= 0 (class indices), found {int(labels.min())}")
    return images.contiguous(), labels


def _tensor(value: Any, where: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise DataError(f"{where} must be a tensor or numpy array, got {type(value).__name__}")
    return value.detach().cpu()


def _num_classes(given: Any, top: int, path: str) -> int:
    if given is None:
        return top
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise DataError(f"dataset {path}: num_classes must be a positive integer, got {given!r}")
    if top > given:
        raise DataError(f"dataset {path}: a label is {top - 1} but num_classes is {given}; labels are 0..{given - 1}")
    return given


def _stats(
    data: UserData, images: torch.Tensor, channels: int, path: str
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if (data.mean is None) != (data.std is None):
        raise DataError(f"dataset {path}: give both mean and std, or neither (then the training images' are used)")
    if data.mean is None or data.std is None:
        return channel_stats(images)
    mean, std = _per_channel(data.mean, channels, path, "mean"), _per_channel(data.std, channels, path, "std")
    if min(std) <= 0:
        raise DataError(f"dataset {path}: std must be positive in every channel, got {std}")
    return mean, std


def _per_channel(values: Any, channels: int, path: str, what: str) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise DataError(f"dataset {path}: {what} must be a sequence of numbers, got {values!r}") from None
    if len(out) != channels:
        raise DataError(f"dataset {path}: {what} has {len(out)} values but the images have {channels} channels")
    return out


def channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) standard deviation of N x C x H x W images, in 0..1 units for uint8,
    accumulated in float64 a chunk at a time. A constant channel gets std 1 (normalising it must not divide by
    zero)."""
    unit = 255.0 if images.dtype == torch.uint8 else 1.0
    c = images.shape[1]
    total = torch.zeros(c, dtype=torch.float64)
    square = torch.zeros(c, dtype=torch.float64)
    for start in range(0, images.shape[0], STATS_CHUNK):
        x = images[start : start + STATS_CHUNK].to(torch.float64) / unit
        total += x.sum(dim=(0, 2, 3))
        square += (x * x).sum(dim=(0, 2, 3))
    count = images.shape[0] * images.shape[2] * images.shape[3]
    mean = total / count
    std = (square / count - mean * mean).clamp_min(0).sqrt()
    std = torch.where(std > 1e-8, std, torch.ones_like(std))
    return tuple(mean.tolist()), tuple(std.tolist())


# ---------------------------------------------------------------------------------------------- Datasets


def _dataset_splits(data: UserData, path: str) -> tuple[DatasetSplit, DatasetSplit]:
    shapes = {which: _first_item(getattr(data, which), path, which) for which in ("train", "test")}
    if shapes["train"] != shapes["test"]:
        raise DataError(
            f"dataset {path}: train items are {_shape(shapes['train'])} images but test items "
            f"{_shape(shapes['test'])}; both splits need one image shape"
        )
    check_same_classes(data, path)
    classes = data.num_classes
    if classes is None:
        names = getattr(data.train, "classes", None)
        if names is None:
            raise DataError(f"dataset {path}: return num_classes with Datasets (they have no 'classes' list)")
        classes = len(names)
    classes = _num_classes(classes, 1, path)
    channels = shapes["train"][0]
    mean = std = None
    if data.mean is not None or data.std is not None:
        mean, std = _stats(data, torch.empty(0), channels, path)
    return (
        DatasetSplit(data.train, classes, shapes["train"], mean, std, name=f"{path} (train)"),
        DatasetSplit(data.test, classes, shapes["test"], mean, std, name=f"{path} (test)"),
    )


def check_same_classes(data: UserData, path: str) -> None:
    """Splits that name their classes (torchvision's ``ImageFolder``: the sorted folder names of its own root) must
    name the same ones in the same order: a test folder lacking a class numbers the later classes one lower, and
    every accuracy would be measured against other classes' labels, without an error."""
    train_names, test_names = (getattr(getattr(data, which), "classes", None) for which in ("train", "test"))
    if train_names is None or test_names is None:
        return
    train, test = list(train_names), list(test_names)
    if train == test:
        return
    only = [
        f"{which} only: {', '.join(map(str, sorted(set(a) - set(b), key=str)[:3]))}"
        for which, a, b in (("train", train, test), ("test", test, train))
        if set(a) - set(b)
    ]
    detail = "; ".join(only) or "the same names in another order"
    raise DataError(
        f"dataset {path}: the train and test splits name different classes ({detail}), so one label would mean "
        "two classes; build the test split with the training split's classes"
    )


def _first_item(dataset: Any, path: str, which: str) -> tuple[int, int, int]:
    where = f"dataset {path}: {which}"
    try:
        size = len(dataset)
    except TypeError:
        raise DataError(f"{where} is a Dataset without a length; give it __len__") from None
    if size == 0:
        raise DataError(f"{where} is empty")
    item = dataset[0]
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise DataError(f"{where}[0] must be (image, label), got {type(item).__name__}")
    image, label = item
    if not isinstance(image, (torch.Tensor, np.ndarray)):
        raise DataError(
            f"{where}[0] image is a {type(image).__name__}; return a C x H x W tensor (e.g. add "
            "torchvision.transforms.ToTensor() or PILToTensor() to its transform)"
        )
    image = torch.as_tensor(image)
    if image.dim() != 3:
        raise DataError(f"{where}[0] image must be C x H x W, got shape {_shape(image.shape)}")
    if image.dtype != torch.uint8 and not image.is_floating_point():
        raise DataError(f"{where}[0] image must be uint8 or float, got {image.dtype}")
    if not _is_integer(label):
        raise DataError(f"{where}[0] label must be an integer class index, got {type(label).__name__} {label!r}")
    c, h, w = image.shape
    return int(c), int(h), int(w)


def _is_integer(label: Any) -> bool:
    if isinstance(label, torch.Tensor):
        return label.dim() == 0 and not label.is_floating_point() and label.dtype != torch.bool
    return isinstance(label, (int, np.integer)) and not isinstance(label, bool)


def _shape(shape: Sequence[int]) -> str:
    return " x ".join(str(int(s)) for s in shape)


class LoaderBatches:
    """Batches of a ``DatasetSplit`` read by a ``DataLoader``; satisfies the ``Batches`` protocol.

    Training: a ``DistributedSampler`` (shuffled by (seed, epoch), ``drop_last``: equal shards, as
    ``DeviceBatches``), full batches only. Evaluation: a contiguous block per rank, in order, the last partial
    batch kept, so every test item is counted once (a ``DistributedSampler`` would repeat some to even out the
    ranks). Each batch's labels are checked against the class count on the host before they are copied (they are
    there anyway), so a label out of range is one line, not an index error deep in the loss. Yields (normalised
    ``dtype`` N x C x H x W on ``device``, int64 labels on ``device``)."""

    def __init__(
        self,
        split: DatasetSplit,
        batch_size: int,
        *,
        train: bool,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        channels_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch size must be a positive integer, got {batch_size}")
        n = len(split)
        check_world(n, rank, world_size)
        self.split, self.batch_size, self.train = split, batch_size, train
        self.device, self.dtype = torch.device(device), dtype
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_workers, self.channels_last = num_workers, channels_last
        self.num_classes, self.total_samples = split.num_classes, n
        self.drop_last = train
        if train:
            self.shard_size = train_shard_size(n, world_size)
            self._eval = range(0)
        else:
            self._eval = range(*eval_range(n, rank, world_size))
            self.shard_size = len(self._eval)
        if train and batch_size > self.shard_size:
            raise ConfigError(
                f"batch size {batch_size} is larger than the {self.shard_size} samples rank {rank} of {world_size} "
                f"gets per epoch from {n} samples of {split.name}; use a batch size of at most {self.shard_size}"
            )

    def __len__(self) -> int:
        return batches_per_epoch(self.shard_size, self.batch_size, self.drop_last)

    @property
    def num_samples(self) -> int:
        return len(self) * self.batch_size if self.drop_last else self.shard_size

    def indices(self, epoch: int) -> list[int]:
        """Dataset indices this rank reads in ``epoch``, in order (the sampler's)."""
        if not self.train:
            return list(self._eval)
        sampler: DistributedSampler[int] = DistributedSampler(
            self.split.dataset,
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=True,
            seed=self.seed,
            drop_last=True,
        )
        sampler.set_epoch(epoch)
        return list(sampler)[: len(self) * self.batch_size]

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        loader = DataLoader(
            self.split.dataset,
            batch_size=self.batch_size,
            sampler=self.indices(epoch),
            num_workers=self.num_workers,
            drop_last=self.drop_last,
            pin_memory=self.device.type == "cuda",
            persistent_workers=False,
        )
        for images, labels in loader:
            yield self._finish(images, labels)

    def lazy_epoch(self, epoch: int) -> Iterator[Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
        """The training batches of ``epoch``, each as a function that reads it (a fault-tolerant replica reads
        only the batches it trains on)."""
        order = self.indices(epoch)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            yield lambda chunk=chunk: self._read(chunk)  # type: ignore[misc]

    def _read(self, chunk: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.split.dataset[i] for i in chunk]
        images = torch.stack([torch.as_tensor(x) for x, _ in items])
        labels = torch.tensor([int(y) for _, y in items])
        return self._finish(images, labels)

    def _finish(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.as_tensor(labels)
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            bad = int(labels.max()) if int(labels.max()) >= self.num_classes else int(labels.min())
            raise DataError(
                f"dataset {self.split.name}: label {bad} is outside 0..{self.num_classes - 1} "
                "(num_classes); fix the labels or return a larger num_classes"
            )
        x = images.to(self.device, non_blocking=True)
        split = self.split
        if split.mean is not None and split.std is not None:
            x = normalize(x, split.mean, split.std, self.dtype)
        else:
            x = x.to(self.dtype) / 255 if x.dtype == torch.uint8 else x.to(self.dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, labels.to(self.device, dtype=torch.int64, non_blocking=True)
