"""Recipes (per-model default settings) and the airbench94 ingredients, on small tensors.

Every registered recipe and every model's recipe builds a valid config; what a user writes wins over a recipe; the
alternating flip pattern, Muon's parameter grouping and update, the whitening bias schedule and the TTA views.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from trainscale.app.config import build_config
from trainscale.data import DeviceBatches
from trainscale.data.loader import AugmentConfig
from trainscale.data.tensors import ImageTensors
from trainscale.errors import ConfigError
from trainscale.models import create_model, list_models, model_info
from trainscale.recipes import get_recipe, list_recipes
from trainscale.runtime.cpus import keep_freed_memory
from trainscale.train.loop import PassStats, predict, views_per_image
from trainscale.train.optimizers import MuonWithSGD, build_optimizer, set_lr
from trainscale.train.trainer import Trainer, reference_scope


@pytest.mark.parametrize("name", list_recipes())
def test_every_recipe_builds_a_valid_config(name: str) -> None:
    cfg = build_config({"recipe": name, "dataset": "synthetic"})
    assert cfg.optim.recipe == name
    for key, value in get_recipe(name).settings.items():
        assert cfg.to_dict()[key] == value, key


@pytest.mark.parametrize("model", list_models())
def test_every_model_gets_its_own_recipe(model: str) -> None:
    cfg = build_config({"model": model})
    recipe = get_recipe(model_info(model).recipe)
    assert cfg.optim.recipe == recipe.name
    assert cfg.optim.lr == recipe.settings["lr"]


def test_user_settings_win_and_lr_scales_with_the_batch() -> None:
    cfg = build_config({"model": "resnet20", "batch_size": 256})
    optim = cfg.optim
    assert (optim.lr, optim.lr_scaling, optim.schedule, optim.milestones) == (0.1, "none", "step", [83, 124])
    scaled = build_config({"model": "resnet50", "batch_size": 512})
    assert (scaled.optim.lr, scaled.optim.lr_scaling, scaled.optim.base_batch_size) == (
        0.1,
        "linear",
        256,
    )  # 0.2 at 512
    mine = build_config({"model": "resnet50", "batch_size": 512, "lr": 0.3, "schedule": "cosine"})
    assert (mine.optim.lr, mine.optim.lr_scaling, mine.optim.schedule) == (
        0.3,
        "none",
        "cosine",
    )  # no scaling of the user's lr
    assert mine.optim.milestones == [41, 61]  # the recipe's milestones went with its schedule: trainscale's default


def test_recipe_warmup_and_milestones_are_scaled_to_the_run() -> None:
    short = build_config({"model": "resnet50", "epochs": 2}).optim  # Goyal et al.: 5 warm-up of 90, /10 at 30, 60, 80
    assert short.warmup_epochs == round(5 * 2 / 90, 4) and short.milestones == [1.6667, 2.3333, 2.7778]
    with pytest.raises(ConfigError, match="--warmup-epochs"):
        build_config({"model": "resnet50", "epochs": 2, "warmup_epochs": 3.0})  # the user's own: refused


def test_recipe_may_name_the_model_and_unknown_recipe_is_one_line() -> None:
    assert build_config({"recipe": "airbench94"}).data.model == "airbench94"
    assert build_config({"recipe": "airbench94", "model": "resnet20"}).data.model == "resnet20"
    with pytest.raises(ConfigError, match="unknown recipe 'airbench9'.*did you mean 'airbench94'"):
        build_config({"recipe": "airbench9"})


def test_muon_refused_for_parameter_server_modes() -> None:
    with pytest.raises(
        ConfigError, match="--optimizer muon is for --mode local, sync, localsgd, diloco and ma, not --mode async"
    ):
        build_config({"optimizer": "muon", "mode": "async", "servers": 1, "workers": 2})


# ------------------------------------------------------------------------------------------- alternating flip


def images(n: int = 40) -> ImageTensors:
    data = torch.arange(n * 3 * 4 * 4, dtype=torch.int64).remainder(251).to(torch.uint8).view(n, 3, 4, 4)
    return ImageTensors(
        images=data, labels=torch.arange(n), num_classes=n, mean=(0.5,) * 3, std=(0.25,) * 3, name="tiny"
    )


def flipped_by_label(batches: DeviceBatches, epoch: int, data: ImageTensors) -> dict[int, bool]:
    out = {}
    for x, y in batches.epoch(epoch):
        for image, label in zip(x, y.tolist()):
            plain = batches._finish(data.images[label : label + 1])[0]
            assert torch.equal(image, plain) or torch.equal(image, plain.flip(2))
            out[label] = not torch.equal(image, plain)
    return out


def test_alternating_flip_flips_each_image_on_every_other_epoch() -> None:
    data = images()
    aug = AugmentConfig(crop_padding=0, flip=True, alternate_flip=True)
    ranks = [
        DeviceBatches(data, 4, train=True, augment=aug, device="cpu", rank=r, world_size=2, seed=3) for r in range(2)
    ]
    epochs = [{k: v for b in ranks for k, v in flipped_by_label(b, e, data).items()} for e in range(3)]
    assert set(epochs[0]) == set(range(40))
    assert all(epochs[1][i] != epochs[0][i] and epochs[2][i] == epochs[0][i] for i in range(40))
    assert 8 < sum(epochs[0].values()) < 32  # a coin per image, not one for all


# ------------------------------------------------------------------------------------------------ optimizer


def muon_cfg(**extra: object):
    return build_config({"recipe": "airbench94", "dataset": "synthetic", **extra})


def test_airbench94_parameter_groups() -> None:
    cfg = muon_cfg()
    model = create_model("airbench94").to(memory_format=torch.channels_last)
    opt = build_optimizer(cfg, model, lr=cfg.optim.lr)
    groups = {g["name"]: g for g in opt.param_groups}
    assert list(groups) == ["rest", "head", "until", "filters"]
    assert opt.param_groups[0]["name"] == "rest"  # the per-epoch table shows group 0's lr
    filters = [p for p in model.parameters() if p.ndim == 4 and p.requires_grad]
    assert groups["filters"]["params"] == filters and len(filters) == 6 and groups["filters"]["muon"]
    assert groups["head"]["params"] == [model.fc.weight]
    assert groups["until"]["params"] == [model.whiten.bias] and groups["until"]["until_epoch"] == 3.0
    decay = {n: g["lr"] * g["weight_decay"] for n, g in groups.items() if n != "filters"}
    assert decay["head"] == pytest.approx(decay["rest"]) == pytest.approx(2e-6 * 2000)
    set_lr(opt, cfg.optim.lr * 0.5, 1.5)
    assert groups["head"]["lr"] == pytest.approx(cfg.optim.lr * 0.5 * cfg.optim.head_lr_factor)
    assert groups["filters"]["lr"] == pytest.approx(cfg.optim.muon_lr * 0.5)
    assert groups["until"]["lr"] == pytest.approx(cfg.optim.lr * 0.5)  # 1 - 1.5 / 3
    set_lr(opt, cfg.optim.lr * 0.4, 3.2)
    assert groups["until"]["lr"] == 0.0


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_muon_step_equals_torch_muon_on_the_flattened_filter(layout: torch.memory_format) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 8, 3, bias=False).to(memory_format=layout)
    reference = nn.Parameter(conv.weight.detach().clone().flatten(1))
    ours = MuonWithSGD(
        [{"params": [conv.weight], "lr": 0.1, "muon": True, "momentum": 0.6}],
        {"momentum": 0.9, "nesterov": True},
        normalise_filters=False,
    )
    ours.ns_dtype = torch.bfloat16  # torch's, also on a CPU whose own choice is fp32
    theirs = torch.optim.Muon([reference], lr=0.1, momentum=0.6, nesterov=True, weight_decay=0.0, ns_steps=3)
    for _ in range(3):
        grad = torch.randn(8, 6, 3, 3)
        conv.weight.grad = grad.clone().to(memory_format=layout)
        reference.grad = grad.flatten(1)
        ours.step()
        theirs.step()
    # columns in another order (channels_last) give the same update: compare in the filter's own shape
    assert torch.allclose(conv.weight.detach(), reference.detach().view(8, 6, 3, 3), atol=1e-3, rtol=0)
    assert conv.weight.is_contiguous(memory_format=layout)


def test_muon_state_round_trips_through_a_checkpoint() -> None:
    torch.manual_seed(1)
    conv = nn.Conv2d(4, 4, 3, bias=False).to(memory_format=torch.channels_last)

    def make() -> MuonWithSGD:
        return MuonWithSGD(
            [{"params": [conv.weight], "lr": 0.05, "muon": True, "momentum": 0.6}],
            {"momentum": 0.9, "nesterov": True},
            normalise_filters=True,
        )

    first = make()
    conv.weight.grad = torch.randn_like(conv.weight)
    first.step()
    saved, weights = copy.deepcopy(first.state_dict()), conv.weight.detach().clone()  # as a checkpoint file
    second = make()
    second.load_state_dict(saved)
    conv.weight.grad = torch.ones_like(conv.weight)
    first.step()
    after_first = conv.weight.detach().clone()
    conv.weight.data.copy_(weights)
    second.step()
    assert torch.equal(conv.weight.detach(), after_first)
    assert conv.weight.norm().item() == pytest.approx(2.0, rel=0.05)  # normalised to sqrt(out), then one step


# ------------------------------------------------------------------------------------------------------- TTA


class Probe(nn.Module):
    """Logits = the image's mean over each of a few pixel columns: flips and shifts change them predictably."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(1, 2))[:, :3]


def test_tta_views() -> None:
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).view(2, 3, 6, 6).sin()
    model = Probe()
    mirror = lambda t: 0.5 * (model(t) + model(t.flip(3)))  # noqa: E731
    padded = torch.nn.functional.pad(x, (1,) * 4, mode="reflect")
    expected = 0.5 * mirror(x) + 0.25 * (mirror(padded[..., :6, :6]) + mirror(padded[..., 2:, 2:]))
    assert torch.allclose(predict(model, x, flip=True, translate=1), expected)
    assert torch.allclose(predict(model, x, flip=True), mirror(x))
    assert (views_per_image(False, 0), views_per_image(True, 0), views_per_image(True, 1)) == (1, 2, 6)


def test_reference_scope_counts_init_training_and_the_last_evaluation() -> None:
    last = {"eval_seconds": 4.0, "test_acc": 0.941, "test_views": 6}
    scope = reference_scope(1.5, 100.0, last, 0.94)
    assert scope["seconds"] == scope["time_to_target_seconds"] == 105.5 and scope["name"] == "airbench"
    assert reference_scope(1.5, 100.0, {**last, "test_acc": 0.93}, 0.94)["time_to_target_seconds"] is None


# ------------------------------------------------------------------------------------- a run that does not learn


def bare_trainer(lr: float) -> Trainer:
    trainer = object.__new__(Trainer)
    trainer.cfg = build_config({"model": "resnet20", "batch_size": 256, "lr": lr, "dataset": "synthetic"})
    trainer.summary_base = {"lr": lr, "batch_size": 256}
    trainer.first_loss, trainer.warned_not_learning = None, False
    return trainer


def epoch_stats(loss: float, first: float | None = None) -> PassStats:
    return PassStats(loss, 0.1, 256, 1.0, first_loss=first)


def test_a_run_that_does_not_learn_is_told_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trainscale.train"):
        diverging = bare_trainer(0.4)
        diverging._check_learning(0, epoch_stats(2.70, 2.31))
        diverging._check_learning(1, epoch_stats(2.80))
        learning = bare_trainer(0.1)
        learning._check_learning(0, epoch_stats(1.90, 2.31))
        learning._check_learning(1, epoch_stats(1.60))
        frozen = bare_trainer(0.0)  # --lr 0 asks for no learning: it was told its learning rate was too high
        frozen._check_learning(0, epoch_stats(2.40, 2.31))
    assert len(caplog.records) == 1
    assert "epoch 1: the mean training loss 2.700 is above the first step's 2.310" in caplog.text
    assert "(0.4 at batch 256) is probably too high for resnet20: lower --lr" in caplog.text


def test_the_whitening_bias_stops_taking_gradients_once_its_training_ends() -> None:
    """From epoch 3 on its lr is zero; in one process it then leaves backward (no first-conv input gradient)."""
    trainer = object.__new__(Trainer)
    trainer.cfg = muon_cfg()
    trainer.model = create_model("airbench94")
    optimizer = build_optimizer(trainer.cfg, trainer.model, lr=trainer.cfg.optim.lr)
    bias = trainer.model.whiten.bias
    trainable = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    trainer.freeze_finished(2)
    assert bias.requires_grad
    trainer.freeze_finished(3)
    assert {id(p) for p in trainer.model.parameters() if p.requires_grad} == trainable - {id(bias)}
    before = bias.detach().clone()
    trainer.model(torch.randn(4, 3, 32, 32)).sum().backward()
    optimizer.step()
    assert bias.grad is None and torch.equal(bias, before)


def test_freed_memory_is_kept_on_glibc() -> None:
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert keep_freed_memory()
