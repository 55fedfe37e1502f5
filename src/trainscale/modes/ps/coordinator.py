"""Collectives among parameter-server workers, over RPC through server 0, that survive dead workers.

The trainer's barrier, all-reduces and broadcasts (``trainscale.runtime.dist``) run on the workers
only. A gloo group among them would fail for good on the first dead peer, so instead every worker
sends its n-th collective call to the coordinator (hosted by server 0) and gets the result back once
every *live* worker has sent its n-th call: a dead worker's missing contributions are simply not
waited for. Sums are taken in worker order, so every worker gets the same bits. The ``plan`` collective
deals a dead worker's uncommitted batches to the live ones (see ``handover.py``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future

from trainscale.modes.ps.handover import Ledger
from trainscale.modes.ps.membership import Membership

OPS = ("sum", "max", "min", "broadcast", "barrier", "plan")


class CollectiveError(RuntimeError):
    """A collective cannot complete (e.g. the source of a broadcast died before sending)."""


@dataclass
class Gather:
    op: str
    src: int | None
    values: dict[int, Any] = field(default_factory=dict)
    futures: dict[int, Future] = field(default_factory=dict)


class Coordinator:
    def __init__(self, membership: Membership, ledger: Ledger | None = None) -> None:
        self.membership = membership
        self.ledger = ledger or Ledger()
        self.lock = threading.Lock()
        self.pending: dict[int, Gather] = {}
        membership.subscribe(self.on_membership_change)

    def contribute(self, worker: int, seq: int, op: str, value: Any, src: int | None = None) -> Future:
        if op not in OPS:
            raise ValueError(f"unknown collective {op!r}")
        refused = self.membership.refused(worker)  # dropped (e.g. hung past the heartbeat): the others went on
        if refused is not None:
            return refused
        fut: Future = Future()
        with self.lock:
            gather = self.pending.setdefault(seq, Gather(op, src))
            if gather.op != op:
                fut.set_exception(
                    CollectiveError(
                        f"collective #{seq}: worker {worker} called {op}, others {gather.op} (workers out of step)"
                    )
                )
                return fut
            gather.values[worker] = value
            gather.futures[worker] = fut
            done = self._take_complete()
        self._finish(done)
        return fut

    def on_membership_change(self) -> None:
        with self.lock:
            done = self._take_complete()
        self._finish(done)

    def _take_complete(self) -> list[Gather]:
        alive = self.membership.alive()
        done = [seq for seq, g in self.pending.items() if alive <= set(g.values)]
        return [self.pending.pop(seq) for seq in done]

    def _finish(self, done: list[Gather]) -> None:
        for gather in done:
            try:
                value, error = self._result(gather), None
            except CollectiveError as exc:
                value, error = None, exc
            for fut in gather.futures.values():
                if error is None:
                    fut.set_result(value)
                else:
                    fut.set_exception(error)

    def _result(self, gather: Gather) -> Any:
        if gather.op != "plan":
            return result_of(gather)
        values = list(gather.values.values())  # (epoch, batches per worker, the worker's step)
        epoch, batches = values[0][0], values[0][1]
        live = set(gather.values) & self.membership.alive()
        return self.ledger.plan(epoch, batches, max(v[2] for v in values), live, self.membership.dead)


def result_of(gather: Gather) -> Any:
    """The collective's result from the contributions of the workers that made it."""
    if gather.op == "barrier":
        return None
    if gather.op == "broadcast":
        if gather.src not in gather.values:
            raise CollectiveError(f"broadcast source worker {gather.src} died before sending")
        return gather.values[gather.src]
    stacked = torch.stack([gather.values[w] for w in sorted(gather.values)])
    if gather.op == "sum":
        return stacked.sum(dim=0)
    return stacked.amax(dim=0) if gather.op == "max" else stacked.amin(dim=0)
