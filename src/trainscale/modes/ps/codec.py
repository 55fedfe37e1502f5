"""Compressed pushes: the compression package's compressors (the same objects DDP hooks use), built from the
run's one compression description (``trainscale.compression.CompressionSpec``).

The worker encodes each shard's slice (after adding the error-feedback residual, when on) and sends the
payload; the server, holding a compressor built from the same spec (same seed), decodes it before the
update. Granularity: ``entire`` compresses each shard's slice as one vector; ``layerwise`` compresses each
parameter's part of the slice on its own (a parameter that straddles two shards is two units) and sends
their payloads as a list. During ``--compress-warmup-epochs`` pushes go dense. Only the payload's tensors
and its small non-tensor description travel: tensor-valued ``meta`` entries are the sender's caches (e.g.
Random-k's indices), which the receiver recomputes from the shared seed and context, so ``Payload.nbytes``
is what crosses the wire.

Methods that drive their own collectives (``aggregation == "custom"``: PowerSGD, whose second factor is
computed from the all-reduced first one) have no parameter-server form: workers never talk to each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from trainscale.compression import Compressor, ErrorFeedback, Payload, UnitContext
from trainscale.compression.config import CompressionConfig
from trainscale.compression.spec import CompressionSpec
from trainscale.errors import ConfigError


def push_refusal(spec: CompressionSpec) -> str | None:
    """Why ``spec`` cannot compress parameter-server pushes (one line naming what to do), or None."""
    compressor = spec.compressor()
    if compressor.aggregation == "custom":
        return (
            f"--compress {spec.method} cannot compress parameter-server pushes: it exchanges between the workers "
            "with collectives of its own (PowerSGD all-reduces its P factor, then computes Q from the sum), and "
            "parameter-server workers only talk to the servers; use it with --mode sync, localsgd or diloco, or "
            "pick a compressor that encodes each push on its own (e.g. topk, qsgd, signsgd)"
        )
    return None


def push_compressor(spec: CompressionSpec) -> Compressor:
    """The compressor of ``spec`` for pushes (workers encode, servers decode); a ConfigError where it has none."""
    refusal = push_refusal(spec)
    if refusal is not None:
        raise ConfigError(refusal)
    return spec.compressor()


def codec_spec(name: str, params: dict[str, Any] | None = None, error_feedback: bool = False) -> CompressionSpec:
    """A push spec from a method and its compressor's parameters (each shard's slice as one unit)."""
    return CompressionSpec(name, "entire", dict(params or {}), error_feedback)


CodecSpec = codec_spec  # the name callers of the former push-only description use


def wire(payload: Payload) -> Payload:
    """The payload as sent: travelling tensors plus non-tensor meta (no cached tensors)."""
    meta = {k: v for k, v in payload.meta.items() if not isinstance(v, Tensor)}
    return Payload(payload.tensors, payload.shape, payload.dtype, meta, payload.selected)


class PushCodec:
    """Worker side: compress each shard's slice, keeping what was dropped for the next push (error feedback).

    ``units`` are the (name, numel) of the parameters in the flat vector's order: ``layerwise`` needs them.
    ``error_feedback`` None: the spec's.
    """

    def __init__(
        self, spec: CompressionSpec, error_feedback: bool | None = None, units: Sequence[tuple[str, int]] | None = None
    ) -> None:
        self.spec = spec
        self.compressor = push_compressor(spec)
        wanted = spec.error_feedback if error_feedback is None else error_feedback
        use_feedback = wanted or self.compressor.feedback == "always"
        self.feedback = ErrorFeedback() if use_feedback and self.compressor.feedback != "internal" else None
        self.units = list(units or [])
        if spec.granularity == "layerwise" and not self.units:
            raise ValueError("layer-wise compressed pushes need the parameters' (name, numel)")
        self.layout: list[list[tuple[str, int]]] | None = None
        self.pushes = 0

    def encode(self, pieces: list[Tensor], epoch: int) -> list[Any]:
        """One push's slices, as sent: a tensor (dense warm-up), a payload (entire) or a list of payloads."""
        if epoch < self.spec.warmup_epochs:
            self.pushes += 1
            return list(pieces)
        if self.spec.granularity == "entire":
            out: list[Any] = [self._encode(f"shard{s}", piece, epoch) for s, piece in enumerate(pieces)]
        else:
            layout = self._layout([p.numel() for p in pieces])
            out = [
                [self._encode(key, part, epoch) for (key, _), part in zip(units, piece.split([n for _, n in units]))]
                for units, piece in zip(layout, pieces)
            ]
        self.pushes += 1
        return out

    def _encode(self, key: str, x: Tensor, epoch: int) -> Payload:
        ctx = UnitContext(key=key, step=self.pushes, epoch=epoch)
        if self.feedback is not None:
            x = self.feedback.compensate(key, x)
        payload = self.compressor.encode(x, ctx)
        if self.feedback is not None:
            self.feedback.update(key, x, self.compressor.decode(payload))
        return wire(payload)

    def _layout(self, sizes: list[int]) -> list[list[tuple[str, int]]]:
        """Each shard's units: the parts of the parameters its slice holds, as (key, numel)."""
        if self.layout is None:
            if sum(sizes) != sum(n for _, n in self.units):
                raise ValueError(f"pushes of {sum(sizes)} values, parameters of {sum(n for _, n in self.units)}")
            self.layout = [[] for _ in sizes]
            shard, room = 0, sizes[0] if sizes else 0
            for name, numel in self.units:
                while numel:
                    while room == 0:
                        shard += 1
                        room = sizes[shard]
                    take = min(numel, room)
                    self.layout[shard].append((f"shard{shard}/{name}", take))
                    numel, room = numel - take, room - take
        return self.layout


def decode_push(decoder: Compressor | None, payload: Any) -> Tensor:
    """A push as the shard's flat fp32 slice: dense as is, one payload decoded, or a list decoded and joined."""
    if isinstance(payload, Tensor):
        return payload
    if decoder is None:
        raise ValueError("a compressed push reached a shard whose rule has no compressor")
    if isinstance(payload, list):
        return torch.cat([decoder.decode(p).reshape(-1).float() for p in payload])
    return decoder.decode(payload).reshape(-1).float()


def payload_nbytes(payload: Any) -> int:
    """Bytes a push carries: a dense tensor's, a compressed payload's travelling tensors, or a list's sum."""
    if isinstance(payload, Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, list):
        return sum(payload_nbytes(p) for p in payload)
    return int(payload.nbytes)


def codec_from_config(cfg: CompressionConfig, seed: int) -> CompressionSpec | None:
    """The run's compression spec for pushes (the flags mapped once, in ``CompressionSpec.from_config``);
    None means dense fp32 pushes."""
    spec = CompressionSpec.from_config(cfg, seed)
    return spec if spec.enabled else None
