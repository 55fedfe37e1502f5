"""The whole configuration of a run, ``TrainConfig``: the core sections (``trainscale.config``) plus one typed
attribute per section a built-in mode or the compression declares, and the data-parallel modes' own sections.

Each section is a dataclass owned by its component, with its own checks (``Section.validate``): the compression
section in ``compression.config``, fault injection in ``runtime.faults``, fault tolerance's (torchft replicas) in
``modes.fault_tolerance.config``, the parameter server's in ``modes.ps.config``, sync mode's and local SGD/DiLoCo's
here (sync, local SGD and DiLoCo share them). A mode declares the sections it takes (``Mode.sections``);
``app.config`` refuses settings of the others. A mode registered from outside trainscale needs no edit here: its
sections are found in the registry when a config is built, held in ``TrainConfig.plugins`` and read with
``cfg.section(ItsConfig)``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import ClassVar

from trainscale.compression.config import CompressionConfig
from trainscale.config import CoreConfig, Section, option
from trainscale.errors import require
from trainscale.modes.base import list_modes, mode_class
from trainscale.modes.fault_tolerance.config import ReplicationConfig
from trainscale.modes.ps.config import PSConfig
from trainscale.runtime.faults import FaultConfig

DEFAULT_SYNC_EVERY = 8
DILOCO_OUTER = (0.7, 0.9)  # outer lr, Nesterov momentum


@dataclass
class SyncConfig(Section):
    """Settings of sync mode beyond the launcher's: BatchNorm handling (also taken by local SGD and DiLoCo)."""

    TITLE: ClassVar[str] = "data parallel (sync mode)"

    sync_bn: bool = option(False, "SyncBatchNorm (CUDA) instead of per-worker BN statistics averaged each epoch")


@dataclass
class PeriodicConfig(Section):
    """Settings of local SGD and DiLoCo."""

    TITLE: ClassVar[str] = "local SGD and DiLoCo (--mode localsgd | diloco)"

    sync_every: int | None = option(None, f"local steps between averaging rounds, H (default {DEFAULT_SYNC_EVERY})")
    local_after_epochs: int = option(0, "post-local SGD: average after every step for this many epochs first")
    outer_lr: float | None = option(None, f"diloco: the outer Nesterov SGD's learning rate (default {DILOCO_OUTER[0]})")
    outer_momentum: float | None = option(None, f"diloco: the outer momentum (default {DILOCO_OUTER[1]})")

    def validate(self) -> None:
        require(
            self.sync_every is None or self.sync_every >= 1,
            f"--sync-every must be a positive number of steps, got {self.sync_every}",
        )
        require(self.outer_lr is None or self.outer_lr > 0, f"--outer-lr must be positive, got {self.outer_lr}")
        require(
            self.outer_momentum is None or 0 <= self.outer_momentum < 1,
            f"--outer-momentum must be in [0, 1), got {self.outer_momentum}",
        )


@dataclass
class TrainConfig(CoreConfig):
    """The whole configuration of a run: ``cfg.optim.lr``, ``cfg.launch.workers``, ``cfg.ps.servers``...
    Picklable (workers receive it); ``to_dict`` is ``config.json``'s flat form, ``from_flat`` reads it back."""

    compression: CompressionConfig = dataclasses.field(default_factory=CompressionConfig)
    faults: FaultConfig = dataclasses.field(default_factory=FaultConfig)
    replication: ReplicationConfig = dataclasses.field(default_factory=ReplicationConfig)
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    periodic: PeriodicConfig = dataclasses.field(default_factory=PeriodicConfig)
    ps: PSConfig = dataclasses.field(default_factory=PSConfig)

    @classmethod
    def plugin_key(cls) -> tuple[object, ...]:
        return tuple((name, mode_class(name).sections) for name in list_modes())

    @classmethod
    def plugin_types(cls) -> dict[str, type[Section]]:
        """Sections of registered modes that have no typed attribute here, by name (``NAME``, else the class's
        less ``Config``, lower case: ``GossipConfig`` is ``gossip``)."""
        hints = typing.get_type_hints(cls)
        typed = {hints[f.name] for f in dataclasses.fields(cls)}
        found: dict[str, type[Section]] = {}
        for name in list_modes():
            for kind in mode_class(name).sections:
                if kind not in typed:
                    found.setdefault(kind.NAME or kind.__name__.removesuffix("Config").lower(), kind)
        return found
