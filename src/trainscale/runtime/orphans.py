"""How a trainscale process ends when its job ends: with the process that started it, and without a word.

Orphans: torch's elastic agent runs inside `trainscale train --workers N` (the launcher) and starts the
workers as its children, each in a session of its own; a parameter-server worker starts its training
child the same way. When the launcher dies by SIGKILL nothing stops the workers: they go on training
and writing into a run folder whose lock died with the launcher. ``die_with_parent`` asks Linux for the
parent-death signal (``prctl(PR_SET_PDEATHSIG)``), so the kernel kills the child when its parent dies.
That covers a parent that dies after the request; a child whose parent died during its start-up
(importing torch takes seconds) was already re-parented, so it compares its parent with the one the
parent recorded (``Job.launcher_pid``, or a pid passed to it) and leaves at once.

Quiet stops: on Ctrl-C or a scheduler's SIGTERM the agent sends the same signal to every worker's
process group. Python would turn SIGINT into KeyboardInterrupt, which unwinds through RPC calls,
checkpoint writes and pipes and prints a traceback from every process, while the launcher already says
once that the job was interrupted. ``die_quietly_on_stop`` gives SIGINT and SIGTERM back their default
action: the process ends at once, even inside C code (a collective, an RPC wait), without unwinding.
Run-folder files are replaced atomically, so what is left is at most ``.*.tmp`` debris, which the
next writer of the folder removes. The agent's own warnings about that stop are left out of the
launcher's output too (``become_launcher``).

Launchers that start processes themselves (the fault-tolerant replicas, an emulated cluster's nodes, a
cluster being built) take the opposite course: ``sigterm_as_interrupt`` makes a scheduler's SIGTERM unwind
them as Ctrl-C does, so what they started is stopped and what they made is removed, where Python's default
would end them at once and leave their temporary folder and run-folder lock behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from trainscale.runtime.job import LAUNCHER_PID_ENV
from trainscale.stops import STOP_SIGNALS, Terminated

log = logging.getLogger("trainscale.runtime")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
AGENT_LOGGERS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
    "torch.multiprocessing.spawn",  # the forked workers' process context
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
)
DEATH_SIGNAL_NOTICE = "Received %s death signal, shutting down workers"  # their templates in torch 2.13
CLOSING_SIGNAL_NOTICES = (  # new processes, forked ones, the forked ones' context after one failed
    "Sending process %s closing signal %s",
    "Closing process %s via signal %s",
    "Terminating process %s via signal SIGTERM",
)
UNCLOSED_NOTICE = "has failed to shutdown the rendezvous"  # the store is gone: the launcher's line says so
FAILED_NOTICES = (
    "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
    "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)",
)


def become_launcher(restarts: bool = False) -> None:
    """In the launcher, before the agent starts workers: they inherit its pid through the environment, and
    the agent's notices about stopping them are left out (the launcher says so in one line; see
    ``AgentStopNotices`` for ``restarts``)."""
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    notices = AgentStopNotices(restarts)
    for name in AGENT_LOGGERS:
        logging.getLogger(name).addFilter(notices)


class AgentStopNotices(logging.Filter):
    """Drops torch's agent's notices of how it stops a job: "Received SIGINT death signal, shutting down
    workers", "Sending process N closing signal", "... has failed to shutdown the rendezvous" (its store went with
    node 0's launcher, which the launcher's line says) and, in a job that restarts no worker (``restarts`` False),
    "failed (exitcode: 1) local_rank: ..." (the launcher says in one line why the job stopped, naming the failed
    rank and the ones stopped after it; in a job that restarts workers, that notice is the news of a restart,
    kept without the traceback of the agent's own exception that comes with it for forked workers)."""

    def __init__(self, restarts: bool = False) -> None:
        super().__init__()
        self.restarts = restarts
        self.dropped = (DEATH_SIGNAL_NOTICE, *CLOSING_SIGNAL_NOTICES, *(() if restarts else FAILED_NOTICES))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in FAILED_NOTICES and self.restarts:
            record.exc_info, record.exc_text = None, None
        return record.msg not in self.dropped and UNCLOSED_NOTICE not in str(record.msg)


def end_with_launcher(launcher: int | None) -> None:
    """A worker's first call under a launcher (trainscale's, pid ``launcher``, or an external torchrun, whose pid
    is not recorded: None): die with it, and silently when it stops the job."""
    die_quietly_on_stop()
    die_with_parent(signal.SIGKILL, launcher)


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies; exit at once if the parent is
    already gone (``parent``: the pid the parent recorded; None skips that check). A no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    libc = _libc()
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.warning(
            "prctl(PR_SET_PDEATHSIG) failed (%s): this process may outlive its parent", os.strerror(ctypes.get_errno())
        )
        return
    if parent is not None and os.getppid() != parent:
        os._exit(1)  # orphaned before the request: nobody is left to report to


def dying_with_this_process(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for a child that must not outlive this process: the kernel sends it ``sig`` when this
    process dies (even by SIGKILL), and a child that finds this process already gone exits at once. libc is
    loaded here, in the parent, so the child does nothing between fork and exec that could wait on a lock."""
    parent = os.getpid()
    if sys.platform.startswith("linux"):
        _libc()
    return functools.partial(die_with_parent, sig, parent)


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def die_quietly_on_stop() -> None:
    """SIGINT and SIGTERM end this process at once and silently (see the module docstring); call it from
    the main thread at a worker's start."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat from the state letter on (field 3 of proc(5) is item 0), or None if process
    ``pid`` is gone. The command name in parentheses may hold spaces and parentheses, so the fields are read after
    its last ``)``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of process ``pid``, or None if it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else (fields[0], int(fields[1]))


def is_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, not yet reaped, has)."""
    state = process_state(pid)
    return state is not None and state[0] != "Z"


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP: state ``T``); False if it is gone."""
    state = process_state(pid)
    return state is not None and state[0] == "T"


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` (a KeyboardInterrupt) inside the block (see the module docstring); the
    handler before it comes back after. Outside the main thread (``trainscale.fit`` called from a thread of the
    user's), where Python takes no handlers and SIGTERM would not reach the block anyway, nothing changes."""

    def interrupt(signum: int, frame: object) -> None:
        raise Terminated

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
