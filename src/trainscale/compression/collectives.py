"""The two collectives compression needs, with every byte counted; identity in a world of one.

Gloo facts this layer absorbs: all-gather needs equal sizes on every rank and hangs on empty tensors,
so callers pad and this layer never sends fewer than one element; mixed dtypes cannot share one
all-reduce, so tensors are coalesced into one flat buffer per dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from trainscale.compression.stats import CompressionStats
from trainscale.runtime.dist import is_distributed


class Communicator:
    """Counts what this rank hands to each collective into ``stats``; ``group`` defaults to WORLD."""

    def __init__(self, stats: CompressionStats, group: Any = None) -> None:
        self.stats = stats
        self.group = group

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if is_distributed() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if is_distributed() else 0

    def all_reduce_(self, tensors: list[Tensor]) -> None:
        """Sum ``tensors`` over ranks in place, one collective per dtype (contiguous tensors only)."""
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            self._all_reduce_group(group)

    def _all_reduce_group(self, tensors: list[Tensor]) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if nbytes == 0:
            return  # every rank has the same layout, so every rank skips alike
        self.stats.add_collective("all_reduce", nbytes, self.world_size)
        if self.world_size == 1:
            return  # the sum over one rank: counted, nothing to copy
        single = len(tensors) == 1 and tensors[0].is_contiguous()
        flat = tensors[0].view(-1) if single else torch.cat([t.reshape(-1) for t in tensors])
        with self.stats.timer("comm"):
            dist.all_reduce(flat, group=self.group)
        if not single:
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(part.view_as(t))

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's ``tensor`` (same shape on all ranks), in rank order; padded to >= 1 element."""
        if tensor.numel() == 0:
            tensor = tensor.new_zeros(1)
        self.stats.add_collective("all_gather", tensor.numel() * tensor.element_size(), self.world_size)
        if self.world_size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self.stats.timer("comm"):
            dist.all_gather(out, tensor.contiguous(), group=self.group)
        return out
