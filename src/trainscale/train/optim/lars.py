"""LARS, layer-wise adaptive rate scaling (You, Gitman and Ginsburg 2017, "Large Batch Training of Convolutional
Networks", Algorithm 1), for the large global batches of scaling studies.

Per parameter tensor (a "layer") w with gradient g, weight decay beta, momentum m, global lr gamma and trust
coefficient eta::

    local_lr = eta * ||w|| / (||g|| + beta * ||w||)      (1 where ||w|| or ||g|| is 0)
    v = m * v + gamma * local_lr * (g + beta * w)
    w = w - v

A group with ``trust_ratio=False`` (biases and normalisation weights under ``--no-decay-norm-bias``, as LARS users
keep them) takes plain momentum SGD: local_lr = 1. The norms and the ratio stay on the device (no host sync).
"""

from __future__ import annotations

from typing import Any

import torch

from trainscale.config import OptimConfig
from trainscale.train.optim.layerwise import LayerwiseOptimizer
from trainscale.train.optim.registry import register_optimizer


class LARS(LayerwiseOptimizer):
    """See the module docstring. ``eta``: the trust coefficient (the paper's 0.001)."""

    def __init__(
        self,
        params: Any,
        lr: float = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        eps: float = 0.0,
    ) -> None:
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or eta <= 0 or eps < 0:
            raise ValueError(
                f"LARS needs lr >= 0, momentum in [0, 1), weight_decay >= 0, eta > 0 and eps >= 0; got lr={lr}, "
                f"momentum={momentum}, weight_decay={weight_decay}, eta={eta}, eps={eps}"
            )
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, eps=eps))

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        assert p.grad is not None
        g, decay = p.grad, group["weight_decay"]
        local = trust_ratio(p, g, group["eta"], decay, group["eps"]) if group.get("trust_ratio", True) else None
        step = g.add(p, alpha=decay) if decay else g.clone()
        step.mul_(group["lr"] if local is None else local * group["lr"])
        buffer = self.state[p].get("momentum_buffer")
        if buffer is None:
            buffer = self.state[p]["momentum_buffer"] = step
        else:
            buffer.mul_(group["momentum"]).add_(step)
        p.sub_(buffer)


def trust_ratio(w: torch.Tensor, g: torch.Tensor, eta: float, decay: float, eps: float) -> torch.Tensor:
    """LARS's local lr: eta ||w|| / (||g|| + decay ||w|| + eps), 1 where either norm is 0 (a 0-d tensor)."""
    w_norm, g_norm = w.norm(), g.norm()
    ratio = eta * w_norm / (g_norm + decay * w_norm + eps)
    return torch.where((w_norm > 0) & (g_norm > 0), ratio, torch.ones_like(ratio))


@register_optimizer("lars", accepts=("eta", "eps"), reads=("momentum",), lr=1.0, weight_decay=5e-4)
def lars(groups: list[dict[str, Any]], cfg: OptimConfig, args: dict[str, Any]) -> torch.optim.Optimizer:
    return LARS(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **args)
