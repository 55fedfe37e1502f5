"""The optimizer registry: each optimizer's first step against its formula, LARS and LAMB against their papers on
hand-computed tensors (trust ratios included), ``--optim-arg`` checked against the optimizer's signature, the
weight-decay groups, and the defaults an optimizer brings over a recipe written for another one."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainscale.app.config import build_config, train_settings
from trainscale.config import OptimConfig
from trainscale.errors import ConfigError
from trainscale.models import create_model
from trainscale.train.optim import create_optimizer, list_optimizers
from trainscale.train.optim.lamb import LAMB
from trainscale.train.optim.lamb import trust_ratio as lamb_ratio
from trainscale.train.optim.lars import LARS
from trainscale.train.optim.lars import trust_ratio as lars_ratio
from trainscale.train.optimizers import build_optimizer, parameter_groups

W, G = [3.0, 4.0], [0.6, 0.8]  # ||w|| = 5, ||g|| = 1


def stepped(optimizer_cls, steps=1, **kwargs):
    w = nn.Parameter(torch.tensor(W, dtype=torch.float64))
    opt = optimizer_cls([w], **kwargs)
    for _ in range(steps):
        w.grad = torch.tensor(G, dtype=torch.float64)
        opt.step()
    return w.detach()


def test_lars_trust_ratio_and_two_steps_by_hand():
    # local lr = eta ||w|| / (||g|| + beta ||w||) = 0.001 * 5 / (1 + 0.1 * 5) = 1/300
    w, g = torch.tensor(W), torch.tensor(G)
    assert float(lars_ratio(w, g, eta=0.001, decay=0.1, eps=0.0)) == pytest.approx(1 / 300, rel=1e-6)
    assert float(lars_ratio(torch.zeros(2), g, 0.001, 0.1, 0.0)) == 1.0  # a zero layer takes the global lr
    assert float(lars_ratio(w, torch.zeros(2), 0.001, 0.1, 0.0)) == 1.0
    kw = dict(lr=2.0, momentum=0.9, weight_decay=0.1, eta=0.001)
    # v1 = 2 * (1/300) * (g + 0.1 w) = (1/150) * [0.9, 1.2] = [0.006, 0.008]; w1 = [2.994, 3.992] (= 0.998 w)
    assert stepped(LARS, 1, **kw).tolist() == pytest.approx([2.994, 3.992], abs=1e-12)
    # ||w1|| = 4.99: local lr 0.00499 / 1.499; g + 0.1 w1 = [0.8994, 1.1992]
    # v2 = 0.9 v1 + 2 * 0.00499 / 1.499 * [0.8994, 1.1992] = [0.0054 + 0.0059880, 0.0072 + 0.0079840]
    local = 2 * 0.00499 / 1.499
    v2 = [0.0054 + local * 0.8994, 0.0072 + local * 1.1992]
    assert stepped(LARS, 2, **kw).tolist() == pytest.approx([2.994 - v2[0], 3.992 - v2[1]], abs=1e-12)
    assert v2 == pytest.approx([0.011388, 0.015184], abs=1e-6)


def test_lars_without_trust_ratio_is_momentum_sgd():
    w = nn.Parameter(torch.tensor(W))
    opt = LARS([{"params": [w], "trust_ratio": False}], lr=0.5, momentum=0.9, weight_decay=0.0)
    w.grad = torch.tensor(G)
    opt.step()
    assert w.tolist() == pytest.approx([3 - 0.3, 4 - 0.4])


def test_lamb_trust_ratio_and_first_step_by_hand():
    # step 1: m_hat = g, v_hat = g^2, so r = g / |g| = [1, 1] (eps 0); u = r + 0.1 w = [1.3, 1.4]
    # ||u|| = sqrt(3.65); ratio ||w|| / ||u|| = 5 / 1.9104973 = 2.6171196
    u = torch.tensor([1.3, 1.4], dtype=torch.float64)
    ratio = float(lamb_ratio(torch.tensor(W, dtype=torch.float64), u))
    assert ratio == pytest.approx(2.6171196, abs=1e-7)
    assert float(lamb_ratio(torch.zeros(2), u)) == 1.0
    w1 = stepped(LAMB, 1, lr=0.01, betas=(0.9, 0.999), eps=0.0, weight_decay=0.1)
    assert w1.tolist() == pytest.approx([3 - 0.01 * ratio * 1.3, 4 - 0.01 * ratio * 1.4], abs=1e-12)
    assert w1.tolist() == pytest.approx([2.9659774, 3.9633603], abs=1e-7)


def test_lamb_second_step_bias_corrections():
    b1, b2, lr = 0.9, 0.999, 0.01
    w1 = stepped(LAMB, 1, lr=lr, betas=(b1, b2), eps=0.0, weight_decay=0.0)
    # the same gradient twice: m_hat = g and v_hat = g^2 again, so r = [1, 1]; u = r; ratio ||w1|| / sqrt(2)
    expected = w1 - lr * w1.norm() / math.sqrt(2) * torch.ones(2, dtype=torch.float64)
    assert stepped(LAMB, 2, lr=lr, betas=(b1, b2), eps=0.0, weight_decay=0.0).tolist() == pytest.approx(
        expected.tolist(), abs=1e-12
    )


def first_step(name, **optim):
    w = nn.Parameter(torch.tensor(W, dtype=torch.float64))
    cfg = OptimConfig(optimizer=name, lr=0.01, weight_decay=0.1, **optim)
    opt = create_optimizer([{"params": [w], "lr": 0.01, "weight_decay": 0.1}], cfg)
    w.grad = torch.tensor(G, dtype=torch.float64)
    opt.step()
    return opt, w.detach()


def test_adamw_and_adam_first_step_formulas():
    # first step: m_hat / sqrt(v_hat) = g / |g| = 1 per element (eps aside)
    _, w = first_step("adamw", optim_arg=["eps=0"])
    assert w.tolist() == pytest.approx([3 * (1 - 0.01 * 0.1) - 0.01, 4 * (1 - 0.01 * 0.1) - 0.01], abs=1e-12)
    _, w = first_step("adam", optim_arg=["eps=0", "betas=0.8,0.99"])  # L2: g + 0.1 w, still one sign
    assert w.tolist() == pytest.approx([2.99, 3.99], abs=1e-12)


def test_radam_first_step_is_momentum_without_adaptation():
    # rho_1 <= 5: RAdam takes the bias-corrected first moment, w - lr * (g + wd w)
    _, w = first_step("radam")
    assert w.tolist() == pytest.approx([3 - 0.01 * 0.9, 4 - 0.01 * 1.2], abs=1e-12)


@pytest.mark.parametrize(
    "name, cls, args",
    [("nadam", torch.optim.NAdam, {"momentum_decay": 0.002}), ("adafactor", torch.optim.Adafactor, {"d": 2.0})],
)
def test_named_optimizer_is_torchs_with_its_arguments(name, cls, args):
    opt, w = first_step(name, optim_arg=[f"{k}={v}" for k, v in args.items()])
    assert type(opt) is cls and all(opt.param_groups[0][k] == v for k, v in args.items())
    ref = nn.Parameter(torch.tensor(W, dtype=torch.float64))
    direct = cls([ref], lr=0.01, weight_decay=0.1, **args)
    ref.grad = torch.tensor(G, dtype=torch.float64)
    direct.step()
    assert torch.equal(w, ref.detach())


def test_every_torch_optimizer_is_registered():
    assert {"sgd", "muon", "adamw", "adam", "nadam", "radam", "adafactor", "lars", "lamb"} <= set(list_optimizers())


@pytest.mark.parametrize(
    "args, message",
    [
        (["foo=1"], "--optim-arg foo: --optimizer adamw takes no such argument (it takes: betas, eps"),
        (["betas=1.5,0.9"], "Invalid beta parameter at index 0: 1.5"),
        (["lr=0.1"], "--optim-arg lr: set it with --lr, not --optim-arg"),
        (["betas"], "expected KEY=VALUE"),
    ],
)
def test_bad_optim_args_are_one_line(args, message):
    with pytest.raises(ConfigError, match=None) as err:
        build_config({"model": "mlp", "dataset": "synthetic", "optimizer": "adamw", "optim_arg": args})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_sgd_takes_no_optim_args():
    with pytest.raises(ConfigError, match="--optimizer sgd takes no such argument"):
        build_config({"model": "mlp", "optim_arg": ["dampening=0.1"]})


@pytest.mark.parametrize("name", list_optimizers())
@pytest.mark.parametrize(
    "edges",
    [
        {"lr": 0.0, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0},
        {"lr": 10.0, "momentum": 0.99, "nesterov": True, "weight_decay": 1.0, "head_lr_factor": 0.1},
        {
            "lr": 1e-6,
            "momentum": 0.5,
            "nesterov": False,
            "no_decay_norm_bias": True,
            "muon_lr": 0.0,
            "muon_momentum": 0.0,
        },
    ],
)
def test_a_registered_optimizer_builds_for_every_setting_the_config_accepts(name, edges):
    """The config checks a registered optimizer without building it (``check_optimizer`` builds only for
    ``--optim-arg`` or an import path): every value of the flags it shares that the config accepts must build."""
    cfg = build_config({"model": "airbench94", "optimizer": name, **edges})
    build_optimizer(cfg, create_model("airbench94"), cfg.optim.lr)


def test_checking_a_registered_optimizer_does_not_build_it(monkeypatch):
    built = []
    monkeypatch.setattr(torch.optim.Optimizer, "__init__", lambda self, *a, **k: built.append(a))
    build_config({"model": "mlp", "optimizer": "adamw", "lr": 0.5})
    assert not built
    build_config({"model": "mlp", "optimizer": "adamw", "optim_arg": ["eps=1e-6"]})  # its own checks speak
    assert len(built) == 1


def test_optimizer_by_import_path():
    cfg = build_config({"model": "mlp", "optimizer": "torch.optim:ASGD", "optim_arg": ["lambd=0.001"]})
    opt = build_optimizer(cfg, create_model("mlp"), 0.1)
    assert type(opt) is torch.optim.ASGD and opt.param_groups[0]["lambd"] == 0.001
    with pytest.raises(ConfigError, match="--optimizer no_such_pkg:Opt: cannot import it"):
        build_config({"model": "mlp", "optimizer": "no_such_pkg:Opt"})


def test_an_optimizer_by_import_path_takes_the_momentum_flags_its_signature_names():
    cfg = build_config({"model": "mlp", "optimizer": "torch.optim:SGD", "momentum": 0.5, "nesterov": True})
    group = build_optimizer(cfg, create_model("mlp"), 0.1).param_groups[0]
    assert (group["momentum"], group["nesterov"]) == (0.5, True)
    cfg = build_config({"model": "mlp", "optimizer": "torch.optim:Adam", "momentum": 0.5})  # Adam names neither
    assert type(build_optimizer(cfg, create_model("mlp"), 0.1)) is torch.optim.Adam
    with pytest.raises(ConfigError, match="torch.optim:SGD --optim-arg dampening=0.5: Nesterov momentum requires"):
        build_config({"model": "mlp", "optimizer": "torch.optim:SGD", "nesterov": True, "optim_arg": ["dampening=0.5"]})


@pytest.mark.parametrize(
    "flags, note",
    [
        ({"optimizer": "adamw", "momentum": 0.8, "nesterov": True}, "--momentum and --nesterov do nothing with"),
        ({"optimizer": "sgd", "muon_lr": 0.1}, "--muon-lr does nothing with --optimizer sgd"),
        ({"optimizer": "lars", "nesterov": True}, "--nesterov does nothing with --optimizer lars"),
        ({"optimizer": "torch.optim:Adam", "momentum": 0.5}, "--momentum does nothing with --optimizer torch"),
        ({"schedule": "cosine", "milestones": [2.0], "gamma": 0.5}, "--milestones and --gamma do nothing with"),
        ({"error_feedback": True}, "--error-feedback does nothing with --compress none"),
        ({"workers": 2, "ft_timeout": 9.0}, "--ft-timeout does nothing with --fault-tolerance off"),
        ({"optimizer": "sgd", "momentum": 0.8, "nesterov": True}, None),
        ({"optimizer": "muon", "muon_lr": 0.1, "momentum": 0.8}, None),
        ({"optimizer": "torch.optim:SGD", "momentum": 0.5}, None),
        ({"schedule": "step", "milestones": [2.0]}, None),
        ({"recipe": "airbench94", "optimizer": "adamw"}, None),  # the recipe's momentum is no setting the user gave
    ],
)  # fmt: skip
def test_a_setting_given_that_the_run_never_reads_is_noted(flags, note, caplog):
    """A flag the chosen optimizer, schedule or compression never reads is said, once, where it used to pass in
    silence; only settings the user gave (not a recipe's) and not refused (a grid's cells share settings)."""
    with caplog.at_level("INFO", logger="trainscale"):
        train_settings({"model": "mlp", "dataset": "synthetic", **flags})
    notes = [r.getMessage() for r in caplog.records if "nothing with" in r.getMessage()]
    assert len(notes) == (note is not None)
    assert note is None or notes[0].startswith(note)


def returns_none(groups, **_):
    return None


def test_an_optimizer_by_import_path_that_returns_no_optimizer_is_refused_before_the_run():
    with pytest.raises(ConfigError, match="returned NoneType, not a torch.optim.Optimizer"):
        build_config({"model": "mlp", "optimizer": f"{__name__}:returns_none"})


def test_another_optimizer_brings_its_own_lr_and_decay():
    cfg = build_config({"model": "resnet20", "optimizer": "adamw"})  # the recipe's lr 0.1 is SGD's
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (1e-3, 0.05)
    cfg = build_config({"model": "resnet20", "optimizer": "adamw", "lr": 3e-4})
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (3e-4, 0.05)


def test_no_decay_groups_hold_every_bias_and_norm_weight():
    model = create_model("resnet20")
    cfg = build_config({"model": "resnet20", "no_decay_norm_bias": True, "weight_decay": 1e-4})
    groups = {g["name"]: g for g in parameter_groups(cfg, model, 0.1)}
    exempt = {id(p) for p in groups["no_decay"]["params"]}
    assert exempt == {id(p) for p in model.parameters() if p.ndim <= 1} and exempt
    assert groups["no_decay"]["weight_decay"] == 0 and groups["no_decay"]["trust_ratio"] is False
    assert groups["rest"]["weight_decay"] == 1e-4 and all(p.ndim > 1 for p in groups["rest"]["params"])
    plain = parameter_groups(build_config({"model": "resnet20"}), model, 0.1)
    assert [g["name"] for g in plain] == ["rest"]
