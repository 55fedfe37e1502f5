"""Sparsifiers: Random-k (shared seed, values only), Top-k and Threshold-v (values + int32 indices).

The layer-wise study simulated these by all-reducing dense tensors full of zeros. Here only the kept
elements travel: Random-k draws the same indices on every rank from a dedicated generator seeded by
(seed, step, unit key), so the indices never travel and the values can be all-reduced; Top-k and
Threshold-v keep different indices per rank, so (values, indices) are all-gathered and scatter-added.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from trainscale.compression.base import (
    Compressor,
    Payload,
    UnitContext,
    check_ratio,
    register_compressor,
    stable_seed,
)
from trainscale.errors import ConfigError

INDEX_DTYPE = torch.int32


def count_for(numel: int, ratio: float) -> int:
    """Elements kept at ``ratio``: at least one of a non-empty tensor, never more than all of it."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(numel * ratio - 1e-9)))


def sparse_payload(x: Tensor, indices: Tensor) -> Payload:
    flat = x.reshape(-1)
    return Payload({"values": flat[indices], "indices": indices.to(INDEX_DTYPE)}, tuple(x.shape), x.dtype,
                   selected=int(indices.numel()))


def scatter(payload: Payload, out: Tensor | None = None) -> Tensor:
    """Add a (values, indices) payload into ``out`` (zeros of the payload's size when ``None``)."""
    if out is None:
        out = torch.zeros(payload.numel, dtype=payload.dtype, device=payload.tensors["values"].device)
    out.index_add_(0, payload.tensors["indices"].long(), payload.tensors["values"].to(out.dtype))
    return out


class _Sparse(Compressor):
    """Shared (values, indices) decode and scatter-add combine."""

    def decode(self, payload: Payload) -> Tensor:
        return scatter(payload).reshape(payload.shape)

    def combine(self, payloads: list[Payload]) -> Tensor:
        total = scatter(payloads[0])
        for p in payloads[1:]:
            scatter(p, total)
        return total.div_(len(payloads)).reshape(payloads[0].shape)


@register_compressor
class TopK(_Sparse):
    """The ``ratio`` share of largest magnitudes: fp values + int32 indices (8 bytes per kept fp32)."""

    name: ClassVar[str] = "topk"

    def __init__(self, ratio: float = 0.01, seed: int = 0) -> None:
        super().__init__(seed)
        self.ratio = check_ratio(ratio)

    def encode(self, x: Tensor, ctx: UnitContext) -> Payload:
        flat = x.reshape(-1)
        k = count_for(flat.numel(), self.ratio)
        indices = flat.abs().topk(k, sorted=False).indices if k else flat.new_zeros(0, dtype=torch.long)
        return sparse_payload(x, indices)

    def theoretical_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        return 8.0 * numel * self.ratio

    def describe(self) -> str:
        return f"topk(ratio={self.ratio})"


@register_compressor
class Threshold(_Sparse):
    """Every element with ``|g| >= threshold``. Sizes differ per rank (the exchange gathers them first)
    and may be zero; the kept share is reported as the measured density."""

    name: ClassVar[str] = "threshold"
    variable_size: ClassVar[bool] = True

    def __init__(self, threshold: float = 0.001, seed: int = 0) -> None:
        super().__init__(seed)
        self.threshold = float(threshold)
        if not self.threshold >= 0.0:
            raise ConfigError(f"--threshold must be >= 0, got {threshold}")

    def encode(self, x: Tensor, ctx: UnitContext) -> Payload:
        flat = x.reshape(-1)
        indices = (flat.abs() >= self.threshold).nonzero().reshape(-1)
        return sparse_payload(x, indices)

    def theoretical_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        return float("nan")  # depends on the data: the measured density says

    def describe(self) -> str:
        return f"threshold(v={self.threshold})"


def sample_indices(numel: int, k: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """``k`` distinct indices of ``range(numel)``, uniformly chosen, sorted (for cache-friendly gathers).

    ``randperm`` costs O(numel) (~0.3 s for ResNet9's 6.5 M on this CPU), so for small ``k`` draw with
    replacement, drop duplicates and keep a random ``k`` of the distinct draws; by symmetry every
    k-subset stays equally likely.
    """
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    if 4 * k >= numel:
        return torch.randperm(numel, generator=generator, device=device)[:k].sort().values
    draws = k + k * k // numel + 16
    while True:
        distinct = torch.randint(numel, (draws,), generator=generator, device=device).unique()
        if distinct.numel() >= k:
            pick = torch.randperm(distinct.numel(), generator=generator, device=device)[:k]
            return distinct[pick].sort().values
        draws *= 2


@register_compressor
class RandomK(Compressor):
    """``ratio`` of the elements at indices every rank draws alike, so only the values travel (4 bytes
    per kept fp32) and they are summed by an all-reduce. ``unbiased`` scales by n/k on decode."""

    name: ClassVar[str] = "randomk"
    aggregation: ClassVar[str] = "allreduce"

    def __init__(self, ratio: float = 0.01, unbiased: bool = False, seed: int = 0) -> None:
        super().__init__(seed)
        self.ratio = check_ratio(ratio)
        self.unbiased = bool(unbiased)

    def indices(self, numel: int, ctx: UnitContext, device: torch.device) -> Tensor:
        """The indices for this (seed, step, key): a fresh generator each call, never the global RNG."""
        gen = torch.Generator(device=device)
        gen.manual_seed(stable_seed(self.seed, "randomk", ctx.step, ctx.key))
        return sample_indices(numel, count_for(numel, self.ratio), gen, device)

    def encode(self, x: Tensor, ctx: UnitContext) -> Payload:
        flat = x.reshape(-1)
        indices = self.indices(flat.numel(), ctx, x.device)
        meta: dict[str, Any] = {"ctx": ctx, "indices": indices}
        return Payload({"values": flat[indices]}, tuple(x.shape), x.dtype, meta, selected=int(indices.numel()))

    def decode(self, payload: Payload) -> Tensor:
        values = payload.tensors["values"]
        indices = payload.meta.get("indices")
        if indices is None:  # a receiver without the sender's cache recomputes them from the context
            indices = self.indices(payload.numel, payload.meta["ctx"], values.device)
        out = torch.zeros(payload.numel, dtype=payload.dtype, device=values.device)
        scale = payload.numel / max(1, indices.numel()) if self.unbiased else 1.0
        out[indices] = values.to(payload.dtype) * scale if scale != 1.0 else values.to(payload.dtype)
        return out.reshape(payload.shape)

    def theoretical_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        return 4.0 * numel * self.ratio

    def describe(self) -> str:
        return f"randomk(ratio={self.ratio}, unbiased={self.unbiased})"
