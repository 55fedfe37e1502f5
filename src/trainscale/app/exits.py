"""The exit status of each worker that torch's agent forked, read as it dies, for the launcher's triage.

Forked workers (``app.launch.start_method``) are reaped inside torch's agent, which reports only the first failed
one it finds (``torch.multiprocessing``'s ``ProcessContext.join``): possibly a rank that merely lost its peer. A rank
that failed with an exception leaves an error file (``app.failures.every_failure`` reads them all); one killed by a
signal (SIGKILL, the out-of-memory killer, a crash in native code) leaves nothing but its exit status. So the
launcher watches its children with ``waitid(..., WNOWAIT)``: the kernel tells each one's status when it dies and
leaves it for torch to reap, so the agent runs exactly as it would unwatched. Each forked worker writes its process
id and start time beside its error file (``note_worker``), which ties a status to a rank and keeps a process id
that the system gave again to a later process from being taken for it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import TracebackType

from trainscale.io import atomic_write_text
from trainscale.runtime.orphans import stat_fields

PID_FILE = "pid"  # in the agent's folder of a worker's error file: "<process id> <start time>"


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot: field 22 of ``/proc/<pid>/stat``, still there while it
    is a zombie); None once it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[19])


def note_worker(error_file: str) -> None:
    """In a forked worker, first of all: who it is, beside the error file the agent gave it."""
    pid = os.getpid()
    atomic_write_text(Path(error_file).with_name(PID_FILE), f"{pid} {start_time(pid)}\n")


def children() -> set[int]:
    """The process ids of this process's children, dead ones not yet reaped included."""
    found: set[int] = set()
    for listing in Path("/proc/self/task").glob("*/children"):
        try:
            found.update(int(pid) for pid in listing.read_text().split())
        except OSError:
            continue  # a thread that ended meanwhile
    return found


def exit_status(info: os.waitid_result) -> int:
    """As ``multiprocessing`` gives it: the exit code, or minus the signal that ended the process."""
    return int(info.si_status) if info.si_code == os.CLD_EXITED else -int(info.si_status)


class ChildExits:
    """The exit status of every child of this process that died while it was watched, by process id and start
    time; a context manager (a daemon thread that never reaps)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="trainscale child exits", daemon=True)

    def __enter__(self) -> ChildExits:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=0.1)  # it may wait on a child that outlives the job: it holds nothing

    def of_worker(self, folder: Path) -> int | None:
        """The exit status of the worker whose error-file folder this is; None where it is alive, was not seen to
        die, or wrote no ``PID_FILE``."""
        try:
            pid, started = (int(part) for part in (folder / PID_FILE).read_text().split())
        except (OSError, ValueError):
            return None
        return self._seen.get((pid, started))

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)  # until a child dies; it stays unreaped
            except ChildProcessError:
                self._stop.wait(0.01)  # no children yet, or none left
                continue
            if info is not None and not self._record({info.si_pid} | children()):
                self._stop.wait(0.005)  # only dead children already seen, left for their parent to reap

    def _record(self, pids: set[int]) -> bool:
        new = False
        for pid in pids:
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
            except ChildProcessError:
                continue  # reaped meanwhile
            if info is None:
                continue  # alive
            started = start_time(pid)
            if started is None or (pid, started) in self._seen:
                continue
            self._seen[(pid, started)] = exit_status(info)
            new = True
        return new
