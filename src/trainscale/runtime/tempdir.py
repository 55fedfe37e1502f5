"""The temporary folders trainscale makes for its processes, short enough for their sockets.

A Unix socket's path holds at most 107 bytes, and multiprocessing makes its sockets 33 bytes deep into the
temporary folder (``pymp-XXXXXXXX/listener-XXXXXXXX``), so under a deeper TMPDIR a DataLoader's workers cannot hand
over their batches. A launcher's folder (which its processes get as TMPDIR, and which goes with it) is therefore
made in /tmp when the usual place is too deep, and a run in one process trains with a short folder of its own.
Either way torch's compiler cache stays where it would be, so compiled kernels are still reused across runs.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from multiprocessing.util import Finalize

SOCKET_FOLDER_MAX = 107 - 34  # the longest TMPDIR whose multiprocessing sockets still fit
SHORT_TEMP = "/tmp"  # where a launcher's folder goes when the usual temporary folder is too deep


def short_enough(folder: str) -> bool:
    """Whether the Unix sockets that processes make in ``folder`` (as their TMPDIR) fit their path limit."""
    return len(folder) <= SOCKET_FOLDER_MAX


def compiler_cache() -> str:
    """Where torch's compiler keeps its cache: TORCHINDUCTOR_CACHE_DIR, else ``torchinductor_<user>`` in the
    temporary folder (torch's default, worked out here without importing the compiler). A process given a folder
    of its launcher's as TMPDIR is told this one, so compiled kernels are still reused across runs."""
    if cache := os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return cache
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def launcher_temp_parent(prefix: str) -> str | None:
    """Where to make a launcher's temporary folder named ``prefix`` + 8 characters: the usual temporary folder
    (None), or /tmp where a folder there would be too deep for its processes' sockets and /tmp can be written."""
    if short_enough(os.path.join(tempfile.gettempdir(), prefix + "x" * 8)):
        return None
    writable = os.path.isdir(SHORT_TEMP) and os.access(SHORT_TEMP, os.W_OK | os.X_OK)
    return SHORT_TEMP if writable else None


@contextlib.contextmanager
def socket_safe_tempdir() -> Iterator[None]:
    """Inside, this process's temporary folder (and its children's TMPDIR) is short enough for Unix sockets: as
    it was where it already is, else a folder of its own in /tmp. A run in one process needs it for its
    DataLoader workers, which hand batches over sockets made there (under a deeper one they fail, and the run
    waits for them forever). The folder is removed at exit, after multiprocessing removes the ``pymp-*`` folder
    it made in it for the rest of the process's life."""
    if short_enough(tempfile.gettempdir()) or (parent := launcher_temp_parent("ts")) is None:
        yield
        return
    folder = tempfile.mkdtemp(prefix="ts", dir=parent)
    Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=_AFTER_MULTIPROCESSING)
    before = tempfile.tempdir
    with environ({"TMPDIR": folder, "TORCHINDUCTOR_CACHE_DIR": compiler_cache()}):
        tempfile.tempdir = folder
        try:
            yield
        finally:
            tempfile.tempdir = before


_AFTER_MULTIPROCESSING = -101  # multiprocessing removes its pymp-* folder at -100 (higher runs first)


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment (so in every process it starts) while the block runs."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
