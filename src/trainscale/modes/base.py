"""What a training mode is: how processes are organised and talk, around the same training engine.

A mode is one class registered by name (``@register_mode``) in its own module, imported once in
``modes/__init__.py``. It declares the config sections it takes beyond the core ones (``sections``: dataclasses
of ``option`` fields, each with its own checks; flags, TOML keys and ``config.json`` follow) and validates them
against the rest of the config; the engine sees it only as ``Callbacks``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from trainscale.config import CoreConfig, Section
from trainscale.data import Batches
from trainscale.registry import Registry
from trainscale.runtime.dist import world_size
from trainscale.runtime.job import Job
from trainscale.train.callbacks import Callbacks

Result = tuple[dict[str, Any], list[dict[str, Any]]]
TRAINER, SERVER, SUPERVISOR = "trainer", "server", "supervisor"


class Mode(Callbacks):
    """Local training: one process, no communication. Subclasses add a process group and a wrapper.

    ``distributed`` modes run in worker processes started by torch's elastic agent: `trainscale train`
    starts it for them unless it already runs under one.
    """

    name: str = "local"
    distributed: ClassVar[bool] = False
    sections: ClassVar[tuple[type[Section], ...]] = ()  # the sections it takes beyond the core ones
    uses_servers: ClassVar[bool] = False  # parameter-server shards beside the workers
    job: Job = Job()  # this process's place in the job (``create_mode`` sets the entry's)
    standby_writer: bool = False  # this process holds a writer, shared with others that take turns writing

    def __init__(self, name: str = "local", cfg: CoreConfig | None = None) -> None:
        self.name = name

    @classmethod
    def validate(cls, cfg: CoreConfig) -> None:
        """Checks of this mode's settings against the rest of the config (ConfigError, one line). Here: those of
        each section it takes that checks itself against the rest (a ``check_section`` classmethod, e.g. fault
        tolerance's), in the order of ``sections``; a mode with checks of its own calls this first."""
        for kind in cls.sections:
            check = getattr(kind, "check_section", None)
            if check is not None:
                check(cfg)

    @classmethod
    def check_steps(cls, cfg: CoreConfig, steps_per_epoch: int) -> None:
        """Checks of this mode's settings against the run's length, once the data and batch are known (each worker
        takes ``steps_per_epoch`` steps an epoch): those of each section it takes with a ``check_steps`` classmethod
        (a period or an injected fault's step the run never reaches)."""
        for kind in cls.sections:
            check = getattr(kind, "check_steps", None)
            if check is not None:
                check(cfg, steps_per_epoch)

    @classmethod
    def check_device(cls, cfg: CoreConfig, device: torch.device) -> None:
        """Checks of this mode's settings against the device the workers will train on (run before any
        worker starts, and again in each worker, which may have been started by an external torchrun)."""

    def role(self) -> str:
        """This process's part in the job: ``trainer`` (the default), ``server`` (answers requests and
        never trains) or ``supervisor`` (runs a trainer in a child process it watches)."""
        return TRAINER

    def serve(self) -> Result:
        raise NotImplementedError(f"mode {self.name} has no server role")

    def supervise(self, trainer: Callable[[], Result]) -> Result:
        raise NotImplementedError(f"mode {self.name} has no supervisor role")

    def worker_device(self, requested: torch.device) -> torch.device:
        """The device this process trains on (distributed modes map CUDA to ``cuda:LOCAL_RANK``)."""
        return requested

    @contextlib.contextmanager
    def session(self, device: torch.device) -> Iterator[None]:
        """Set up (and always tear down) whatever the mode needs for the run."""
        yield

    def wrap_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer the training loop steps (parameter-server modes: one that pushes and pulls)."""
        return optimizer

    def wrap_batches(self, train: Batches, test: Batches) -> tuple[Batches, Batches]:
        """The training and test batches the trainer iterates (parameter-server modes: warm-start epochs,
        evaluation of the whole test set on the main worker)."""
        return train, test

    def data_parallel_size(self) -> int:
        """How many workers share each step's global batch (the batch plan's divisor): the process group's
        size, or the replicas of a fault-tolerant job, each of which is a world of one."""
        return world_size()

    def describe(self) -> dict[str, Any]:
        """Static facts about the mode for summary.json (backend, BatchNorm handling, ...)."""
        return {"backend": None}


MODES: Registry[Mode] = Registry("mode")


def register_mode(*names: str) -> Callable[[type[Mode]], type[Mode]]:
    """Register a Mode class under each of ``names`` (one class may serve several, e.g. async and ps-sync);
    it is built as ``cls(name, cfg)``."""

    def decorator(cls: type[Mode]) -> type[Mode]:
        for name in names:
            MODES.register(name, sections=cls.sections)(cls)
        return cls

    return decorator


def mode_class(name: str) -> type[Mode]:
    """The class registered under ``name`` (ConfigError with a did-you-mean when unknown)."""
    return MODES.get(name).factory  # type: ignore[return-value]


def create_mode(cfg: CoreConfig, job: Job | None = None) -> Mode:
    """The mode ``cfg.run.mode`` names, built for this run (``cfg`` must have its mode resolved) in this process of
    ``job``."""
    mode = mode_class(cfg.run.mode)(cfg.run.mode, cfg)
    if job is not None:
        mode.job = job
    return mode


def list_modes() -> list[str]:
    return MODES.names()


@register_mode("local")
class LocalMode(Mode):
    """One process, no communication (the engine's Callbacks, all no-ops)."""
