"""Build a ready-to-run Trainer from a TrainConfig: device, data, model, optimizer, run folder."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainscale.data import AugmentConfig, DeviceBatches, ImageTensors, load_dataset
from trainscale.data.sharding import check_world, train_shard_size
from trainscale.errors import ConfigError
from trainscale.models import count_parameters, create_model, model_info
from trainscale.parallel import broadcast_object, is_main_process, rank, world_size
from trainscale.parallel.faults import with_fault_injection
from trainscale.parallel.modes import Mode
from trainscale.train.config import TrainConfig
from trainscale.train.environment import environment
from trainscale.train.outputs import RunWriter
from trainscale.train.precision import Precision, resolve_device
from trainscale.train.schedules import create_schedule
from trainscale.train.trainer import Trainer

log = logging.getLogger("trainscale.train")

SYNTHETIC_SIZE = 50_000  # load_dataset's default size of each synthetic split


@dataclass(frozen=True)
class BatchPlan:
    """How ``--batch-size`` / ``--batch-per-worker`` split over workers, and the LR they imply."""

    per_worker: int
    global_batch: int
    lr: float

    @classmethod
    def resolve(cls, cfg: TrainConfig, workers: int) -> "BatchPlan":
        if cfg.batch_per_worker is not None:
            per_worker = cfg.batch_per_worker
        elif cfg.batch_size % workers:
            raise ConfigError(f"--batch-size {cfg.batch_size} is not divisible by {workers} workers; "
                              "choose a multiple or use --batch-per-worker")
        else:
            per_worker = cfg.batch_size // workers
        global_batch = per_worker * workers
        lr = cfg.lr * global_batch / cfg.base_batch_size if cfg.lr_scaling == "linear" else cfg.lr
        return cls(per_worker, global_batch, lr)


def default_out_dir(cfg: TrainConfig) -> Path:
    return Path("runs") / f"{cfg.model}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"


def synthetic_size(cfg: TrainConfig, subset: int | None) -> dict[str, int]:
    """Synthetic data: generate only the subset asked for (50,000 random images take seconds per process,
    and every worker makes its own); a subset larger than the set stays an error."""
    if cfg.dataset != "synthetic" or not subset or subset > SYNTHETIC_SIZE:
        return {}
    return {"synthetic_size": subset}


def load_data(cfg: TrainConfig) -> tuple[ImageTensors, ImageTensors]:
    size = cfg.image_size if cfg.dataset == "synthetic" else None
    common = dict(data_dir=cfg.data_dir, verify=cfg.verify, download=cfg.download, image_size=size)
    train = load_dataset(cfg.dataset, train=True, **common, **synthetic_size(cfg, cfg.train_subset))
    test = load_dataset(cfg.dataset, train=False, **common, **synthetic_size(cfg, cfg.test_subset))
    if cfg.train_subset:
        train = train.subset(cfg.train_subset)
    if cfg.test_subset:
        test = test.subset(cfg.test_subset)
    return train, test


def augment_for(cfg: TrainConfig, native: int, want: int) -> tuple[AugmentConfig, AugmentConfig]:
    """Train/eval pipelines: random crops smaller than the images (MXNet's 28x28), upscaling larger."""
    crop = want if want < native else None
    resize = want if want > native else None
    train = AugmentConfig(crop_padding=cfg.crop_padding, crop_size=crop, flip=cfg.flip, cutout=cfg.cutout,
                          resize=resize)
    test = AugmentConfig(crop_padding=0, crop_size=crop, flip=False, cutout=0, resize=resize)
    return train, test


def build_model(cfg: TrainConfig, num_classes: int, device: torch.device, train: ImageTensors) -> nn.Module:
    torch.manual_seed(cfg.seed)
    model = create_model(cfg.model, num_classes=num_classes)
    if hasattr(model, "data_init"):
        sample = train.images[:5000].to(device)
        model.to(device).data_init(normalise(sample, train))
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def normalise(images: torch.Tensor, data: ImageTensors) -> torch.Tensor:
    mean = torch.tensor(data.mean, device=images.device).view(1, -1, 1, 1)
    std = torch.tensor(data.std, device=images.device).view(1, -1, 1, 1)
    return (images.float() / 255 - mean) / std


def build_optimizer(cfg: TrainConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                           weight_decay=cfg.weight_decay)


def check_fits(cfg: TrainConfig, n_train: int, n_test: int, workers: int) -> BatchPlan:
    """The shard rules of ``DeviceBatches``, checked without building it (the launcher runs this before
    starting any worker): every rank needs samples and at least one full training batch."""
    plan = BatchPlan.resolve(cfg, workers)
    check_world(n_train, 0, workers)
    check_world(n_test, 0, workers)
    shard = train_shard_size(n_train, workers)
    if plan.per_worker > shard:
        raise ConfigError(f"batch size {plan.per_worker} per worker is larger than the {shard} training samples each "
                          f"of {workers} workers gets from {n_train}; use a smaller batch, fewer workers or more data")
    return plan


def resolve_out(cfg: TrainConfig) -> Path:
    return Path(cfg.out) if cfg.out else default_out_dir(cfg)


def check_run_folder(out: Path, resume: bool) -> None:
    """Refuse to start over an existing run unless resuming, and to resume nothing."""
    if not resume and (out / "checkpoint.pt").exists():
        raise ConfigError(f"--out {out} already holds a run; pass --resume to continue it or choose another --out")
    if resume and not (out / "checkpoint.pt").exists():
        raise ConfigError(f"--resume: no checkpoint at {out / 'checkpoint.pt'}; run without --resume to start fresh")


def restart_count() -> int:
    """How often torch's elastic agent has restarted this job's workers (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def wants_resume(cfg: TrainConfig, out: Path | None) -> bool:
    """``--resume``, or a restarted worker finding the failed attempt's checkpoint (decided by the main
    process, which owns the run folder, and shared so every rank agrees)."""
    if cfg.resume:
        return True
    if restart_count() == 0:
        return False
    found = out is not None and (out / "checkpoint.pt").exists()
    return bool(broadcast_object(found))


def run_folder(cfg: TrainConfig) -> tuple[RunWriter | None, bool]:
    """(the run folder on the main process, whether to resume); see ``check_run_folder``."""
    out = resolve_out(cfg) if is_main_process() else None
    resume = wants_resume(cfg, out)
    if out is None:
        return None, resume
    if not (resume and restart_count() > 0):
        check_run_folder(out, resume)
    return RunWriter(out), resume


def build_trainer(cfg: TrainConfig, device: torch.device, mode: Mode) -> Trainer:
    """Everything before the first step; errors here happen before any training time is spent."""
    precision = Precision(cfg.precision, device)
    writer, resume = run_folder(cfg)
    train, test = load_data(cfg)
    workers = world_size()
    plan = check_fits(cfg, len(train), len(test), workers)
    want = cfg.image_size or model_info(cfg.model).input_size
    aug_train, aug_test = augment_for(cfg, train.images.shape[-1], want)
    common = dict(device=device, rank=rank(), world_size=workers, seed=cfg.seed, channels_last=cfg.channels_last)
    train_batches = with_fault_injection(DeviceBatches(train, plan.per_worker, train=True, augment=aug_train,
                                                       **common), rank())
    test_batches = DeviceBatches(test, max(plan.per_worker, 500), train=False, augment=aug_test, **common)
    model = build_model(cfg, train.num_classes, device, train)
    params = count_parameters(model)
    if cfg.compile:
        model.compile()
    schedule = create_schedule(cfg)
    optimizer = mode.wrap_optimizer(build_optimizer(cfg, model, plan.lr), model)  # PS modes: push/pull
    train_batches, test_batches = mode.wrap_batches(train_batches, test_batches)
    trainer = Trainer(cfg=cfg, model=model, optimizer=optimizer, precision=precision,
                      train_batches=train_batches, test_batches=test_batches,
                      lr_at=lambda t: plan.lr * schedule(t), writer=writer,
                      train_model=mode.wrap_model(model, device), epoch_hooks=[mode.epoch_stats],
                      before_train_hooks=[mode.before_train_epoch],
                      after_train_hooks=[lambda: mode.after_train_epoch(model)], summary_hooks=[mode.run_stats],
                      baseline=load_baseline(cfg) if writer is not None else None,
                      summary_base={**summary_base(cfg, plan, params, device, want,
                                                   train_batches.num_samples * workers, writer), **mode.describe()})
    if resume:
        trainer.resume()
    if writer is not None:
        writer.write_config({**cfg.to_dict(), "out": str(writer.out), "resolved": {
            "batch_per_worker": plan.per_worker, "global_batch_size": plan.global_batch, "lr": plan.lr,
            "image_size": want, "device": str(device), "world_size": workers}})
    return trainer


def load_baseline(cfg: TrainConfig) -> dict[str, Any] | None:
    """The --baseline run's summary (for scaling efficiency), or None."""
    if not cfg.baseline:
        return None
    from trainscale.train.outputs import read_json

    path = Path(cfg.baseline) / "summary.json"
    if not path.is_file():
        raise ConfigError(f"--baseline {cfg.baseline}: no summary.json there; give the folder of a finished run")
    return read_json(path)


def summary_base(cfg: TrainConfig, plan: BatchPlan, params: int, device: torch.device, image_size: int,
                 epoch_samples: int, writer: RunWriter | None) -> dict[str, Any]:
    return {
        "out": str(writer.out) if writer else None,
        "model": cfg.model, "params": params, "dataset": cfg.dataset, "mode": cfg.mode, "world_size": world_size(),
        "epochs": cfg.epochs, "batch_size": plan.global_batch, "batch_per_worker": plan.per_worker, "lr": plan.lr,
        "precision": cfg.precision, "image_size": image_size, "train_samples_per_epoch": epoch_samples,
        "seed": cfg.seed, "environment": environment(device),
    }
