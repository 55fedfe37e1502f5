"""Closed-form collective costs (the alpha-beta model): seconds for ``nbytes`` over links of ``bandwidth``
bytes/s and ``latency`` seconds per message.

Every collective here is the algorithm gloo and NCCL run on a flat group, bounded by its slowest link
(BytePS paper, section 2): a ring all-reduce sends 2(n-1)/n of the buffer over every link in 2(n-1)
rounds; a ring all-gather of a p-byte payload per worker sends (n-1)p in n-1 rounds; a parameter server
with k shards (not on the workers' hosts) is bound by the worker's link (M) or the servers' (nM/k).
Pure functions: no torch, no measurement, so the unit tests can check them on hand-computed cases.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One direction of a full-duplex link: ``bandwidth`` in bytes/s, ``latency`` in seconds."""

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"a link needs a positive bandwidth, got {self.bandwidth}")
        if self.latency < 0:
            raise ValueError(f"a link's latency cannot be negative, got {self.latency}")

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return nbytes / self.bandwidth + messages * self.latency


def ring_allreduce(nbytes: float, workers: int, link: Link) -> float:
    """Reduce-scatter then all-gather around a ring: 2(n-1)/n x M / B + 2(n-1) x alpha."""
    if workers <= 1:
        return 0.0
    return link.seconds(2.0 * (workers - 1) / workers * nbytes, 2 * (workers - 1))


def ring_allgather(nbytes: float, workers: int, link: Link) -> float:
    """Every worker ends with all n payloads of ``nbytes``: (n-1) x p / B + (n-1) x alpha."""
    if workers <= 1:
        return 0.0
    return link.seconds((workers - 1) * nbytes, workers - 1)


def collective(kind: str, nbytes: float, workers: int, link: Link) -> float:
    """Seconds of one collective of ``kind`` (``all_reduce`` or ``all_gather``) handing over ``nbytes``."""
    if kind == "all_reduce":
        return ring_allreduce(nbytes, workers, link)
    if kind == "all_gather":
        return ring_allgather(nbytes, workers, link)
    raise ValueError(f"unknown collective {kind!r}: all_reduce or all_gather")


def parameter_server(nbytes: float, workers: int, shards: int, worker_link: Link, server_link: Link) -> float:
    """One push (or one pull) of an ``nbytes`` model to ``shards`` servers on hosts of their own:
    max(M / B_worker, n M / (k B_server)) (BytePS's non-colocated PS), plus one message's latency."""
    if shards < 1:
        raise ValueError(f"a parameter server needs at least one shard, got {shards}")
    return max(worker_link.seconds(nbytes), server_link.seconds(workers * nbytes / shards))


def colocated_parameter_server(nbytes: float, hosts: int, workers_per_host: int, link: Link) -> float:
    """One push (or pull) when every host runs a shard of the model beside its workers (ps-lite's and
    trainscale's layout): a host's workers send the (hosts-1)/hosts of the model that lives elsewhere,
    and its shard receives as much from the other hosts; the link carries g(h-1)/h x M each way."""
    if hosts <= 1:
        return 0.0
    return link.seconds(workers_per_host * (hosts - 1) / hosts * nbytes, hosts - 1)


def overlapped_finish(ready: list[float], seconds: list[float]) -> float:
    """When the last of a sequence of collectives ends, each launched when its bucket is ready and after
    the previous one (DDP launches buckets in ready order and the collectives run one after another).
    ``ready[i]``: bucket i's ready time; ``seconds[i]``: its collective's duration."""
    if len(ready) != len(seconds):
        raise ValueError("one duration per bucket")
    free = 0.0
    for start, duration in zip(ready, seconds):
        free = max(free, start) + duration
    return free
