"""Which workers a server still waits for: alive, left (finished cleanly) or dead.

A server pings every live worker over RPC every ``heartbeat_s``. A dead process closes its TensorPipe
connections, so the ping fails at once with an EOF; a hung one fails after ``timeout_s``
(``--heartbeat-timeout``). Either way the worker is marked dead, logged once (and in the job's fault log),
and every listener (the shard's pending rounds and staleness waits, the coordinator's pending
collectives) re-checks what it was waiting for, so the remaining workers carry on instead of waiting
forever. Each server process runs its own monitor.

A worker marked dead stays out: one that was only slow or stopped and comes back gets ``WorkerDropped``
from every server it calls (its batches have been handed to others), and stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from torch.futures import Future

from trainscale.runtime.ft import log_event

log = logging.getLogger("trainscale.ps")


class WorkerDropped(RuntimeError):
    """Raised by a server to a worker it has already declared dead."""


def worker_name(index: int) -> str:
    return f"worker{index}"


def server_name(index: int) -> str:
    return f"server{index}"


def ping() -> bool:
    """Answered by a worker's RPC threads (the training thread is not involved)."""
    return True


class Membership:
    """Thread-safe worker states plus a ping monitor; listeners run after every change."""

    def __init__(self, workers: int, heartbeat_s: float = 1.0, timeout_s: float = 60.0) -> None:
        self.workers = workers
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self.dead: dict[int, str] = {}
        self.left: set[int] = set()
        self._listeners: list[Callable[[], None]] = []
        self._in_flight: set[int] = set()
        self._stop = threading.Event()
        self.changed = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    def alive(self) -> set[int]:
        with self._lock:
            return self._alive()

    def _alive(self) -> set[int]:
        return set(range(self.workers)) - set(self.dead) - self.left

    def refusal(self, worker: int) -> WorkerDropped | None:
        """The answer to a call from a worker already declared dead, else None. Handlers answer with it rather
        than raise it (the client raises it, see ``client.raised``): a raised one travels as a remote traceback."""
        with self._lock:
            reason = self.dead.get(worker)
        if reason is None:
            return None
        return WorkerDropped(
            f"worker {worker} was dropped from the job ({reason}); the others went on and took its batches"
        )

    def refused(self, worker: int) -> Future | None:
        """``refusal`` for a handler that answers with a Future: a failed one (it reaches the caller as the error
        object, as ``refusal``'s answer does), else None."""
        refusal = self.refusal(worker)
        if refusal is None:
            return None
        fut: Future = Future()
        fut.set_exception(refusal)
        return fut

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def mark_left(self, worker: int) -> None:
        self._change(lambda: self.left.add(worker))

    def mark_dead(self, worker: int, reason: str) -> None:
        with self._lock:
            if worker in self.dead or worker in self.left:
                return
        log.warning("worker %d is gone (%s); carrying on with the remaining workers", worker, reason)
        log_event("dead", worker=worker, reason=reason)
        self._change(lambda: self.dead.setdefault(worker, reason))

    def _change(self, update: Callable[[], object]) -> None:
        with self._lock:
            update()
            self.changed.notify_all()
        for listener in self._listeners:
            listener()

    def wait_all_gone(self) -> None:
        """Block until every worker has left or died (the server's serving loop)."""
        with self._lock:
            while self._alive():
                self.changed.wait(timeout=1.0)

    # -------------------------------------------------------------------------------- the monitor

    def start(self) -> None:
        self._thread = threading.Thread(target=self._monitor, name="ps-membership", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _monitor(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            for worker in sorted(self.alive()):
                with self._lock:
                    if worker in self._in_flight:
                        continue
                    self._in_flight.add(worker)
                self._ping(worker)

    def _ping(self, worker: int) -> None:
        import torch.distributed.rpc as rpc

        try:
            fut = rpc.rpc_async(worker_name(worker), ping, timeout=self.timeout_s)
        except Exception as exc:  # the agent is shutting down or the peer is unknown
            self._after_ping(worker, exc)
            return
        fut.add_done_callback(lambda f: self._after_ping(worker, _error_of(f)))

    def _after_ping(self, worker: int, error: BaseException | None) -> None:
        with self._lock:
            self._in_flight.discard(worker)
            finished = worker in self.left
        if error is not None and not finished and not self._stop.is_set():
            self.mark_dead(worker, f"ping failed: {first_line(error)}")


def _error_of(fut) -> BaseException | None:
    try:
        fut.wait()
    except Exception as exc:
        return exc
    return None


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
