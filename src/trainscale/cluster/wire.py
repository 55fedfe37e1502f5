"""Bytes on the wire as the kernel counts them, for runs on an emulated cluster (``train --cluster``).

trainscale's own ``bytes_sent_per_step`` is what a worker hands to its collectives; what a host's network
interface really sends is larger (TCP/IP headers, gloo's framing, acknowledgements, the size exchanges of
variable-size methods) or a multiple of it (a ring all-reduce sends 2(W-1)/W of the buffer). On an
emulated host every process of the host shares one interface, so its counters are exactly the host's
traffic. ``WireCounter`` reads them around each epoch's training pass only (not evaluation, checkpoints
or start-up) and records, per step, the mean over hosts (under ``--fault-tolerance`` each replica is a world
of its own: the host of the replica that writes the run folder).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainscale.record import K
from trainscale.runtime.dist import all_reduce_sum, barrier, world_size
from trainscale.runtime.network import interface_counters
from trainscale.train.callbacks import Callbacks, Forwarding


class WireCounter(Forwarding):
    """Wraps a mode's callbacks: the interface counters are read right after the mode's epoch set-up and
    right after the pass, before the mode's own end-of-epoch exchange, each time behind a barrier. A
    sender's collective can return while its last bytes still wait in the socket and the shaper (the
    initial parameter broadcast from rank 0: a whole model); once every rank has reached the barrier they
    have all been received, so they are counted in the window they belong to, on both sides."""

    def __init__(self, inner: Callbacks, steps_in_epoch: Callable[[int], int], facts: dict[str, Any]) -> None:
        super().__init__(inner)
        self.steps_in_epoch, self.facts = steps_in_epoch, facts
        self.steps = 1
        self.start = (0, 0)
        self.epochs: list[tuple[float, float]] = []

    def before_train_epoch(self, epoch: int) -> None:
        self.inner.before_train_epoch(epoch)
        self.steps = max(1, self.steps_in_epoch(epoch))
        barrier()
        self.start = interface_counters(self.facts["interface"])

    def after_train_epoch(self, model: nn.Module) -> None:
        barrier()
        sent, received = interface_counters(self.facts["interface"])
        mine = torch.tensor(
            [(sent - self.start[0]) / self.steps, (received - self.start[1]) / self.steps], dtype=torch.float64
        )
        mean = all_reduce_sum(mine) / world_size()  # every host has the same number of workers
        self.epochs.append((float(mean[0]), float(mean[1])))
        self.inner.after_train_epoch(model)

    def epoch_stats(self) -> dict[str, Any]:
        stats = self.inner.epoch_stats()
        if self.epochs:
            stats[K.wire_bytes_sent_per_step], stats[K.wire_bytes_received_per_step] = self.epochs[-1]
        return stats

    def run_stats(self) -> dict[str, Any]:
        stats = {**self.inner.run_stats(), K.cluster: self.facts}
        if self.epochs:
            stats[K.wire_bytes_sent_per_step] = statistics.fmean(e[0] for e in self.epochs)
            stats[K.wire_bytes_received_per_step] = statistics.fmean(e[1] for e in self.epochs)
        return stats
