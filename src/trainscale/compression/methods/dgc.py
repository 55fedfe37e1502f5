"""Deep Gradient Compression (Lin et al. 2018): Top-k with momentum correction and a sparsity warm-up.

State per unit key (a parameter name, or ``"entire"``):

* ``u``, the local momentum: ``u = momentum * u + g``. DGC applies momentum *before* sparsifying, so
  the optimizer must run without its own momentum (``replaces_optimizer_momentum``).
* ``v``, the local accumulator: ``v = v + u``; the top-k of |v| are sent, and both ``v`` and ``u`` are
  zeroed where they were sent (momentum factor masking), so stale momentum does not push a
  coordinate twice. ``v`` is DGC's own error feedback, so the generic one is never added on top.

Sparsity warm-up: density starts at ``initial_density`` (25%) and decays exponentially, once per
epoch, to ``ratio`` after ``sparsity_warmup_epochs`` (for 0.1% over 4 epochs: 25%, 6.3%, 1.6%, 0.4%,
0.1%, the paper's schedule).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from trainscale.compression.base import Payload, UnitContext, check_ratio, register_compressor
from trainscale.compression.methods.sparse import _Sparse, count_for, top_magnitudes
from trainscale.errors import ConfigError


@register_compressor
class DGC(_Sparse):
    name: ClassVar[str] = "dgc"
    feedback: ClassVar[str] = "internal"
    replaces_optimizer_momentum: ClassVar[bool] = True

    def __init__(
        self,
        ratio: float = 0.001,
        momentum: float = 0.9,
        sparsity_warmup_epochs: int = 4,
        initial_density: float = 0.25,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        self.ratio = check_ratio(ratio)
        self.momentum = float(momentum)
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"DGC momentum must be in [0, 1), got {momentum}")
        self.warmup_epochs = int(sparsity_warmup_epochs)
        self.initial_density = max(self.ratio, check_ratio(initial_density, "initial-density"))
        self._u: dict[str, Tensor] = {}
        self._v: dict[str, Tensor] = {}

    def density(self, epoch: int) -> float:
        """Kept share in ``epoch`` (0-based): exponential from ``initial_density`` to ``ratio``."""
        if epoch >= self.warmup_epochs or self.warmup_epochs <= 0:
            return self.ratio
        return self.initial_density * (self.ratio / self.initial_density) ** (epoch / self.warmup_epochs)

    def _state(self, key: str, flat: Tensor) -> tuple[Tensor, Tensor]:
        u, v = self._u.get(key), self._v.get(key)
        if u is None or u.shape != flat.shape:
            u, v = torch.zeros_like(flat), torch.zeros_like(flat)
            self._u[key], self._v[key] = u, v
        assert v is not None
        return u, v

    def encode(self, x: Tensor, ctx: UnitContext) -> Payload:
        flat = x.reshape(-1)
        u, v = self._state(ctx.key, flat)
        u.mul_(self.momentum).add_(flat)
        v.add_(u)
        k = count_for(flat.numel(), self.density(ctx.epoch))
        indices = top_magnitudes(v, k)
        payload = self.sparse_payload(v.view(x.shape), indices, ctx)  # values are copied out of v here
        v[indices] = 0
        u[indices] = 0
        return payload

    def theoretical_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        return 8.0 * numel * self.ratio

    def state_dict(self) -> dict[str, Any]:
        return {"u": {k: t.clone() for k, t in self._u.items()}, "v": {k: t.clone() for k, t in self._v.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._u = {k: t.clone() for k, t in state.get("u", {}).items()}
        self._v = {k: t.clone() for k, t in state.get("v", {}).items()}

    def describe(self) -> str:
        return f"dgc(ratio={self.ratio}, momentum={self.momentum}, sparsity_warmup_epochs={self.warmup_epochs})"
