"""Checks of the settings the engine owns (data, optimisation, execution), made before anything runs.

Each failure is one line naming the flag (a ConfigError). Checks that need the data or a device come
later, in ``setup``; the launcher's and the modes' settings are checked by their owners.
"""

from __future__ import annotations

from trainscale.config import CoreConfig
from trainscale.data import DATASETS
from trainscale.errors import require
from trainscale.models import MODELS
from trainscale.train.schedules import SCHEDULES

PRECISIONS = ("fp32", "bf16", "fp16")


OPTIMIZERS = ("sgd", "muon")


def validate_engine(cfg: CoreConfig) -> None:
    """Ranges and names of the engine's settings."""
    require(cfg.epochs > 0, f"--epochs must be a positive integer, got {cfg.epochs}")
    require(cfg.batch_size > 0, f"--batch-size must be a positive integer, got {cfg.batch_size}")
    require(cfg.batch_per_worker is None or cfg.batch_per_worker > 0,
            f"--batch-per-worker must be a positive integer, got {cfg.batch_per_worker}")
    require(cfg.lr >= 0, f"--lr must be >= 0, got {cfg.lr}")
    require(0 <= cfg.momentum < 1, f"--momentum must be in [0, 1), got {cfg.momentum}")
    require(not cfg.nesterov or cfg.momentum > 0, "--nesterov needs --momentum > 0")
    require(cfg.weight_decay >= 0, f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    require(0 <= cfg.label_smoothing < 1, f"--label-smoothing must be in [0, 1), got {cfg.label_smoothing}")
    require(cfg.precision in PRECISIONS, f"--precision must be one of {', '.join(PRECISIONS)}, got '{cfg.precision}'")
    require(cfg.lr_scaling in ("none", "linear"), f"--lr-scaling must be 'none' or 'linear', got '{cfg.lr_scaling}'")
    require(cfg.base_batch_size > 0, f"--base-batch-size must be positive, got {cfg.base_batch_size}")
    for name in ("train_subset", "test_subset", "image_size", "threads"):
        value = getattr(cfg, name)
        require(value is None or value > 0, f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    require(cfg.crop_padding >= 0 and cfg.cutout >= 0, "--crop-padding and --cutout must be >= 0")
    require(cfg.target_acc is None or 0 < cfg.target_acc <= 1,
            f"--target-acc is a fraction in (0, 1] (e.g. 0.94), got {cfg.target_acc}")
    require(cfg.eval_every >= 0, f"--eval-every must be 0 (the last epoch only) or a positive number of epochs, "
                                 f"got {cfg.eval_every}")
    require(cfg.warmup_epochs is None or 0 <= cfg.warmup_epochs <= cfg.epochs,
            f"--warmup-epochs must be in [0, epochs={cfg.epochs}], got {cfg.warmup_epochs}")
    require(list(cfg.milestones) == sorted(cfg.milestones) and all(m > 0 for m in cfg.milestones),
            f"--milestones must be increasing positive epoch numbers, got {cfg.milestones}")
    _check_optimizer(cfg)
    require(cfg.tta_translate == 0 or (cfg.tta and 0 < cfg.tta_translate < 8),
            f"--tta-translate must be 0, or 1-7 pixels with --tta, got {cfg.tta_translate}"
            f"{'' if cfg.tta else ' without --tta'}")
    require(cfg.flip or not cfg.alternate_flip, "--alternate-flip alternates flips: it needs --flip")
    _check_names(cfg)


def _check_optimizer(cfg: CoreConfig) -> None:
    require(cfg.muon_lr >= 0, f"--muon-lr must be >= 0, got {cfg.muon_lr}")
    require(0 <= cfg.muon_momentum < 1, f"--muon-momentum must be in [0, 1), got {cfg.muon_momentum}")
    require(cfg.head_lr_factor > 0, f"--head-lr-factor must be > 0, got {cfg.head_lr_factor}")
    require(cfg.optimizer in OPTIMIZERS, f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got '{cfg.optimizer}'")


def _check_names(cfg: CoreConfig) -> None:
    """Unknown model, dataset or schedule names: a ConfigError with a did-you-mean."""
    MODELS.get(cfg.model)
    DATASETS.get(cfg.dataset)
    SCHEDULES.get(cfg.schedule)
