"""--nonfinite: a NaN/inf step stops training (default) or is skipped, on every rank alike, and counted."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tests.integration.cli import assert_one_line_error, run_cli
from trainscale.app.config import build_config
from trainscale.errors import ConfigError
from trainscale.runtime.network import free_port
from trainscale.runtime.process_group import process_group
from trainscale.train.loop import NonFiniteLoss, train_one_epoch
from trainscale.train.precision import Precision

CPU = Precision("fp32", torch.device("cpu"))


class Batches:
    """Four batches of one linear layer's inputs; batch ``bad`` has a NaN pixel. Before each batch it
    records the model's parameters, so a test sees exactly what each step changed."""

    def __init__(self, model: nn.Module, bad: set[int], steps: int = 4) -> None:
        self.model, self.bad, self.steps = model, bad, steps
        self.before: list[torch.Tensor] = []
        self.num_samples = 8 * steps

    def __len__(self) -> int:
        return self.steps

    def epoch(self, epoch: int):
        gen = torch.Generator().manual_seed(epoch)
        for step in range(self.steps):
            self.before.append(torch.cat([p.detach().flatten().clone() for p in self.model.parameters()]))
            images = torch.randn(8, 6, generator=gen)
            if step in self.bad:
                images[0, 0] = float("nan")
            yield images, torch.randint(0, 3, (8,), generator=gen)


def epoch(model: nn.Module, batches: Batches, nonfinite: str, lr: float = 0.1):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return train_one_epoch(
        model, batches, optimizer, CPU.grad_scaler(), CPU, lambda t: lr, epoch=0, progress=False, nonfinite=nonfinite
    )


def test_a_nan_step_is_skipped_leaving_the_parameters_as_they_were():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    batches = Batches(model, bad={2})
    stats = epoch(model, batches, "skip")
    before = batches.before
    assert not torch.equal(before[1], before[2])  # steps 1 and 2 were applied
    assert torch.equal(before[2], before[3])  # step 3 (index 2) was not
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.isfinite(after).all() and not torch.equal(after, before[3])  # step 4 applied again
    assert stats.skipped_steps == 1 and math.isfinite(stats.loss)
    assert stats.samples == 32  # skipped samples were computed: they count for throughput


def test_by_default_the_same_step_stops_training_naming_it():
    model = nn.Linear(6, 3)
    with pytest.raises(NonFiniteLoss, match=r"not finite \(NaN or inf\) at epoch 1 step 3 \(lr 0.1\)"):
        epoch(model, Batches(model, bad={2}), "stop")


def test_a_step_with_finite_loss_but_non_finite_gradients_is_skipped():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    batches = Batches(model, bad=set())
    model.bias.register_hook(lambda g: g * float("inf") if len(batches.before) == 2 else g)
    stats = epoch(model, batches, "skip")
    assert stats.skipped_steps == 1 and torch.equal(batches.before[1], batches.before[2])
    assert math.isfinite(stats.loss)


def test_an_epoch_of_only_skipped_steps_stops_training():
    model = nn.Linear(6, 3)
    batches = Batches(model, bad={0, 1, 2, 3})
    with pytest.raises(
        NonFiniteLoss,
        match=r"every step of epoch 1 \(4\) had a non-finite loss or gradients and "
        r"was skipped \(--nonfinite skip",
    ):
        epoch(model, batches, "skip")
    assert all(torch.equal(batches.before[0], b) for b in batches.before)


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    with process_group(torch.device("cpu"), "gloo", timeout_s=60):
        torch.manual_seed(0)
        model = nn.Linear(6, 3)
        batches = Batches(model, bad={1} if rank == 1 else set())  # only rank 1 sees the NaN
        stats = epoch(model, batches, "skip")
        same = [torch.equal(batches.before[i], batches.before[i + 1]) for i in range(3)]
        Path(out, f"{rank}.json").write_text(json.dumps({"skipped": stats.skipped_steps, "same": same}))


@pytest.mark.dist
def test_ranks_agree_a_step_is_skipped_when_any_rank_saw_a_non_finite_value(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result == {"skipped": 1, "same": [False, True, False]}, (rank, result)


def test_skip_is_refused_for_parameter_server_modes_and_unknown_values():
    assert build_config({"model": "mlp", "nonfinite": "skip"}).optim.nonfinite == "skip"
    assert build_config({"model": "mlp", "workers": 2, "nonfinite": "skip"}).run.mode == "sync"
    with pytest.raises(ConfigError, match=r"^--nonfinite skip is for --mode local and sync, not --mode async"):
        build_config({"model": "mlp", "servers": 1, "nonfinite": "skip"})
    with pytest.raises(ConfigError, match=r"^--nonfinite must be one of stop, skip, got 'ignore'"):
        build_config({"model": "mlp", "nonfinite": "ignore"})


TINY = (
    "--model",
    "mlp",
    "--dataset",
    "synthetic",
    "--train-subset",
    "256",
    "--test-subset",
    "64",
    "--batch-size",
    "64",
    "--schedule",
    "constant",
    "--epochs",
    "2",
    "--no-progress",
    "--threads",
    "1",
)


def test_an_overflowing_lr_stops_with_one_line_by_default(tmp_path):
    proc = run_cli("train", *TINY, "--lr", "1e30", "--out", tmp_path / "run", timeout=300)
    assert_one_line_error(proc, "the training loss is not finite (NaN or inf) at epoch 1 step 2 (lr 1e+30)")


def test_an_overflowing_lr_with_skip_reports_skipped_steps_then_stops_when_a_whole_epoch_is_skipped(tmp_path):
    proc = run_cli("train", *TINY, "--lr", "1e30", "--nonfinite", "skip", "--out", tmp_path / "run", timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip() and " INFO " not in x]
    assert "epoch 1: skipped 3 step(s) with a non-finite loss or gradients (--nonfinite skip)" in lines[0]
    assert lines[1].startswith("trainscale train: error: every step of epoch 2 (4) had a non-finite loss"), lines
    assert len(lines) == 2 and "Traceback" not in proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [3]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["skipped_steps"] == 3
    assert os.path.exists(tmp_path / "run" / "checkpoint.pt")


def test_skip_is_refused_with_a_stateful_compressor() -> None:
    with pytest.raises(ConfigError, match="--nonfinite skip cannot be combined with --compress topk"):
        build_config({}, {"nonfinite": "skip", "compress": "topk", "workers": 2, "dataset": "synthetic"})
    build_config({}, {"nonfinite": "skip", "compress": "fp16", "workers": 2, "dataset": "synthetic"})
