"""The flat parameter vector and how it is cut into server shards.

Every parameter tensor is flattened in its logical (NCHW) order, whatever its memory format, and the
tensors are concatenated in ``model.parameters()`` order. The vector is cut into ``S`` contiguous
ranges whose lengths differ by at most one element, so each server does the same amount of work
whatever the layer sizes (a per-tensor assignment would leave ResNet9's 2.4 M-element layers on one
shard). These functions are pure, so the round trip is unit-tested without any process.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

Bounds = list[tuple[int, int]]


def shard_bounds(numel: int, shards: int) -> Bounds:
    """``[start, stop)`` of each shard; the first ``numel % shards`` shards hold one element more."""
    if shards < 1:
        raise ValueError(f"need at least one shard, got {shards}")
    if numel < shards:
        raise ValueError(f"cannot cut {numel} elements into {shards} non-empty shards")
    base, extra = divmod(numel, shards)
    bounds, start = [], 0
    for s in range(shards):
        stop = start + base + (1 if s < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def flatten(tensors: Iterable[Tensor], device: torch.device | str = "cpu") -> Tensor:
    """One new fp32 vector holding ``tensors`` in logical order (channels_last tensors included)."""
    return torch.cat([t.detach().reshape(-1).to(device=device, dtype=torch.float32) for t in tensors])


def split(flat: Tensor, bounds: Bounds) -> list[Tensor]:
    """Each shard's slice as its own tensor (RPC would otherwise send a view's whole storage)."""
    return [flat[start:stop].clone() for start, stop in bounds]


def join(pieces: Sequence[Tensor]) -> Tensor:
    return torch.cat(list(pieces))


@torch.no_grad()
def assign(tensors: Sequence[Tensor], flat: Tensor) -> None:
    """Copy ``flat`` back into ``tensors`` (the inverse of ``flatten``), keeping their memory formats."""
    total = sum(t.numel() for t in tensors)
    if flat.numel() != total:
        raise ValueError(f"flat vector has {flat.numel()} elements, the tensors {total}")
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view(t.shape))
        offset += n


def gradients(params: Sequence[Tensor]) -> Tensor:
    """The flat gradient; a parameter without one (unused this step) contributes zeros."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float() for p in params]
    )
