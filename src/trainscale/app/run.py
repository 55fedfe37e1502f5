"""One training job in this process, whatever the mode: the composition root of a run.

Here, and only here, the engine (``train``), a mode (``modes``) and the data and model are put together.
A process's role comes from its mode (``trainer``, ``server``, ``supervisor``) unless the caller names it:
a parameter-server supervisor starts its child with the explicit ``trainer`` role. Which process of the job
this is (``runtime.job.Job``) comes from the entry; a parameter-server trainer, spawned by its supervisor,
installs the job it is handed (this is its entry).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainscale.cluster.seam import with_cluster
from trainscale.data import Batches, DeviceBatches, ImageTensors
from trainscale.data.user import DatasetSplit, LoaderBatches
from trainscale.errors import ConfigError, DataError, memory_errors_as_one_line
from trainscale.models import count_parameters
from trainscale.modes import Mode, create_mode, mode_class
from trainscale.modes.base import SERVER, SUPERVISOR, TRAINER, Result
from trainscale.modes.config import TrainConfig
from trainscale.modes.fault_tolerance import JobFinished
from trainscale.modes.fault_tolerance.replicated import with_fault_tolerance
from trainscale.record import SUMMARY, K, merge
from trainscale.results import RunWriter, lock_run_folder, read_json, read_summary
from trainscale.runtime.cpus import keep_freed_memory, threads_per_worker
from trainscale.runtime.dist import is_main_process, rank, world_size
from trainscale.runtime.faults import with_fault_injection
from trainscale.runtime.job import Job, install, this_job
from trainscale.runtime.tempdir import socket_safe_tempdir
from trainscale.train import Trainer, build_optimizer, built_model
from trainscale.train.precision import Precision, resolve_device, resolve_precision
from trainscale.train.schedules import create_schedule, length_change, never_steps
from trainscale.train.setup import (
    augment_for,
    check_fits,
    claimed_out,
    load_data,
    run_folder,
    steps_per_epoch,
    subset_class_warnings,
    summary_base,
)
from trainscale.train.step import torch_mode
from trainscale.train.steplog import StepLog
from trainscale.train.usermodel import check_model_on_data, input_side
from trainscale.train.utilisation import allowed_cores

log = logging.getLogger("trainscale.train")


def worker_threads(cfg: TrainConfig, job: Job) -> int | None:
    """``--threads``; under a launcher, the node's cores split over its workers; otherwise None (torch's
    default)."""
    local_workers = (cfg.launch.workers or 1) if job.replica is not None else job.local_world
    if cfg.run.threads or not local_workers:
        return cfg.run.threads
    return threads_per_worker(cfg.run.threads, local_workers)


def run_training(cfg: TrainConfig, role: str | None = None, job: Job | None = None) -> Result:
    """Run this process's part of the job (``job``: which process this is; by default the one the entry
    installed); returns the summary and the per-epoch rows (empty off the main process and for servers and
    supervisors that report nothing)."""
    if job is None:
        job = this_job()
    else:
        install(job)  # a spawned trainer's entry
    threads = worker_threads(cfg, job)
    if threads:
        torch.set_num_threads(threads)
    if cfg.run.keep_memory:
        keep_freed_memory()
    mode = create_mode(cfg, job)
    role = role or mode.role()
    if role == SERVER:
        return mode.serve()
    if role == SUPERVISOR:
        return mode.supervise(functools.partial(run_training, cfg, TRAINER, job))
    device = mode.worker_device(resolve_device(cfg.run.device))
    mode.check_device(cfg, device)
    if cfg.run.precision == "auto":  # resolved where the device is known: the run folder records what ran
        cfg = cfg.replace(precision=resolve_precision("auto", device))
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # a run's shapes repeat: time cuDNN's algorithms once (in the warm-up)
    mode = with_fault_tolerance(mode, cfg, job)
    with mode.session(device), socket_safe_tempdir(), run_folder_held(cfg, job) as held, memory_errors_as_one_line():
        try:
            return train_and_release(build_trainer(held, device, mode, job))
        except BaseException as failed:
            if job.launched:  # the trainer, in a finished frame's locals, goes too (a local run keeps them to debug)
                traceback.clear_frames(failed.__traceback__)
            raise


def train_and_release(trainer: Trainer) -> Result:
    """Train; the summary and the per-epoch rows. The trainer goes with this call, inside the mode's session: its
    DDP wrapper holds the process group, which must be freed before the session destroys it (freed later, when
    ``run_training`` returned, the group's destructor, run holding Python's lock, waited for gloo's thread, which
    waited for that lock to free a finished barrier's tensors: a deadlock, now and then)."""
    try:
        summary = trainer.fit()
    except JobFinished:
        return {}, []
    finally:
        if trainer.writer is not None:
            trainer.writer.close()
    return summary, trainer.writer.history if trainer.writer else []


@contextlib.contextmanager
def run_folder_held(cfg: TrainConfig, job: Job) -> Iterator[TrainConfig]:
    """``cfg`` with its run folder resolved once, locked while this process writes it (``results.lock_run_folder``)
    when it owns the folder: a local run, or the main process under an external torchrun. Under `trainscale train
    --workers N` the launcher holds the lock for the whole job, restarts included; workers never take it."""
    if job.by_trainscale or not is_main_process():
        yield cfg
        return
    with claimed_out(cfg) as out, lock_run_folder(out):
        yield cfg if cfg.run.out else cfg.replace(out=str(out))


def build_trainer(cfg: TrainConfig, device: torch.device, mode: Mode, job: Job) -> Trainer:
    """Everything before the first step; errors here happen before any training time is spent."""
    precision = Precision(cfg.run.precision, device)
    writer, resume = run_folder(cfg, standby=mode.standby_writer, job=job)
    train, test = load_data(cfg)
    for line in subset_class_warnings(cfg, train, test) if is_main_process() else ():
        log.warning("%s", line)
    workers = mode.data_parallel_size()
    plan = check_fits(cfg, len(train), len(test), workers)
    check_model_on_data(cfg, train, mode_class(cfg.run.mode).uses_servers)
    mode_class(cfg.run.mode).check_steps(cfg, steps_per_epoch(len(train), workers, plan.per_worker))
    want = input_side(cfg, train)
    common: dict[str, Any] = dict(
        device=device, rank=rank(), world_size=world_size(), seed=cfg.run.seed, channels_last=cfg.run.channels_last
    )
    test_batch = max(plan.per_worker, 500)
    if isinstance(train, ImageTensors) and isinstance(test, ImageTensors):
        aug_train, aug_test = augment_for(cfg, train.images.shape[-1], want)
        train_batches: Batches = DeviceBatches(train, plan.per_worker, train=True, augment=aug_train, **common)
        test_batches: Batches = DeviceBatches(test, test_batch, train=False, augment=aug_test, **common)
    else:  # a user's Datasets, read by DataLoaders
        assert isinstance(train, DatasetSplit) and isinstance(test, DatasetSplit)
        loader = {**common, "num_workers": cfg.data.loader_workers}
        train_batches = LoaderBatches(train, plan.per_worker, train=True, **loader)
        test_batches = LoaderBatches(test, test_batch, train=False, **loader)
    train_batches = with_fault_injection(train_batches, rank(), job)
    model, data_init_seconds = built_model(cfg, train.num_classes, device, train)  # in airbench's timer: the fit
    params = count_parameters(model)
    if cfg.run.compile:
        model.compile(mode=torch_mode(cfg.run.compile_mode, graphed=False))
    schedule = create_schedule(cfg)
    steps = cfg.optim.total_steps(len(train_batches))
    if is_main_process() and never_steps(schedule, steps, len(train_batches)):
        log.warning(
            "the %s schedule gives every one of this run's %d step(s) a learning rate of 0, so it learns nothing: "
            "give it more steps (more --epochs, a smaller --batch-size) or another --schedule",
            cfg.optim.schedule,
            steps,
        )
    built = build_optimizer(cfg, model, plan.lr)
    optimizer = mode.wrap_optimizer(built, model)  # PS modes: push/pull
    train_batches, test_batches = mode.wrap_batches(train_batches, test_batches)
    facts = job.cluster  # on an emulated cluster: count the bytes its interfaces send
    callbacks = with_cluster(mode, functools.partial(cfg.optim.steps_in_epoch, steps=len(train_batches)), facts)
    train_model = mode.wrap_model(model, device)
    trainer = Trainer(
        cfg=cfg,
        model=model,
        optimizer=optimizer,
        precision=precision,
        train_batches=train_batches,
        test_batches=test_batches,
        lr_at=lambda t: plan.lr * schedule(t),
        writer=writer,
        train_model=train_model,
        step_wrapping=step_wrapping(optimizer is built, train_model is model and world_size() == 1, train_model),
        callbacks=callbacks,
        baseline=load_baseline(cfg) if writer is not None else None,
        cores=allowed_cores(facts, cfg.launch.local_workers + cfg.ps.servers),
        step_log=step_log(cfg, writer, workers),
        summary_base=merge(
            summary_base(cfg, plan, params, device, want, train_batches.num_samples * world_size(), writer),
            {K.data_init_seconds: data_init_seconds},
            mode.describe(),
        ),
    )
    if resume:
        trainer.resume()
        if writer is not None and is_main_process():  # before this run's config.json replaces the run's
            change = length_change(cfg, recorded_epochs(writer.out), trainer.state.next_epoch, plan.lr)
            if change:
                log.warning("%s", change)
    if writer is not None and is_main_process() and job.writes_folder_first:
        # not another replica (replica 0 checks the folder is free, then writes), nor a restart (written already)
        writer.write_run_toml(recorded_settings(cfg, facts["name"] if facts else None))
        on_cluster = {"cluster": facts["name"]} if facts else {}  # a node runs with the cluster's flags, not it
        writer.write_config(
            {
                **cfg.to_dict(),
                **on_cluster,
                "out": str(writer.out),
                "resolved": {
                    "batch_per_worker": plan.per_worker,
                    "global_batch_size": plan.global_batch,
                    "lr": plan.lr,
                    "image_size": want,
                    "device": str(device),
                    "world_size": workers,
                },
            }
        )
    return trainer


def recorded_epochs(out: Path) -> float:
    """The length the run in ``out`` was started with (its ``config.json``; 0 where none says)."""
    try:
        return float(read_json(out / "config.json").get("epochs") or 0)
    except (OSError, DataError, ValueError, TypeError, AttributeError):
        return 0


def step_wrapping(optimizer_as_built: bool, bare: bool, train_model: torch.nn.Module) -> str:
    """What wraps the training step (``train.step.WRAPPINGS``): nothing, a DDP wrapper, or a mode whose optimizer
    or model exchanges inside the step (which keeps the eager step)."""
    if optimizer_as_built and bare:
        return "none"
    ddp = isinstance(train_model, torch.nn.parallel.DistributedDataParallel)
    return "ddp" if optimizer_as_built and ddp else "mode"


def recorded_settings(cfg: TrainConfig, cluster: str | None) -> TrainConfig:
    """What run.toml records: ``cfg``; for a node of an emulated cluster, the run the user started (``--cluster``
    NAME, not this node's place in it), so `--resume` and `--config run.toml` start the whole cluster job again."""
    if cluster is None:
        return cfg
    return cfg.replace(cluster=cluster, nnodes=1, node_rank=0, rdzv_endpoint=None, rdzv_id=None)


def step_log(cfg: TrainConfig, writer: RunWriter | None, workers: int) -> StepLog | None:
    """The main process's live metrics (``--log-every``): rows into ``writer``'s steps.jsonl (not where several
    processes may write the folder in turn: a fault-tolerant job's replicas), and as plain lines where no progress
    bar shows (the output is no terminal)."""
    if not cfg.run.log_every or not is_main_process():
        return None
    lines = cfg.run.progress and not sys.stderr.isatty()
    sink = writer.add_steps if writer is not None and not cfg.replication.fault_tolerance else None
    return StepLog(cfg.run.log_every, workers, sink, lines) if sink or lines else None


def load_baseline(cfg: TrainConfig) -> dict[str, Any] | None:
    """The --baseline run's summary (for scaling efficiency), or None; checked before any worker starts
    too, so a wrong folder is not found only at the very end."""
    if not cfg.launch.baseline:
        return None
    if not (Path(cfg.launch.baseline) / SUMMARY).is_file():
        raise ConfigError(f"--baseline {cfg.launch.baseline}: no {SUMMARY} there; give the folder of a finished run")
    return read_summary(Path(cfg.launch.baseline))
