"""The user documentation speaks of the project and its users: README.md is a landing page of at most 250 lines of
at most 120 characters, and neither it nor docs/ carries the language of how the project is made (issue numbers,
sessions, lent machines, the results pages' internal numbers). Every page under docs/ is in the site's navigation
(mkdocs --strict fails on a broken link; `make docs`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
PROCESS_LANGUAGE = re.compile(
    r"\bissues? #?\d|\bsessions?\b|\blent\b|\bseeds? 00\d|\bseed00\d's\b|\bthe brief\b|"
    r"\bno GPU was (lent|given)|\bthe issue's\b",
    re.I,
)


def test_the_readme_is_a_landing_page():
    lines = README.read_text().splitlines()
    assert 150 <= len(lines) <= 250, f"README.md has {len(lines)} lines; the landing page keeps 150-250"
    long = [f"README.md:{n}" for n, line in enumerate(lines, 1) if len(line) > 120]
    assert not long, f"lines over 120 characters: {long}"


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_process_language(path: Path):
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for m in PROCESS_LANGUAGE.finditer(line)
    ]
    assert not hits, "user documentation speaks of the project, not of how it is made: " + "; ".join(hits)


def test_the_pattern_catches_what_it_is_for():
    for text in ("see issue 15", "no GPU was lent", "in this session", "seed 003's grid", "Seed 000"):
        assert PROCESS_LANGUAGE.search(text), text
    for text in ("--seed 0", "same seed, same run", "seeds 0-4", "benchmarks/grids/seed000_multiverso.toml"):
        assert not PROCESS_LANGUAGE.search(text), text


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in PAGES if f": {p.relative_to(ROOT / 'docs')}" not in nav]
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"
