"""The training step under DDP over a real 2-process gloo group (tests/dist/ddp_step_worker.py runs every case in
one launch). Gradient accumulation: 4 micro-batches of 8 make the update one batch of 32 makes (a BatchNorm-free
model, to 1e-6), and DDP communicates once per optimizer step, the same bytes and calls as the single batch, dense
and bf16-compressed. The compiled step (``--train-step compiled``) through DDP gives the eager step's parameters
and the same exchanges, dense and Top-k with error feedback (the gradient hooks run inside the compiled step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = Path(__file__).with_name("ddp_step_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("accumulate")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        "--log-dir",  # torch's agent folder here, not left in /tmp
        str(out / "agent"),
        str(WORKER),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("hook", ["dense", "bf16"])
def test_micro_batches_make_the_whole_batch_update_and_communicate_once(results, hook):
    for rank in results:
        case = rank[hook]
        assert "error" not in case, case.get("error")
        micro, whole = case["micro"], case["whole"]
        tolerance = 1e-6 if hook == "dense" else 1e-2  # bf16 rounds the summed gradient, not the same sum
        for a, b in zip(micro["params"], whole["params"]):
            assert max(abs(x - y) for x, y in zip(a, b)) < tolerance
        assert micro["steps"] == whole["steps"] == 2  # two optimizer steps, one exchange each
        assert (micro["bytes"], micro["calls"]) == (whole["bytes"], whole["calls"])
        assert micro["calls"] > 2  # several buckets per exchange
    assert results[0]["dense"]["micro"]["params"] == results[1]["dense"]["micro"]["params"]


@pytest.mark.parametrize("hook", ["dense", "topk"])
def test_the_compiled_step_under_ddp_gives_the_eager_steps_update_and_exchanges(results, hook):
    for rank in results:
        case = rank["compiled-" + hook]
        assert "error" not in case, case.get("error")
        eager, compiled = case["eager"], case["compiled"]
        for a, b in zip(compiled["params"], eager["params"]):
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
        assert (compiled["bytes"], compiled["calls"], compiled["steps"]) == (eager["bytes"], eager["calls"], 3)
    assert results[0]["compiled-" + hook]["compiled"]["params"] == results[1]["compiled-" + hook]["compiled"]["params"]
