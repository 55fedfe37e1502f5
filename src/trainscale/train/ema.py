"""An exponential moving average of the weights (``--ema DECAY``), kept beside the model, evaluated and checkpointed.

The average is a ``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn(decay)``, over parameters and
buffers (BatchNorm's running statistics too, so the averaged model evaluates as it is). The first update copies
the model (``AveragedModel.update_parameters``); later ones call the same EMA function directly on the cached
tensor lists: ``update_parameters`` reads its step counter on the host and copies it to the device every step,
which on a GPU would wait for the queued work, and the EMA function does not use the counter. The counter is
kept on the host and written into the averaged model's ``n_averaged`` buffer for checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from trainscale.runtime.dist import average_in_place


class WeightAverage:
    """The EMA of ``model``'s parameters and buffers with ``decay`` (the weight of the old average per step)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.source = model
        self.averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.ema = get_ema_multi_avg_fn(decay)
        self.count = 0
        self._lists: tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]] | None
        self._lists = None

    @property
    def module(self) -> nn.Module:
        """The averaged network, to evaluate."""
        return self.averaged.module

    @torch.no_grad()
    def update(self) -> None:
        """Fold the model's current weights in (after each optimizer step)."""
        if self.count == 0:
            self.averaged.update_parameters(self.source)
        else:
            floats, sources, others = self._tensor_lists()
            self.ema(floats, sources, None)
            for mine, theirs in others:  # integer buffers (BatchNorm's batch counter): the model's own
                mine.copy_(theirs)
        self.count += 1

    def _tensor_lists(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        if self._lists is None:
            mine = [*self.module.parameters(), *self.module.buffers()]
            theirs = [*self.source.parameters(), *self.source.buffers()]
            pairs = [(a.detach(), b.detach()) for a, b in zip(mine, theirs, strict=True)]
            floats = [(a, b) for a, b in pairs if a.is_floating_point()]
            self._lists = (
                [a for a, _ in floats],
                [b for _, b in floats],
                [p for p in pairs if not p[0].is_floating_point()],
            )
        return self._lists

    def average_over_ranks(self) -> None:
        """The averaged buffers' mean over ranks (each worker's BatchNorm statistics differ, as the model's do
        until its epoch-end average), so every rank evaluates the same average; a no-op on one process."""
        average_in_place([b for b in self.module.buffers() if b.is_floating_point()])

    def state_dict(self) -> dict[str, Any]:
        self.averaged.n_averaged.fill_(self.count)
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.averaged.load_state_dict(state)
        self.count = int(self.averaged.n_averaged)
