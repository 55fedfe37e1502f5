"""From the compression section of the config to a compressor and its DDP hook: the glue a mode calls
(see ``config.py`` for the flags and their alternative spellings, ``spec.py`` for the one description)."""

from __future__ import annotations

from typing import Any

from torch import nn

from trainscale.compression.config import CompressionConfig
from trainscale.compression.ddp_hook import CompressionHookState, compression_hook, ddp_kwargs_for
from trainscale.compression.spec import FLAG_PARAMS, CompressionSpec, split_compress_flag
from trainscale.errors import ConfigError

CompressionPlan = CompressionSpec  # the resolved settings of a run, under the name the modes import

__all__ = [
    "FLAG_PARAMS",
    "CompressionPlan",
    "CompressionSpec",
    "ddp_kwargs",
    "make_hook",
    "plan_from_config",
    "split_compress_flag",
    "validate_compression",
]


def plan_from_config(cfg: CompressionConfig, seed: int) -> CompressionSpec:
    """Resolve and validate the compression flags; errors are one-line ConfigErrors naming the flag."""
    return CompressionSpec.from_config(cfg, seed)


def make_hook(plan: CompressionSpec, ddp: nn.Module) -> tuple[CompressionHookState, Any]:
    """The compression hook and its state for a DDP model (state keyed by parameter name)."""
    return plan.hook_state(ddp), compression_hook


def ddp_kwargs(plan: CompressionSpec, model: nn.Module) -> dict[str, Any]:
    return ddp_kwargs_for(plan.granularity, model) if plan.enabled else {}


def validate_compression(cfg: CompressionConfig, seed: int, epochs: float) -> CompressionSpec:
    """The method exists and takes the given parameters with valid values; the warm-up fits the run."""
    plan = plan_from_config(cfg, seed)
    plan.warn_if_unwise()
    if not 0 <= cfg.compress_warmup_epochs < epochs:
        raise ConfigError(f"--compress-warmup-epochs must be in [0, epochs={epochs}), got {cfg.compress_warmup_epochs}")
    return plan
