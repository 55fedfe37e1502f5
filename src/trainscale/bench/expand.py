"""From a grid and a scale to the list of runs: merge, cross the axes, build and validate every config.

Precedence for one run, later wins: TrainConfig defaults < ``[base]`` < the row < its axis values <
``[scale.NAME]`` < the row's ``scale.NAME`` (so ``--scale quick`` can shrink the model of every row and
a row can still keep its own worker count) < ``sets``, the ``--set KEY=VALUE`` of `trainscale bench`
(it wins over everything the grid says about its key: an axis of that key collapses to the one value).
Axes: ``[axes]``, then the row's, then the scale's ``axes.KEY`` and the row's scale axes replace values.
A key that is both an axis and a fixed value is ambiguous and rejected. Repeat ``r`` trains with
``seed + r`` (``--set seed=N`` sets the first repeat's seed).

Each run gets an id: a readable name plus the first 8 hex digits of the SHA-256 of its resolved config
(plumbing keys that cannot change a result, ``HASH_EXCLUDE``, and default values left out: see
``significant``), so a folder can only ever hold the run of exactly that config. ``--set`` values are part
of the config like any grid key, so a changed ``--set`` plans new runs, never a reuse of the old ones.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainscale.bench.grid import RUNNER_OWNED, Grid, GridError, check_sets, set_text
from trainscale.cluster.bench import take_cluster_keys
from trainscale.config import CoreConfig
from trainscale.errors import ConfigError
from trainscale.train import BatchPlan

if TYPE_CHECKING:
    from trainscale.app.config import TrainConfig

SET_SOURCE = "--set"  # the source of a key that --set chose (an error about it names --set, not a line)
# Keys that do not change what is measured: where the run goes, how it is shown, how workers meet.
HASH_EXCLUDE = frozenset(
    {
        "out",
        "resume",
        "progress",
        "checkpoint",
        "rdzv_endpoint",
        "rdzv_id",
        "rdzv_timeout",
        "node_rank",
        "hosts",
        "ssh",
        "dist_timeout",
        "max_restarts",
        "dry_run",
    }
)
# Keys that make a run start commands on other machines: a grid may set them only with --allow-ssh.
REMOTE_KEYS = ("hosts", "ssh")
MAX_RUNS = 10_000  # more planned runs than this is a typo (repeats = 1000000), not a benchmark
# Short labels for axis values in run names ("w2-bpw32"); other keys use their own name.
ABBREVIATIONS = {
    "workers": "w",
    "batch_per_worker": "bpw",
    "batch_size": "bs",
    "precision": "",
    "model": "",
    "mode": "",
    "compress": "",
    "granularity": "",
    "servers": "s",
    "train_subset": "n",
}


@dataclass
class RunSpec:
    """One planned run: its id, labels, where each key came from, and the resolved config."""

    run_id: str
    name: str
    label: str
    repeat: int
    config: dict[str, Any]
    config_hash: str
    point: dict[str, Any] = field(default_factory=dict)
    short_name: str = ""

    def record(self) -> dict[str, Any]:
        """What grid.json and bench.json keep about the run."""
        return {
            "run_id": self.run_id,
            "name": self.name,
            "label": self.label,
            "short_name": self.short_name,
            "repeat": self.repeat,
            "axes": self.point,
            "config_hash": self.config_hash,
            "config": self.config,
        }


@dataclass
class RowPlan:
    """One row at one scale: its fixed keys, axes and scale overrides, and where each key was written."""

    index: int
    short_name: str
    fixed: dict[str, Any]
    axes: dict[str, list[Any]]
    overrides: dict[str, Any]
    sources: dict[str, str]


def _scale_table(grid: Grid, scale: str | None) -> dict[str, Any]:
    if scale is not None and scale not in grid.scales:
        choices = ", ".join(sorted(grid.scales)) or "none (leave --scale out)"
        raise grid.error("scale", f"grid has no scale '{scale}'; its scales are: {choices}")
    return grid.scales.get(scale, {}) if scale else {}


def row_plans(grid: Grid, scale: str | None, sets: dict[str, Any] | None = None) -> list[RowPlan]:
    """The rows this scale runs (all, or its ``rows = [...]``), each with its axes and overrides resolved;
    ``sets`` (checked ``--set`` values) replace whatever the grid says about their keys."""
    table = _scale_table(grid, scale)
    wanted = table.get("rows")
    rows = list(enumerate(grid.rows)) or [(0, {})]
    return [
        _with_sets(_row_plan(grid, scale, table, row, i), sets or {})
        for i, row in rows
        if wanted is None or row.get("short_name") in wanted
    ]


def _with_sets(plan: RowPlan, sets: dict[str, Any]) -> RowPlan:
    """--set wins over the grid: an axis of its key keeps the one value (so its runs are not duplicates),
    fixed values and scale overrides of its key give way."""
    for key, value in sets.items():
        if key in plan.axes:
            plan.axes[key] = [value]
        else:
            plan.fixed.pop(key, None)
            plan.overrides[key] = value
        plan.sources[key] = SET_SOURCE
    return plan


def _row_plan(grid: Grid, scale: str | None, table: dict[str, Any], row: dict[str, Any], index: int) -> RowPlan:
    own = row.get("scale", {}).get(scale, {}) if scale else {}
    fixed = {k: v for k, v in row.items() if k not in ("axes", "short_name", "scale")}
    scale_keys = {k: v for k, v in table.items() if k not in ("axes", "rows", "repeats", "description")}
    own_keys = {k: v for k, v in own.items() if k != "axes"}
    sources = {k: f"base.{k}" for k in grid.base}
    sources.update({k: f"rows[{index}].{k}" for k in fixed})
    axes: dict[str, list[Any]] = {}
    for path, layer in (
        ("axes", grid.axes),
        (f"rows[{index}].axes", row.get("axes", {})),
        (f"scale.{scale}.axes", table.get("axes", {})),
        (f"rows[{index}].scale.{scale}.axes", own.get("axes", {})),
    ):
        for key, values in layer.items():
            if path.startswith("scale.") and key not in axes and _is_row_axis(grid, key):
                continue  # a scale's values for an axis of other rows only
            axes[key] = values
            sources[key] = f"{path}.{key}"
    sources.update({k: f"scale.{scale}.{k}" for k in scale_keys})
    sources.update({k: f"rows[{index}].scale.{scale}.{k}" for k in own_keys})
    plan = RowPlan(index, row.get("short_name", ""), fixed, axes, {**scale_keys, **own_keys}, sources)
    _check_conflicts(grid, plan)
    return plan


def _is_row_axis(grid: Grid, key: str) -> bool:
    return key not in grid.axes and any(key in row.get("axes", {}) for row in grid.rows)


def _check_conflicts(grid: Grid, plan: RowPlan) -> None:
    for key in plan.axes:
        if key in plan.fixed:
            raise grid.error(
                plan.sources[key],
                f"'{key}' is an axis and is also set by row "
                f"{plan.short_name or plan.index + 1} (rows[{plan.index}].{key}); keep one",
            )
        if key in plan.overrides:
            raise grid.error(
                plan.sources[key], f"'{key}' is an axis and a scale sets it too; in a scale write axes.{key} = [...]"
            )


def plan_runs(
    grid: Grid, scale: str | None, sets: dict[str, Any] | None = None, allow_ssh: bool = False
) -> list[RunSpec]:
    """Every run of the grid at this scale, each config built and validated; errors name file and line
    (or the --set). ``sets``: `trainscale bench --set` values, applied to every run over the grid's.
    ``allow_ssh``: `trainscale bench --allow-ssh`, without which no run may use ``hosts``/``ssh``."""
    sets = check_sets(sets or {})
    repeats = _scale_table(grid, scale).get("repeats", grid.repeats)
    plans = row_plans(grid, scale, sets)
    _check_plans(grid, plans, repeats, allow_ssh)
    specs = [
        _spec(grid, plan, dict(zip(plan.axes, combo)), repeat, repeats)
        for plan in plans
        for combo in itertools.product(*plan.axes.values())
        for repeat in range(repeats)
    ]
    _check_unique(grid, specs, sets)
    return specs


def _check_plans(grid: Grid, plans: list[RowPlan], repeats: int, allow_ssh: bool) -> None:
    """Before any config is built: no run over ssh without ``allow_ssh``, and a number of runs that can be
    planned at all (``repeats = 1000000`` would otherwise build configs for hours)."""
    for plan in plans:
        if not allow_ssh:
            _refuse_remote(grid, plan)
    total = repeats * sum(math.prod(len(values) for values in plan.axes.values()) for plan in plans)
    if total > MAX_RUNS:
        raise grid.error(
            "repeats" if repeats > MAX_RUNS else "axes",
            f"the grid plans {total:,} runs (rows x axis values x repeats); more than {MAX_RUNS:,} is surely a mistake",
        )


def _refuse_remote(grid: Grid, plan: RowPlan) -> None:
    """A grid file is data anyone can hand over; one that sets ``ssh`` (or ``hosts``) would make
    `trainscale bench` run commands on machines it names. That takes the user's own ``--allow-ssh``."""
    layers = {**grid.base, **plan.fixed, **plan.overrides}
    for key in REMOTE_KEYS:
        values = plan.axes.get(key, [layers.get(key)])
        chosen = next((v for v in values if v not in (None, False)), None)
        if chosen is not None:
            raise _error(
                grid,
                key,
                {key: chosen},
                plan.sources,
                f"'{key}' = {chosen!r} would make the runs start "
                "commands on other machines (over ssh); pass `trainscale bench --allow-ssh` to allow it",
            )


def _spec(grid: Grid, plan: RowPlan, point: dict[str, Any], repeat: int, repeats: int) -> RunSpec:
    values = {**grid.base, **plan.fixed, **point, **plan.overrides}
    values["seed"] = values.get("seed", 0) + repeat
    config = build_run_config(grid, values, plan.sources)
    digest = config_hash(config)
    label = run_label(grid, plan.short_name, point)
    name = f"{label}-r{repeat}" if repeats > 1 else label
    return RunSpec(
        run_id=f"{name}-{digest}",
        name=name,
        label=label,
        repeat=repeat,
        config=config,
        config_hash=digest,
        point=point,
        short_name=plan.short_name,
    )


def build_run_config(grid: Grid, values: dict[str, Any], sources: dict[str, str]) -> dict[str, Any]:
    """``build_config`` on the merged values; its one-line error gets the file and line of the key."""
    from trainscale.app.config import build_config

    _check_mode(grid, values.get("mode"), sources.get("mode", "base"), values)
    try:
        cfg = build_config(take_cluster_keys(values))
        _check_batch(cfg)
        _check_named(cfg, values)
    except (ConfigError, TypeError, ValueError) as exc:
        key = _key_in_message(str(exc), values)
        raise _error(grid, key, values, sources, f"{exc} ({_describe(values, sources)})") from None
    return {k: v for k, v in cfg.to_dict().items() if k not in RUNNER_OWNED}


def _error(grid: Grid, key: str | None, values: dict[str, Any], sources: dict[str, str], message: str) -> GridError:
    """Named by the grid's file and line of ``key``, or by its --set when --set chose it."""
    if key is not None and sources.get(key) == SET_SOURCE:
        return GridError(f"{set_text({key: values[key]})}: {message}")
    return grid.error(sources.get(key, "base") if key is not None else "base", message)


def _check_batch(cfg: CoreConfig) -> None:
    """The batch split over workers (what the launcher checks, minus the data): fails here, not mid-grid."""
    BatchPlan.resolve(cfg, (cfg.launch.workers or 1) * cfg.launch.nnodes)


def _check_named(cfg: TrainConfig, values: dict[str, Any]) -> None:
    """What a run reads that the grid only names, a ``baseline`` run folder and a ``cluster`` made with `trainscale
    cluster up`, is there now: else every run of the grid would start and fail on it (a cluster the bench makes
    from ``cluster_hosts`` and ``bandwidth`` is made when its runs come)."""
    from trainscale.app.run import load_baseline
    from trainscale.cluster.command import load

    load_baseline(cfg)
    named = cfg.launch.cluster if values.get("cluster") is not None else None
    if named is not None:
        try:
            load(named)
        except ConfigError as exc:
            raise ConfigError(f"--cluster {named}: {exc}") from None


def _check_mode(grid: Grid, mode: Any, path: str, values: dict[str, Any]) -> None:
    from trainscale.modes.base import MODES

    if mode is None or mode == "auto" or mode in MODES:
        return
    raise _error(grid, "mode", values, {"mode": path}, MODES.unknown_message(mode))


def _key_in_message(message: str, values: dict[str, Any]) -> str | None:
    """The key a ``build_config`` error is about: its --flag, else the first key named in it."""
    for flag in re.findall(r"--([a-z][a-z0-9-]*)", message):
        if flag.replace("-", "_") in values:
            return flag.replace("-", "_")
    for word in re.findall(r"\b(model|dataset|schedule|optimizer|recipe|mode)\b", message):
        if word in values:
            return word
    return None


def _describe(values: dict[str, Any], sources: dict[str, str]) -> str:
    varied = {k: values[k] for k, path in sources.items() if ".axes." in f".{path}" or path.startswith("rows")}
    return "run with " + ", ".join(f"{k}={v!r}" for k, v in varied.items()) if varied else "every run"


def significant(config: dict[str, Any], exclude: frozenset[str] = HASH_EXCLUDE) -> dict[str, Any]:
    """The settings that identify a run: plumbing (``exclude``) and values equal to TrainConfig's
    defaults left out, so a trainscale that adds a flag (default: the old behaviour) keeps every run id.
    A changed default is still caught: the run's own config.json is compared key by key."""
    known = defaults()
    return {k: v for k, v in config.items() if k not in exclude and (k not in known or known[k] != v)}


def defaults() -> dict[str, Any]:
    """TrainConfig's default values."""
    from trainscale.app.config import TrainConfig

    return TrainConfig().to_dict()


def config_hash(config: dict[str, Any]) -> str:
    """8 hex digits of SHA-256 over the canonical JSON (sorted keys) of ``significant(config)``."""
    canonical = json.dumps(significant(config), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:8]


def run_label(grid: Grid, short_name: str, point: dict[str, Any]) -> str:
    """Readable and filesystem-safe: the row's short name and the axis values, e.g. ``1P1G0M-lr0.1``."""
    parts = [short_name] if short_name else []
    parts += [f"{ABBREVIATIONS.get(k, k)}{_value_text(v)}" for k, v in point.items()]
    text = "-".join(parts) or grid.name
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "run"


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return "_".join(map(str, value))
    return str(value)


def _check_unique(grid: Grid, specs: list[RunSpec], sets: dict[str, Any]) -> None:
    seen: dict[str, RunSpec] = {}
    for spec in specs:
        if spec.config_hash in seen:
            cause = f" once {set_text(sets)} applies to every run" if sets else ""
            raise grid.error(
                "rows",
                f"runs '{seen[spec.config_hash].name}' and '{spec.name}' have the same "
                f"settings{cause}; remove the duplicate row or axis value",
            )
        seen[spec.config_hash] = spec
