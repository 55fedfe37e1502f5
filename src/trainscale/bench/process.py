"""Run one `trainscale train` as a child in its own process group, and stop it and all it started.

The child dies with the bench: the parent-death signal (SIGTERM, so a run on a cluster still stops its nodes)
reaches it even when the bench is killed with SIGKILL, which leaves no chance to stop it.

A distributed run's launcher starts its workers in sessions of their own (torch's elastic agent does),
so killing the child's process group is not enough: the whole tree of descendants is collected from
/proc first and stopped with it. SIGTERM first (the agent then stops its workers cleanly), SIGKILL after
a grace period.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from trainscale.io import open_output
from trainscale.runtime.orphans import dying_with_this_process, is_running

log = logging.getLogger("trainscale.bench")

GRACE_SECONDS = 15.0
POLL_SECONDS = 1.0


def start(cmd: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """The child writes stdout and stderr to ``log_path``, after what earlier attempts wrote there (an interrupted
    or failed attempt's output is kept); ``start_new_session`` gives it its own group, and it gets SIGTERM when
    this process dies."""
    with open_output(log_path, append=True) as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=dying_with_this_process(signal.SIGTERM),
        )


def wait(proc: subprocess.Popen, timeout: float | None, on_poll: Callable[[], None] = lambda: None) -> bool:
    """Wait for the child, calling ``on_poll`` about every second; True when it ran past ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            proc.wait(timeout=POLL_SECONDS)
            return False
        except subprocess.TimeoutExpired:
            pass
        on_poll()
        if deadline is not None and time.monotonic() > deadline:
            return True


def stop(proc: subprocess.Popen, grace: float = GRACE_SECONDS) -> None:
    """Stop the child and every process it started (collected before any of them dies, and again while they stop:
    a node or worker started just as the signal came is stopped with the others)."""
    tree = [proc.pid, *descendants(proc.pid)]
    _signal_all(proc.pid, tree, signal.SIGTERM)
    alive = _alive_until(tree, time.monotonic() + grace, signal.SIGTERM)
    if alive:
        log.warning("run did not stop in %.0f s after SIGTERM; killing %d process(es)", grace, len(alive))
        _signal_all(proc.pid, alive, signal.SIGKILL)
        _alive_until(alive, time.monotonic() + grace, signal.SIGKILL)
    proc.wait()


def _alive_until(pids: list[int], deadline: float, sig: signal.Signals) -> list[int]:
    """Those of ``pids`` and of what they start meanwhile (sent ``sig`` as found) still running at ``deadline``,
    or none as soon as all are gone: the child may end before the processes it started have (a node that takes a
    moment to stop its workers), and the bench must not go on (or end) while any of them runs."""
    known = set(pids)
    while True:
        alive = [pid for pid in known if is_running(pid)]
        children = _children()
        late = {pid for parent in alive for pid in descendants(parent, children)} - known
        for pid in late:
            _signal(pid, sig)
        known |= late
        alive += sorted(late)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(POLL_SECONDS / 10)


def _signal_all(group: int, pids: list[int], sig: signal.Signals) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:
        _signal(pid, sig)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _children() -> dict[int, list[int]]:
    """Every live process's pid by its parent's (Linux /proc; elsewhere empty)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    return children


def descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """Every live descendant of ``pid`` (``children``: a ``_children()`` taken already)."""
    children = _children() if children is None else children
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found
