"""Collective helpers that are safe without a process group (rank 0, world 1).

The training loop calls these unconditionally, so local and data-parallel runs share one code path.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    """The rank on this node, as set by torch.distributed.run (0 when not launched by it)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main_process() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def _reduce(values: torch.Tensor, op: Any) -> torch.Tensor:
    if not is_distributed():
        return values
    out = values.detach().clone()
    dist.all_reduce(out, op=op)
    return out


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` over ranks (a copy); the tensor itself when not distributed."""
    return _reduce(values, dist.ReduceOp.SUM if is_distributed() else None)


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """Element-wise max over ranks, e.g. the slowest rank's epoch time or the largest peak memory."""
    return _reduce(values, dist.ReduceOp.MAX if is_distributed() else None)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (``obj`` itself when not distributed)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
