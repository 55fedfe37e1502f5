"""airbench94-style net (Jordan 2024) for time-to-accuracy runs on CIFAR-10.

Structure: a frozen 2x2 patch-whitening conv 3 -> 24 (no padding, 32 -> 31 pixels), GELU; three conv groups
(conv3x3 -> maxpool2 -> BN -> GELU -> conv3x3 -> BN -> GELU) at ``widths`` (64, 256, 256), no residuals, 31 -> 15 ->
7 -> 3 pixels; MaxPool2d(3) to 1x1; Linear(256, classes, bias=False); logits scaled by 1/9.
1,971,328 trainable parameters for 10 classes (the whitening conv and the BN scales are frozen).

Decisions:
- Whitening bias: :meth:`AirbenchNet.data_init` sets it to ``-W @ mean_patch`` so the whitened channels have zero
  mean on the fitting batch (for normalised images this is close to zero anyway); it stays frozen afterwards.
- Before ``data_init`` the whitening filters are the 12 unit patch vectors and their negations (the whitening of
  white-noise patches), so an un-initialised net still runs and trains, just without decorrelated input.
- BN momentum: airbench's "momentum 0.6" is the weight kept on the old running statistics, i.e. PyTorch momentum
  0.4 (0.4 of each new batch's statistics enters the running average). ``bn_momentum`` is in PyTorch's convention.
- Convs after the whitening layer start with their first ``c_in`` filters set to identity (Dirac), as airbench
  does, which lets this residual-free net train quickly from step one.

``airbench94`` is the same net as airbench94_muon.py builds it: the head's weight starts at unit standard deviation
and the logits are divided by the width (256) instead of scaled by 1/9, and the whitening bias trains for the first
3 epochs (``train_until``) before it freezes. Its recipe (``trainscale.models.recipes``) trains the filters with Muon.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from trainscale.errors import ConfigError
from trainscale.models.pool2x2 import MaxPool2x2
from trainscale.models.registry import register_model

PATCH = 2


class FrozenScaleBN(nn.BatchNorm2d):
    """BN with its scale fixed at 1 (only the shift trains) and eps 1e-12, as in airbench."""

    def __init__(self, channels: int, momentum: float) -> None:
        super().__init__(channels, eps=1e-12, momentum=momentum)
        self.weight.requires_grad_(False)


def dirac_conv(c_in: int, c_out: int) -> nn.Conv2d:
    """Bias-free 3x3 conv whose first min(c_in, c_out) filters pass the input through unchanged at init."""
    conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
    n = min(c_in, c_out)
    with torch.no_grad():
        conv.weight[:n].zero_()
        conv.weight[:n, :, 1, 1] = torch.eye(n, c_in)
    return conv


POOLS: dict[str, Callable[[], nn.Module]] = {
    "max": lambda: nn.MaxPool2d(2),
    "triton": MaxPool2x2,
    "triton-opaque": lambda: MaxPool2x2(opaque=True),
}


def pool_2x2(name: str) -> nn.Module:
    """The groups' 2x2 max pooling by name (``POOLS``; ``--model-arg pool=NAME``): ``max`` is ``nn.MaxPool2d``,
    ``triton`` the same pooling through Triton kernels inside torch.compile on a GPU (``models.pool2x2``),
    ``triton-opaque`` those kernels as opaque ops that torch.compile calls without tracing into them."""
    if name not in POOLS:
        raise ConfigError(f"--model-arg pool={name}: no such pooling; use one of {', '.join(POOLS)}")
    return POOLS[name]()


class ConvGroup(nn.Module):
    """conv -> maxpool2 -> BN -> GELU -> conv -> BN -> GELU: pool before BN so BN sees the downsampled map."""

    def __init__(
        self, c_in: int, c_out: int, bn_momentum: float, act: type[nn.Module] = nn.GELU, pool: str = "max"
    ) -> None:
        super().__init__()
        self.conv1 = dirac_conv(c_in, c_out)
        self.pool = pool_2x2(pool)
        self.bn1 = FrozenScaleBN(c_out, bn_momentum)
        self.conv2 = dirac_conv(c_out, c_out)
        self.bn2 = FrozenScaleBN(c_out, bn_momentum)
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.bn1(self.pool(self.conv1(x))))
        return self.act(self.bn2(self.conv2(x)))


def patches_2x2(images: torch.Tensor) -> torch.Tensor:
    """All 2x2 patches as rows, flattened in the conv weight's (channel, row, col) order.

    Built from four shifted slices rather than ``F.unfold``, which is several times slower on CPU.
    """
    n, c, h, w = images.shape
    shifts = [images[:, :, i : h - 1 + i, j : w - 1 + j] for i in range(PATCH) for j in range(PATCH)]
    stacked = torch.stack(shifts, dim=2)  # (N, C, 4, H-1, W-1)
    return stacked.reshape(n, c * PATCH * PATCH, -1).transpose(1, 2).reshape(-1, c * PATCH * PATCH)


def patch_moments(images: torch.Tensor, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and covariance (float64) of all 2x2xC patches, accumulated in chunks to bound memory (default: 500
    images on a CPU; on a GPU 5,000, a few launches in all)."""
    chunk = chunk or (5000 if images.device.type == "cuda" else 500)
    dim = images.shape[1] * PATCH * PATCH
    total = torch.zeros(dim, dtype=torch.float64, device=images.device)
    outer = torch.zeros(dim, dim, dtype=torch.float64, device=images.device)
    count = 0
    for batch in images.split(chunk):
        patches = patches_2x2(batch.float()).double()
        total += patches.sum(0)
        outer += patches.T @ patches
        count += patches.shape[0]
    mean = total / count
    return mean, outer / count - torch.outer(mean, mean)


def whitening_filters(cov: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows v_i / sqrt(lambda_i + eps) for the covariance's eigenpairs, largest eigenvalue first. The 12 x 12
    eigendecomposition runs on the CPU: microseconds there, where a GPU's solver costs a library start-up and
    several synchronising launches."""
    eigvals, eigvecs = torch.linalg.eigh(cov.cpu())
    eigvals, eigvecs = eigvals.flip(0).clamp_min(0), eigvecs.flip(1)
    return (eigvecs.T / torch.sqrt(eigvals + eps)[:, None]).to(cov.device)


class AirbenchNet(nn.Module):
    """The airbench94 network; call :meth:`data_init` with training images before training."""

    def __init__(
        self,
        num_classes: int = 10,
        widths: Sequence[int] = (64, 256, 256),
        bn_momentum: float = 0.4,
        whiten_eps: float = 5e-4,
        output_scale: float | None = 1 / 9,
        bias_epochs: float = 0.0,
        act: type[nn.Module] = nn.GELU,
        pool: str = "max",
    ) -> None:
        """``output_scale`` None: unit-std head, logits / width (airbench94_muon); ``bias_epochs`` > 0: the
        whitening bias trains for that many epochs (see ``train_until``); ``pool``: the groups' (``POOLS``)."""
        super().__init__()
        self.whiten_eps = whiten_eps
        dim = 3 * PATCH * PATCH
        self.whiten = nn.Conv2d(3, 2 * dim, PATCH, bias=True)
        self._set_whitening(torch.eye(dim, dtype=torch.float64), torch.zeros(dim, dtype=torch.float64))
        self.whiten.requires_grad_(False)
        self.train_until = {"whiten.bias": bias_epochs} if bias_epochs > 0 else {}
        assert self.whiten.bias is not None  # built with bias=True
        self.whiten.bias.requires_grad_(bias_epochs > 0)
        self.act = act()
        c_ins = (2 * dim, *widths[:-1])
        self.groups = nn.Sequential(*[ConvGroup(a, b, bn_momentum, act, pool) for a, b in zip(c_ins, widths)])
        self.pool = nn.MaxPool2d(3)
        self.fc = nn.Linear(widths[-1], num_classes, bias=False)
        self.scale = output_scale if output_scale is not None else 1 / widths[-1]
        if output_scale is None:
            with torch.no_grad():
                self.fc.weight.div_(self.fc.weight.std())

    @torch.no_grad()
    def _set_whitening(self, filters: torch.Tensor, mean: torch.Tensor) -> None:
        """Load filters W (12 x 12) and their negations, with bias -W @ mean so the output is centred."""
        weight = torch.cat([filters, -filters])
        bias = -(weight @ mean)
        self.whiten.weight.copy_(weight.reshape(self.whiten.weight.shape))
        assert self.whiten.bias is not None  # built with bias=True
        self.whiten.bias.copy_(bias)

    @torch.no_grad()
    def data_init(self, images: torch.Tensor) -> None:
        """Fit the frozen whitening conv to a normalised NCHW batch of training images (e.g. 5,000).

        The 2x2 patch covariance's eigenvectors, scaled by 1/sqrt(eigenvalue + eps), decorrelate the input so the
        first layer starts from unit-variance, uncorrelated features; that is most of airbench's fast start.
        """
        mean, cov = patch_moments(images.to(self.whiten.weight.device))
        self._set_whitening(whitening_filters(cov, self.whiten_eps), mean)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.groups(self.act(self.whiten(x)))
        x = torch.flatten(self.pool(x), 1)
        return self.fc(x) * self.scale


@register_model(
    "airbench",
    input_size=32,
    description="airbench94-style net with frozen patch whitening (1.97 M trainable params)",
    data_init_images=5000,
    recipe="airbench-sgd",
)
def airbench(
    num_classes: int = 10, widths: Sequence[int] = (64, 256, 256), bn_momentum: float = 0.4, whiten_eps: float = 5e-4
) -> nn.Module:
    """airbench94 net for time-to-94% runs; needs ``data_init(images)`` before training (see module docstring)."""
    return AirbenchNet(num_classes, widths=widths, bn_momentum=bn_momentum, whiten_eps=whiten_eps)


@register_model(
    "airbench94",
    input_size=32,
    description="airbench94_muon's net: unit-std head, logits / 256, whitening bias trained 3 epochs",
    data_init_images=5000,
    recipe="airbench94",
)
def airbench94(
    num_classes: int = 10, widths: Sequence[int] = (64, 256, 256), bn_momentum: float = 0.4, pool: str = "max"
) -> nn.Module:
    """The airbench94_muon net; with its recipe, 94% on CIFAR-10 in 8 epochs (see module docstring). Its pooling is
    the reference's by default; ``pool="triton"`` as ``speedrun94``'s."""
    return AirbenchNet(
        num_classes, widths=widths, bn_momentum=bn_momentum, output_scale=None, bias_epochs=3.0, pool=pool
    )


@register_model(
    "speedrun94",
    input_size=32,
    description="the airbench94 net with SiLU activations, for the speedrun94 recipe",
    data_init_images=5000,
    recipe="speedrun94",
)
def speedrun94(
    num_classes: int = 10, widths: Sequence[int] = (64, 256, 256), bn_momentum: float = 0.4, pool: str = "triton"
) -> nn.Module:
    """airbench94 with SiLU in place of GELU (cheaper, as the 2025 CIFAR-10 speed record uses), its pooling
    through trainscale's Triton kernels inside a compiled step on a GPU (7.6% off a steady epoch on an H200;
    ``max_pool2d`` itself everywhere else, so CPU and eager runs are unchanged)."""
    return AirbenchNet(
        num_classes,
        widths=widths,
        bn_momentum=bn_momentum,
        output_scale=None,
        bias_epochs=3.0,
        act=nn.SiLU,
        pool=pool,
    )
