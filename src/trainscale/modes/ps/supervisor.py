"""Why a PS worker runs its training in a child process: so that a worker can die without ending the job.

torch's elastic agent (behind `trainscale train --workers` and torchrun) stops every process of the
job as soon as one exits with an error or a signal. For ASGD that is the wrong reaction to a dead
worker, so each worker rank is a small supervisor that starts the real worker (the same training
code) as a child process and waits for it:

* the child finished: pass its summary on (exit 0);
* the child was killed by a signal (SIGKILL, the OOM killer, a segfault): log it and exit 0, so the
  agent leaves the others running; the servers notice the dead worker by its closed connections and
  the rest finish the epoch without its shard;
* the child raised (a bug, a dead server, a bad flag) or it was the main worker (the one writing the
  run folder): re-raise its error here, so the agent stops the job with that message.

Killing the supervisor itself (not its child) still ends the job: the agent only watches supervisors.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import traceback
from typing import Any, Callable

from trainscale.errors import ConfigError, TrainscaleError
from trainscale.log import setup_logging
from trainscale.modes.base import Result
from trainscale.modes.ps.client import PSError, ServerLost
from trainscale.runtime.orphans import die_quietly_on_stop, die_with_parent
from trainscale.runtime.worker_errors import kind_of

log = logging.getLogger("trainscale.ps")


def _child_main(trainer: Callable[[], Result], conn: Any, supervisor: int) -> None:
    """The training child: dies with its supervisor (SIGKILL, also if it died while this one started), and
    silently when the agent stops the job (see ``runtime.orphans``). It starts no processes, but spawning
    made spawn its default: locks made here (tqdm's) would be named semaphores that the supervisor's
    resource tracker warns about when the child is stopped; fork's are unlinked at once."""
    die_quietly_on_stop()
    die_with_parent(signal.SIGKILL, supervisor)
    multiprocessing.set_start_method("fork", force=True)
    setup_logging()
    try:
        summary, history = trainer()
    except BaseException as exc:
        kind = kind_of(exc)
        if kind != "user":
            traceback.print_exc()
        plain = isinstance(exc, (TrainscaleError, PSError))
        conn.send((kind, str(exc) if plain else f"{type(exc).__name__}: {exc}"))
        sys.exit(2 if kind == "user" else 1)
    conn.send(("ok", summary, history))


def supervise(trainer: Callable[[], Result], worker: int, is_main: bool) -> Result:
    """Run ``trainer`` (picklable: it crosses into a spawned process) as worker ``worker``'s training
    child; see the module docstring for the outcomes."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(trainer, sender, os.getpid()), name=f"trainscale-ps-worker{worker}")
    child.start()
    sender.close()
    message = _receive(receiver)
    child.join()
    if message is not None and message[0] == "ok":
        return message[1], message[2]
    if message is not None:
        kind, text = message
        raise {"user": ConfigError, "peer": ServerLost}.get(kind, PSError)(text)
    killed = (child.exitcode or 0) < 0
    how = f"was killed by signal {signal.Signals(-child.exitcode).name}" if killed else \
        f"exited with status {child.exitcode} without a result"
    if is_main or not killed:
        role = "the main worker (it writes the run folder)" if is_main else "a worker"
        raise PSError(f"worker {worker}, {role}, failed: its training process (pid {child.pid}) {how}")
    log.warning("worker %d: its training process (pid %d) %s; the servers and the other workers carry on "
                "without it", worker, child.pid, how)
    return {}, []


def _receive(conn: Any) -> Any:
    try:
        return conn.recv()
    except EOFError:  # the child died without a word
        return None
