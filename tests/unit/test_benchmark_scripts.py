"""The benchmark scripts that run in one process still run: each on the smallest input it takes, through its
``main`` as its command line calls it, saving its figures beside its settings and the machine's environment. The
figures themselves are not checked here (speed lives in the benchmarks, not in timed tests); that a script still
runs against today's engine is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.scripts import load_benchmark

TINY = {
    "throughput": ["--models", "mlp", "--images", "128", "--batch", "64", "--repeats", "1", "--warmup", "0"],
    "step_log_overhead": ["--model", "mlp", "--images", "128", "--batch", "64", "--every", "1", "--repeats", "1"],
    "compression": ["--model", "mlp", "--methods", "topk", "qsgd", "--granularities", "layerwise", "--repeats", "1"],
    "muon_step": ["--repeats", "1"],
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_the_script_runs_and_saves_its_figures_with_its_settings(name, tmp_path, monkeypatch) -> None:
    out = tmp_path / f"{name}.json"
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *TINY[name], "--out", str(out)])
    monkeypatch.chdir(tmp_path)
    status = load_benchmark(name).main()
    assert status in (None, 0)
    saved = json.loads(out.read_text())
    assert saved["config"]["repeats"] == 1 and saved["environment"]["torch"]
    assert not [p for p in Path(tmp_path).iterdir() if p != out], "the script wrote beside its --out"
