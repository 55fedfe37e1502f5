"""Files that survive interruptions: atomic writes, JSON without NaN, and JSON Lines read back after a crash.

Every file trainscale writes goes through a temporary file beside its target, fsync and a rename, so a
reader sees the old file or the new one, never half of one. Append-only logs (``metrics.jsonl``,
``grid.jsonl``) can still end in a torn line when a process is killed mid-append elsewhere; the reader
here tolerates exactly that (a bad *last* line) and refuses a bad line anywhere else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import tomllib
from pathlib import Path
from typing import Any, BinaryIO, Callable

from trainscale.errors import ConfigError, DataError

log = logging.getLogger("trainscale.io")


def atomic_write_bytes(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Call ``write(fileobj)`` on a temp file beside ``path``, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, lambda f: f.write(text.encode()))


def clean(value: Any) -> Any:
    """JSON has no NaN/inf: store them as null so every reader can parse the files."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def dumps(obj: Any) -> str:
    return json.dumps(clean(obj), indent=2, sort_keys=False) + "\n"


def read_json(path: Path) -> Any:
    """A JSON file; a corrupt one is a DataError naming the file (not a JSONDecodeError traceback)."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is not valid JSON ({exc}); the file is corrupt: restore or delete it") from None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One JSON object per line. A torn *last* line (what an interrupted append leaves) is dropped with a
    warning; an unparsable line before it is real corruption and a DataError naming file and line."""
    lines = Path(path).read_text().splitlines()
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                log.warning("%s: ignoring a torn last line (an interrupted write)", path)
                break
            raise DataError(f"{path}:{number} is not valid JSON; the file is corrupt: restore or delete it") from None
    return rows


def append_jsonl(path: Path, obj: Any) -> None:
    """Append one object as a line. A torn last line left by an interrupted append is cut off first (with a
    warning), so it never ends up as corruption in the middle of the file; the line goes out in one write."""
    path = Path(path)
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            log.warning("%s: dropping a torn last line (an interrupted write) before appending", path)
            with open(path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
    with open(path, "ab") as f:
        f.write((json.dumps(clean(obj)) + "\n").encode())


def read_toml(path: Path, kind: str, error: type[ConfigError] = ConfigError) -> tuple[str, dict[str, Any]]:
    """(text, table) of a TOML file; a missing, unreadable or invalid one is ``error`` in one line naming
    the ``kind`` of file ("config file", "grid file") and the path."""
    try:
        text = Path(path).read_text()
        return text, tomllib.loads(text)
    except FileNotFoundError:
        raise error(f"{kind} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{kind} {path} cannot be read as text ({type(exc).__name__})") from None
    except ValueError as exc:  # TOMLDecodeError, or an integer literal too long for Python's int conversion
        raise error(f"{kind} {path} is not valid TOML: {str(exc).splitlines()[0]}") from None


def check_folder_writable(folder: Path, flag: str = "--out") -> None:
    """Make ``folder`` (parents too) and a probe file in it, then remove what was made: a path that cannot
    be written (a parent that is a file, a read-only or special file system, no permission) is one line
    now, checked the way the run will write (so also as root), not a traceback once the work is done."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{flag} {folder} is a file, not a folder; choose another {flag}")
    made: list[Path] = []
    try:
        made = missing_folders(folder)
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(prefix=".trainscale-probe-", dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {folder}: cannot write there ({unwritable_reason(folder, exc)}); "
                          f"choose another {flag}") from None
    finally:
        remove_empty(made)


def check_folder_permissions(folder: Path, flag: str = "--out") -> None:
    """``check_folder_writable`` without writing: the nearest existing ancestor must be a folder this
    process may write into (root passes on a read-only file system; only the probe sees that)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{flag} {folder}: cannot write there ({existing} is a file); choose another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {folder}: cannot write there (no permission in {existing}); choose another {flag}")


def unwritable_reason(folder: Path, exc: OSError) -> str:
    """Why ``folder`` cannot be written: the ancestor that is a file, else the OS's words and path."""
    with contextlib.suppress(OSError):
        existing = next((p for p in folder.parents if p.exists()), None)
        if existing is not None and not existing.is_dir():
            return f"{existing} is a file"
    return f"{exc.strerror or exc}: {exc.filename or folder}"


def missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, deepest first (what a mkdir would make)."""
    missing: list[Path] = []
    for path in (folder, *folder.parents):
        try:
            if path.exists():
                break
        except OSError:
            break
        missing.append(path)
    return missing


def remove_empty(folders: list[Path]) -> None:
    """Remove each folder (deepest first) that is still empty; a folder with anything in it stays."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()
