"""The run's configuration: every section joined into one flat ``TrainConfig``, read from defaults, a
TOML file and flags (later wins), and checked by each section's owner.

The sections are declared where they belong (``trainscale.config`` for the core, each mode and
``compression`` for their own); this module is the one place that knows them all. ``TrainConfig`` is
built from the registered modes' sections, so a new mode's settings appear here, in ``--help`` and in
``config.json`` without an edit outside the mode's own file.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from trainscale.compression.config import CompressionConfig
from trainscale.compression.setup import validate_compression
from trainscale.config import CoreConfig, Section, coerce, field_types, flag_name, section_of
from trainscale.errors import ConfigError, require
from trainscale.modes import list_modes, mode_class
from trainscale.train.checks import validate_engine

BACKENDS = ("auto", "gloo", "nccl")


def _compose() -> type[CoreConfig]:
    """One dataclass with every section's fields: the modes' sections, plus the core and compression."""
    sections: list[type[Section]] = []
    for name in list_modes():
        section = mode_class(name).section
        if section is not None and section not in sections:
            sections.append(section)
    extra = [b for b in (CompressionConfig, CoreConfig) if not any(issubclass(s, b) for s in sections)]
    cls = dataclasses.make_dataclass("TrainConfig", [], bases=(*sections, *extra))
    cls.__module__, cls.__qualname__ = __name__, "TrainConfig"  # picklable: workers receive it
    cls.__doc__ = "The whole configuration of a run: every section's fields, flat."
    return cls


TrainConfig = _compose()
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
TYPES = field_types(TrainConfig)


def _line_of(text: str, key: str) -> int | None:
    pattern = re.compile(rf"^[ \t]*{re.escape(key)}[ \t]*=", re.MULTILINE)
    match = pattern.search(text)
    return text.count("\n", 0, match.start()) + 1 if match else None


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config; an unknown key or a value of the wrong type is an error naming the file, line,
    key, the expected type and the value as written."""
    path = Path(path)
    try:
        text = path.read_text()
        raw = tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read as text ({type(exc).__name__})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        line = _line_of(text, key)
        where = f"{path}:{line}" if line else str(path)
        if name not in FIELDS:
            raise ConfigError(f"{where}: unknown key '{key}'; valid keys are the `trainscale train` flags")
        values[name] = typed(name, value, f"{where}: key '{key}'")
    return values


def typed(name: str, value: Any, where: str) -> Any:
    """``value`` checked against field ``name``'s type (ints widen to floats); else a ConfigError."""
    try:
        return coerce(TYPES[name], value)
    except TypeError as exc:
        raise ConfigError(f"{where} must be {exc}, got {value!r} ({type(value).__name__})") from None


def build_config(*layers: dict[str, Any]) -> CoreConfig:
    """Merge layers left to right over the defaults (later wins), then validate."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update({k: v for k, v in layer.items() if v is not None or k in ("out",)})
    unknown = sorted(set(merged) - set(FIELDS))
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(unknown)}")
    merged = {k: typed(k, v, f"setting '{k}' ({flag_name(FIELDS[k])})") for k, v in merged.items()}
    cfg = TrainConfig(**merged)
    validate_engine(cfg)
    validate_launch(cfg)
    cfg = resolve_parallel(cfg)
    validate_mode(cfg)
    return cfg


def validate_launch(cfg: CoreConfig) -> None:
    """The launcher's settings: process counts, rendezvous, devices."""
    require(cfg.workers is None or cfg.workers > 0, f"--workers must be a positive integer, got {cfg.workers}")
    require(cfg.nnodes > 0, f"--nnodes must be a positive integer, got {cfg.nnodes}")
    require(0 <= cfg.node_rank < cfg.nnodes, f"--node-rank must be in 0..{cfg.nnodes - 1}, got {cfg.node_rank}")
    require(cfg.max_restarts >= 0, f"--max-restarts must be >= 0, got {cfg.max_restarts}")
    require(cfg.dist_timeout > 0, f"--dist-timeout must be > 0 seconds, got {cfg.dist_timeout}")
    require(cfg.rdzv_timeout > 0, f"--rdzv-timeout must be > 0 seconds, got {cfg.rdzv_timeout}")
    require(cfg.backend in BACKENDS, f"--backend must be one of {', '.join(BACKENDS)}, got '{cfg.backend}'")
    require(not cfg.devices or (len(set(cfg.devices)) == len(cfg.devices) and min(cfg.devices) >= 0),
            f"--devices must list distinct GPU indices, got {cfg.devices}")
    require(not cfg.devices or cfg.workers in (None, len(cfg.devices)),
            f"--workers {cfg.workers} but --devices lists {len(cfg.devices or [])} GPU(s): one worker per GPU")
    require(cfg.rdzv_endpoint is None or _endpoint_ok(cfg.rdzv_endpoint),
            f"--rdzv-endpoint must be HOST:PORT (port 1-65535), got '{cfg.rdzv_endpoint}'")
    require(cfg.nnodes == 1 or cfg.rdzv_endpoint is not None,
            "--nnodes > 1 needs --rdzv-endpoint HOST:PORT of node 0 (the same on every node)")
    require(not cfg.ssh or cfg.hosts is not None, "--ssh runs the per-node commands of --hosts FILE; give --hosts")


def _endpoint_ok(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def resolve_parallel(cfg: CoreConfig) -> CoreConfig:
    """Fill in ``workers`` and the mode: several processes (``--workers``/``--devices``/``--nnodes``/
    ``--hosts``, or a launcher's WORLD_SIZE > 1) imply ``sync`` when ``--mode`` is left at ``auto``;
    parameter-server shards (``--servers``) imply ``async``."""
    workers = cfg.workers or (len(cfg.devices) if cfg.devices else 1)
    launched_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    several = workers > 1 or cfg.nnodes > 1 or launched_world > 1 or cfg.hosts is not None
    mode = cfg.mode
    if mode == "auto" and getattr(cfg, "servers", 0):
        mode = "async"
    if mode == "auto":
        mode = "sync" if several else "local"
    elif mode == "local" and several:
        what = f"WORLD_SIZE={launched_world} from the launcher" if launched_world > 1 else \
            f"--workers {workers}" if workers > 1 else "--nnodes/--hosts"
        raise ConfigError(f"--mode local trains in one process but {what} asks for several; "
                          "use --mode sync (or leave --mode out)")
    return dataclasses.replace(cfg, workers=workers, mode=mode)


def validate_mode(cfg: CoreConfig) -> None:
    """The mode's own checks; settings of other modes' sections left at their defaults; compression
    only where the mode exchanges something it can compress."""
    mode = mode_class(cfg.mode)
    for name, field in FIELDS.items():
        owner = section_of(TrainConfig, name)
        foreign = owner not in CoreConfig.__mro__ and owner is not CompressionConfig and \
            not (mode.section is not None and issubclass(mode.section, owner))
        if foreign and getattr(cfg, name) != _default(field):
            what = getattr(owner, "FOR", f"--mode {', '.join(_modes_with(owner))}")
            raise ConfigError(f"{flag_name(field)} is for {what}, not --mode {cfg.mode}")
    mode.validate(cfg)
    plan = validate_compression(cfg, cfg.seed, cfg.epochs)
    require(not (plan.enabled or cfg.error_feedback) or mode.accepts_compression,
            f"--compress {plan.method} compresses the gradients workers exchange: it needs --workers N >= 2 "
            f"(sync mode), not --mode {cfg.mode}")


def _default(field: dataclasses.Field) -> Any:
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def _modes_with(section: type) -> list[str]:
    return [n for n in list_modes() if (s := mode_class(n).section) is not None and issubclass(s, section)]
