"""Collectives among parameter-server workers, over RPC through server 0, that survive dead workers.

The trainer's barrier, all-reduces and broadcasts (``trainscale.runtime.dist``) run on the workers
only. A gloo group among them would fail for good on the first dead peer, so instead every worker
sends its n-th collective call to the coordinator (hosted by server 0) and gets the result back once
every *live* worker has sent its n-th call: a dead worker's missing contributions are simply not
waited for. Sums are taken in worker order, so every worker gets the same bits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future

from trainscale.modes.ps.membership import Membership

OPS = ("sum", "max", "min", "broadcast", "barrier")


class CollectiveError(RuntimeError):
    """A collective cannot complete (e.g. the source of a broadcast died before sending)."""


@dataclass
class Gather:
    op: str
    src: int | None
    values: dict[int, Any] = field(default_factory=dict)
    futures: dict[int, Future] = field(default_factory=dict)


class Coordinator:
    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.lock = threading.Lock()
        self.pending: dict[int, Gather] = {}
        membership.subscribe(self.on_membership_change)

    def contribute(self, worker: int, seq: int, op: str, value: Any, src: int | None = None) -> Future:
        if op not in OPS:
            raise ValueError(f"unknown collective {op!r}")
        fut: Future = Future()
        with self.lock:
            gather = self.pending.setdefault(seq, Gather(op, src))
            if gather.op != op:
                fut.set_exception(CollectiveError(f"collective #{seq}: worker {worker} called {op}, others "
                                                  f"{gather.op} (workers out of step)"))
                return fut
            gather.values[worker] = value
            gather.futures[worker] = fut
            done = self._take_complete()
        _finish(done)
        return fut

    def on_membership_change(self) -> None:
        with self.lock:
            done = self._take_complete()
        _finish(done)

    def _take_complete(self) -> list[Gather]:
        alive = self.membership.alive()
        done = [seq for seq, g in self.pending.items() if alive <= set(g.values)]
        return [self.pending.pop(seq) for seq in done]


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


def _finish(done: list[Gather]) -> None:
    for gather in done:
        try:
            value, error = result_of(gather), None
        except CollectiveError as exc:
            value, error = None, exc
        for fut in gather.futures.values():
            if error is None:
                fut.set_result(value)
            else:
                fut.set_exception(error)
