"""torch.optim's adaptive optimizers by name: AdamW, Adam, NAdam, RAdam and Adafactor.

Each takes the groups' lr and weight decay (``--lr``, ``--weight-decay``) and its own keywords through
``--optim-arg`` (``betas=0.9,0.95``, ``eps=1e-8``, ``decoupled_weight_decay=true``...). Their default lr
and weight decay (used when the recipe was written for another optimizer) are the common ones for each.
"""

from __future__ import annotations

from typing import Any

import torch

from trainscale.config import OptimConfig
from trainscale.train.optim.registry import register_optimizer


def _make(cls: Any) -> Any:
    def factory(groups: list[dict[str, Any]], cfg: OptimConfig, args: dict[str, Any]) -> torch.optim.Optimizer:
        return cls(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, **args)

    return factory


register_optimizer("adamw", accepts=torch.optim.AdamW, lr=1e-3, weight_decay=0.05)(_make(torch.optim.AdamW))
register_optimizer("adam", accepts=torch.optim.Adam, lr=1e-3, weight_decay=0.0)(_make(torch.optim.Adam))
register_optimizer("nadam", accepts=torch.optim.NAdam, lr=2e-3, weight_decay=0.0)(_make(torch.optim.NAdam))
register_optimizer("radam", accepts=torch.optim.RAdam, lr=1e-3, weight_decay=0.0)(_make(torch.optim.RAdam))
register_optimizer("adafactor", accepts=torch.optim.Adafactor, lr=1e-2, weight_decay=0.0)(_make(torch.optim.Adafactor))
