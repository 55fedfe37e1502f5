"""The resolved training configuration: defaults, then a TOML file, then command-line flags.

One flat dataclass, so `config.json` in every run folder is exactly what ran and a TOML file can hold
any flag under the same name (dashes or underscores).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainscale.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")
BACKENDS = ("auto", "gloo", "nccl")


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
    mode: str = "auto"
    # Data-parallel execution (see parallel/launch.py). workers: processes on this node (None: one, or
    # one per --devices entry); the world is workers x nnodes.
    workers: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_timeout: float = 300.0
    hosts: str | None = None
    ssh: bool = False
    devices: list[int] | None = None
    sync_bn: bool = False
    backend: str = "auto"
    max_restarts: int = 0
    dist_timeout: float = 300.0
    baseline: str | None = None
    # Parameter-server modes (async, ps-sync, ma; see parallel/ps/): server shards per node beside the
    # --workers; staleness bounds ASGD (None: unbounded); average_every: ma's period in steps (None: 4).
    servers: int = 0
    staleness: int | None = None
    average_every: int | None = None
    warm_start_epochs: int = 0
    rpc_timeout: float = 300.0
    # Compressed gradient communication (see compression/): compress is a method, or seed 004's
    # granularity spelling (layerwise/entiremodel); method/granularity override it when given.
    compress: str = "none"
    method: str | None = None
    granularity: str | None = None
    ratio: float | None = None
    threshold: float | None = None
    qstates: int | None = None
    powersgd_rank: int | None = None
    error_feedback: bool = False
    compress_warmup_epochs: int = 0

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
    return _validate_compression(_validate_ps(resolve_parallel(cfg)))


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
    _validate_parallel(cfg)
    _validate_names(cfg)


def _validate_parallel(cfg: TrainConfig) -> None:
    _require(cfg.workers is None or cfg.workers > 0, f"--workers must be a positive integer, got {cfg.workers}")
    _require(cfg.nnodes > 0, f"--nnodes must be a positive integer, got {cfg.nnodes}")
    _require(0 <= cfg.node_rank < cfg.nnodes, f"--node-rank must be in 0..{cfg.nnodes - 1}, got {cfg.node_rank}")
    _require(cfg.max_restarts >= 0, f"--max-restarts must be >= 0, got {cfg.max_restarts}")
    _require(cfg.dist_timeout > 0, f"--dist-timeout must be > 0 seconds, got {cfg.dist_timeout}")
    _require(cfg.rdzv_timeout > 0, f"--rdzv-timeout must be > 0 seconds, got {cfg.rdzv_timeout}")
    _require(cfg.backend in BACKENDS, f"--backend must be one of {', '.join(BACKENDS)}, got '{cfg.backend}'")
    _require(not cfg.devices or (len(set(cfg.devices)) == len(cfg.devices) and min(cfg.devices) >= 0),
             f"--devices must list distinct GPU indices, got {cfg.devices}")
    _require(not cfg.devices or cfg.workers in (None, len(cfg.devices)),
             f"--workers {cfg.workers} but --devices lists {len(cfg.devices or [])} GPU(s): one worker per GPU")
    _require(cfg.rdzv_endpoint is None or _endpoint_ok(cfg.rdzv_endpoint),
             f"--rdzv-endpoint must be HOST:PORT (port 1-65535), got '{cfg.rdzv_endpoint}'")
    _require(cfg.nnodes == 1 or cfg.rdzv_endpoint is not None,
             "--nnodes > 1 needs --rdzv-endpoint HOST:PORT of node 0 (the same on every node)")
    _require(not cfg.ssh or cfg.hosts is not None, "--ssh runs the per-node commands of --hosts FILE; give --hosts")


def _endpoint_ok(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def resolve_parallel(cfg: TrainConfig) -> TrainConfig:
    """Fill in ``workers`` and the mode: several processes (``--workers``/``--devices``/``--nnodes``/
    ``--hosts``, or a launcher's WORLD_SIZE > 1) imply ``sync`` when ``--mode`` is left at ``auto``."""
    workers = cfg.workers or (len(cfg.devices) if cfg.devices else 1)
    launched_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    several = workers > 1 or cfg.nnodes > 1 or launched_world > 1 or cfg.hosts is not None
    mode = cfg.mode
    if mode == "auto" and cfg.servers:  # parameter-server shards asked for: ASGD unless --mode says otherwise
        mode = "async"
    if mode == "auto":
        mode = "sync" if several else "local"
    elif mode == "local" and several:
        what = f"WORLD_SIZE={launched_world} from the launcher" if launched_world > 1 else \
            f"--workers {workers}" if workers > 1 else "--nnodes/--hosts"
        raise ConfigError(f"--mode local trains in one process but {what} asks for several; "
                          "use --mode sync (or leave --mode out)")
    return dataclasses.replace(cfg, workers=workers, mode=mode)


def _validate_ps(cfg: TrainConfig) -> TrainConfig:
    """Parameter-server settings, checked once the mode is resolved; returns ``cfg``."""
    from trainscale.parallel.ps.mode import PS_MODES

    ps, mode = cfg.mode in PS_MODES, cfg.mode
    _require(isinstance(cfg.servers, int) and cfg.servers >= 0, f"--servers must be >= 0, got {cfg.servers}")
    _require(not ps or cfg.servers >= 1, f"--mode {mode} needs --servers S >= 1 (parameter-server shards per node)")
    _require(ps or cfg.servers == 0, f"--servers is for the parameter-server modes (--mode async, ps-sync or ma), "
                                     f"not --mode {mode}")
    _require(cfg.staleness is None or cfg.staleness >= 0, f"--staleness must be >= 0 steps, got {cfg.staleness}")
    _require(cfg.staleness is None or mode == "async", "--staleness bounds ASGD; use it with --mode async")
    _require(cfg.average_every is None or cfg.average_every >= 1,
             f"--average-every must be a positive number of steps, got {cfg.average_every}")
    _require(cfg.average_every is None or mode == "ma", "--average-every is the period of --mode ma")
    _require(0 <= cfg.warm_start_epochs < cfg.epochs,
             f"--warm-start-epochs must be in [0, epochs={cfg.epochs}), got {cfg.warm_start_epochs}")
    _require(cfg.warm_start_epochs == 0 or ps, "--warm-start-epochs is for the parameter-server modes")
    _require(cfg.rpc_timeout > 0, f"--rpc-timeout must be > 0 seconds, got {cfg.rpc_timeout}")
    _require(not ps or cfg.max_restarts == 0, "--max-restarts is not supported with parameter-server modes (a dead "
                                              "worker does not stop the job; continue a stopped one with --resume)")
    return cfg


def _validate_compression(cfg: TrainConfig) -> TrainConfig:
    """Compression flags resolve to a method the registry knows, with values it accepts; returns ``cfg``."""
    from trainscale.compression.setup import plan_from_config

    plan = plan_from_config(cfg)
    _require(0 <= cfg.compress_warmup_epochs < cfg.epochs,
             f"--compress-warmup-epochs must be in [0, epochs={cfg.epochs}), got {cfg.compress_warmup_epochs}")
    compressing = plan.enabled or cfg.error_feedback
    _require(not compressing or cfg.mode == "sync",
             f"--compress {plan.method} compresses the gradients workers exchange: it needs --workers N >= 2 "
             f"(sync mode), not --mode {cfg.mode}")
    return cfg


def _validate_names(cfg: TrainConfig) -> None:
    from trainscale.data import DATASETS
    from trainscale.models import MODELS
    from trainscale.parallel.modes import MODES
    from trainscale.train.schedules import SCHEDULES

    MODELS.get(cfg.model)
    if cfg.mode != "auto":
        MODES.get(cfg.mode)
    DATASETS.get(cfg.dataset)
    SCHEDULES.get(cfg.schedule)
