"""Periodic averaging: local SGD (``--mode localsgd``) and DiLoCo (``--mode diloco``).

Each worker trains on its own shard with the run's optimizer (the inner one) and talks to the others only
every ``--sync-every`` H steps. A round averages the pseudo-gradient, the change of each parameter since
the last round (anchor - local), over workers, through the run's compressor (``--compress``: dense fp32
by default; bf16, Top-k with error feedback... work as for gradients), and an outer SGD step on the
anchor applies it; every worker then continues from the new anchor. DiLoCo's outer step is Nesterov
SGD (``--outer-lr``, ``--outer-momentum``; Douillard et al. 2023 use 0.7 and 0.9), reached after a warm-up
from local SGD's step (``outer_step``); with outer momentum the step follows the inner lr's schedule
(``apply_round``) and the inner SGD momentum restarts each round (``restart_inner_momentum``);
local SGD is the same with outer lr 1 and no momentum, i.e. the workers' parameters averaged. With H = 1 local SGD is
synchronous SGD (the optimizer's update is linear in the gradient). ``--local-after-epochs E`` is
post-local SGD (Lin et al. 2020): H = 1 for the first E epochs.

Each epoch ends with a round (so evaluation and the checkpoint see one model), with the BatchNorm running
statistics and the inner optimizer's momentum averaged over workers: every rank then holds the same
state, and the checkpoint (rank 0's, plus the outer momentum) resumes the run bit for bit.
Error-feedback residuals stay per worker and are not checkpointed, as in sync mode.

Under ``--fault-tolerance`` the mode runs wrapped (``modes.fault_tolerance.ReplicatedPeriodic``), as torchft's
own LocalSGD and DiLoCo wrap a model: the wrapper takes each round over the quorum through the primitives below
(``prepare``, ``count_step``, ``exchange_deltas``, ``apply_round``, ``inner_state``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from trainscale.compression.config import CompressionConfig
from trainscale.compression.ddp_hook import CompressionHookState
from trainscale.compression.setup import CompressionPlan
from trainscale.config import Section
from trainscale.errors import ConfigError
from trainscale.modes.base import register_mode
from trainscale.modes.batchnorm import average_bn_statistics
from trainscale.modes.config import (
    DEFAULT_SYNC_EVERY,
    DILOCO_OUTER,
    PeriodicConfig,
    SyncConfig,
    TrainConfig,
    default_outer_warmup,
)
from trainscale.modes.fault_tolerance.config import ReplicationConfig
from trainscale.modes.sync import SyncMode
from trainscale.record import K
from trainscale.runtime.dist import average_in_place, broadcast_tensors
from trainscale.runtime.faults import FaultConfig

log = logging.getLogger("trainscale.localsgd")


@register_mode("localsgd", "diloco")
class PeriodicMode(SyncMode):
    """See the module docstring."""

    sections: ClassVar[tuple[type[Section], ...]] = (
        CompressionConfig,
        FaultConfig,
        ReplicationConfig,
        SyncConfig,
        PeriodicConfig,
    )

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:  # type: ignore[override]
        super().validate(cfg)
        if not 0 <= cfg.periodic.local_after_epochs < cfg.optim.epochs:
            raise ConfigError(
                f"--local-after-epochs must be in [0, epochs={cfg.optim.epochs}), got {cfg.periodic.local_after_epochs}"
            )
        periodic = cfg.periodic
        outer = (periodic.outer_lr, periodic.outer_momentum, periodic.outer_warmup_rounds)
        if cfg.run.mode == "localsgd" and any(v is not None for v in outer):
            raise ConfigError(
                "--outer-lr, --outer-momentum and --outer-warmup-rounds are for --mode diloco (local SGD averages: "
                "outer lr 1, no momentum)"
            )
        if cfg.sync.sync_bn:
            raise ConfigError(
                f"--sync-bn needs DDP; --mode {cfg.run.mode} averages the BatchNorm statistics each epoch"
            )
        if cfg.run.precision == "fp16":
            raise ConfigError(
                f"--mode {cfg.run.mode} needs every worker to take every step; fp16's grad scaler skips "
                "steps per worker: use --precision bf16"
            )

    def __init__(self, name: str = "localsgd", cfg: TrainConfig | None = None) -> None:
        cfg = cfg or TrainConfig()
        super().__init__(name, cfg)
        self.sync_every = cfg.periodic.sync_every or DEFAULT_SYNC_EVERY
        self.local_after_epochs = cfg.periodic.local_after_epochs
        diloco = name == "diloco"
        periodic = cfg.periodic
        self.outer_lr = (periodic.outer_lr or DILOCO_OUTER[0]) if diloco else 1.0
        self.outer_momentum = (
            (DILOCO_OUTER[1] if periodic.outer_momentum is None else periodic.outer_momentum) if diloco else 0.0
        )
        warmup = periodic.outer_warmup_rounds
        self.outer_warmup = (default_outer_warmup(self.outer_momentum) if warmup is None else warmup) if diloco else 0
        self.rounds = 0
        self.epoch = 0
        self.since_round = 0
        self.lr_sum: float | torch.Tensor = 0.0  # the inner lr's schedule factor, summed over the round's steps
        self.params: list[nn.Parameter] = []
        self.inner: torch.optim.Optimizer | None = None
        self.anchor: list[torch.Tensor] = []
        self.outer: torch.optim.Optimizer | None = None
        self.exchange: CompressionHookState | None = None
        self.steps = {"epoch": 0, "run": 0}

    # ------------------------------------------------------------------------------ set-up

    def wrap_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        """No DDP: the model itself, with the main rank's parameters and buffers on every worker."""
        broadcast_tensors([*model.parameters(), *model.buffers()])
        return self.prepare(model)

    def prepare(self, model: nn.Module, group: Any = None) -> nn.Module:
        """The anchor, the outer optimizer and the exchange (over ``group``, a compression transport; None: the
        process group) for ``model``'s trainable parameters. Frozen ones (airbench's whitening) are never
        exchanged."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.anchor = [p.detach().clone().float() for p in self.params]
        self.outer = torch.optim.SGD(
            self.anchor, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_momentum > 0
        )
        plan = self.compression or CompressionPlan("none", "layerwise", {}, False, 0)
        self.exchange = plan.hook_state(model, group)
        self.stats = self.exchange.stats
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return self.step_with(optimizer, self.after_step)

    def step_with(self, optimizer: torch.optim.Optimizer, after_step: Callable[[], None]) -> torch.optim.Optimizer:
        """``optimizer`` as the inner one, calling ``after_step`` after each of its steps."""
        self.inner = optimizer
        optimizer.register_step_post_hook(lambda *_: after_step())
        return optimizer

    # ------------------------------------------------------------------------------ training

    def period(self) -> int:
        return 1 if self.epoch < self.local_after_epochs else self.sync_every

    def before_train_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.exchange is not None:
            self.exchange.set_epoch(epoch)

    def after_step(self) -> None:
        if self.count_step():
            self.average()

    def count_step(self) -> bool:
        """Count a local step; whether a round is due."""
        self.steps["epoch"] += 1
        self.since_round += 1
        self.lr_sum = self.lr_sum + self.lr_factor()
        return self.since_round >= self.period()

    @torch.no_grad()
    def average(self) -> None:
        """One round: average the pseudo-gradients, step the anchor, continue every worker from it."""
        start = time.perf_counter()
        self.apply_round(self.exchange_deltas())
        self.stats.exchange_seconds += time.perf_counter() - start

    @torch.no_grad()
    def exchange_deltas(self) -> list[torch.Tensor]:
        """The pseudo-gradients (anchor - local) averaged over workers, through the run's compressor."""
        assert self.exchange is not None
        return self.exchange.reduce_params([(p, a - p.float()) for a, p in zip(self.anchor, self.params)])

    def lr_factor(self) -> float | torch.Tensor:
        """Where the inner lr's schedule stands (the lr over its peak; 1 without a schedule). A tensor lr (a
        compiled step's) stays on its device: it is read once a round, not once a step."""
        if self.inner is None:
            return 1.0
        group = self.inner.param_groups[0]
        peak = group.get("peak_lr", 0.0) * group.get("lr_scale", 1.0)
        return group["lr"] / peak if peak else 1.0

    @torch.no_grad()
    def apply_round(self, averaged: list[torch.Tensor]) -> None:
        """Step the anchor by the ``averaged`` pseudo-gradients and continue from it.

        With outer momentum the step follows the inner lr's schedule: the pseudo-gradient enters the momentum
        divided by the round's mean lr factor s and the step is taken at s times the outer lr, as SGD's momentum
        holds gradients and its lr scales the step. Otherwise, once the schedule cuts the lr tenfold, the momentum
        would go on stepping with pseudo-gradients ten times those the workers now make (without momentum both
        are the same step)."""
        assert self.exchange is not None and self.outer is not None
        self.exchange.end_step()
        lr, momentum = self.outer_step(self.rounds)
        scale = float(self.lr_sum) / self.since_round if momentum > 0 and self.since_round else 1.0
        for a, g in zip(self.anchor, averaged):
            a.grad = g.to(a.dtype) / scale if scale > 0 else torch.zeros_like(a)
        for group in self.outer.param_groups:
            group["lr"], group["momentum"] = lr * scale, momentum
        self.outer.step()
        self.rounds += 1
        for a, p in zip(self.anchor, self.params):
            p.copy_(a)
        if self.outer_momentum > 0:
            self.restart_inner_momentum()
        self.since_round = 0
        self.lr_sum = 0.0

    def restart_inner_momentum(self) -> None:
        """DiLoCo with outer momentum: the inner optimizer's momentum buffers start each round from zero (in place:
        a captured step keeps its buffers). The outer momentum carries the direction across rounds; an inner one
        carried too compounds with it, stepping each round further along what the outer step has already taken
        (a short run lost 3 to 5 points to that; docs/local-sgd-diloco.md). Other state (Adam's moments, with
        their step count) is kept: only SGD-style ``momentum_buffer`` entries restart."""
        if self.inner is None:
            return
        for state in self.inner.state.values():
            buffer = state.get("momentum_buffer")
            if isinstance(buffer, torch.Tensor):
                buffer.zero_()

    def outer_step(self, rounds: int) -> tuple[float, float]:
        """The outer (lr, momentum) of the round after ``rounds`` rounds: local SGD's (1, 0) moving linearly to
        the configured ones over the first ``outer_warmup`` rounds. Nesterov momentum m multiplies a steady
        pseudo-gradient's step by up to 1 / (1 - m) (10x at 0.9) and needs about that many rounds to pay off;
        in a run of few rounds the full step overshoots from the first rounds on."""
        if rounds >= self.outer_warmup:
            return self.outer_lr, self.outer_momentum
        f = rounds / self.outer_warmup
        return 1.0 + (self.outer_lr - 1.0) * f, self.outer_momentum * f

    def after_train_epoch(self, model: nn.Module) -> None:
        """A round if steps are pending, then BN statistics and the inner momentum averaged (see above)."""
        if self.since_round:
            self.average()
        average_bn_statistics(model)
        average_in_place(self.inner_state())

    def inner_state(self) -> list[torch.Tensor]:
        """The inner optimizer's floating-point state tensors (momentum buffers), averaged at each epoch's end."""
        assert self.inner is not None
        return [
            v
            for state in self.inner.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0
        ]

    # ------------------------------------------------------------------------------ figures and state

    def epoch_stats(self) -> dict[str, Any]:
        row = super().epoch_stats()
        self.steps["run"] += self.steps["epoch"]
        self.steps["epoch"] = 0
        return row

    def per_step(self, stats: Any, period: str) -> dict[str, Any]:
        """The compressor's per-round figures turned into per-training-step ones (a round every H steps;
        ``stats.steps`` counts rounds)."""
        row = stats.per_step()
        steps, rounds = self.steps[period], stats.steps
        scale = rounds / steps if steps else 0.0
        for key in (
            K.bytes_sent_per_step,
            K.dense_bytes_per_step,
            K.wire_bytes_per_step,
            K.allreduce_calls_per_step,
            K.encode_ms_per_step,
            K.decode_ms_per_step,
            K.comm_ms_per_step,
            K.hidden_ms_per_step,
            K.comm_seconds_per_step,
        ):
            if row.get(key) is not None:
                row[key] *= scale
        return {**row, K.rounds: rounds, K.steps_per_round: steps / rounds if rounds else None}

    def state_dict(self) -> dict[str, Any]:
        """The outer optimizer's state (a checkpoint is taken at an epoch's end, where the model is the anchor)."""
        assert self.outer is not None
        return {"outer": self.outer.state_dict(), "rounds": self.rounds}

    def round_state(self) -> dict[str, Any]:
        """``state_dict`` and where the round is: the anchor and the round's step count (what a worker that takes
        over mid-round, such as a healing replica, needs)."""
        return {
            **self.state_dict(),
            "anchor": [a.clone() for a in self.anchor],
            "since_round": self.since_round,
            "lr_sum": float(self.lr_sum),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the trainer restored the model: the anchor is the model (every epoch ends with a round), or, from
        a ``round_state`` taken mid-round, that anchor, from which this worker starts the rest of the round."""
        assert self.outer is not None
        with torch.no_grad():
            for a, p, peer in zip(self.anchor, self.params, state.get("anchor") or self.params):
                a.copy_(peer)
                p.copy_(a)
        self.since_round = int(state.get("since_round", 0))
        self.lr_sum = float(state.get("lr_sum", self.since_round))
        self.rounds = int(state.get("rounds", 0))
        if state.get("outer"):
            self.outer.load_state_dict(state["outer"])

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "sync_every": self.sync_every,
            "local_after_epochs": self.local_after_epochs,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "outer_warmup_rounds": self.outer_warmup if self.name == "diloco" else None,
            "bytes_sent_scope": "payload each worker hands to the collectives per training step: one "
            "pseudo-gradient every sync_every steps, averaged over the steps",
        }
