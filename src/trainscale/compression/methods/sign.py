"""1-bit methods: signSGD with majority vote and EF-signSGD, both with one fp32 scale per tensor.

Each element costs one bit (x >= 0 -> 1), packed 8 per byte; the scale is mean |g| (= ||g||_1 / n),
which keeps the decoded step on the gradient's scale so the usual learning rates still apply.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from trainscale.compression.base import Compressor, Payload, UnitContext, register_compressor
from trainscale.compression.bitpack import pack_bits, unpack_bits


class _Sign(Compressor):
    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)

    def encode(self, x: Tensor, ctx: UnitContext) -> Payload:
        f = x.reshape(-1)
        scale = f.abs().float().mean().reshape(1) if f.numel() else f.new_zeros(1, dtype=torch.float32)
        return Payload({"scale": scale, "signs": pack_bits((f >= 0).view(torch.uint8), 1)}, tuple(x.shape), x.dtype)

    def _positive(self, payload: Payload) -> Tensor:
        return unpack_bits(payload.tensors["signs"], 1, payload.numel).view(torch.bool)

    def _signs(self, payload: Payload) -> Tensor:
        """+1/-1 as float32."""
        return self._positive(payload).to(torch.float32) * 2.0 - 1.0

    def decode(self, payload: Payload) -> Tensor:
        scale = payload.tensors["scale"].to(payload.dtype)
        return torch.where(self._positive(payload), scale, -scale).reshape(payload.shape)

    def theoretical_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        return numel / 8


@register_compressor
class SignSGD(_Sign):
    """signSGD with majority vote (Bernstein et al. 2018): the result is the sign most ranks sent
    (0 on a tie) times the ranks' mean scale. Error feedback is optional."""

    name: ClassVar[str] = "signsgd"

    def combine(self, payloads: list[Payload]) -> Tensor:
        votes = self._signs(payloads[0])
        for p in payloads[1:]:
            votes += self._signs(p)
        scale = torch.stack([p.tensors["scale"] for p in payloads]).mean()
        first = payloads[0]
        return (torch.sign(votes) * scale).to(first.dtype).reshape(first.shape)


@register_compressor
class EFSignSGD(_Sign):
    """EF-signSGD (Karimireddy et al. 2019): scaled signs averaged over ranks, always with error
    feedback, which is what makes the biased sign compressor converge like SGD."""

    name: ClassVar[str] = "efsignsgd"
    feedback: ClassVar[str] = "always"
