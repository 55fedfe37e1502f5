"""Compression as a standard DDP communication hook, for trainscale's trainer and for your own loop::

    compressor = create_compressor("topk", ratio=0.01)
    state = CompressionHookState(compressor, "layerwise", model=ddp_model, error_feedback=True)
    ddp_model.register_comm_hook(state, compression_hook)

DDP calls the hook once per gradient bucket with the *local* gradients; the hook returns a future of
the bucket-sized averaged tensor. Layerwise: each parameter of the bucket is a unit with its own k,
scale or norm (``bucket.parameters()``/``bucket.gradients()``), keyed by parameter name because
``bucket.index()`` changes when DDP rebuilds its buckets after the first iteration. The hook encodes
at once and returns the collective's future, decoding when it lands, so a bucket's exchange overlaps
the backward pass of the buckets after it, as DDP's own all-reduce does (PowerSGD, whose second
all-reduce needs the first one's result, completes inside the hook).

Entire model: every gradient must be one vector, but DDP may split the model into several buckets
(25 MiB each by default, plus a 1 MiB first bucket). The hook therefore does not rely on one bucket:
it holds each bucket's future open until the last bucket arrives (``bucket.is_last()``; DDP launches
buckets strictly in index order), concatenates all gradients in the model's parameter order (stable
across the bucket rebuild), compresses that one vector, and completes every bucket's future from it.
``ddp_kwargs_for("entire", model)`` asks DDP for a single bucket anyway, which saves the bookkeeping
(in torch 2.13 an explicit ``bucket_cap_mb`` also sizes the first bucket).
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook inspects the hook's real
# annotations and rejects the strings that import would turn them into.
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainscale.compression.base import Compressor
from trainscale.compression.collectives import Carrier
from trainscale.compression.exchange import DEFAULT_DENSE_BELOW, Exchange
from trainscale.compression.stats import CompressionStats
from trainscale.errors import ConfigError
from trainscale.runtime.comm_hooks import OverlapClock

GRANULARITIES = ("layerwise", "entire")
GRANULARITY_ALIASES = {
    "entiremodel": "entire",
    "entire-model": "entire",
    "entire_model": "entire",
    "layer": "layerwise",
    "layer-wise": "layerwise",
}
ENTIRE_KEY = "entire"


def canonical_granularity(value: str) -> str:
    """``layerwise`` or ``entire`` (or the layer-wise study's ``entiremodel``); anything else is a ConfigError."""
    name = GRANULARITY_ALIASES.get(value.strip().lower(), value.strip().lower())
    if name not in GRANULARITIES:
        raise ConfigError(f"unknown granularity '{value}'; choose one of: layerwise, entire (alias entiremodel)")
    return name


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


class ParamKeys:
    """A stable name and canonical position per parameter, equal on every rank.

    From ``model.named_parameters()`` when a model is given; otherwise positions are assigned on first
    sight, which is also rank-consistent (DDP presents buckets in the same order on every rank).
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self._by_id: dict[int, tuple[int, str]] = {}
        if model is not None:
            for i, (name, p) in enumerate(unwrap(model).named_parameters()):
                self._by_id[id(p)] = (i, name)

    def lookup(self, param: Tensor) -> tuple[int, str]:
        if id(param) not in self._by_id:
            n = len(self._by_id)
            self._by_id[id(param)] = (n, f"param{n}")
        return self._by_id[id(param)]

    def name(self, param: Tensor) -> str:
        return self.lookup(param)[1]


@dataclass
class StepClock:
    """Step and epoch as every rank sees them; dense (uncompressed) exchange until the warm-up ends."""

    warmup_steps: int = 0
    warmup_epochs: int = 0
    step: int = 0
    epoch: int = 0

    def dense(self) -> bool:
        return self.step < self.warmup_steps or self.epoch < self.warmup_epochs


@dataclass
class _Pending:
    """One bucket waiting for the last bucket of the step (entire-model granularity)."""

    params: list[Tensor]
    grads: list[Tensor]
    dtype: torch.dtype
    future: torch.futures.Future = field(default_factory=torch.futures.Future)


class CompressionHookState:
    """What the hook keeps between calls: the exchange (with error-feedback residuals and byte
    counts), the step clock for shared seeds and warm-ups, and parameter names for keying state.

    Call ``set_epoch(epoch)`` at the start of every epoch when using ``warmup_epochs`` or DGC.
    ``dense_below``: layerwise, a sparsifier's tensors under this many elements and its 1-D tensors are sent dense
    (``Exchange``; 0: every tensor compressed, the method as published); the whole-model vector never is.
    """

    def __init__(
        self,
        compressor: Compressor,
        granularity: str = "layerwise",
        *,
        model: nn.Module | None = None,
        error_feedback: bool = False,
        warmup_steps: int = 0,
        warmup_epochs: int = 0,
        stats: CompressionStats | None = None,
        group: Carrier = None,
        dense_below: int = DEFAULT_DENSE_BELOW,
    ) -> None:
        self.granularity = canonical_granularity(granularity)
        stats = stats or CompressionStats(method=compressor.name, granularity=self.granularity)
        self.clock = OverlapClock(stats)
        self.exchange = Exchange(
            compressor,
            error_feedback=error_feedback,
            stats=stats,
            group=group,
            clock=self.clock,
            dense_below=dense_below if self.granularity == "layerwise" else 0,
        )
        self.keys = ParamKeys(model)
        self.steps = StepClock(int(warmup_steps), int(warmup_epochs))
        self.pending: list[_Pending] = []
        self.buckets_this_step = 0
        self.buckets_last_step = 0  # how many buckets DDP handed over in the last full step

    @property
    def stats(self) -> CompressionStats:
        return self.exchange.stats

    @property
    def compressor(self) -> Compressor:
        return self.exchange.compressor

    def set_epoch(self, epoch: int) -> None:
        self.steps.epoch = int(epoch)

    def reduce(self, units: list[tuple[str, Tensor]]) -> list[Tensor]:
        """Average ``(key, gradient)`` units over ranks at the current step (compressed or warm-up dense)."""
        return self.reduce_async(units).wait()

    def reduce_async(self, units: list[tuple[str, Tensor]]) -> torch.futures.Future:
        """:meth:`reduce`, launched: encoded now, a future of the averages (see ``Exchange.reduce_async``)."""
        return self.exchange.reduce_async(units, self.steps.step, self.steps.epoch, dense=self.steps.dense())

    def end_step(self) -> None:
        self.buckets_last_step, self.buckets_this_step = self.buckets_this_step, 0
        self.stats.steps += 1
        self.stats.dense_steps += int(self.steps.dense())
        self.steps.step += 1

    def reduce_params(self, items: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        """Average (parameter, gradient) pairs at this state's granularity: each under its parameter's name, or
        all as one vector; results come back in the order given."""
        if self.granularity == "entire":
            return self.reduce_entire(items)
        return self.reduce([(self.keys.name(p), g) for p, g in items])

    def reduce_entire(self, items: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        """Average (parameter, gradient) pairs as ONE vector in canonical parameter order; results come
        back in the order given."""
        order = sorted(range(len(items)), key=lambda i: self.keys.lookup(items[i][0])[0])
        flat = torch.cat([items[i][1].reshape(-1) for i in order]) if items else torch.zeros(0)
        [avg] = self.reduce([(ENTIRE_KEY, flat)])
        parts = avg.split([items[i][1].numel() for i in order])
        out: list[Tensor] = [torch.empty(0)] * len(items)
        for i, part in zip(order, parts):
            out[i] = part.view_as(items[i][1])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.steps.step, "epoch": self.steps.epoch, "exchange": self.exchange.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps.step, self.steps.epoch = int(state["step"]), int(state["epoch"])
        self.exchange.load_state_dict(state["exchange"])


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: ``ddp_model.register_comm_hook(state, compression_hook)``."""
    state.buckets_this_step += 1
    if state.granularity == "entire":
        return _entire_hook(state, bucket)
    params, grads = bucket.parameters(), bucket.gradients()
    future = state.reduce_async([(state.keys.name(p), g) for p, g in zip(params, grads)])
    if bucket.is_last():
        state.end_step()
    dtype = bucket.buffer().dtype
    return future.then(lambda averaged: _bucket_tensor(averaged.value(), dtype))


def _entire_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    pending = _Pending(list(bucket.parameters()), list(bucket.gradients()), bucket.buffer().dtype)
    state.pending.append(pending)
    if bucket.is_last():
        _flush_entire(state)
    return pending.future


def _flush_entire(state: CompressionHookState) -> None:
    waiting, state.pending = state.pending, []
    items = [(p, g) for w in waiting for p, g in zip(w.params, w.grads)]
    averaged = iter(state.reduce_entire(items))
    for w in waiting:
        w.future.set_result(_bucket_tensor([next(averaged) for _ in w.params], w.dtype))
    state.end_step()


def _bucket_tensor(parts: list[Tensor], dtype: torch.dtype) -> Tensor:
    """The flat bucket DDP expects: the per-parameter results concatenated in bucket order."""
    return torch.cat([p.reshape(-1) for p in parts]).to(dtype)


def ddp_kwargs_for(granularity: str, model: nn.Module | None = None) -> dict[str, Any]:
    """Extra ``DistributedDataParallel`` keywords: for ``entire``, a ``bucket_cap_mb`` above the model's
    gradient size so DDP makes one bucket (the hook is correct with several, just busier)."""
    if canonical_granularity(granularity) != "entire":
        return {}
    nbytes = sum(p.numel() * p.element_size() for p in unwrap(model).parameters()) if model is not None else 0
    return {"bucket_cap_mb": max(25, math.ceil(nbytes / 2**20) + 1)}
