"""A restricted unpickler for the CIFAR "python version" files.

Those files are Python-2 pickles of a dict holding one numpy uint8 array and lists of ints / byte
strings. A plain ``pickle.load`` would run whatever callable a tampered file names, so this unpickler
resolves only the few globals numpy needs to rebuild an array and refuses every other one before
anything is called. Containers (dict, list, tuple), ints and strings are pickle opcodes, not globals,
so they need no entry here.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import IO, Any

from trainscale.errors import DataError


def _reconstruct() -> Callable[..., Any]:
    # Files written by older numpy name ``numpy.core.multiarray``; numpy >= 2 moved it to ``numpy._core``
    # (the old path still works there but warns), so both names resolve to the same function.
    try:
        from numpy._core.multiarray import _reconstruct as fn
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct as numpy1_fn

        return numpy1_fn
    return fn


def _ndarray() -> type:
    import numpy

    return numpy.ndarray


def _dtype() -> type:
    import numpy

    return numpy.dtype


ALLOWED: dict[tuple[str, str], Callable[[], Any]] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): _ndarray,
    ("numpy", "dtype"): _dtype,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler whose ``find_class`` admits only numpy's array reconstruction."""

    def __init__(self, file: IO[bytes], *, source: str = "<bytes>") -> None:
        super().__init__(file, encoding="bytes")
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        resolver = ALLOWED.get((module, name))
        if resolver is None:
            raise DataError(
                f"refused to unpickle {module}.{name} from {self.source}: CIFAR python files hold only numpy "
                f"arrays, lists and strings, so this file is not an official one; delete it and run "
                f"`trainscale data download`"
            )
        return resolver()


def restricted_load(fileobj: IO[bytes], *, source: str | None = None) -> Any:
    """Unpickle from an open binary file, admitting only numpy arrays (see module docstring).

    Malformed or truncated data raises DataError naming ``source`` (default: the file's name).
    """
    where = source or str(getattr(fileobj, "name", "<stream>"))
    try:
        return RestrictedUnpickler(fileobj, source=where).load()
    except DataError:
        raise
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        UnicodeDecodeError,
        MemoryError,
    ) as exc:
        raise DataError(
            f"{where} is not a readable CIFAR python pickle ({type(exc).__name__}: {exc}); it is truncated or "
            f"corrupted: delete the folder and run `trainscale data download`"
        ) from exc


def restricted_loads(data: bytes, *, source: str = "<bytes>") -> Any:
    """``restricted_load`` for an in-memory pickle."""
    return restricted_load(io.BytesIO(data), source=source)
