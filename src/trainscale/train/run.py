"""Entry point of one training job in this process, whatever the mode."""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainscale.parallel.modes import create_mode
from trainscale.train.config import TrainConfig
from trainscale.train.precision import resolve_device
from trainscale.train.setup import build_trainer

log = logging.getLogger("trainscale.train")


def run_training(cfg: TrainConfig) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Train as configured; returns the summary and the per-epoch rows (empty off the main process)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    mode = create_mode(cfg.mode)
    with mode.session(device):
        trainer = build_trainer(cfg, device, mode)
        summary = trainer.fit()
    history = trainer.writer.history if trainer.writer else []
    return summary, history
