"""`trainscale train --mode async|ps-sync|ma --workers N --servers S` end to end, as a user runs it."""

import json

import pytest
import torch

from tests.integration.cli import assert_one_line_error, run_cli, small_run

SYN = small_run(train=512, test=128)
PS_SUMMARY = (
    "mode",
    "servers",
    "workers",
    "staleness_mean",
    "staleness_max",
    "staleness_hist",
    "pushes_per_sec",
    "bytes_pushed_per_step",
    "bytes_pulled_per_step",
    "server_update_seconds",
    "worker_samples_per_sec",
    "samples_per_sec",
    "push_seconds_per_step",
    "pull_seconds_per_step",
    "wait_seconds_per_step",
)


def rows_of(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.realdata
@pytest.mark.slow
def test_async_two_workers_two_servers_learn_real_cifar(tmp_path, cifar10_dir):
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        "--model",
        "mlp",
        "--dataset",
        "cifar10",
        "--data-dir",
        cifar10_dir,
        "--train-subset",
        "10000",
        "--test-subset",
        "2000",
        "--epochs",
        "2",
        "--batch-size",
        "128",
        "--lr",
        "0.01",
        "--schedule",
        "constant",
        "--crop-padding",
        "0",
        "--no-flip",
        "--no-progress",
        "--mode",
        "async",
        "--workers",
        "2",
        "--servers",
        "2",
        "--out",
        out,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # RPC's local shutdown: no C++ warning of TensorPipe's closed connections from the forked workers and servers
    assert "tensorpipe" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_test_acc"] > 0.30, summary  # chance is 0.10
    assert set(PS_SUMMARY) <= set(summary)
    assert (summary["mode"], summary["servers"], summary["workers"], summary["world_size"]) == ("async", 2, 2, 2)
    assert summary["bytes_pushed_per_step"] == summary["bytes_pulled_per_step"] == 4 * summary["params"]
    assert len(summary["worker_samples_per_sec"]) == 2 and all(r > 0 for r in summary["worker_samples_per_sec"])
    # 2 epochs x 2 workers x 78 steps (5,000 samples / 64 per worker), each applied by 2 shards
    assert sum(summary["staleness_hist"].values()) == 2 * 2 * (5000 // 64) * 2
    rows = rows_of(out)
    assert [r["epoch"] for r in rows] == [1, 2] and all(r["train_samples"] == 9984 for r in rows)
    assert all(r["pushes_per_sec"] > 0 and "staleness_hist" in r for r in rows)
    assert "async through 2 server shard(s) over RPC" in proc.stdout
    # The defaults (momentum 0.9): the server's momentum reduced for 2 asynchronous workers, staleness-aware lr on.
    assert (
        "async: server momentum 0.4 (--momentum 0.9 less 1 - 1/2 for 2 asynchronous worker(s)), staleness-aware lr on"
    ) in proc.stdout + proc.stderr
    assert (summary["async_momentum"], summary["staleness_lr"]) == (pytest.approx(0.4), True)
    config = json.loads((out / "config.json").read_text())
    assert (config["momentum"], config["async_momentum"], config["staleness_lr"]) == (0.9, "auto", True)


@pytest.mark.dist
def test_ps_sync_checkpoints_the_servers_and_resumes_them(tmp_path):
    out = tmp_path / "run"
    first = run_cli(
        "train",
        *SYN,
        "--mode",
        "ps-sync",
        "--workers",
        "2",
        "--servers",
        "2",
        "--epochs",
        "1",
        "--out",
        out,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli(
        "train",
        *SYN,
        "--mode",
        "ps-sync",
        "--workers",
        "2",
        "--servers",
        "2",
        "--epochs",
        "2",
        "--out",
        out,
        "--resume",
        timeout=300,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    servers = ckpt["optimizer"]["servers"]
    # BSP: one update per step (8 per epoch); the clock went on from the first run's 8 instead of restarting.
    assert [s["version"] for s in servers] == [16, 16]
    assert all(s["momentum"] is not None for s in servers)
    flat = torch.cat([s["params"] for s in servers])
    assert torch.equal(flat, torch.cat([p.reshape(-1) for p in ckpt["model"].values()]))  # model = servers
    rows = rows_of(out)
    assert [r["epoch"] for r in rows] == [1, 2] and all(r["staleness_max"] == 0 for r in rows)


@pytest.mark.dist
def test_model_averaging_with_a_warm_start(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        *SYN,
        "--mode",
        "ma",
        "--average-every",
        "3",
        "--warm-start-epochs",
        "1",
        "--workers",
        "2",
        "--servers",
        "1",
        "--epochs",
        "2",
        "--out",
        out,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(out)
    # Epoch 1: worker 0 alone over all 512 samples (16 steps of 32): averages after 3, 6, ..., 15 and 16.
    assert (rows[0]["workers_finished"], rows[0]["train_samples"], rows[0]["ps_pushes"]) == (1, 512, 6)
    # Epoch 2: both workers, 8 steps each: averages after 3, 6 and 8, i.e. 3 pushes each.
    assert (rows[1]["workers_finished"], rows[1]["train_samples"], rows[1]["ps_pushes"]) == (2, 512, 6)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["ps_rule"], summary["average_every"], summary["warm_start_epochs"]) == ("ma", 3, 1)


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (
            ("--mode", "async", "--workers", "2", "--servers", "1", "--async-momentum", "high"),
            "--async-momentum must be 'auto' or a number in [0, 1), got 'high'",
        ),
        (("--mode", "async", "--workers", "2"), "--mode async needs --servers S >= 1"),
        (("--mode", "sync", "--workers", "2", "--servers", "1"), "--servers is for the parameter-server modes"),
        (("--mode", "ps-sync", "--servers", "1", "--staleness", "2"), "--staleness bounds ASGD"),
    ],
)
def test_bad_parameter_server_flags_are_one_line(main_cli, tmp_path, flags, fragment):
    assert_one_line_error(main_cli("train", *SYN, "--epochs", "1", *flags, "--out", tmp_path), fragment)
