"""Compress, exchange and decompress a list of units, returning each unit's average over ranks.

A *unit* is one parameter's gradient (layerwise) or all gradients flattened into one vector (entire
model). One call handles all units of a step (or of a DDP bucket) with as few collectives as the method
allows:

* all-reduce methods: one all-reduce of every unit's payload (per dtype). Inputs are divided by the
  world size *before* encoding (in the gradient's precision), as DDP does, so an fp16 sum cannot
  overflow and the decoded sum is already the average.
* all-gather methods: each unit is still compressed on its own (its own k, scale or norm), but the
  payloads of all units are serialised into one byte buffer and gathered once. Fixed-size methods
  need nothing else (every rank's layout equals this rank's); variable-size ones (Threshold-v) first
  gather each payload tensor's element count, then pad every buffer to the largest.
* custom methods (PowerSGD) run their own collectives through the same counting communicator.

Error feedback wraps all three the same way: encode ``g + residual``, keep ``(g + residual) - sent``.

Small tensors of a sparsifier (``dense_below``): a method that keeps k of each tensor's n elements starves the
small ones (a 10-element bias sends 1 value a step at 1%, and with error feedback its residual grows to tens of
times its gradient). Units under ``dense_below`` elements, and 1-D ones (biases, normalisation scales), are
therefore averaged dense in one fp32 all-reduce beside the compressed ones, as torch's PowerSGD hook leaves 1-D
and barely compressible tensors uncompressed. Their bytes count as sent; they need no residual.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from trainscale.compression.base import Compressor, Payload, UnitContext
from trainscale.compression.collectives import Carrier, Communicator, Future, done
from trainscale.compression.feedback import ErrorFeedback
from trainscale.compression.stats import CompressionStats
from trainscale.runtime.comm_hooks import OverlapClock

# Layerwise sparsifiers send tensors under this many elements (and 1-D ones) dense: on ResNet-20 that is the
# stem convolution, the classifier and every BatchNorm and bias, 2,026 of 269,722 values (measured:
# docs/incoming/defaults-that-learn.md).
DEFAULT_DENSE_BELOW = 1024


@dataclass(frozen=True)
class Slot:
    """Where one payload tensor sits in a serialised buffer."""

    unit: int
    name: str
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def layout(payloads: list[Payload]) -> list[Slot]:
    """Slots of every payload tensor, widest dtypes first so every slice stays aligned for ``view``."""
    slots = [Slot(i, name, t.dtype, t.numel()) for i, p in enumerate(payloads) for name, t in p.tensors.items()]
    return sorted(slots, key=lambda s: -s.dtype.itemsize)


def serialize(payloads: list[Payload], slots: list[Slot]) -> Tensor:
    parts = [payloads[s.unit].tensors[s.name].reshape(-1).contiguous().view(torch.uint8) for s in slots]
    if not parts:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.cat(parts)


def deserialize(buffer: Tensor, slots: list[Slot], templates: list[Payload]) -> list[Payload]:
    """Another rank's payloads from its buffer: its tensors, this rank's agreed shape/dtype/meta."""
    tensors: list[dict[str, Tensor]] = [{} for _ in templates]
    offset = 0
    for s in slots:
        tensors[s.unit][s.name] = buffer[offset : offset + s.nbytes].view(s.dtype)
        offset += s.nbytes
    return [t.replace(tensors[i]) for i, t in enumerate(templates)]


def total_nbytes(slots: list[Slot]) -> int:
    return sum(s.nbytes for s in slots)


class Exchange:
    """The collective layer shared by the DDP hook and the manual reducer (and usable on its own).

    ``reduce(units, step, epoch)`` takes ``(key, gradient)`` pairs in the same order on every rank and
    returns the averaged gradients, shaped like the inputs. ``reduce_async`` is the same, launched: it
    encodes (and keeps error-feedback residuals) now, and returns a future that decodes once the
    collective lands, so a DDP hook overlaps the exchange with the rest of the backward pass. Methods
    that drive their own collectives (PowerSGD) complete before the future is returned. Without a
    process group it is the identity (still counting the bytes it would hand over).
    """

    def __init__(
        self,
        compressor: Compressor,
        *,
        error_feedback: bool = False,
        stats: CompressionStats | None = None,
        group: Carrier = None,
        clock: OverlapClock | None = None,
        dense_below: int = 0,
    ) -> None:
        self.compressor = compressor
        self.dense_below = int(dense_below) if compressor.dense_small else 0
        self.stats = stats or CompressionStats(method=compressor.name)
        self.comm = Communicator(self.stats, group, clock)
        wants_feedback = compressor.feedback == "always" or (error_feedback and compressor.feedback == "optional")
        self.feedback = ErrorFeedback() if wants_feedback else None
        self.stats.world_size = self.comm.world_size

    def reduce(
        self, units: list[tuple[str, Tensor]], step: int = 0, epoch: int = 0, dense: bool = False
    ) -> list[Tensor]:
        """Average ``units`` over ranks: compressed, or plain all-reduce when ``dense`` (warm-up)."""
        return self.reduce_async(units, step, epoch, dense).wait()

    def reduce_async(
        self, units: list[tuple[str, Tensor]], step: int = 0, epoch: int = 0, dense: bool = False
    ) -> Future:
        """:meth:`reduce`, launched: a future of the averaged gradients."""
        grads = [g for _, g in units]
        self.stats.world_size = self.comm.world_size
        self.stats.dense_bytes += sum(g.numel() * g.element_size() for g in grads)
        if dense:
            return self._dense(grads)
        small = [i for i, g in enumerate(grads) if self.sends_dense(g)]
        if small:
            return self._split(units, small, step, epoch)
        return self._compressed(units, step, epoch)

    def sends_dense(self, grad: Tensor) -> bool:
        """Whether a unit goes dense beside the compressed ones (see the module docstring)."""
        return self.dense_below > 0 and (grad.dim() <= 1 or grad.numel() < self.dense_below)

    def _split(self, units: list[tuple[str, Tensor]], small: list[int], step: int, epoch: int) -> Future:
        """The ``small`` units in one dense all-reduce, the others compressed; results in the order given."""
        chosen = set(small)
        large = [i for i in range(len(units)) if i not in chosen]
        grads = [units[i][1] for i in small]
        for g in grads:
            self.stats.add_density(g.numel(), g.numel())
        dense = self._dense(grads)
        rest = self._compressed([units[i] for i in large], step, epoch) if large else done([])

        def merge(_: Future) -> list[Tensor]:
            out: list[Tensor] = [torch.empty(0)] * len(units)
            for i, t in [*zip(small, dense.wait()), *zip(large, rest.wait())]:
                out[i] = t
            return out

        return torch.futures.collect_all([dense, rest]).then(merge)

    def _compressed(self, units: list[tuple[str, Tensor]], step: int, epoch: int) -> Future:
        grads = [g for _, g in units]
        ctxs = [UnitContext(key, step, epoch) for key, _ in units]
        inputs = [self._compensate(c.key, g) for c, g in zip(ctxs, grads)]
        method = {"allreduce": self._allreduce, "allgather": self._allgather, "custom": self._custom}
        return method[self.compressor.aggregation](inputs, ctxs)

    def _compensate(self, key: str, grad: Tensor) -> Tensor:
        return self.feedback.compensate(key, grad) if self.feedback is not None else grad

    def _device(self, tensors: list[Tensor]) -> torch.device | None:
        return tensors[0].device if tensors else None

    def _dense(self, grads: list[Tensor]) -> Future:
        world = self.comm.world_size
        out = [g.div(world) if world > 1 else g.clone() for g in grads]
        return self.comm.all_reduce_async_(out).then(lambda _: out)

    def _encode(self, inputs: list[Tensor], ctxs: list[UnitContext]) -> list[Payload]:
        with self.stats.timer("encode", self._device(inputs)):
            payloads = [self.compressor.encode(x, c) for x, c in zip(inputs, ctxs)]
        for p in payloads:
            if p.selected is not None:
                self.stats.add_density(p.selected, p.numel)
            if p.meta.get("format", "indices") != "indices":
                self.stats.fallback_units += 1
        return payloads

    def _remember(
        self, ctxs: list[UnitContext], inputs: list[Tensor], payloads: list[Payload], scale: float = 1.0
    ) -> None:
        """Error feedback: keep ``input - scale * decode(payload)``, before the exchange touches anything."""
        if self.feedback is None:
            return
        with self.stats.timer("decode", self._device(inputs)):
            for ctx, x, p in zip(ctxs, inputs, payloads):
                sent = self.compressor.decode(p)
                self.feedback.update(ctx.key, x, sent * scale if scale != 1.0 else sent)

    def _allreduce(self, inputs: list[Tensor], ctxs: list[UnitContext]) -> Future:
        world = self.comm.world_size
        scaled = [x.div(world) for x in inputs] if world > 1 else inputs
        payloads = self._encode(scaled, ctxs)
        self._remember(ctxs, inputs, payloads, float(world))
        owned = (
            payloads
            if world == 1
            else [p.replace({k: _owned(t, x) for k, t in p.tensors.items()}) for p, x in zip(payloads, inputs)]
        )
        device = self._device(inputs)

        def decode(_: Future) -> list[Tensor]:
            with self.stats.timer("decode", device):
                return [self.compressor.decode(p) for p in owned]

        return self.comm.all_reduce_async_([t for p in owned for t in p.tensors.values()]).then(decode)

    def _allgather(self, inputs: list[Tensor], ctxs: list[UnitContext]) -> Future:
        payloads = self._encode(inputs, ctxs)
        self._remember(ctxs, inputs, payloads)
        device = self._device(inputs)

        def combine(gathered: Future) -> list[Tensor]:
            per_rank = gathered.value()
            with self.stats.timer("decode", device):
                return [self.compressor.combine([ranked[u] for ranked in per_rank]) for u in range(len(payloads))]

        return self.gather_payloads_async(payloads).then(combine)

    def _custom(self, inputs: list[Tensor], ctxs: list[UnitContext]) -> Future:
        out, sent = self.compressor.reduce(inputs, ctxs, self.comm)  # type: ignore[attr-defined]
        if self.feedback is not None:
            for ctx, x, s in zip(ctxs, inputs, sent):
                self.feedback.update(ctx.key, x, s)
        return done(out)

    def gather_payloads(self, payloads: list[Payload]) -> list[list[Payload]]:
        """Every rank's payloads (rank order), through one all-gather of serialised bytes."""
        return self.gather_payloads_async(payloads).wait()

    def gather_payloads_async(self, payloads: list[Payload]) -> Future:
        """:meth:`gather_payloads`, launched (a variable-size method's size exchange runs first, blocking)."""
        slots, device = layout(payloads), _device_of(payloads)
        per_rank = self._gather_layouts(slots, device) if self.compressor.variable_size else None
        buffer = serialize(payloads, slots).to(device)
        size = max(total_nbytes(s) for s in per_rank) if per_rank else buffer.numel()
        if buffer.numel() < size:
            buffer = torch.cat([buffer, buffer.new_zeros(size - buffer.numel())])
        me = self.comm.rank

        def unpack(gathered: Future) -> list[list[Payload]]:
            return [
                payloads if r == me else deserialize(buf, per_rank[r] if per_rank else slots, payloads)
                for r, buf in enumerate(gathered.value())
            ]

        return self.comm.all_gather_async(buffer).then(unpack)

    def _gather_layouts(self, slots: list[Slot], device: torch.device) -> list[list[Slot]]:
        """Each rank's slots, from an all-gather of every payload tensor's element count."""
        counts = torch.tensor([s.numel for s in slots], dtype=torch.int64, device=device)
        gathered = self.comm.all_gather(counts)
        return [[replace(s, numel=int(n)) for s, n in zip(slots, c.tolist())] for c in gathered]

    def state_dict(self) -> dict[str, Any]:
        return {
            "feedback": self.feedback.state_dict() if self.feedback else None,
            "compressor": self.compressor.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.feedback is not None and state.get("feedback"):
            self.feedback.load_state_dict(state["feedback"])
        self.compressor.load_state_dict(state.get("compressor") or {})


def _owned(t: Tensor, source: Tensor) -> Tensor:
    """``t`` as a tensor the all-reduce may overwrite: copied if it shares memory with the gradient."""
    shares = t.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
    return t.clone() if shares or not t.is_contiguous() else t


def _device_of(payloads: list[Payload]) -> torch.device:
    for p in payloads:
        for t in p.tensors.values():
            return t.device
    return torch.device("cpu")
