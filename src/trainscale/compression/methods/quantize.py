"""Unbiased stochastic quantisers, bit-packed: TernGrad (2 bits + one scale) and QSGD (S levels).

Both round stochastically with this rank's private generator, so E[decode(encode(x))] = x and the
noise of different workers averages out. The references these replace sent one byte per element (4x
instead of 16x for TernGrad) and divided by a zero max or norm on all-zero tensors (NaN): here a zero
scale encodes and decodes to exact zeros.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from trainscale.compression.base import Compressor, Payload, UnitContext, register_compressor
from trainscale.compression.bitpack import bits_for, pack_bits, unpack_bits
from trainscale.errors import ConfigError


def _bernoulli(p: Tensor, generator: torch.Generator) -> Tensor:
    """Boolean draws with probability ``p`` (``rand < p``: several times faster than torch.bernoulli)."""
    return torch.rand(p.shape, generator=generator, device=p.device, dtype=p.dtype) < p


def _safe(scale: Tensor) -> Tensor:
    """``scale`` with zeros replaced by ones, for dividing an all-zero tensor by its zero scale."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


@register_compressor
class TernGrad(Compressor):
    """Levels {-1, 0, +1} times one fp32 scale (max |g|) per tensor, packed 4 per byte.

    ``clip`` first clamps to ``clip_sigma`` standard deviations (Wen et al.'s 2.5 sigma), which cuts the
    scale and so the variance, at the price of a small bias; off by default so the encoder is unbiased.
    """

    name: ClassVar[str] = "terngrad"
    noisy: ClassVar[bool] = True

    def __init__(self, clip: bool = False, clip_sigma: float = 2.5, seed: int = 0) -> None:
        super().__init__(seed)
        self.clip = bool(clip)
        self.clip_sigma = float(clip_sigma)
        if self.clip_sigma <= 0:
            raise ConfigError(f"clip_sigma must be > 0, got {clip_sigma}")

    def encode(self, x: Tensor, ctx: UnitContext) -> Payload:
        f = x.reshape(-1).float()
        if self.clip and f.numel() > 1:
            bound = self.clip_sigma * f.std()
            bound = torch.where(bound > 0, bound, f.abs().amax())  # a constant tensor has sigma 0
            f = torch.maximum(torch.minimum(f, bound), -bound)
        scale = f.abs().amax().reshape(1) if f.numel() else f.new_zeros(1)
        keep = _bernoulli(f.abs() / _safe(scale), self.generator(x.device))
        codes = (torch.sign(f) * keep + 1).to(torch.uint8)  # -1, 0, +1 -> 0, 1, 2
        return Payload({"scale": scale, "codes": pack_bits(codes, 2)}, tuple(x.shape), x.dtype)

    def decode(self, payload: Payload) -> Tensor:
        codes = unpack_bits(payload.tensors["codes"], 2, payload.numel)
        out = (codes.to(torch.float32) - 1.0) * payload.tensors["scale"]
        return out.to(payload.dtype).reshape(payload.shape)

    def theoretical_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        return numel * 2 / 8

    def describe(self) -> str:
        return f"terngrad(clip={self.clip})"


@register_compressor
class QSGD(Compressor):
    """``qstates`` levels of |g|/||g|| with a sign, as one code in [0, 2S] packed into
    ceil(log2(2S+1)) bits (9 bits for S=255; the same count as a sign bit plus ceil(log2(S+1)) level
    bits), plus one fp32 L2 norm per tensor, or per ``bucket_size`` elements when that is > 0."""

    name: ClassVar[str] = "qsgd"
    noisy: ClassVar[bool] = True

    def __init__(self, qstates: int = 255, bucket_size: int = 0, seed: int = 0) -> None:
        super().__init__(seed)
        self.levels = int(qstates)
        if not 1 <= self.levels <= 32767:
            raise ConfigError(f"--qstates must be in 1..32767, got {qstates}")
        self.bucket_size = int(bucket_size)
        if self.bucket_size < 0:
            raise ConfigError(f"bucket_size must be >= 0, got {bucket_size}")
        self.bits = bits_for(2 * self.levels + 1)

    def _rows(self, f: Tensor) -> Tensor:
        """``f`` as rows that share a norm: one row, or zero-padded rows of ``bucket_size``."""
        if not self.bucket_size:
            return f.reshape(1, -1)
        pad = (-f.numel()) % self.bucket_size
        return torch.cat([f, f.new_zeros(pad)]).reshape(-1, self.bucket_size)

    def encode(self, x: Tensor, ctx: UnitContext) -> Payload:
        f = x.reshape(-1).float()
        rows = self._rows(f)
        norms = torch.linalg.vector_norm(rows, dim=1)
        scaled = rows.abs() / _safe(norms).unsqueeze(1) * self.levels
        low = scaled.floor()
        level = (low + _bernoulli(scaled - low, self.generator(x.device))).clamp_(max=self.levels)
        signed = torch.where(rows < 0, -level, level).reshape(-1)[: f.numel()]
        codes = (signed + self.levels).to(torch.int16 if self.bits > 8 else torch.uint8)
        return Payload({"norms": norms, "codes": pack_bits(codes, self.bits)}, tuple(x.shape), x.dtype)

    def decode(self, payload: Payload) -> Tensor:
        n = payload.numel
        codes = unpack_bits(payload.tensors["codes"], self.bits, n)
        signed = codes.to(torch.float32) - self.levels
        norms = payload.tensors["norms"]
        if self.bucket_size:
            norms = norms.repeat_interleave(self.bucket_size)[:n]
        return (signed * (norms / self.levels)).to(payload.dtype).reshape(payload.shape)

    def theoretical_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        return numel * self.bits / 8

    def describe(self) -> str:
        return f"qsgd(S={self.levels}, {self.bits} bits, bucket={self.bucket_size or 'tensor'})"
