"""Measured, not assumed: the bytes each rank hands to collectives, and the time spent coding.

``CompressionStats`` extends the sync mode's :class:`~trainscale.runtime.comm_hooks.CommStats`
(``bytes_sent``, ``calls``, ``steps``), so a compressed run and the counting all-reduce hook report
the same ``bytes_sent_per_step``. ``bytes_sent`` is the size of every tensor this rank passes to
``all_reduce``/``all_gather`` (size exchanges and padding included); ``dense_bytes`` is what a plain
all-reduce of the same gradients would have passed; their ratio is the ``compression_ratio`` a speed
claim may rest on. ``wire_bytes`` estimates what leaves the rank under ring algorithms: 2(W-1)/W times
the buffer for all-reduce, (W-1) times it for all-gather, which is why all-gather methods lose ground
as workers are added.

Time per step: ``encode_seconds`` and ``decode_seconds`` here; ``comm_seconds`` (collectives in flight),
``hidden_seconds`` (the part of that under the backward pass) and ``exchange_seconds`` (what the step
waited for) from the base class, filled by the hook's clock. ``fallback_units`` counts sparse payloads
sent as a bitmap or dense because that was smaller than values + indices.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from trainscale.runtime.comm_hooks import CommStats

_LABELS = ("method", "granularity", "world_size")
_TIMER_LOCK = threading.Lock()


@dataclass
class CompressionStats(CommStats):
    """Running totals since the last ``reset()``; ``summary()`` turns them into per-step figures.

    ``calls`` (inherited) counts collectives of either kind; ``steps`` counts optimizer steps.
    """

    method: str = "none"
    granularity: str = "layerwise"
    world_size: int = 1
    dense_steps: int = 0
    dense_bytes: int = 0
    wire_bytes: float = 0.0
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0
    selected: int = 0
    candidates: int = 0
    fallback_units: int = 0

    def add_collective(self, kind: str, nbytes: int, world_size: int) -> None:
        """Count one collective of ``nbytes`` handed over by this rank (``kind``: all_reduce/all_gather)."""
        self.calls += 1
        self.bytes_sent += int(nbytes)
        factor = 2.0 * (world_size - 1) / world_size if kind == "all_reduce" else float(world_size - 1)
        self.wire_bytes += factor * nbytes

    def add_density(self, selected: int, candidates: int) -> None:
        self.selected += int(selected)
        self.candidates += int(candidates)

    @contextlib.contextmanager
    def timer(self, name: str, device: torch.device | None = None) -> Iterator[None]:
        """Add the wall time of the body to ``<name>_seconds`` (device-synchronised on CUDA). Decoding
        may run on the backend's threads (overlapped exchanges), hence the lock."""
        _sync(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync(device)
            attr = f"{name}_seconds"
            with _TIMER_LOCK:
                setattr(self, attr, getattr(self, attr) + time.perf_counter() - start)

    def reset(self) -> None:
        for f in fields(self):
            if f.name not in _LABELS:
                setattr(self, f.name, type(getattr(self, f.name))())

    def add(self, other: CommStats) -> None:
        """Accumulate another period's totals (e.g. epochs into a run)."""
        for f in fields(other):
            if f.name not in _LABELS and hasattr(self, f.name):
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def per_step(self) -> dict[str, Any]:
        return self.summary()

    def summary(self) -> dict[str, Any]:
        """Per-step figures for metrics.jsonl and summary.json (None before the first step)."""
        s = self.steps

        def per(value: float, scale: float = 1.0) -> float | None:
            return scale * value / s if s else None

        return {
            "compress_method": self.method,
            "compress_granularity": self.granularity,
            "compress_steps": s,
            "compress_dense_steps": self.dense_steps,
            "bytes_sent_per_step": per(self.bytes_sent),
            "dense_bytes_per_step": per(self.dense_bytes),
            "wire_bytes_per_step": per(self.wire_bytes),
            "compression_ratio": self.dense_bytes / self.bytes_sent if self.bytes_sent else None,
            "allreduce_calls_per_step": per(self.calls),  # CommStats' name; all-gathers included
            "encode_ms_per_step": per(self.encode_seconds, 1e3),
            "decode_ms_per_step": per(self.decode_seconds, 1e3),
            "comm_ms_per_step": per(self.comm_seconds, 1e3),
            "hidden_ms_per_step": per(self.hidden_seconds, 1e3),
            "comm_seconds_per_step": per(self.exchange_seconds),
            "density": self.selected / self.candidates if self.candidates else None,
            "fallback_units_per_step": per(self.fallback_units),
        }

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
