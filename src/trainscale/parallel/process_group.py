"""The only place trainscale creates and destroys torch.distributed process groups.

Workers are started by torch.distributed.run (torchrun), which sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; ``process_group()`` joins that group and always tears it down, so a
failing worker never leaves a half-open group behind.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from typing import Iterator

import torch
import torch.distributed as dist

from trainscale.errors import ConfigError

log = logging.getLogger("trainscale.parallel")

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 300.0


def launched_by_torchrun() -> bool:
    """True inside a worker started by torch.distributed.run (or anything setting the same variables)."""
    return all(v in os.environ for v in LAUNCH_VARS)


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def worker_device(requested: torch.device) -> torch.device:
    """One GPU per worker: CUDA workers use ``cuda:LOCAL_RANK`` (after CUDA_VISIBLE_DEVICES)."""
    if requested.type != "cuda":
        return requested
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if index >= torch.cuda.device_count():
        raise ConfigError(f"local rank {index} has no GPU: only {torch.cuda.device_count()} visible; "
                          "start at most one worker per GPU")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


@contextlib.contextmanager
def process_group(device: torch.device, backend: str | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[str]:
    """Join the launcher's process group for the body of the ``with``; yields the backend name.

    ``timeout_s`` bounds every collective, so a dead peer ends the job with an error instead of a hang.
    Without launcher variables this is a no-op (world of 1), so callers need no branch.
    """
    if not launched_by_torchrun() or dist.is_initialized():
        yield backend or default_backend(device)
        return
    backend = backend or default_backend(device)
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("--backend nccl needs CUDA devices; use gloo on the CPU")
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    log.debug("joined process group: backend %s, rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
    try:
        yield backend
    finally:
        dist.destroy_process_group()
