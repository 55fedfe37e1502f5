"""Where the datasets live, and fetching the official CIFAR archives when they are not there.

Search order for the data root: an explicit ``data_dir`` (the ``--data-dir`` flag), then the
``TRAINSCALE_DATA`` environment variable, then ``~/.cache/trainscale``. The root may hold the
official sub-folders (``cifar-10-batches-bin`` ...) or be a batches folder itself.
"""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath

from trainscale.data.checksums import FORMATS, FormatSpec, md5_file, verify_files
from trainscale.data.cifar import CIFAR_NAMES, find_cifar_folder
from trainscale.errors import ConfigError, DataError
from trainscale.io import check_output, open_output

log = logging.getLogger("trainscale.data")

ENV_VAR = "TRAINSCALE_DATA"
DEFAULT_ROOT = "~/.cache/trainscale"
# Format fetched by ``download_dataset``: the binary one, whose loading involves no pickle at all.
DOWNLOAD_FORMAT = {"cifar10": "cifar10-binary", "cifar100": "cifar100-binary"}


def resolve_data_dir(name: str, data_dir: str | os.PathLike[str] | None) -> Path:
    """The data root for dataset ``name``: ``data_dir``, else $TRAINSCALE_DATA, else ~/.cache/trainscale."""
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir).expanduser()
    env = os.environ.get(ENV_VAR, "")
    if env:
        return Path(env).expanduser()
    return Path(DEFAULT_ROOT).expanduser()


def _download_spec(name: str) -> FormatSpec:
    if name not in DOWNLOAD_FORMAT:
        raise ConfigError(f"only {', '.join(CIFAR_NAMES)} can be downloaded, not '{name}'")
    return FORMATS[DOWNLOAD_FORMAT[name]]


def fetch_url(url: str, dest: Path, *, progress: bool = True, timeout: float = 60.0) -> None:
    """Stream ``url`` (http(s) or file://) into ``dest`` with a tqdm progress bar.

    Network problems surface as ``urllib.error.URLError`` / ``OSError`` (turned into a DataError by
    the caller); a short read raises OSError.
    """
    from tqdm import tqdm

    request = urllib.request.Request(url, headers={"User-Agent": "trainscale"})
    written = 0
    with urllib.request.urlopen(request, timeout=timeout) as response, open_output(dest) as out:
        length = response.headers.get("Content-Length")
        total = int(length) if length else None
        with tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=url.rsplit("/", 1)[-1], disable=not progress
        ) as bar:
            while block := response.read(1 << 20):
                out.write(block)
                written += len(block)
                bar.update(len(block))
    if total is not None and written != total:
        raise OSError(f"connection closed after {written} of {total} bytes")


def _check_member(archive: Path, member: tarfile.TarInfo) -> None:
    path = PurePosixPath(member.name)
    if (
        member.name.startswith(("/", "\\"))
        or path.is_absolute()
        or ".." in path.parts
        or (path.parts and ":" in path.parts[0])
    ):
        raise DataError(
            f"refused to extract {archive}: member '{member.name}' has an absolute path or '..'; it is not an "
            f"official archive: delete it and download again"
        )
    if not (member.isfile() or member.isdir()):
        raise DataError(
            f"refused to extract {archive}: member '{member.name}' is a link or special file; it is not an "
            f"official archive: delete it and download again"
        )


def safe_extract(archive: Path, dest: Path) -> None:
    """Extract a tar(.gz) into ``dest`` after checking every member: no absolute paths, no '..', only
    regular files and folders. Nothing is written if any member is refused."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            for member in members:
                _check_member(archive, member)
            if hasattr(tarfile, "data_filter"):  # defence in depth where Python has extraction filters
                tar.extractall(dest, members=members, filter="data")
            else:  # pragma: no cover - Python without extraction filters
                tar.extractall(dest, members=members)
    except (tarfile.TarError, EOFError) as exc:
        raise DataError(f"{archive} is not a readable tar archive ({exc}); delete it and download again") from exc


def _network_error(spec: FormatSpec, url: str, target: Path, exc: BaseException) -> DataError:
    reason = getattr(exc, "reason", None) or exc
    return DataError(
        f"could not download {url} ({reason}); download it by hand and extract it so that its files are in "
        f"{target} (e.g. `tar -xzf {spec.archive} -C {target.parent}`), or set --data-dir / {ENV_VAR} to the "
        f"folder that holds them"
    )


def download_dataset(
    name: str,
    root: str | os.PathLike[str],
    *,
    url: str | None = None,
    md5: str | None = None,
    verify: bool = True,
    progress: bool = True,
) -> Path:
    """Download the official binary archive of ``name`` into ``root``, check it, extract it safely, verify.

    Returns the folder holding the files (``root/cifar-10-batches-bin`` or ``root/cifar-100-binary``).
    ``url`` / ``md5`` override the official archive (tests use a local file:// archive).
    """
    spec = _download_spec(name)
    root = Path(root).expanduser()
    target = root / spec.folder
    url = url or spec.url
    md5 = md5 or spec.archive_md5
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create the data folder {root} ({exc}); pass a writable --data-dir") from exc

    archive = root / spec.archive
    check_output(archive, "data file")  # renamed over below: only a regular file or nothing may be there
    if not (archive.is_file() and md5_file(archive) == md5):
        partial = root / (spec.archive + ".part")
        log.info("downloading %s from %s into %s", name, url, root)
        try:
            fetch_url(url, partial, progress=progress)
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            partial.unlink(missing_ok=True)
            raise _network_error(spec, url, target, exc) from exc
        partial.replace(archive)
        actual = md5_file(archive)
        if actual != md5:
            archive.unlink(missing_ok=True)
            raise DataError(
                f"downloaded {url} failed its checksum (expected MD5 {md5}, got {actual}); the download was "
                f"corrupted: run `{download_command(name, root)}` again"
            )

    staging = Path(tempfile.mkdtemp(prefix=".extract-", dir=root))
    try:
        safe_extract(archive, staging)
        extracted = staging / spec.folder
        if not extracted.is_dir():
            raise DataError(f"{archive} does not contain the folder {spec.folder}; delete it and download again")
        target.mkdir(exist_ok=True)
        for item in extracted.iterdir():
            check_output(target / item.name, "data file")
            os.replace(item, target / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    archive.unlink(missing_ok=True)
    if verify:
        verify_files(target, spec.name)
    return target


def ensure_dataset(
    name: str, data_dir: str | os.PathLike[str] | None = None, *, download: bool = True, verify: bool = True
) -> Path:
    """The folder holding the files of ``name`` (verified when ``verify``), downloading them if allowed."""
    if name not in CIFAR_NAMES:
        raise ConfigError(f"only {', '.join(CIFAR_NAMES)} live in a data folder, not '{name}'")
    root = resolve_data_dir(name, data_dir)
    found = find_cifar_folder(root, name)
    if found is not None:
        folder, spec = found
        if verify:
            verify_files(folder, spec.name)
        return folder
    spec = _download_spec(name)
    if not download:
        raise DataError(
            f"{name} files not found in {root}{'' if root.exists() else ' (no such folder)'}: put the files of "
            f"{spec.url} in {root / spec.folder}, or run `{download_command(name, data_dir)}`"
        )
    check_download_root(name, root, data_dir)
    return download_dataset(name, root)


def download_command(name: str, data_dir: str | os.PathLike[str] | None) -> str:
    """The command that downloads ``name`` into the folder where it was looked for."""
    folder = f" --data-dir {data_dir}" if data_dir not in (None, "") else ""
    return f"trainscale data download --dataset {name}{folder}"


def check_download_root(name: str, root: Path, data_dir: str | os.PathLike[str] | None) -> None:
    """Download only into a folder that exists, or into the default cache: a mistyped --data-dir (or
    $TRAINSCALE_DATA) is one line, not a new folder in the wrong place and a large download into it."""
    if root.is_dir() or root == Path(DEFAULT_ROOT).expanduser():
        return
    source = "--data-dir" if data_dir is not None and str(data_dir) != "" else f"${ENV_VAR}"
    if root.exists():
        raise ConfigError(
            f"{source} {root} is a file, not a folder; give the folder that holds (or is to hold) the {name} files"
        )
    raise ConfigError(
        f"{source} {root} does not exist; fix the path, or create the folder (mkdir -p {root}) to "
        f"download {name} into it, or run `trainscale data download --dataset {name} --data-dir {root}`"
    )
