"""Errors a user can fix. The CLI prints their message on one line and exits 2, with no traceback."""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator


class TrainscaleError(Exception):
    """Base class for errors caused by input the user controls (flags, files, data)."""


class ConfigError(TrainscaleError, ValueError):
    """A flag or config value is invalid; the message names it and the accepted values."""


class DataError(TrainscaleError):
    """Dataset files are missing, truncated, altered or unreadable."""


class OutOfMemory(TrainscaleError):
    """The run's settings ask for more memory than its device has (torch's allocator refused)."""


_ALLOCATION = re.compile(r"tried to allocate ([0-9.]+ ?[KMGT]?i?B|\d+ bytes)")


@contextlib.contextmanager
def memory_errors_as_one_line() -> Iterator[None]:
    """torch's out-of-memory errors (CUDA's ``OutOfMemoryError``, the CPU allocator's ``RuntimeError``) as an
    ``OutOfMemory`` line naming what to shrink, not a traceback from deep in a model: a batch, an image size or a
    model too large for the device is a setting the user chose."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc)
        if type(exc).__name__ != "OutOfMemoryError" and "can't allocate memory" not in text:
            raise
        asked = _ALLOCATION.search(text)
        what = f"the run tried to allocate {_size(asked.group(1))}" if asked else text.strip().splitlines()[0][:200]
        raise OutOfMemory(
            f"out of memory: {what}; a smaller --batch-size (or --batch-per-worker), --image-size or model fits"
        ) from exc


def _size(text: str) -> str:
    if not text.endswith(" bytes"):
        return text
    return f"{int(text.split()[0]) / 2**30:,.1f} GiB"


def require(ok: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``ok``: the one-line form every settings check takes."""
    if not ok:
        raise ConfigError(message)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit status 2 (no usage dump): the parser of
    ``trainscale`` and of every benchmark script."""

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = "" if "--help" in message else " (see --help)"  # a message may point to its own help already
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")
