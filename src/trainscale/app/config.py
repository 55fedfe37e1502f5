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
import unicodedata
from pathlib import Path
from typing import Any

from trainscale.compression.config import CompressionConfig
from trainscale.compression.setup import validate_compression
from trainscale.config import CoreConfig, Section, coerce, field_types, flag_name, section_of
from trainscale.errors import ConfigError, require
from trainscale.io import read_toml
from trainscale.models import model_info
from trainscale.modes import list_modes, mode_class
from trainscale.recipes import get_recipe
from trainscale.runtime.cluster import validate_name
from trainscale.train.checks import validate_engine

BACKENDS = ("auto", "gloo", "nccl")
NONFINITE = ("stop", "skip")
INT_LIMIT = 2**63  # TOML's integers are 64-bit; tomllib reads any size, which torch and float() refuse later
UNPRINTABLE = ("Cc", "Cf", "Cs", "Zl", "Zp")  # control, format, surrogate and line-break characters


def _compose() -> type[CoreConfig]:
    """One dataclass with every section's fields: the modes' sections, plus the core and compression."""
    sections: list[type[Section]] = []
    for name in list_modes():
        section = mode_class(name).section
        if section is not None and section not in sections:
            sections.append(section)
    sections = [s for s in sections if not any(t is not s and issubclass(t, s) for t in sections)]  # MRO
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
    text, raw = read_toml(path, "config file")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        line = _line_of(text, key)
        where = f"{path}:{line}" if line else str(path)
        if name not in FIELDS:
            raise ConfigError(f"{where}: unknown key {key!r}; valid keys are the `trainscale train` flags")
        values[name] = typed(name, value, f"{where}: key {key!r}")
    return values


def typed(name: str, value: Any, where: str) -> Any:
    """``value`` checked against field ``name``'s type (ints widen to floats); else a ConfigError. Text
    must be printable and integers 64-bit, so every later message stays one line and no number overflows."""
    problem = value_problem(value)
    if problem:
        raise ConfigError(f"{where} {problem}")
    try:
        return coerce(TYPES[name], value)
    except TypeError as exc:
        raise ConfigError(f"{where} must be {exc}, got {value!r} ({type(value).__name__})") from None


def value_problem(value: Any) -> str | None:
    """Why a setting's value is unusable whatever its type (None when it is fine): an integer beyond 64
    bits, or text with control or line-break characters (in a list too)."""
    if isinstance(value, list):
        return next((p for p in map(value_problem, value) if p), None)
    if isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT <= value < INT_LIMIT:
        return f"must be a 64-bit integer, got one of {value.bit_length()} bits"
    if isinstance(value, str) and any(unicodedata.category(c) in UNPRINTABLE for c in value):
        return f"must be printable text on one line, got {ascii(value)[:80]}"
    return None


def build_config(*layers: dict[str, Any]) -> CoreConfig:
    """Merge layers left to right over the defaults (later wins) and the recipe (see ``with_recipe``), then
    validate."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update({k: v for k, v in layer.items() if v is not None or k in ("out",)})
    unknown = sorted(set(merged) - set(FIELDS))
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(unknown)}")
    merged = {k: typed(k, v, f"setting '{k}' ({flag_name(FIELDS[k])})") for k, v in merged.items()}
    cfg = TrainConfig(**with_recipe(merged))
    validate_engine(cfg)
    validate_launch(cfg)
    cfg = resolve_parallel(cfg)
    validate_mode(cfg)
    validate_nonfinite(cfg)
    validate_optimizer(cfg)
    return cfg


def validate_optimizer(cfg: TrainConfig) -> None:
    """Parameter-server workers push their gradients and the servers apply one SGD with one learning rate:
    Muon and per-group learning rates live in the trainer's optimizer, which those modes do not run."""
    if not mode_class(cfg.mode).uses_servers:
        return
    require(cfg.optimizer == "sgd", f"--optimizer {cfg.optimizer} is for --mode local and sync, not --mode {cfg.mode} "
            "(the parameter servers apply SGD); use --optimizer sgd")
    require(cfg.head_lr_factor == 1, f"--head-lr-factor is for --mode local and sync, not --mode {cfg.mode} (the "
            "parameter servers apply one learning rate); leave it at 1")


def with_recipe(user: dict[str, Any]) -> dict[str, Any]:
    """``user``'s settings over its recipe's (``--recipe``, else the model's own; a recipe may name the model
    when the user does not), with the recipe's name recorded. A recipe's warm-up longer than the run is cut to
    the run (the user asked for fewer epochs than the recipe has; the warm-up was the recipe's, not theirs)."""
    name = user.get("recipe") or model_info(user.get("model", FIELDS["model"].default)).recipe
    recipe = get_recipe(name)
    settings = {k: typed(k, v, f"recipe {name!r}: setting '{k}'") for k, v in recipe.for_user(user).items()}
    if "model" not in user and "model" in settings:
        user = {**user, "model": settings["model"]}
    merged = {**settings, **user, "recipe": name}
    epochs = merged.get("epochs", FIELDS["epochs"].default)
    if "warmup_epochs" in settings and "warmup_epochs" not in user and merged["warmup_epochs"] > epochs:
        merged["warmup_epochs"] = float(epochs)
    return merged


STATELESS_COMPRESSION = ("none", "fp16", "bf16")  # keep nothing from one step to the next


def validate_nonfinite(cfg: TrainConfig) -> None:
    """``--nonfinite``: skipping needs every rank to agree on each step before it is applied; a
    parameter-server worker pushes its gradients as its own step, with no such agreement, so those modes
    keep the default, stop."""
    require(cfg.nonfinite in NONFINITE, f"--nonfinite must be one of {', '.join(NONFINITE)}, got {cfg.nonfinite!r}")
    require(cfg.nonfinite == "stop" or not mode_class(cfg.mode).uses_servers,
            f"--nonfinite skip is for --mode local and sync, not --mode {cfg.mode} (parameter-server workers "
            "push every step's gradients); use --nonfinite stop")
    stateless = cfg.compress in STATELESS_COMPRESSION and not cfg.error_feedback
    require(cfg.nonfinite == "stop" or stateless,
            f"--nonfinite skip cannot be combined with --compress {cfg.compress}"
            f"{' --error-feedback' if cfg.error_feedback else ''}: the compressor's state (residuals, momentum) "
            "would carry a skipped step's NaN into every later step; use --nonfinite stop")


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
    if cfg.cluster is not None:
        validate_name(cfg.cluster)
    require(cfg.cluster is None or (cfg.nnodes, cfg.node_rank, cfg.rdzv_endpoint, cfg.hosts) == (1, 0, None, None),
            "--cluster places one node on each emulated host itself: leave out --nnodes, --node-rank, "
            "--rdzv-endpoint and --hosts")


def _endpoint_ok(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def resolve_parallel(cfg: CoreConfig) -> CoreConfig:
    """Fill in ``workers`` and the mode: several processes (``--workers``/``--devices``/``--nnodes``/
    ``--hosts``, or a launcher's WORLD_SIZE > 1) imply ``sync`` when ``--mode`` is left at ``auto``;
    parameter-server shards (``--servers``) imply ``async``."""
    workers = cfg.workers or (len(cfg.devices) if cfg.devices else 1)
    launched_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    several = workers > 1 or cfg.nnodes > 1 or launched_world > 1 or cfg.hosts is not None or cfg.cluster is not None
    mode = cfg.mode
    if mode == "auto" and getattr(cfg, "servers", 0):
        mode = "async"
    if mode == "auto":
        mode = "sync" if several else "local"
    elif mode == "local" and several:
        what = f"WORLD_SIZE={launched_world} from the launcher" if launched_world > 1 else \
            f"--workers {workers}" if workers > 1 else "--nnodes/--hosts/--cluster"
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
