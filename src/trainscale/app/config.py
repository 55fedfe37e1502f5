"""The run's configuration: ``TrainConfig``'s typed sections read from defaults, a TOML file and flags (later
wins), each section checked by its owner, and the checks across sections.

The sections are declared where they belong (``trainscale.config`` for the core, ``compression.config``,
``runtime.faults``, ``modes.config`` and each mode's own); ``modes.config.TrainConfig`` joins them as typed
attributes. Names stay flat for the user: a flag, a TOML key and a ``config.json`` key is a field's name, found
in whichever section declares it; a TOML file may also group keys in ``[section]`` tables (``[optim]``,
``[launch]``...). A mode registered later brings its sections without an edit here (``FIELDS`` and ``TYPES``
are read from the registry on each use).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import logging
import os
import re
import unicodedata
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainscale.compression.config import CompressionConfig
from trainscale.compression.setup import validate_compression
from trainscale.config import CORE_SECTIONS, Section, coerce, field_types, flag_name, spellings
from trainscale.errors import ConfigError, require
from trainscale.io import read_json, read_toml
from trainscale.models import model_info
from trainscale.modes import list_modes, mode_class
from trainscale.modes.config import TrainConfig
from trainscale.recipes import get_recipe
from trainscale.record import RUN_TOML
from trainscale.registry import format_args
from trainscale.runtime.cluster import validate_name
from trainscale.train.checks import check_step, validate_engine
from trainscale.train.optim import optimizer_info
from trainscale.train.optim.registry import OPTIMIZER_SETTINGS
from trainscale.train.schedules import SCHEDULES

log = logging.getLogger("trainscale")

INT_LIMIT = 2**63  # TOML's integers are 64-bit; tomllib reads any size, which torch and float() refuse later
UNPRINTABLE = ("Cc", "Cf", "Cs", "Zl", "Zp")  # control, format, surrogate and line-break characters


class _Fields(Mapping[str, dataclasses.Field]):
    """Every section's fields by flat name, read from ``TrainConfig`` (and the registered modes) on each use."""

    def _map(self) -> dict[str, dataclasses.Field]:
        return {name: f for name, (_, f) in TrainConfig.field_map().items()}

    def __getitem__(self, name: str) -> dataclasses.Field:
        return TrainConfig.field_map()[name][1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._map())

    def __len__(self) -> int:
        return len(self._map())


class _Types(Mapping[str, Any]):
    """Each field's resolved type (``int | None``, not the string), by flat name."""

    def _map(self) -> dict[str, Any]:
        return {name: t for kind in TrainConfig.section_types().values() for name, t in field_types(kind).items()}

    def __getitem__(self, name: str) -> Any:
        return field_types(TrainConfig.section_types()[TrainConfig.field_map()[name][0]])[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._map())

    def __len__(self) -> int:
        return len(self._map())


FIELDS: Mapping[str, dataclasses.Field] = _Fields()
TYPES: Mapping[str, Any] = _Types()


def _line_of(text: str, key: str, table: str | None = None) -> int | None:
    """The line of ``key = ...`` in ``text`` (after the ``[table]`` header when ``table`` is given)."""
    start = 0
    if table is not None:
        header = _table_line(text, table)
        if header is None:
            return None
        start = len("\n".join(text.splitlines()[:header]))
    match = re.compile(rf"^[ \t]*{re.escape(key)}[ \t]*=", re.MULTILINE).search(text, start)
    return text.count("\n", 0, match.start()) + 1 if match else None


def _table_line(text: str, table: str) -> int | None:
    match = re.compile(rf"^[ \t]*\[[ \t]*{re.escape(table)}[ \t]*\]", re.MULTILINE).search(text)
    return text.count("\n", 0, match.start()) + 1 if match else None


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config: flat keys (a flag's name) and ``[section]`` tables of the keys of that section
    (``[optim]`` with ``lr = 0.1``). An unknown key or section, or a value of the wrong type, is an error naming
    the file, line, key, the expected type and the value as written."""
    path = Path(path)
    text, raw = read_toml(path, "config file")
    sections = TrainConfig.section_types()
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if isinstance(value, dict) and name not in FIELDS:
            if name not in sections:
                line = _table_line(text, key)
                raise ConfigError(
                    f"{path}:{line}: unknown table [{key}]; the tables are the config sections: {', '.join(sections)}"
                    if line
                    else f"{path}: unknown key {key!r}"
                )
            table = _table(path, text, key, sections[name], value)
            _once(path, values, table, f"in [{key}]")
            values.update(table)
            continue
        line = _line_of(text, key)
        where = f"{path}:{line}" if line else str(path)
        if name not in FIELDS:
            raise ConfigError(f"{where}: unknown key {key!r}; valid keys are the `trainscale train` flags")
        _once(path, values, {name: value}, "at the top level")
        values[name] = typed(name, value, f"{where}: key {key!r}")
    return values


def _once(path: Path, values: Mapping[str, Any], new: Mapping[str, Any], where: str) -> None:
    """A setting the file gives twice (at the top and in its table, or spelled with - and _) is refused."""
    twice = sorted(set(values) & set(new))
    if twice:
        raise ConfigError(
            f"{path}: {', '.join(repr(k) for k in twice)} set twice (again {where}); give each setting once"
        )


def located(
    exc: ConfigError, path: str | Path, from_file: Mapping[str, Any], from_flags: Mapping[str, Any]
) -> ConfigError:
    """``exc`` (a check of a value, naming its flag) said of the TOML file when the value came from there: the
    file and line, and the key as the file writes it, as type errors already are (``load_toml``)."""
    message = str(exc)
    match = re.match(r"(--[a-z0-9-]+)\b", message)
    name = next((f for f in FIELDS if match and flag_name(FIELDS[f]) == match.group(1)), None)
    lookup = re.match(r"unknown ([a-z]+) '", message)  # a registry's: "unknown model 'mlpp' (did you mean...)"
    if name is None and lookup and lookup.group(1) in FIELDS:
        name, match = lookup.group(1), None
    if name is None or name not in from_file or name in from_flags:
        return exc
    text = Path(path).read_text()
    line = next((n for key in (name, name.replace("_", "-")) if (n := _line_of(text, key))), None)
    where = f"{path}:{line}" if line else str(path)
    if match is None:
        return type(exc)(f"{where}: key {name!r}: {message}")
    return type(exc)(f"{where}: key {name.replace('_', '-')!r}{message[match.end() :]}")


def _table(path: Path, text: str, table: str, section: type[Section], raw: dict[str, Any]) -> dict[str, Any]:
    """The keys of a ``[table]`` of ``section``, typed; a key of another section is refused."""
    own = {f.name for f in dataclasses.fields(section)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        line = _line_of(text, key, table)
        where = f"{path}:{line}" if line else str(path)
        if name not in own:
            elsewhere = f" (it belongs in [{TrainConfig.field_map()[name][0]}] or at the top)" if name in FIELDS else ""
            raise ConfigError(
                f"{where}: unknown key {key!r} in [{table}]{elsewhere}; valid keys are the "
                f"`trainscale train` flags of that section"
            )
        values[name] = typed(name, value, f"{where}: key {key!r}")
    return values


def train_settings(flags: Mapping[str, Any], config_file: str | Path | None = None) -> TrainConfig:
    """`trainscale train`'s config (the CLI's and ``trainscale.fit``'s): defaults, then with ``--resume`` the run
    folder's own settings (``resumed_settings``), then ``--config FILE``, then ``flags`` (the settings given)."""
    file_values = load_toml(config_file) if config_file else {}
    require(
        flags.get("batch_size") is None or flags.get("batch_per_worker") is None,
        f"--batch-size {flags.get('batch_size')} (the global batch) and --batch-per-worker "
        f"{flags.get('batch_per_worker')} both set the batch; give one of them",
    )
    try:
        cfg = build_config(resumed_settings({**file_values, **flags}), file_values, dict(flags))
    except ConfigError as exc:
        raise (located(exc, config_file, file_values, flags) if config_file and file_values else exc) from None
    for note in idle_settings(cfg, {*file_values, *(k for k, v in flags.items() if v is not None)}):
        log.info("%s", note)
    return cfg


def idle_settings(cfg: TrainConfig, given: set[str]) -> list[str]:
    """A note for each group of the settings ``given`` (on the command line or in the config file) that this run
    never reads: a flag that silently does nothing reads as a result of it. Notes, not refusals: a grid's cells
    share settings that only some of its optimizers or schedules read."""
    groups: list[tuple[list[str], str]] = [
        (_unread(given, optimizer_info(cfg.optim.optimizer).reads, OPTIMIZER_SETTINGS),
         f"--optimizer {cfg.optim.optimizer}"),
        (_unread(given, SCHEDULES.get(cfg.optim.schedule).meta.get("reads", ()), ("milestones", "gamma")),
         f"--schedule {cfg.optim.schedule} (only --schedule step reads them)"),
        ([k for k in ("error_feedback", "compress_warmup_epochs") if k in given and cfg.compression.compress == "none"],
         "--compress none (nothing is compressed)"),
        ([k for k in ("ft_timeout",) if k in given and not cfg.replication.fault_tolerance],
         "--fault-tolerance off (only fault-tolerant replicas drop a silent peer's step)"),
    ]  # fmt: skip
    return [
        f"{' and '.join(flag_name(FIELDS[k]) for k in idle)} {'does' if len(idle) == 1 else 'do'} nothing with {why}"
        for idle, why in groups
        if idle
    ]


def _unread(given: set[str], reads: tuple[str, ...], settings: tuple[str, ...]) -> list[str]:
    return [k for k in settings if k in given and k not in reads]


def resumed_settings(given: Mapping[str, Any]) -> dict[str, Any]:
    """With ``resume`` and ``out`` among the settings ``given``, the settings of the run in that folder: its
    ``run.toml`` (a folder from before run.toml: its ``config.json``), so `train --out DIR --resume` needs no other
    flag; only the settings given are then compared with the run's (``train.setup.check_resume_matches``). Empty
    otherwise, and for a folder with neither file (the run-folder check says what is missing)."""
    if not given.get("resume") or not given.get("out"):
        return {}
    folder = Path(given["out"])
    if (folder / RUN_TOML).is_file():
        settings = one_batch(load_toml(folder / RUN_TOML))
    elif (folder / "config.json").is_file():
        settings = one_batch(read_run_config(folder / "config.json").to_dict())
    else:
        return {}
    if any(given.get(k) is not None for k in NODE_PLACEMENT):  # a node: its launcher placed it, the run's way
        settings = {k: v for k, v in settings.items() if k not in RUN_PLACEMENT}
    return settings


NODE_PLACEMENT = ("nnodes", "node_rank", "rdzv_endpoint")  # what a node of a job is told by the one that starts it
RUN_PLACEMENT = ("cluster", "hosts", "ssh")  # how the user placed the job, which made those nodes


def one_batch(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` (a run's record: every field) with the batch said once, as flags must say it: a batch per
    worker is what the run trained at, and the global ``batch_size`` beside it only its unused default."""
    if settings.get("batch_per_worker") is None:
        return dict(settings)
    return {k: v for k, v in settings.items() if k != "batch_size"}


def read_run_config(path: str | Path) -> TrainConfig:
    """A run folder's ``config.json`` as a ``TrainConfig``: the flat form every run writes (keys that are no
    setting, such as ``resolved``, skipped)."""
    return config_from_dict(read_json(Path(path)))


def config_from_dict(recorded: Mapping[str, Any]) -> TrainConfig:
    """A ``TrainConfig`` from a flat record (``config.json``, ``to_dict``); a section's fields given as one object
    under the section's name are read too."""
    sections = TrainConfig.section_types()
    flat: dict[str, Any] = {}
    for key, value in recorded.items():
        if key in sections and isinstance(value, dict):
            flat.update(value)
        elif key in FIELDS:
            flat[key] = value
    return TrainConfig.from_flat(flat)


def typed(name: str, value: Any, where: str) -> Any:
    """``value`` checked against field ``name``'s type (ints widen to floats); else a ConfigError. Text
    must be printable and integers 64-bit, so every later message stays one line and no number overflows. A
    ``KEY=VALUE`` field (``--model-arg``) also takes a table, ``{depth = 4}``."""
    if isinstance(value, dict) and name in FIELDS and FIELDS[name].metadata.get("pairs"):
        value = format_args(value, flag_name(FIELDS[name]))
    problem = value_problem(value)
    if problem:
        raise ConfigError(f"{where} {problem}")
    try:
        return coerce(TYPES[name], value)
    except TypeError as exc:
        raise ConfigError(f"{where} must be {exc}, got {value!r} ({type(value).__name__})") from None


def value_problem(value: Any) -> str | None:
    """Why a setting's value is unusable whatever its type (None when it is fine): an integer beyond 64
    bits, text with control or line-break characters, or no text at all (in a list too)."""
    if isinstance(value, list):
        return next((p for p in map(value_problem, value) if p), None)
    if isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT <= value < INT_LIMIT:
        return f"must be a 64-bit integer, got one of {value.bit_length()} bits"
    if isinstance(value, str) and any(unicodedata.category(c) in UNPRINTABLE for c in value):
        return f"must be printable text on one line, got {ascii(value)[:80]}"
    if value == "":
        return "is empty: give a value, or leave it out"
    return None


BATCH_SPELLINGS = (("batch_size", "batch_per_worker"), ("batch_per_worker", "batch_size"))


def flag_spellings() -> dict[str, str]:
    """Every spelling of every flag with underscores (``gpus``, ``model_arg``), to the setting it sets."""
    return {
        spelling.lstrip("-").replace("-", "_"): key
        for key, f in FIELDS.items()
        for spelling in spellings(f)
        if spelling.startswith("--")
    }


def as_settings(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """Keywords named as the flags are (``gpus=``, ``model_arg=``) under their settings' names; a setting given
    under two of its spellings is refused."""
    spelled = flag_spellings()
    settings: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in keywords.items():
        name = key if key in FIELDS else spelled.get(key, key)
        if name in settings:
            raise ConfigError(f"{given_as[name]} and {key} are the same setting; give it once")
        settings[name], given_as[name] = value, key
    return settings


def _with_hint(name: str) -> str:
    """An unknown setting's name with the nearest setting's name."""
    meant = next(iter(difflib.get_close_matches(name, list(FIELDS), n=1, cutoff=0.7)), None)
    return f"{name} (did you mean {meant}?)" if meant else name


def build_config(*layers: dict[str, Any]) -> TrainConfig:
    """Merge layers left to right over the defaults (later wins) and the recipe (see ``with_recipe``), then
    validate."""
    merged: dict[str, Any] = {}
    for layer in layers:
        given = {k: v for k, v in layer.items() if v is not None or k in ("out",)}
        for one, other in BATCH_SPELLINGS:
            if one in given and other not in given:  # a later layer's batch replaces an earlier one's
                merged.pop(other, None)
        merged.update(given)
    unknown = sorted(set(merged) - set(FIELDS))
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(map(_with_hint, unknown))}")
    merged = {k: typed(k, v, f"setting '{k}' ({flag_name(FIELDS[k])})") for k, v in merged.items()}
    flat, cut = batch_within_subset(with_recipe(merged), merged)
    cfg = TrainConfig.from_flat(flat)
    validate_engine(cfg)
    for _, section in cfg.sections():
        if type(section) in CORE_SECTIONS:
            section.validate()
    if cfg.launch.cluster is not None:
        validate_name(cfg.launch.cluster)
    cfg = resolve_parallel(cfg)
    check_step(cfg)
    validate_mode(cfg)
    validate_script_code(cfg)
    validate_nonfinite(cfg)
    validate_optimizer(cfg)
    validate_tensorboard(cfg)
    if cut:
        log.info("%s", cut)  # once the settings are valid: a refusal is then the one line the user sees
    return cfg


TENSORBOARD_HINT = "pip install 'trainscale[tensorboard]'"


def validate_tensorboard(cfg: TrainConfig) -> None:
    """``--tensorboard`` needs the optional ``tensorboard`` package: said before anything starts, not at the
    first event."""
    require(
        not cfg.run.tensorboard or importlib.util.find_spec("tensorboard") is not None,
        f"--tensorboard writes TensorBoard event files, but the tensorboard package is not installed: "
        f"{TENSORBOARD_HINT} (or leave --tensorboard out)",
    )


EMA_MODES = ("local", "sync")  # where every rank holds the one model whose average is worth evaluating


def validate_optimizer(cfg: TrainConfig) -> None:
    """Parameter-server workers of ``async`` and ``ps-sync`` push their gradients and the servers apply one SGD
    with one learning rate and weight decay: Muon, the adaptive optimizers, weight-decay groups and per-group
    learning rates live in the trainer's optimizer, which those modes do not run. ``ma`` steps the trainer's
    optimizer on each worker (the servers only average), so any optimizer goes there. A weight average
    (``--ema``) is of the one model every rank holds: local and sync modes."""
    mode = cfg.run.mode
    require(
        cfg.optim.ema is None or mode in EMA_MODES,
        f"--ema is for --mode {' and '.join(EMA_MODES)}, not --mode {mode} (its workers hold different weights "
        "between exchanges, so there is no one model to average); leave --ema out",
    )
    if not mode_class(mode).uses_servers:
        return
    if mode != "ma":
        require(
            cfg.optim.optimizer == "sgd",
            f"--optimizer {cfg.optim.optimizer} is for --mode local, sync, localsgd, diloco and ma, not --mode "
            f"{mode} (the parameter servers apply SGD); use --optimizer sgd",
        )
        require(
            not cfg.optim.no_decay_norm_bias,
            f"--no-decay-norm-bias is not for --mode {mode} (the parameter servers apply one weight decay to "
            "every parameter); leave it out",
        )
    require(
        cfg.optim.head_lr_factor == 1,
        f"--head-lr-factor is for --mode local and sync, not --mode {mode} (the "
        "parameter servers apply one learning rate); leave it at 1",
    )


def with_recipe(user: dict[str, Any]) -> dict[str, Any]:
    """``user``'s settings over its recipe's (``--recipe``, else the model's own; a recipe may name the model
    when the user does not), with the recipe's name recorded. The recipe's milestones and warm-up are scaled to
    the epochs asked for (``fit_schedule``), and an optimizer other than the recipe's brings its own defaults."""
    name = user.get("recipe") or model_info(user.get("model", FIELDS["model"].default)).recipe
    recipe = get_recipe(name)
    settings = {k: typed(k, v, f"recipe {name!r}: setting '{k}'") for k, v in recipe.for_user(user).items()}
    if "model" not in user and "model" in settings:
        user = {**user, "model": settings["model"]}
    merged = {**settings, **user, "recipe": name}
    merged.update(fit_schedule(settings, recipe.settings.get("epochs"), merged.get("epochs", FIELDS["epochs"].default)))
    merged.update(optimizer_defaults(settings, user))
    return merged


def batch_within_subset(merged: dict[str, Any], user: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A batch the user did not choose (the recipe's or the default) that is larger than a small
    ``--train-subset`` allows is cut to the largest that fits, with a note (returned, None when nothing was cut);
    a batch the user wrote stays as written (and a batch that does not fit is then refused with one line)."""
    subset = merged.get("train_subset")
    if not subset or "batch_size" in user or merged.get("batch_per_worker") is not None:
        return merged, None
    workers = (merged.get("workers") or 1) * (merged.get("nnodes") or 1)
    batch = merged.get("batch_size", FIELDS["batch_size"].default)
    fits = (subset // workers) * workers
    if batch // workers <= subset // workers or fits < 1:
        return merged, None
    chosen = f"recipe {merged['recipe']}" if "batch_size" in get_recipe(merged["recipe"]).settings else "the default"
    note = (
        f"batch {batch} ({chosen}) is larger than --train-subset {subset} allows: training at batch {fits}; set "
        "--batch-size to choose"
    )
    return {**merged, "batch_size": fits}, note


def fit_schedule(recipe: Mapping[str, Any], length: float | None, epochs: float) -> dict[str, Any]:
    """The recipe's step milestones and warm-up scaled to ``epochs`` when the user asks for another length than
    the recipe's (He et al.'s /10 at epochs 83 and 124 of 164 is at 1.0 and 1.5 of 2 epochs): the shape of the
    schedule is the recipe's, its length the user's. A milestone stays 1-based (M: from M - 1 epochs of training
    on) and may become fractional. ``recipe``: the settings the recipe gives this run (none the user wrote), ``length``
    its epochs."""
    if not length or length == epochs:
        return {}
    ratio = epochs / length
    fitted: dict[str, Any] = {}
    if "milestones" in recipe:
        fitted["milestones"] = [round(1 + (m - 1) * ratio, 4) for m in recipe["milestones"]]
    if "warmup_epochs" in recipe:
        fitted["warmup_epochs"] = min(float(epochs), round(recipe["warmup_epochs"] * ratio, 4))
    return fitted


def optimizer_defaults(recipe: Mapping[str, Any], user: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer other than the recipe's brings its own default lr and weight decay (a recipe's SGD lr of 0.1
    diverges with Adam), and the recipe's lr scaling rule goes with its lr; what the user wrote stays."""
    chosen = user.get("optimizer")
    if chosen is None or chosen == recipe.get("optimizer", FIELDS["optimizer"].default):
        return {}
    defaults = {k: v for k, v in optimizer_info(chosen).defaults.items() if k not in user}
    if "lr" in defaults and "lr_scaling" not in user:
        defaults["lr_scaling"] = "none"
    return defaults


STATELESS_COMPRESSION = ("none", "fp16", "bf16")  # keep nothing from one step to the next


def validate_nonfinite(cfg: TrainConfig) -> None:
    """``--nonfinite``: skipping needs every rank to agree on each step before it is applied; a
    parameter-server worker pushes its gradients as its own step, with no such agreement, so those modes
    keep the default, stop."""
    require(
        cfg.optim.nonfinite == "stop" or not mode_class(cfg.run.mode).uses_servers,
        f"--nonfinite skip is for --mode local and sync, not --mode {cfg.run.mode} (parameter-server workers "
        "push every step's gradients); use --nonfinite stop",
    )
    compression = cfg.compression
    stateless = compression.compress in STATELESS_COMPRESSION and not compression.error_feedback
    require(
        cfg.optim.nonfinite == "stop" or stateless,
        f"--nonfinite skip cannot be combined with --compress {compression.compress}"
        f"{' --error-feedback' if compression.error_feedback else ''}: the compressor's state (residuals, momentum) "
        "would carry a skipped step's NaN into every later step; use --nonfinite stop",
    )


def resolve_parallel(cfg: TrainConfig) -> TrainConfig:
    """Fill in ``workers`` and the mode: several processes (``--workers``/``--devices``/``--nnodes``/
    ``--hosts``, or a launcher's WORLD_SIZE > 1) imply ``sync`` when ``--mode`` is left at ``auto``;
    parameter-server shards (``--servers``) imply ``async``."""
    launch = cfg.launch
    workers = launch.local_workers
    launched_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    several = (
        workers > 1 or launch.nnodes > 1 or launched_world > 1 or launch.hosts is not None or launch.cluster is not None
    )
    mode = cfg.run.mode
    if mode == "auto" and cfg.ps.servers:
        mode = "async"
    if mode == "auto":
        mode = "sync" if several else "local"
    elif mode == "local" and several:
        what = (
            f"WORLD_SIZE={launched_world} from the launcher"
            if launched_world > 1
            else f"--workers {workers}"
            if workers > 1
            else "--nnodes/--hosts/--cluster"
        )
        raise ConfigError(
            f"--mode local trains in one process but {what} asks for several; use --mode sync (or leave --mode out)"
        )
    return cfg.replace(workers=workers, mode=mode)


def validate_script_code(cfg: TrainConfig) -> None:
    """A model or dataset from the running script (``__main__:build``) exists only in this process: the workers of
    a job of several processes import it by its path and find another ``__main__``, theirs."""
    several = mode_class(cfg.run.mode).distributed or cfg.launch.cluster is not None or cfg.launch.hosts is not None
    for flag, path in (("--model", cfg.data.model), ("--dataset", cfg.data.dataset)):
        module, _, attr = path.partition(":")
        require(
            not (several and module == "__main__"),
            f"{flag} {path}: the other processes of this job cannot import your script's {attr}; move it into a "
            f"module of its own (my_pkg/code.py) and give my_pkg.code:{attr}",
        )


def validate_mode(cfg: TrainConfig) -> None:
    """Settings of sections the mode does not take left at their defaults; the mode's sections' own checks and
    the mode's checks across sections; compression only where the mode exchanges something it can compress."""
    mode = mode_class(cfg.run.mode)
    for _, section in cfg.sections():
        kind = type(section)
        if kind in CORE_SECTIONS or kind is CompressionConfig:
            continue
        if kind not in mode.sections:
            _refuse_foreign(section, cfg.run.mode)
        else:
            section.validate()
    mode.validate(cfg)
    plan = validate_compression(cfg.compression, cfg.run.seed, cfg.optim.epochs)
    require(
        not plan.enabled or CompressionConfig in mode.sections,
        f"--compress {plan.method} compresses the gradients workers exchange: it needs --workers N >= 2 "
        f"(sync mode), not --mode {cfg.run.mode}",
    )


def _refuse_foreign(section: Section, mode: str) -> None:
    """A ConfigError naming the first setting of ``section`` changed from its default (``mode`` does not take it)."""
    for field in dataclasses.fields(section):  # type: ignore[arg-type]
        if getattr(section, field.name) != _default(field):
            what = section.FOR or f"--mode {', '.join(_modes_with(type(section)))}"
            raise ConfigError(f"{flag_name(field)} is for {what}, not --mode {mode}")


def _default(field: dataclasses.Field) -> Any:
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def _modes_with(section: type[Section]) -> list[str]:
    return [n for n in list_modes() if section in mode_class(n).sections]
