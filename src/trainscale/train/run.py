"""Entry point of one training job in this process, whatever the mode."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from trainscale.parallel.modes import create_mode
from trainscale.train.config import TrainConfig
from trainscale.train.precision import resolve_device
from trainscale.train.setup import build_trainer

log = logging.getLogger("trainscale.train")


def worker_threads(cfg: TrainConfig) -> int | None:
    """``--threads``; under a launcher, the node's cores split over its workers (torchrun's default of 1
    thread per worker would leave most cores idle); otherwise None (torch's default)."""
    if cfg.threads:
        return cfg.threads
    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if not local_workers:
        return None
    from trainscale.parallel.launch import threads_per_worker

    return threads_per_worker(cfg, local_workers)


def run_training(cfg: TrainConfig) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Train as configured; returns the summary and the per-epoch rows (empty off the main process)."""
    threads = worker_threads(cfg)
    if threads:
        torch.set_num_threads(threads)
    mode = create_mode(cfg.mode, cfg=cfg)
    device = mode.worker_device(resolve_device(cfg.device))
    runner = mode.role_runner(device)  # parameter-server modes: shards serve, worker ranks supervise a trainer
    if runner is not None:
        return runner()
    with mode.session(device):
        trainer = build_trainer(cfg, device, mode)
        summary = trainer.fit()
    history = trainer.writer.history if trainer.writer else []
    return summary, history
