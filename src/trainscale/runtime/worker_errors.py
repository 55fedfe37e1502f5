"""How a worker hands its exception to the elastic agent, without the agent ever reading half a file.

torch's ``@record`` writes the error file with ``open(path, "w")`` and ``json.dump``. When one rank dies,
the agent SIGTERMs the others and then reads every failed rank's error file; a rank that was killed
between the truncating open and the dump leaves an empty file, and torch's agent (2.13) crashes on it
with a JSONDecodeError instead of reporting the job's failure (seen here in a restart test). The handler
below writes the same JSON to a temporary file and renames it into place, so the agent sees either no
file (and reports the signal) or a complete one.

The file also says what *kind* of failure it was (``kind_of``), so the launcher can tell the root cause of
a failed job from its consequences without matching message text: ``user`` (bad input: exit 2), ``peer``
(this process lost a peer it depends on), ``stopped`` (the agent stopped it after another failed) or
``error`` (anything else: a root cause).
"""

from __future__ import annotations

import contextlib
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from trainscale.errors import TrainscaleError
from trainscale.io import atomic_write_text

KINDS = ("user", "peer", "stopped", "error")


class PeerLost(RuntimeError):
    """This process lost a peer it depends on (a server, a coordinator): a consequence, not a root cause."""


def kind_of(exc: BaseException) -> str:
    """The failure kind of an exception or of the one it was raised from (see the module docstring)."""
    if isinstance(exc, TrainscaleError):
        return "user"
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 10:
        chain.append(chain[-1].__cause__)
    if any(isinstance(e, (PeerLost, dist.DistError)) for e in chain):
        return "peer"
    if isinstance(exc, (SignalException, KeyboardInterrupt)):
        return "stopped"
    return "error"


T = TypeVar("T")


class AtomicErrorHandler(ErrorHandler):
    """torch's error handler with an atomic error-file write (same JSON layout, read by the agent)."""

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "kind": kind_of(e),
                "time_ns": time.time_ns(),
                "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
            }
        }
        atomic_write_text(Path(path), json.dumps(data))
        with contextlib.suppress(AttributeError, TypeError):
            setattr(e, RECORDED, True)


RECORDED = "_trainscale_recorded"  # set on an exception once its error file is written


def was_recorded(exc: BaseException) -> bool:
    """Whether ``exc`` is in the agent's error file already (so the launcher can report it)."""
    return bool(getattr(exc, RECORDED, False))


def recorded(fn: Callable[..., T]) -> Callable[..., Any]:
    """``fn`` wrapped like torch's ``@record`` (fault handler, error file), writing the file atomically."""
    return record(fn, error_handler=AtomicErrorHandler())
