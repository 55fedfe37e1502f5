"""How much of a bucket's all-reduce really hides under backward on this device, and what DDP itself costs
per step: measured for ``trainscale profile``, so that a plan uses figures of the user's device instead of
assuming perfect overlap and free frameworks.

Two ranks of this process (``runtime.process_group.loopback_pair``: gloo over 127.0.0.1 on a CPU, NCCL
between the profiled GPU and a second one of the machine) all-reduce buffers of the model's bucket sizes, in
DDP's launch order: first alone, which gives the communication's own time; then launched from DDP's hook while
backward runs, rank 1 mirroring rank 0 from a thread. The backward that carried them, minus the backward alone,
is what was exposed. A perfect overlap would still expose what the schedule cannot hide (buckets start when
ready and run one after another); no overlap exposes all of it. The overlap is where the measured exposure falls
between the two. On a CPU both ranks' reductions run on this machine's cores, where a real peer's would run on
its own host, so the figure errs low (towards less overlap); on GPUs NCCL's kernels share the profiled GPU with
backward's as they do in training, over the link between the two GPUs rather than the cluster's.

The per-step cost is a DDP step (with a hook that hands its bucket straight back) minus a plain step of the
same model: DDP's bucket copies and bookkeeping, which a one-device run does not pay. The per-bucket cost is a
one-element all-reduce between the pair: what every collective costs whatever its size (gloo's launch and
completion, and the loopback's own round trips, a few microseconds, which a real link's latency replaces).
"""

from __future__ import annotations

import contextlib
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainscale.plan.costs import overlapped_finish
from trainscale.train.precision import synchronize

Round = list[int] | None  # the bucket sizes (bytes) rank 1 all-reduces next; None: stop


@dataclass(frozen=True)
class OverlapMeasurement:
    """Seconds per step: backward alone; how much longer it took with the all-reduces launched from it (the
    median of paired steps, one of each in turn, so that a machine's drifting load cancels); the all-reduces
    alone; and what a perfect schedule would still expose."""

    backward: float
    exposed: float
    comm: float
    schedule_bound: float

    @property
    def overlap(self) -> float | None:
        return overlap_fraction(self.comm, self.exposed, self.schedule_bound)


def overlap_fraction(comm: float, exposed: float, bound: float) -> float | None:
    """The planner's overlap f for a measured step: exposed = f x bound + (1 - f) x comm (``bound``: what a
    perfect overlap still exposes, ``comm``: the collectives' own time, all exposed without overlap), clipped
    to [0, 1]; None when nothing could hide (``comm`` no more than ``bound``), where f means nothing."""
    if comm <= bound or comm <= 0:
        return None
    return min(1.0, max(0.0, (comm - exposed) / (comm - bound)))


def schedule_bound(ready: list[float], comm: list[float], backward: float) -> float:
    """What perfect overlap still exposes: the collectives, each starting when its bucket is ready and after
    the previous one, end this long after backward."""
    return max(0.0, overlapped_finish(ready, comm) - backward)


def _buffers(sizes: list[int], device: torch.device) -> list[torch.Tensor]:
    return [torch.zeros(max(1, n // 4), device=device) for n in sizes]


class Peer:
    """Rank 1 of a loopback pair on its own thread (and its own device): it all-reduces each round of bucket
    sizes it is given, in order, so that rank 0's collectives find their partner."""

    def __init__(self, group: Any, device: torch.device) -> None:  # torch's stubs omit a backend's collectives
        self.group = group
        self.device = device
        self.rounds: queue.Queue[Round] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="trainscale-overlap-peer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            while (sizes := self.rounds.get()) is not None:
                for buffer in _buffers(sizes, self.device):
                    self.group.allreduce([buffer]).wait()
                synchronize(self.device)
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self, timeout_s: float = 60.0) -> None:
        self.rounds.put(None)
        self.thread.join(timeout_s)
        if self.error is not None:
            raise RuntimeError(f"the overlap measurement's peer failed: {self.error}") from self.error


@contextlib.contextmanager
def running_peer(group: Any, device: torch.device) -> Iterator[Peer]:
    """A ``Peer`` for the block, stopped after it. A block that ends in an exception (Ctrl-C, an error) does not
    wait for it: the peer may wait in a collective rank 0 will never make, until gloo's timeout (a stop took 60 s,
    then the peer's timeout won over it as a traceback); a daemon thread, it ends with the process."""
    peer = Peer(group, device)
    try:
        yield peer
    except BaseException:
        peer.rounds.put(None)
        raise
    peer.stop()


def comm_alone(group: Any, peer: Peer, sizes: list[int], repeats: int, device: torch.device) -> list[float]:
    """Median seconds of each bucket's all-reduce with nothing else running (rank 0's side, on ``device``; on a
    GPU until its stream has finished it, not only until NCCL has queued it)."""
    samples: list[list[float]] = [[] for _ in sizes]
    buffers = _buffers(sizes, device)
    for _ in range(repeats):
        peer.rounds.put(sizes)
        for i, buffer in enumerate(buffers):
            synchronize(device)
            start = time.perf_counter()
            group.allreduce([buffer]).wait()
            synchronize(device)
            samples[i].append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def per_collective(group: Any, peer: Peer, repeats: int, device: torch.device, count: int = 8) -> float:
    """Median seconds of a one-element all-reduce with the peer: the part of a bucket's collective that does not
    depend on its size (``count`` of them a round, ``repeats`` rounds)."""
    return statistics.median(comm_alone(group, peer, [4] * count, repeats, device))


def allreduce_hook(state, bucket):  # unannotated: DDP rejects string annotations on a hook
    """Rank 0's side: the bucket all-reduced with the loopback peer, DDP waiting on it as on any collective."""
    return state.allreduce([bucket.buffer()]).get_future().then(lambda fut: fut.value()[0])


def paired_exposure(
    alone: Callable[[], float], with_comm: Callable[[], float], peer: Peer, sizes: list[int], repeats: int
) -> float:
    """The median over ``repeats`` pairs of how much longer a backward takes while DDP's hook all-reduces every
    bucket with the peer than the backward just before it without (never below 0)."""
    samples = []
    for _ in range(repeats):
        before = alone()
        peer.rounds.put(sizes)
        samples.append(with_comm() - before)
    return max(0.0, statistics.median(samples))
