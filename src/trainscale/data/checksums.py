"""Official file tables (name, byte size, MD5) of the CIFAR archives, and ``verify_files``.

Sources: the CIFAR-10 binary MD5s are those of the official ``cifar-10-binary.tar.gz`` (they match
the MD5SUMS file shipped with the project's copy of the data); sizes of fixed-record files follow
from the format (records x record size). Where this table has no MD5 it is because no trusted value
was at hand: those files are checked for size only (or, with no known size either, for presence and
for being parseable when loaded). A checksum is never made up here.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainscale.errors import ConfigError, DataError

URL_BASE = "https://www.cs.toronto.edu/~kriz/"

CIFAR_IMAGE_BYTES = 3 * 32 * 32
CIFAR10_RECORD_BYTES = 1 + CIFAR_IMAGE_BYTES  # label byte + pixels
CIFAR100_RECORD_BYTES = 2 + CIFAR_IMAGE_BYTES  # coarse label byte + fine label byte + pixels


class ChecksumError(DataError):
    """A data file is missing or fails its size or MD5 check. The message says how to fetch the files again,
    which every command can do; a command that can skip the check (``train --no-verify``) adds that itself."""


def fix_hint(folder: Path, dataset: str | None) -> str:
    """How to get good files back: valid whichever command printed it (``data verify`` takes no
    ``--no-verify``), and naming the dataset and folder so the download lands where the check looked."""
    if dataset is None:
        return "delete the folder and run `trainscale data download`"
    return f"delete {folder} and run `trainscale data download --dataset {dataset} --data-dir {folder.parent}`"


@dataclass(frozen=True)
class FileSpec:
    """Expected byte size and MD5 of one file; ``None`` means "not checked"."""

    size: int | None
    md5: str | None


@dataclass(frozen=True)
class FormatSpec:
    """One on-disk format of one dataset: the folder the archive extracts to and its files."""

    name: str  # e.g. "cifar10-binary"
    dataset: str  # "cifar10" | "cifar100"
    layout: str  # "binary" | "python"
    folder: str  # folder name inside the archive, e.g. "cifar-10-batches-bin"
    archive: str  # archive file name
    archive_md5: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    files: Mapping[str, FileSpec]  # every file checked by verify_files (train, test and meta)

    @property
    def url(self) -> str:
        return URL_BASE + self.archive


CIFAR10_BINARY_FILES: dict[str, FileSpec] = {
    "data_batch_1.bin": FileSpec(30_730_000, "5dd7e06a14cb22eb9f671a540d1b7c25"),
    "data_batch_2.bin": FileSpec(30_730_000, "5ea93a67294ea407fff1d09f752e9692"),
    "data_batch_3.bin": FileSpec(30_730_000, "942cd6a4bcdd0dd3c604fbe906cb4421"),
    "data_batch_4.bin": FileSpec(30_730_000, "ae636b3ba5c66a11e91e8cb52e771fcb"),
    "data_batch_5.bin": FileSpec(30_730_000, "53f37980c15c3d472c316c40844f3f0d"),
    "test_batch.bin": FileSpec(30_730_000, "803d5f7f4d78ea53de84dbe85f74fb6d"),
}

# MD5s as published with the official cifar-10-python.tar.gz (the values torchvision checks too);
# sizes as listed for the extracted files of that archive.
CIFAR10_PYTHON_FILES: dict[str, FileSpec] = {
    "data_batch_1": FileSpec(31_035_704, "c99cafc152244af753f735de768cd75f"),
    "data_batch_2": FileSpec(31_035_320, "d4bba439e000b95fd0a9bffe97cbabec"),
    "data_batch_3": FileSpec(31_035_999, "54ebc095f3ab1f0389bbae665268c751"),
    "data_batch_4": FileSpec(31_035_696, "634d18415352ddfa80567beed471001a"),
    "data_batch_5": FileSpec(31_035_623, "482c414d41f54cd18b22e5b47cb7c3cb"),
    "test_batch": FileSpec(31_035_526, "40351d587109b95175f43aff81a1287e"),
    "batches.meta": FileSpec(158, "5ff9c542aee3614f3951f8cda6e48888"),
}

# No trusted per-file MD5 for the CIFAR-100 binary files: size only (50,000 / 10,000 records of
# 3,074 bytes). The archive MD5 below still covers a fresh download.
CIFAR100_BINARY_FILES: dict[str, FileSpec] = {
    "train.bin": FileSpec(50_000 * CIFAR100_RECORD_BYTES, None),
    "test.bin": FileSpec(10_000 * CIFAR100_RECORD_BYTES, None),
}

# MD5s as published with the official cifar-100-python.tar.gz; the pickle sizes are not known with
# certainty, so they are not checked (the MD5 pins them anyway).
CIFAR100_PYTHON_FILES: dict[str, FileSpec] = {
    "train": FileSpec(None, "16019d7e3df5f24257cddd939b257f8d"),
    "test": FileSpec(None, "f0ef6b0ae62326f3e7ffdfab6717acfc"),
    "meta": FileSpec(None, "7973b15100ade9c7d40fb424638fde48"),
}

FORMATS: dict[str, FormatSpec] = {
    spec.name: spec
    for spec in (
        FormatSpec(
            "cifar10-binary",
            "cifar10",
            "binary",
            "cifar-10-batches-bin",
            "cifar-10-binary.tar.gz",
            "c32a1d4ab5d03f1284b67883e8d87530",
            tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
            ("test_batch.bin",),
            CIFAR10_BINARY_FILES,
        ),
        FormatSpec(
            "cifar10-python",
            "cifar10",
            "python",
            "cifar-10-batches-py",
            "cifar-10-python.tar.gz",
            "c58f30108f718f92721af3b95e74349a",
            tuple(f"data_batch_{i}" for i in range(1, 6)),
            ("test_batch",),
            CIFAR10_PYTHON_FILES,
        ),
        FormatSpec(
            "cifar100-binary",
            "cifar100",
            "binary",
            "cifar-100-binary",
            "cifar-100-binary.tar.gz",
            "03b5dce01913d631647c71ecec9e9cb8",
            ("train.bin",),
            ("test.bin",),
            CIFAR100_BINARY_FILES,
        ),
        FormatSpec(
            "cifar100-python",
            "cifar100",
            "python",
            "cifar-100-python",
            "cifar-100-python.tar.gz",
            "eb9058c3a382ffc7106e4002c42a8d85",
            ("train",),
            ("test",),
            CIFAR100_PYTHON_FILES,
        ),
    )
}


def get_format(fmt: str) -> FormatSpec:
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ConfigError(f"unknown data format '{fmt}'; choose one of: {', '.join(sorted(FORMATS))}") from None


def md5_file(path: Path, chunk_size: int = 1 << 20) -> str:
    """Hex MD5 of a file, read in chunks so memory stays flat."""
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


# (resolved path, size, mtime_ns, expected size, expected md5) of files that verified in this process.
_verified: set[tuple[str, int, int, int | None, str | None]] = set()
_verified_lock = threading.Lock()


def clear_verification_cache() -> None:
    with _verified_lock:
        _verified.clear()


def verify_file(path: Path, spec: FileSpec, hint: str = fix_hint(Path("."), None)) -> None:
    """Check one file's presence, size, then MD5; raise DataError saying what is wrong and what to do."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ChecksumError(f"{path} is missing; {hint}") from None
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, spec.size, spec.md5)
    with _verified_lock:
        if key in _verified:
            return
    if spec.size is not None and st.st_size != spec.size:
        raise ChecksumError(
            f"{path} has the wrong size (expected {spec.size} bytes, got {st.st_size} bytes; "
            f"truncated or altered); {hint}"
        )
    if spec.md5 is not None:
        actual = md5_file(path)
        if actual != spec.md5.lower():
            raise ChecksumError(
                f"{path} failed its checksum (expected MD5 {spec.md5}, got {actual}; corrupted or altered); {hint}"
            )
    with _verified_lock:
        _verified.add(key)


def verify_files(
    folder: Path,
    fmt: str,
    table: Mapping[str, FileSpec] | None = None,
    *,
    names: tuple[str, ...] | list[str] | None = None,
) -> None:
    """Verify the files of format ``fmt`` in ``folder``; ``table`` replaces the official one (tests).

    ``names`` restricts the check to some of the files (e.g. only the training batches). A successful
    check is remembered per (path, size, mtime), so verifying the same files again in this process
    costs a ``stat`` per file.
    """
    files = dict(table) if table is not None else dict(get_format(fmt).files)
    hint = fix_hint(Path(folder), FORMATS[fmt].dataset if fmt in FORMATS else None)
    selected = list(files) if names is None else list(names)
    for name in selected:
        spec = files.get(name)
        if spec is None:
            raise ConfigError(f"no checksum entry for '{name}' in the {fmt} table")
        verify_file(Path(folder) / name, spec, hint)
