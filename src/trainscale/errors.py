"""Errors a user can fix. The CLI prints their message on one line and exits 2, with no traceback."""


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
