"""Errors a user can fix. The CLI prints their message on one line and exits 2, with no traceback."""

from __future__ import annotations

import argparse


class TrainscaleError(Exception):
    """Base class for errors caused by input the user controls (flags, files, data)."""


class ConfigError(TrainscaleError, ValueError):
    """A flag or config value is invalid; the message names it and the accepted values."""


class DataError(TrainscaleError):
    """Dataset files are missing, truncated, altered or unreadable."""


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
