"""What every compressor is: a pure ``encode`` to a :class:`Payload` and a pure ``decode`` back.

Compressors know nothing about DDP or process groups, so the same objects serve a DDP comm hook, a
manual reducer and a parameter server's pushes. How payloads from several workers combine is a
class attribute, because it decides which collective can carry them:

* ``"allreduce"``: payloads are summable element-wise and ``decode`` is linear in them (dense, fp16,
  bf16, shared-seed Random-k values). One ``all_reduce`` per step, traffic independent of world size.
* ``"allgather"``: everything else (indices differ per rank, scales differ per rank, bits cannot be
  added). Every rank gathers every rank's payload, decodes each and combines them.
* ``"custom"``: the compressor drives its own collectives (PowerSGD: two all-reduces per step).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from trainscale.errors import ConfigError
from trainscale.registry import Registry


@dataclass(frozen=True)
class UnitContext:
    """What a compressor may know about the tensor it encodes, identical on every rank.

    ``key`` names the unit (a parameter name for layerwise, ``"entire"`` for the whole model) so
    stateful compressors keep state per parameter, never per DDP bucket index. ``step``/``epoch`` drive
    shared seeds and warm-up schedules (the base seed is the compressor's own ``seed``, equal on every
    rank because every rank builds its compressor from the same flags).
    """

    key: str = "tensor"
    step: int = 0
    epoch: int = 0


@dataclass
class Payload:
    """The tensors that travel for one unit, plus what both sides already agree on.

    ``tensors`` are 1-D and are all that is sent: ``nbytes`` is exactly what goes on the wire.
    ``shape``/``dtype`` describe the decoded tensor and ``meta`` holds values every receiver can
    compute without communication (shared-seed inputs, cached indices); neither is ever sent.
    ``selected`` is the number of elements a sparsifier kept (for the density figure).
    """

    tensors: dict[str, Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    meta: dict[str, Any] = field(default_factory=dict)
    selected: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def replace(self, tensors: dict[str, Tensor]) -> Payload:
        """The same agreed description with other travelling tensors (e.g. another rank's, or a sum)."""
        return Payload(tensors, self.shape, self.dtype, self.meta, self.selected)


class Compressor:
    """Base class. Subclasses set ``name``/``aggregation`` and implement ``encode``/``decode``.

    ``feedback`` says how error feedback applies: ``"optional"`` (on with ``error_feedback=True``),
    ``"always"`` (the method is defined with it: EF-signSGD, PowerSGD) or ``"internal"`` (the method
    keeps its own residual: DGC). ``noisy`` marks unbiased stochastic quantisers whose error can exceed the
    input (QSGD with few levels, TernGrad): error feedback needs a compressor whose error is smaller than its
    input, and fed back such noise grows from step to step. ``variable_size`` means payload sizes differ per
    rank, so the exchange must gather sizes first. State, where there is any, is keyed by ``UnitContext.key``;
    ``shared_state`` says it is the same on every rank (PowerSGD's Q, made of all-reduced values), so a replica
    that joins a running job copies it; otherwise it is each rank's own (DGC's momenta) and a new one starts empty.
    """

    name: ClassVar[str] = "base"
    aggregation: ClassVar[str] = "allgather"
    feedback: ClassVar[str] = "optional"
    noisy: ClassVar[bool] = False
    variable_size: ClassVar[bool] = False
    replaces_optimizer_momentum: ClassVar[bool] = False
    # a per-tensor budget (k of n) that starves small tensors: layerwise exchanges send those dense
    # (``Exchange(dense_below=)``, the spec's ``dense_below``)
    dense_small: ClassVar[bool] = False
    shared_state: ClassVar[bool] = False

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}

    def encode(self, x: Tensor, ctx: UnitContext) -> Payload:
        raise NotImplementedError

    def decode(self, payload: Payload) -> Tensor:
        raise NotImplementedError

    def combine(self, payloads: list[Payload]) -> Tensor:
        """The average over ranks of the decoded payloads (allgather methods).

        Sparsifiers override it to scatter-add without densifying each rank; signSGD votes instead.
        """
        total = self.decode(payloads[0]).clone()
        for p in payloads[1:]:
            total += self.decode(p)
        return total.div_(len(payloads))

    def theoretical_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        """Bytes the method's idea costs for ``numel`` fp32 elements, ignoring per-tensor headers."""
        return 4.0 * numel

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def describe(self) -> str:
        return self.name

    def generator(self, device: torch.device) -> torch.Generator:
        """This rank's private stream for stochastic rounding (never the global RNG).

        Seeded lazily from (seed, rank), so it is created after the process group exists and every
        rank draws independent noise, which is what makes averaging unbiased quantisers pay off.
        """
        if device not in self._generators:
            from trainscale.runtime.dist import rank

            gen = torch.Generator(device=device)
            gen.manual_seed(stable_seed(self.seed, "rounding", self.name, rank()))
            self._generators[device] = gen
        return self._generators[device]


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from any parts, equal in every process (Python's ``hash`` is salted per process)."""
    text = "\x1f".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


COMPRESSORS: Registry[Compressor] = Registry("compressor")


def register_compressor(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: register ``cls`` under ``cls.name`` with its constructor keywords as its params."""
    COMPRESSORS.register(cls.name, params=tuple(_init_params(cls)), cls=cls)(cls)
    return cls


def _init_params(cls: type[Compressor]) -> list[str]:
    sig = inspect.signature(cls.__init__)
    return [p for p in sig.parameters if p != "self"]


def compressor_params(name: str) -> list[str]:
    """The keyword parameters ``create_compressor(name, ...)`` accepts (e.g. ``['ratio', 'seed']``)."""
    return list(COMPRESSORS.get(canonical_method(name)).meta["params"])


METHOD_ALIASES = {
    "thresholdv": "threshold",
    "threshold-v": "threshold",
    "random-k": "randomk",
    "top-k": "topk",
    "dense": "none",
    "ef-signsgd": "efsignsgd",
}


def canonical_method(name: str) -> str:
    """Registry name for ``name``, case-insensitive, with the layer-wise study's spellings (``TopK``...)."""
    lowered = name.strip().lower()
    return METHOD_ALIASES.get(lowered, lowered)


def create_compressor(name: str, **params: Any) -> Compressor:
    """Build a compressor by name. ``None`` values are ignored, so a CLI can pass all its flags; an
    unknown parameter or a bad value is a :class:`ConfigError` naming what is accepted."""
    name = canonical_method(name)
    entry = COMPRESSORS.get(name)
    given = {k: v for k, v in params.items() if v is not None}
    unknown = sorted(set(given) - set(entry.meta["params"]))
    if unknown:
        accepted = ", ".join(entry.meta["params"]) or "none"
        raise ConfigError(f"compressor '{name}' does not take {', '.join(unknown)}; it accepts: {accepted}")
    factory: Callable[..., Compressor] = entry.factory
    return factory(**given)


def compressor_class(name: str) -> type[Compressor]:
    """The registered class of ``name`` (its ClassVars say how it aggregates and what it needs), unbuilt."""
    entry = COMPRESSORS.get(canonical_method(name))
    cls: type[Compressor] = entry.meta.get("cls", entry.factory)
    return cls


def list_compressors() -> list[str]:
    return COMPRESSORS.names()


def check_ratio(value: float, flag: str = "ratio") -> float:
    value = float(value)
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"--{flag} must be in (0, 1], got {value}")
    return value
