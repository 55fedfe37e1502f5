"""`trainscale report DIR... --out REPORT`: results.csv, results.md, PNG plots and index.html.

The Markdown and the HTML page are rendered from the same ``Table`` objects, so they cannot disagree.
The output folder is either new or a previous report (recognised by its ``results.md``), whose files
are replaced: a stale plot from an earlier report never survives next to new tables. The new report is written
into a folder beside the output first, so a report that fails or is stopped leaves the previous one whole.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from trainscale.bench.grid import set_text
from trainscale.errors import ConfigError
from trainscale.io import (
    atomic_write_text,
    check_folder_writable,
    check_output,
    dumps,
    missing_folders,
    read_json,
    remove_empty,
)
from trainscale.record import K
from trainscale.report.aggregate import Partition, partitions
from trainscale.report.collect import Collection, RunRecord, collect
from trainscale.report.csvfile import csv_rows, write_csv
from trainscale.report.document import Report, Section
from trainscale.report.html import render_html
from trainscale.report.plots import left_out, write_plots
from trainscale.report.tables import (
    communication,
    configurations,
    crossover,
    environment_table,
    epochs_table,
    problems,
    scaling,
    step_split,
    time_to_target,
)

log = logging.getLogger("trainscale.report")

OUTPUTS = ("results.csv", "results.md", "index.html")


def write_report(dirs: list[Path], out: Path, profile_paths: Sequence[Path] = ()) -> Report:
    """Collect the runs under ``dirs`` and write every report file into ``out``; with ``profile_paths`` the
    planner's predictions stand beside the runs on emulated clusters."""
    profiles: dict[tuple, Any] = {}
    if profile_paths:
        from trainscale.report.planned import load_profiles

        profiles = load_profiles(list(profile_paths))
    collection = collect([Path(d) for d in dirs])
    out = Path(out)
    previous = _checked_out(out)
    made = missing_folders(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.new-", dir=out.parent) as stage:
            report = _write(collection, dirs, Path(stage), profiles)
            _swap_in(Path(stage), out, previous)
    except BaseException:
        remove_empty(made)
        raise
    report.files = [out / path.name for path in report.files]
    for section in report.sections:
        section.plots = {title: out / path.name for title, path in section.plots.items()}
    log.info(
        "report of %d run(s) in %d environment(s) written to %s", len(collection.records), len(report.sections), out
    )
    return report


def _swap_in(stage: Path, out: Path, previous: list[Path]) -> None:
    """The new report's files into ``out``, each replacing its namesake at once; the previous report's other files
    (a plot it drew that this one does not) removed."""
    written = sorted(stage.iterdir())
    names = {new.name for new in written}
    for old in previous:
        if old.name not in names:
            old.unlink(missing_ok=True)
    for new in written:
        os.replace(new, out / new.name)


def _write(collection: Collection, dirs: list[Path], stage: Path, profiles: dict[tuple, Any]) -> Report:
    """Every file of the report into ``stage``, a new folder beside ``--out``: the previous report in ``--out``
    is replaced only once the new one is whole (a run that cannot be read, or a stop, leaves it as it was)."""
    parts = partitions(collection.records)
    report = Report(
        "trainscale benchmark report",
        _intro(dirs, collection),
        _warnings(collection, parts),
        [_section(p, i, len(parts), stage, profiles) for i, p in enumerate(parts, start=1)],
        problems(collection.records),
    )
    write_csv(stage / "results.csv", csv_rows(collection.records, parts))
    atomic_write_text(stage / "results.md", render_markdown(report))
    atomic_write_text(stage / "index.html", render_html(report))
    report.files = [stage / name for name in OUTPUTS] + [p for s in report.sections for p in s.plots.values()]
    atomic_write_text(stage / MANIFEST, dumps(sorted(f.name for f in report.files)))
    return report


MANIFEST = ".trainscale-report.json"  # the names of the files a report wrote: only those are replaced
# What a report draws, for a report folder written before the manifest: its plots, one set per environment.
REPORT_PLOT = re.compile(
    r"(accuracy_epoch|accuracy_time|accuracy_time_networks|accuracy_bsp_async|accuracy_bytes|throughput_workers"
    r"|training_curves|planned_measured)(-env\d+)?\.png"
)


def _checked_out(out: Path) -> list[Path]:
    """The files of the previous report in ``out`` that the new one replaces (none for a new folder), after
    checking ``out`` can be written; of a previous report only the files it wrote go, so what a user put beside
    them stays."""
    check_folder_writable(out, "--out")
    previous = _previous_report(out)
    for old in previous:
        check_output(old, "--out")  # only files are replaced or removed, never a device, FIFO or folder
    return previous


def _previous_report(out: Path) -> list[Path]:
    """The files of the report in ``out`` (none for a new or empty folder); a folder that holds anything else
    and no report's list of its files is refused."""
    if not out.is_dir() or not any(out.iterdir()):
        return []
    if (out / MANIFEST).is_file():
        names = read_json(out / MANIFEST)
        listed = [n for n in names if isinstance(n, str) and Path(n).name == n] if isinstance(names, list) else []
        return [out / n for n in (*listed, *OUTPUTS, MANIFEST)]
    other = sorted(p.name for p in out.iterdir() if p.name not in OUTPUTS and not REPORT_PLOT.fullmatch(p.name))
    if other or not all((out / n).is_file() for n in OUTPUTS):
        raise ConfigError(
            f"--out {out} holds {other[0] if other else 'files'}, which no trainscale report wrote; choose a new folder"
        )
    return [p for p in out.iterdir() if p.name in OUTPUTS or REPORT_PLOT.fullmatch(p.name)]


def _intro(dirs: list[Path], collection: Collection) -> list[str]:
    """When and from where, then per grid folder (and for the runs outside a grid) what ran, taken from
    the runs' own configs and summaries; a grid file's descriptions come after, as its authors' words."""
    counts: dict[str, int] = {}
    for record in collection.records:
        counts[record.status] = counts.get(record.status, 0) + 1
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Generated {when} from {', '.join(str(d) for d in dirs)}: {len(collection.records)} run(s), "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        + "."
    ]
    by_folder: dict[Path | None, list[RunRecord]] = {}
    for record in collection.records:
        by_folder.setdefault(record.folder.parent.parent if record.grid else None, []).append(record)
    for root, records in by_folder.items():
        if root is None:
            lines.append(f"Runs outside a grid: {describe_runs(records)}.")
        else:
            lines += _grid_lines(records[0].grid, _grid_meta(root), records)
    return lines


def _grid_lines(name: str, meta: dict[str, Any], records: list[RunRecord]) -> list[str]:
    sets = set_text(meta.get("set") or {})
    lines = [
        f"Grid {name} (scale {meta.get('scale') or 'none'}{', ' + sets if sets else ''}): {describe_runs(records)}."
    ]
    described = [
        text
        for text in (
            meta.get("description"),
            meta.get("scale_description") and f"scale {meta.get('scale')}: {meta['scale_description']}",
        )
        if text
    ]
    if described:
        lines.append(
            f"The grid file describes {name} as: {'; '.join(described)} (its words, not a record of the runs above)."
        )
    return lines


def describe_runs(records: list[RunRecord]) -> str:
    """What the runs that were made trained: models, epochs and training images, from each run's config
    (``config.json``, else its planned config) and summary; differing values are all listed."""
    made = [r for r in records if r.status not in ("excluded", "not run")]
    if not made:
        return "no run has been made yet"
    pairs = [(r.config or r.bench.get("config") or {}, r.summary) for r in made]
    models = _distinct(c.get("model") or s.get(K.model) for c, s in pairs)
    epochs = _distinct(c.get("epochs") or s.get(K.epochs) for c, s in pairs)
    subsets = _distinct(c.get("train_subset") or "all" for c, _ in pairs)
    datasets = _distinct(c.get("dataset") or s.get(K.dataset) for c, s in pairs)
    per_epoch = _distinct(s.get(K.train_samples_per_epoch) for _, s in pairs)
    text = (
        f"{len(made)} run(s) of {_or(models)} for {_or(epochs)} epoch{'' if epochs == ['1'] else 's'} on "
        f"{_or(subsets)} {_or(datasets)} training images"
    )
    return text + (f" ({_or(per_epoch)} per epoch)" if per_epoch else "")


def _distinct(values: Iterable[Any]) -> list[str]:
    """Each value once, numbers in order and with thousands separators, other values as they came."""
    found = list(dict.fromkeys(v for v in values if v is not None))
    is_number = [isinstance(v, int) and not isinstance(v, bool) for v in found]
    numbers = sorted(v for v, number in zip(found, is_number) if number)
    return [f"{v:,}" for v in numbers] + [str(v) for v, number in zip(found, is_number) if not number]


def _or(values: list[str]) -> str:
    if not values:
        return "?"
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def _grid_meta(root: Path) -> dict[str, Any]:
    try:
        return json.loads((root / "grid.json").read_text())
    except (OSError, ValueError):
        return {}


def _warnings(collection: Collection, parts: list[Partition]) -> list[str]:
    warnings = list(collection.warnings)
    if len(parts) > 1:
        warnings.insert(
            0,
            f"These runs were measured in {len(parts)} different environments (device or torch "
            "version); each has its own tables and plots and they are never averaged together.",
        )
    return warnings


def _section(part: Partition, number: int, total: int, out: Path, profiles: dict[tuple, Any]) -> Section:
    env = part.environment
    title = f"{env.get('device_name')}, torch {env.get('torch')}"
    if total > 1:
        title = f"Environment {number}: {title}"
    suffix = f"-env{number}" if number > 1 else ""
    tables = [environment_table(part), configurations(part), scaling(part)]
    plots = write_plots(part, out, suffix)
    if not profiles:
        tables += [
            t for t in (communication(part), step_split(part), time_to_target(part), crossover(part)) if t is not None
        ]
        return Section(title, tables, plots, [epochs_table(r) for g in part.groups for r in g.runs], left_out(part))
    from trainscale.report.planned import planned_crossover, planned_plot, planned_table

    tables += [
        t
        for t in (
            communication(part),
            step_split(part),
            time_to_target(part),
            crossover(part, lambda g: planned_crossover(g, profiles)),
            planned_table(part, profiles),
        )
        if t is not None
    ]
    scatter = planned_plot(part, profiles, out / f"planned_measured{suffix}.png")
    if scatter is not None:
        plots["Planned against measured step time"] = scatter
    return Section(title, tables, plots, [epochs_table(r) for g in part.groups for r in g.runs], left_out(part))


def render_markdown(report: Report) -> str:
    lines = [f"# {report.title}", ""] + [part for line in report.intro for part in (line, "")]
    lines += [f"> **Warning:** {w}\n" for w in report.warnings]
    for section in report.sections:
        lines += [f"## {section.title}", ""] + [t.markdown() for t in section.tables]
        lines += ["### Figures", ""] + [f"![{title}]({path.name})\n" for title, path in section.plots.items()]
        lines += [f"{reason}\n" for reason in section.left_out]
        lines += ["### Accuracy by epoch", ""] + [t.markdown().replace("### ", "#### ", 1) for t in section.epochs]
    if report.problems:
        lines += ["## Runs without results", "", report.problems.markdown()]
    return "\n".join(lines)
