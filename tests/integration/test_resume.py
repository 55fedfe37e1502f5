"""--resume continues a run bit for bit: an interrupted run and an uninterrupted one end identical. The resumed run
is given nothing but its folder (`trainscale train --out DIR --resume`): its settings come from the folder's
run.toml."""

import json
import logging

import torch

from trainscale.app.config import build_config, train_settings
from trainscale.app.run import run_training
from trainscale.train.trainer import Trainer


def final_weights(out):
    return torch.load(out / "checkpoint.pt", weights_only=True)["model"]


def test_resume_is_bit_exact(tmp_path, monkeypatch):
    base = dict(
        model="resnet20",
        dataset="synthetic",
        train_subset=384,
        test_subset=128,
        epochs=3,
        batch_size=64,
        lr=0.1,
        momentum=0.9,
        schedule="onecycle",
        cutout=8,
        progress=False,
        threads=1,
        seed=3,
        log_every=4,
    )
    run_training(build_config(base, {"out": str(tmp_path / "straight")}))

    real_run_epoch = Trainer.run_epoch

    def crash_in_epoch_3(self, epoch):
        if epoch == 2:
            raise KeyboardInterrupt
        return real_run_epoch(self, epoch)

    monkeypatch.setattr(Trainer, "run_epoch", crash_in_epoch_3)
    broken = tmp_path / "broken"
    try:
        run_training(build_config(base, {"out": str(broken)}))
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(Trainer, "run_epoch", real_run_epoch)
    assert torch.load(broken / "checkpoint.pt", weights_only=True)["state"]["next_epoch"] == 2
    run_training(train_settings({"out": str(broken), "resume": True}))

    a, b = final_weights(tmp_path / "straight"), final_weights(broken)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    lines = (broken / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    steps = [
        [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
        for out in (tmp_path / "straight", broken)
    ]
    assert [r["step"] for r in steps[1]] == [4, 6, 10, 12, 16, 18]  # every 4 steps of 6 and each epoch's last
    assert [(r["loss"], r["lr"]) for r in steps[0]] == [(r["loss"], r["lr"]) for r in steps[1]]


def test_resuming_with_more_epochs_says_once_what_it_does_to_the_learning_rate(tmp_path, caplog):
    """A finished one-cycle run resumed with more --epochs goes on at a rate its own schedule never had there (the
    schedule is computed for the new length): said in one warning, with both rates, and recorded as trained."""
    base = dict(model="mlp", dataset="synthetic", train_subset=256, test_subset=64, epochs=2, batch_size=64)
    base.update(lr=0.2, schedule="onecycle", progress=False, threads=1)
    run_training(build_config(base, {"out": str(tmp_path / "run")}))
    with caplog.at_level(logging.WARNING, logger="trainscale"):
        run_training(build_config({**base, "epochs": 3}, {"out": str(tmp_path / "run"), "resume": True}))
    said = [r.getMessage() for r in caplog.records if "over the run's" in r.getMessage()]
    assert said == [
        "--epochs 3 over the run's 2: its onecycle schedule is now computed for 3 epochs, so epoch 3 starts at "
        "lr 0.08421 where the run's own schedule had 0"
    ], said
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["epoch"] == 3 and rows[-1]["lr"] > 0
