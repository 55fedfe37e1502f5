"""The commands the documentation shows, with what it says they print, still print that.

A newcomer copies a command from README.md or docs/ and compares what comes back with the page. Every example
written as ``$ trainscale ...`` followed by its output is collected here; those that run in a moment and the same on
every machine are run in this process and each line the page shows must come back: plans given their inputs
(not a measured profile), ``--dry-run`` commands, ``trainscale models`` and the one-line refusals of bad input.
A line with ``...`` stands for its pieces in that order; a line in parentheses is the page's own remark. The
others (runs that train, measure, or need an emulated cluster) are covered by their own tests and the figures
beside them say which machine gave them; every command in the pages' code, these too, and every benchmark command
they give must be one the CLI or the script takes (no flag renamed or gone). The published validation set's
output, which the planner's pages quote, is checked the same way (the benchmark plans and measures nothing)."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Example:
    where: str
    argv: tuple[str, ...]
    shown: tuple[str, ...]

    @property
    def instant(self) -> bool:
        """Runs in a moment and prints the same everywhere: nothing trained, measured or shaped, no file of the
        user's (a profile they measured; a module the page invents, ``my_pkg``)."""
        args = self.argv
        if "--profile" in args or any("my_pkg" in a for a in args):
            return False
        refused = any(": error: " in line for line in self.shown)
        return args[0] in ("plan", "models") or "--dry-run" in args or (args[0] == "train" and refused)

    @property
    def reads_cifar(self) -> bool:
        """A training command on CIFAR (the default data set): its checks read the real files."""
        args = self.argv
        dataset = args[args.index("--dataset") + 1] if "--dataset" in args else "cifar10"
        return args[0] == "train" and dataset in ("cifar10", "cifar100")


def examples(page: Path, program: str = "trainscale") -> list[Example]:
    """Each ``$ <program>`` line of a page (with its continuation lines), and the lines after it up to a blank
    line, the next prompt or the end of the code block."""
    prompt, lines, found = f"$ {program} ", page.read_text().splitlines(), []
    i = 0
    while i < len(lines):
        text = lines[i].strip()
        if not (text + " ").startswith(prompt):
            i += 1
            continue
        start, command = i + 1, text[len(prompt) :]
        while command.endswith("\\"):
            i += 1
            command = command[:-1] + " " + lines[i].strip()
        shown = []
        for line in lines[i + 1 :]:
            line = line.strip()
            if not line or line.startswith(("$ ", "```")):
                break
            shown.append(line)
        i += 1 + len(shown)
        found.append(Example(f"{page.relative_to(ROOT)}:{start}", tuple(shlex.split(command)), tuple(shown)))
    return found


ALL = [e for page in PAGES for e in examples(page)]


def test_the_pages_show_examples_to_check():
    instant = [e for e in ALL if e.instant and e.shown]
    assert len(ALL) >= 20 and len(instant) >= 12, (len(ALL), len(instant))


def _missing(example: Example, printed: list[str]) -> list[str]:
    """The lines the page shows that did not come back (a line in parentheses is the page's own remark)."""
    return [line for line in example.shown if not re.match(r"^\(.*\)$", line) and not _shown_in(line, printed)]


def _shown_in(line: str, printed: list[str]) -> bool:
    if "..." not in line:
        return line in printed
    pieces = [re.escape(p.strip()) for p in line.split("...") if p.strip()]
    pattern = re.compile(".*".join(pieces))
    return any(pattern.search(p) for p in printed)


@pytest.mark.parametrize("example", [e for e in ALL if e.instant and e.shown], ids=lambda e: e.where)
def test_the_example_prints_what_its_page_shows(example: Example, main_cli, tmp_path, monkeypatch, request):
    monkeypatch.syspath_prepend(str(ROOT))  # the pages run from a checkout: tests.userpkg imports from there
    if example.reads_cifar:
        monkeypatch.setenv("TRAINSCALE_DATA", str(request.getfixturevalue("cifar10_dir")))
    done = main_cli(*example.argv, cwd=tmp_path)
    printed = [line.strip() for line in (done.stdout + done.stderr).splitlines()]
    refused = any(": error: " in line for line in example.shown)
    assert done.returncode == (2 if refused else 0), f"{example.where}: exit {done.returncode}\n{done.stderr}"
    missing = _missing(example, printed)
    assert not missing, f"{example.where}: the page shows lines it no longer prints: {missing}\n" + "\n".join(printed)


COMMAND = re.compile(r"^(\$ )?trainscale (?![a-z ]+:)(?P<args>.*)$")  # not an output line ("trainscale train: ...")


def block_commands(page: Path) -> list[tuple[str, str]]:
    """Every ``trainscale`` command in a page's code (fenced or indented), with or without a prompt, joined
    over its continuation lines; comments, pipes and redirections cut off."""
    lines, found, fenced = page.read_text().splitlines(), [], False
    i = 0
    while i < len(lines):
        line, i = lines[i], i + 1
        if line.strip().startswith("```"):
            fenced = not fenced
        match = COMMAND.match(line.strip())
        if match is None or not (fenced or line.startswith("    ")):
            continue
        where, command = f"{page.relative_to(ROOT)}:{i}", match["args"]
        while command.endswith("\\"):
            command, i = command[:-1] + " " + lines[i].strip(), i + 1
        found.append((where, re.split(r"\s+(?:#|\||>|2>|&&)\s", command)[0]))
    return found


@pytest.mark.parametrize(
    "where, command", [c for page in PAGES for c in block_commands(page)], ids=lambda v: v if ".md:" in v else ""
)
def test_every_command_in_the_pages_code_is_one_the_cli_takes(where: str, command: str, capsys):
    from trainscale.cli import build_parser

    try:
        _, extra = build_parser().parse_known_args(shlex.split(command))
    except SystemExit:
        pytest.fail(f"{where}: trainscale {command}: {capsys.readouterr().err.strip()}")
    assert not extra, f"{where}: trainscale {command}: no flag takes {extra}"


BENCHMARK = re.compile(r"(?:sudo )?(?:\.venv/bin/)?python (?P<script>benchmarks/\w+\.py)(?P<args>.*)")


def benchmark_commands(page: Path) -> list[tuple[str, str, str]]:
    """Every ``python benchmarks/<script>.py ...`` of a page, in its code blocks and its inline code (which may
    wrap), continuation lines joined; comments, pipes and redirections cut off."""
    text = re.sub(r"\\\n\s*", " ", page.read_text())
    spans = [(m.start(), " ".join(m.group(1).split())) for m in re.finditer(r"`([^`]+)`", text)]
    lines = [(m.start(), m.group(0).strip()) for m in re.finditer(r"^.*$", text, re.M)]
    found = []
    for start, candidate in spans + lines:
        match = BENCHMARK.match(candidate)
        if match:
            where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, start) + 1}"
            found.append((where, match["script"], re.split(r"\s+(?:#|\||>|2>|&&|;)(?:\s|$)", match["args"])[0]))
    return sorted(set(found))


class _Parsed(Exception):
    """Raised where a benchmark's parser accepted its command line: nothing after it runs."""


@pytest.mark.parametrize(
    "where, script, args",
    [c for page in PAGES for c in benchmark_commands(page)],
    ids=lambda v: v if ".md:" in v else "",
)
def test_every_benchmark_command_in_the_pages_is_one_its_script_takes(where, script, args, monkeypatch, capsys):
    module = load_benchmark(Path(script).stem)
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the pages' GPU commands parse on any machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(sys, "argv", [script, *shlex.split(args)])
    with pytest.raises((_Parsed, SystemExit)) as stopped:
        module.main()
    refused = capsys.readouterr().err.strip().splitlines()[-1:] if stopped.type is SystemExit else []
    assert stopped.type is _Parsed, f"{where}: python {script}{args}: {refused}"


PLANS_ONLY = "benchmarks/plan_published.py"  # it plans published rows and measures nothing: the same output anywhere


def test_the_validation_output_the_pages_show_is_what_the_benchmark_prints(monkeypatch, capsys):
    """The planner's figures against the published set are the pages' main claim; one run with every flag the
    pages show gives all their blocks."""
    shown = [e for page in PAGES for e in examples(page, f"python {PLANS_ONLY}")]
    assert len(shown) >= 3, [e.where for e in shown]
    module = load_benchmark(Path(PLANS_ONLY).stem)
    monkeypatch.setattr(sys, "argv", [PLANS_ONLY, *sorted({a for e in shown for a in e.argv})])
    module.main()
    printed = [line.strip() for line in capsys.readouterr().out.splitlines()]
    for example in shown:
        missing = _missing(example, printed)
        assert not missing, f"{example.where}: the page shows lines the benchmark no longer prints: {missing}"
