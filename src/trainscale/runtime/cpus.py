"""How many cores this process may use, and how a node's cores are split over its worker processes."""

from __future__ import annotations

import ctypes
import ctypes.util
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


OVERSUBSCRIBED = 2  # processes per core above which a CPU job spends more time switching than training


def oversubscription(processes: int, cores: int | None = None) -> str | None:
    """A warning when ``processes`` CPU processes of one node are far more than its cores (each then gets a
    fraction of a core, and the job measures the scheduler, not the training), else None."""
    cores = cores or cpu_count()
    if processes <= OVERSUBSCRIBED * cores:
        return None
    return (
        f"{processes} worker and server processes share {cores} core(s) on this machine: each gets "
        f"{cores / processes:.2f} of a core, so times measure contention; use fewer --workers, or an emulated "
        "cluster (trainscale cluster) to give each host its own CPU share"
    )


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep what the process frees (no mmap for large blocks, no trimming of the heap), so
    a step's activations reuse the last step's pages instead of faulting fresh zero pages in each time: on a
    2-core CPU those faults cost airbench94 10-29% of its img/s (more at larger batches). The resident set stays
    at its peak. Returns whether it took effect (False off glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
