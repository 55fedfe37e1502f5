"""Line numbers for keys of a TOML file, so a grid error can say `grid.toml:12` and not just the key.

``tomllib`` returns plain dicts without positions; this scans the text once and maps every dotted key
path (``base.model``, ``axes.workers``, ``rows[1].lr``, ``scale.quick.axes.workers``) to the line that
sets it. It understands table headers, arrays of tables, dotted and quoted keys, and skips comments and
the continuation lines of multi-line arrays. Good enough for error messages; never used for values.
"""

from __future__ import annotations

import re

_ARRAY_HEADER = re.compile(r"^\s*\[\[\s*([^\]]+?)\s*\]\]")
_TABLE_HEADER = re.compile(r"^\s*\[\s*([^\]\[]+?)\s*\]")
_PART = r"""(?:[A-Za-z0-9_\-]+|"[^"]*"|'[^']*')"""
_KEY_LINE = re.compile(rf"^\s*({_PART}(?:\s*\.\s*{_PART})*)\s*=")


def _split_dotted(text: str) -> list[str]:
    parts = re.findall(r"""[A-Za-z0-9_\-]+|"[^"]*"|'[^']*'""", text)
    return [p.strip("\"'").replace("-", "_") for p in parts]


class KeyLocator:
    """Dotted key path -> 1-based line number of the line that sets it (first occurrence)."""

    def __init__(self, text: str) -> None:
        self.lines: dict[str, int] = {}
        self._scan(text)

    def _scan(self, text: str) -> None:
        prefix: list[str] = []
        arrays: dict[str, int] = {}
        depth = 0  # open brackets of a multi-line value
        for number, line in enumerate(text.splitlines(), start=1):
            code = _strip_comment(line)
            if depth == 0 and (match := _ARRAY_HEADER.match(code)):
                name = ".".join(_split_dotted(match.group(1)))
                arrays[name] = arrays.get(name, -1) + 1
                prefix = [f"{name}[{arrays[name]}]"]
                self.lines.setdefault(prefix[0], number)
            elif depth == 0 and (match := _TABLE_HEADER.match(code)):
                prefix = [self._table_path(_split_dotted(match.group(1)), arrays)]
                self.lines.setdefault(prefix[0], number)
            elif depth == 0 and (match := _KEY_LINE.match(code)):
                path = ".".join(prefix + _split_dotted(match.group(1)))
                self.lines.setdefault(path, number)
            depth = max(0, depth + code.count("[") - code.count("]")) if not _is_header(code, depth) else 0

    @staticmethod
    def _table_path(parts: list[str], arrays: dict[str, int]) -> str:
        """``[rows.axes]`` after ``[[rows]]`` belongs to the latest row: ``rows[k].axes``."""
        for cut in range(len(parts), 0, -1):
            head = ".".join(parts[:cut])
            if head in arrays:
                return ".".join([f"{head}[{arrays[head]}]"] + parts[cut:])
        return ".".join(parts)

    def line(self, path: str) -> int | None:
        """Line of ``path``, else of its nearest enclosing table or key that was written out."""
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):
            found = self.lines.get(".".join(parts[:cut]))
            if found is not None:
                return found
        return None


def _is_header(code: str, depth: int) -> bool:
    return depth == 0 and bool(_ARRAY_HEADER.match(code) or _TABLE_HEADER.match(code))


def _strip_comment(line: str) -> str:
    """Drop a trailing ``# comment`` that is not inside a string."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[:i]
    return line
