"""Error feedback: what compression dropped this step is added back to the next step's gradient.

Invariant (checked by the property tests): ``sent + new_residual == gradient + old_residual``, so no
gradient mass is ever lost, only delayed. That is what turns Top-k 1% on ResNet-20 from 84.8% into
91.0% and Random-k 1% from 55.4% into 88.2% in the field notes. Residuals are keyed by a stable unit
key (a parameter name, or ``"entire"``), never by DDP bucket index, which changes after DDP rebuilds
its buckets on the first iteration.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


class ErrorFeedback:
    """Residual memory, one tensor per unit key."""

    def __init__(self) -> None:
        self._residuals: dict[str, Tensor] = {}

    def compensate(self, key: str, grad: Tensor) -> Tensor:
        """``grad + residual`` as a new tensor (``grad`` itself, unmodified, before the first residual)."""
        residual = self._residuals.get(key)
        if residual is None or residual.shape != grad.shape:
            return grad
        return grad + residual.to(grad.dtype)

    def update(self, key: str, corrected: Tensor, sent: Tensor) -> Tensor:
        """Remember ``corrected - sent`` (what this rank meant to send but did not) and return it."""
        residual = corrected.detach() - sent.detach().to(corrected.dtype)
        self._residuals[key] = residual
        return residual

    def residual(self, key: str) -> Tensor | None:
        return self._residuals.get(key)

    def keys(self) -> list[str]:
        return sorted(self._residuals)

    def clear(self) -> None:
        self._residuals.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}
