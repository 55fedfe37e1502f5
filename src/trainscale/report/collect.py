"""Find the runs a report covers: grid folders (``grid.json``) and plain run folders (``summary.json``).

From a grid folder only the runs its ``grid.json`` plans are read, and each must still hold exactly that
run (``bench.runfolder.folder_state``): a leftover folder from older settings is listed as excluded,
never averaged in. Failed runs come with their error from the ledger. A run whose own files cannot be read
(a corrupt ``summary.json``, a bad line inside ``metrics.jsonl``) is listed as corrupt and named in a warning;
a grid folder's ``grid.json`` or ledger that cannot be read is an error (which runs it holds is unknown). A
torn last line of a JSON Lines file (an interrupted append) is dropped with a warning (``io.read_jsonl``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainscale.errors import ConfigError, DataError
from trainscale.io import read_json, read_jsonl
from trainscale.record import METRICS, RUN_TOML, SUMMARY, K, finished, malformed
from trainscale.results import read_history

log = logging.getLogger("trainscale.report")


@dataclass
class RunRecord:
    """One run as the report sees it; ``status`` is ok, failed, timeout, incomplete, not run, excluded or
    corrupt."""

    folder: Path
    status: str
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    bench: dict[str, Any] = field(default_factory=dict)
    grid: str = ""
    error: str = ""

    @property
    def run_id(self) -> str:
        return self.bench.get("run_id") or self.folder.name

    @property
    def label(self) -> str:
        """The configuration's name in tables: the grid's label (no repeat suffix), else the folder name."""
        return self.bench.get("label") or self.folder.name

    @property
    def environment(self) -> dict[str, Any]:
        return self.summary.get(K.environment) or {}

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class Collection:
    records: list[RunRecord]
    warnings: list[str]


def collect(dirs: list[Path]) -> Collection:
    """Every run under ``dirs`` (each a grid folder, a run folder or a folder holding either), once."""
    records: list[RunRecord] = []
    warnings: list[str] = []
    seen: set[Path] = set()
    for top in dirs:
        if not Path(top).is_dir():
            raise ConfigError(f"{top} is not a folder; give grid folders (`trainscale bench --out`) or run folders")
        found = _walk(Path(top), warnings)
        records += [r for r in found if r.folder.resolve() not in seen]
        seen.update(r.folder.resolve() for r in found)
    if not records:
        raise ConfigError(_nothing_to_report(dirs))
    return Collection(records, warnings)


def _nothing_to_report(dirs: list[Path]) -> str:
    """Why ``dirs`` hold no run to report: none at all, or runs that have not finished an epoch yet (their
    ``run.toml`` is written at the start, ``summary.json`` after the first epoch)."""
    started = sorted(p.parent for top in dirs for p in Path(top).rglob(RUN_TOML))
    if not started:
        return f"no runs found in {', '.join(map(str, dirs))} (no grid.json or summary.json)"
    more = f" and {len(started) - 1} more" if len(started) > 1 else ""
    return (
        f"no run in {', '.join(map(str, dirs))} has finished an epoch yet: {started[0]}{more} holds a run in "
        "progress or one stopped before its first epoch ended; report it once an epoch is done"
    )


def _walk(top: Path, warnings: list[str]) -> list[RunRecord]:
    grids = sorted(p.parent for p in top.rglob("grid.json"))
    records = [r for g in grids for r in grid_records(g, warnings)]
    for summary in sorted(top.rglob(SUMMARY)):
        if not any(g in summary.parents for g in grids):
            records.append(plain_record(summary.parent, warnings))
    return records


def plain_record(folder: Path, warnings: list[str] | None = None) -> RunRecord:
    """A run folder made by `trainscale train` directly: ok only when its summary covers every epoch."""
    record = read_run(RunRecord(folder, "ok"), warnings)
    summary = record.summary
    if record.ok and not finished(summary):
        record.status = "incomplete"
        record.error = f"{summary.get(K.epochs_completed)} of {summary.get(K.epochs)} epochs finished"
    return record


def read_run(record: RunRecord, warnings: list[str] | None) -> RunRecord:
    """Fill ``record`` from its folder's files; one that cannot be read makes the run corrupt (never ok),
    said in one warning naming the file."""
    try:
        record.summary = _object(record.folder / SUMMARY)
        record.config = _config(record.folder)
        record.metrics = read_history(record.folder)
        _check(record)
    except DataError as exc:
        record.status, record.error = "corrupt", str(exc)
        record.summary, record.metrics = {}, []  # what was read of it is not computed with
        _warn(f"run {record.folder} is left out of the tables: {exc}", warnings)
    return record


def _check(record: RunRecord) -> None:
    """A value that trainscale never writes (a key of the wrong kind, a number that is not finite) makes the
    file corrupt, said before a table computes with it."""
    rows = [(f"{record.folder / SUMMARY}", record.summary, SUMMARY)]
    rows += [(f"{record.folder / METRICS} row {n}", row, METRICS) for n, row in enumerate(record.metrics, start=1)]
    for where, row, file in rows:
        problem = malformed(row, file) if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"
        if problem:
            raise DataError(f"{where}: {problem}; the file is corrupt: restore or delete it")


def _warn(message: str, warnings: list[str] | None) -> None:
    log.warning(message)
    if warnings is not None:
        warnings.append(message)


def grid_records(root: Path, warnings: list[str]) -> list[RunRecord]:
    """The runs ``root/grid.json`` plans, each checked to still hold that run."""
    grid = _object(root / "grid.json")
    ledger = _ledger(root)
    planned = grid.get("runs", [])
    _warn_stale(root, {r["run_id"] for r in planned}, warnings)
    name = grid.get("name", root.name)
    return [_grid_record(root, name, run, ledger.get(run["run_id"], {}), warnings) for run in planned]


def _grid_record(
    root: Path, name: str, run: dict[str, Any], last: dict[str, Any], warnings: list[str] | None = None
) -> RunRecord:
    from trainscale.bench.expand import RunSpec
    from trainscale.bench.runfolder import State, folder_state

    record = read_run(RunRecord(root / "runs" / run["run_id"], "ok", bench=dict(run), grid=name), warnings)
    if not record.ok:
        return record
    folder = record.folder
    spec = RunSpec(run["run_id"], run["name"], run["label"], run["repeat"], run["config"], run["config_hash"])
    try:
        state = folder_state(folder, spec)
    except ConfigError as exc:
        record.status, record.error = "excluded", str(exc)
        return record
    if state is not State.DONE:
        record.status = last.get("status", "not run") if last.get("status") != "skipped" else "incomplete"
        record.error = last.get("error", "") or "no finished run in the folder"
    return record


def _warn_stale(root: Path, planned: set[str], warnings: list[str]) -> None:
    runs = root / "runs"
    stale = sorted(p.name for p in runs.iterdir() if p.is_dir() and p.name not in planned) if runs.is_dir() else []
    if stale:
        message = (
            f"{root}: {len(stale)} run folder(s) not planned by its grid.json (older settings) are left "
            f"out: {', '.join(stale[:5])}{' ...' if len(stale) > 5 else ''}"
        )
        _warn(message, warnings)


def _ledger(root: Path) -> dict[str | None, dict[str, Any]]:
    """Last ledger line per run id."""
    path = root / "grid.jsonl"
    entries = read_jsonl(path) if path.exists() else []
    return {entry.get("run_id"): entry for entry in entries if isinstance(entry, dict)}


def _object(path: Path) -> dict[str, Any]:
    """A JSON object file ({} when absent); unreadable, corrupt or not an object: a DataError naming it."""
    try:
        value = read_json(path)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise DataError(f"{path} cannot be read ({exc.strerror or exc}); restore or delete it") from None
    if not isinstance(value, dict):
        raise DataError(
            f"{path} holds a JSON {type(value).__name__}, not an object; the file is corrupt: restore or delete it"
        )
    return value


def _config(folder: Path) -> dict[str, Any]:
    config = _object(folder / "config.json")
    config.pop("resolved", None)
    return config
