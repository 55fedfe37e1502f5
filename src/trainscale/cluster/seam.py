"""The one seam between an emulated cluster and a run: a Callbacks wrapper its workers install.

A node of `train --cluster` learns its cluster's facts from the launcher (``Job.cluster``, read at the entry:
name, hosts, rates, round trip, interface, CPU share, time dilation). The worker's composition root
(``app.run``) hands them here with the mode's callbacks and gets back what the Trainer calls; off a cluster it
gets the mode's callbacks unchanged. Everything a cluster adds to a run goes through this object: the kernel's
bytes on the wire (``cluster.wire``), the cluster's facts in summary.json, and on a time-dilated cluster the
run's figures projected to the cluster it stands for (``cluster.dilation.projected``). The engine
(``train.trainer``, ``train.loop``) knows nothing of namespaces or dilation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainscale.cluster.dilation import projected
from trainscale.cluster.wire import WireCounter
from trainscale.train.callbacks import Callbacks


class OnCluster(WireCounter):
    """The mode's callbacks on an emulated cluster: wire counters around each pass, facts and projection in the
    summary."""

    def derived_stats(self) -> list[Callable[[dict[str, Any]], dict[str, Any]]]:
        return [*self.inner.derived_stats(), projected]


def with_cluster(callbacks: Callbacks, steps_in_epoch: Callable[[int], int], facts: dict[str, Any] | None) -> Callbacks:
    """``callbacks`` as a run on the emulated cluster ``facts`` describes needs them (None: on no cluster);
    ``steps_in_epoch(epoch)``: the steps a worker takes in that epoch."""
    return OnCluster(callbacks, steps_in_epoch, facts) if facts else callbacks
