"""The shared frame of the layer-wise optimizers (LARS, LAMB): each parameter is updated on its own, with a trust
ratio computed from that parameter's weight and update, so the step is one loop over the parameters that have a
gradient and the optimizer supplies only ``_update``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class LayerwiseOptimizer(torch.optim.Optimizer):
    """An optimizer whose step is ``_update(p, group)`` for every parameter with a gradient."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError
