"""Closed-form collective costs (the alpha-beta model): seconds for ``nbytes`` over links of ``bandwidth``
bytes/s and ``latency`` seconds per message.

Every collective here is the algorithm gloo and NCCL run on a flat group, bounded by its slowest link
(BytePS paper, section 2): a ring all-reduce sends 2(n-1)/n of the buffer over every link in 2(n-1)
rounds; a ring all-gather of a p-byte payload per worker sends (n-1)p in n-1 rounds; a parameter server
with k shards (not on the workers' hosts) is bound by the worker's link (M) or the servers' (nM/k).
Pure functions: no torch, no measurement, so the unit tests can check them on hand-computed cases.
"""

from __future__ import annotations

import math
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

    def at(self, fraction: float) -> Link:
        """The link as software drives it: ``fraction`` of its rate, its latency unchanged (itself at 1)."""
        return self if fraction == 1 else Link(self.bandwidth * fraction, self.latency)


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


# --- Topology-aware collectives (NCCL's algorithms) ---------------------------------------------------------


@dataclass(frozen=True)
class Fabric:
    """Where a collective runs: ``hosts`` x ``per_host`` devices; ``intra``: one device's link to its peers
    inside a host (NVLink, NVSwitch, or PCIe through switches and sockets, already reduced to its bottleneck);
    ``nic``: one network interface; ``nics``: interfaces per host (NCCL runs one ring or tree per NIC, so a
    host's traffic spreads over all of them)."""

    hosts: int
    per_host: int
    intra: Link
    nic: Link
    nics: int = 1

    @property
    def devices(self) -> int:
        return self.hosts * self.per_host

    @property
    def network(self) -> Link:
        """All of a host's NICs together: the bandwidth a ring or tree crossing hosts gets per host."""
        return Link(self.nic.bandwidth * self.nics, self.nic.latency)

    @property
    def bottleneck(self) -> Link:
        """A flat ring or chain over every device: the slower of the links it crosses, the larger latency."""
        if self.hosts == 1:
            return self.intra
        if self.per_host == 1:
            return self.network
        net = self.network
        return Link(min(self.intra.bandwidth, net.bandwidth), max(self.intra.latency, net.latency))


ALGORITHMS = ("ring", "tree", "hierarchical")


def flat_ring(nbytes: float, fabric: Fabric) -> float:
    """One ring through every device: 2(n-1)/n x M / B_bottleneck + 2(n-1) x alpha (NCCL's and gloo's ring)."""
    return ring_allreduce(nbytes, fabric.devices, fabric.bottleneck)


def tree(nbytes: float, fabric: Fabric) -> float:
    """NCCL's double binary tree: a chain inside each host, a binary tree across hosts, reduce up then
    broadcast down, pipelined, so every link carries M each way: 2 x M / B_bottleneck; its latency grows with
    log2(hosts) + the chain's length: 2 x (ceil(log2 h) x alpha_net + (g-1) x alpha_intra)."""
    n = fabric.devices
    if n <= 1:
        return 0.0
    hops_net = math.ceil(math.log2(fabric.hosts)) if fabric.hosts > 1 else 0
    hops_intra = fabric.per_host - 1
    latency = hops_net * fabric.network.latency + hops_intra * fabric.intra.latency
    return 2.0 * nbytes / fabric.bottleneck.bandwidth + 2.0 * latency


def hierarchical(nbytes: float, fabric: Fabric) -> float:
    """Two levels (Horovod's hierarchical all-reduce, NCCL's 2-D): reduce-scatter inside each host, a ring
    all-reduce of each device's 1/g share across hosts over its share of the host's NICs, all-gather inside:
    2 x [(g-1)/g x M / B_intra + (g-1) alpha_intra] + 2(h-1)/h x M / B_net + 2(h-1) alpha_net."""
    g, h = fabric.per_host, fabric.hosts
    inside = 2.0 * (fabric.intra.seconds((g - 1) / g * nbytes, g - 1)) if g > 1 else 0.0
    across = ring_allreduce(nbytes, h, fabric.network) if h > 1 else 0.0
    return inside + across


def allreduce(nbytes: float, fabric: Fabric, algorithm: str = "ring") -> float:
    """Seconds of one all-reduce of ``nbytes`` on ``fabric`` by ``algorithm``; ``auto`` picks as NCCL does."""
    if fabric.devices <= 1:
        return 0.0
    return {"ring": flat_ring, "tree": tree, "hierarchical": hierarchical}[nccl_choice(nbytes, fabric, algorithm)](
        nbytes, fabric
    )


def nccl_choice(nbytes: float, fabric: Fabric, algorithm: str = "auto") -> str:
    """The algorithm NCCL runs for one all-reduce: the one given, or (``auto``) the one its tuner predicts
    fastest among ring and tree; NCCL builds trees only across hosts, so one host always rings."""
    if algorithm != "auto":
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: auto, {', '.join(ALGORITHMS)}")
        return algorithm
    if fabric.hosts == 1:
        return "ring"
    return min(("ring", "tree"), key=lambda a: (flat_ring if a == "ring" else tree)(nbytes, fabric))


# --- Parameter servers as systems place them -------------------------------------------------------------

ASSIGNMENTS = ("shard", "round_robin", "by_size")


def server_loads(tensor_bytes: list[float], servers: int, assignment: str = "shard") -> list[float]:
    """Bytes each of ``servers`` holds: ``shard`` splits every tensor evenly (ps-lite, BytePS, trainscale);
    ``round_robin`` places whole tensors in turn (TensorFlow's default device setter); ``by_size`` places
    whole tensors, largest first, on the least loaded server (TensorFlow's greedy load balancing)."""
    if servers < 1:
        raise ValueError(f"a parameter server needs at least one server, got {servers}")
    total = float(sum(tensor_bytes))
    if assignment == "shard":
        return [total / servers] * servers
    loads = [0.0] * servers
    if assignment == "round_robin":
        for i, n in enumerate(tensor_bytes):
            loads[i % servers] += n
        return loads
    if assignment == "by_size":
        for n in sorted(tensor_bytes, reverse=True):
            loads[loads.index(min(loads))] += n
        return loads
    raise ValueError(f"unknown assignment {assignment!r}: {', '.join(ASSIGNMENTS)}")


def placed_parameter_server(
    tensor_bytes: list[float],
    workers: int,
    servers: int,
    worker_link: Link,
    server_link: Link,
    assignment: str = "shard",
    efficiency: float = 1.0,
) -> float:
    """One push (or pull) of every tensor by ``workers`` workers to ``servers`` servers on hosts of their own:
    each worker sends M over its link; the busiest server receives its load from every worker; the transport
    reaches ``efficiency`` of line rate (RPC stacks move large tensors well below it).
    max(M / B_worker, n x max_load / B_server) / efficiency + one message's latency."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"transport efficiency is a fraction of line rate in (0, 1], got {efficiency}")
    loads = server_loads(tensor_bytes, servers, assignment)
    total = float(sum(tensor_bytes))
    wire = max(total / worker_link.bandwidth, workers * max(loads) / server_link.bandwidth) / efficiency
    return wire + max(worker_link.latency, server_link.latency)
