"""Synchronous data parallelism (BSP): DDP over gloo (CPU) or NCCL (CUDA), one worker per device.

Every step each worker computes gradients on its shard of the global batch; DDP averages them with
all-reduce (through trainscale's counting hook) before the optimizer step, so all replicas stay
identical. BatchNorm: by default each worker normalises with its own batch statistics (like the
source pages' multi-GPU runs) and the running statistics are averaged over workers at each epoch end, so
evaluation and checkpoints see one consistent model; ``--sync-bn`` uses SyncBatchNorm (CUDA only)
for global batch statistics instead. Evaluation is sharded across ranks and its sums all-reduced.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections.abc import Iterator
from typing import Any, ClassVar, TypedDict

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainscale.compression.config import CompressionConfig
from trainscale.compression.setup import CompressionPlan, plan_from_config
from trainscale.compression.setup import ddp_kwargs as compression_ddp_kwargs
from trainscale.compression.setup import make_hook as make_compression_hook
from trainscale.config import Section
from trainscale.errors import ConfigError
from trainscale.modes.base import Mode, register_mode
from trainscale.modes.batchnorm import average_bn_statistics
from trainscale.modes.config import SyncConfig, TrainConfig
from trainscale.modes.fault_tolerance.config import ReplicationConfig
from trainscale.runtime.comm_hooks import CommStats, Hook, HookState, counting_allreduce_hook, register_hook
from trainscale.runtime.dist import elect_main_rank, local_rank, quiet_unless_main, set_main_rank, world_size
from trainscale.runtime.faults import FaultConfig
from trainscale.runtime.process_group import process_group, worker_device

log = logging.getLogger("trainscale.sync")

EVALUATION = "sharded across ranks (contiguous blocks of the test set), loss/correct/count sums all-reduced"


class BufferSync(TypedDict, total=False):
    """DDP's keyword for its forward buffer broadcast: one of the two (see ``no_forward_buffer_sync``)."""

    forward_sync_buffers: bool
    broadcast_buffers: bool


def no_forward_buffer_sync() -> BufferSync:
    """DDP's switch for broadcasting buffers before every forward, off: torch 2.13 calls it
    ``forward_sync_buffers`` (``broadcast_buffers`` is deprecated there); earlier releases only know
    ``broadcast_buffers``."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


SYNC_BN_NEEDS_CUDA = (
    "--sync-bn needs CUDA workers (torch's SyncBatchNorm is GPU-only); on the CPU leave it off: "
    "running statistics are averaged over workers at each epoch end"
)


@register_mode("sync")
class SyncMode(Mode):
    """DDP with a byte-counting all-reduce hook; see the module docstring for BatchNorm and evaluation."""

    distributed = True
    sections: ClassVar[tuple[type[Section], ...]] = (CompressionConfig, FaultConfig, ReplicationConfig, SyncConfig)

    def __init__(self, name: str = "sync", cfg: TrainConfig | None = None) -> None:
        cfg = cfg or TrainConfig()
        self.name = name
        self.compression: CompressionPlan | None = plan_from_config(cfg.compression, cfg.run.seed)
        self.hook_state: Any = None
        self.requested_backend = None if cfg.launch.backend == "auto" else cfg.launch.backend
        self.sync_bn = cfg.sync.sync_bn
        self.timeout_s = cfg.launch.dist_timeout
        self.node_rank = cfg.launch.node_rank
        self.backend: str | None = None
        self.stats = CommStats()  # this epoch's, filled by the hook
        self.total = CommStats()  # the run's, epoch by epoch

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:  # type: ignore[override]
        super().validate(cfg)

    @classmethod
    def check_device(cls, cfg: TrainConfig, device: torch.device) -> None:  # type: ignore[override]
        if cfg.sync.sync_bn and device.type != "cuda":
            raise ConfigError(SYNC_BN_NEEDS_CUDA)

    def worker_device(self, requested: torch.device) -> torch.device:
        return worker_device(requested)

    @contextlib.contextmanager
    def session(self, device: torch.device) -> Iterator[None]:
        """Join the launcher's group, elect the run-folder owner (node 0's first worker), always leave."""
        with process_group(device, self.requested_backend, self.timeout_s) as backend:
            self.backend = backend
            main = elect_main_rank(self.node_rank == 0 and local_rank() == 0)
            with quiet_unless_main():
                log.info(
                    "%s mode: %d workers over %s; rank %d writes the run folder", self.name, world_size(), backend, main
                )
                try:
                    yield
                finally:
                    set_main_rank(0)

    def wrap_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        if self.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # swaps BN children in place
        # Buffers are synced once at construction (identical starting BN statistics), not before every
        # forward: per-worker statistics, averaged at epoch end (see ``after_train_epoch``).
        extra = compression_ddp_kwargs(self.compression, model) if self.compression else {}
        ddp = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, **no_forward_buffer_sync(), **extra
        )
        state, hook = self.comm_hook(ddp)
        register_hook(ddp, state, hook)
        return ddp

    def comm_hook(self, ddp: DistributedDataParallel) -> tuple[Any, Hook]:
        """The DDP comm hook and its state: dense mean all-reduce, counted into ``self.stats``. A mode that
        sends something else (e.g. compressed gradients) overrides this and reports into ``self.stats``
        (a ``CommStats`` or subclass), and the per-epoch and summary figures follow."""
        if self.compression is None or not self.compression.enabled:
            return HookState(self.stats), counting_allreduce_hook
        self.hook_state, hook = make_compression_hook(self.compression, ddp)
        self.stats = self.hook_state.stats
        return self.hook_state, hook

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """DGC applies momentum itself (momentum correction), so the optimizer's own is switched off."""
        if self.compression is not None and self.compression.compressor().replaces_optimizer_momentum:
            for group in optimizer.param_groups:
                group.update(momentum=0.0, nesterov=False)
            log.info("dgc: optimizer momentum off (DGC's momentum correction replaces it)")
        return optimizer

    def use_exchange(self, state: Any) -> None:
        """Count into ``state`` (a compression hook's state, with its ``stats``) the gradients another exchange
        than DDP's hook sends: this mode's figures then follow it."""
        self.hook_state = state
        self.stats = state.stats

    def before_train_epoch(self, epoch: int) -> None:
        if self.hook_state is not None:
            self.hook_state.set_epoch(epoch)

    def after_train_epoch(self, model: nn.Module) -> None:
        if not self.sync_bn:
            average_bn_statistics(model)

    def epoch_stats(self) -> dict[str, Any]:
        row = self.per_step(self.stats, "epoch")
        if not self.total.steps and type(self.total) is not type(self.stats):
            self.total = copy.deepcopy(self.stats)  # same kind of stats as the hook's (labels kept)
            self.total.reset()
        self.total.add(self.stats)
        self.stats.reset()
        return row

    def run_stats(self) -> dict[str, Any]:
        return self.per_step(self.total, "run")

    def per_step(self, stats: CommStats, period: str) -> dict[str, Any]:
        """The per-step figures of ``stats`` (this ``period``'s: ``epoch`` or ``run``); a mode that does not
        exchange every step turns per-exchange figures into per-step ones here."""
        return stats.per_step()

    def describe(self) -> dict[str, Any]:
        bn = (
            "SyncBatchNorm (global batch statistics)"
            if self.sync_bn
            else "per-worker batch statistics; running statistics averaged over workers at each epoch end"
        )
        compression = self.compression.describe() if self.compression else {"compress_method": "none"}
        return {
            "backend": self.backend,
            "batchnorm": bn,
            "evaluation": EVALUATION,
            **compression,
            "bytes_sent_scope": "payload each worker hands to all-reduce per step (DDP gradient buckets)",
        }
