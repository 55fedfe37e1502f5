"""Local SGD and DiLoCo end to end (2 gloo workers, the mlp: no BatchNorm, so replicas can be compared
exactly): H = 1 is synchronous SGD, DiLoCo with outer lr 1 and no momentum is local SGD, a resumed run
equals an uninterrupted one bit for bit, and a compressed outer step sends what its payload says."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.integration.cli import assert_one_line_error, run_cli, small_run

pytestmark = pytest.mark.dist

SYN = (
    *small_run(train=1024, test=128, batch=128),
    *("--workers", "2", "--momentum", "0.9", "--weight-decay", "5e-4", "--lr", "0.05"),
)


def train(out: Path, *args: str, epochs: float = 2) -> dict:
    run = run_cli("train", *SYN, "--epochs", str(epochs), "--out", out, *args, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoint.pt", weights_only=False)["model"]


def assert_close(a: Path, b: Path, atol: float) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=atol, msg=key)


def test_localsgd_averaging_every_step_is_sync(tmp_path: Path) -> None:
    """Momentum and weight decay are linear in the gradient, so averaging after every local step gives
    the parameters of averaging the gradients first."""
    train(tmp_path / "sync")
    summary = train(tmp_path / "local", "--mode", "localsgd", "--sync-every", "1")
    assert_close(tmp_path / "sync", tmp_path / "local", atol=1e-5)
    assert summary["rounds"] == 16 and summary["steps_per_round"] == 1  # 8 steps per epoch
    assert summary["bytes_sent_per_step"] == 4 * summary["params"]  # one fp32 pseudo-gradient per step


def test_diloco_with_outer_lr_1_and_no_momentum_is_localsgd(tmp_path: Path) -> None:
    train(tmp_path / "local", "--mode", "localsgd", "--sync-every", "3")
    summary = train(
        tmp_path / "diloco", "--mode", "diloco", "--sync-every", "3", "--outer-lr", "1", "--outer-momentum", "0"
    )
    assert_close(tmp_path / "local", tmp_path / "diloco", atol=1e-6)
    assert summary["rounds"] == 6  # 8 steps per epoch: rounds after steps 3 and 6, and one to end it


def test_a_fractional_length_ends_its_partial_epoch_with_a_round(tmp_path: Path) -> None:
    """--epochs 1.5 at 8 steps an epoch: both workers train 4 steps of the second epoch, with a round after its
    third and one to end it (5 in all, 3 for the first epoch)."""
    summary = train(tmp_path / "d", "--mode", "diloco", "--sync-every", "3", epochs=1.5)
    rows = [json.loads(line) for line in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_samples"] for r in rows] == [1024, 512]
    assert summary["epochs"] == 1.5 and summary["epochs_completed"] == 2 and summary["rounds"] == 5


def test_diloco_resumes_bit_for_bit(tmp_path: Path) -> None:
    """The outer Nesterov momentum is in the checkpoint (without it the weights differ by 0.02); the inner
    momentum is averaged at each epoch end. A constant LR, so that 1 epoch then 2 follow one schedule."""
    args = ("--mode", "diloco", "--sync-every", "3", "--schedule", "constant")
    train(tmp_path / "whole", *args)
    train(tmp_path / "parts", *args, epochs=1)
    train(tmp_path / "parts", *args, "--resume")
    assert_close(tmp_path / "whole", tmp_path / "parts", atol=0)


def test_a_compressed_outer_step_sends_its_payload_once_per_round(tmp_path: Path) -> None:
    """Top-k 1% of the pseudo-gradient every 4 steps: per step, a quarter of what Top-k sends when sync
    mode compresses every step's gradient."""
    topk = ("--compress", "topk", "--ratio", "0.01", "--error-feedback")
    sync = train(tmp_path / "sync", *topk, epochs=1)
    diloco = train(tmp_path / "diloco", "--mode", "diloco", "--sync-every", "4", *topk, epochs=1)
    assert diloco["steps_per_round"] == 4
    assert diloco["bytes_sent_per_step"] * 4 == pytest.approx(sync["bytes_sent_per_step"])
    assert diloco["compression_ratio"] == pytest.approx(sync["compression_ratio"])


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ("--mode", "localsgd", "--outer-lr", "0.5"),
            "--outer-lr, --outer-momentum and --outer-warmup-rounds are for --mode diloco",
        ),
        (("--mode", "diloco", "--sync-every", "0"), "--sync-every must be a positive number of steps"),
        (("--mode", "diloco", "--outer-momentum", "1"), "--outer-momentum must be in [0, 1)"),
        (("--mode", "localsgd", "--local-after-epochs", "2"), "--local-after-epochs must be in [0, epochs=2)"),
        (("--sync-every", "4"), "--sync-every is for --mode diloco, localsgd, not --mode sync"),
    ],
)
def test_bad_periodic_flags(tmp_path: Path, capsys: pytest.CaptureFixture, args: tuple, fragment: str) -> None:
    from trainscale.cli import main

    argv = ["train", *SYN, "--epochs", "2", "--out", str(tmp_path / "run"), *args]
    status = main(argv)
    captured = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess(argv, status, captured.out, captured.err), fragment)
    assert not (tmp_path / "run").exists()
