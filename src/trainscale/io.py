"""Files that survive interruptions: atomic writes, JSON without NaN, and JSON Lines read back after a crash.

Every file trainscale writes goes through a temporary file beside its target, fsync and a rename, so a
reader sees the old file or the new one, never half of one. Append-only logs (``metrics.jsonl``,
``grid.jsonl``) can still end in a torn line when a process is killed mid-append elsewhere; the reader
here tolerates exactly that (a bad *last* line) and refuses a bad line anywhere else.
"""

from __future__ import annotations

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
