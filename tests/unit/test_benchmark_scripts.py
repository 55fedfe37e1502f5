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
from trainscale.errors import ConfigError

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


def test_user_model_checks_every_cell_before_the_first_starts(tmp_path, monkeypatch, cifar10_dir) -> None:
    """A setting one of its `trainscale train` runs would refuse (here the Top-k cell's ratio) is refused, naming
    the cell, before the bare loops or any run start, with the user's model found by import path as the runs
    find it."""
    user_model = load_benchmark("user_model")
    monkeypatch.setenv("TRAINSCALE_DATA", str(cifar10_dir))
    monkeypatch.setattr(user_model, "run_child", lambda *a, **k: pytest.fail("a run started"))
    monkeypatch.setattr(sys, "argv", ["user_model.py", "--tiny", "--ratio", "0", "--out", str(tmp_path / "r.json")])
    path = list(sys.path)
    with pytest.raises(ConfigError, match=r"^2 workers topk: --ratio must be in \(0, 1\], got 0.0$"):
        user_model.main()
    assert sys.path == path and not list(tmp_path.iterdir())
