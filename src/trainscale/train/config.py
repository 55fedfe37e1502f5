"""The resolved training configuration: defaults, then a TOML file, then command-line flags.

One flat dataclass, so `config.json` in every run folder is exactly what ran and a TOML file can hold
any flag under the same name (dashes or underscores).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainscale.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class TrainConfig:
    model: str = "resnet9"
    dataset: str = "cifar10"
    data_dir: str | None = None
    verify: bool = True
    download: bool = True
    train_subset: int | None = None
    test_subset: int | None = None
    image_size: int | None = None
    epochs: int = 24
    batch_size: int = 512
    batch_per_worker: int | None = None
    lr: float = 0.4
    lr_scaling: str = "none"
    base_batch_size: int = 128
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    schedule: str = "onecycle"
    warmup_epochs: float | None = None
    milestones: list[int] = field(default_factory=lambda: [41, 61])
    gamma: float = 0.1
    label_smoothing: float = 0.0
    crop_padding: int = 4
    flip: bool = True
    cutout: int = 0
    tta: bool = False
    precision: str = "fp32"
    channels_last: bool = True
    compile: bool = False
    device: str = "auto"
    threads: int | None = None
    seed: int = 0
    target_acc: float | None = None
    out: str | None = None
    resume: bool = False
    checkpoint: bool = True
    progress: bool = True
    mode: str = "local"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _line_of(text: str, key: str) -> int | None:
    pattern = re.compile(rf"^[ \t]*{re.escape(key)}[ \t]*=", re.MULTILINE)
    match = pattern.search(text)
    return text.count("\n", 0, match.start()) + 1 if match else None


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config; an unknown key is an error naming the file and line, not silently ignored."""
    path = Path(path)
    try:
        text = path.read_text()
        raw = tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            line = _line_of(text, key)
            where = f"{path}:{line}" if line else str(path)
            raise ConfigError(f"{where}: unknown key '{key}'; valid keys are the `trainscale train` flags")
        values[name] = value
    return values


def build_config(*layers: dict[str, Any]) -> TrainConfig:
    """Merge layers left to right over the defaults (later wins), then validate."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update({k: v for k, v in layer.items() if v is not None or k in ("out",)})
    unknown = sorted(set(merged) - set(FIELDS))
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(unknown)}")
    cfg = TrainConfig(**merged)
    validate(cfg)
    return cfg


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: TrainConfig) -> None:
    """Checks that need no data or device; each failure is one line naming the flag."""
    _require(isinstance(cfg.epochs, int) and cfg.epochs > 0, f"--epochs must be a positive integer, got {cfg.epochs}")
    _require(cfg.batch_size > 0, f"--batch-size must be a positive integer, got {cfg.batch_size}")
    _require(cfg.batch_per_worker is None or cfg.batch_per_worker > 0,
             f"--batch-per-worker must be a positive integer, got {cfg.batch_per_worker}")
    _require(cfg.lr >= 0, f"--lr must be >= 0, got {cfg.lr}")
    _require(0 <= cfg.momentum < 1, f"--momentum must be in [0, 1), got {cfg.momentum}")
    _require(not cfg.nesterov or cfg.momentum > 0, "--nesterov needs --momentum > 0")
    _require(cfg.weight_decay >= 0, f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    _require(0 <= cfg.label_smoothing < 1, f"--label-smoothing must be in [0, 1), got {cfg.label_smoothing}")
    _require(cfg.precision in PRECISIONS, f"--precision must be one of {', '.join(PRECISIONS)}, got '{cfg.precision}'")
    _require(cfg.lr_scaling in ("none", "linear"), f"--lr-scaling must be 'none' or 'linear', got '{cfg.lr_scaling}'")
    _require(cfg.base_batch_size > 0, f"--base-batch-size must be positive, got {cfg.base_batch_size}")
    for name in ("train_subset", "test_subset", "image_size", "threads"):
        value = getattr(cfg, name)
        _require(value is None or value > 0, f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    _require(cfg.crop_padding >= 0 and cfg.cutout >= 0, "--crop-padding and --cutout must be >= 0")
    _require(cfg.target_acc is None or 0 < cfg.target_acc <= 1,
             f"--target-acc is a fraction in (0, 1] (e.g. 0.94), got {cfg.target_acc}")
    _require(cfg.warmup_epochs is None or 0 <= cfg.warmup_epochs <= cfg.epochs,
             f"--warmup-epochs must be in [0, epochs={cfg.epochs}], got {cfg.warmup_epochs}")
    _require(list(cfg.milestones) == sorted(cfg.milestones) and all(m > 0 for m in cfg.milestones),
             f"--milestones must be increasing positive epoch numbers, got {cfg.milestones}")
    _validate_names(cfg)


def _validate_names(cfg: TrainConfig) -> None:
    from trainscale.data import DATASETS
    from trainscale.models import MODELS
    from trainscale.parallel.modes import MODES
    from trainscale.train.schedules import SCHEDULES

    MODELS.get(cfg.model)
    MODES.get(cfg.mode)
    DATASETS.get(cfg.dataset)
    SCHEDULES.get(cfg.schedule)
