"""What each parameter-server worker trains and evaluates on.

Training: a worker's own shard (``DeviceBatches`` sharded by worker index and worker count), then its
share of dead workers' batches (``handover.py``), except in the ``--warm-start-epochs`` epochs, when the
main worker trains on the whole training set alone (Multiverso's warm start) and the others train on
nothing and wait at the epoch barrier.
Evaluation: the main worker evaluates the whole test set on the servers' parameters and the others
evaluate nothing, so a worker that dies takes no part of the test set with it. Every worker of node 0
holds the test set, since any of them may become the main worker (``MainOnly``).
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

from trainscale.data import Batches, DeviceBatches
from trainscale.data.sharding import train_shard_size
from trainscale.errors import ConfigError
from trainscale.modes.ps.handover import HandOver
from trainscale.modes.ps.optimizer import EpochClock
from trainscale.runtime.dist import is_main_process


class EmptyBatches:
    """No batches (an idle worker's epoch)."""

    num_samples = 0
    batch_size = 0

    def __len__(self) -> int:
        return 0

    def epoch(self, epoch: int) -> Iterator[Any]:
        return iter(())


def unsharded(batches: Batches) -> DeviceBatches:
    """The same in-memory batches as one world of one: every sample, same seeds and augmentation.

    A shallow copy sharing the device tensors; only the shard fields change (checked against a fresh
    one-process ``DeviceBatches`` by the unit tests).
    """
    base = getattr(batches, "inner", batches)  # a fault-injection wrapper keeps the real one as .inner
    if not isinstance(base, DeviceBatches):
        raise ConfigError("parameter-server modes need an in-memory dataset (cifar10, cifar100, synthetic)")
    view = copy.copy(base)
    view.rank, view.world_size = 0, 1
    view.shard_size = train_shard_size(base.total_samples, 1) if base.train else base.total_samples
    view._eval_start = 0
    return view


class MainOnly:
    """The test batches on whichever worker is the main one when an evaluation starts; none on the others."""

    def __init__(self, inner: Batches) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner) if is_main_process() else 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def epoch(self, epoch: int) -> Iterator[Any]:
        return self.inner.epoch(epoch) if is_main_process() else iter(())


class TrainBatches:
    """A worker's training batches per epoch (see the module docstring), timing its own pass.

    ``on_epoch(epoch, active)`` is called when an epoch starts (``active``: the workers training in it,
    None for all); ``finished`` holds (samples, seconds) of the worker's last pass, measured up to its
    last step, before it waits for anyone at the epoch's end. Each batch of the own shard is noted in
    ``client.covers`` for the push that commits it. ``progress`` is the fraction of the epoch the trainer
    sets the learning rate by: a hand-over batch counts as the epoch's last step.
    """

    def __init__(
        self,
        inner: Batches,
        clock: EpochClock,
        warm_epochs: int,
        is_main: bool,
        main: int,
        on_epoch: Callable[[int, tuple[int, ...] | None], None],
        client: Any,
        handover: HandOver | None = None,
    ) -> None:
        self.inner = inner
        self.clock = clock
        self.warm_epochs = warm_epochs
        self.main = main
        self.full = unsharded(inner) if warm_epochs and is_main else None
        self.is_main = is_main
        self.on_epoch = on_epoch
        self.client = client
        self.handover = handover
        self.finished = (0, 0.0)
        self.progress = 0.0

    def _source(self, epoch: int) -> Any:
        if epoch >= self.warm_epochs:
            return self.inner
        return self.full if self.is_main else EmptyBatches()

    def __len__(self) -> int:
        return len(self._source(self.clock.next_epoch))

    @property
    def num_samples(self) -> int:
        return self.inner.num_samples

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def epoch(self, epoch: int) -> Iterator[Any]:
        self.clock.next_epoch = epoch
        warm = epoch < self.warm_epochs
        self.on_epoch(epoch, (self.main,) if warm else None)
        own = self._own(self._source(epoch).epoch(epoch), len(self))
        if warm or self.handover is None:
            return self._timed(own)
        return self._timed(itertools.chain(own, self.handover.tail(epoch)))

    def _own(self, batches: Iterator[Any], steps: int) -> Iterator[Any]:
        for index, batch in enumerate(batches):
            self.client.covers.append((self.client.worker, index))
            self.progress = index / steps
            yield batch
        self.progress = (steps - 1) / steps if steps else 0.0

    def _timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        start, samples = time.perf_counter(), 0
        for images, labels in batches:
            yield images, labels
            samples += int(labels.shape[0])
        self.finished = (samples, time.perf_counter() - start)
