"""A failing worker stops the whole job promptly with its error named; with --max-restarts the elastic
agent restarts the workers, which resume from the last finished epoch and end where an uninterrupted
run ends."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.integration.cli import run_cli
from trainscale.app.config import build_config
from trainscale.app.run import run_training

SMALL = dict(
    model="mlp",
    dataset="synthetic",
    train_subset=512,
    test_subset=128,
    epochs=3,
    batch_size=64,
    lr=0.05,
    crop_padding=0,
    flip=False,
    seed=3,
    progress=False,
    threads=1,
)


def flags(settings: dict) -> list[str]:
    out = []
    for key, value in settings.items():
        name = "--" + key.replace("_", "-")
        out += [name if value else "--no-" + name[2:]] if isinstance(value, bool) else [name, str(value)]
    return out


@pytest.mark.dist
def test_a_raising_worker_stops_the_job_with_its_error(tmp_path):
    start = time.monotonic()
    proc = run_cli(
        "train",
        *flags(SMALL),
        "--workers",
        "2",
        "--out",
        tmp_path / "run",
        timeout=120,
        env={"TRAINSCALE_FAULT": "raise:rank=1:epoch=1:step=2"},
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "trainscale train: error: worker rank 1 (local rank 1) failed: RuntimeError: "
        "TRAINSCALE_FAULT: injected failure in rank 1 at epoch 1 step 2"
    ), last
    assert elapsed < 60, elapsed
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def restarted_with_fault(out, fault: str, restarts: int) -> subprocess.CompletedProcess:
    """Two workers of ``SMALL`` with ``--max-restarts restarts`` and the test-only fault ``fault``."""
    argv = ["train", *flags(SMALL), "--workers", "2", "--max-restarts", str(restarts), "--out", out]
    return run_cli(*argv, timeout=300, env={"TRAINSCALE_FAULT": fault})


@pytest.mark.dist
def test_killed_worker_is_restarted_and_the_run_resumes(tmp_path):
    proc = restarted_with_fault(tmp_path / "run", "kill:rank=1:epoch=2:step=1", restarts=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SIGKILL" in proc.stderr or "exitcode: -9" in proc.stderr  # the kill really happened
    assert "resumed from" in proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert ckpt["state"]["next_epoch"] == 3

    # The interrupted two-worker run ends where one uninterrupted process does (same global batches).
    run_training(build_config(SMALL, {"out": str(tmp_path / "straight")}))
    straight = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)["model"]
    for key, value in straight.items():
        torch.testing.assert_close(ckpt["model"][key], value, rtol=0, atol=1e-5, msg=key)


@pytest.mark.dist
def test_with_restarts_a_refusal_ends_the_job_at_once_with_its_line(tmp_path):
    """A refusal that a restart would meet again (a full disk refusing the checkpoint; injected here, once): before,
    the agent restarted the workers into it --max-restarts times, each time after the work up to it, its notices
    of the failed worker above the line. Now the first refusal ends the job: its line, status 2, no restart."""
    proc = restarted_with_fault(tmp_path / "run", "refuse:rank=1:epoch=2:step=1", restarts=2)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "trainscale train: error: worker rank 1 (local rank 1) failed: ConfigError: "
        "TRAINSCALE_FAULT: injected refusal in rank 1 at epoch 2 step 1"
    ), proc.stderr[-3000:]
    noise = [x for x in proc.stderr.splitlines() if " INFO " not in x and "injecting 'refuse'" not in x]
    assert noise == [last], noise
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1  # the first epoch's, kept; not resumed and retried


@pytest.mark.dist
def test_under_an_external_torchrun_workers_join_and_survive_a_restart(tmp_path):
    """`torchrun ... -m trainscale train` just joins (no second launcher), and a restart by torchrun's own
    agent (which keeps its store across attempts) resumes too."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--log-dir",  # torch's agent folder here, not left in /tmp
        str(tmp_path / "agent"),
        "-m",
        "trainscale",
        "train",
        *flags(SMALL),
        "--out",
        str(tmp_path / "run"),
    ]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRAINSCALE_FAULT": "kill:rank=1:epoch=2:step=1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3] and rows[-1]["world_size"] == 2
    assert "results in" in proc.stdout  # rank 0 prints, as nobody else will
