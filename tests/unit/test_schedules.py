import pytest

from trainscale.app.config import TrainConfig
from trainscale.train.schedules import create_schedule, length_change, list_schedules, never_steps


def lr(cfg: TrainConfig, t: float) -> float:
    return cfg.optim.lr * create_schedule(cfg)(t)


def test_seed000_step_schedule():
    """0.1, then 0.01 from epoch 41 and 0.001 from epoch 61 (1-based, as the seed writes it)."""
    cfg = TrainConfig.flat(schedule="step", lr=0.1, epochs=82, milestones=[41, 61], gamma=0.1)
    assert lr(cfg, 0) == pytest.approx(0.1)
    assert lr(cfg, 39.99) == pytest.approx(0.1)  # 0-based epoch 39 is the seed's epoch 40
    assert lr(cfg, 40) == pytest.approx(0.01)  # the seed's epoch 41
    assert lr(cfg, 59.5) == pytest.approx(0.01)
    assert lr(cfg, 60) == pytest.approx(0.001)
    assert lr(cfg, 81.9) == pytest.approx(0.001)


def test_seed004_onecycle():
    """0 -> 0.4 over epochs 0-5, back to 0 at epoch 24 (piecewise linear)."""
    cfg = TrainConfig.flat(schedule="onecycle", lr=0.4, epochs=24)
    assert lr(cfg, 0) == 0
    assert lr(cfg, 2.5) == pytest.approx(0.2)
    assert lr(cfg, 5) == pytest.approx(0.4)
    assert lr(cfg, 14.5) == pytest.approx(0.2)
    assert lr(cfg, 24) == pytest.approx(0.0)


def test_onecycle_default_warmup_scales_with_epochs():
    cfg = TrainConfig.flat(schedule="onecycle", lr=1.0, epochs=48)
    assert lr(cfg, 10) == pytest.approx(1.0)


def test_linear_warmup_on_step_and_cosine():
    step = TrainConfig.flat(schedule="step", lr=0.1, epochs=10, warmup_epochs=2, milestones=[6])
    assert lr(step, 1) == pytest.approx(0.05)
    assert lr(step, 2) == pytest.approx(0.1)
    assert lr(step, 5) == pytest.approx(0.01)
    cos = TrainConfig.flat(schedule="cosine", lr=1.0, epochs=10)
    assert lr(cos, 0) == pytest.approx(1.0)
    assert lr(cos, 5) == pytest.approx(0.5)
    assert lr(cos, 10) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("name", list_schedules())
def test_every_schedule_is_bounded(name):
    cfg = TrainConfig.flat(schedule=name, lr=0.5, epochs=7)
    values = [lr(cfg, e / 10) for e in range(71)]
    assert all(0 <= v <= 0.5 + 1e-12 for v in values)


def test_a_run_whose_every_step_has_lr_0_is_found():
    one_cycle = create_schedule(TrainConfig.flat(schedule="onecycle", epochs=1))
    assert never_steps(one_cycle, total=1, steps_per_epoch=1)  # its one step sits at the start, lr 0
    assert not never_steps(one_cycle, total=4, steps_per_epoch=4)
    assert not never_steps(create_schedule(TrainConfig.flat(schedule="constant", epochs=1)), total=1, steps_per_epoch=1)
    half = create_schedule(TrainConfig.flat(schedule="onecycle", epochs=0.5))
    assert never_steps(half, total=1, steps_per_epoch=2)  # half an epoch of 2 steps: one step, at lr 0
    assert not never_steps(half, total=2, steps_per_epoch=4)


def test_a_resume_with_more_epochs_says_what_an_epoch_shaped_schedule_becomes():
    """One-cycle and cosine are computed for the run's length: resumed with more --epochs, the rate where the run
    goes on is not its own schedule's (one-cycle's 0 at the end of 24 epochs is 0.4 x 6/23.75 over 30); a step
    schedule's milestones and an explicit warm-up stay put, so nothing is said; nor for the same length."""
    onecycle = TrainConfig.flat(schedule="onecycle", lr=0.4, epochs=30)
    assert length_change(onecycle, 24, 24, 0.4) == (
        "--epochs 30 over the run's 24: its onecycle schedule is now computed for 30 epochs, so epoch 25 starts "
        "at lr 0.1011 where the run's own schedule had 0"
    )
    assert "epoch 11 starts at lr 0.3" in (length_change(onecycle, 24, 10, 0.4) or "")  # an interrupted run too
    assert "cosine" in (length_change(TrainConfig.flat(schedule="cosine", lr=0.1, epochs=20), 10, 10, 0.1) or "")
    step = TrainConfig.flat(schedule="step", lr=0.1, epochs=90, milestones=[41, 61], gamma=0.1)
    warm = TrainConfig.flat(schedule="constant", lr=0.1, epochs=90, warmup_epochs=5)
    assert length_change(step, 82, 82, 0.1) is None and length_change(warm, 82, 3, 0.1) is None
    assert length_change(onecycle, 30, 12, 0.4) is None and length_change(onecycle, 0, 12, 0.4) is None
