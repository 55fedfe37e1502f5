"""How many cores this process may use, and how a node's cores are split over its worker processes."""

from __future__ import annotations

import os


def cpu_count() -> int:
    """Cores this process may use (the affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_worker(threads: int | None, local_workers: int) -> int:
    """``threads`` (``--threads``) when given, else the node's cores split evenly over its workers
    (torchrun's default of one thread per worker would leave most cores idle)."""
    return threads or max(1, cpu_count() // max(1, local_workers))
