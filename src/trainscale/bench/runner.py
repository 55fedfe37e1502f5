"""`trainscale bench GRID.toml --out DIR`: run a grid one run after another, resumable and failure-tolerant.

Layout of DIR::

    grid.json       the grid file's text, the scale, the --set values (``--data-dir`` as ``data_dir``),
                    every planned run (id, labels, resolved config, hash) and one entry per bench
                    session with its environment
    grid.jsonl      the ledger: one line per run attempt (ok / failed / timeout / skipped, seconds, error)
    runs/<run-id>/  a normal `trainscale train` run folder, plus bench.json (the marker), run.toml (the
                    generated config), train.log (every attempt's output, each after a line naming it) and
                    error.txt when the last attempt failed

Each run is ``python -m trainscale train --config runs/<id>/run.toml --out runs/<id>`` in its own process
group. Finished runs are skipped, a checkpointed unfinished run is resumed, a failed run is recorded and
the grid goes on. DIR made from other settings (another grid, scale or --set) is refused before anything
runs (``--update`` re-uses the runs whose settings still match).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from trainscale.bench import process
from trainscale.bench.expand import RunSpec, plan_runs
from trainscale.bench.grid import Grid, GridError, check_sets, load_grid, set_text
from trainscale.bench.runfolder import ERROR, LOG, State, folder_state, write_run_files
from trainscale.cluster.bench import cluster_for
from trainscale.io import append_jsonl, atomic_write_text, dumps, open_output, read_json
from trainscale.record import SUMMARY, finished
from trainscale.results import LOCK_FILE, in_use_message, lock_holder, lock_run_folder
from trainscale.stops import stops_held

log = logging.getLogger("trainscale.bench")

ERROR_TAIL_LINES = 40


@dataclass
class RunResult:
    run_id: str
    name: str
    status: str  # ok, failed, timeout, skipped
    seconds: float = 0.0
    returncode: int | None = None
    error: str = ""


@dataclass
class BenchOptions:
    grid: Path
    out: Path
    scale: str | None = None  # --scale as given; see effective_scale
    timeout: float | None = None
    update: bool = False
    python: str = sys.executable
    sets: dict[str, Any] = field(default_factory=dict)  # --set KEY=VALUE: over the grid, for every run
    data_dir: Path | None = None  # --data-dir: --set data_dir=DIR, checked to be a folder first
    allow_ssh: bool = False  # --allow-ssh: the grid may set hosts/ssh (runs that start commands elsewhere)


def plan(options: BenchOptions) -> tuple[Grid, list[RunSpec]]:
    """Parse and validate the grid and its results folder: every error is raised here, before anything is
    written."""
    sets = overrides(options)
    grid = load_grid(options.grid)
    check_results_folder(options.out)
    return grid, plan_runs(grid, effective_scale(options, grid), sets, allow_ssh=options.allow_ssh)


def check_results_folder(out: Path) -> None:
    """A bench writes into a new or empty folder or a bench's own (its ``grid.json``), never beside a user's files or
    a run of `trainscale train`, whose results a report of the folder would then leave out."""
    if not out.exists():
        return
    if not out.is_dir():
        raise GridError(f"--out {out} is a file; give a folder for the grid's results")
    holder = lock_holder(out)
    if holder is not None:
        raise GridError(in_use_message(out, holder))
    if (out / "grid.json").is_file():
        return
    own = {(LOCK_FILE, False), ("runs", True)}  # a bench's lock, and its runs' folders (each checked on its own)
    other = sorted(p.name for p in out.iterdir() if (p.name, p.is_dir()) not in own)
    if other:
        raise GridError(
            f"--out {out} holds {other[0]} and is no trainscale bench folder (it has no grid.json); choose a new or "
            "empty folder"
        )


def overrides(options: BenchOptions) -> dict[str, Any]:
    """``--set`` values, checked, with ``--data-dir`` as ``data_dir`` (an absolute path to a folder that
    exists, so a run never starts without its data)."""
    sets = check_sets(options.sets)
    if options.data_dir is None:
        return sets
    if "data_dir" in sets:
        raise GridError(
            f"--data-dir {options.data_dir} and {set_text({'data_dir': sets['data_dir']})} both "
            "choose the data folder; give one"
        )
    folder = Path(options.data_dir).expanduser()
    if not folder.is_dir():
        raise GridError(
            f"--data-dir {options.data_dir}: no such folder" + (" (it is a file)" if folder.exists() else "")
        )
    return {**sets, "data_dir": str(folder.resolve())}


DEFAULT_SCALE = "quick"


def effective_scale(options: BenchOptions, grid: Grid) -> str | None:
    """``--scale``, else ``quick`` for a grid with scales and None for one without (its settings are the only
    ones). A ``--scale`` the grid does not have is refused when the runs are planned, also on a grid without
    scales: running it anyway would record runs the user did not ask for."""
    if options.scale is None:
        return DEFAULT_SCALE if grid.scales else None
    return options.scale


def run_grid(options: BenchOptions) -> list[RunResult]:
    """Run every planned run not yet finished; returns one result per planned run, in plan order."""
    grid, specs = plan(options)
    runs_dir = options.out / "runs"
    with lock_run_folder(options.out):  # one bench at a time per folder: a second would run the runs twice
        states = {s.run_id: folder_state(runs_dir / s.run_id, s) for s in specs}  # raises on any mismatch
        write_grid_json(options, grid, specs)
        results = [_skipped(s) for s in specs if states[s.run_id] is State.DONE]
        todo = [s for s in specs if states[s.run_id] is not State.DONE]
        log.info(
            "grid %s (scale %s): %d run(s), %d already finished, %d to run; results in %s",
            grid.name,
            effective_scale(options, grid) or "none",
            len(specs),
            len(results),
            len(todo),
            options.out,
        )
        for result in results:
            append_ledger(options.out, result)
        results += _run_all(options, todo, states)
    order = {s.run_id: i for i, s in enumerate(specs)}
    return sorted(results, key=lambda r: order[r.run_id])


def _skipped(spec: RunSpec) -> RunResult:
    return RunResult(spec.run_id, spec.name, "skipped")


def _run_all(options: BenchOptions, todo: list[RunSpec], states: dict[str, State]) -> list[RunResult]:
    """Run ``todo`` grouped by emulated cluster (``cluster.bench``), so each is made once and deleted after
    its last run."""
    results: list[RunResult] = []
    groups: dict[str | None, list[RunSpec]] = {}
    for spec in todo:
        groups.setdefault(spec.config.get("cluster"), []).append(spec)
    with tqdm(total=len(todo), desc=f"bench {options.grid.stem}", unit="run", dynamic_ncols=True, disable=None) as bar:
        for cluster, specs in groups.items():
            with cluster_for(cluster):
                for spec in specs:
                    bar.set_postfix_str(spec.name)
                    result = run_one(options, spec, states[spec.run_id] is State.RESUME, bar)
                    results.append(result)
                    append_ledger(options.out, result)
                    bar.update(1)
                    log.info(
                        "[%d/%d] %s: %s in %.1f s%s (%s left)",
                        len(results),
                        len(todo),
                        spec.run_id,
                        result.status,
                        result.seconds,
                        f": {result.error}" if result.error else "",
                        _eta(results, len(todo)),
                    )
    return results


def _eta(results: list[RunResult], total: int) -> str:
    seconds = statistics.fmean(r.seconds for r in results) * (total - len(results))
    return str(_dt.timedelta(seconds=round(seconds)))


def run_one(options: BenchOptions, spec: RunSpec, resume: bool, bar: tqdm | None = None) -> RunResult:
    """One run in a child process; a failure or timeout is recorded in the folder and returned, not raised."""
    folder = options.out / "runs" / spec.run_id
    config = write_run_files(folder, spec, resume)
    (folder / ERROR).unlink(missing_ok=True)
    cmd = [options.python, "-m", "trainscale", "train", "--config", str(config), "--out", str(folder)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open_output(folder / LOG, append=True) as log_file:
        log_file.write(f"--- attempt of {_now()}: {shlex.join(cmd)}\n".encode())
    offset = (folder / LOG).stat().st_size  # this attempt's output starts here
    start = time.monotonic()
    proc: subprocess.Popen | None = None
    try:
        with stops_held():  # a Ctrl-C while the child starts comes once it is known, so it is stopped too
            proc = process.start(cmd, folder / LOG, env)
        timed_out = process.wait(proc, options.timeout, lambda: _show_epoch(bar, spec, folder))
    except BaseException:  # Ctrl-C or any error here: never leave the run behind
        if proc is not None:
            process.stop(proc)
        raise
    if timed_out:
        process.stop(proc)
    return _result(spec, folder, proc.returncode, time.monotonic() - start, timed_out, options.timeout, offset)


def _show_epoch(bar: tqdm | None, spec: RunSpec, folder: Path) -> None:
    if bar is None:
        return
    try:
        done = sum(1 for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip())
    except OSError:
        done = 0
    bar.set_postfix_str(f"{spec.name} epoch {done}/{math.ceil(spec.config['epochs'])}")  # 2.5: the third in part


def _result(
    spec: RunSpec,
    folder: Path,
    code: int | None,
    seconds: float,
    timed_out: bool,
    timeout: float | None,
    offset: int = 0,
) -> RunResult:
    complete = finished(_summary(folder), spec.config["epochs"])
    if not timed_out and code == 0 and complete:
        return RunResult(spec.run_id, spec.name, "ok", seconds, code)
    tail = _tail(folder / LOG, offset)
    if timed_out:
        error = f"stopped after the --timeout of {timeout:g} s"
    elif code == 0:
        error = "exited with status 0 but summary.json does not cover every epoch"
    else:
        error = _error_line(tail) or f"exited with status {code}"
    atomic_write_text(
        folder / ERROR, f"{error}\nexit status: {code}\n\n--- last lines of {LOG} ---\n" + "\n".join(tail) + "\n"
    )
    return RunResult(spec.run_id, spec.name, "timeout" if timed_out else "failed", seconds, code, error)


def _summary(folder: Path) -> dict[str, Any]:
    try:
        summary = json.loads((folder / SUMMARY).read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _tail(path: Path, offset: int = 0) -> list[str]:
    """The last lines the attempt that began at byte ``offset`` of the log wrote."""
    try:
        with path.open("rb") as log_file:
            log_file.seek(offset)
            return log_file.read().decode(errors="replace").splitlines()[-ERROR_TAIL_LINES:]
    except OSError:
        return []


def _error_line(lines: list[str]) -> str:
    """The child's one-line error (`trainscale train: error: ...`), else its last exception line."""
    for line in reversed(lines):
        if "error:" in line.lower() or line.split(":")[0].endswith(("Error", "Exception")):
            return line.strip()[:500]
    return lines[-1].strip()[:500] if lines else ""


def append_ledger(out: Path, result: RunResult) -> None:
    append_jsonl(out / "grid.jsonl", {"time": _now(), **asdict(result)})


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_grid_json(options: BenchOptions, grid: Grid, specs: list[RunSpec]) -> None:
    """Record what DIR holds; refuse a DIR planned from other settings unless ``--update``."""
    path = options.out / "grid.json"
    old = check_same_plan(options, grid, specs)
    planned = [s.record() for s in specs]
    scale = effective_scale(options, grid)
    sets = overrides(options)
    sessions = (old or {}).get("sessions", []) + [{"started": _now(), "environment": bench_environment()}]
    record = {
        "name": grid.name,
        "description": grid.description,
        "source": grid.source,
        "scale_description": grid.scales.get(scale or "", {}).get("description", ""),
        "grid_file": str(options.grid),
        "grid_text": grid.text,
        "scale": scale,
        "set": sets,
        "timeout": options.timeout,
        "runs": planned,
        "sessions": sessions,
    }
    atomic_write_text(path, dumps(record))


def check_same_plan(options: BenchOptions, grid: Grid, specs: list[RunSpec]) -> dict[str, Any] | None:
    """The folder's ``grid.json`` (None: a new folder), refused when it was planned from other settings unless
    ``--update`` (a dry run says so too, before anything runs)."""
    path = options.out / "grid.json"
    old = read_json(path) if path.exists() else None
    if old is not None and not options.update:
        scale, sets = effective_scale(options, grid), overrides(options)
        _check_same_plan(path, old, grid, scale, sets, [s.run_id for s in specs])
    return old


def _check_same_plan(
    path: Path, old: dict[str, Any], grid: Grid, scale: str | None, sets: dict[str, Any], ids: list[str]
) -> None:
    old_ids = [r["run_id"] for r in old.get("runs", [])]
    changes = [
        f"{what} {a!r} -> {b!r}"
        for what, a, b in (("grid", old.get("name"), grid.name), ("scale", old.get("scale"), scale))
        if a != b
    ]
    if (old.get("set") or {}) != sets:
        changes.append(f"{set_text(old.get('set') or {}) or 'no --set'} -> {set_text(sets) or 'no --set'}")
    gone, new = set(old_ids) - set(ids), set(ids) - set(old_ids)
    if gone or new:
        changes.append(f"{len(gone)} run(s) no longer planned, {len(new)} new")
    if changes:
        raise GridError(
            f"{path} was planned from other settings ({'; '.join(changes)}); results are never "
            "mixed silently: use another --out, or --update to keep the runs whose settings still match"
        )


def bench_environment() -> dict[str, Any]:
    """The machine the grid runs on (each run also records its own in summary.json)."""
    import torch

    from trainscale.train.environment import environment

    return environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
