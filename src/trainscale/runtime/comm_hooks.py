"""DDP communication hooks, and the byte accounting every hook reports into.

DDP hands a hook each gradient bucket (a flat tensor of several parameters' gradients, summed
locally, not yet averaged) and expects a future of the bucket's new contents. trainscale's default
hook counts the bytes of the tensor it gives to the collective, then averages it with one
all-reduce, exactly as DDP does without a hook.

``bytes_sent`` is the payload each worker hands to the collective per step (for dense fp32 all-reduce:
4 bytes x trainable parameters), not what the ring algorithm puts on the wire (about 2(W-1)/W times
that). A compression hook reports what it really hands over (values, indices, packed bits) with
``CommStats.record`` and is then directly comparable.

Every hook is installed through :func:`register_hook`, which also times it: ``exchange_seconds`` is how
long the training step is held up by its gradient exchange, i.e. the time spent inside hook calls
(compressed methods encode, exchange and decode there, during the backward pass) plus the time from the
return of the step's last bucket hook (every gradient computed) to the completion of its last collective
(the dense all-reduce runs on gloo's threads, overlapping the backward pass, and only this tail is
waited for). The rest of the step is compute.
"""

# No ``from __future__ import annotations`` here: DDP checks a hook's annotations at registration and
# needs the real ``dist.GradBucket`` / ``torch.futures.Future`` objects, not strings.
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


@dataclass
class CommStats:
    """Bytes and collective calls per worker, and the optimizer steps they span."""

    bytes_sent: int = 0
    calls: int = 0
    steps: int = 0
    exchange_seconds: float = 0.0

    def record(self, nbytes: int, last_bucket: bool, calls: int = 1) -> None:
        """Count one bucket's payload; the step ends with DDP's last bucket of the backward pass."""
        self.bytes_sent += int(nbytes)
        self.calls += calls
        if last_bucket:
            self.steps += 1

    def per_step(self) -> "dict[str, float | None]":
        """What metrics.jsonl and summary.json carry (None before the first step)."""
        if not self.steps:
            return {"bytes_sent_per_step": None, "allreduce_calls_per_step": None, "comm_seconds_per_step": None}
        return {"bytes_sent_per_step": self.bytes_sent / self.steps,
                "allreduce_calls_per_step": self.calls / self.steps,
                "comm_seconds_per_step": self.exchange_seconds / self.steps}

    def add(self, other: "CommStats") -> None:
        self.bytes_sent += other.bytes_sent
        self.calls += other.calls
        self.steps += other.steps
        self.exchange_seconds += other.exchange_seconds

    def reset(self) -> None:
        self.bytes_sent = self.calls = self.steps = 0
        self.exchange_seconds = 0.0


@dataclass
class HookState:
    """What a hook needs: where to count, and which group to talk to (None = the default group)."""

    stats: CommStats = field(default_factory=CommStats)
    process_group: Any = None


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def allreduce_mean(tensor: torch.Tensor, process_group: Any = None) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` over the group in place, asynchronously; the future yields the tensor.

    Dividing before the sum (not after) keeps fp16/bf16 payloads from overflowing.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    tensor.div_(dist.get_world_size(group))
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def counting_allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default behaviour (mean all-reduce of the bucket), with its payload counted."""
    tensor = bucket.buffer()
    state.stats.record(tensor_bytes(tensor), bucket.is_last())
    return allreduce_mean(tensor, state.process_group)


class ExchangeClock:
    """Adds each step's exchange time to ``stats.exchange_seconds`` (see the module docstring). Collectives
    complete on gloo's threads, hence the lock; a step is closed when its last bucket has been handed over
    and nothing it started is still pending."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending = 0
        self.last_return: float | None = None
        self.latest_done = 0.0

    def returned(self, stats: CommStats, blocked: float, last_bucket: bool) -> None:
        with self.lock:
            stats.exchange_seconds += blocked
            self.pending += 1
            if last_bucket:
                self.last_return = time.perf_counter()

    def completed(self, stats: CommStats) -> None:
        with self.lock:
            self.pending -= 1
            self.latest_done = max(self.latest_done, time.perf_counter())
            if self.last_return is not None and self.pending == 0:
                stats.exchange_seconds += max(0.0, self.latest_done - self.last_return)
                self.last_return, self.latest_done = None, 0.0


def timed(hook: Hook) -> Hook:
    """``hook`` with its step's exchange time measured into ``state.stats``."""
    clock = ExchangeClock()

    def timed_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()
        future = hook(state, bucket)
        clock.returned(state.stats, time.perf_counter() - start, bucket.is_last())

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            clock.completed(state.stats)
            return fut.value()
        return future.then(done)

    return timed_hook


def register_hook(model: torch.nn.Module, state: Any, hook: Hook = counting_allreduce_hook) -> None:
    """Install ``hook``, timed, on a DDP model (DDP allows one hook per model, installed before the first
    step); ``state.stats`` must be a ``CommStats``."""
    model.register_comm_hook(state, timed(hook))
