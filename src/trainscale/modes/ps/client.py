"""A worker's side of the parameter server: push to and pull from every shard concurrently.

Each call sends one ``rpc_async`` per shard and then waits for all of them, so S shards move their
slices in parallel. Failures become one ``PSError`` naming the shard: a dead server closes its
connection (an immediate EOF), a hung one runs into ``--rpc-timeout``; either way the worker stops
with that message instead of hanging, and the launcher ends the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed.rpc as rpc
from torch import Tensor

from trainscale.modes.ps import handlers
from trainscale.modes.ps.codec import PushCodec, payload_nbytes
from trainscale.modes.ps.coordinator import CollectiveError
from trainscale.modes.ps.handover import Plan
from trainscale.modes.ps.membership import WorkerDropped, first_line, server_name
from trainscale.modes.ps.server import Rule
from trainscale.modes.ps.shards import join, shard_bounds, split
from trainscale.modes.ps.stats import WorkerStats
from trainscale.runtime.ft import log_event
from trainscale.runtime.worker_errors import PeerLost

log = logging.getLogger("trainscale.ps")


class PSError(RuntimeError):
    """The parameter server cannot be reached or refused a request."""


class ServerLost(PSError, PeerLost):
    """A server (or the coordinator) stopped answering: the failure is that server's, not this worker's."""


class Dropped(PSError):
    """The servers declared this worker dead (it stopped answering for a while) and went on without it."""


def dropped(exc: BaseException) -> Dropped | None:
    """The ``Dropped`` error a server's ``WorkerDropped`` answer means, else None."""
    return Dropped(first_line(exc)) if isinstance(exc, WorkerDropped) or "WorkerDropped" in str(exc) else None


def raised(answer: Any) -> Any:
    """An answer, or the exception it is: a handler run with ``async_execution`` whose Future failed comes back
    as the exception object, not raised."""
    if isinstance(answer, BaseException):
        raise answer
    return answer


class ShardClient:
    """Push/pull through ``servers`` shards of a ``numel``-element vector, with timings and byte counts."""

    def __init__(self, worker: int, servers: int, numel: int, timeout_s: float, codec: PushCodec | None = None) -> None:
        self.worker = worker
        self.names = [server_name(s) for s in range(servers)]
        self.bounds = shard_bounds(numel, servers)
        self.timeout_s = timeout_s
        self.versions = [0] * servers
        self.epoch = 0
        self.step = 0
        self.active: tuple[int, ...] | None = None
        self.stats = WorkerStats()
        self.last_staleness = 0
        self.codec = codec
        self.covers: list[tuple[int, int]] = []  # batches the next push commits (see handover.py)

    def begin_epoch(self, epoch: int, active: tuple[int, ...] | None) -> None:
        """Steps are counted per epoch; ``active`` (None = every live worker) is who trains in it."""
        self.epoch, self.step, self.active = epoch, 0, active

    def _call(self, fn: Any, args_of: Any, what: str, timeout: float | None = None) -> list[Any]:
        timeout = self.timeout_s if timeout is None else timeout
        futures = []
        for s, name in enumerate(self.names):
            try:
                futures.append(rpc.rpc_async(name, fn, args=args_of(s), timeout=timeout))
            except Exception as exc:
                raise self._error(s, what, exc) from None
        results = []
        for s, fut in enumerate(futures):
            try:
                results.append(raised(fut.wait()))
            except Exception as exc:
                raise self._error(s, what, exc) from None
        return results

    def _error(self, shard: int, what: str, exc: BaseException) -> PSError:
        if (error := dropped(exc)) is not None:
            return error
        log_event("server_lost", shard=shard)
        return ServerLost(
            f"lost parameter server {shard} ({self.names[shard]}) during {what}: {first_line(exc)} "
            f"(it died, hung past --rpc-timeout {self.timeout_s:g} s, or raised; see its log)"
        )

    def initialize(self, flat: Tensor, rule: Rule) -> None:
        pieces = split(flat.detach().cpu().float(), self.bounds)
        self._call(handlers.initialize, lambda s: (pieces[s], rule), "initialisation")

    def push(self, flat: Tensor, lr: float) -> None:
        """Send this step's gradient (or, for model averaging, parameter change) to every shard."""
        start = time.perf_counter()
        pieces = split(flat.detach().cpu().float(), self.bounds)
        if self.codec is not None:
            pieces = self.codec.encode(pieces, self.epoch)
        covers, self.covers = tuple(self.covers), []
        staleness = self._call(
            handlers.push,
            lambda s: (
                self.worker,
                self.epoch,
                self.step,
                pieces[s],
                float(lr),
                self.versions[s],
                self.active,
                covers if s == 0 else (),
            ),
            "push",
        )
        self.stats.push_seconds += time.perf_counter() - start
        self.stats.bytes_pushed += sum(payload_nbytes(p) for p in pieces)
        self.stats.dense_bytes_pushed += 4 * flat.numel()
        self.stats.pushes += 1
        self.step += 1
        self.last_staleness = max(staleness)

    def pull(self, wait: bool = True) -> Tensor:
        """The current parameters; with ``wait`` (a training step's pull) the servers first apply the
        staleness bound or finish the step's round, and the call is counted in the step statistics: the
        seconds the servers held the answer as wait, the rest as pull. Without, it is answered at once
        and not counted (the start and epoch-end synchronisations)."""
        step = self.step if wait else None
        start = time.perf_counter()
        answers = self._call(handlers.pull, lambda s: (self.worker, self.epoch, step, self.active), "pull")
        elapsed = time.perf_counter() - start
        waited = max(a[2] for a in answers)
        self.versions = [a[1] for a in answers]
        pieces = [a[0] for a in answers]
        if not wait:
            return join(pieces)
        self.stats.pull_seconds += max(0.0, elapsed - waited)
        self.stats.wait_seconds += waited
        self.stats.bytes_pulled += sum(p.numel() * p.element_size() for p in pieces)
        return join(pieces)

    def fetch_state(self) -> list[dict[str, Any]]:
        return self._call(handlers.state, lambda s: (), "checkpoint")

    def restore(self, states: Sequence[dict[str, Any]]) -> None:
        if len(states) != len(self.names):
            raise PSError(
                f"the checkpoint holds {len(states)} server shard(s), this job has {len(self.names)}; "
                "resume with the same --servers (and --nnodes)"
            )
        self._call(handlers.load_state, lambda s: (states[s],), "resume")

    def run_totals(self) -> list[dict[str, Any]]:
        return self._call(handlers.run_totals, lambda s: (), "statistics")

    def take_stats(self) -> list[dict[str, Any]]:
        return self._call(handlers.take_stats, lambda s: (self.epoch,), "statistics")

    def leave(self) -> None:
        """Tell every server this worker finished cleanly (so it is not mistaken for a dead one).

        A server shuts down as soon as the last worker's notice arrives, possibly before its answer is
        sent, so a failed answer here is expected and harmless: all work is done and checkpointed.
        """
        try:
            self._call(handlers.leave, lambda s: (self.worker,), "leave")
        except PSError as exc:
            log.debug("leaving: %s", exc)


class RpcCollectives:
    """``trainscale.runtime.dist``'s collectives for PS workers, through the coordinator on server 0.

    Installed with ``dist.use_collectives`` for the worker's session: ``rank()``/``world_size()`` are
    the worker's index and the number of workers, so data sharding and the run folder follow workers,
    not server processes. Collectives wait without a timeout: a slow worker is legitimate (warm-start
    epochs last a whole epoch); a dead one is dropped by the coordinator, a dead coordinator is an EOF.
    """

    def __init__(self, worker: int, workers: int, coordinator: str = server_name(0)) -> None:
        self.worker = worker
        self.workers = workers
        self.coordinator = coordinator
        self.seq = 0

    def rank(self) -> int:
        return self.worker

    def world_size(self) -> int:
        return self.workers

    def _run(self, op: str, value: Any, src: int | None = None) -> Any:
        self.seq += 1
        try:
            return raised(
                rpc.rpc_sync(
                    self.coordinator, handlers.collective, args=(self.worker, self.seq, op, value, src), timeout=0
                )
            )
        except Exception as exc:
            if (error := dropped(exc)) is not None:
                raise error from None
            if "CollectiveError" in str(exc) or isinstance(exc, CollectiveError):  # the coordinator is alive
                raise PSError(f"collective {op} failed: {first_line(exc)}") from None
            log_event("server_lost", shard=0)
            raise ServerLost(
                f"lost parameter server 0 ({self.coordinator}, the workers' coordinator) during {op}: {first_line(exc)}"
            ) from None

    def barrier(self) -> None:
        self._run("barrier", None)

    def all_reduce(self, values: Tensor, op: Any) -> Tensor:
        import torch.distributed as dist

        names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}
        name = next((n for o, n in names.items() if o == op), None)
        if name is None:
            raise ValueError(f"parameter-server collectives support SUM, MAX and MIN, not {op}")
        out = self._run(name, values.detach().cpu())
        return out.to(values.device)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return self._run("broadcast", obj if self.worker == src else None, src)

    def plan(self, epoch: int, batches: int, step: int) -> Plan:
        """The hand-over plan of ``epoch`` (see handover.py): every live worker gets the same one."""
        return self._run("plan", (epoch, batches, step))
