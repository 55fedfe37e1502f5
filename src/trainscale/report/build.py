"""`trainscale report DIR... --out REPORT`: results.csv, results.md, PNG plots and index.html.

The Markdown and the HTML page are rendered from the same ``Table`` objects, so they cannot disagree.
The output folder is either new or a previous report (recognised by its ``results.md``), whose files
are replaced: a stale plot from an earlier report never survives next to new tables.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from trainscale.errors import ConfigError
from trainscale.report.aggregate import Partition, partitions
from trainscale.report.collect import Collection, collect
from trainscale.report.csvfile import csv_rows, write_csv
from trainscale.report.html import render_html
from trainscale.report.plots import write_plots
from trainscale.report.tables import (
    Table,
    communication,
    configurations,
    environment_table,
    epochs_table,
    problems,
    scaling,
)

log = logging.getLogger("trainscale.report")

OUTPUTS = ("results.csv", "results.md", "index.html")


@dataclass
class Section:
    """One environment's part of the report."""

    title: str
    tables: list[Table]
    plots: dict[str, Path]
    epochs: list[Table] = field(default_factory=list)


@dataclass
class Report:
    title: str
    intro: list[str]
    warnings: list[str]
    sections: list[Section]
    problems: Table | None
    files: list[Path] = field(default_factory=list)


def write_report(dirs: list[Path], out: Path) -> Report:
    """Collect the runs under ``dirs`` and write every report file into ``out``."""
    collection = collect([Path(d) for d in dirs])
    _prepare_out(Path(out))
    parts = partitions(collection.records)
    report = Report("trainscale benchmark report", _intro(dirs, collection), _warnings(collection, parts),
                    [_section(p, i, len(parts), out) for i, p in enumerate(parts, start=1)],
                    problems(collection.records))
    write_csv(out / "results.csv", csv_rows(collection.records, parts))
    (out / "results.md").write_text(render_markdown(report))
    (out / "index.html").write_text(render_html(report))
    report.files = [out / name for name in OUTPUTS] + [p for s in report.sections for p in s.plots.values()]
    log.info("report of %d run(s) in %d environment(s) written to %s", len(collection.records), len(parts), out)
    return report


def _prepare_out(out: Path) -> None:
    if out.exists() and any(out.iterdir()) and not (out / "results.md").exists():
        raise ConfigError(f"--out {out} exists and is not a trainscale report folder; choose a new folder")
    out.mkdir(parents=True, exist_ok=True)
    for old in [*(out / n for n in OUTPUTS), *out.glob("*.png")]:
        old.unlink(missing_ok=True)


def _intro(dirs: list[Path], collection: Collection) -> list[str]:
    grids = {}
    for record in collection.records:
        if record.grid:
            meta = _grid_meta(record.folder.parent.parent)
            scale = meta.get("scale") or "none"
            grids[record.grid] = f"{record.grid} (scale {scale}): {meta.get('description', '')}".strip()
    counts = {}
    for record in collection.records:
        counts[record.status] = counts.get(record.status, 0) + 1
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"Generated {when} from {', '.join(str(d) for d in dirs)}: {len(collection.records)} run(s), "
             + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + "."]
    return lines + [f"Grid {text}" for text in grids.values()]


def _grid_meta(root: Path) -> dict:
    try:
        return json.loads((root / "grid.json").read_text())
    except (OSError, ValueError):
        return {}


def _warnings(collection: Collection, parts: list[Partition]) -> list[str]:
    warnings = list(collection.warnings)
    if len(parts) > 1:
        warnings.insert(0, f"These runs were measured in {len(parts)} different environments (device or torch "
                           "version); each has its own tables and plots and they are never averaged together.")
    return warnings


def _section(part: Partition, number: int, total: int, out: Path) -> Section:
    env = part.environment
    title = f"{env.get('device_name')}, torch {env.get('torch')}"
    if total > 1:
        title = f"Environment {number}: {title}"
    tables = [environment_table(part), configurations(part), scaling(part)]
    comm = communication(part)
    tables += [comm] if comm else []
    plots = write_plots(part, out, f"-env{number}" if number > 1 else "")
    return Section(title, tables, plots, [epochs_table(r) for g in part.groups for r in g.runs])


def render_markdown(report: Report) -> str:
    lines = [f"# {report.title}", "", *report.intro, ""]
    lines += [f"> **Warning:** {w}\n" for w in report.warnings]
    for section in report.sections:
        lines += [f"## {section.title}", ""] + [t.markdown() for t in section.tables]
        lines += ["### Figures", ""] + [f"![{title}]({path.name})\n" for title, path in section.plots.items()]
        lines += ["### Accuracy by epoch", ""] + [t.markdown().replace("### ", "#### ", 1) for t in section.epochs]
    if report.problems:
        lines += ["## Runs without results", "", report.problems.markdown()]
    return "\n".join(lines)
