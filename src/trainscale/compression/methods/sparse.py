"""Sparsifiers: Random-k (shared seed, values only), Top-k and Threshold-v (values + int32 indices).

The layer-wise study simulated these by all-reducing dense tensors full of zeros. Here only the kept
elements travel: Random-k draws the same indices on every rank from a dedicated generator seeded by
(seed, step, unit key), so the indices never travel and the values can be all-reduced; Top-k and
Threshold-v keep different indices per rank, so (values, indices) are all-gathered and scatter-added.

Values plus int32 indices cost ``k * (b + 4)`` bytes for ``b``-byte values, which passes the dense
``n * b`` at high densities (Threshold-v at 95% of ResNet9's gradients would send 1.9x dense). So every
(values, indices) payload takes the cheapest of three encodings of the same kept set, chosen from
``k`` and ``n`` alone (so all ranks of a fixed-``k`` method agree without talking):

* ``indices``: ``k`` values + ``k`` int32 indices, while ``k * (b + 4)`` is the least;
* ``bitmap``: ``k`` values in index order + one bit per element (``ceil(n / 8)`` bytes), from the
  break-even density ``k / n > 1/32`` (4 index bytes per kept value against n/8 bitmap bytes);
* ``dense``: all ``n`` values, zeros where nothing was kept, when even the bitmap costs more
  (``k / n > 1 - 1/(8b)``: 96.9% for fp32).

The first payload of each fallback encoding is logged (per compressor), and the exchange counts them.

A payload always carries the three tensors ``values``, ``indices``, ``bitmap`` (unused ones empty), so
ranks of a variable-size method that chose different encodings still share one layout of slot names.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

import numpy as np
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
from trainscale.compression.bitpack import pack_bits, unpack_bits
from trainscale.errors import ConfigError

INDEX_DTYPE = torch.int32
FORMATS = ("indices", "bitmap", "dense")
log = logging.getLogger("trainscale.compression")


def count_for(numel: int, ratio: float) -> int:
    """Elements kept at ``ratio``: at least one of a non-empty tensor, never more than all of it."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(numel * ratio - 1e-9)))


SAMPLED_TOPK_FROM = 1 << 15  # below this many elements one torch.topk is as fast as sampling first


def top_magnitudes(flat: Tensor, k: int) -> Tensor:
    """Positions of the ``k`` largest ``|flat|``: the set ``torch.topk`` returns (ties aside), faster.

    ``topk`` over all ``n`` elements dominates Top-k's and DGC's encode time. Here a sample of ~4,096
    elements estimates a threshold about ``2k`` elements pass, one vectorised comparison keeps those
    candidates, and ``topk`` runs on them alone. The answer never depends on the sample: every element
    of the true top ``k`` is at or above any threshold that ``k`` or more elements pass, and when fewer
    pass (an unlucky sample) the full ``topk`` runs instead. The sample comes from a generator of its
    own, never the global RNG.
    """
    n = flat.numel()
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=flat.device)
    magnitudes = flat.abs()
    if n < SAMPLED_TOPK_FROM or 8 * k > n:
        return magnitudes.topk(k, sorted=False).indices
    gen = torch.Generator(device=flat.device).manual_seed(n)
    sample = magnitudes[torch.randint(n, (4096,), generator=gen, device=flat.device)]
    rank = min(sample.numel(), math.ceil(2 * sample.numel() * k / n) + 8)
    threshold = sample.topk(rank, sorted=False).values.min()
    candidates = (magnitudes >= threshold).nonzero().reshape(-1)
    if candidates.numel() < k:
        return magnitudes.topk(k, sorted=False).indices
    return candidates[magnitudes[candidates].topk(k, sorted=False).indices]


def format_nbytes(numel: int, kept: int, value_bytes: int) -> dict[str, int]:
    """Bytes each encoding sends for ``kept`` of ``numel`` values of ``value_bytes`` bytes."""
    return {
        "indices": kept * (value_bytes + INDEX_DTYPE.itemsize),
        "bitmap": kept * value_bytes + math.ceil(numel / 8),
        "dense": numel * value_bytes,
    }


def choose_format(numel: int, kept: int, value_bytes: int) -> str:
    """The cheapest encoding; on a tie the earlier of ``indices``, ``bitmap``, ``dense``."""
    costs = format_nbytes(numel, kept, value_bytes)
    return min(FORMATS, key=lambda f: (costs[f], FORMATS.index(f)))


def sparse_payload(x: Tensor, indices: Tensor) -> Payload:
    """The kept elements ``x[indices]`` in the cheapest encoding (``meta['format']`` names it)."""
    flat = x.reshape(-1)
    n, k = flat.numel(), int(indices.numel())
    fmt = choose_format(n, k, x.element_size())
    empty_idx, empty_bits = flat.new_zeros(0, dtype=INDEX_DTYPE), flat.new_zeros(0, dtype=torch.uint8)
    if fmt == "indices":
        tensors = {"values": flat[indices], "indices": indices.to(INDEX_DTYPE), "bitmap": empty_bits}
    else:
        mask = torch.zeros(n, dtype=torch.bool, device=flat.device)
        mask[indices] = True
        if fmt == "bitmap":
            tensors = {"values": flat[mask], "indices": empty_idx, "bitmap": pack_bits(mask.view(torch.uint8), 1)}
        else:
            tensors = {
                "values": torch.where(mask, flat, flat.new_zeros(())),
                "indices": empty_idx,
                "bitmap": empty_bits,
            }
    return Payload(tensors, tuple(x.shape), x.dtype, {"format": fmt, "kept": indices}, selected=k)


def payload_format(payload: Payload) -> str:
    """Which encoding a (values, indices, bitmap) payload uses, read from its tensors alone."""
    if payload.tensors["bitmap"].numel():
        return "bitmap"
    if payload.tensors["indices"].numel():
        return "indices"
    return "dense" if payload.tensors["values"].numel() == payload.numel > 0 else "indices"


def kept_indices(payload: Payload) -> Tensor:
    """The flat positions a sparse payload carries: the sender's own (``meta['kept']``, a cache that
    never travels), else read from the encoding (ascending; for ``dense``, its non-zeros)."""
    if "kept" in payload.meta:
        return payload.meta["kept"].long()
    fmt = payload_format(payload)
    if fmt == "indices":
        return payload.tensors["indices"].long()
    if fmt == "bitmap":
        return unpack_bits(payload.tensors["bitmap"], 1, payload.numel).bool().nonzero().reshape(-1)
    return payload.tensors["values"].nonzero().reshape(-1)


def scatter(payload: Payload, out: Tensor | None = None) -> Tensor:
    """Add a sparse payload (any encoding) into ``out`` (zeros of the payload's size when ``None``)."""
    values = payload.tensors["values"]
    if out is None:
        out = torch.zeros(payload.numel, dtype=payload.dtype, device=values.device)
    fmt = payload_format(payload)
    if fmt == "indices":
        out.index_add_(0, payload.tensors["indices"].long(), values.to(out.dtype))
    elif fmt == "bitmap":
        mask = unpack_bits(payload.tensors["bitmap"], 1, payload.numel).bool()
        out[mask] += values.to(out.dtype)
    else:
        out += values.to(out.dtype)
    return out


class _Sparse(Compressor):
    """Shared encoding choice, decode and scatter-add combine."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self._fallbacks_logged: set[str] = set()

    def sparse_payload(self, x: Tensor, indices: Tensor, ctx: UnitContext) -> Payload:
        """:func:`sparse_payload`, logging the first time this compressor falls back to each encoding."""
        payload = sparse_payload(x, indices)
        fmt = payload.meta["format"]
        if fmt != "indices" and fmt not in self._fallbacks_logged:
            self._fallbacks_logged.add(fmt)
            costs = format_nbytes(payload.numel, int(indices.numel()), x.element_size())
            log.info(
                "%s: unit '%s' keeps %d of %d values (%.1f%%): sending %s (%d bytes) instead of values + "
                "indices (%d bytes); later fallbacks are counted, not logged",
                self.name,
                ctx.key,
                indices.numel(),
                payload.numel,
                100.0 * indices.numel() / max(1, payload.numel),
                "a bitmap" if fmt == "bitmap" else "dense values",
                costs[fmt],
                costs["indices"],
            )
        return payload

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
    dense_small: ClassVar[bool] = True

    def __init__(self, ratio: float = 0.01, seed: int = 0) -> None:
        super().__init__(seed)
        self.ratio = check_ratio(ratio)

    def encode(self, x: Tensor, ctx: UnitContext) -> Payload:
        flat = x.reshape(-1)
        k = count_for(flat.numel(), self.ratio)
        return self.sparse_payload(x, top_magnitudes(flat, k), ctx)

    def theoretical_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        return 8.0 * numel * self.ratio

    def describe(self) -> str:
        return f"topk(ratio={self.ratio})"


@register_compressor
class Threshold(_Sparse):
    """Every element with ``|g| >= threshold``. Sizes differ per rank (the exchange gathers them first)
    and may be zero; the kept share is reported as the measured density."""

    name: ClassVar[str] = "threshold"
    dense_small: ClassVar[bool] = True
    variable_size: ClassVar[bool] = True

    def __init__(self, threshold: float = 0.001, seed: int = 0) -> None:
        super().__init__(seed)
        self.threshold = float(threshold)
        if not self.threshold >= 0.0:
            raise ConfigError(f"--threshold must be >= 0, got {threshold}")

    def encode(self, x: Tensor, ctx: UnitContext) -> Payload:
        flat = x.reshape(-1)
        indices = (flat.abs() >= self.threshold).nonzero().reshape(-1)
        return self.sparse_payload(x, indices, ctx)

    def theoretical_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        return float("nan")  # depends on the data: the measured density says

    def describe(self) -> str:
        return f"threshold(v={self.threshold})"


def sorted_distinct(values: Tensor) -> Tensor:
    """``torch.unique(values)``: on the CPU through numpy's sort, several times faster than torch's for the
    tens of thousands of indices a layer's Random-k draws (0.12 against 1.1 ms for 23,600 on 2 cores)."""
    if values.device.type != "cpu" or values.numel() < 2:
        return torch.unique(values)
    ordered = np.sort(values.numpy())
    first = np.empty(ordered.size, dtype=bool)
    first[0], first[1:] = True, ordered[1:] != ordered[:-1]
    return torch.from_numpy(ordered[first])


def sample_indices(numel: int, k: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """``k`` distinct indices of ``range(numel)``, uniformly chosen, sorted (for cache-friendly gathers).

    ``randperm`` costs O(numel) (~0.3 s for ResNet9's 6.5 M on this CPU), so for small ``k`` draw with
    replacement, drop duplicates (``unique`` sorts), then drop a random few of the distinct draws to
    leave exactly ``k``, which keeps them sorted; by symmetry every k-subset stays equally likely.
    """
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    if 4 * k >= numel:
        return torch.randperm(numel, generator=generator, device=device)[:k].sort().values
    draws = k + k * k // numel + 16
    while True:
        distinct = sorted_distinct(torch.randint(numel, (draws,), generator=generator, device=device))
        extra = distinct.numel() - k
        if extra >= 0:
            break
        draws *= 2
    if extra == 0:
        return distinct
    keep = torch.ones(distinct.numel(), dtype=torch.bool, device=device)
    keep[torch.randperm(distinct.numel(), generator=generator, device=device)[:extra]] = False
    return distinct[keep]


@register_compressor
class RandomK(Compressor):
    """``ratio`` of the elements at indices every rank draws alike, so only the values travel (4 bytes
    per kept fp32) and they are summed by an all-reduce. ``unbiased`` scales by n/k on decode."""

    name: ClassVar[str] = "randomk"
    dense_small: ClassVar[bool] = True
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
