"""Why a PS worker runs its training in a child process: so that a worker can die without ending the job.

torch's elastic agent (behind `trainscale train --workers` and torchrun) stops every process of the
job as soon as one exits with an error or a signal. For ASGD that is the wrong reaction to a dead
worker, so each worker rank is a small supervisor that starts the real worker (the same training
code) as a child process and waits for it:

* the child finished: pass its summary on (exit 0);
* the child was killed by a signal (SIGKILL, the OOM killer, a segfault): log it and exit 0, so the
  agent leaves the others running; the servers notice the dead worker by its closed connections, the
  others train its batches (``handover.py``), and if it was the main worker, the next one on node 0
  takes over evaluating and writing the run folder at the epoch's end;
* the child was dropped by the servers (it stopped answering their pings for ``--heartbeat-timeout``
  and came back): as if it had been killed;
* the child has been stopped (SIGSTOP, a hung host) for longer than the servers wait for it: they have
  dropped it and handed its batches over, so it is killed here and the job goes on;
* the child raised (a bug, a dead server, a bad flag): re-raise its error here, so the agent stops the
  job with that message (under ``--max-restarts``, restarts every process: a dead server's way back, from the
  last epoch's checkpoint). A lost server is one warning line here, the server's own failure the job's.

Killing the supervisor itself (not its child) still ends the job: the agent only watches supervisors.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch

from trainscale.errors import ConfigError, TrainscaleError
from trainscale.log import setup_logging
from trainscale.modes.base import Result
from trainscale.modes.ps.client import Dropped, PSError, ServerLost
from trainscale.runtime.orphans import die_quietly_on_stop, die_with_parent, is_stopped
from trainscale.runtime.worker_errors import kind_of

log = logging.getLogger("trainscale.ps")

WATCH_INTERVAL_S = 0.2


def _child_main(trainer: Callable[[], Result], conn: Connection, supervisor: int) -> None:
    """The training child: dies with its supervisor (SIGKILL, also if it died while this one started), and
    silently when the agent stops the job (see ``runtime.orphans``). It starts no processes, but a spawned
    child has spawn as its default: locks made here (tqdm's) would be named semaphores that the supervisor's
    resource tracker warns about when the child is stopped; fork's are unlinked at once."""
    die_quietly_on_stop()
    die_with_parent(signal.SIGKILL, supervisor)
    multiprocessing.set_start_method("fork", force=True)
    setup_logging()
    try:
        summary, history = trainer()
    except BaseException as exc:
        kind = "dropped" if isinstance(exc, Dropped) else kind_of(exc)
        if kind == "peer":  # another process's failure (a server's): the launcher names that one
            log.warning("%s", exc)
        elif kind not in ("user", "dropped"):
            traceback.print_exc()
        plain = isinstance(exc, (TrainscaleError, PSError))
        conn.send((kind, str(exc) if plain else f"{type(exc).__name__}: {exc}"))
        sys.exit(2 if kind == "user" else 1)
    conn.send(("ok", summary, history))


def start_method() -> Literal["fork", "spawn"]:
    """How the training child starts. Forked, it trains at once; spawned, it first imports torch and trainscale
    again (about 2 s of CPU a worker, paid by every parameter-server run). Fork only where nothing in the
    supervisor can leave the child an unusable device: Linux with a torch built without CUDA (a CUDA driver
    initialised before a fork, by so little as asking whether a GPU is there, fails in the child)."""
    return "fork" if sys.platform == "linux" and not torch.backends.cuda.is_built() else "spawn"


def supervise(trainer: Callable[[], Result], worker: int, stopped_limit_s: float) -> Result:
    """Run ``trainer`` (picklable: it may cross into a spawned process) as worker ``worker``'s training
    child; see the module docstring for the outcomes (``stopped_limit_s``: how long it may stay stopped)."""
    ctx = multiprocessing.get_context("fork") if start_method() == "fork" else multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(trainer, sender, os.getpid()), name=f"trainscale-ps-worker{worker}")
    child.start()
    assert child.pid is not None  # started
    sender.close()
    message = _receive(receiver, child.pid, stopped_limit_s)
    child.join()
    if message is not None and message[0] == "ok":
        return message[1], message[2]
    if message is not None and message[0] == "dropped":
        log.warning("%s", message[1])
        return {}, []
    if message is not None:
        kind, text = message
        raise {"user": ConfigError, "peer": ServerLost}.get(kind, PSError)(text)
    assert child.exitcode is not None  # joined
    killed = (child.exitcode or 0) < 0
    how = (
        f"was killed by signal {signal.Signals(-child.exitcode).name}"
        if killed
        else f"exited with status {child.exitcode} without a result"
    )
    if not killed:
        raise PSError(f"worker {worker} failed: its training process (pid {child.pid}) {how}")
    log.warning(
        "worker %d: its training process (pid %d) %s; the servers and the other workers carry on without it",
        worker,
        child.pid,
        how,
    )
    return {}, []


def _receive(conn: Connection, pid: int, stopped_limit_s: float) -> Any:
    """The child's last word (None if it died without one); a child stopped for too long is killed."""
    stopped_since: float | None = None
    while not conn.poll(WATCH_INTERVAL_S):
        if not is_stopped(pid):
            stopped_since = None
            continue
        now = time.monotonic()
        stopped_since = now if stopped_since is None else stopped_since
        if now - stopped_since > stopped_limit_s:
            log.warning(
                "worker training process %d has been stopped for %.1f s: killing it (the servers have dropped it)",
                pid,
                now - stopped_since,
            )
            os.kill(pid, signal.SIGKILL)
            stopped_since = None
    try:
        return conn.recv()
    except EOFError:  # the child died without a word
        return None
