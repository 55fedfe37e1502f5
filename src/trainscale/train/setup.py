"""The engine's builders: data, batch plan, model and the run folder, from the config (the optimizer: ``optimizers``).

Public: ``build_model`` (usable on its own, with ``optimizers.build_optimizer``, e.g. to time one ``train_step``);
the composition root (``app.run``) puts the pieces together with a mode."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainscale.config import CoreConfig
from trainscale.data import AugmentConfig, load_dataset
from trainscale.data.checksums import ChecksumError
from trainscale.data.download import ENV_VAR as DATA_ENV
from trainscale.data.sharding import batches_per_epoch, check_world, train_shard_size
from trainscale.data.tensors import ImageTensors
from trainscale.data.user import UserSplit, load_user_data
from trainscale.errors import ConfigError, DataError
from trainscale.io import (
    check_folder_permissions,
    check_folder_writable,
    missing_folders,
    read_json,
    remove_empty,
    unwritable_reason,
)
from trainscale.models import model_info
from trainscale.models.registry import DataInitModel
from trainscale.record import SUMMARY, K, finished
from trainscale.registry import is_import_path
from trainscale.results import LAUNCHER_FILES, LOCK_FILE, RunWriter, in_use_message, lock_holder
from trainscale.runtime import ft
from trainscale.runtime.dist import broadcast_object, is_main_process, job_restarted, world_size
from trainscale.runtime.job import Job
from trainscale.train import usermodel
from trainscale.train.environment import environment
from trainscale.train.precision import synchronize

log = logging.getLogger("trainscale.train")

SYNTHETIC_SIZE = 50_000  # load_dataset's default size of each synthetic split
# Random test images a synthetic run evaluates unless --test-subset says otherwise: its accuracy means nothing, and
# 50,000 of them took 17.8 s of a 28 s run.
SYNTHETIC_TEST_SIZE = 2_000


@dataclass(frozen=True)
class BatchPlan:
    """How ``--batch-size`` / ``--batch-per-worker`` split over workers, and the LR they imply."""

    per_worker: int
    global_batch: int
    lr: float

    @classmethod
    def resolve(cls, cfg: CoreConfig, workers: int) -> BatchPlan:
        if cfg.optim.batch_per_worker is not None:
            per_worker = cfg.optim.batch_per_worker
        elif cfg.optim.batch_size % workers:
            raise ConfigError(
                f"--batch-size {cfg.optim.batch_size} is not divisible by {workers} workers; "
                "choose a multiple or use --batch-per-worker"
            )
        else:
            per_worker = cfg.optim.batch_size // workers
        if per_worker % cfg.optim.accumulate:
            raise ConfigError(
                f"--accumulate {cfg.optim.accumulate} splits each worker's batch of {per_worker} into equal "
                "micro-batches: choose a batch per worker divisible by it"
            )
        global_batch = per_worker * workers
        optim = cfg.optim
        lr = optim.lr * global_batch / optim.base_batch_size if optim.lr_scaling == "linear" else optim.lr
        return cls(per_worker, global_batch, lr)


def default_out_dir(cfg: CoreConfig, free: bool = True) -> Path:
    """``runs/<model>-<dataset>-<time>``, with ``-2``, ``-3``... where a run of the same second has the name (a sweep
    of short runs in a loop, several started at once). ``free`` False: the name without that search, as another
    process of a job started by an outside launcher computes the one its main process chose."""
    return next(name for name in default_names(cfg) if not (free and os.path.lexists(name)))


def default_names(cfg: CoreConfig) -> Iterator[Path]:
    model, dataset = (name.replace(":", ".") for name in (cfg.data.model, cfg.data.dataset))
    base = Path("runs") / f"{model}-{dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    return itertools.chain([base], (base.with_name(f"{base.name}-{n}") for n in itertools.count(2)))


def synthetic_size(cfg: CoreConfig, subset: int | None) -> dict[str, Any]:
    """Synthetic data: generate only the subset asked for (50,000 random images take seconds per process,
    and every worker makes its own); a subset larger than the set stays an error."""
    if cfg.data.dataset != "synthetic" or not subset or subset > SYNTHETIC_SIZE:
        return {}
    return {"synthetic_size": subset}


def load_data(cfg: CoreConfig) -> tuple[UserSplit, UserSplit]:
    """The train and test splits; a file failing its check names ``--no-verify`` too, which train takes. A dataset
    given by import path is the user's function's (``data.user``)."""
    if is_import_path(cfg.data.dataset):
        data_dir = cfg.data.data_dir or os.environ.get(DATA_ENV) or None
        train, test = load_user_data(cfg.data.dataset, data_dir)
        check_clipped_range(cfg, train)
        return _subsets(cfg, train, test, cfg.data.test_subset)
    size = cfg.data.image_size if cfg.data.dataset == "synthetic" else None
    common: dict[str, Any] = dict(
        data_dir=cfg.data.data_dir, verify=cfg.data.verify, download=cfg.data.download, image_size=size
    )
    synthetic = cfg.data.dataset == "synthetic"
    test_subset = cfg.data.test_subset or (SYNTHETIC_TEST_SIZE if synthetic else None)
    try:
        train = load_dataset(
            cfg.data.dataset,
            train=True,
            limit=cfg.data.train_subset,
            **common,
            **synthetic_size(cfg, cfg.data.train_subset),
        )
        test = load_dataset(
            cfg.data.dataset, train=False, limit=test_subset, **common, **synthetic_size(cfg, test_subset)
        )
    except ChecksumError as exc:
        raise ChecksumError(f"{exc}, or train without the check (--no-verify)") from None
    return _subsets(cfg, train, test, test_subset)


def check_clipped_range(cfg: CoreConfig, train: UserSplit) -> None:
    """``--brightness`` and ``--contrast`` clip to 0..1, the range float images are documented in: float tensors in
    other units (0..255, normalised already), which train as they are otherwise (normalised by their own
    statistics), would be erased by the clip, so the two are refused together."""
    if not (cfg.data.brightness or cfg.data.contrast) or not isinstance(train, ImageTensors):
        return
    if not train.images.is_floating_point():
        return
    low, high = float(train.images.min()), float(train.images.max())
    if low < 0.0 or high > 1.0:
        raise ConfigError(
            f"--brightness and --contrast clip images to 0..1, but the float images of {train.name} span {low:g} to "
            f"{high:g}: give them in 0..1 (0..255 ones divided by 255, or as uint8), or leave both at 0"
        )


def _subsets(
    cfg: CoreConfig, train: UserSplit, test: UserSplit, test_subset: int | None
) -> tuple[UserSplit, UserSplit]:
    if cfg.data.train_subset:
        train = train.subset(cfg.data.train_subset)
    if test_subset:
        test = test.subset(test_subset)
    return train, test


def subset_class_warnings(cfg: CoreConfig, train: UserSplit, test: UserSplit) -> list[str]:
    """What to say of a subset (``--train-subset``, ``--test-subset``: the first N items) that holds at most half the
    data's classes: data ordered by class gives a run that learns, or is tested on, only the first few, with no other
    sign. Said only where the labels are at hand (tensors, a Dataset's ``targets``) and the subset is large enough
    (three items per class, 20 at least) that shuffled data all but never holds half the classes or fewer."""
    said = []
    for flag, n, split in (
        ("--train-subset", cfg.data.train_subset, train),
        ("--test-subset", cfg.data.test_subset, test),
    ):
        if not n or n < max(3 * split.num_classes, 20):
            continue
        labels = split.labels if isinstance(split, ImageTensors) else split.known_labels()
        if labels is None:
            continue
        held = int(torch.unique(labels).numel())
        if 2 * held <= split.num_classes:  # far fewer: shuffled data that misses a class or two says nothing
            said.append(
                f"{flag} {n}: the first {n} items of {split.name} hold {held} of its {split.num_classes} classes "
                "(is the data ordered by class?); a subset is the first N items, so shuffle the data first"
            )
    return said


def augment_for(cfg: CoreConfig, native: int, want: int) -> tuple[AugmentConfig, AugmentConfig]:
    """Train/eval pipelines: random crops smaller than the images (MXNet's 28x28), upscaling larger."""
    crop = want if want < native else None
    resize = want if want > native else None
    train = AugmentConfig(
        crop_padding=cfg.data.crop_padding,
        crop_size=crop,
        flip=cfg.data.flip,
        alternate_flip=cfg.data.alternate_flip,
        cutout=cfg.data.cutout,
        brightness=cfg.data.brightness,
        contrast=cfg.data.contrast,
        resize=resize,
    )
    test = AugmentConfig(crop_padding=0, crop_size=crop, flip=False, cutout=0, resize=resize)
    return train, test


def built_model(cfg: CoreConfig, num_classes: int, device: torch.device, train: UserSplit) -> tuple[nn.Module, float]:
    """The model (by name or import path, with its ``--model-arg``), seeded by ``cfg.run.seed``, on ``device`` in
    the configured memory format; a model registered with ``data_init_images=N`` is first initialised from N
    normalised training images. Also returns the seconds of that data-based init (device-synchronised; 0 without
    one): airbench's timer covers the fit, not the model's construction nor the loading of the images, which it
    does before its timer; on a GPU the fit's kernels and libraries are first used on random images, as airbench's
    warm-up run uses them before its timed runs."""
    torch.manual_seed(cfg.run.seed)
    model = usermodel.build(cfg, num_classes, usermodel.input_side(cfg, train)).to(device)
    images, seconds = model_info(cfg.data.model).data_init_images, 0.0
    if images:
        assert isinstance(model, DataInitModel)  # registered with data_init_images, so it defines data_init
        batch = usermodel.data_init_images(train, images, device)
        if device.type == "cuda":  # its result is replaced by the fit below
            model.data_init(torch.randn(batch.shape, device=device, generator=torch.Generator(device).manual_seed(0)))
        synchronize(device)
        started = time.perf_counter()
        model.data_init(batch)
        synchronize(device)
        seconds = time.perf_counter() - started
    if cfg.run.channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stubs omit it
    return model, seconds


def build_model(cfg: CoreConfig, num_classes: int, device: torch.device, train: UserSplit) -> nn.Module:
    """The model as ``built_model`` builds it, without the time of its data-based init."""
    return built_model(cfg, num_classes, device, train)[0]


def check_fits(cfg: CoreConfig, n_train: int, n_test: int, workers: int) -> BatchPlan:
    """The shard rules of ``DeviceBatches``, checked without building it (the launcher runs this before
    starting any worker): every rank needs samples and at least one full training batch."""
    plan = BatchPlan.resolve(cfg, workers)
    check_world(n_train, 0, workers)
    check_world(n_test, 0, workers)
    shard = train_shard_size(n_train, workers)
    if plan.per_worker > shard:
        raise ConfigError(
            f"batch size {plan.per_worker} per worker is larger than the {shard} training samples each "
            f"of {workers} workers gets from {n_train}; use a smaller batch, fewer workers or more data"
        )
    return plan


def steps_per_epoch(n_train: int, workers: int, per_worker: int) -> int:
    """Training steps each of ``workers`` takes an epoch (its shard in full batches: ``DeviceBatches`` drops the last
    partial one)."""
    return batches_per_epoch(train_shard_size(n_train, workers), per_worker, drop_last=True)


def resolve_out(cfg: CoreConfig) -> Path:
    return Path(cfg.run.out) if cfg.run.out else default_out_dir(cfg)


@contextlib.contextmanager
def claimed_out(cfg: CoreConfig) -> Iterator[Path]:
    """The run folder of the job about to start: ``--out``, else a default name made here, so that jobs started
    in the same second (each seeing the name free) never share one; the folders made for it are removed on
    leaving if the job wrote nothing there (``results.lock_run_folder``, taken after, did not make them)."""
    if cfg.run.out:
        yield Path(cfg.run.out)
        return
    names = (name for name in default_names(cfg) if not os.path.lexists(name))
    out = next(names)
    made = missing_folders(out.parent)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                out.mkdir()
                break
            except FileExistsError:  # another job made it between the look and the make: the next name
                out = next(names)
    except OSError as exc:
        remove_empty(made)
        raise ConfigError(f"--out {out}: cannot write there ({unwritable_reason(out, exc)}); give --out") from None
    try:
        yield out
    finally:
        remove_empty([out, *made])


RUN_FILES = ("checkpoint.pt", "summary.json", "metrics.jsonl", "config.json")  # any of them: a trainscale run
# Settings a resumed run may change: where things are and how the job is run, never what is trained.
# ``epochs`` may only grow (checked apart).
RESUME_MAY_CHANGE = frozenset(
    {
        "out",
        "resume",
        "progress",
        "log_every",
        "tensorboard",
        "checkpoint",
        "data_dir",
        "verify",
        "download",
        "threads",
        "loader_workers",
        "epochs",
        "rdzv_endpoint",
        "rdzv_id",
        "rdzv_timeout",
        "dist_timeout",
        "rpc_timeout",
        "max_restarts",
        "hosts",
        "ssh",
        "cluster",
        "baseline",
    }
)


def check_run_folder(
    out: Path, resume: bool, cfg: CoreConfig | None = None, probe: bool = True, holders: tuple[int, ...] = ()
) -> None:
    """Never write into a folder that holds anything unless resuming a trainscale run there with the same
    settings (``RESUME_MAY_CHANGE`` aside); never resume nothing. ``probe=False`` (a dry run, which writes
    nothing) judges writability from the nearest existing folder's permissions instead of a probe file.
    ``holders``: this job's processes that may hold the folder's lock (``check_not_in_use``)."""
    check_not_in_use(out, holders)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder; choose another --out")
    (check_folder_writable if probe else check_folder_permissions)(out, "--out")
    if not resume:
        if any((out / name).exists() for name in RUN_FILES):
            if not any((out / name).exists() for name in RUN_FILES if name != "config.json"):
                raise ConfigError(
                    f"--out {out} holds a run that stopped before its first epoch ended (its settings, no checkpoint "
                    "or results); delete that folder to start there again, or choose another --out"
                )
            raise ConfigError(f"--out {out} already holds a run; pass --resume to continue it or choose another --out")
        if out.is_dir() and any(p.name not in (*LAUNCHER_FILES, LOCK_FILE, ft.EVENTS_FILE) for p in out.iterdir()):
            raise ConfigError(
                f"--out {out} is a folder that already holds files and is not a trainscale run; "
                "choose a new or empty folder"
            )
        return
    if not (out / "checkpoint.pt").exists() and not (out / "config.json").exists():
        raise ConfigError(f"--resume: no checkpoint at {out / 'checkpoint.pt'}; run without --resume to start fresh")
    if not (out / "checkpoint.pt").exists():
        check_not_finished(out)
    if cfg is not None and (out / "config.json").exists():
        check_resume_matches(read_json(out / "config.json"), cfg)


def check_not_finished(out: Path) -> None:
    """``--resume`` on a folder whose run finished and whose checkpoint is gone (deleted, as the advice for a
    corrupt one says) would train again from the start over the finished run's results: refused."""
    try:
        summary = read_json(out / SUMMARY) if (out / SUMMARY).is_file() else {}
    except DataError:
        return
    if isinstance(summary, dict) and finished(summary):
        raise ConfigError(
            f"--resume: the run in {out} finished all its {summary.get(K.epochs_completed)} epoch(s) and has no "
            "checkpoint to go on from; its results stay as they are: choose another --out to train again"
        )


def check_not_in_use(out: Path, holders: tuple[int, ...] = ()) -> None:
    """Another job holding the folder's lock (``results.lock_run_folder``) is said first: its files say
    nothing yet about this job. This process's own lock, or one of its launchers' (``holders``), is no
    obstacle."""
    holder = lock_holder(out)
    if holder is not None and holder not in (os.getpid(), *holders):
        raise ConfigError(in_use_message(out, holder))


def check_model_input(cfg: CoreConfig) -> None:
    """The model takes ``--image-size`` images: a forward of two images on the meta device (shapes only, no
    memory or compute), so a size its downsampling or fixed dense layers cannot take is one line before
    any data is loaded or worker started, not a shape error in the first step."""
    if cfg.data.image_size is None:  # the model's own input size
        return
    size, info = cfg.data.image_size, model_info(cfg.data.model)
    try:
        with torch.device("meta"), torch.no_grad():
            usermodel.build(cfg, 10, size)(torch.empty(2, 3, size, size))
    except NotImplementedError:  # an operation without a meta kernel: shapes cannot be checked here
        return
    except (RuntimeError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0][:200]
        raise ConfigError(
            f"--image-size {size}: model {cfg.data.model} cannot take {size}x{size} images ({reason}); "
            f"leave --image-size out for its {info.input_size}x{info.input_size} or choose a size "
            "it takes"
        ) from None


def check_resume_matches(recorded: dict[str, Any], cfg: CoreConfig) -> None:
    """``--resume`` continues the run that ``config.json`` records: every setting must match, except where
    things are (``RESUME_MAY_CHANGE``) and ``epochs``, which may only grow."""
    now = cfg.to_dict()
    differ = [
        f"{k} (was {recorded[k]!r}, now {now[k]!r})"
        for k in now
        if k in recorded and k not in RESUME_MAY_CHANGE and recorded[k] != now[k]
    ]
    if differ:
        raise ConfigError(
            f"--resume: the run in {cfg.run.out} was started with other settings: {'; '.join(differ)}; "
            "resume with its settings or start a new run with another --out"
        )
    was = recorded.get("epochs", 0)
    if now["epochs"] < was:
        raise ConfigError(f"--resume: --epochs {now['epochs']:g} is fewer than the run's {was:g}; epochs may only grow")
    if now["epochs"] != was and not float(was).is_integer():
        raise ConfigError(
            f"--resume: --epochs {now['epochs']:g} over the run's {was:g}, whose last epoch trains in part: resume it "
            f"with --epochs {was:g}, or start a new run with another --out"
        )


def wants_resume(cfg: CoreConfig, out: Path | None, restarted: bool) -> bool:
    """Whether to load a checkpoint: ``--resume`` or a restarted job (``job_restarted``), and the main process
    (which owns the run folder) finds one; shared so every rank agrees. A run killed before its first
    checkpoint has none and starts from the beginning."""
    if not cfg.run.resume and not restarted:
        return False
    found = out is not None and (out / "checkpoint.pt").exists()
    return bool(broadcast_object(found))


def run_folder(cfg: CoreConfig, standby: bool = False, job: Job | None = None) -> tuple[RunWriter | None, bool]:
    """(the run folder on the main process, and on a ``standby`` one that may take over writing it: processes
    that write it in turns hold ``shared`` writers; whether to resume); see ``check_run_folder``. The checks that
    need only the config come first (see also ``results.lock_run_folder``, which removes a folder it made that a
    failed check left empty). ``job``: this process's place in the job (whether it creates the folder, which
    launchers hold its lock)."""
    check_model_input(cfg)
    main = is_main_process()
    out = resolve_out(cfg) if main else None
    if standby and not main:  # the main process's choice of name, not the next free one after it
        out = Path(cfg.run.out) if cfg.run.out else default_out_dir(cfg, free=False)
    restarted = job_restarted()
    resume = wants_resume(cfg, out if main else None, restarted)
    if out is None:
        return None, resume
    job = job or Job()
    first_writer = main and job.writes_folder_first and not restarted  # replicas share the folder
    if first_writer:
        check_run_folder(out, cfg.run.resume, cfg, holders=job.folder_holders)
    if cfg.run.resume and not resume:
        log.warning(
            "--resume: %s has no checkpoint (the run stopped before its first one); starting from the beginning", out
        )
    return RunWriter(out, clean=first_writer, tensorboard=cfg.run.tensorboard, shared=standby), resume


def summary_base(
    cfg: CoreConfig,
    plan: BatchPlan,
    params: int,
    device: torch.device,
    image_size: int,
    epoch_samples: int,
    writer: RunWriter | None,
) -> dict[str, Any]:
    """The run's description: the first part of summary.json (keys: ``record.K``)."""
    return {
        K.out: str(writer.out) if writer else None,
        K.model: cfg.data.model,
        K.params: params,
        K.dataset: cfg.data.dataset,
        K.mode: cfg.run.mode,
        K.world_size: world_size(),
        K.epochs: cfg.optim.epochs,
        K.batch_size: plan.global_batch,
        K.batch_per_worker: plan.per_worker,
        K.lr: plan.lr,
        K.precision: cfg.run.precision,
        K.image_size: image_size,
        K.train_samples_per_epoch: epoch_samples,
        K.seed: cfg.run.seed,
        K.environment: environment(device),
    }
