"""Who owns a cluster: one lock per cluster name, so two commands never build, delete or replace one cluster at
the same time.

The lock is an ``flock`` on ``/run/trainscale/locks/NAME.lock``. It is held by `cluster up` while it builds the
cluster, by `cluster down` while it deletes it, and by `trainscale bench` for as long as it uses a cluster it made
(from making it to deleting it). The kernel drops the lock when its holder dies, even by SIGKILL, so "the lock is
free" means "no live owner": a record or namespaces left behind by a killed owner are a leftover, never a live
cluster. The holder writes its pid into the file, so a refusal can name it. The folder is fixed, not under
``$TRAINSCALE_CLUSTER_STATE``: namespaces are global to the machine, whatever state folder a command uses.

A holder deletes the file before it lets go; whoever locks a file that has been deleted meanwhile (it opened it
just before) tries again on the new one, so two processes never both believe they hold the lock. The lock is not
re-entrant: a process asking again for a name it holds is refused like any other.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainscale.errors import ConfigError
from trainscale.io import open_regular
from trainscale.runtime import cluster as net
from trainscale.runtime.orphans import process_state

LOCK_DIR = Path("/run/trainscale/locks")
WAIT_S = 2.0  # how long to retry a held lock: a `cluster status` looking at it holds it for a moment
POLL_S = 0.05

_held: dict[str, int] = {}  # cluster name -> the locked file's descriptor, in this process


@dataclass(frozen=True)
class Owner:
    """The live process holding a cluster's lock (pid 0: it has not written its pid yet)."""

    pid: int
    command: str

    def __str__(self) -> str:
        if not self.pid:
            return "another trainscale process"
        return f"pid {self.pid} ({self.command})" if self.command else f"pid {self.pid}"


class ClusterBusy(ConfigError):
    """Another live process holds the cluster's lock."""

    def __init__(self, name: str, owner: Owner) -> None:
        self.name, self.owner = name, owner
        super().__init__(
            f"cluster {name} is in use by {owner}, which is making, using or deleting it: wait for it to "
            f"finish, or stop it with `trainscale cluster down {name} --force`"
        )


def lock_path(name: str) -> Path:
    return LOCK_DIR / f"{net.validate_name(name)}.lock"


@contextlib.contextmanager
def owned(name: str, wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold cluster ``name``'s lock for the body; ClusterBusy, naming the holder, when another live process (or
    this one) still holds it after ``wait_s`` seconds."""
    fd = _acquire(name, wait_s)
    assert fd is not None  # with create, there is always a file to lock
    _held[name] = fd
    try:
        yield
    finally:
        del _held[name]
        _let_go(name, fd)


def clear_leftover(name: str, wait_s: float = WAIT_S) -> bool:
    """Delete cluster ``name``'s lock file where no live process holds it (a killed owner's), as taking and letting
    go of the lock does, but never make one where there is none: a sweep that listed the file just before its owner
    deleted it would otherwise put it back for a moment. False when a live owner still holds it after ``wait_s``."""
    try:
        fd = _acquire(name, wait_s, create=False)
    except ClusterBusy:
        return False
    if fd is not None:
        _let_go(name, fd)
    return True


def _let_go(name: str, fd: int) -> None:
    """Delete the lock file, then let go of its lock: never the other way round, or a process could lock the file
    in between and believe it held a lock that the next process, locking a new file, holds too."""
    with contextlib.suppress(FileNotFoundError):
        lock_path(name).unlink()
    os.close(fd)


def holds(name: str) -> bool:
    """Whether this process holds cluster ``name``'s lock (what changing the cluster requires)."""
    return name in _held


def require(name: str) -> None:
    """A guard for the functions that build or delete a cluster: their caller must own it."""
    if not holds(name):
        raise RuntimeError(f"cluster {name} is changed without its lock (trainscale.cluster.owner.owned)")


def _acquire(name: str, wait_s: float, create: bool = True) -> int | None:
    """The locked file's descriptor; None where ``create`` is off and there is no file to lock."""
    path = lock_path(name)
    if name in _held:
        raise ClusterBusy(name, Owner(os.getpid(), net.command_of(os.getpid())))
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = open_regular(path, os.O_RDWR | (os.O_CREAT if create else 0), follow=False)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() > deadline:
                raise ClusterBusy(name, holder(name) or Owner(0, "")) from None
            time.sleep(POLL_S)
            continue
        if _still_there(fd, path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)  # the previous holder deleted it after we opened it: lock the new one


def _still_there(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def holder(name: str) -> Owner | None:
    """The live process holding cluster ``name``'s lock, None when no process does. Looking takes a shared lock
    for a moment (an owner asking meanwhile retries for ``WAIT_S``)."""
    try:
        fd = os.open(lock_path(name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 64, 0).decode(errors="replace").strip()
            pid = int(text) if text.isdigit() else 0
            return Owner(pid, net.command_of(pid) if pid else "")
        return None
    finally:
        os.close(fd)


def leftover_locks() -> list[str]:
    """Cluster names with a lock file nobody holds (its holder was killed); `cluster down --all` removes them."""
    if not LOCK_DIR.is_dir():
        return []
    names = [p.stem for p in LOCK_DIR.glob("*.lock")]
    return sorted(n for n in names if _valid(n) and holder(n) is None)


def _valid(name: str) -> bool:
    try:
        net.validate_name(name)
    except ConfigError:
        return False
    return True


def is_ancestor(pid: int) -> bool:
    """Whether ``pid`` is this process or one it descends from (a bench's run, started under its lock)."""
    current: int | None = os.getpid()
    while current and current != pid:
        state = process_state(current)
        current = state[1] if state else None
    return bool(pid) and current == pid


def stop_owner(owner: Owner, grace_s: float = 20.0) -> None:
    """SIGTERM a cluster's owner (a bench then stops its run and deletes its cluster; an `up` deletes what it
    made), SIGKILL after ``grace_s``. Only a trainscale process is signalled: a pid read from the lock file is
    checked against its command line first."""
    if owner.pid and owner.pid != os.getpid() and "trainscale" in net.command_of(owner.pid):
        net.stop_processes([owner.pid], grace_s)
