"""DDP communication hooks, and the byte accounting every hook reports into.

DDP hands a hook each gradient bucket (a flat tensor of several parameters' gradients, summed
locally, not yet averaged) and expects a future of the bucket's new contents. trainscale's default
hook counts the bytes of the tensor it gives to the collective, then averages it with one
all-reduce, exactly as DDP does without a hook.

``bytes_sent`` is the payload each worker hands to the collective per step (for dense fp32 all-reduce:
4 bytes x trainable parameters), not what the ring algorithm puts on the wire (about 2(W-1)/W times
that). A compression hook reports what it really hands over (values, indices, packed bits) with
``CommStats.record`` and is then directly comparable.

Every hook is installed through :func:`register_hook`, which also times it with the hook state's
:class:`OverlapClock`. Per step it measures:

* ``exchange_seconds``: how long the training step is held up by its gradient exchange: the time spent
  inside hook calls (encoding, launching, and for methods that cannot overlap also communicating and
  decoding) plus the time from the return of the step's last bucket hook (every gradient computed) to
  the completion of its last collective. The rest of the step is compute.
* ``comm_seconds``: wall time during which at least one collective was in flight.
* ``hidden_seconds``: the part of that in-flight time that ran while the backward pass was computing
  (before the last bucket was ready, outside hook calls): communication the step did not pay for.
"""

# No ``from __future__ import annotations`` here: DDP checks a hook's annotations at registration and
# needs the real ``dist.GradBucket`` / ``torch.futures.Future`` objects, not strings.
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainscale.record import K

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


@dataclass
class CommStats:
    """Bytes and collective calls per worker, the optimizer steps they span, and the step's exchange
    times (see the module docstring)."""

    bytes_sent: int = 0
    calls: int = 0
    steps: int = 0
    exchange_seconds: float = 0.0
    comm_seconds: float = 0.0
    hidden_seconds: float = 0.0

    def record(self, nbytes: int, last_bucket: bool, calls: int = 1) -> None:
        """Count one bucket's payload; the step ends with DDP's last bucket of the backward pass."""
        self.bytes_sent += int(nbytes)
        self.calls += calls
        if last_bucket:
            self.steps += 1

    def per_step(self) -> "dict[str, float | None]":
        """What metrics.jsonl and summary.json carry (None before the first step)."""
        s = self.steps
        return {
            K.bytes_sent_per_step: self.bytes_sent / s if s else None,
            K.allreduce_calls_per_step: self.calls / s if s else None,
            K.comm_seconds_per_step: self.exchange_seconds / s if s else None,
            K.comm_ms_per_step: 1e3 * self.comm_seconds / s if s else None,
            K.hidden_ms_per_step: 1e3 * self.hidden_seconds / s if s else None,
        }

    def add(self, other: "CommStats") -> None:
        for name in ("bytes_sent", "calls", "steps", "exchange_seconds", "comm_seconds", "hidden_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def reset(self) -> None:
        self.bytes_sent = self.calls = self.steps = 0
        self.exchange_seconds = self.comm_seconds = self.hidden_seconds = 0.0


class HookState:
    """What a hook needs: where to count, which group to talk to (None = the default group), and the
    clock that times its steps."""

    def __init__(self, stats: CommStats | None = None, process_group: dist.ProcessGroup | None = None) -> None:
        self.stats = stats if stats is not None else CommStats()
        self.process_group = process_group
        self.clock = OverlapClock(self.stats)


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def allreduce_mean(
    tensor: torch.Tensor, process_group: dist.ProcessGroup | None = None, clock: "OverlapClock | None" = None
) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` over the group in place, asynchronously; the future yields the tensor.

    Dividing before the sum (not after) keeps fp16/bf16 payloads from overflowing.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    tensor.div_(dist.get_world_size(group))
    launched = clock.launched() if clock is not None else 0.0
    work = dist.all_reduce(tensor, group=group, async_op=True)

    def landed(fut: torch.futures.Future[Any]) -> torch.Tensor:
        if clock is not None:
            clock.landed(launched)
        return fut.value()[0]

    return work.get_future().then(landed)


def counting_allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default behaviour (mean all-reduce of the bucket), with its payload counted."""
    tensor = bucket.buffer()
    state.stats.record(tensor_bytes(tensor), bucket.is_last())
    return allreduce_mean(tensor, state.process_group, state.clock)


Interval = tuple[float, float]


def merged(intervals: list[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def measure(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in merged(intervals))


def minus(intervals: list[Interval], holes: list[Interval]) -> list[Interval]:
    """The parts of ``intervals`` outside every hole."""
    out = merged(intervals)
    for h_start, h_end in merged(holes):
        out = [
            piece
            for start, end in out
            for piece in ((start, min(end, h_start)), (max(start, h_end), end))
            if piece[1] > piece[0]
        ]
    return out


class OverlapClock:
    """Times one DDP step's exchange into ``stats`` (``exchange_seconds``, ``comm_seconds``,
    ``hidden_seconds``; see the module docstring).

    Hook calls happen on the training thread; collectives land on the backend's threads, hence the
    lock. A step closes when its last bucket's hook has returned and every hook's future has completed.
    A collective outside any hook (a manual reducer's, a periodic average) only adds its time in flight;
    whoever calls it knows how long it held the step up.
    """

    def __init__(self, stats: CommStats) -> None:
        self.stats = stats
        self.lock = threading.Lock()
        self._clear()

    def _clear(self) -> None:
        self.blocked: list[Interval] = []
        self.flight: list[Interval] = []
        self.pending = 0
        self.backward_end: float | None = None
        self.last_return: float | None = None
        self.latest_done = 0.0
        self.in_step = False

    def hook_called(self, last_bucket: bool) -> float:
        start = time.perf_counter()
        with self.lock:
            self.in_step = True
            if last_bucket:
                self.backward_end = start
        return start

    def hook_returned(self, start: float, last_bucket: bool) -> None:
        now = time.perf_counter()
        with self.lock:
            self.blocked.append((start, now))
            self.pending += 1
            if last_bucket:
                self.last_return = now

    def launched(self) -> float:
        return time.perf_counter()

    def landed(self, launched: float) -> None:
        now = time.perf_counter()
        with self.lock:
            if self.in_step:
                self.flight.append((launched, now))
            else:
                self.stats.comm_seconds += now - launched

    def hook_done(self) -> None:
        with self.lock:
            self.pending -= 1
            self.latest_done = max(self.latest_done, time.perf_counter())
            if self.last_return is None or self.pending:
                return
            self.stats.exchange_seconds += measure(self.blocked) + max(0.0, self.latest_done - self.last_return)
            self.stats.comm_seconds += measure(self.flight)
            end = self.backward_end if self.backward_end is not None else self.last_return
            before_end = [(start, min(stop, end)) for start, stop in self.flight]
            self.stats.hidden_seconds += measure(minus(before_end, self.blocked))
            self._clear()


def timed(hook: Hook) -> Hook:
    """``hook`` with its steps timed by ``state.clock`` into ``state.stats``."""

    def timed_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        clock: OverlapClock = state.clock
        last = bucket.is_last()
        start = clock.hook_called(last)
        future = hook(state, bucket)
        clock.hook_returned(start, last)

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            clock.hook_done()
            return fut.value()

        return future.then(done)

    return timed_hook


def register_hook(
    model: torch.nn.parallel.DistributedDataParallel, state: Any, hook: Hook = counting_allreduce_hook
) -> None:
    """Install ``hook``, timed, on a DDP model (DDP allows one hook per model, installed before the first
    step); ``state.stats`` must be a ``CommStats`` and ``state.clock`` an ``OverlapClock`` over it."""
    model.register_comm_hook(state, timed(hook))
