"""LAMB, layer-wise adaptive moments (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT
in 76 minutes", Algorithm 2), for the large global batches of scaling studies.

Per parameter tensor (a "layer") w with gradient g, step t, betas (b1, b2), weight decay lambda, lr eta::

    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
    r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    u = r + lambda w
    w = w - eta * ||w|| / ||u|| * u                      (the ratio is 1 where ||w|| or ||u|| is 0)

(phi, the paper's scaling function of ||w||, is the identity, as in its experiments.) A group with
``trust_ratio=False`` (biases and normalisation weights under ``--no-decay-norm-bias``) takes the Adam step u
unscaled. Norms and ratio stay on the device.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainscale.config import OptimConfig
from trainscale.train.optim.layerwise import LayerwiseOptimizer
from trainscale.train.optim.registry import register_optimizer


class LAMB(LayerwiseOptimizer):
    """See the module docstring."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        betas = tuple(betas)  # type: ignore[assignment]
        if lr < 0 or len(betas) != 2 or not all(0 <= b < 1 for b in betas) or eps < 0 or weight_decay < 0:
            raise ValueError(
                f"LAMB needs lr >= 0, two betas in [0, 1), eps >= 0 and weight_decay >= 0; got lr={lr}, "
                f"betas={betas}, eps={eps}, weight_decay={weight_decay}"
            )
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        assert p.grad is not None
        g, (b1, b2), state = p.grad, group["betas"], self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        update = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt_().add_(group["eps"]))
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        scale = trust_ratio(p, update) * group["lr"] if group.get("trust_ratio", True) else group["lr"]
        p.sub_(update.mul_(scale))


def trust_ratio(w: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """LAMB's ratio ||w|| / ||u||, 1 where either norm is 0 (a 0-d tensor)."""
    w_norm, u_norm = w.norm(), update.norm()
    return torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp_min(math.ulp(0.0)), torch.ones_like(w_norm))


@register_optimizer("lamb", accepts=("betas", "eps"), lr=1e-2, weight_decay=0.01)
def lamb(groups: list[dict[str, Any]], cfg: OptimConfig, args: dict[str, Any]) -> torch.optim.Optimizer:
    return LAMB(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, **args)
