"""``results.csv``: one row per run (failed ones too), every summary field, the resolved config and the
environment, flattened to ``summary``/``environment.*``/``config.*``/``axes.*`` columns, so a reader can
check any number in the tables against its run without opening JSON files."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from trainscale.io import atomic_write_text
from trainscale.record import K
from trainscale.report.aggregate import Partition, run_throughput
from trainscale.report.collect import RunRecord

LEAD = [
    "run_id",
    "label",
    "grid",
    "status",
    "error",
    "folder",
    "repeat",
    "partition",
    "group",
    "throughput_images_per_sec",
    "scaling_efficiency",
    "efficiency_baseline",
]


def csv_rows(records: list[RunRecord], parts: list[Partition]) -> list[dict[str, Any]]:
    where = _placement(parts)
    return [_row(r, *where.get(id(r), ("", "", None, ""))) for r in records]


def _placement(parts: list[Partition]) -> dict[int, tuple[Any, str, float | None, str]]:
    """id(run) -> (partition number, group label, efficiency of this run, baseline label)."""
    found: dict[int, tuple[Any, str, float | None, str]] = {}
    for number, part in enumerate(parts, start=1):
        for group in part.groups:
            effs = iter(group.efficiency)
            for run in group.runs:
                eff = next(effs, None) if group.efficiency and run_throughput(run) else None
                found[id(run)] = (number, group.label, eff, group.baseline)
    return found


def _row(r: RunRecord, partition: int | str, group: str, efficiency: float | None, baseline: str) -> dict[str, Any]:
    row: dict[str, Any] = {
        "run_id": r.run_id,
        "label": r.label,
        "grid": r.grid,
        "status": r.status,
        "error": r.error,
        "folder": str(r.folder),
        "repeat": r.bench.get("repeat", ""),
        "partition": partition,
        "group": group,
        "throughput_images_per_sec": run_throughput(r) if r.ok else None,
        "scaling_efficiency": efficiency,
        "efficiency_baseline": baseline,
    }
    for key, value in r.summary.items():
        if key == K.environment:
            row.update({f"environment.{k}": v for k, v in (value or {}).items()})
        else:
            row[key] = value
    row.update({f"config.{k}": v for k, v in r.config.items()})
    row.update({f"axes.{k}": v for k, v in r.bench.get("axes", {}).items()})
    return row


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Columns: the lead ones, then every other key in order of first appearance; lists/dicts as JSON."""
    columns = list(LEAD)
    for row in rows:
        columns += [k for k in row if k not in columns]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns, restval="")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(v) for k, v in row.items()})
    atomic_write_text(path, text.getvalue())


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return value
