"""A dead worker's batches go to the live workers, so an epoch skips no sample when a worker dies.

Every push tells server 0 which batches it commits, as (owner, batch) pairs: the batch just trained
(``async``, ``ps-sync``), or every local step since the last average (``ma``). Server 0's ``Ledger``
keeps them per epoch. A worker that has trained its own shard asks for a hand-over ``Plan``: a
collective through the coordinator that completes once every worker has asked or been found dead, so
a death just before the end is still seen. The plan deals the batches of the dead workers' shards that
no push committed round-robin to the live workers, in index order; each trains its share (the owner's
augmentation of that epoch: the same images, crops and flips the owner would have trained on) as
extra steps of the epoch, then asks again, until a plan is empty. A worker that dies during its share
leaves those batches uncommitted, so the next plan deals them again.

What this guarantees: every batch of every worker's shard is committed at least once per epoch while one
worker lives (and the main worker, which writes the run folder, does). A batch whose push was in flight
as its worker died may be committed twice; in ``ma`` a dead worker's local steps since its last average
are lost and trained again by others (they were never pushed). Warm-start epochs train on the main
worker alone and hand nothing over.

Rounds (``ps-sync``, ``ma``) and the staleness bound need every worker to agree on step numbers and on
who trains each step: the plan carries the step to go on from (the highest any live worker reached)
and, for the k-th extra step, the workers that have one (``active_at``).
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from trainscale.data import DeviceBatches
from trainscale.runtime.ft import log_event

log = logging.getLogger("trainscale.ps")

Batch = tuple[int, int]  # (owner worker, batch index in the owner's shard of the epoch)


@dataclass(frozen=True)
class Plan:
    """One hand-over: the live workers (in index order), the orphaned batches, the step to go on from."""

    epoch: int
    base_step: int
    live: tuple[int, ...]
    orphans: tuple[Batch, ...]

    def mine(self, worker: int) -> list[Batch]:
        """The batches dealt to ``worker``: every ``len(live)``-th orphan from its place among the live."""
        if worker not in self.live:
            return []
        return list(self.orphans[self.live.index(worker) :: len(self.live)])

    def active_at(self, k: int) -> tuple[int, ...]:
        """The workers that train an extra step ``k`` (0-based): those dealt more than ``k`` batches."""
        left = len(self.orphans) - k * len(self.live)
        return self.live[: max(0, min(len(self.live), left))]


class Ledger:
    """Server 0's record of the batches pushes committed, per epoch (older epochs are dropped)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: dict[int, set[Batch]] = {}
        self.handed_over = 0

    def commit(self, epoch: int, batches: Iterable[Batch]) -> None:
        with self.lock:
            self.done.setdefault(epoch, set()).update((owner, index) for owner, index in batches)
            for old in [e for e in self.done if e < epoch - 1]:
                del self.done[old]

    def committed(self, epoch: int) -> int:
        """Distinct batches of ``epoch`` that pushes committed (every batch of the epoch, when no sample is
        skipped)."""
        with self.lock:
            return len(self.done.get(epoch, ()))

    def plan(
        self, epoch: int, batches_per_worker: int, base_step: int, live: Iterable[int], dead: Iterable[int]
    ) -> Plan:
        """The hand-over of ``epoch``: the batches of ``dead`` workers' shards not committed yet."""
        with self.lock:
            done = self.done.get(epoch, set())
            orphans = tuple((d, b) for d in sorted(dead) for b in range(batches_per_worker) if (d, b) not in done)
            self.handed_over += len(orphans)
        plan = Plan(epoch, base_step, tuple(sorted(live)), orphans)
        if orphans:
            owners = sorted({owner for owner, _ in orphans})
            log.warning(
                "epoch %d: handing %d uncommitted batch(es) of dead worker(s) %s over to worker(s) %s",
                epoch + 1,
                len(orphans),
                ", ".join(map(str, owners)),
                ", ".join(map(str, plan.live)),
            )
            log_event("handover", epoch=epoch + 1, batches=len(orphans), owners=owners, live=list(plan.live))
        return plan


def owner_view(batches: DeviceBatches, owner: int) -> DeviceBatches:
    """``batches`` (a worker's ``DeviceBatches``) as worker ``owner``'s shard: a shallow copy sharing the data."""
    view = copy.copy(batches)
    view.rank = owner
    return view


class HandOver:
    """A worker's side: after its own shard, train the plans' shares until a plan is empty.

    ``ask(epoch, batches, step)`` is the plan collective; ``optimizer.flush(active)`` makes ``ma`` push its local
    steps (a no-op for the other rules) so that the ledger holds them before the next plan, and
    ``optimizer.holding`` keeps ``ma`` from averaging in the middle of a share (shares differ in length, so the
    workers would not meet); ``client`` is the worker's ``ShardClient`` (its ``step``, ``active`` and ``covers``
    are set here).
    """

    def __init__(
        self, worker: int, batches: Any, client: Any, ask: Callable[[int, int, int], Plan], optimizer: Any
    ) -> None:
        self.worker = worker
        self.batches = batches
        self.client = client
        self.ask = ask
        self.optimizer = optimizer
        self.trained = 0  # batches of other workers' shards this worker trained, since the last reset

    def tail(self, epoch: int) -> Iterator[Any]:
        """The extra batches of ``epoch`` (each yielded after the previous one's step was taken)."""
        views: dict[int, list[Callable[[], Any]]] = {}
        flush_for: tuple[int, ...] | None = None
        try:
            while True:
                self.optimizer.flush(flush_for)
                self.optimizer.holding = True
                plan = self.ask(epoch, len(self.batches), self.client.step)
                if not plan.orphans:
                    return
                self.client.step = plan.base_step
                for k, (owner, index) in enumerate(plan.mine(self.worker)):
                    if owner not in views:
                        views[owner] = list(owner_view(self.batches, owner).lazy_epoch(epoch))
                    self.client.active = plan.active_at(k)
                    self.client.covers.append((owner, index))
                    self.trained += 1
                    yield views[owner][index]()
                flush_for = plan.active_at(0)
        finally:
            self.client.active = None
            self.optimizer.holding = False
