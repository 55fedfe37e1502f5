"""Checks of the settings the engine owns (data, optimisation, execution), made before anything runs.

Each failure is one line naming the flag (a ConfigError). Checks that need the data or a device come
later, in ``setup``; the launcher's and the modes' settings are checked by their owners.
"""

from __future__ import annotations

import torch

import trainscale.train.optimizers  # noqa: F401  (registers sgd and muon)
from trainscale.config import CoreConfig
from trainscale.data import DATASETS
from trainscale.errors import require
from trainscale.models import MODELS
from trainscale.train.optim import check_optimizer
from trainscale.train.precision import PRECISION_CHOICES
from trainscale.train.schedules import SCHEDULES
from trainscale.train.step import refusal, step_blockers


def validate_engine(cfg: CoreConfig) -> None:
    """Ranges and names of the engine's settings."""
    require(cfg.optim.batch_size > 0, f"--batch-size must be a positive integer, got {cfg.optim.batch_size}")
    require(
        cfg.optim.batch_per_worker is None or cfg.optim.batch_per_worker > 0,
        f"--batch-per-worker must be a positive integer, got {cfg.optim.batch_per_worker}",
    )
    require(cfg.optim.lr >= 0, f"--lr must be >= 0, got {cfg.optim.lr}")
    require(0 <= cfg.optim.momentum < 1, f"--momentum must be in [0, 1), got {cfg.optim.momentum}")
    require(not cfg.optim.nesterov or cfg.optim.momentum > 0, "--nesterov needs --momentum > 0")
    require(cfg.optim.weight_decay >= 0, f"--weight-decay must be >= 0, got {cfg.optim.weight_decay}")
    require(0 <= cfg.optim.label_smoothing < 1, f"--label-smoothing must be in [0, 1), got {cfg.optim.label_smoothing}")
    require(
        cfg.run.precision in PRECISION_CHOICES,
        f"--precision must be one of {', '.join(PRECISION_CHOICES)}, got '{cfg.run.precision}'",
    )
    require(
        cfg.optim.lr_scaling in ("none", "linear"),
        f"--lr-scaling must be 'none' or 'linear', got '{cfg.optim.lr_scaling}'",
    )
    require(cfg.optim.base_batch_size > 0, f"--base-batch-size must be positive, got {cfg.optim.base_batch_size}")
    for name, value in (
        ("train_subset", cfg.data.train_subset),
        ("test_subset", cfg.data.test_subset),
        ("image_size", cfg.data.image_size),
        ("threads", cfg.run.threads),
    ):
        require(value is None or value > 0, f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    require(cfg.data.crop_padding >= 0 and cfg.data.cutout >= 0, "--crop-padding and --cutout must be >= 0")
    require(
        cfg.run.target_acc is None or 0 < cfg.run.target_acc <= 1,
        f"--target-acc is a fraction in (0, 1] (e.g. 0.94), got {cfg.run.target_acc}",
    )
    require(
        cfg.run.eval_every >= 0,
        f"--eval-every must be 0 (the last epoch only) or a positive number of epochs, got {cfg.run.eval_every}",
    )
    require(
        cfg.optim.warmup_epochs is None or 0 <= cfg.optim.warmup_epochs <= cfg.optim.epochs,
        f"--warmup-epochs must be in [0, epochs={cfg.optim.epochs}], got {cfg.optim.warmup_epochs}",
    )
    require(
        list(cfg.optim.milestones) == sorted(cfg.optim.milestones) and all(m >= 1 for m in cfg.optim.milestones),
        f"--milestones must be increasing 1-based epoch numbers (>= 1), got {cfg.optim.milestones}",
    )
    late = [m for m in cfg.optim.milestones if m - 1 >= cfg.optim.epochs]
    require(
        cfg.optim.schedule != "step" or not late,
        f"--milestones {','.join(f'{m:g}' for m in late)}: after the run's last epoch (--epochs {cfg.optim.epochs}), "
        "so the learning rate would never decay there; give milestones within the run or leave --milestones out "
        "(a recipe's are scaled to --epochs)",
    )
    _check_optimizer(cfg)
    require(
        cfg.optim.tta_translate == 0 or (cfg.optim.tta and 0 < cfg.optim.tta_translate < 8),
        f"--tta-translate must be 0, or 1-7 pixels with --tta, got {cfg.optim.tta_translate}"
        f"{'' if cfg.optim.tta else ' without --tta'}",
    )
    require(cfg.data.flip or not cfg.data.alternate_flip, "--alternate-flip alternates flips: it needs --flip")
    _check_names(cfg)


def _check_optimizer(cfg: CoreConfig) -> None:
    require(cfg.optim.muon_lr >= 0, f"--muon-lr must be >= 0, got {cfg.optim.muon_lr}")
    require(0 <= cfg.optim.muon_momentum < 1, f"--muon-momentum must be in [0, 1), got {cfg.optim.muon_momentum}")
    require(cfg.optim.head_lr_factor > 0, f"--head-lr-factor must be > 0, got {cfg.optim.head_lr_factor}")
    check_optimizer(cfg.optim)  # the name (or import path), and its --optim-arg keys and values


def _check_names(cfg: CoreConfig) -> None:
    """Unknown model, dataset or schedule names: a ConfigError with a did-you-mean."""
    MODELS.get(cfg.data.model)
    DATASETS.get(cfg.data.dataset)
    SCHEDULES.get(cfg.optim.schedule)


def check_step(cfg: CoreConfig) -> None:
    """What ``train.step.choose_step`` refuses, where the settings alone tell (before any worker starts); the
    mode resolved first (``auto`` is ``local`` or ``sync`` by then, or a parameter-server mode)."""
    step = cfg.run.train_step
    require(
        cfg.run.compile_mode == "default" or step != "eager" or cfg.run.compile,
        f"--compile-mode {cfg.run.compile_mode} applies to a compiled step or model: add --train-step compiled, "
        "graphed, captured or auto, or --compile",
    )
    if step in ("auto", "eager"):
        return
    several = (cfg.launch.processes() or 1) > 1
    wrapping = "mode" if cfg.run.mode not in ("local", "sync") else "ddp" if several else "none"
    device = cfg.run.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = "cpu" if device == "cpu" else "cuda"
    o = cfg.optim
    blocked = step_blockers(step, wrapping, device, cfg.run.precision, o.nonfinite, o.accumulate, o.clip_grad_norm)
    require(not blocked, refusal(step, blocked))
