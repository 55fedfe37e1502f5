"""A benchmark grid file: a base config, axes whose cartesian product gives the runs, optional named
rows, repeats, and per-scale overrides (``quick`` for a small CPU, ``full`` for the source's own settings).

Every mistake is found here, before any run starts, and named with the file and line: an unknown key
(with a did-you-mean), a value of the wrong type, an empty axis. The format::

    name = "keras-resnet50"          # required; also the default label of the runs
    description = "..."              # optional, shown in the report
    source = "Keras-MXNet scaling"   # optional: the results page the grid reproduces
    repeats = 1                      # runs per configuration (seed, seed+1, ...), default 1
    [base]                           # `trainscale train` keys shared by every run
    [axes]                           # key = [values]: the cartesian product of all axes
    [[rows]]                         # optional named configurations, each crossed with the axes
    short_name = "1P1G0M"            #   the label in the report's tables
    axes.workers = [1, 2]            #   axes of this row only
    scale.quick.workers = 2          #   this row's own overrides at a scale (win over [scale.quick])
    [scale.quick]                    # overrides for `--scale quick`: train keys, repeats, description,
    axes.workers = [1, 2]            #   axes.KEY = [...] replaces that axis' values,
    rows = ["1P1G0M"]                #   rows = [short names] runs only those rows

Precedence for one run, later wins: defaults < [base] < the row < its axis values < [scale.NAME] < the
row's scale.NAME < `trainscale bench --set KEY=VALUE` (and ``--data-dir``). A scale's train keys apply to
every row (a quick scale shrinks the model everywhere); ``--set`` applies to every run of the grid.
"""

from __future__ import annotations

import argparse
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from trainscale.bench.locate import KeyLocator
from trainscale.errors import ConfigError
from trainscale.io import read_toml

TOP_KEYS = ("name", "description", "source", "repeats", "base", "axes", "rows", "scale")
ROW_KEYS = ("short_name", "axes", "scale")
SCALE_KEYS = ("description", "repeats", "axes", "rows")
# Set by the runner for every run: neither a grid nor --set may choose them.
RUNNER_OWNED = ("out", "resume", "progress", "config", "dry_run")
# Grid keys that are no `trainscale train` flag: an emulated cluster the bench makes (cluster.bench).
CLUSTER_KEY_TYPES = {"cluster_hosts": "int", "bandwidth": "str"}


class GridError(ConfigError):
    """The grid file (or a --set of `trainscale bench`) is wrong; the message names the file, line and key."""


@dataclass
class Grid:
    """A parsed grid file: raw sections, plus the text and key locator for error messages."""

    path: Path
    text: str
    name: str
    description: str = ""
    source: str = ""
    repeats: int = 1
    base: dict[str, Any] = field(default_factory=dict)
    axes: dict[str, list[Any]] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    scales: dict[str, dict[str, Any]] = field(default_factory=dict)
    locator: KeyLocator | None = None

    def where(self, path: str) -> str:
        """``file:line`` of a dotted key path (``rows[0].lr``), or the file alone when not found."""
        line = self.locator.line(path) if self.locator else None
        return f"{self.path}:{line}" if line else str(self.path)

    def error(self, path: str, message: str) -> GridError:
        return GridError(f"{self.where(path)}: {message}")


def load_grid(path: str | Path) -> Grid:
    """Read and check the structure of a grid file (values are checked when the runs are planned)."""
    path = Path(path)
    text, raw = read_toml(path, "grid file", GridError)
    grid = Grid(path=path, text=text, name="", locator=KeyLocator(text))
    _check_printable(grid, raw, "")
    _check_keys(grid, raw, TOP_KEYS, "", "top-level grid keys")
    grid.name = _string(grid, raw, "name", required=True)
    grid.description = _string(grid, raw, "description")
    grid.source = _string(grid, raw, "source")
    grid.repeats = _repeats(grid, raw.get("repeats", 1), "repeats")
    grid.base = _train_keys(grid, _table(grid, raw, "base"), "base")
    grid.axes = _axes(grid, _table(grid, raw, "axes"), "axes")
    grid.rows = [_row(grid, row, i) for i, row in enumerate(_rows(grid, raw))]
    grid.scales = {name: _scale(grid, value, f"scale.{name}") for name, value in _table(grid, raw, "scale").items()}
    grid.rows = [_row_scales(grid, row, i) for i, row in enumerate(grid.rows)]
    _check_row_filters(grid)
    return grid


def _check_printable(grid: Grid, table: dict[str, Any], prefix: str) -> None:
    """Every key and value must be printable on one line and every integer 64-bit (``value_problem``):
    messages quote them, and a run's config is built from them."""
    from trainscale.app.config import value_problem

    for key, value in table.items():
        path = _join(prefix, key)
        problem = value_problem(key)
        if problem:
            raise grid.error(prefix or "name", f"a key {problem}")
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            where = f"{path}[{index}]" if isinstance(value, list) else path
            if isinstance(item, dict):
                _check_printable(grid, item, where)
            elif problem := value_problem(item):
                raise grid.error(path, f"'{key}' {problem}")


def _check_keys(grid: Grid, table: dict[str, Any], allowed: tuple[str, ...], prefix: str, what: str) -> None:
    for key in table:
        if key.replace("-", "_") not in allowed:
            raise grid.error(
                _join(prefix, key),
                f"unknown key '{key}'{_did_you_mean(key, allowed)}; {what} are: {', '.join(allowed)}",
            )


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _did_you_mean(key: str, choices: Any) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _string(grid: Grid, raw: dict[str, Any], key: str, required: bool = False) -> str:
    value = raw.get(key, "")
    if required and not value:
        raise grid.error(key, f"the grid needs a '{key}' (a short text naming it)")
    if not isinstance(value, str):
        raise grid.error(key, f"'{key}' must be a string, got {value!r}")
    return value


def _repeats(grid: Grid, value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise grid.error(path, f"'repeats' must be a positive integer, got {value!r}")
    return value


def _table(grid: Grid, raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise grid.error(key, f"'{key}' must be a table ([{key}]), got {value!r}")
    return value


def _rows(grid: Grid, raw: dict[str, Any]) -> list[dict[str, Any]]:
    rows = raw.get("rows", [])
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise grid.error("rows", "'rows' must be an array of tables ([[rows]])")
    return rows


def _row(grid: Grid, row: dict[str, Any], index: int) -> dict[str, Any]:
    prefix = f"rows[{index}]"
    extras = {k: row[k] for k in ROW_KEYS if k in row}
    if "short_name" in extras and not isinstance(extras["short_name"], str):
        raise grid.error(f"{prefix}.short_name", f"'short_name' must be a string, got {extras['short_name']!r}")
    values = _train_keys(grid, {k: v for k, v in row.items() if k not in ROW_KEYS}, prefix, ROW_KEYS)
    if "axes" in extras:
        values["axes"] = _axes(grid, extras["axes"], f"{prefix}.axes")
    if "short_name" in extras:
        values["short_name"] = extras["short_name"]
    if "scale" in extras:
        values["scale"] = extras["scale"]  # checked once every scale is known (_row_scales)
    return values


def _row_scales(grid: Grid, row: dict[str, Any], index: int) -> dict[str, Any]:
    """A row's ``scale.NAME`` tables: train keys and axes, for scales the grid defines."""
    table = row.get("scale", {})
    prefix = f"rows[{index}].scale"
    if not isinstance(table, dict):
        raise grid.error(prefix, "a row's 'scale' must be a table: scale.NAME.KEY = value")
    checked = {}
    for name, value in table.items():
        if name not in grid.scales:
            raise grid.error(
                f"{prefix}.{name}",
                f"row overrides scale '{name}', which the grid does not define "
                f"(its scales: {', '.join(grid.scales) or 'none'})",
            )
        checked[name] = _scale_keys(grid, value, f"{prefix}.{name}", ("axes",))
    return {**row, "scale": checked} if checked else {k: v for k, v in row.items() if k != "scale"}


def _check_row_filters(grid: Grid) -> None:
    names = [row.get("short_name") for row in grid.rows]
    for scale, table in grid.scales.items():
        wanted = table.get("rows")
        if wanted is None:
            continue
        path = f"scale.{scale}.rows"
        if not isinstance(wanted, list) or not wanted or not all(isinstance(n, str) for n in wanted):
            raise grid.error(path, "'rows' must be a non-empty list of the rows' short names")
        for name in wanted:
            if name not in names:
                raise grid.error(path, f"no row has short_name '{name}'{_did_you_mean(name, names)}")


def _scale(grid: Grid, table: Any, prefix: str) -> dict[str, Any]:
    values = _scale_keys(grid, table, prefix, SCALE_KEYS)
    if "rows" in table:
        values["rows"] = table["rows"]
    if "repeats" in table:
        values["repeats"] = _repeats(grid, table["repeats"], f"{prefix}.repeats")
    if "description" in table:
        values["description"] = _string(grid, table, "description")
    return values


def _scale_keys(grid: Grid, table: Any, prefix: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """Train keys and ``axes`` of a scale table; the other ``allowed`` keys are the caller's."""
    if not isinstance(table, dict):
        raise grid.error(prefix, f"'{prefix}' must be a table ([{prefix}])")
    values = _train_keys(grid, {k: v for k, v in table.items() if k not in allowed}, prefix, allowed)
    if "axes" in table:
        values["axes"] = _axes(grid, table["axes"], f"{prefix}.axes")
    return values


def _axes(grid: Grid, table: Any, prefix: str) -> dict[str, list[Any]]:
    if not isinstance(table, dict):
        raise grid.error(prefix, f"'{prefix}' must be a table of key = [values]")
    axes: dict[str, list[Any]] = {}
    for key, values in table.items():
        name = _train_key(grid, key, f"{prefix}.{key}")
        _once(grid, axes, name, f"{prefix}.{key}")
        if not isinstance(values, list):
            raise grid.error(f"{prefix}.{key}", f"axis '{key}' must be a list of values, got {values!r}")
        if not values:
            raise grid.error(f"{prefix}.{key}", f"axis '{key}' is empty: give at least one value")
        for value in values:
            check_type(grid, name, value, f"{prefix}.{key}")
        axes[name] = values
    return axes


def _train_keys(grid: Grid, table: dict[str, Any], prefix: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, value in table.items():
        name = _train_key(grid, key, f"{prefix}.{key}", extra)
        _once(grid, values, name, f"{prefix}.{key}")
        check_type(grid, name, value, f"{prefix}.{key}")
        values[name] = value
    return values


def _once(grid: Grid, given: dict[str, Any], name: str, path: str) -> None:
    """A setting a table gives twice (``batch-size`` and ``batch_size``) is refused: one value would be lost."""
    if name in given:
        raise grid.error(path, f"'{name}' is given twice in this table (with - and with _); keep one")


def _train_key(grid: Grid, key: str, path: str, extra: tuple[str, ...] = ()) -> str:
    """A `trainscale train` key (dashes or underscores); the error says which keys exist."""
    problem = key_problem(key, "remove it from the grid", "grid keys are the `trainscale train` flags", extra)
    if problem:
        raise grid.error(path, problem)
    return key.replace("-", "_")


def key_problem(key: str, owned_hint: str, unknown_hint: str, extra: tuple[str, ...] = ()) -> str | None:
    """Why ``key`` is no `trainscale train` setting a grid or --set may choose (None when it is one)."""
    from trainscale.app.config import FIELDS

    name = key.replace("-", "_")
    if name in RUNNER_OWNED:
        return f"key '{key}' is set by `trainscale bench` for each run; {owned_hint}"
    if name in FIELDS or name in CLUSTER_KEY_TYPES:
        return None
    return (
        f"unknown key '{key}'{_did_you_mean(name, [*FIELDS, *extra])}; {unknown_hint} (see `trainscale train --help`)"
    )


def check_type(grid: Grid, name: str, value: Any, path: str) -> None:
    """The value's TOML type must fit the TrainConfig field (``epochs = "ten"`` fails here, by line)."""
    problem = type_problem(name, value)
    if problem:
        raise grid.error(path, problem)


def type_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be TrainConfig field ``name`` (None when its type fits); a ``KEY=VALUE`` field
    (``model_args``) takes a table too."""
    if isinstance(value, dict) and _pairs(name):
        return None
    expected = [k for k in _kinds(name) if k != "None"]
    if any(_fits(kind, value) for kind in expected):
        return None
    return f"'{name}' must be {' or '.join(expected)}, got {value!r}"


def _pairs(name: str) -> bool:
    from trainscale.app.config import FIELDS

    return name in FIELDS and bool(FIELDS[name].metadata.get("pairs"))


def _kinds(name: str) -> list[str]:
    from trainscale.app.config import FIELDS

    if name in CLUSTER_KEY_TYPES:
        return [CLUSTER_KEY_TYPES[name]]
    return str(FIELDS[name].type).replace(" ", "").split("|")


def _fits(kind: str, value: Any) -> bool:
    if kind.startswith("list["):
        return isinstance(value, list) and all(_fits(kind[5:-1], v) for v in value)
    simple = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
    if kind not in simple:
        return True  # a type this check does not know: build_config decides
    return isinstance(value, simple[kind]) and (kind == "bool" or not isinstance(value, bool))


# ------------------------------------------------------------------ `trainscale bench --set KEY=VALUE`


def parse_set(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key as typed, value): the value is read as a TOML value (``2``, ``0.1``, ``true``,
    ``"bf16"``, ``[2, 3]``); a bare word that is no TOML value is a string (``precision=bf16``), and so is
    a bare word for a text setting (``rdzv_id=42`` is "42")."""
    key, sep, text = item.partition("=")
    key, text = key.strip(), text.strip()
    if not sep or not key:
        raise GridError(f"--set {item}: give KEY=VALUE, e.g. --set epochs=2")
    bare = not text or text[0] not in "[{\"'"
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        if not bare or not text:
            raise GridError(
                f"--set {item}: '{text}' is not a TOML value (a number, true/false, \"text\" or [a, list])"
            ) from None
        return key, text
    return key, text if bare and _wants_text(key, value) else value


def _wants_text(key: str, value: Any) -> bool:
    """A bare word for a text setting that TOML read as something else (``rdzv_id=42``): keep the text."""
    from trainscale.app.config import FIELDS

    name = key.replace("-", "_")
    return name in FIELDS and "str" in _kinds(name) and type_problem(name, value) is not None


def parse_sets(items: list[str]) -> dict[str, Any]:
    """Every ``--set KEY=VALUE``, parsed and checked (``check_sets``); a key given twice is an error."""
    sets: dict[str, Any] = {}
    for item in items:
        key, value = parse_set(item)
        name = key.replace("-", "_")
        if name in sets:
            raise GridError(f"--set {item}: '{name}' is given twice with --set; keep one")
        sets[name] = check_sets({key: value})[name]
    return sets


def set_argument(item: str) -> str:
    """An argparse ``type`` for a script's ``--set KEY=VALUE`` of `trainscale train` settings: the item checked
    as :func:`parse_sets` checks it (known key, value of its type) when the command line is read, so a mistyped
    key stops the script with argparse's one line before any run starts; the text comes back unchanged."""
    try:
        key, value = parse_set(item)
        check_sets({key: value})
    except GridError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--set ")) from None
    return item


def check_sets(sets: dict[str, Any]) -> dict[str, Any]:
    """--set values checked like grid keys (unknown or runner-owned key, wrong type: a one-line error
    naming --set); keys come back with underscores."""
    checked: dict[str, Any] = {}
    for key, value in sets.items():
        shown = f"--set {key}={_text(value)}"
        name = key.replace("-", "_")
        problem = key_problem(
            key, "it cannot be given with --set", "--set takes the `trainscale train` flags"
        ) or type_problem(name, value)
        if problem:
            raise GridError(f"{shown}: {problem}")
        if name in checked:
            raise GridError(f"{shown}: '{name}' is given twice with --set; keep one")
        checked[name] = value
    return checked


def set_text(sets: dict[str, Any]) -> str:
    """``--set a=1 --set b="x"``, as a user would type them (for messages and the plan)."""
    return " ".join(f"--set {k}={_text(v)}" for k, v in sets.items())


def _text(value: Any) -> str:
    return json.dumps(value)  # a JSON number, boolean, string or list of them is also a TOML value
