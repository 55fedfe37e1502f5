"""trainscale.data formats: CIFAR binary/python parsing, checksums, the restricted unpickler, downloads,
image folders and the dataset registry. Everything runs on tiny generated files; the real-data tests
use the ``cifar10_dir`` fixture (TRAINSCALE_DATA)."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import shutil
import struct
import tarfile
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch

import trainscale.data.download as download_mod
from trainscale.data import (
    DATASETS,
    FileSpec,
    ImageTensors,
    checksums,
    download_dataset,
    ensure_dataset,
    find_cifar_folder,
    list_datasets,
    load_cifar,
    load_dataset,
    load_folder_as_tensors,
    md5_file,
    resolve_data_dir,
    restricted_load,
    restricted_loads,
    safe_extract,
    synthetic_dataset,
    verify_files,
)
from trainscale.data.checksums import CIFAR10_BINARY_FILES, FORMATS
from trainscale.data.imagefolder import ImageFolderDataset, list_samples
from trainscale.errors import ConfigError, DataError

RNG = np.random.default_rng(0)


# ------------------------------------------------------------------------------------------ helpers


def _images(n: int) -> np.ndarray:
    return RNG.integers(0, 256, size=(n, 3072), dtype=np.uint8)


def write_cifar10_binary(folder: Path, per_batch: int = 3, test: int = 2) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Tiny data_batch_1..5.bin + test_batch.bin; returns {file: (images N x 3072, labels)}."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, n in [(f"data_batch_{i}.bin", per_batch) for i in range(1, 6)] + [("test_batch.bin", test)]:
        images = _images(n)
        labels = RNG.integers(0, 10, size=n).astype(np.uint8)
        records = np.concatenate([labels[:, None], images], axis=1)
        (folder / name).write_bytes(records.tobytes())
        out[name] = (images, labels.astype(np.int64))
    return out


def write_cifar100_binary(folder: Path, train: int = 4, test: int = 3) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, n in (("train.bin", train), ("test.bin", test)):
        images = _images(n)
        coarse = RNG.integers(0, 20, size=n).astype(np.uint8)
        fine = RNG.integers(0, 100, size=n).astype(np.uint8)
        records = np.concatenate([coarse[:, None], fine[:, None], images], axis=1)
        (folder / name).write_bytes(records.tobytes())
        out[name] = (images, fine.astype(np.int64))
    return out


class _Py2StylePickler(pickle._Pickler):  # type: ignore[name-defined]
    """Writes bytes as Python-2 ``str`` opcodes, like the official (Python 2) CIFAR pickles."""

    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def _save_bytes_py2(self, obj: bytes) -> None:
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_bytes_py2


def py2_pickle(obj: object) -> bytes:
    buf = io.BytesIO()
    _Py2StylePickler(buf, protocol=2).dump(obj)
    # numpy 2 names its reconstructor numpy._core...; files written by old numpy say numpy.core...
    return buf.getvalue().replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")


def write_cifar10_python(folder: Path, per_batch: int = 3, test: int = 2) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", test)]:
        images = _images(n)
        labels = [int(v) for v in RNG.integers(0, 10, size=n)]
        entry = {
            b"batch_label": b"tiny",
            b"labels": labels,
            b"data": images,
            b"filenames": [b"img%d.png" % i for i in range(n)],
        }
        (folder / name).write_bytes(py2_pickle(entry))
        out[name] = (images, np.asarray(labels, dtype=np.int64))
    (folder / "batches.meta").write_bytes(py2_pickle({b"label_names": [b"airplane"] * 10}))
    return out


def write_cifar100_python(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, n in (("train", 4), ("test", 2)):
        images = _images(n)
        fine = [int(v) for v in RNG.integers(0, 100, size=n)]
        coarse = [int(v) for v in RNG.integers(0, 20, size=n)]
        entry = {b"data": images, b"fine_labels": fine, b"coarse_labels": coarse}
        (folder / name).write_bytes(pickle.dumps(entry, protocol=4))  # a Python-3 pickle is fine too
        out[name] = (images, np.asarray(fine, dtype=np.int64))
    return out


def table_for(folder: Path, names: list[str]) -> dict[str, FileSpec]:
    return {n: FileSpec((folder / n).stat().st_size, md5_file(folder / n)) for n in names}


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------------------- CIFAR parse


def test_cifar10_binary_tiny(tmp_path: Path) -> None:
    written = write_cifar10_binary(tmp_path / "cifar-10-batches-bin")
    for folder in (tmp_path, tmp_path / "cifar-10-batches-bin"):  # parent or the batches folder itself
        train = load_cifar(folder, "cifar10", train=True, verify=False)
        assert train.images.shape == (15, 3, 32, 32) and train.images.dtype == torch.uint8
        assert train.labels.dtype == torch.int64 and train.num_classes == 10 and train.name == "cifar10"
        expected = np.concatenate([written[f"data_batch_{i}.bin"][0] for i in range(1, 6)])
        assert np.array_equal(train.images.reshape(15, -1).numpy(), expected)
        assert np.array_equal(
            train.labels.numpy(), np.concatenate([written[f"data_batch_{i}.bin"][1] for i in range(1, 6)])
        )
    test = load_cifar(tmp_path, "cifar10", train=False, verify=False)
    assert test.images.shape == (2, 3, 32, 32)
    # Row-major CHW: pixel byte 1024 of a record is the top-left pixel of the green channel.
    assert test.images[0, 1, 0, 0].item() == written["test_batch.bin"][0][0, 1024]


def test_cifar100_binary_uses_fine_labels(tmp_path: Path) -> None:
    written = write_cifar100_binary(tmp_path / "cifar-100-binary")
    train = load_cifar(tmp_path, "cifar100", train=True, verify=False)
    assert train.images.shape == (4, 3, 32, 32) and train.num_classes == 100
    assert np.array_equal(train.labels.numpy(), written["train.bin"][1])
    assert np.array_equal(train.images.reshape(4, -1).numpy(), written["train.bin"][0])
    assert len(load_cifar(tmp_path, "cifar100", train=False, verify=False)) == 3


def test_cifar10_python_tiny_py2_pickles(tmp_path: Path) -> None:
    written = write_cifar10_python(tmp_path / "cifar-10-batches-py")
    assert b"numpy.core.multiarray" in (tmp_path / "cifar-10-batches-py" / "test_batch").read_bytes()
    train = load_cifar(tmp_path, "cifar10", train=True, verify=False)
    assert train.images.shape == (15, 3, 32, 32)
    expected = np.concatenate([written[f"data_batch_{i}"][0] for i in range(1, 6)])
    assert np.array_equal(train.images.reshape(15, -1).numpy(), expected)
    test = load_cifar(tmp_path / "cifar-10-batches-py", "cifar10", train=False, verify=False)
    assert np.array_equal(test.labels.numpy(), written["test_batch"][1])


def test_cifar100_python_tiny(tmp_path: Path) -> None:
    written = write_cifar100_python(tmp_path / "cifar-100-python")
    train = load_cifar(tmp_path, "cifar100", train=True, verify=False)
    assert np.array_equal(train.labels.numpy(), written["train"][1])
    assert np.array_equal(train.images.reshape(4, -1).numpy(), written["train"][0])


def test_binary_preferred_when_both_formats_present(tmp_path: Path) -> None:
    write_cifar10_python(tmp_path / "cifar-10-batches-py")
    write_cifar10_binary(tmp_path / "cifar-10-batches-bin")
    folder, spec = find_cifar_folder(tmp_path, "cifar10")
    assert folder == tmp_path / "cifar-10-batches-bin" and spec.layout == "binary"


def test_missing_data_names_the_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=str(tmp_path)):
        load_cifar(tmp_path, "cifar10", train=True, verify=False)
    with pytest.raises(ConfigError, match="cifar10, cifar100"):
        load_cifar(tmp_path, "mnist", train=True)


def test_truncated_binary_fails_even_without_verify(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar10_binary(folder)
    path = folder / "data_batch_3.bin"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataError, match="data_batch_3.bin") as err:
        load_cifar(tmp_path, "cifar10", train=True, verify=False)
    assert "3073-byte records" in str(err.value) and "\n" not in str(err.value)


def test_truncated_pickle_fails_even_without_verify(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10_python(folder)
    path = folder / "test_batch"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(DataError, match="test_batch"):
        load_cifar(tmp_path, "cifar10", train=False, verify=False)


def test_labels_out_of_range_rejected(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar10_binary(folder)
    path = folder / "test_batch.bin"
    data = bytearray(path.read_bytes())
    data[0] = 42
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="labels outside 0..9"):
        load_cifar(tmp_path, "cifar10", train=False, verify=False)


# ----------------------------------------------------------------------------------------- checksums


def test_official_tables_are_complete() -> None:
    assert set(FORMATS) == {"cifar10-binary", "cifar10-python", "cifar100-binary", "cifar100-python"}
    for spec in FORMATS.values():
        assert set(spec.train_files + spec.test_files) <= set(spec.files)
        assert spec.url.startswith("https://www.cs.toronto.edu/~kriz/") and len(spec.archive_md5) == 32
        for entry in spec.files.values():
            assert entry.md5 is None or len(entry.md5) == 32
            assert entry.size is not None or entry.md5 is not None  # every file is checked somehow
    assert all(e.size == 30_730_000 for e in CIFAR10_BINARY_FILES.values())


def test_verify_with_custom_table_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar10_binary(folder)
    names = sorted(p.name for p in folder.iterdir())
    table = table_for(folder, names)
    checksums.clear_verification_cache()
    calls = []
    real_md5 = checksums.md5_file
    monkeypatch.setattr(checksums, "md5_file", lambda p, *a: calls.append(p) or real_md5(p, *a))
    verify_files(folder, "cifar10-binary", table)
    assert len(calls) == len(names)
    verify_files(folder, "cifar10-binary", table)  # cached per (path, size, mtime): no re-hash
    assert len(calls) == len(names)
    data = load_cifar(tmp_path, "cifar10", train=True, verify=True, checksums=table)
    assert len(data) == 15 and len(calls) == len(names)


def test_checksum_mismatch_message(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar10_binary(folder)
    table = table_for(folder, ["data_batch_2.bin"])
    _flip_byte(folder / "data_batch_2.bin")
    actual = md5_file(folder / "data_batch_2.bin")
    with pytest.raises(DataError) as err:
        verify_files(folder, "cifar10-binary", table)
    message = str(err.value)
    assert "data_batch_2.bin" in message and table["data_batch_2.bin"].md5 in message and actual in message
    assert f"trainscale data download --dataset cifar10 --data-dir {tmp_path}" in message and "\n" not in message
    assert "--no-verify" not in message  # `data verify` prints it too, and takes no such flag


def test_size_mismatch_message(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar10_binary(folder)
    table = table_for(folder, ["test_batch.bin"])
    path = folder / "test_batch.bin"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"test_batch.bin has the wrong size \(expected 6146 bytes, got 6136"):
        verify_files(folder, "cifar10-binary", table)


def test_missing_file_message(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data_batch_1.bin is missing; delete .* and run `trainscale data download"):
        verify_files(tmp_path, "cifar10-binary")


def test_train_adds_the_flag_it_takes_to_skip_the_check(tmp_path: Path) -> None:
    from trainscale.app.config import build_config
    from trainscale.train.setup import load_data

    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar10_binary(folder)  # not the official files: the official checksums fail
    cfg = build_config({"model": "mlp", "dataset": "cifar10", "data_dir": str(tmp_path), "download": False})
    with pytest.raises(
        DataError,
        match=r"trainscale data download --dataset cifar10 .*, or train without the "
        r"check \(--no-verify\)$",
    ):
        load_data(cfg)


@pytest.mark.realdata
def test_real_file_corruption_detected(cifar10_dir: Path, tmp_path: Path) -> None:
    src_folder, _ = find_cifar_folder(cifar10_dir, "cifar10")
    copy = tmp_path / "data_batch_1.bin"
    shutil.copyfile(src_folder / "data_batch_1.bin", copy)
    _flip_byte(copy, offset=12345)
    with pytest.raises(DataError) as err:
        verify_files(tmp_path, "cifar10-binary", names=["data_batch_1.bin"])
    message = str(err.value)
    assert "data_batch_1.bin" in message and "5dd7e06a14cb22eb9f671a540d1b7c25" in message
    assert md5_file(copy) in message and "trainscale data download" in message
    with open(copy, "r+b") as f:
        f.truncate(30_000_000)
    with pytest.raises(DataError, match="expected 30730000 bytes, got 30000000 bytes"):
        verify_files(tmp_path, "cifar10-binary", names=["data_batch_1.bin"])


@pytest.mark.realdata
def test_real_cifar10(cifar10_dir: Path) -> None:
    folder, _ = find_cifar_folder(cifar10_dir, "cifar10")
    md5sums = folder / "MD5SUMS"
    if md5sums.exists():  # the table agrees with the MD5SUMS file shipped with the data
        for line in md5sums.read_text().splitlines():
            digest, name = line.split()
            assert CIFAR10_BINARY_FILES[name.lstrip("*")].md5 == digest
    verify_files(folder, "cifar10-binary")
    train = load_cifar(cifar10_dir, "cifar10", train=True)
    test = load_cifar(cifar10_dir, "cifar10", train=False)
    assert train.images.shape == (50_000, 3, 32, 32) and test.images.shape == (10_000, 3, 32, 32)
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64
    assert int(train.labels.min()) == 0 and int(train.labels.max()) == 9
    assert torch.bincount(train.labels, minlength=10).tolist() == [5000] * 10
    assert torch.bincount(test.labels, minlength=10).tolist() == [1000] * 10
    mean = train.images.double().mean(dim=(0, 2, 3)) / 255
    assert torch.allclose(mean, torch.tensor(train.mean, dtype=torch.float64), atol=1e-4)


# -------------------------------------------------------------------------------------------- pickle


class _Hostile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


def test_unpickler_refuses_hostile_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps({b"data": _Hostile(marker)}, protocol=4)
    with pytest.raises(DataError, match=r"refused to unpickle (posix|os|nt)\.system from evil_batch"):
        restricted_loads(payload, source="evil_batch")
    assert not marker.exists()
    path = tmp_path / "data_batch_1"
    path.write_bytes(payload)
    with pytest.raises(DataError, match="refused to unpickle"):
        load_cifar(tmp_path, "cifar10", train=True, verify=False)
    assert not marker.exists()
    builtins_eval = b"cbuiltins\neval\n(S'1+1'\ntR."
    with pytest.raises(DataError, match="refused to unpickle builtins.eval"):
        restricted_loads(builtins_eval)


def test_unpickler_accepts_numpy_arrays(tmp_path: Path) -> None:
    array = np.arange(24, dtype=np.uint8).reshape(2, 12)
    for blob in (
        py2_pickle({b"data": array, b"labels": [1, 2]}),
        pickle.dumps({b"data": array, b"labels": [1, 2]}, protocol=3),
        pickle.dumps({b"data": array, b"labels": [1, 2]}, protocol=4),
    ):
        entry = restricted_loads(blob)
        assert np.array_equal(entry[b"data"], array) and entry[b"labels"] == [1, 2]
    path = tmp_path / "f"
    path.write_bytes(py2_pickle({b"x": np.ones(3, dtype=np.float32)}))
    with open(path, "rb") as f:
        assert restricted_load(f)[b"x"].tolist() == [1.0, 1.0, 1.0]


# ------------------------------------------------------------------------------------------ download


def test_resolve_data_dir_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRAINSCALE_DATA", str(tmp_path / "env"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_data_dir("cifar10", str(tmp_path / "explicit")) == tmp_path / "explicit"
    assert resolve_data_dir("cifar10", None) == tmp_path / "env"
    monkeypatch.delenv("TRAINSCALE_DATA")
    assert resolve_data_dir("cifar10", None) == tmp_path / "home" / ".cache" / "trainscale"


def test_download_failure_names_folder_and_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(url: str, dest: Path, **_: object) -> None:
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(download_mod, "fetch_url", offline)
    root = tmp_path / "data"
    root.mkdir()  # downloads go only into a folder that exists (or the default cache)
    with pytest.raises(DataError) as err:
        ensure_dataset("cifar10", root)
    message = str(err.value)
    assert str(root / "cifar-10-batches-bin") in message
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz" in message and "no network" in message
    assert not list(root.glob("*.part"))
    with pytest.raises(DataError, match=str(root / "cifar-100-binary")):
        ensure_dataset("cifar100", root, download=False)


def _tar_gz(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_safe_extract_rejects_escaping_members(tmp_path: Path) -> None:
    for bad in ("../evil", "/tmp/evil-abs", "cifar-10-batches-bin/../../evil"):
        archive = tmp_path / "bad.tar.gz"
        _tar_gz(archive, {"cifar-10-batches-bin/ok.bin": b"ok", bad: b"evil"})
        dest = tmp_path / "out"
        dest.mkdir(exist_ok=True)
        with pytest.raises(DataError, match="refused to extract"):
            safe_extract(archive, dest)
        assert not (tmp_path / "evil").exists() and not list(dest.iterdir())
    archive = tmp_path / "link.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("cifar-10-batches-bin/link")
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(DataError, match="link or special file"):
        safe_extract(archive, tmp_path / "out")


def test_download_from_local_archive(tmp_path: Path) -> None:
    staging = tmp_path / "staging" / "cifar-10-batches-bin"
    written = write_cifar10_binary(staging)
    archive = tmp_path / "cifar-10-binary.tar.gz"
    _tar_gz(archive, {f"cifar-10-batches-bin/{n}": (staging / n).read_bytes() for n in written})
    digest = hashlib.md5(archive.read_bytes()).hexdigest()
    root = tmp_path / "root"
    with pytest.raises(DataError, match="failed its checksum"):
        download_dataset("cifar10", root, url=archive.as_uri(), md5="0" * 32, verify=False, progress=False)
    folder = download_dataset("cifar10", root, url=archive.as_uri(), md5=digest, verify=False, progress=False)
    assert folder == root / "cifar-10-batches-bin"
    assert sorted(p.name for p in root.iterdir()) == ["cifar-10-batches-bin"]  # no archive, no staging left
    data = load_cifar(root, "cifar10", train=False, verify=False)
    assert np.array_equal(data.images.reshape(2, -1).numpy(), written["test_batch.bin"][0])
    assert ensure_dataset("cifar10", root, download=False, verify=False) == folder


# --------------------------------------------------------------------------------------- imagefolder


def make_image_folder(root: Path) -> None:
    from PIL import Image

    sizes = [(40, 60), (64, 48), (50, 50)]
    for split in ("train", "val"):
        for cls, color in (("cat", (200, 30, 30)), ("ant", (30, 200, 30))):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i, (w, h) in enumerate(sizes):
                img = Image.new("RGB" if i != 2 else "L", (w, h), color if i != 2 else 128)
                ext = (".JPEG", ".png", ".Jpg")[i]
                img.save(folder / f"img{i}{ext}", format="JPEG" if ext.lower() != ".png" else "PNG")
        (root / split / "ant" / "notes.txt").write_text("not an image")


def test_image_folder_listing_and_tensors(tmp_path: Path) -> None:
    make_image_folder(tmp_path)
    samples, classes = list_samples(tmp_path, "train")
    assert classes == ["ant", "cat"] and len(samples) == 6
    for size in (224, 299):
        data = load_folder_as_tensors(tmp_path, "val", size)
        assert data.images.shape == (6, 3, size, size) and data.images.dtype == torch.uint8
        assert data.labels.tolist() == [0, 0, 0, 1, 1, 1] and data.num_classes == 2
    limited = load_folder_as_tensors(tmp_path, "train", 32, limit=3)
    assert sorted(limited.labels.tolist()) == [0, 0, 1]  # interleaved: both classes present
    # A centre crop of a flat red JPEG stays red; a grey image is converted to RGB.
    red = load_folder_as_tensors(tmp_path, "val", 64).images[3].float().mean(dim=(1, 2))
    assert red[0] > 150 and red[1] < 80
    ds = ImageFolderDataset(tmp_path, "train", 227)
    x, y = ds[0]
    assert x.shape == (3, 227, 227) and x.dtype == torch.uint8 and y == 0
    assert torch.equal(ds[1][0], ds[1][0])  # same (seed, epoch, index): same random crop


def test_image_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does not exist.*<root>/train/<class>"):
        load_folder_as_tensors(tmp_path, "train", 224)
    (tmp_path / "train").mkdir()
    with pytest.raises(DataError, match=rf"no class folders in {tmp_path / 'train'}"):
        load_folder_as_tensors(tmp_path, "train", 224)
    (tmp_path / "train" / "a").mkdir()
    with pytest.raises(DataError, match="no .jpg/.jpeg/.png images"):
        load_folder_as_tensors(tmp_path, "train", 224)
    (tmp_path / "train" / "a" / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(DataError, match="cannot decode image .*broken.jpg"):
        load_folder_as_tensors(tmp_path, "train", 224)


def test_image_folder_labels_are_the_training_splits_classes_in_every_split(tmp_path: Path) -> None:
    """A validation split without a class keeps the others' labels (before: each split numbered its own folders, so
    `val/` without `ant/` labelled its cats 0, the training ants' label, and the accuracy was silently wrong); a
    folder that would shift the labels, an empty training class or a validation class training lacks, is one
    error naming it."""
    make_image_folder(tmp_path)
    for image in (tmp_path / "val" / "ant").iterdir():
        image.unlink()
    (tmp_path / "val" / "ant").rmdir()
    val = load_folder_as_tensors(tmp_path, "val", 32)
    assert val.labels.tolist() == [1, 1, 1] and val.num_classes == 2
    (tmp_path / "val" / "bee").mkdir()
    with pytest.raises(DataError, match=r"val has class folder\(s\) the training split lacks: bee"):
        load_folder_as_tensors(tmp_path, "val", 32)
    (tmp_path / "train" / "bee").mkdir()
    with pytest.raises(DataError, match=r"class folder .*train/bee holds no .jpg/.jpeg/.png images"):
        load_folder_as_tensors(tmp_path, "train", 32)


# ------------------------------------------------------------------------------- registry & tensors


def test_registry_and_synthetic(monkeypatch: pytest.MonkeyPatch) -> None:
    assert list_datasets() == ["cifar10", "cifar100", "imagefolder", "synthetic"]
    train = load_dataset("synthetic", train=True, synthetic_size=64)
    test = load_dataset("synthetic", train=False, synthetic_size=64, image_size=40)
    assert train.images.shape == (64, 3, 32, 32) and test.images.shape == (64, 3, 40, 40)
    assert not torch.equal(train.images, test.images[:, :, :32, :32])
    assert torch.equal(train.images, synthetic_dataset(64, 32).images)  # seeded
    with pytest.raises(ConfigError, match="unknown dataset 'cifar11'.*did you mean 'cifar10'"):
        load_dataset("cifar11", train=True)
    monkeypatch.delenv("TRAINSCALE_DATA", raising=False)
    with pytest.raises(ConfigError, match="imagefolder' needs --data-dir"):
        load_dataset("imagefolder", train=True)
    assert DATASETS.get("cifar100").meta["num_classes"] == 100


def test_registry_imagefolder(tmp_path: Path) -> None:
    make_image_folder(tmp_path)
    data = load_dataset("imagefolder", train=False, data_dir=str(tmp_path), image_size=64)
    assert data.images.shape == (6, 3, 64, 64)


def test_a_subset_of_an_image_folder_decodes_only_its_images_across_the_classes(tmp_path: Path) -> None:
    """`--train-subset 2` of a folder: one image of each class, the only ones decoded (before: every image was
    decoded and the first two kept, both of the first class, so a run trained on one class of two)."""
    from trainscale.app.config import build_config
    from trainscale.train.setup import load_data

    make_image_folder(tmp_path)
    cfg = build_config({"model": "mlp", "dataset": "imagefolder", "data_dir": str(tmp_path), "train_subset": 2})
    train, test = load_data(cfg)
    assert isinstance(train, ImageTensors) and sorted(train.labels.tolist()) == [0, 1] and len(test) == 6
    too_many = build_config({"model": "mlp", "dataset": "imagefolder", "data_dir": str(tmp_path), "test_subset": 9})
    with pytest.raises(ConfigError, match="asked for a subset of 9 samples but imagefolder has only 6"):
        load_data(too_many)


@pytest.mark.realdata
def test_registry_real_cifar10(cifar10_dir: Path) -> None:
    data = load_dataset("cifar10", train=False, data_dir=str(cifar10_dir), download=False)
    assert len(data) == 10_000


def test_image_tensors_subset_and_to() -> None:
    data = synthetic_dataset(10, 8)
    sub = data.subset(4)
    assert len(sub) == 4 and torch.equal(sub.images, data.images[:4])
    with pytest.raises(ConfigError, match="asked for a subset of 11 samples but synthetic has only 10"):
        data.subset(11)
    moved = data.to("cpu")
    assert isinstance(moved, ImageTensors) and moved.images.device.type == "cpu"
    assert data.image_shape == (3, 8, 8)
