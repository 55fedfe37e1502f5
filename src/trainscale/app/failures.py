"""A node's failed workers, triaged: which rank's failure caused the others', in one line, and the node report
that lets a parent of several nodes (``train --cluster``) name the root cause among them; and a worker's refusal
handed to its launcher where a restart would meet it again (``refuse_job``).

torch's agent hands over every failed process (``ProcessFailure``) with what the worker recorded through
``@record`` (``runtime.worker_errors``: message, failure kind, nanosecond stamp).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from trainscale.errors import TrainscaleError
from trainscale.io import atomic_write_text, dumps
from trainscale.runtime.job import Job

CONSEQUENCES = ("peer", "stopped")  # failure kinds caused by another process's failure (see worker_errors)
REFUSAL_WAIT_S = 30.0  # a refusing worker's wait for its launcher to end the job (it takes a fraction of a second)


def recorded_field(failure: ProcessFailure, key: str) -> Any:
    """A field of the worker's error file (``kind``, ``time_ns``: see ``worker_errors``), None without one."""
    message = failure.message
    return message.get(key) if isinstance(message, dict) else None


def recorded_kind(failure: ProcessFailure) -> str | None:
    """The failure kind the worker recorded (``worker_errors.kind_of``), None when it recorded none."""
    return recorded_field(failure, "kind")


def recorded_message(failure: ProcessFailure) -> str:
    """The exception a worker recorded through ``@record`` ("" when it died without one)."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message") or ""
    return "" if message.startswith("To enable traceback") else message.strip()


def root_traceback(failures: dict[int, ProcessFailure]) -> str:
    """The traceback the root-cause rank recorded, where its failure was an unexpected error (a bug, in trainscale
    or in the user's code); "" for bad input, which its one line says in full, and for a rank that recorded none."""
    failure = failures[root_cause(failures)]
    extra = recorded_field(failure, "extraInfo")
    if recorded_kind(failure) != "error" or not isinstance(extra, dict):
        return ""
    return str(extra.get("py_callstack") or "").rstrip()


def failure_text(failure: ProcessFailure) -> str:
    """One line for a failed worker: its exception, the signal that killed it, or its exit code."""
    message = recorded_message(failure)
    if message:
        first = message.splitlines()[0]
        return first if len(first) <= 400 else first[:400] + "..."
    if failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()}"
    return f"exited with status {failure.exitcode} (no exception recorded; see its output above)"


def is_consequence(failure: ProcessFailure) -> bool:
    """A worker the agent stopped (SIGTERM, or a recorded ``stopped``) or one that recorded losing a peer
    (closed connection, collective timeout, dead server): an effect of the root cause, not the cause."""
    if failure.exitcode == -signal.SIGTERM and recorded_kind(failure) is None:
        return True
    return recorded_kind(failure) in CONSEQUENCES


def failure_time_ns(failure: ProcessFailure) -> int:
    """When the failure was recorded: the worker's own nanosecond stamp (a root cause records before its
    peers notice it), else the agent's whole-second timestamp (a process killed without a word)."""
    stamp = recorded_field(failure, "time_ns")
    return int(stamp) if stamp is not None else int(failure.timestamp) * 10**9


def root_cause(failures: dict[int, ProcessFailure]) -> int:
    """The rank whose failure caused the others: the earliest that is not a consequence of another."""
    return min(failures, key=lambda r: (is_consequence(failures[r]), failure_time_ns(failures[r]), r))


def write_node_report(failures: dict[int, ProcessFailure], message: str, status: int, path: Path | None) -> None:
    """For a parent that runs several nodes (``train --cluster``) and must name the root cause among
    them: this node's failure line, whether it is a consequence, and when it was recorded, at ``path``
    (``Job.node_report``; None: no such parent)."""
    failure = failures[root_cause(failures)]
    write_report(path, message, status, is_consequence(failure), failure_time_ns(failure))


def write_report(path: Path | None, message: str, status: int, consequence: bool, time_ns: int) -> None:
    """The node report's one writer (``write_node_report``; a refusal's, which has no failed process)."""
    if path:
        report = {"message": message, "status": status, "consequence": consequence, "time_ns": time_ns}
        atomic_write_text(Path(path), dumps(report))


def every_failure(
    failures: dict[int, ProcessFailure], status_of: Callable[[Path], int | None]
) -> dict[int, ProcessFailure]:
    """``failures`` with every other rank of the same attempt that failed on its own. For forked workers
    (``app.launch.start_method``) torch's agent hands over only the first failed process it finds, which may be a
    consequence (a lost peer) of a rank that failed a moment earlier. Such a rank left an error file, or its exit
    status says it failed: a signal other than the agent's SIGTERM, or a non-zero exit code (``status_of``: a
    worker's status by its folder beside the error file, None where not known; ``app.exits``)."""
    found = dict(failures)
    for rank, failure in failures.items():
        if not failure.error_file or failure.error_file == os.devnull:
            continue
        offset = rank - failure.local_rank  # global rank of this node's local rank 0
        for folder in sorted(Path(failure.error_file).parent.parent.iterdir()):
            if not folder.name.isdigit() or offset + int(folder.name) in found:
                continue
            status = status_of(folder)
            error = folder / "error.json"
            if error.exists() or status not in (None, 0, -signal.SIGTERM):
                found[offset + int(folder.name)] = ProcessFailure(int(folder.name), -1, status or 1, str(error))
    return found


def describe_failure(failures: dict[int, ProcessFailure], first_server: int | None = None) -> tuple[str, int]:
    """(one line naming the root-cause rank and its error, exit status): the earliest failure that is
    not a consequence of another; the agent then stopped the rest. ``first_server``: in parameter-server
    modes, local ranks from this one on are servers, and are named so."""
    rank = root_cause(failures)
    failure = failures[rank]
    line = failed_line(rank, failure.local_rank, failure_text(failure), first_server)
    others = sorted(r for r in failures if r != rank)
    if others:
        line += f"; the other workers were stopped (rank {', '.join(map(str, others))})"
    return line, 2 if failure.exitcode == 2 or recorded_kind(failure) == "user" else 1


def failed_line(rank: int, local_rank: int, text: str, first_server: int | None = None) -> str:
    """How the job's one line names a failed process: its role, rank and local rank, then what it said."""
    kind = "parameter server" if first_server is not None and local_rank >= first_server else "worker"
    return f"{kind} rank {rank} (local rank {local_rank}) failed: {text}"


def refuse_job(job: Job, refused: TrainscaleError, first_server: int | None = None) -> None:
    """In a worker that refuses to go on (bad input it alone could see, a full disk: a TrainscaleError) where its
    launcher would restart it into the same refusal (``Job.refusal`` set: a fault-tolerant replica, or a job with
    ``--max-restarts``), have the launcher end the job with the refusal's line, and wait for it. Restarted, a
    full disk cost every restart's work before the same line, and in a fault-tolerant job the refusal went unsaid
    once the other replicas finished. The first refusing process speaks (the line is published whole, once: a
    second refusal, as every rank meeting the same bad input, finds it there); a fault-tolerant job's launcher
    watches for it, a job's elastic agent is told by SIGTERM (``app.launch.run_agents``). Where the line cannot be
    handed over, the worker fails as any other."""
    if job.refusal is None:
        return
    if job.replica is not None:
        line = f"replica {job.replica}: {refused}"
    else:
        line = failed_line(job.rank, job.local_rank, f"{type(refused).__name__}: {refused}", first_server)
    try:
        first = publish_once(job.refusal, line + "\n")
    except (OSError, TrainscaleError):
        return
    if first and job.replica is None and job.launcher_pid:
        os.kill(job.launcher_pid, signal.SIGTERM)
    time.sleep(REFUSAL_WAIT_S)  # the launcher ends the job long before


def publish_once(path: Path, text: str) -> bool:
    """``text`` at ``path`` whole, unless something is there already (False): written beside it, then linked,
    which fails where the name exists, so a reader never sees part of it and a second writer never replaces it."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    atomic_write_text(partial, text)
    try:
        os.link(partial, path)
    except FileExistsError:
        return False
    finally:
        partial.unlink(missing_ok=True)
    return True
