"""Collective helpers that are safe without a process group (rank 0, world 1).

The training loop calls these unconditionally, so local and data-parallel runs share one code path. They
are no-ops only when the process really is alone: when the environment says it is one of several
(WORLD_SIZE > 1, as every launcher sets) but no process group was joined, they raise instead of
silently returning the local value (which would make each rank report its own figures as the job's).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Collectives(Protocol):
    """A mode's own collectives in place of torch.distributed's default group: parameter-server workers
    use RPC ones (trainscale.modes.ps.client.RpcCollectives) that survive dead workers."""

    def rank(self) -> int: ...

    def world_size(self) -> int: ...

    def barrier(self) -> None: ...

    def all_reduce(self, values: torch.Tensor, op: Any) -> torch.Tensor: ...

    def broadcast_object(self, obj: Any, src: int) -> Any: ...


_collectives: Collectives | None = None


def restart_count() -> int:
    """How often torch's elastic agent has restarted this job's workers (0 on the first attempt, and outside one)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def use_collectives(impl: Collectives | None) -> None:
    """Route every helper below through ``impl`` (None: back to torch.distributed's default group)."""
    global _collectives
    _collectives = impl


class NoProcessGroup(RuntimeError):
    """The launcher's environment says distributed, but this process never joined the group."""


def is_distributed() -> bool:
    """True inside a process group (or a mode's own collectives); False for a process that is alone.
    Raises NoProcessGroup when WORLD_SIZE > 1 but no group exists (a missing ``process_group()``)."""
    if _collectives is not None:
        return True
    if dist.is_available() and dist.is_initialized():
        return True
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1:
        raise NoProcessGroup(
            f"WORLD_SIZE={launched} says this process is one of {launched}, but it has not joined "
            "a process group: enter trainscale.runtime.process_group() (or the mode's session) "
            "before calling collective helpers"
        )
    return False


def rank() -> int:
    if _collectives is not None:
        return _collectives.rank()
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    if _collectives is not None:
        return _collectives.world_size()
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    """The rank on this node, as set by torch.distributed.run (0 when not launched by it)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


_main_rank = 0


def main_rank() -> int:
    """The rank that owns the run folder and prints: 0, unless a mode elected another (see ``elect_main_rank``)."""
    return _main_rank if is_distributed() else 0


def set_main_rank(value: int) -> None:
    global _main_rank
    _main_rank = value


def is_main_process() -> bool:
    return rank() == main_rank()


def barrier() -> None:
    if _collectives is not None:
        _collectives.barrier()
    elif is_distributed():
        dist.barrier()


def _reduce(values: torch.Tensor, op: Any) -> torch.Tensor:
    if not is_distributed():
        return values
    if _collectives is not None:
        return _collectives.all_reduce(values, op)
    out = values.detach().clone()
    if out.device.type == "cpu" and dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
        moved = out.cuda()
        dist.all_reduce(moved, op=op)
        return moved.cpu()
    dist.all_reduce(out, op=op)
    return out


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` over ranks (a copy); the tensor itself when not distributed."""
    return _reduce(values, dist.ReduceOp.SUM if is_distributed() else None)


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """Element-wise max over ranks, e.g. the slowest rank's epoch time or the largest peak memory."""
    return _reduce(values, dist.ReduceOp.MAX if is_distributed() else None)


def all_reduce_min(values: torch.Tensor) -> torch.Tensor:
    """Element-wise min over ranks."""
    return _reduce(values, dist.ReduceOp.MIN if is_distributed() else None)


def any_rank(flag: torch.Tensor) -> bool:
    """Whether ``flag`` (a one-element bool tensor) is set on any rank, so all ranks take the same branch:
    one all-reduce of one number when distributed, and a read to the host (a sync on a GPU) always."""
    return bool(all_reduce_max(flag.detach().reshape(1).float()).item())


def job_restarted() -> bool:
    """Whether torch's elastic agents restarted this job's workers, the same answer on every rank (a collective
    when distributed). One process's ``restart_count`` cannot say on several nodes: an agent whose own workers
    did not fail restarts them for the new rendezvous round with its count unchanged (0)."""
    return any_rank(torch.tensor(restart_count() > 0))


def broadcast_object(obj: Any, src: int | None = None) -> Any:
    """Rank ``src``'s ``obj`` (default: the main rank's) on every rank; ``obj`` itself when not distributed."""
    if not is_distributed():
        return obj
    if _collectives is not None:
        return _collectives.broadcast_object(obj, main_rank() if src is None else src)
    box = [obj]
    dist.broadcast_object_list(box, src=main_rank() if src is None else src)
    return box[0]


def average_in_place(tensors: list[torch.Tensor]) -> None:
    """Replace each tensor by its mean over ranks, with one all-reduce of them all (in float64, so every
    rank rounds alike); a no-op when not distributed or when ``tensors`` is empty."""
    if not tensors or world_size() == 1:
        return
    flat = all_reduce_sum(torch.cat([t.detach().reshape(-1).double() for t in tensors])) / world_size()
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def broadcast_tensors(tensors: list[torch.Tensor], src: int | None = None) -> None:
    """Overwrite ``tensors`` in place with rank ``src``'s (default: the main rank's); a no-op when not
    distributed. For modes without DDP, whose replicas must start from the same weights."""
    if not is_distributed():
        return
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=main_rank() if src is None else src)


def elect_main_rank(candidate: bool) -> int:
    """Make the lowest-ranked candidate the main process, and return its rank.

    The c10d rendezvous numbers nodes in an order of its own, so global rank 0 may live on any node.
    Trainscale wants the run folder on the node the user called node 0 (where ``--out`` and the
    checkpoint to resume from are): each worker says whether it is that node's first worker, and
    the lowest such rank wins. With no candidate at all, rank 0 stays main.
    """
    me = torch.tensor([rank() if candidate else world_size()], dtype=torch.int64)
    chosen = int(all_reduce_min(me).item())
    set_main_rank(chosen if chosen < world_size() else 0)
    return main_rank()


@contextlib.contextmanager
def quiet_unless_main() -> Iterator[None]:
    """Only the main process logs progress (every rank computes the same epoch line); warnings still show."""
    logger = logging.getLogger("trainscale")
    level = logger.level
    if not is_main_process():
        logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)
