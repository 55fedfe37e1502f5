"""The honest baselines: fp32 as is, and fp16/bf16 casts. A compressor has to beat these, not only fp32."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from trainscale.compression.base import Compressor, Payload, UnitContext, register_compressor


@register_compressor
class NoCompression(Compressor):
    """Sends the gradient unchanged; through the exchange this is exactly DDP's averaging all-reduce."""

    name: ClassVar[str] = "none"
    aggregation: ClassVar[str] = "allreduce"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)

    def encode(self, x: Tensor, ctx: UnitContext) -> Payload:
        return Payload({"values": x.reshape(-1)}, tuple(x.shape), x.dtype)

    def decode(self, payload: Payload) -> Tensor:
        return payload.tensors["values"].to(payload.dtype).reshape(payload.shape)

    def theoretical_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        return 4.0 * numel


class _Cast(Compressor):
    """Cast to a 2-byte float for the wire. Summable, so it rides an all-reduce; the exchange divides
    by world size before the cast (in fp32) so the sum cannot overflow fp16."""

    aggregation: ClassVar[str] = "allreduce"
    wire_dtype: ClassVar[torch.dtype] = torch.float16

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)

    def encode(self, x: Tensor, ctx: UnitContext) -> Payload:
        return Payload({"values": x.reshape(-1).to(self.wire_dtype)}, tuple(x.shape), x.dtype)

    def decode(self, payload: Payload) -> Tensor:
        return payload.tensors["values"].to(payload.dtype).reshape(payload.shape)

    def theoretical_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        return 2.0 * numel


@register_compressor
class Fp16(_Cast):
    name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16


@register_compressor
class Bf16(_Cast):
    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
