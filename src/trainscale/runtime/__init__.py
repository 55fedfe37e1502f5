"""Everything that talks to torch.distributed lives here; the rest of trainscale calls these helpers,
which behave as rank 0 of a world of 1 when no process group exists."""

from trainscale.runtime.dist import (
    all_reduce_max,
    all_reduce_sum,
    barrier,
    broadcast_object,
    is_distributed,
    is_main_process,
    local_rank,
    rank,
    world_size,
)

__all__ = [
    "all_reduce_max",
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "is_distributed",
    "is_main_process",
    "local_rank",
    "rank",
    "world_size",
]
