"""The report as data: what ``build`` assembles and the Markdown and HTML renderers read, in a module of its own so
the renderers need not import the builder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainscale.report.tables import Table


@dataclass
class Section:
    """One environment's part of the report."""

    title: str
    tables: list[Table]
    plots: dict[str, Path]
    epochs: list[Table] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # figures not drawn, and why


@dataclass
class Report:
    title: str
    intro: list[str]
    warnings: list[str]
    sections: list[Section]
    problems: Table | None
    files: list[Path] = field(default_factory=list)
