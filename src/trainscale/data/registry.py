"""The dataset registry: every dataset a config or the CLI can name, loaded as ``ImageTensors``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainscale.data.tensors import ImageTensors
from trainscale.errors import ConfigError
from trainscale.registry import Registry

# A dataset given by import path (``--dataset my_pkg.data:build``) is loaded by ``data.user``; these are its facts.
IMPORTED_DATASET = {"num_classes": None, "image_size": None, "downloadable": False}
DATASETS: Registry[ImageTensors] = Registry("dataset", importable=IMPORTED_DATASET)


def _load_cifar(
    name: str, *, train: bool, data_dir: str | os.PathLike[str] | None, verify: bool, download: bool, **_: Any
) -> ImageTensors:
    # CIFAR is always returned at 32x32 (``image_size`` is ignored): upscaling for a larger model is
    # done per batch on the device by ``AugmentConfig.resize``, which keeps the stored data small.
    from trainscale.data.cifar import load_cifar
    from trainscale.data.download import ensure_dataset

    folder = ensure_dataset(name, data_dir, download=download, verify=verify)
    return load_cifar(folder, name, train, verify)


@DATASETS.register("cifar10", num_classes=10, image_size=32, downloadable=True)
def cifar10(**kwargs: Any) -> ImageTensors:
    return _load_cifar("cifar10", **kwargs)


@DATASETS.register("cifar100", num_classes=100, image_size=32, downloadable=True)
def cifar100(**kwargs: Any) -> ImageTensors:
    return _load_cifar("cifar100", **kwargs)


@DATASETS.register("synthetic", num_classes=10, image_size=32, downloadable=False)
def synthetic(*, train: bool, image_size: int | None, synthetic_size: int, **_: Any) -> ImageTensors:
    from trainscale.data.synthetic import synthetic_dataset

    # Different seeds so the "test" split is not a copy of the training split.
    return synthetic_dataset(synthetic_size, image_size or 32, num_classes=10, seed=0 if train else 1)


@DATASETS.register("imagefolder", num_classes=None, image_size=224, downloadable=False)
def imagefolder(
    *, train: bool, data_dir: Path | str | None, image_size: int | None, limit: int | None = None, **_: Any
) -> ImageTensors:
    from trainscale.data.download import ENV_VAR
    from trainscale.data.imagefolder import load_folder_as_tensors

    root = data_dir if data_dir not in (None, "") else os.environ.get(ENV_VAR) or None
    if root is None:
        raise ConfigError(
            f"dataset 'imagefolder' needs --data-dir (or {ENV_VAR}) pointing at a folder with "
            f"train/<class>/ and val/<class>/ image folders"
        )
    return load_folder_as_tensors(root, "train" if train else "val", image_size or 224, limit=limit)


def load_dataset(
    name: str,
    *,
    train: bool,
    data_dir: str | os.PathLike[str] | None = None,
    verify: bool = True,
    download: bool = True,
    image_size: int | None = None,
    synthetic_size: int = 50_000,
    limit: int | None = None,
) -> ImageTensors:
    """Load the training (``train=True``) or test split of a registered dataset into memory. ``limit``: the most
    images a run will use (``--train-subset``, ``--test-subset``), for a dataset that can load fewer (image folders
    decode only those, taken across the classes); the others load every image and the run takes its first ones."""
    return DATASETS.create(
        name,
        train=train,
        data_dir=data_dir,
        verify=verify,
        download=download,
        image_size=image_size,
        synthetic_size=synthetic_size,
        limit=limit,
    )


def list_datasets() -> list[str]:
    return DATASETS.names()
