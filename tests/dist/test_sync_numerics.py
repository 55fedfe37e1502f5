"""Synchronous data parallelism changes the arithmetic, not the algorithm: with a BatchNorm-free model,
the same global batch and seed, two workers over gloo end with the parameters one process reaches."""

import json

import pytest
import torch

from tests.integration.cli import run_cli
from trainscale.app.config import build_config
from trainscale.app.run import run_training
from trainscale.models import create_model

# 512 samples, global batch 64: 8 steps per epoch, 3 epochs. Augmentation off so both runs see the
# same pixels; rank r's half-batch is perm[r::2] of the single process's batch.
COMMON = dict(
    model="mlp",
    dataset="synthetic",
    train_subset=512,
    test_subset=128,
    epochs=3,
    batch_size=64,
    lr=0.05,
    momentum=0.9,
    weight_decay=5e-4,
    crop_padding=0,
    flip=False,
    precision="fp32",
    seed=7,
    progress=False,
    threads=1,
)


def as_flags(settings: dict) -> list[str]:
    flags = []
    for key, value in settings.items():
        name = "--" + key.replace("_", "-")
        flags += [name if value else "--no-" + name[2:]] if isinstance(value, bool) else [name, str(value)]
    return flags


def weights(out):
    return torch.load(out / "checkpoint.pt", weights_only=True)["model"]


@pytest.mark.dist
def test_two_workers_match_one_process(tmp_path):
    run_training(build_config(COMMON, {"out": str(tmp_path / "one")}))
    proc = run_cli(
        "train",
        *as_flags(COMMON),
        "--workers",
        "2",
        "--out",
        tmp_path / "two",
        "--baseline",
        tmp_path / "one",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=1e-5, msg=key)
    torch.manual_seed(COMMON["seed"])  # the initial weights, as build_model draws them
    initial = create_model("mlp").state_dict()
    assert max((one[k] - initial[k]).abs().max() for k in one) > 1e-3  # training really moved them
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert (summary["mode"], summary["world_size"], summary["backend"]) == ("sync", 2, "gloo")
    assert summary["batch_size"] == 64 and summary["batch_per_worker"] == 32
    assert summary["scaling_efficiency"] > 0 and summary["scaling_baseline"]["world_size"] == 1
    one_rows = (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()
    two_rows = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    for a, b in zip(map(json.loads, one_rows), map(json.loads, two_rows)):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-5)
        assert b["test_acc"] == pytest.approx(a["test_acc"])
