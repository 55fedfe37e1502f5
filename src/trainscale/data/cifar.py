"""Read CIFAR-10 / CIFAR-100 from either official format (binary records or python pickles).

Both formats are parsed with ``numpy.frombuffer`` and reshapes only: no per-sample Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from trainscale.data.checksums import (
    CIFAR10_RECORD_BYTES,
    CIFAR100_RECORD_BYTES,
    CIFAR_IMAGE_BYTES,
    FORMATS,
    FileSpec,
    FormatSpec,
    verify_files,
)
from trainscale.data.tensors import CIFAR10_MEAN, CIFAR10_STD, CIFAR100_MEAN, CIFAR100_STD, ImageTensors
from trainscale.data.unpickle import restricted_load
from trainscale.errors import ConfigError, DataError

CIFAR_NAMES = ("cifar10", "cifar100")
NUM_CLASSES = {"cifar10": 10, "cifar100": 100}
STATS = {"cifar10": (CIFAR10_MEAN, CIFAR10_STD), "cifar100": (CIFAR100_MEAN, CIFAR100_STD)}
# Looked for in this order: binary first (no pickle involved at all), then python.
FORMAT_ORDER = {"cifar10": ("cifar10-binary", "cifar10-python"), "cifar100": ("cifar100-binary", "cifar100-python")}


def _check_name(name: str) -> None:
    if name not in CIFAR_NAMES:
        raise ConfigError(f"unknown CIFAR dataset '{name}'; choose one of: {', '.join(CIFAR_NAMES)}")


def _has_files(folder: Path, spec: FormatSpec) -> bool:
    return any((folder / f).is_file() for f in spec.train_files + spec.test_files)


def find_cifar_folder(folder: Path, name: str) -> tuple[Path, FormatSpec] | None:
    """Locate the batches folder of ``name`` in ``folder`` (itself or its official sub-folder).

    Returns (batches folder, format) or None when neither format is there.
    """
    _check_name(name)
    folder = Path(folder)
    for fmt in FORMAT_ORDER[name]:
        spec = FORMATS[fmt]
        for candidate in (folder, folder / spec.folder):
            if candidate.is_dir() and _has_files(candidate, spec):
                return candidate, spec
    return None


def _read_binary(path: Path, record_bytes: int, label_offset: int) -> tuple[np.ndarray, np.ndarray]:
    raw = path.read_bytes()
    if len(raw) == 0 or len(raw) % record_bytes != 0:
        raise DataError(
            f"{path} has {len(raw)} bytes, not a whole number of {record_bytes}-byte records (truncated or "
            f"altered); delete the folder and run `trainscale data download`"
        )
    records = np.frombuffer(raw, dtype=np.uint8).reshape(-1, record_bytes)
    images = records[:, record_bytes - CIFAR_IMAGE_BYTES :]
    labels = records[:, label_offset].astype(np.int64)
    return images, labels


def _read_python(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        entry = restricted_load(f, source=str(path))
    if not isinstance(entry, dict):
        raise DataError(
            f"{path} does not hold a dict of arrays (got {type(entry).__name__}); "
            f"delete the folder and run `trainscale data download`"
        )
    data = entry.get(b"data")
    labels = entry.get(b"fine_labels", entry.get(b"labels"))
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != CIFAR_IMAGE_BYTES
        or labels is None
    ):
        shape = getattr(data, "shape", None)
        raise DataError(
            f"{path} is not a CIFAR batch (expected b'data' as uint8 N x {CIFAR_IMAGE_BYTES} and b'labels' or "
            f"b'fine_labels', got data shape {shape}); delete the folder and run `trainscale data download`"
        )
    try:
        label_array = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise DataError(
            f"{path}: labels are not integers ({exc}); delete the folder and run `trainscale data download`"
        ) from exc
    if label_array.shape != (data.shape[0],):
        raise DataError(
            f"{path}: {data.shape[0]} images but {label_array.size} labels; delete the folder and "
            f"run `trainscale data download`"
        )
    return data, label_array


def load_cifar(
    folder: Path,
    name: str,
    train: bool,
    verify: bool = True,
    *,
    checksums: Mapping[str, FileSpec] | None = None,
) -> ImageTensors:
    """Load the training (50,000) or test (10,000) split of ``name`` ("cifar10" | "cifar100").

    ``folder`` is the batches folder itself or a parent holding ``cifar-10-batches-bin``,
    ``cifar-10-batches-py``, ``cifar-100-binary`` or ``cifar-100-python``. With ``verify`` the split's
    files are checked against the official sizes and MD5s (or ``checksums``, for tests) first. A file
    whose size does not fit the format is a DataError even with ``verify=False``. CIFAR-100 returns
    the fine (100-class) labels.
    """
    _check_name(name)
    found = find_cifar_folder(Path(folder), name)
    if found is None:
        expected = " or ".join(FORMATS[f].folder for f in FORMAT_ORDER[name])
        raise DataError(
            f"no {name} files in {folder} (looked for the files of {expected} in it and in those "
            f"sub-folders); run `trainscale data download` or point --data-dir at the folder holding them"
        )
    batches, spec = found
    files = spec.train_files if train else spec.test_files
    if verify:
        verify_files(batches, spec.name, checksums, names=files)
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    for file in files:
        path = batches / file
        if not path.is_file():
            raise DataError(f"{path} is missing; delete the folder and run `trainscale data download`")
        if spec.layout == "binary":
            if spec.dataset == "cifar10":
                parts.append(_read_binary(path, CIFAR10_RECORD_BYTES, 0))
            else:  # coarse label byte, then the fine label byte we use
                parts.append(_read_binary(path, CIFAR100_RECORD_BYTES, 1))
        else:
            parts.append(_read_python(path))

    total = sum(p[0].shape[0] for p in parts)
    images = np.empty((total, CIFAR_IMAGE_BYTES), dtype=np.uint8)
    np.concatenate([p[0] for p in parts], axis=0, out=images)
    labels = np.concatenate([p[1] for p in parts])
    num_classes = NUM_CLASSES[name]
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(
            f"{batches}: labels outside 0..{num_classes - 1} (found {labels.min()}..{labels.max()}); the files "
            f"are not {name}: delete the folder and run `trainscale data download`"
        )
    mean, std = STATS[name]
    return ImageTensors(
        images=torch.from_numpy(images).view(total, 3, 32, 32),
        labels=torch.from_numpy(labels),
        num_classes=num_classes,
        mean=mean,
        std=std,
        name=name,
    )
