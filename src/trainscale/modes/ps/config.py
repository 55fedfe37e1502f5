"""The parameter-server section of the configuration and its checks (``--mode async``, ``ps-sync``, ``ma``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainscale.compression.config import CompressionConfig
from trainscale.config import CoreConfig, option
from trainscale.errors import ConfigError

PS_MODES = ("async", "ps-sync", "ma")
DEFAULT_AVERAGE_EVERY = 4


@dataclass
class PSConfig(CompressionConfig, CoreConfig):
    """Server shards per node beside ``--workers``; ``staleness`` bounds ASGD (None: unbounded);
    ``average_every``: ma's period in steps (None: 4)."""

    TITLE: ClassVar[str] = "parameter server (--mode async, ps-sync, ma)"
    FOR: ClassVar[str] = "the parameter-server modes (--mode async, ps-sync or ma)"

    servers: int = option(0, "parameter-server shards per node, started beside --workers (same launcher)")
    staleness: int | None = option(None, "async: a worker more than K steps ahead of the slowest waits (default: "
                                   "unbounded)")
    average_every: int | None = option(None, "ma: average the workers' parameters every STEPS steps (default 4)")
    warm_start_epochs: int = option(0, "train on the main worker alone for the first E epochs (default 0)")
    rpc_timeout: float = option(300.0, "seconds a push or pull may take before the worker stops with an error")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_ps(cfg: PSConfig) -> None:
    """Parameter-server settings of a run whose mode is one of ``PS_MODES``."""
    mode = cfg.mode
    _require(cfg.servers >= 1, f"--mode {mode} needs --servers S >= 1 (parameter-server shards per node)")
    _require(cfg.staleness is None or cfg.staleness >= 0, f"--staleness must be >= 0 steps, got {cfg.staleness}")
    _require(cfg.staleness is None or mode == "async", "--staleness bounds ASGD; use it with --mode async")
    _require(cfg.average_every is None or cfg.average_every >= 1,
             f"--average-every must be a positive number of steps, got {cfg.average_every}")
    _require(cfg.average_every is None or mode == "ma", "--average-every is the period of --mode ma")
    _require(0 <= cfg.warm_start_epochs < cfg.epochs,
             f"--warm-start-epochs must be in [0, epochs={cfg.epochs}), got {cfg.warm_start_epochs}")
    _require(cfg.rpc_timeout > 0, f"--rpc-timeout must be > 0 seconds, got {cfg.rpc_timeout}")
    _require(cfg.max_restarts == 0, "--max-restarts is not supported with parameter-server modes (a dead worker "
                                    "does not stop the job; continue a stopped one with --resume)")
