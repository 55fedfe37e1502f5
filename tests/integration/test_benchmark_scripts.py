"""The benchmark scripts that start processes (torch's launcher, RPC, `trainscale train`) still run: each on the
smallest input it takes, as a user starts it, saving its figures beside its settings and the environment. The
figures are not checked (speed lives in the benchmarks, not in timed tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.scripts import BENCHMARKS

pytestmark = pytest.mark.dist

TINY = {
    "sync_overhead": ["--model", "mlp", "--steps", "1", "--repeats", "1", "--warmup", "0"],
    "ps_overhead": ["--model", "mlp", "--steps", "1", "--repeats", "1", "--warmup", "0"],
    "ps_transport": ["--repeats", "1", "--warmup", "0"],
    "worker_start": ["--repeats", "1", "--warmup", "0"],
    "user_model": ["--tiny", "--repeats", "1", "--cells", "local", "bf16"],  # the real CIFAR-10's first images
}
REAL_DATA = {"user_model"}


@pytest.mark.parametrize("name", sorted(TINY))
def test_the_script_runs_and_saves_its_figures_with_its_settings(name, tmp_path, request) -> None:
    """Its temporary files too are gone when it ends: its own and those of what it starts (torch's launcher makes a
    ``torchelastic_*`` folder in the temporary folder unless given one), each process given ``temp`` as TMPDIR.
    torch.compile's cache folder there is meant to stay (later compiles read it)."""
    if name in REAL_DATA:
        request.getfixturevalue("cifar10_dir")  # skipped without the data, failed without it under CI=true
    out, temp = tmp_path / "run" / f"{name}.json", tmp_path / "temp"
    out.parent.mkdir()
    temp.mkdir()
    argv = [sys.executable, str(BENCHMARKS / f"{name}.py"), *TINY[name], "--out", str(out)]
    env = {**os.environ, "TMPDIR": str(temp)}
    done = subprocess.run(argv, cwd=out.parent, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"{name}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    saved = json.loads(out.read_text())
    assert saved["config"]["repeats"] == 1 and saved["environment"]["torch"]
    assert [p.name for p in out.parent.iterdir()] == [out.name], "the script wrote beside its --out"
    left = [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]  # the compiler's cache, kept
    assert not left, f"temporary files were left behind: {left}"
