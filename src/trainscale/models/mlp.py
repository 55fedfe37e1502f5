"""A small dense net for quick distributed checks.

It has no BatchNorm on purpose: with no per-batch statistics, a data-parallel step over k shards must match the
single-process step on the whole batch to floating-point accuracy, which the sync-vs-local tests rely on.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from trainscale.models.registry import register_model


@register_model(
    "mlp",
    input_size=32,
    description="flatten -> 512 -> 256 -> classes, ReLU, no BN (1.71 M params)",
    recipe="mxnet-mnist",
)
def mlp(num_classes: int = 10, hidden: Sequence[int] = (512, 256), in_features: int = 3 * 32 * 32) -> nn.Module:
    """Flatten, then Linear+ReLU for each width in ``hidden``, then a Linear to ``num_classes``."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU(inplace=True)]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
