"""From the compression section of the config to a compressor and its DDP hook: the glue a mode calls
(see ``config.py`` for the flags and their alternative spellings)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from trainscale.compression.base import Compressor, canonical_method, compressor_params, create_compressor
from trainscale.compression.ddp_hook import (
    GRANULARITIES,
    CompressionHookState,
    canonical_granularity,
    compression_hook,
    ddp_kwargs_for,
)
from trainscale.compression.config import CompressionConfig
from trainscale.errors import ConfigError

log = logging.getLogger("trainscale.compression")

FLAG_PARAMS = {"ratio": "ratio", "threshold": "threshold", "qstates": "qstates", "qsgd_bucket": "bucket_size",
               "powersgd_rank": "rank"}


@dataclass(frozen=True)
class CompressionPlan:
    """The resolved compression settings of a run; ``method == 'none'`` means plain dense all-reduce."""

    method: str
    granularity: str
    params: dict[str, Any]
    error_feedback: bool
    warmup_epochs: int

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def compressor(self) -> Compressor:
        return create_compressor(self.method, **self.params)

    def describe(self) -> dict[str, Any]:
        return {"compress_method": self.method, "compress_granularity": self.granularity,
                "compress_params": self.params, "error_feedback": self.error_feedback,
                "compress_warmup_epochs": self.warmup_epochs}


def split_compress_flag(value: str) -> tuple[str | None, str | None]:
    """``--compress X``: a granularity (the layer-wise study's meaning) or a method; (method, granularity)."""
    if value.strip().lower() in GRANULARITIES or value.strip().lower() == "entiremodel":
        return None, canonical_granularity(value)
    return canonical_method(value), None


def plan_from_config(cfg: CompressionConfig, seed: int) -> CompressionPlan:
    """Resolve and validate the compression flags; errors are one-line ConfigErrors naming the flag."""
    method, granularity = split_compress_flag(cfg.compress)
    method = canonical_method(cfg.method) if cfg.method else (method or "none")
    granularity = canonical_granularity(cfg.granularity) if cfg.granularity else (granularity or "layerwise")
    accepted = compressor_params(method)
    params = {p: getattr(cfg, flag) for flag, p in FLAG_PARAMS.items()
              if p in accepted and getattr(cfg, flag) is not None}
    if "seed" in accepted:
        params["seed"] = seed
    unused = [f"--{flag.replace('_', '-')}" for flag, p in FLAG_PARAMS.items()
              if getattr(cfg, flag) is not None and p not in accepted]
    if unused:
        raise ConfigError(f"--compress {method} does not use {', '.join(unused)}; it takes: "
                          f"{', '.join(a for a in accepted if a != 'seed') or 'no parameters'}")
    plan = CompressionPlan(method, granularity, params, bool(cfg.error_feedback), int(cfg.compress_warmup_epochs))
    if plan.compressor().noisy and plan.error_feedback:  # bad values fail here, before any worker starts
        log.warning("--error-feedback with %s: an unbiased stochastic quantiser's error can exceed its input, and "
                    "fed back it grows from step to step (training may diverge); leave error feedback off, or use "
                    "more levels and smaller buckets", method)
    return plan


def make_hook(plan: CompressionPlan, ddp: nn.Module) -> tuple[CompressionHookState, Any]:
    """The compression hook and its state for a DDP model (state keyed by parameter name)."""
    state = CompressionHookState(plan.compressor(), plan.granularity, model=ddp, error_feedback=plan.error_feedback,
                                 warmup_epochs=plan.warmup_epochs)
    return state, compression_hook


def ddp_kwargs(plan: CompressionPlan, model: nn.Module) -> dict[str, Any]:
    return ddp_kwargs_for(plan.granularity, model) if plan.enabled else {}


def validate_compression(cfg: CompressionConfig, seed: int, epochs: int) -> CompressionPlan:
    """The method exists and takes the given parameters with valid values; the warm-up fits the run."""
    plan = plan_from_config(cfg, seed)
    if not 0 <= cfg.compress_warmup_epochs < epochs:
        raise ConfigError(f"--compress-warmup-epochs must be in [0, epochs={epochs}), "
                          f"got {cfg.compress_warmup_epochs}")
    return plan
