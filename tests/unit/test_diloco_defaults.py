"""DiLoCo's outer step in a run of few rounds: it starts as local SGD's (lr 1, no momentum) and grows to the
configured Nesterov step over the first rounds, so a short run learns (figures:
docs/local-sgd-diloco.md).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainscale.app.config import build_config
from trainscale.modes.config import default_outer_warmup
from trainscale.modes.localsgd import PeriodicMode

BASE = {"model": "mlp", "dataset": "synthetic", "workers": 2, "epochs": 2}


def diloco(**flags) -> PeriodicMode:
    return PeriodicMode("diloco", build_config(BASE, {"mode": "diloco", **flags}))


def test_by_default_the_outer_step_grows_from_local_sgds_to_dilocos_over_twice_the_momentum_horizon():
    mode = diloco()
    assert mode.outer_warmup == 20 == default_outer_warmup(0.9)  # 2 / (1 - 0.9) rounds
    assert diloco(outer_momentum=0.95).outer_warmup == 40 and diloco(outer_momentum=0.0).outer_warmup == 0
    assert mode.outer_step(0) == (1.0, 0.0)  # local SGD: the workers' average
    lr, momentum = mode.outer_step(10)
    assert lr == pytest.approx(0.85) and momentum == pytest.approx(0.45)
    assert mode.outer_step(20) == mode.outer_step(1000) == (0.7, 0.9)


def test_the_warm_up_follows_the_settings_and_0_is_dilocos_step_from_the_first_round():
    assert diloco(outer_warmup_rounds=0).outer_step(0) == (0.7, 0.9)
    mode = diloco(outer_lr=0.5, outer_momentum=0.6, outer_warmup_rounds=4)
    assert mode.outer_step(2) == pytest.approx((0.75, 0.3))
    assert PeriodicMode("localsgd", build_config(BASE, {"mode": "localsgd"})).outer_step(0) == (1.0, 0.0)


def test_rounds_apply_the_schedule_and_a_checkpoint_keeps_where_it_is():
    """Nesterov SGD on the anchor with the round's (lr, momentum): a steady pseudo-gradient of 1 moves it by
    1, then lr x (1 + m) x (1 + m's buffer)... exactly as torch.optim.SGD with those settings would."""
    mode = diloco(outer_warmup_rounds=4)
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    mode.prepare(model)
    reference = nn.Parameter(torch.zeros(1, 1))
    outer = torch.optim.SGD([reference], lr=1.0, momentum=0.9, nesterov=True)
    for r in range(6):
        mode.apply_round([torch.ones(1, 1)])
        outer.param_groups[0]["lr"], outer.param_groups[0]["momentum"] = mode.outer_step(r)
        reference.grad = torch.ones(1, 1)
        outer.step()
        assert torch.allclose(model.weight, reference.detach()), f"round {r}"
    state = mode.state_dict()
    resumed = diloco(outer_warmup_rounds=4)
    resumed.prepare(model)
    resumed.load_state_dict(state)
    assert resumed.rounds == mode.rounds == 6


def test_with_momentum_the_outer_step_follows_the_inner_lr_schedule():
    """Workers whose lr the schedule cuts tenfold make pseudo-gradients ten times smaller; the outer momentum holds
    them divided by the round's lr factor and steps at that factor times the outer lr, as momentum SGD under the
    same schedule would (before: it went on stepping with the pseudo-gradients of the old lr)."""
    mode = diloco(outer_warmup_rounds=0)
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    mode.prepare(model)
    mode.inner = torch.optim.SGD([{"params": list(model.parameters()), "lr": 0.1, "peak_lr": 0.1}])
    reference = nn.Parameter(torch.zeros(1, 1))
    outer = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for r, factor in enumerate([1.0, 1.0, 0.1, 0.1, 0.01, 0.0]):
        mode.inner.param_groups[0]["lr"] = 0.1 * factor
        for _ in range(mode.sync_every):
            assert mode.count_step() == (_ == mode.sync_every - 1)
        mode.apply_round([torch.full((1, 1), factor)])  # a steady gradient of 1, taken at the inner lr
        outer.param_groups[0]["lr"] = 0.7 * factor
        reference.grad = torch.ones(1, 1)
        outer.step()
        assert torch.allclose(model.weight, reference.detach()), f"round {r}"
    assert mode.round_state()["lr_sum"] == 0.0


def test_with_outer_momentum_the_inner_sgd_momentum_restarts_each_round():
    """The outer momentum carries the direction across rounds; the inner one restarts, so the two do not compound.
    Without outer momentum (local SGD, DiLoCo at momentum 0) nothing changes; Adam's moments are never touched."""

    def after_a_round(mode: PeriodicMode, make) -> dict:
        model = nn.Linear(2, 1)
        mode.prepare(model)
        inner = mode.step_with(make(model.parameters()), lambda: None)
        model(torch.ones(3, 2)).sum().backward()
        inner.step()
        mode.apply_round([torch.zeros_like(p) for p in model.parameters()])
        return {k: v.abs().sum().item() for state in inner.state.values() for k, v in state.items() if v.dim()}

    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    adam = lambda ps: torch.optim.Adam(ps, lr=0.1)  # noqa: E731
    assert after_a_round(diloco(), sgd) == {"momentum_buffer": 0.0}
    assert after_a_round(diloco(outer_momentum=0.0), sgd)["momentum_buffer"] > 0
    assert after_a_round(PeriodicMode("localsgd", build_config(BASE, {"mode": "localsgd"})), sgd)["momentum_buffer"] > 0
    moments = after_a_round(diloco(), adam)
    assert moments["exp_avg"] > 0 and moments["exp_avg_sq"] > 0
