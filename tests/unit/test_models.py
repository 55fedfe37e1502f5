"""Tests for trainscale.models: every registered net builds, runs, back-propagates and has its published size."""

from __future__ import annotations

from dataclasses import FrozenInstanceError

import pytest
import torch

from trainscale.errors import ConfigError
from trainscale.models import MODELS, ModelInfo, count_parameters, create_model, list_models, model_info

# Exact trainable-parameter counts at num_classes=10. Every registered model must appear here.
EXPECTED_PARAMS = {
    "airbench": 1_971_328,
    "airbench94": 1_971_352,  # + the whitening bias, trained for 3 epochs
    "speedrun94": 1_971_352,  # airbench94 with SiLU: the same parameters
    "alexnet": 23_272_266,
    "alexnet_bn": 2_255_306,
    "inception_bn_small": 1_651_114,
    "inception_v3": 21_806_058,
    "mlp": 1_707_274,
    "resnet9": 6_573_120,
    "resnet20": 269_722,
    "resnet32": 464_154,
    "resnet44": 658_586,
    "resnet56": 853_018,
    "resnet110": 1_727_962,
    "resnet50": 23_520_842,
    "resnet50_imagenet": 23_528_522,
    "resnet50_mxnet": 758_621,
    "resnet110_mxnet": 1_730_781,
}

LARGE_INPUT = 224  # nets at or above this input side get a batch-1, forward-only check (CPU time)


def make_input(name: str, batch: int) -> torch.Tensor:
    size = model_info(name).input_size
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


def build(name: str, **kwargs: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model(name, **kwargs)
    if hasattr(model, "data_init"):
        model.data_init(torch.randn(64, 3, model_info(name).input_size, model_info(name).input_size))
    return model


@pytest.mark.parametrize("name", list_models())
def test_forward_backward(name: str) -> None:
    model = build(name)
    if model_info(name).input_size >= LARGE_INPUT:
        model.eval()
        with torch.no_grad():
            out = model(make_input(name, 1))
        assert out.shape == (1, 10)
        assert torch.isfinite(out).all()
        return
    out = model(make_input(name, 2))
    assert out.shape == (2, 10)
    out.float().logsumexp(1).sum().backward()
    for pname, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name}.{pname} got no gradient"
            assert torch.isfinite(p.grad).all(), f"{name}.{pname} has a non-finite gradient"


def test_every_model_has_an_expected_count() -> None:
    assert set(list_models()) == set(EXPECTED_PARAMS)


@pytest.mark.parametrize("name", list_models())
def test_parameter_count(name: str) -> None:
    assert count_parameters(create_model(name)) == EXPECTED_PARAMS[name]


def test_resnet9_has_25_tensors() -> None:
    assert len(list(create_model("resnet9").parameters())) == 25


@pytest.mark.parametrize(("name", "count"), [("resnet50_imagenet", 25_557_032), ("inception_v3", 23_834_568)])
def test_imagenet_counts_at_1000_classes(name: str, count: int) -> None:
    assert count_parameters(create_model(name, num_classes=1000)) == count


def test_inception_bn_small_size_is_as_published() -> None:
    assert 1_500_000 <= EXPECTED_PARAMS["inception_bn_small"] <= 1_800_000


def test_inception_v3_aux_head_in_training_only() -> None:
    model = create_model("inception_v3", num_classes=1000, aux_logits=True)
    assert count_parameters(model) == 27_161_264  # main net + aux head
    with torch.no_grad():  # train-mode BN in the aux head needs batch >= 2; eval mode is covered above
        logits, aux = model(torch.randn(2, 3, 299, 299))
    assert logits.shape == aux.shape == (2, 1000)


def test_unknown_name_suggests_closest() -> None:
    with pytest.raises(ConfigError, match="did you mean 'resnet32'"):
        create_model("resnet23")
    with pytest.raises(ConfigError):
        model_info("no_such_net")


@pytest.mark.parametrize("name", ["resnet20", "mlp", "airbench", "alexnet_bn", "inception_bn_small"])
def test_num_classes_changes_output_width(name: str) -> None:
    model = build(name, num_classes=100)
    assert model(make_input(name, 2)).shape == (2, 100)


def test_model_info_is_frozen_metadata() -> None:
    info = model_info("resnet50_imagenet")
    assert info == ModelInfo("resnet50_imagenet", 224, info.description, "imagefolder", "goyal2017")
    assert model_info("resnet9").input_size == 32 and model_info("resnet9").default_dataset == "cifar10"
    assert model_info("inception_bn_small").input_size == 28
    with pytest.raises(FrozenInstanceError):
        info.input_size = 32  # type: ignore[misc]
    assert all(model_info(n).description for n in list_models())
    assert "resnet9" in MODELS


def test_mlp_kwargs() -> None:
    model = create_model("mlp", num_classes=3, hidden=(7,), in_features=12)
    assert count_parameters(model) == 12 * 7 + 7 + 7 * 3 + 3
    assert model(torch.randn(4, 3, 2, 2)).shape == (4, 3)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in create_model("mlp").modules())


def test_cifar_resnet_shortcuts_are_parameter_free() -> None:
    model = create_model("resnet20")
    assert all(p.ndim != 4 or p.shape[-1] == 3 for p in model.parameters())  # only 3x3 convs, no 1x1 projections


def test_airbench_frozen_parts() -> None:
    model = create_model("airbench")
    assert not model.whiten.weight.requires_grad and not model.whiten.bias.requires_grad
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bns) == 6
    assert all(not bn.weight.requires_grad and bn.bias.requires_grad and bn.eps == 1e-12 for bn in bns)
    assert count_parameters(create_model("airbench", widths=(8, 16, 16))) < EXPECTED_PARAMS["airbench"]


def correlated_images(n: int, seed: int) -> torch.Tensor:
    """Images whose 2x2 patches are strongly correlated across channels and neighbouring pixels, with an offset."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 3, 32, 32, generator=g)
    mix = torch.tensor([[1.0, 0.8, 0.3], [0.0, 0.6, 0.5], [0.0, 0.0, 0.4]])
    x = torch.einsum("ij,njhw->nihw", mix, z)
    x = x + 0.7 * x.roll(1, dims=-1) + 0.5 * x.roll(1, dims=-2)
    return 2.0 * x + torch.tensor([0.5, -1.0, 0.2]).view(1, 3, 1, 1)


def patch_covariance(x: torch.Tensor) -> torch.Tensor:
    """Covariance of the channel vectors of x (N, C, H, W) over all samples and positions."""
    flat = x.transpose(0, 1).reshape(x.shape[1], -1).double()
    return torch.cov(flat)


def test_airbench_whitening_decorrelates_held_out_patches() -> None:
    model = create_model("airbench")
    model.data_init(correlated_images(800, seed=1))
    held_out = correlated_images(800, seed=2)
    raw = patch_covariance(held_out.unfold(2, 2, 1).unfold(3, 2, 1).permute(0, 1, 4, 5, 2, 3).reshape(-1, 12, 31, 31))
    assert (raw - torch.eye(12, dtype=raw.dtype)).abs().max() > 1.0  # the test data is far from white
    with torch.no_grad():
        out = model.whiten(held_out)
    cov = patch_covariance(out[:, :12])
    assert torch.allclose(cov, torch.eye(12, dtype=cov.dtype), atol=0.05)
    assert out[:, :12].mean(dim=(0, 2, 3)).abs().max() < 0.05  # bias centres the output
    assert torch.allclose(out[:, 12:], -out[:, :12], atol=1e-5)  # second half are the negated filters
