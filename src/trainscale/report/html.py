"""``index.html``: the whole report as one self-contained page (inline CSS, PNGs as base64 data URIs,
no scripts, no external resources), so it can be mailed, archived or opened offline."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from trainscale.report.document import Report, Section

CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;
     padding:0 1em;color:#1b1f23;background:#fff;line-height:1.45}
h1{border-bottom:2px solid #d0d7de;padding-bottom:.3em}
h2{margin-top:2em;border-bottom:1px solid #d0d7de;padding-bottom:.2em}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:.9em}
th,td{border:1px solid #d0d7de;padding:.3em .6em;text-align:right}
th{background:#f0f3f6}
td:first-child,th:first-child{text-align:left}
tbody tr:nth-child(even){background:#f8f9fa}
.warning{background:#fff4d6;border-left:4px solid #e3a008;padding:.6em 1em;margin:1em 0}
.notes{font-size:.85em;color:#57606a}
figure{margin:1em 0}
figure img{max-width:100%;border:1px solid #d0d7de}
figcaption{font-size:.9em;color:#57606a}
details{margin:.3em 0}
"""


def render_html(report: Report) -> str:
    parts = [f"<h1>{html.escape(report.title)}</h1>"]
    parts += [f"<p>{html.escape(line)}</p>" for line in report.intro]
    parts += [f"<div class='warning'><b>Warning:</b> {html.escape(w)}</div>" for w in report.warnings]
    parts += [_section(s) for s in report.sections]
    if report.problems:
        parts.append("<h2>Runs without results</h2>" + report.problems.html())
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(report.title)}</title><style>{CSS}</style></head><body>"
        + "\n".join(parts)
        + "</body></html>\n"
    )


def _section(section: Section) -> str:
    body = [f"<h2>{html.escape(section.title)}</h2>"] + [t.html() for t in section.tables]
    body += ["<h3>Figures</h3>"] + [_figure(title, path) for title, path in section.plots.items()]
    body += [f"<p>{html.escape(reason)}</p>" for reason in section.left_out]
    body.append("<h3>Accuracy by epoch</h3>")
    body += [
        f"<details><summary>{html.escape(t.title)}</summary>{t.html(heading=False)}</details>" for t in section.epochs
    ]
    return "\n".join(body)


def _figure(title: str, path: Path) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return (
        f"<figure><img alt='{html.escape(title, quote=True)}' src='data:image/png;base64,{data}'>"
        f"<figcaption>{html.escape(title)}</figcaption></figure>"
    )
