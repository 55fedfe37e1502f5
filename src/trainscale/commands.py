"""What each `trainscale` subcommand does, given its parsed flags."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from trainscale.errors import ConfigError, TrainscaleError
from trainscale.runtime.job import LOCAL, Job, installed, this_job

if TYPE_CHECKING:  # imported where used: the modes (and torch) load only for the commands that train
    from trainscale.modes.config import TrainConfig


def dispatch(args: argparse.Namespace, worker: Callable[..., None] | None = None) -> int:
    """Every trainscale process starts here: first it learns which process of its job it is, from the
    environment its launcher gave it (``runtime.job``), then it runs its subcommand as that process.
    ``worker``: the entry point's function that runs a worker forked from this process (``app.launch``)."""
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "train": functools.partial(train, worker=worker),
        "models": models,
        "data": data,
        "bench": bench,
        "report": report,
        "cluster": cluster,
        "profile": profile,
        "plan": plan,
    }
    job = Job.from_environ(os.environ)
    with installed(job), stops_as_ctrl_c(job):
        return handlers[args.command](args)


def stops_as_ctrl_c(job: Job) -> contextlib.AbstractContextManager[None]:
    """A process the user started unwinds on a scheduler's SIGTERM as on Ctrl-C (its run folder's lock, its
    temporary files and the processes it started taken down; one line, status 143), where SIGTERM's default would
    end it at once. The processes a launcher starts keep their own stops (``runtime.orphans``)."""
    if job.role != LOCAL:
        return contextlib.nullcontext()
    from trainscale.runtime.orphans import sigterm_as_interrupt

    return sigterm_as_interrupt()


def bench(args: argparse.Namespace) -> int:
    from trainscale.bench.cli import bench_command

    return bench_command(args)


def profile(args: argparse.Namespace) -> int:
    from trainscale.plan.cli import run_profile
    from trainscale.plan.profile import ProfileConfig

    return run_profile(ProfileConfig(**{k: v for k, v in vars(args).items() if k != "command"}))


def plan(args: argparse.Namespace) -> int:
    from trainscale.plan.cli import run_plan
    from trainscale.plan.plan import PlanConfig

    return run_plan(PlanConfig(**{k: v for k, v in vars(args).items() if k != "command"}))


def cluster(args: argparse.Namespace) -> int:
    from trainscale.cluster.command import cluster_command

    return cluster_command(args)


def report(args: argparse.Namespace) -> int:
    from trainscale.report.cli import report_command

    return report_command(args)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then (``--resume``) the run folder's settings, then --config FILE, then the flags given on the
    command line."""
    from trainscale.app.config import train_settings

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    with notes_said_by_launcher(this_job()):  # a node of an emulated cluster, say: its launcher said them
        return train_settings(flags, getattr(args, "config", None))


def worker_config(args: argparse.Namespace) -> TrainConfig:
    """A launched worker's config, its errors recorded for the agent (``runtime.worker_errors``): a model or
    dataset that does not import in this process is one line naming the worker, from the launcher."""
    from trainscale.runtime.worker_errors import recorded

    config: TrainConfig = recorded(train_config)(args)
    return config


@contextlib.contextmanager
def notes_said_by_launcher(job: Job) -> Iterator[None]:
    """The settings' notes (``INFO``: a batch cut to fit the subset, a flag that does nothing...) once per job:
    trainscale's launcher said them, so its workers and nodes, resolving the same settings, keep them to
    themselves; warnings still speak."""
    logger = logging.getLogger("trainscale")
    level = logger.level
    if job.settings_said:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def train(args: argparse.Namespace, worker: Callable[..., None] | None = None) -> int:
    """One command for every scale: a local run; the parent of a sync job (starts the workers through
    torch's elastic agent, ``worker`` the function a forked one runs); a worker (under that agent or an
    external torchrun); --hosts; or --cluster."""
    job = this_job()
    if not job.by_trainscale:
        return train_as(args, worker)
    try:
        return train_as(args, worker)
    except Exception as exc:  # in the agent's error file: trainscale's launcher prints it once, for the job
        from trainscale.runtime.worker_errors import was_recorded

        if not was_recorded(exc):
            raise
        return 2 if isinstance(exc, TrainscaleError) else 1


def train_as(args: argparse.Namespace, worker: Callable[..., None] | None = None) -> int:
    """``train`` in whichever role this process has (see ``train``)."""
    from trainscale.modes import mode_class
    from trainscale.runtime.process_group import launched_by_torchrun

    cfg = worker_config(args) if this_job().launched else train_config(args)
    if cfg.run.dry_run:
        return train_dry_run(cfg)
    flags = {k: v for k, v in vars(args).items() if k != "command"}
    if not this_job().launched:  # the processes it starts import the user's model and data as it did
        from trainscale.app.worker_env import user_code_env

        os.environ.update(user_code_env(cfg))
    if cfg.launch.hosts is not None:
        from trainscale.app.config import resumed_settings
        from trainscale.app.hosts import hosts_main

        return hosts_main(cfg, {**resumed_settings(flags), **flags})  # resuming: the run's settings on every node
    if cfg.launch.cluster is not None:
        from trainscale.app.cluster_launch import cluster_main

        return cluster_main(cfg)
    if launched_by_torchrun():
        return train_worker(cfg)
    if mode_class(cfg.run.mode).distributed:
        from trainscale.app.launch import launch

        return launch(cfg, flags, this_job(), worker)
    from trainscale.app.preflight import preflight

    preflight(cfg, data=False)  # what a dry run refuses; the data is checked as this process loads it
    return train_worker(cfg)


def train_dry_run(cfg: TrainConfig) -> int:
    """`train --dry-run`: the checks, then the resolved config as JSON on stdout; nothing is written."""
    from trainscale.app.dryrun import dry_run
    from trainscale.io import dumps

    print(dumps(dry_run(cfg)), end="")  # NaN/inf as null: the output stays JSON every reader parses
    return 0


def train_worker(cfg: TrainConfig) -> int:
    """Train in this process. Under a launcher first tie this worker to it: it dies with the launcher and
    ends silently when the launcher stops the job (see ``runtime.orphans``)."""
    job = this_job()
    if job.launched:
        from trainscale.runtime.orphans import end_with_launcher

        end_with_launcher(job.launcher_pid)
    from trainscale.app.launch import launched_by_trainscale, run_worker
    from trainscale.app.run import run_training
    from trainscale.console import EPOCH_COLUMNS, format_summary, format_table
    from trainscale.runtime.worker_errors import PeerLost

    try:
        summary, history = run_worker(cfg, job) if job.launched else run_training(cfg, job=job)
    except PeerLost:  # logged as one warning already; the job's message names the peer's own failure
        return 1
    owns_folder = summary.get("out") is not None
    if owns_folder and not launched_by_trainscale(job):  # under `trainscale train --workers N` the parent prints
        print(format_table(history, EPOCH_COLUMNS))
        print(format_summary(summary))
        print(f"results in {summary['out']}")
    return 0


def models(args: argparse.Namespace) -> int:
    """The registered models in 100 columns (``--wide``: with descriptions), one model in detail, or the recipes."""
    import torch

    from trainscale.console import format_table
    from trainscale.models import count_parameters, create_model, list_models, model_info

    def parameter_count(name: str) -> int:
        with torch.device("meta"):  # shapes only: no memory, no init cost
            return count_parameters(create_model(name))

    if args.recipes:
        return recipes()
    if args.name is not None:
        return model_details(args.name, parameter_count(model_info(args.name).name))
    rows = [
        {
            "name": n,
            "params": parameter_count(n),
            "input": model_info(n).input_size,
            "recipe": model_info(n).recipe,
            "description": model_info(n).description,
        }
        for n in list_models()
    ]
    columns: list[tuple[str, str, Callable[[Any], str]]] = [
        ("name", "model", str),
        ("params", "params", lambda v: f"{v:,}"),
        ("input", "input", lambda v: f"{v}x{v}"),
        ("recipe", "recipe", str),
    ]
    print(format_table(rows, columns + ([("description", "description", str)] if args.wide else [])))
    if not args.wide:
        print("descriptions: trainscale models --wide; one model and its recipe: trainscale models NAME")
    return 0


def model_details(name: str, params: int) -> int:
    """``trainscale models NAME``: what the model is, its input and its recipe's settings as flags."""
    from trainscale.models import model_info
    from trainscale.recipes import get_recipe

    info = model_info(name)
    print(
        f"{info.name}: {info.description}\n    {params:,} parameters at 10 classes, input {info.input_size}x"
        f"{info.input_size}"
    )
    if info.recipe:
        recipe = get_recipe(info.recipe)
        print(_wrapped(f"recipe {recipe.name}: {recipe.source}", recipe_argv(recipe.settings)))
    return 0


def recipe_argv(settings: Mapping[str, Any]) -> list[str]:
    """A recipe's settings as flags, numbers as a person writes them (12.6415, not 12.641509433962264)."""
    from trainscale.app.worker_env import to_argv

    return to_argv({k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in settings.items()})


def recipes() -> int:
    """Each recipe's settings (as `trainscale train` flags) and its source."""
    from trainscale.recipes import get_recipe, list_recipes

    for name in list_recipes():
        recipe = get_recipe(name)
        print(_wrapped(f"{name}: {recipe.source}", recipe_argv(recipe.settings)))
    return 0


def _wrapped(title: str, argv: list[str], width: int = 100) -> str:
    """A title and its flags in ``width`` columns; a flag stays on one line with its value."""
    import textwrap

    lines = [textwrap.fill(title, width, subsequent_indent="  ", break_on_hyphens=False)]
    line = "   "
    for pair in (f"{a} {b}" if b is not None else a for a, b in _flag_pairs(argv)):
        if len(line) + 1 + len(pair) > width and line.strip():
            lines.append(line)
            line = "   "
        line += " " + pair
    return "\n".join([*lines, line])


def _flag_pairs(argv: list[str]) -> list[tuple[str, str | None]]:
    pairs: list[tuple[str, str | None]] = []
    for item in argv:
        if item.startswith("--"):
            pairs.append((item, None))
        else:
            pairs[-1] = (pairs[-1][0], item)
    return pairs


def data(args: argparse.Namespace) -> int:
    from trainscale.data import download_dataset, ensure_dataset, resolve_data_dir

    if args.data_command == "verify":
        folder = ensure_dataset(args.dataset, args.data_dir, download=False, verify=True)
        print(f"{args.dataset}: all files present with the official sizes and MD5 checksums in {folder}")
        return 0
    if args.data_command == "download":
        folder = download_dataset(args.dataset, resolve_data_dir(args.dataset, args.data_dir))
        print(f"{args.dataset}: downloaded and verified in {folder}")
        return 0
    raise ConfigError(f"unknown data command {args.data_command!r}")
