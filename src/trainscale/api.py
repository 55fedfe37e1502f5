"""``trainscale.fit``: train from Python (a notebook, a script) with the checks, run folder and results of
`trainscale train`.

``fit`` builds the config from keyword arguments exactly as the command line does (``app.config.train_settings``:
the same typed fields, recipes and checks, so a bad setting raises the ``ConfigError`` whose one line the CLI
prints), then trains: a model given as an ``nn.Module`` instance in this process (mode local), a model given by
name or import path in any mode (several workers, parameter servers, an emulated cluster: the CLI's own launcher,
whose workers build the model themselves). The run folder is the CLI's; ``FitResult`` holds what it recorded.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainscale.errors import ConfigError, TrainscaleError
from trainscale.runtime.job import Job
from trainscale.stops import stop_of_status

INSTANCE_RECIPE = "cifar10-fast"  # a module instance's recipe (a model by import path gets "defaults")


class TrainingFailed(TrainscaleError):
    """A launched job ended with a failure (its workers' error was printed as the CLI prints it)."""


@dataclass(frozen=True)
class FitResult:
    """What a run recorded: ``summary`` (summary.json's keys, ``trainscale.record.K``), ``history`` (one dict per
    finished epoch, metrics.jsonl's rows) and ``out``, the run folder (also holding run.toml and steps.jsonl)."""

    summary: dict[str, Any]
    history: list[dict[str, Any]]
    out: Path | None


def fit(model: nn.Module | str | None = None, *, config: str | Path | None = None, **settings: Any) -> FitResult:
    """Train ``model`` and return what the run recorded.

    ``model``: an ``nn.Module`` (trained in place, in this process), a registered name (``"resnet20"``) or a factory
    by import path (``"my_pkg.nets:build"``); None: the ``model`` setting. ``config``: a TOML file as
    ``--config`` takes (a run folder's ``run.toml`` re-creates that run). ``settings``: every `trainscale train` flag
    as a keyword with underscores (``epochs=2``, ``workers=2``, ``compress="topk"``, ``out="runs/a"``,
    ``resume=True``). Raises ``ConfigError`` (or ``DataError``) with the CLI's one line for a bad setting,
    ``TrainingFailed`` when a launched job fails."""
    from trainscale.app.config import as_settings
    from trainscale.log import setup_logging
    from trainscale.runtime.job import installed

    setup_logging()
    settings = {k: str(v) if isinstance(v, os.PathLike) else v for k, v in as_settings(settings).items()}
    config = str(config) if isinstance(config, os.PathLike) else config
    if config is not None and not isinstance(config, str):
        raise ConfigError(
            f"config= takes the path of a TOML file (a run folder's run.toml), not a {type(config).__name__}; "
            "give settings as keywords: fit(model, epochs=2, ...)"
        )
    with (
        _environ_kept(),
        _torch_state_kept(),
        installed(Job.from_environ(os.environ)) as job,
        _as_registered(model, settings) as named,
    ):
        flags = {**settings, **({"model": named} if named else {})}
        if isinstance(model, nn.Module):
            was_training = model.training
            try:
                return _fit_here(flags, config, job, instance=True)
            finally:
                model.train(was_training)  # the last evaluation leaves it in eval mode
        return _fit(flags, config, job)


@contextlib.contextmanager
def _environ_kept() -> Iterator[None]:
    """The caller's environment as it was: a launch sets the variables its workers inherit in this process (the
    CLI's process then ends), and a later ``fit`` in the same notebook must not read them as its own job's."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _torch_state_kept() -> Iterator[None]:
    """torch's process-wide settings as the caller left them: a run seeds the random generator (``--seed``), sets
    the thread count (``--threads``) and, on CUDA, cuDNN's autotuner; the caller's own experiment goes on after."""
    rng, threads, benchmark = torch.get_rng_state(), torch.get_num_threads(), torch.backends.cudnn.benchmark
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = benchmark
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _fit(flags: dict[str, Any], config: str | Path | None, job: Any) -> FitResult:
    """A model by name or import path: in this process (mode local), else through the CLI's launchers."""
    from trainscale.app.config import train_settings
    from trainscale.modes import mode_class
    from trainscale.train.setup import claimed_out

    cfg = train_settings(flags, config)
    if cfg.run.dry_run:
        from trainscale.app.dryrun import dry_run

        return FitResult(dry_run(cfg), [], None)
    if not (mode_class(cfg.run.mode).distributed or cfg.launch.cluster is not None or cfg.launch.hosts is not None):
        return _fit_here(flags, config, job)
    if cfg.launch.hosts is not None:
        raise ConfigError("--hosts starts other machines' commands: run `trainscale train` there, not fit()")
    from trainscale.app.worker_env import user_code_env

    os.environ.update(user_code_env(cfg))  # the processes it starts import the user's code as this one did
    with claimed_out(cfg) as out:  # fixed here, so the result is read from the folder the workers wrote
        flags = {**flags, "out": str(out), **({"config": str(config)} if config else {})}
        cfg = cfg.replace(out=str(out))
        cause = ""
        if cfg.launch.cluster is not None:
            from trainscale.app.cluster_launch import cluster_main

            status = cluster_main(cfg)
        else:
            status, cause = _launched(cfg, flags, job)
    stop = stop_of_status(status)
    if stop is not None:  # Ctrl-C or SIGTERM: the workers are stopped; the caller gets what Ctrl-C gives in Python
        raise stop
    if status != 0:
        raise TrainingFailed(cause or f"the training job failed (exit status {status}); its error is printed above")
    return _read_result(out)


def _launched(cfg: Any, flags: dict[str, Any], job: Job) -> tuple[int, str]:
    """The job through the CLI's launcher, and the line naming its failure's root cause ("" when it succeeded or
    recorded none): the launcher reports it to ``Job.node_report``, as a node of a cluster run does to its parent."""
    from trainscale.app.launch import launch
    from trainscale.io import read_json
    from trainscale.runtime.job import installed

    with tempfile.TemporaryDirectory(prefix="trainscale-fit-") as folder:
        reporting = dataclasses.replace(job, node_report=Path(folder) / "failure.json")
        with installed(reporting):
            status = launch(cfg, flags, reporting)
        report = Path(folder) / "failure.json"
        cause = str(read_json(report).get("message", "")) if report.exists() else ""
    return status, cause


def _fit_here(flags: dict[str, Any], config: str | Path | None, job: Any, instance: bool = False) -> FitResult:
    """Train in this process with the CLI's checks (``app.preflight``) first."""
    from trainscale.app.config import train_settings
    from trainscale.app.preflight import preflight
    from trainscale.app.run import run_training
    from trainscale.modes import mode_class

    cfg = train_settings(flags, config)
    if instance and (mode_class(cfg.run.mode).distributed or cfg.launch.cluster or cfg.launch.hosts):
        raise ConfigError(
            f"a model instance trains in this process (mode local), not --mode {cfg.run.mode}: other processes "
            "cannot see it; give a factory by import path instead, model='my_pkg.nets:build'"
        )
    if cfg.run.dry_run:
        from trainscale.app.dryrun import dry_run

        return FitResult(dry_run(cfg), [], None)
    preflight(cfg, data=False)
    summary, history = run_training(cfg, job=job)
    out = summary.get("out")
    return FitResult(summary, list(history), Path(out) if out else None)


def _read_result(out: Path) -> FitResult:
    from trainscale.results import read_history, read_summary

    return FitResult(read_summary(out), read_history(out), out)


@contextlib.contextmanager
def _as_registered(model: nn.Module | str | None, settings: dict[str, Any]) -> Iterator[str | None]:
    """The model's name for the config: a string as given; an instance registered under its class's name for the
    call (its recipe: ``INSTANCE_RECIPE`` unless ``recipe`` is given), so every check and record that names a
    model works as for a built-in one."""
    if not isinstance(model, nn.Module):
        yield model
        return
    from trainscale.models.registry import MODELS

    name = type(model).__name__
    while name in MODELS:
        name += "_"
    size = settings.get("image_size")  # None: the data's own size, as for a factory by import path
    MODELS.register(
        name,
        input_size=size,
        description="a model instance given to trainscale.fit",
        default_dataset="cifar10",
        recipe=INSTANCE_RECIPE,
        data_init_images=0,
    )(_instance_factory(model, size))
    try:
        yield name
    finally:
        MODELS.remove(name)


def _instance_factory(model: nn.Module, size: int | None) -> Any:
    """A factory that returns ``model`` itself once it is checked against the data: parameters to train, images of
    the size it is fed (``image_size``, from the data or ``size``), one score per class (a shape check on the meta
    device gets a copy there)."""

    def factory(num_classes: int = 10, image_size: int | None = None) -> nn.Module:  # no --model-arg: it is built
        if torch.get_default_device().type == "meta":
            return copy.deepcopy(model).to("meta")
        name = type(model).__name__
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(f"model {name} has no trainable parameters, so there is nothing to train")
        side = image_size or size or 32
        param = next(model.parameters())
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logits = model(torch.zeros(2, 3, side, side, device=param.device))
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"model {name} cannot take 3x{side}x{side} images ({type(exc).__name__}: {reason}); change the "
                "model, or give image_size= the size it takes"
            ) from None
        finally:
            model.train(was_training)
        if logits.dim() != 2 or logits.shape[0] != 2 or logits.shape[1] < num_classes:  # as by import path
            raise ConfigError(
                f"model {type(model).__name__} gives outputs of shape {tuple(logits.shape)} for 2 images; the data "
                f"has {num_classes} classes: its output must be (batch, {num_classes})"
            )
        return model

    return factory
