"""`trainscale bench` then `trainscale report` end to end on real CIFAR-10: a tiny grid with a 1-worker
run, a 2-worker sync run and a run that fails at run time; a re-run skips what finished; the report's
files, columns and plots are checked and its HTML page is rendered in headless Chromium."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
from PIL import Image

from tests.integration.cli import run_cli

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)

GRID = """
    name = "tiny-real"
    description = "two real MLP runs (1 and 2 workers) and one that cannot find its data"
    [base]
    model = "mlp"
    dataset = "cifar10"
    data_dir = "{data}"
    verify = false
    train_subset = 800
    test_subset = 400
    epochs = 1
    batch_per_worker = 100
    lr = 0.05
    [[rows]]
    short_name = "mlp"
    axes.workers = [1, 2]
    [[rows]]
    short_name = "nodata"
    data_dir = "{missing}"
    download = false
"""


def chromium_or_skip() -> str:
    if Path(CHROMIUM).exists():
        return CHROMIUM
    message = f"{CHROMIUM} is missing: apt-get install -y chromium (needed to render index.html)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " (CI=true: the HTML test must run in CI)")
    pytest.skip(message)


def screenshot(page: Path, tmp_path: Path) -> Path:
    """Render ``page`` in headless Chromium (no network, throwaway profile) and return the PNG."""
    shot = tmp_path / "screenshot.png"
    cmd = [
        chromium_or_skip(),
        *CHROMIUM_FLAGS,
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        f"--screenshot={shot}",
        "--window-size=1280,2000",
        page.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    return shot


@pytest.mark.realdata
def test_grid_runs_resumes_and_reports(main_cli, tmp_path, cifar10_dir):
    grid = tmp_path / "grid.toml"
    grid.write_text(textwrap.dedent(GRID.format(data=cifar10_dir, missing=tmp_path / "no-such-data")))
    out = tmp_path / "results"

    first = run_cli("bench", grid, "--out", out, "--timeout", "300", timeout=600)
    assert first.returncode == 1, first.stderr[-3000:]  # one run failed, the grid went on
    assert "3 run(s): 2 ok, 1 failed" in first.stdout
    ledger = [json.loads(x) for x in (out / "grid.jsonl").read_text().splitlines()]
    assert sorted(e["status"] for e in ledger) == ["failed", "ok", "ok"]
    failed = next(e for e in ledger if e["status"] == "failed")
    assert "no-such-data" in failed["error"]
    assert "no-such-data" in (out / "runs" / failed["run_id"] / "error.txt").read_text()

    again = main_cli("bench", grid, "--out", out)  # in this process: the runs it starts are subprocesses still
    assert again.returncode == 1 and "3 run(s): 2 skipped, 1 failed" in again.stdout, again.stdout

    report_dir = tmp_path / "report"
    rep = main_cli("report", out, "--out", report_dir)
    assert rep.returncode == 0, rep.stderr[-3000:]
    check_report(report_dir)
    check_page(report_dir / "index.html", tmp_path)


def check_report(report_dir: Path) -> None:
    with open(report_dir / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["status"] for r in rows) == ["failed", "ok", "ok"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert sorted(r["world_size"] for r in ok) == ["1", "2"]
    assert all(float(r["best_test_acc"]) > 0 and r["timer_scope"] and r["environment.torch"] for r in ok)
    assert all(r["config.train_subset"] == "800" for r in ok)
    two = next(r for r in ok if r["world_size"] == "2")
    # one noisy epoch on a shared CPU: the value is not judged here, only that it is computed from real runs
    assert float(two["scaling_efficiency"]) > 0 and float(two["bytes_sent_per_step"]) > 0
    assert two["efficiency_baseline"] == "mlp-w1"
    md = (report_dir / "results.md").read_text()
    for header in (
        "| Short Name | model | processes | GPUs per process | parameter server | batch size | "
        "initial LR | seconds per epoch | best validation accuracy | runs |",
        "| Short Name | model | workers | batch size | images/s | scaling efficiency |",
        "| Short Name | method | ratio | granularity | workers | bytes per step | compression vs fp32 |",
        "| run | status | error |",
    ):
        assert header in md, header
    assert "| mlp-w2 | mlp | 2 | 0 | off | 100x2=200 |" in md
    # the header says what ran (from the runs), the grid's description only after it, as the file's words
    assert "Grid tiny-real (scale none): 3 run(s) of mlp for 1 epoch on 800 cifar10 training images" in md
    assert "The grid file describes tiny-real as: two real MLP runs" in md
    pngs = sorted(p.name for p in report_dir.glob("*.png"))
    # one configuration reports bytes: its scatter would be one dot, so it is left out with a sentence
    assert pngs == ["accuracy_epoch.png", "accuracy_time.png", "throughput_workers.png", "training_curves.png"]
    assert "No accuracy-against-bytes figure: one configuration reports bytes per step" in md
    for name in pngs:
        with Image.open(report_dir / name) as image:
            image.load()
            assert image.size[0] > 300


def check_page(page: Path, tmp_path: Path) -> None:
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 4  # every figure of check_report, inline
    assert not re.search(r"(src|href)\s*=\s*['\"]?(https?:|//)|<link|<script|@import|url\(", text)  # offline
    shot = screenshot(page, tmp_path)
    with Image.open(shot) as image:
        image.load()
        assert image.size == (1280, 2000)
        low, high = image.convert("L").getextrema()
        assert high - low > 100, "the screenshot is one flat colour: the page did not render"
        assert len(image.convert("L").getcolors(maxcolors=1 << 16) or []) > 50  # text, tables and plots
