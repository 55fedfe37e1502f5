"""Failure behaviour of the parameter-server modes, through the real `trainscale train` launcher.

A killed worker (TRAINSCALE_FAULT, the launcher's test-only fault injection: SIGKILL of worker 1's
training process) does not stop an ASGD job: the servers log it and the run finishes its epochs on
the remaining worker. A killed server (TRAINSCALE_PS_SERVER_FAULT, test-only) ends the job at once
with one line naming it, instead of leaving the workers waiting.
"""

import json
import time

import pytest

from tests.integration.cli import run_cli

SYN = ("--model", "mlp", "--dataset", "synthetic", "--train-subset", "512", "--test-subset", "128",
       "--batch-size", "64", "--no-progress", "--workers", "2", "--servers", "2")


@pytest.mark.dist
def test_killing_a_worker_in_async_mode_lets_the_job_finish(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", *SYN, "--mode", "async", "--epochs", "2", "--out", out, timeout=300,
                   env={"TRAINSCALE_FAULT": "kill:rank=1:epoch=1:step=3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker 1: its training process" in proc.stderr and "was killed by signal SIGKILL" in proc.stderr
    assert "worker 1 is gone" in proc.stderr  # the servers noticed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs_completed"] == 2 and summary["dead_workers"] == [1]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # Worker 0 finished both epochs on its own shard (256 samples = 8 steps); worker 1 pushed 3 steps first.
    assert [r["train_samples"] for r in rows] == [256, 256]
    assert rows[0]["ps_pushes"] == 8 + 3 and rows[1]["ps_pushes"] == 8
    assert [r["workers_finished"] for r in rows] == [1, 1]


@pytest.mark.dist
def test_a_dead_server_ends_the_job_with_a_clear_error(tmp_path):
    start = time.monotonic()
    proc = run_cli("train", *SYN, "--mode", "async", "--epochs", "2", "--out", tmp_path / "run", timeout=300,
                   env={"TRAINSCALE_PS_SERVER_FAULT": "server=1:pushes=5"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    # The error is the CLI's last word; Python's resource tracker may still warn after it about the
    # semaphores the killed server could not release, so look for the line rather than take the last one.
    errors = [x for x in proc.stderr.splitlines() if x.startswith("trainscale train: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("trainscale train: error: parameter server rank 3 (local rank 3) failed"), errors
    assert time.monotonic() - start < 120  # ended, not waited out an RPC timeout (300 s)
