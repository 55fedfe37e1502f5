"""BatchNorm state that data-parallel workers keep alike: which buffers, and their mean over the workers."""

from __future__ import annotations

import torch
from torch import nn

from trainscale.runtime.dist import average_in_place


def bn_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Every BatchNorm layer's running mean and variance (where it tracks them) and its step counter."""
    out: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
            out += [b for b in (module.running_mean, module.running_var, module.num_batches_tracked) if b is not None]
    return out


def bn_running_stats(model: nn.Module) -> list[torch.Tensor]:
    """The running mean/var buffers of every BatchNorm layer that tracks them."""
    return [b for b in bn_buffers(model) if b.is_floating_point()]


@torch.no_grad()
def average_bn_statistics(model: nn.Module) -> None:
    """Replace each worker's BN running statistics by their mean over workers (one all-reduce)."""
    average_in_place(bn_running_stats(model))
