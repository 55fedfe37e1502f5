"""Files that survive interruptions: atomic writes, JSON without NaN, and JSON Lines read back after a crash.

Every file trainscale writes goes through a temporary file beside its target, fsync and a rename, so a
reader sees the old file or the new one, never half of one. Only regular files are ever replaced: a path that
exists and is anything else (a device node, a FIFO, a socket, a folder; a symlink to one) is refused with a
ConfigError before anything is written (``check_output``), since trainscale often runs as root (``cluster``
needs it) and a rename over ``/dev/null`` would turn the device into a file. Character devices are refused
too, not written through: a report, profile or plot is meant to be read back, and one aimed at a device is a
mistaken path far more often than a wish to discard it. A symlink to a regular file (or to nothing yet) is
written through: its target is replaced, the link stays, and a replaced file keeps its mode (and, as root,
its owner). Append-only logs (``grid.jsonl``, the fault log) can still end in a torn line when a process is
killed mid-append; the reader here tolerates exactly that (a bad *last* line) and refuses a bad line anywhere
else. Ctrl-C and SIGTERM wait for a write to end (``stops_held``), so a stopped run leaves whole files.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import tomllib

from trainscale.errors import ConfigError, DataError
from trainscale.stops import stops_held

log = logging.getLogger("trainscale.io")


KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def output_problem(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` (None when it can be tried): it exists, a symlink followed,
    and is not a regular file."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None  # nothing there yet; a parent that is a file fails the write with the OS's words
    except OSError as exc:
        return f"cannot be examined ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in KINDS if test(mode)), "not a regular file")
    link = " (through a symlink)" if os.path.islink(path) else ""
    return f"is {kind}{link}, not a regular file; trainscale writes only regular files"


def check_output(path: Path | str, label: str = "output", probe: bool = False) -> None:
    """Refuse, in one line, an output path that exists and is not a regular file, or whose nearest existing
    folder is a file or not writable; commands call it before their long work (with ``probe``: a temporary
    file made and removed in its folder, when that exists, so a file system that takes no files, such as
    /proc, is said now too), writers again before writing."""
    path = Path(path)
    problem = output_problem(path)
    if problem:
        raise ConfigError(f"{label} {path} {problem}: choose another path")
    existing = next((p for p in _target(path).parents if os.path.lexists(p)), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"{label} {path}: cannot write there ({existing} is not a folder): choose another path")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{label} {path}: cannot write there (no permission in {existing}): choose another path")
    refused = (
        refusal_of_a_file(existing) if probe and existing is not None and existing == _target(path).parent else None
    )
    if refused:
        raise ConfigError(f"{label} {path}: cannot write there ({refused}): choose another path")


def refusal_of_a_file(folder: Path) -> str | None:
    """Why ``folder`` takes no new file (the OS's words), found with an unnamed temporary file (``O_TMPFILE``; a
    name removed at once where the file system lacks it), so nothing is left; None when it takes one."""
    try:
        with tempfile.TemporaryFile(prefix=".trainscale-probe-", dir=folder):
            return None
    except OSError as exc:
        return str(exc.strerror or exc)


def _target(path: Path) -> Path:
    """Where a write of ``path`` lands: a symlink's target (created when absent), else ``path`` itself."""
    return Path(os.path.realpath(path)) if os.path.islink(path) else path


def _new_file_mode() -> int:
    """0o666 less the umask (mkstemp makes 0o600 files, which other users could no longer read)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    return 0o644


def _match_existing(fd: int, path: Path) -> None:
    """Give the new file the mode of the one it replaces (and its owner, when root may set it)."""
    try:
        old = os.stat(path)
    except OSError:
        os.fchmod(fd, _new_file_mode())
        return
    os.fchmod(fd, stat.S_IMODE(old.st_mode))
    if os.geteuid() == 0 and (old.st_uid, old.st_gid) != (os.getuid(), os.getgid()):
        with contextlib.suppress(OSError):
            os.fchown(fd, old.st_uid, old.st_gid)


STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})


@contextlib.contextmanager
def storage_refusals(path: Path) -> Iterator[None]:
    """A write to ``path`` that fails because of the storage (a full disk, a quota, a read-only or failing file
    system) is one ConfigError line, also where a writer wrapped the OSError in its own (torch.save's zip writer
    turns it into a RuntimeError, "unexpected pos"); any other failure passes as it is."""
    try:
        yield
    except BaseException as exc:
        seen: BaseException | None = exc
        while seen is not None:
            if isinstance(seen, OSError) and seen.errno in STORAGE_ERRNOS:
                said = seen.strerror or errno.errorcode[seen.errno]
                raise ConfigError(f"cannot write {path} ({said}): make room there or choose another path") from None
            seen = seen.__cause__ or seen.__context__
        raise


def atomic_write_bytes(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Call ``write(fileobj)`` on a temp file beside ``path``, fsync, then rename over ``path``; a ``path``
    that exists and is not a regular file is a ConfigError, checked before writing and again just before
    the rename (the rename never replaces anything else). A stop during the write comes after it."""
    path = Path(path)
    check_output(path)
    target = _target(path)
    with stops_held():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        except OSError as exc:
            reason = exc.strerror or exc
            raise ConfigError(f"output {path}: cannot write there ({reason}): choose another path") from None
        with storage_refusals(path):
            try:
                with os.fdopen(fd, "wb") as f:
                    write(f)
                    f.flush()
                    _match_existing(f.fileno(), target)
                    os.fsync(f.fileno())
                check_output(target)
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise


def open_regular(path: Path, flags: int, follow: bool = True) -> int:
    """``os.open`` of a regular file (created 0o666 less the umask with ``O_CREAT``): a FIFO is never waited
    on and a device never written, since what was opened is checked before anything is done with it; a
    ConfigError names what is there instead. ``follow=False``: a symlink is refused too (lock files, which
    are truncated and written in place)."""
    extra = os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    check_output(path)
    try:
        fd = os.open(path, flags | extra, 0o666)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink with O_NOFOLLOW; a FIFO nobody reads
            kind = "a symlink" if exc.errno == errno.ELOOP else "a FIFO"
            raise ConfigError(
                f"output {path} is {kind}, not a regular file; trainscale writes only regular "
                "files: choose another path"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        check_output(path)
        raise ConfigError(
            f"output {path} is not a regular file; trainscale writes only regular files: choose another path"
        )
    os.set_blocking(fd, True)
    return fd


def open_output(path: Path, append: bool = False) -> BinaryIO:
    """A regular file opened for writing in place (a log a child process streams into), truncated unless
    ``append``; anything else at ``path`` is refused as ``open_regular`` does."""
    path = Path(path)
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else 0))
    if not append:
        os.ftruncate(fd, 0)
    return os.fdopen(fd, "ab" if append else "wb")


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


def dumps(obj: Any, indent: int | None = 2) -> str:
    """``obj`` as strict JSON (NaN and inf as null, never the bare ``NaN`` Python's json writes and other readers
    refuse), with a newline: what every JSON file and ``--json`` output of trainscale is written with."""
    return json.dumps(clean(obj), indent=indent, sort_keys=False, allow_nan=False) + "\n"


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
    with stops_held(), storage_refusals(path), open_output(Path(path), append=True) as f:
        data = Path(path).read_bytes()
        if data and not data.endswith(b"\n"):
            log.warning("%s: dropping a torn last line (an interrupted write) before appending", path)
            f.truncate(data.rfind(b"\n") + 1)
        f.write(dumps(obj, indent=None).encode())


def to_toml(values: Mapping[str, Any], tables: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """TOML text of flat ``values`` then one ``[table]`` per entry of ``tables``; None is left out (TOML has no
    null: a reader takes the absent key's default). Floats keep every digit (``repr``), so a value reads back
    equal; NaN and infinities are TOML's ``nan``/``inf``."""
    lines = [f"{key} = {toml_value(value)}" for key, value in values.items() if value is not None]
    for name, table in (tables or {}).items():
        lines += ["", f"[{name}]", *(f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None)]
    return "\n".join(lines).lstrip("\n") + "\n"


def toml_value(value: Any) -> str:
    """One TOML value: a bool, number, string or list of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return (
            repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
        )
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string (settings are printable)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


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
        bom = "; it starts with a byte-order mark: save it as UTF-8 without one" if text.startswith("\ufeff") else ""
        raise error(f"{kind} {path} is not valid TOML: {str(exc).splitlines()[0]}{bom}") from None


def check_replaceable(path: Path, flag: str, what: str, looks_like: Callable[[Path], bool]) -> None:
    """An output that names an existing file replaces only a file of its own kind (``looks_like`` says whether the
    file is one, ``what`` in words): a run's checkpoint or a user's notes given by mistake is refused in one line,
    not overwritten."""
    path = Path(path)
    try:
        if not path.is_file() or looks_like(path):
            return
    except (OSError, ValueError):
        pass
    raise ConfigError(f"{flag} {path} holds a file that is not {what}, which this would replace; choose another {flag}")


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
        raise ConfigError(
            f"{flag} {folder}: cannot write there ({unwritable_reason(folder, exc)}); choose another {flag}"
        ) from None
    finally:
        remove_empty(made)


def check_folder_permissions(folder: Path, flag: str = "--out") -> None:
    """``check_folder_writable`` without making anything: the nearest existing ancestor must be a folder this
    process may write into, and must take a file (``refusal_of_a_file``: permissions alone pass root on /proc)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{flag} {folder}: cannot write there ({existing} is a file); choose another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {folder}: cannot write there (no permission in {existing}); choose another {flag}")
    refused = refusal_of_a_file(existing)
    if refused:
        raise ConfigError(
            f"{flag} {folder}: cannot write there ({existing} takes no new file: {refused}); choose another {flag}"
        )


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


def save_figure(fig: Any, path: Path, **options: Any) -> Path:
    """A matplotlib figure written atomically as ``atomic_write_bytes`` writes (its format from the suffix,
    PNG when there is none)."""
    path = Path(path)
    kind = path.suffix.lstrip(".").lower() or "png"
    atomic_write_bytes(path, lambda f: fig.savefig(f, format=kind, **options))
    return path
