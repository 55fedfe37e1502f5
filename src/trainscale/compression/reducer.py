"""One entry point for a training loop: ``make_reducer(model, method, granularity, ...)``.

* A ``DistributedDataParallel`` model gets the compression comm hook registered; DDP then averages
  (compressed) during ``backward()`` and ``reducer.reduce()`` is a no-op.
* Any other module (a single process, a loop that runs ``backward()`` under ``ddp.no_sync()``, or a
  parameter-server worker) gets a manual reducer: call ``reducer.reduce()`` after ``backward()`` and
  it replaces every ``.grad`` with the average over ranks, compressed the same way.

Either way ``reducer.stats`` holds the measured bytes and times, ``reducer.set_epoch(e)`` drives the
warm-ups, and ``state_dict()``/``load_state_dict()`` carry residuals and the step across a resume.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from trainscale.compression.base import Compressor, create_compressor
from trainscale.compression.collectives import Carrier
from trainscale.compression.ddp_hook import ENTIRE_KEY, CompressionHookState, compression_hook, unwrap
from trainscale.compression.exchange import DEFAULT_DENSE_BELOW
from trainscale.compression.stats import CompressionStats


class Reducer:
    """Common face of the hook and manual reducers (see module docstring)."""

    def __init__(self, state: CompressionHookState) -> None:
        self.state = state

    @property
    def stats(self) -> CompressionStats:
        return self.state.stats

    @property
    def compressor(self) -> Compressor:
        return self.state.compressor

    def reduce(self) -> None:
        """Call after ``backward()``; averages gradients over ranks unless DDP's hook already did."""

    def set_epoch(self, epoch: int) -> None:
        self.state.set_epoch(epoch)

    def summary(self) -> dict[str, Any]:
        return self.stats.summary()

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)


class HookReducer(Reducer):
    """Registers ``compression_hook`` on a DDP model (DDP allows one hook per model)."""

    def __init__(self, ddp_model: DistributedDataParallel, state: CompressionHookState) -> None:
        super().__init__(state)
        ddp_model.register_comm_hook(state, compression_hook)


class ManualReducer(Reducer):
    """Averages ``.grad`` of every trainable parameter after ``backward()``, outside DDP.

    A parameter without a gradient this step (unused branch, frozen by mistake) counts as zeros, so
    every rank exchanges the same units and no collective can be left waiting.
    """

    def __init__(self, model: nn.Module, state: CompressionHookState) -> None:
        super().__init__(state)
        self.params = [(name, p) for name, p in unwrap(model).named_parameters() if p.requires_grad]

    def _grads(self) -> list[Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.params]

    def reduce(self) -> None:
        out = self.state.reduce_params([(p, g) for (_, p), g in zip(self.params, self._grads())])
        for (_, p), avg in zip(self.params, out):
            if p.grad is None:
                p.grad = avg.view_as(p).to(p.dtype)
            elif avg.data_ptr() == p.grad.data_ptr():
                continue  # a world of one without compression: the gradient is its own average
            else:
                p.grad.copy_(avg.view_as(p))  # keeps DDP's bucket views intact under no_sync()
        self.state.end_step()


def make_reducer(
    model: nn.Module,
    method: str | Compressor = "none",
    granularity: str = "layerwise",
    *,
    error_feedback: bool = False,
    warmup_steps: int = 0,
    warmup_epochs: int = 0,
    group: Carrier = None,
    dense_below: int = DEFAULT_DENSE_BELOW,
    **params: Any,
) -> Reducer:
    """A reducer for ``model``: hook-based for a DDP model, manual (call ``.reduce()``) otherwise.

    ``method`` is a registry name (``params`` go to ``create_compressor``) or a ready compressor;
    ``dense_below``: see ``CompressionHookState`` (0: every tensor compressed).
    """
    compressor = method if isinstance(method, Compressor) else create_compressor(method, **params)
    state = CompressionHookState(
        compressor,
        granularity,
        model=model,
        error_feedback=error_feedback,
        warmup_steps=warmup_steps,
        warmup_epochs=warmup_epochs,
        group=group,
        dense_below=dense_below,
    )
    if isinstance(model, DistributedDataParallel):
        return HookReducer(model, state)
    return ManualReducer(model, state)


__all__ = ["ENTIRE_KEY", "HookReducer", "ManualReducer", "Reducer", "make_reducer"]
