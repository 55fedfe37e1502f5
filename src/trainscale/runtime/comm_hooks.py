"""DDP communication hooks, and the byte accounting every hook reports into.

DDP hands a hook each gradient bucket (a flat tensor of several parameters' gradients, summed
locally, not yet averaged) and expects a future of the bucket's new contents. trainscale's default
hook counts the bytes of the tensor it gives to the collective, then averages it with one
all-reduce, exactly as DDP does without a hook.

``bytes_sent`` is the payload each worker hands to the collective per step (for dense fp32 all-reduce:
4 bytes x trainable parameters), not what the ring algorithm puts on the wire (about 2(W-1)/W times
that). A compression hook reports what it really hands over (values, indices, packed bits) with
``CommStats.record`` and is then directly comparable.
"""

# No ``from __future__ import annotations`` here: DDP checks a hook's annotations at registration and
# needs the real ``dist.GradBucket`` / ``torch.futures.Future`` objects, not strings.
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

    def record(self, nbytes: int, last_bucket: bool, calls: int = 1) -> None:
        """Count one bucket's payload; the step ends with DDP's last bucket of the backward pass."""
        self.bytes_sent += int(nbytes)
        self.calls += calls
        if last_bucket:
            self.steps += 1

    def per_step(self) -> "dict[str, float | None]":
        """What metrics.jsonl and summary.json carry (None before the first step)."""
        if not self.steps:
            return {"bytes_sent_per_step": None, "allreduce_calls_per_step": None}
        return {"bytes_sent_per_step": self.bytes_sent / self.steps,
                "allreduce_calls_per_step": self.calls / self.steps}

    def add(self, other: "CommStats") -> None:
        self.bytes_sent += other.bytes_sent
        self.calls += other.calls
        self.steps += other.steps

    def reset(self) -> None:
        self.bytes_sent = self.calls = self.steps = 0


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


def register_hook(model: torch.nn.Module, state: HookState, hook: Hook = counting_allreduce_hook) -> None:
    """Install ``hook`` on a DDP model (DDP allows one hook per model, installed before the first step)."""
    model.register_comm_hook(state, hook)
