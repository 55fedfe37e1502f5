"""Learning-rate schedules as pure functions of the (fractional) epoch, found by name.

Each factory takes the config and returns ``f(t) -> multiplier`` of the base LR, ``t`` in epochs
(``epoch + step / steps_per_epoch``), so the LR is set every step and is identical after a resume.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from trainscale.config import CoreConfig
from trainscale.registry import Registry

Schedule = Callable[[float], float]
SCHEDULES: Registry[Schedule] = Registry("schedule")


def create_schedule(cfg: CoreConfig) -> Schedule:
    """The schedule named by ``cfg.optim.schedule`` with the linear warm-up applied on top."""
    shape = SCHEDULES.create(cfg.optim.schedule, cfg=cfg)
    warmup = warmup_epochs(cfg)
    if warmup <= 0 or cfg.optim.schedule == "onecycle":
        return shape
    return lambda t: shape(t) * min(1.0, t / warmup)


def never_steps(schedule: Schedule, total: int, steps_per_epoch: int) -> bool:
    """Whether ``schedule`` gives every one of the run's ``total`` steps a learning rate of 0 (one-cycle over a
    single step does): such a run trains nothing. At most ~100,000 steps are looked at, spread over the run."""
    stride = max(1, total // 100_000)
    return all(schedule(i / steps_per_epoch) == 0 for i in range(0, total, stride))


def list_schedules() -> list[str]:
    return SCHEDULES.names()


def warmup_epochs(cfg: CoreConfig) -> float:
    """Explicit ``--warmup-epochs``, else 5/24 of the run for one-cycle (cifar10-fast's 5 of 24), else none."""
    if cfg.optim.warmup_epochs is not None:
        return float(cfg.optim.warmup_epochs)
    return cfg.optim.epochs * 5 / 24 if cfg.optim.schedule == "onecycle" else 0.0


@SCHEDULES.register("constant")
def constant(cfg: CoreConfig) -> Schedule:
    return lambda t: 1.0


@SCHEDULES.register("step", reads=("milestones", "gamma"))
def step(cfg: CoreConfig) -> Schedule:
    """Multiply by ``gamma`` at each milestone. Milestones are 1-based epoch numbers as the seeds write
    them: the Multiverso benchmark's "0.01 from epoch 41" is ``milestones=[41, 61]``, i.e. 0-based epoch 40 onwards."""
    starts = [m - 1 for m in cfg.optim.milestones]
    return lambda t: cfg.optim.gamma ** sum(1 for s in starts if t >= s)


@SCHEDULES.register("onecycle")
def onecycle(cfg: CoreConfig) -> Schedule:
    """Piecewise linear 0 -> 1 at the warm-up epoch -> 0 at the last epoch (cifar10-fast)."""
    peak, end = warmup_epochs(cfg), float(cfg.optim.epochs)

    def f(t: float) -> float:
        if t < peak:
            return t / peak
        return max(0.0, (end - t) / (end - peak)) if end > peak else 1.0

    return f


@SCHEDULES.register("cosine")
def cosine(cfg: CoreConfig) -> Schedule:
    return lambda t: 0.5 * (1 + math.cos(math.pi * min(t, cfg.optim.epochs) / cfg.optim.epochs))


def length_change(cfg: CoreConfig, recorded_epochs: float, at_epoch: int, lr: float) -> str | None:
    """What a resume with more ``--epochs`` than the run was started with does to its learning rate, in one line
    (None: nothing). An epoch-shaped schedule (one-cycle, cosine, a warm-up that is a share of the run) is
    computed for the new length, so where the run goes on its rate is not the one its own schedule had there
    (one-cycle's 0 at the end becomes the middle of a decay); a step schedule's milestones stay where they were.
    ``lr``: the base rate the schedule multiplies; ``at_epoch``: the first epoch the resumed run trains (0-based)."""
    if recorded_epochs <= 0 or recorded_epochs == cfg.optim.epochs:
        return None
    before, after = create_schedule(cfg.replace(epochs=recorded_epochs)), create_schedule(cfg)
    points = [float(e) for e in range(at_epoch, math.ceil(min(recorded_epochs, cfg.optim.epochs)) + 1)]
    if all(math.isclose(before(t), after(t), rel_tol=1e-9, abs_tol=1e-12) for t in points):
        return None
    t = float(at_epoch)
    return (
        f"--epochs {cfg.optim.epochs:g} over the run's {recorded_epochs:g}: its {cfg.optim.schedule} schedule is "
        f"now computed for {cfg.optim.epochs:g} epochs, so epoch {at_epoch + 1} starts at lr {lr * after(t):.4g} where "
        f"the run's own schedule had {lr * before(t):.4g}"
    )
