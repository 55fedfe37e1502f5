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
from typing import Any, ClassVar

from trainscale.compression.config import CompressionConfig
from trainscale.config import CoreConfig, Section, option
from trainscale.errors import require
from trainscale.modes.base import list_modes, mode_class
from trainscale.modes.fault_tolerance.config import ReplicationConfig
from trainscale.modes.ps.config import PSConfig
from trainscale.runtime.faults import FaultConfig

DEFAULT_SYNC_EVERY = 8
DILOCO_OUTER = (0.7, 0.9)  # outer lr, Nesterov momentum
# Past 2 the outer step overshoots: a pseudo-gradient is the way to the workers' average, and a step of more than
# twice it lands further from that point than the anchor was.
MAX_OUTER_LR = 2.0


def default_outer_warmup(momentum: float) -> int:
    """Rounds over which DiLoCo's outer step grows from local SGD's: twice the momentum's horizon, 2 / (1 - m) (20
    at 0.9). Momentum m needs about 1 / (1 - m) rounds to pay off, and until then the larger step (outer lr over
    1 - m times a steady pseudo-gradient: 7x at DiLoCo's 0.7 and 0.9) overshoots. Measured in a run of 10 rounds
    (docs/local-sgd-diloco.md): 38.4% test accuracy with 20 rounds, 37.6% with 10, 35.8% with none; a long run
    loses little (20 rounds of H = 8 steps are 160 steps)."""
    return round(2.0 / (1.0 - momentum)) if momentum > 0 else 0


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
    outer_lr: float | None = option(
        None,
        f"diloco: the outer Nesterov SGD's learning rate, in (0, {MAX_OUTER_LR:g}] (default {DILOCO_OUTER[0]})",
        above=0,
        at_most=MAX_OUTER_LR,
    )
    outer_momentum: float | None = option(None, f"diloco: the outer momentum (default {DILOCO_OUTER[1]})")
    outer_warmup_rounds: int | None = option(
        None,
        "diloco: the outer step goes from local SGD's (lr 1, no momentum) to --outer-lr and --outer-momentum "
        "linearly over the first W rounds (default 2 / (1 - outer momentum): 20 at 0.9; 0: DiLoCo's from the "
        "first round)",
        at_least=0,
    )

    def validate(self) -> None:
        require(
            self.sync_every is None or self.sync_every >= 1,
            f"--sync-every must be a positive number of steps, got {self.sync_every}",
        )
        require(
            self.outer_momentum is None or 0 <= self.outer_momentum < 1,
            f"--outer-momentum must be in [0, 1), got {self.outer_momentum}",
        )

    @classmethod
    def check_steps(cls, cfg: Any, steps_per_epoch: int) -> None:
        """``--sync-every`` within an epoch: every epoch ends with a round, so a longer period is never taken (the run
        would average every epoch while its settings say otherwise). The default is not refused: on a run with
        shorter epochs it means a round at each epoch's end."""
        every = cfg.periodic.sync_every
        require(
            every is None or every <= steps_per_epoch,
            f"--sync-every {every} is longer than an epoch ({steps_per_epoch} steps per worker) and every epoch ends "
            f"with a round; give --sync-every 1..{steps_per_epoch}, or more data per worker",
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
