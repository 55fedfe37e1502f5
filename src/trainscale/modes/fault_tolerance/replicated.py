"""A data-parallel mode run as torchft replicas: the wrapper, as torchft's own LocalSGD and DiLoCo wrap a model.

``Replicated`` wraps sync mode: no DDP; each step the replica joins the quorum, takes its batch of the job's
data position and steps an optimizer that averages over the quorum and applies committed steps only.
``ReplicatedPeriodic`` wraps local SGD and DiLoCo: local steps stand on their own, and a round is an exchange
over the quorum that is applied only if committed. A round that fails (a member died or hung in it) leaves every
survivor's local progress in place and is taken again at the next step with whoever is left (the compressor's
state put back first); the dead member's local steps since the last round are what is lost. A restarted replica
heals from a live one mid-round: it takes the anchor, the outer momentum and the round's step count, and starts
the rest of the round from the anchor. The epoch's last round also averages the BatchNorm statistics and the
inner momentum over the quorum, retried until committed.

The wrapped modes know nothing of this: the wrapper uses their public primitives.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from trainscale.errors import ConfigError
from trainscale.modes.base import Mode
from trainscale.modes.batchnorm import bn_running_stats
from trainscale.modes.fault_tolerance.session import ReplicaSession
from trainscale.modes.fault_tolerance.steps import CommittingOptimizer, ReplicaBatches
from trainscale.modes.localsgd import PeriodicMode
from trainscale.modes.sync import SyncMode
from trainscale.runtime.job import Job
from trainscale.train.callbacks import Writes

BACKEND = "gloo (torchft, reconfigured per quorum)"


class Replicated(Mode):
    """Sync mode (``inner``) as this process's torchft replica; see the module docstring."""

    distributed = True
    standby_writer = True  # every replica holds a writer: the one elected at an epoch's end writes

    def __init__(self, inner: SyncMode, cfg: Any, job: Job) -> None:
        self.inner = inner
        self.name = inner.name
        self.job = job
        self.replica = ReplicaSession(cfg, job)

    # ------------------------------------------------------------------------------ set-up

    def worker_device(self, requested: torch.device) -> torch.device:
        return self.inner.worker_device(requested)

    @contextlib.contextmanager
    def session(self, device: torch.device) -> Iterator[None]:
        """This replica's torchft session instead of a process group (replica 0 creates the run folder)."""
        self.inner.backend = BACKEND
        with self.replica.session(device):
            yield

    def wrap_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        self.replica.model = model
        return model  # no DDP: the committing optimizer averages over the quorum

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer averages over the quorum and applies committed steps only (compressed, with a compression
        plan: its exchange's figures are the mode's)."""
        optimizer = self.inner.wrap_optimizer(optimizer, model)
        committing = CommittingOptimizer(optimizer, model, self.replica, self.inner.compression)
        if committing.hook is not None:
            self.inner.use_exchange(committing.hook)
        return committing  # type: ignore[return-value]

    def wrap_batches(self, train: Any, test: Any) -> tuple[Any, Any]:
        return ReplicaBatches(train, self.replica, self.job.replicas), test

    def before_fit(self, snapshot: Callable[[], dict[str, Any]], restore: Callable[[dict[str, Any]], None]) -> None:
        self.replica.attach(snapshot, restore)

    # ------------------------------------------------------------------------------ the run folder and figures

    def writes_run_folder(self) -> Writes:
        """The quorum's first member writes, re-reading the rows so far (another replica may have written them)."""
        return Writes.SHARED if self.replica.member_rank == 0 else Writes.NOT_NOW

    def data_parallel_size(self) -> int:
        return self.job.replicas  # each replica is a world of one

    def before_train_epoch(self, epoch: int) -> None:
        self.inner.before_train_epoch(epoch)

    def after_train_epoch(self, model: nn.Module) -> None:
        """Nothing: the BatchNorm statistics were averaged with every committed step."""

    def epoch_samples(self, counted: int) -> int:
        """Each replica counts only its own: the job's are the committed batches."""
        return self.replica.epoch_batches * self.replica.batch_size

    def epoch_stats(self) -> dict[str, Any]:
        return self.inner.epoch_stats()

    def run_stats(self) -> dict[str, Any]:
        return self.inner.run_stats()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        return {"world_size": self.job.replicas, **self.inner.describe()}


class ReplicatedPeriodic(Replicated):
    """Local SGD or DiLoCo (``inner``) as this process's torchft replica; see the module docstring."""

    inner: PeriodicMode

    def wrap_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        """Replicas start alike from the seed (a late one heals); the rounds go over the quorum."""
        self.replica.model = model
        self.inner.prepare(model, group=self.replica.transport())
        self.replica.compression = self.inner.exchange  # a healing replica takes its shared state
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return self.inner.step_with(optimizer, self.after_step)

    def after_step(self) -> None:
        due = self.inner.count_step()
        self.replica.advance()  # the local step stands, whatever becomes of the round
        if due:
            self.round()
        else:
            self.replica.commit(lambda: None)  # the Manager counts local steps too, alike on every replica

    @torch.no_grad()
    def round(self, also: list[torch.Tensor] | None = None, deltas: bool = True) -> bool:
        """A round over the quorum (the pseudo-gradients when ``deltas``, and ``also``, averaged beside them),
        applied only if committed; otherwise the compressor's state is put back, ``also`` is left as it was
        (it travels as a copy) and the round is due again at the next step. Returns whether it committed."""
        inner = self.inner
        assert inner.exchange is not None
        start = time.perf_counter()
        averaged = self.replica.exchange_committed(
            inner.exchange, also or [], inner.exchange_deltas if deltas else list
        )
        if averaged is not None and deltas:
            inner.apply_round(averaged)
        inner.stats.exchange_seconds += time.perf_counter() - start
        return averaged is not None

    def after_train_epoch(self, model: nn.Module) -> None:
        """The epoch's last round (if steps are pending) with the BN statistics and the inner momentum, each
        try in a fresh quorum, until one commits (a quorum of one always does)."""
        state = bn_running_stats(model) + self.inner.inner_state()
        while True:
            self.replica.quorum()
            self.replica.fresh = False
            if self.round(state, deltas=self.inner.since_round > 0):
                return

    def state_dict(self) -> dict[str, Any]:
        """With the anchor and the round's step count, which a replica healing mid-round needs."""
        return self.inner.round_state()


def with_fault_tolerance(mode: Mode, cfg: Any, job: Job) -> Mode:
    """``mode`` as a torchft replica when ``cfg`` asks for fault tolerance; else ``mode`` itself. The one seam
    between a run and fault tolerance (the composition root calls it once the mode and its device are set)."""
    if not cfg.replication.fault_tolerance:
        return mode
    if isinstance(mode, PeriodicMode):
        return ReplicatedPeriodic(mode, cfg, job)
    if isinstance(mode, SyncMode):
        return Replicated(mode, cfg, job)
    raise ConfigError(f"--fault-tolerance does not apply to --mode {mode.name}")
