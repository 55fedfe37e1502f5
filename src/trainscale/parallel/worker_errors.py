"""How a worker hands its exception to the elastic agent, without the agent ever reading half a file.

torch's ``@record`` writes the error file with ``open(path, "w")`` and ``json.dump``. When one rank dies,
the agent SIGTERMs the others and then reads every failed rank's error file; a rank that was killed
between the truncating open and the dump leaves an empty file, and torch's agent (2.13) crashes on it
with a JSONDecodeError instead of reporting the job's failure (seen here in a restart test). The handler
below writes the same JSON to a temporary file and renames it into place, so the agent sees either no
file (and reports the signal) or a complete one.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable, TypeVar

from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from trainscale.train.checkpoint import atomic_write_text

T = TypeVar("T")


class AtomicErrorHandler(ErrorHandler):
    """torch's error handler with an atomic error-file write (same JSON layout, read by the agent)."""

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        data = {"message": {"message": f"{type(e).__name__}: {e}",
                            "extraInfo": {"py_callstack": traceback.format_exc(),
                                          "timestamp": str(int(time.time()))}}}
        atomic_write_text(Path(path), json.dumps(data))


def recorded(fn: Callable[..., T]) -> Callable[..., Any]:
    """``fn`` wrapped like torch's ``@record`` (fault handler, error file), writing the file atomically."""
    return record(fn, error_handler=AtomicErrorHandler())
