"""A fractional --epochs (airbench's 7.6, the record's way of buying accuracy with a few steps): the run walks
ceil(epochs) epochs, the last one in part, its length counted in steps as airbench counts it; the schedule's clock
is the whole epoch's, so the learning rate ends where the run does; modes whose workers must walk whole epochs say
so in one line."""

import pytest

from tests.unit.small import SMALL_RUN
from trainscale.app.config import build_config
from trainscale.app.run import run_training
from trainscale.errors import ConfigError
from trainscale.modes.config import TrainConfig
from trainscale.record import finished
from trainscale.report.collect import plain_record
from trainscale.train.schedules import create_schedule
from trainscale.train.setup import check_resume_matches

SMALL = {**SMALL_RUN, "checkpoint": False}


@pytest.mark.parametrize(
    "epochs, steps, per_epoch",
    [
        (3, 4, [4, 4, 4]),
        (1.5, 4, [4, 2]),
        (7.6, 25, [25] * 7 + [15]),  # 190 steps: 7.6 x 25 is 190.00000000000003 in floats
        (0.01, 25, [1]),  # at least one step
        (2.01, 4, [4, 4, 1]),  # 8.04 steps: rounded up
    ],
)
def test_the_last_epoch_trains_the_fraction_of_its_steps(epochs, steps, per_epoch):
    optim = TrainConfig.flat(epochs=epochs).optim
    assert [optim.steps_in_epoch(e, steps) for e in range(optim.epoch_count)] == per_epoch
    assert optim.total_steps(steps) == sum(per_epoch)


def test_a_whole_number_stays_an_integer_and_zero_is_refused():
    assert TrainConfig.flat(epochs=8.0).optim.epochs == 8 and isinstance(TrainConfig.flat(epochs=8.0).optim.epochs, int)
    with pytest.raises(ConfigError, match=r"^--epochs must be a positive number, got 0$"):
        build_config(SMALL, {"epochs": 0})


def test_a_run_of_one_and_a_half_epochs(tmp_path):
    """256 images at batch 64: 4 steps an epoch, 6 in all; the second epoch's rate is the schedule's at 1.25 (its
    second step on the whole epoch's clock), not at 1.5; the epoch-time means leave the partial epoch out."""
    cfg = build_config(SMALL, {"epochs": 1.5, "out": str(tmp_path / "run")})
    summary, rows = run_training(cfg)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert [r["train_samples"] for r in rows] == [256, 128]
    assert summary["epochs"] == 1.5 and summary["epochs_completed"] == 2 and finished(summary)
    assert rows[-1]["lr"] == pytest.approx(summary["lr"] * create_schedule(cfg)(1.25))
    assert create_schedule(cfg)(1.5) == 0.0  # one-cycle ends with the run
    assert summary["mean_epoch_seconds"] == rows[0]["epoch_seconds"] and summary["steady_epoch_seconds"] is None
    assert rows[-1]["test_acc"] is not None
    assert plain_record(tmp_path / "run").status == "ok"


def test_a_fractional_run_resumes_only_with_its_own_length():
    recorded = TrainConfig.flat(epochs=1.5, out="runs/x").to_dict()
    check_resume_matches(recorded, TrainConfig.flat(epochs=1.5, out="runs/x"))
    with pytest.raises(ConfigError, match=r"^--resume: --epochs 3 over the run's 1.5, whose last epoch trains in part"):
        check_resume_matches(recorded, TrainConfig.flat(epochs=3, out="runs/x"))
    check_resume_matches(TrainConfig.flat(epochs=2, out="runs/x").to_dict(), TrainConfig.flat(epochs=2.5, out="runs/x"))


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"mode": "async", "servers": 1},
            r"^--mode async trains whole epochs .*not --epochs 2\.5: give a whole number$",
        ),
        (
            {"mode": "sync", "fault_tolerance": True},
            r"^--fault-tolerance trains whole epochs .*not --epochs 2\.5: give a whole number$",
        ),
    ],
)
def test_modes_that_walk_whole_epochs_refuse_a_fraction(settings, message):
    with pytest.raises(ConfigError, match=message):
        build_config(SMALL, {"epochs": 2.5, **settings})
