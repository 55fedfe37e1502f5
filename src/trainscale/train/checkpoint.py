"""Per-epoch checkpoints, written atomically and loaded with ``weights_only=True``.

A checkpoint holds everything that makes ``--resume`` continue bit for bit: model, optimizer, grad scaler, the
weight average of ``--ema`` (``ema.WeightAverage``), the RNG states, the finished epoch and the running totals.
Data order and augmentation are seeded from (seed, epoch), so they need no state of their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainscale.errors import ConfigError
from trainscale.io import atomic_write_bytes

CHECKPOINT_NAME = "checkpoint.pt"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    atomic_write_bytes(path, lambda f: torch.save(state, f))


def load_checkpoint(path: Path, map_location: torch.device | str = "cpu") -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"--resume: no checkpoint at {path}; run without --resume to start fresh")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which and what to do
        raise ConfigError(
            f"--resume: cannot read checkpoint {path} ({type(exc).__name__}: {exc}); delete it to start fresh"
        ) from None
