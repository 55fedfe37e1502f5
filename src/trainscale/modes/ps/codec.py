"""Compressed pushes: the compression package's compressors (the same objects DDP hooks use).

The worker encodes each shard's slice (after adding the error-feedback residual, when on) and sends
the payload; the server, holding a compressor built from the same spec (same seed), decodes it before
the update. Only the payload's tensors and its small non-tensor description travel: tensor-valued
``meta`` entries are the sender's caches (e.g. Random-k's indices), which the receiver recomputes from
the shared seed and context, so ``Payload.nbytes`` is what crosses the wire. Methods that drive their
own collectives (``aggregation == "custom"``, PowerSGD) have no parameter-server form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from trainscale.compression import ErrorFeedback, UnitContext, canonical_method, compressor_params, create_compressor
from trainscale.compression.config import CompressionConfig
from trainscale.errors import ConfigError


@dataclass(frozen=True)
class CodecSpec:
    """What both sides build their compressor from (sent to the servers with the rule)."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    def create(self) -> Any:
        compressor = create_compressor(self.name, **self.params)
        if compressor.aggregation == "custom":
            raise ConfigError(f"compressor '{compressor.name}' runs its own collectives; it cannot compress "
                              "parameter-server pushes")
        return compressor


def wire(payload: Any) -> Any:
    """The payload as sent: travelling tensors plus non-tensor meta (no cached tensors)."""
    meta = {k: v for k, v in payload.meta.items() if not isinstance(v, Tensor)}
    return type(payload)(payload.tensors, payload.shape, payload.dtype, meta, payload.selected)


class PushCodec:
    """Worker side: compress shard ``s``'s slice, keeping what was dropped for the next push (EF)."""

    def __init__(self, spec: CodecSpec, error_feedback: bool) -> None:
        self.spec = spec
        self.compressor = spec.create()
        use_feedback = error_feedback or self.compressor.feedback == "always"
        self.feedback = ErrorFeedback() if use_feedback and self.compressor.feedback != "internal" else None
        self.pushes = 0

    def encode(self, pieces: list[Tensor], epoch: int) -> list[Any]:
        out = []
        for s, piece in enumerate(pieces):
            key = f"shard{s}"
            ctx = UnitContext(key=key, step=self.pushes, epoch=epoch)
            x = self.feedback.compensate(key, piece) if self.feedback is not None else piece
            payload = self.compressor.encode(x, ctx)
            if self.feedback is not None:
                self.feedback.update(key, x, self.compressor.decode(payload))
            out.append(wire(payload))
        self.pushes += 1
        return out


def payload_nbytes(payload: Any) -> int:
    """Bytes a push carries: a dense tensor's, or a compressed payload's travelling tensors."""
    if isinstance(payload, Tensor):
        return payload.numel() * payload.element_size()
    return payload.nbytes


def codec_from_config(cfg: CompressionConfig) -> tuple[CodecSpec | None, bool]:
    """(spec, error feedback) from the compression flags of ``cfg`` when it has them (``compress`` and
    each compressor parameter under its own name, ``error_feedback``); (None, False) means dense."""
    name = getattr(cfg, "compress", None)
    if not name or canonical_method(name) == "none":
        return None, False
    params = {p: getattr(cfg, p) for p in compressor_params(name) if getattr(cfg, p, None) is not None}
    return CodecSpec(canonical_method(name), params), bool(getattr(cfg, "error_feedback", False))
