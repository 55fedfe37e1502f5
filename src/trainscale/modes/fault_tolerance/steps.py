"""What a replica trains on and how it steps: its batches of the job's data position (``ReplicaBatches``), and
the optimizer that applies only committed steps (``CommittingOptimizer``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from trainscale.compression.ddp_hook import CompressionHookState
from trainscale.compression.setup import CompressionPlan
from trainscale.modes.batchnorm import bn_buffers
from trainscale.modes.fault_tolerance.session import Position, ReplicaSession, buckets, unflatten_into


class ReplicaBatches:
    """The training batches of a replica: the whole epoch's permutation (the same on every replica),
    walked by the job's data position, this replica taking its member rank's batch of each step."""

    def __init__(self, full: Any, session: ReplicaSession, replicas: int = 1) -> None:
        self.full = full
        self.session = session
        self.replicas = replicas
        session.batch_size = full.batch_size
        self.progress = 0.0

    def __len__(self) -> int:
        return len(self.full) // max(1, self.replicas)

    @property
    def num_samples(self) -> int:
        return self.full.num_samples

    def __getattr__(self, name: str) -> Any:
        return getattr(self.full, name)

    def epoch(self, epoch: int) -> Iterator[Any]:
        s = self.session
        total = len(self.full)
        source, taken = iter(self.full.lazy_epoch(epoch)), 0
        if s.position.epoch < epoch:  # resumed from a checkpoint: the epoch's start
            s.position = Position(epoch, 0)
        first: int | None = None  # where this replica's pass began (later than 0 after healing mid-epoch)
        while True:
            if not s.fresh:
                s.quorum()
            if s.position.epoch != epoch:  # healed into another epoch
                return
            if s.position.batches + s.members > total:
                s.epoch_batches = s.position.batches - (first or 0)  # the job's, over this replica's pass
                s.position = Position(epoch + 1, 0)
                return
            s.fresh = False
            first = s.position.batches if first is None else first
            want = s.position.batches + s.member_rank
            if want < taken:
                source, taken = iter(self.full.lazy_epoch(epoch)), 0
            for _ in range(want - taken):
                next(source)
            taken = want + 1
            self.progress = s.position.batches / total
            s.saved = [b.clone() for b in s.stats]  # the step's forward updates them
            yield next(source)()


class CommittingOptimizer:
    """The optimizer the training loop steps under fault tolerance: ``step`` averages the gradients and
    the BatchNorm running statistics over the quorum, and applies them only if the step is committed
    (otherwise the statistics are put back as they were before the step's forward).

    With ``compression`` the gradients go through trainscale's compressed exchange over the quorum (the same
    ``CompressionHookState`` that DDP's hook and DiLoCo's outer step use), layer by layer or as one vector.
    Its state (error-feedback residuals, PowerSGD's Q, the step clock) is saved before the step and put
    back when the step is not committed, so an aborted step leaves no trace on any replica."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        model: nn.Module,
        session: ReplicaSession,
        compression: CompressionPlan | None = None,
    ) -> None:
        self.inner, self.session = inner, session
        self.stats = session.stats = bn_buffers(model)
        self.averaged = [b for b in self.stats if b.is_floating_point()]  # the step counters are equal anyway
        self.hook: CompressionHookState | None = None
        if compression is not None and compression.enabled:
            self.hook = session.compression = compression.hook_state(model, session.transport())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        params = [p for group in self.inner.param_groups for p in group["params"] if p.grad is not None]
        committed = self._dense_step(params) if self.hook is None else self._compressed_step(params)
        if committed:
            self.session.advance()
            self.inner.step()
        else:
            for b, saved in zip(self.stats, self.session.saved):
                b.copy_(saved)

    def _dense_step(self, params: list[nn.Parameter]) -> bool:
        flat = buckets([p.grad for p in params if p.grad is not None] + self.averaged)
        if not self.session.commit(lambda: self.session.average([f for f, _ in flat])):
            return False
        unflatten_into(flat)
        return True

    def _compressed_step(self, params: list[nn.Parameter]) -> bool:
        hook = self.hook
        assert hook is not None
        averaged = self.session.exchange_committed(
            hook, self.averaged, lambda: hook.reduce_params([(p, p.grad) for p in params if p.grad is not None])
        )
        if averaged is None:
            return False
        hook.end_step()
        for p, g in zip(params, averaged):
            assert p.grad is not None  # ``step`` passes only parameters with a gradient
            p.grad.copy_(g)
        return True

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
