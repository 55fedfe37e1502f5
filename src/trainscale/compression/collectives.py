"""The two collectives compression needs, with every byte counted; identity in a world of one.

Gloo facts this layer absorbs: all-gather needs equal sizes on every rank and hangs on empty tensors,
so callers pad and this layer never sends fewer than one element; mixed dtypes cannot share one
all-reduce, so tensors are coalesced into one flat buffer per dtype.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from trainscale.compression.stats import CompressionStats
from trainscale.runtime.comm_hooks import OverlapClock
from trainscale.runtime.dist import is_distributed

Future = torch.futures.Future


def done(value: Any) -> Future:
    """A future that already holds ``value`` (a world of one, or a method that cannot overlap)."""
    future: Future = torch.futures.Future()
    future.set_result(value)
    return future


@runtime_checkable
class Transport(Protocol):
    """What carries the collectives: a torch process group (``ProcessGroupTransport``) or a torchft quorum
    (``runtime.ft.QuorumTransport``). Both methods return a future that completes when the tensors hold the
    result; ``all_reduce`` sums in place."""

    def size(self) -> int: ...

    def rank(self) -> int: ...

    def all_reduce(self, flat: Tensor) -> Future: ...

    def all_gather(self, out: list[Tensor], source: Tensor) -> Future: ...


Carrier = Transport | dist.ProcessGroup | None  # a ``group=`` argument: None is torch.distributed's default group


class ProcessGroupTransport:
    """torch.distributed's collectives on ``group`` (WORLD when None); a world of one outside a process group."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def size(self) -> int:
        return dist.get_world_size(self.group) if is_distributed() else 1

    def rank(self) -> int:
        return dist.get_rank(self.group) if is_distributed() else 0

    def all_reduce(self, flat: Tensor) -> Future:
        return dist.all_reduce(flat, group=self.group, async_op=True).get_future()

    def all_gather(self, out: list[Tensor], source: Tensor) -> Future:
        return dist.all_gather(out, source, group=self.group, async_op=True).get_future()


class Communicator:
    """Counts what this rank hands to each collective into ``stats``. ``group``: a torch process group (WORLD
    when None) or a ``Transport`` (a fault-tolerant job's quorum).

    Collectives are launched asynchronously and return futures, so a DDP hook can hand DDP the future
    and let the exchange overlap the rest of the backward pass; ``clock`` (the hook's) records when each
    was in flight. Without a clock the time in flight is added to ``stats.comm_seconds`` directly.
    """

    def __init__(self, stats: CompressionStats, group: Carrier = None, clock: OverlapClock | None = None) -> None:
        self.stats = stats
        self.transport: Transport = group if isinstance(group, Transport) else ProcessGroupTransport(group)
        self.clock = clock

    @property
    def world_size(self) -> int:
        return self.transport.size()

    @property
    def rank(self) -> int:
        return self.transport.rank()

    def all_reduce_(self, tensors: list[Tensor]) -> None:
        """Sum ``tensors`` over ranks in place, one collective per dtype (contiguous tensors only)."""
        self.all_reduce_async_(tensors).wait()

    def all_reduce_async_(self, tensors: list[Tensor]) -> Future:
        """:meth:`all_reduce_`, launched; the future completes when every tensor holds its sum."""
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        futures = [self._all_reduce_group(group) for group in by_dtype.values()]
        return futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)

    def _all_reduce_group(self, tensors: list[Tensor]) -> Future:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if nbytes == 0:
            return done(None)  # every rank has the same layout, so every rank skips alike
        self.stats.add_collective("all_reduce", nbytes, self.world_size)
        if self.world_size == 1:
            return done(None)  # the sum over one rank: counted, nothing to copy
        single = len(tensors) == 1 and tensors[0].is_contiguous()
        flat = tensors[0].view(-1) if single else torch.cat([t.reshape(-1) for t in tensors])

        def unpack() -> None:
            if not single:
                for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                    t.copy_(part.view_as(t))

        return self._launch(lambda: self.transport.all_reduce(flat), unpack)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's ``tensor`` (same shape on all ranks), in rank order; padded to >= 1 element."""
        return self.all_gather_async(tensor).wait()

    def all_gather_async(self, tensor: Tensor) -> Future:
        """:meth:`all_gather`, launched; the future yields the list."""
        if tensor.numel() == 0:
            tensor = tensor.new_zeros(1)
        self.stats.add_collective("all_gather", tensor.numel() * tensor.element_size(), self.world_size)
        if self.world_size == 1:
            return done([tensor])
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        source = tensor.contiguous()
        return self._launch(lambda: self.transport.all_gather(out, source), lambda: out)

    def _launch(self, start: Callable[[], Any], finish: Callable[[], Any]) -> Future:
        """Run ``start()`` (an async collective's future), time it until it lands, then yield ``finish()``."""
        launched = time.perf_counter()
        future = start()

        def landed(_: Future) -> Any:
            _.value()  # raises here, in the future, if the collective failed
            if self.clock is not None:
                self.clock.landed(launched)
            else:
                self.stats.comm_seconds += time.perf_counter() - launched
            return finish()

        return future.then(landed)
