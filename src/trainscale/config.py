"""The configuration schema: dataclass sections whose fields carry their own flag name, help and choices.

A field is declared once, with ``option(...)``: its type annotation, default, help text and flag live
together, and the CLI (``trainscale train --help``), the TOML reader and ``config.json`` are all derived
from the fields. The core sections below are what every run has (data, optimisation, execution, the
launcher); a plug-in with settings of its own (a compressor family, a training mode) declares its own
section in its own package. ``CoreConfig`` holds the core sections as typed attributes (``cfg.optim.lr``,
``cfg.launch.workers``); ``modes.config.TrainConfig`` adds the modes' and the compression's sections. Flag
and TOML key names stay flat (a field name is unique across sections), and so does ``config.json``
(``to_dict``, ``from_flat``).

This module is a leaf: dataclasses and metadata, and each core section's checks of its own fields (checks that need
the registries or other sections live with their owners); of the rest of trainscale it imports only ``errors`` and
``registry``'s argument parser. What every number field shares is checked here, once, when a section is made: a
float must be finite (``--lr nan`` or ``inf`` would train until the loss overflows; a timeout of ``inf`` overflows
the timers), and a field may declare its range with ``option(above=, at_least=, at_most=)``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from trainscale.errors import ConfigError, require
from trainscale.registry import parse_args

S = TypeVar("S", bound="Section")
C = TypeVar("C", bound="CoreConfig")

MAX_WAIT_S = 7 * 86400.0  # the longest timeout a setting may ask for (torch's timers take milliseconds)


MAX_THREADS = 1024  # torch's thread pool per process; 100,000 crashed OpenMP (SIGSEGV, no message)


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    short: str | None = None,
    aliases: Sequence[str] = (),
    choices: Sequence[str] | None = None,
    above: float | None = None,
    at_least: float | None = None,
    at_most: float | None = None,
    pairs: bool = False,
) -> Any:
    """A config field: ``default`` (a list is copied per instance), the help line, and how the flag is
    spelled when it is not ``--`` plus the field name with dashes (``short``: e.g. ``-K``; ``aliases``:
    other long spellings). ``choices`` limits a string field; ``above``, ``at_least`` and ``at_most`` a
    number field (None, the absent value, always passes). ``pairs``: a list of ``KEY=VALUE`` strings, its flag
    repeatable, and a TOML table ``{key = value}`` read as such a list (``registry.format_args``)."""
    meta = {
        "pairs": pairs,
        "help": help,
        "flag": flag,
        "short": short,
        "aliases": tuple(aliases),
        "choices": tuple(choices) if choices else None,
        "bounds": {"above": above, "at_least": at_least, "at_most": at_most},
    }
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def same_option(section: type, name: str, help: str | None = None) -> Any:
    """The option ``name`` of ``section`` again, for another command that takes it too: one default, one flag,
    one set of bounds (``help``: its line for that command, if it needs other words)."""
    field = {f.name: f for f in dataclasses.fields(section)}[name]
    meta = {**field.metadata, "help": help or field.metadata["help"]}
    if field.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=field.default_factory, metadata=meta)
    return dataclasses.field(default=field.default, metadata=meta)


def flag_name(field: dataclasses.Field) -> str:
    """The long flag of a field: ``--batch-size`` for ``batch_size`` unless the field says otherwise."""
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def spellings(field: dataclasses.Field) -> list[str]:
    """Every spelling of a field's flag: its short one (``-K``), its long one, then its aliases (``--gpus``)."""
    short = [field.metadata["short"]] if field.metadata.get("short") else []
    return [*short, flag_name(field), *field.metadata.get("aliases", ())]


FLOAT32_MAX = 3.4028234663852886e38  # a setting multiplies float32 tensors (lr, momentum...)


def bound_problem(
    value: Any, above: float | None = None, at_least: float | None = None, at_most: float | None = None
) -> str | None:
    """What a number must be when ``value`` is not (None when it is fine, or not a number): finite for a
    float, then within the bounds given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "a finite number"
    limits = [
        (above, ">", value > (above or 0)),
        (at_least, ">=", value >= (at_least or 0)),
        (at_most, "<=", value <= (at_most or 0)),
    ]
    if all(ok for bound, _, ok in limits if bound is not None):
        fits = not isinstance(value, float) or abs(value) <= FLOAT32_MAX
        return None if fits else f"within float32's range (magnitude at most {FLOAT32_MAX:.4g}: tensors hold it so)"
    words = [
        "a positive number" if sign == ">" and bound == 0 else f"{sign} {_bound_text(bound)}"
        for bound, sign, _ in limits
        if bound is not None
    ]
    return " and ".join(words)


def _bound_text(bound: float) -> str:
    """A bound as a person writes it: 1048576 rather than 1.04858e+06, 0.5 as 0.5."""
    return f"{int(bound)}" if float(bound).is_integer() and abs(bound) < 1e15 else f"{bound:g}"


class Section:
    """Base of every config section: a dataclass of ``option`` fields. ``TITLE`` heads the section's group in
    ``--help``; ``FOR`` says which runs take it, in the error that refuses it elsewhere (default: the modes that
    declare it). A built-in section's name (its ``[name]`` TOML table) is its attribute's in ``TrainConfig``; a
    plug-in's is ``NAME``, else its class name less ``Config``, in lower case. ``validate`` checks the section's
    own fields; checks across sections live with the mode or the composition root."""

    TITLE: ClassVar[str] = "options"
    FOR: ClassVar[str | None] = None
    NAME: ClassVar[str | None] = None

    def validate(self) -> None:
        """Checks of this section's own fields (ConfigError, one line)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            problem = bound_problem(value, **f.metadata.get("bounds", {}))
            if problem:
                raise ConfigError(f"{flag_name(f)} must be {problem}, got {value}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


@dataclass
class DataConfig(Section):
    TITLE: ClassVar[str] = "model and data"

    model: str = option(
        "resnet9", "model name (see `trainscale models`), or your own: an import path package.module:function"
    )
    model_args: list[str] = option(
        [],
        "KEY=VALUE keyword argument for the model's function (repeatable; numbers, true/false, else text)",
        flag="--model-arg",
        pairs=True,
    )
    dataset: str = option(
        "cifar10", "cifar10, cifar100, imagefolder, synthetic, or your own: an import path package.module:function"
    )
    data_dir: str | None = option(None, "folder holding the dataset (else $TRAINSCALE_DATA, else ~/.cache/trainscale)")
    verify: bool = option(True, "check every data file's size and MD5 (default on)")
    download: bool = option(True, "download the dataset when it is absent (default on)")
    train_subset: int | None = option(None, "train on the first N training images")
    test_subset: int | None = option(
        None, "evaluate on the first N test images (default: all; 2,000 random images for --dataset synthetic)"
    )
    image_size: int | None = option(None, "input size; default: the model's (CIFAR is cropped or upscaled to it)")
    crop_padding: int = option(4, "pad-and-random-crop padding in pixels (default 4)")
    flip: bool = option(True, "random horizontal flips (default on)")
    alternate_flip: bool = option(
        False,
        "with --flip: each image flipped on alternate epochs (its first epoch's coin "
        "decides which) instead of a new coin every epoch (airbench)",
    )
    cutout: int = option(0, "Cutout square size, 0 = off (cifar10-fast uses 8)")
    brightness: float = option(
        0.0,
        "per-image brightness change in training: factors uniform in 1 +- this, 0 = off (e.g. 0.2), below 1",
        at_least=0,
    )
    contrast: float = option(
        0.0,
        "per-image contrast change in training (distance from the image's mean scaled by a factor uniform in "
        "1 +- this), 0 = off, below 1",
        at_least=0,
    )
    loader_workers: int = option(
        2,
        "DataLoader worker processes per training process, for a dataset function that returns "
        "torch Datasets (0: read in the training process)",
        at_least=0,
    )

    def validate(self) -> None:
        """``--model-arg`` items are KEY=VALUE, each key once; a brightness or contrast of 1 or more could make an
        image black or flat."""
        parse_args(self.model_args)
        for flag, value in (("--brightness", self.brightness), ("--contrast", self.contrast)):
            require(value < 1.0, f"{flag} must be below 1 (0.2: factors 0.8..1.2), got {value}")


@dataclass
class OptimConfig(Section):
    TITLE: ClassVar[str] = "optimisation"

    recipe: str | None = option(
        None,
        "named training settings for every setting left unset (default: the model's "
        "own; `trainscale models --recipes` lists them)",
    )
    epochs: float = option(
        24,
        "number of epochs; a fraction trains the last one in part (7.5: seven epochs, then the first half of the "
        "eighth's steps, the schedule ending there)",
        above=0,
    )
    batch_size: int = option(512, "global batch size, split across workers")
    batch_per_worker: int | None = option(None, "batch per worker instead (global = this x workers)")
    lr: float = option(0.4, "peak/base learning rate")
    lr_scaling: str = option(
        "none", "'linear': lr x global batch / --base-batch-size (Goyal et al.)", choices=("none", "linear")
    )
    base_batch_size: int = option(128, "batch size the --lr was tuned for (linear scaling)")
    optimizer: str = option(
        "sgd",
        "sgd; muon (Muon batched over the conv filters, SGD on the rest); adamw, adam, nadam, radam, adafactor "
        "(torch.optim); lars, lamb (layer-wise trust ratio); or an import path package.module:factory",
    )
    optim_arg: list[str] = option(
        [],
        "KEY=VALUE: a keyword of the optimizer's own (e.g. betas=0.9,0.95 or eps=1e-8), checked against its "
        "signature; repeatable",
        flag="--optim-arg",
        pairs=True,
    )
    no_decay_norm_bias: bool = option(
        False, "no weight decay for biases and normalisation layers' weights (every 1-D parameter)"
    )
    clip_grad_norm: float | None = option(
        None, "clip the gradients' global L2 norm to X before each optimizer step", above=0
    )
    accumulate: int = option(
        1,
        "split each worker's batch into N micro-batches and sum their gradients before one optimizer step "
        "(the batch per step and the schedule stay; activation memory is that of batch/N; DDP communicates "
        "once per step)",
        at_least=1,
    )
    ema: float | None = option(
        None,
        "keep an exponential moving average of the weights with this decay (e.g. 0.999), updated every "
        "optimizer step, evaluated beside the model and checkpointed",
        above=0,
        at_most=1,
    )
    muon_lr: float = option(0.02, "--optimizer muon: Muon's learning rate (follows --schedule; not scaled by batch)")
    muon_momentum: float = option(0.95, "--optimizer muon: Muon's momentum")
    muon_compile: str = option(
        "auto",
        "--optimizer muon: torch.compile Muon's batched Newton-Schulz iteration: on, off, or auto (on a GPU only)",
        choices=("auto", "on", "off"),
    )
    head_lr_factor: float = option(
        1.0,
        "the classifier layer's learning rate as a multiple of --lr (its weight decay "
        "divided by it, so lr x weight decay is the same in every group)",
    )
    momentum: float = option(0.9, "SGD momentum")
    nesterov: bool = option(False, "Nesterov momentum")
    weight_decay: float = option(5e-4, "L2 weight decay")
    schedule: str = option("onecycle", "onecycle, step, cosine or constant")
    warmup_epochs: float | None = option(None, "linear warm-up length (onecycle: the peak epoch)")
    milestones: list[float] = option(
        [41, 61],
        "step schedule: 1-based epochs where lr *= gamma, e.g. 41,61 (a recipe's are scaled to --epochs, "
        "and may then be fractional: 1.5 is half-way through epoch 1)",
    )
    gamma: float = option(0.1, "step schedule factor", above=0)
    label_smoothing: float = option(0.0, "label smoothing")
    tta: bool = option(False, "flip test-time augmentation at evaluation")
    tta_translate: int = option(
        0, "with --tta, the last evaluation also averages the views shifted by N pixels (airbench: 1; 6 views in all)"
    )
    tta_select: float = option(
        1.0,
        "with --tta, the last evaluation gives its extra views only to this fraction of each test batch, the images "
        "the model is least sure of (selective test-time augmentation; 1: all)",
        above=0,
        at_most=1,
    )
    nonfinite: str = option(
        "stop",
        "a step whose loss or gradients are NaN/inf: 'stop' training (default), or "
        "'skip' it (no update; counted per epoch; costs one device sync and, with several "
        "workers, one all-reduce per step; an epoch of only skipped steps still stops)",
        choices=("stop", "skip"),
    )

    def __post_init__(self) -> None:
        if isinstance(self.epochs, float) and self.epochs.is_integer():
            self.epochs = int(self.epochs)  # 8.0 from the command line is the recipe's 8, also in summary.json
        super().__post_init__()

    @property
    def epoch_count(self) -> int:
        """The epochs the run walks, the last of them in part where ``epochs`` has a fraction."""
        return math.ceil(self.epochs)

    @property
    def partial_last_epoch(self) -> bool:
        """Whether ``epochs`` has a fraction, so that the last epoch trains only part of its steps."""
        return self.epoch_count != self.epochs

    def steps_in_epoch(self, epoch: int, steps: int) -> int:
        """How many of an epoch's ``steps`` epoch ``epoch`` (0-based) trains: all, but in the last epoch of a
        fractional ``epochs``, those that bring the run to ``epochs`` x ``steps`` steps (rounded up, so at least
        one): the run's length in steps, as airbench counts it, whatever the batch."""
        if epoch + 1 < self.epoch_count or not steps:
            return steps
        total = math.ceil(self.epochs * steps - 1e-9)  # 7.6 x 25 is 190.00000000000003 in floats
        return max(1, min(steps, total - epoch * steps))

    def total_steps(self, steps: int) -> int:
        """The steps a worker takes in the whole run, its epochs ``steps`` long."""
        return (self.epoch_count - 1) * steps + self.steps_in_epoch(self.epoch_count - 1, steps)

    def validate(self) -> None:
        """The choices whose names the engine does not register elsewhere (the rest: ``train.checks``)."""
        require(
            self.nonfinite in NONFINITE, f"--nonfinite must be one of {', '.join(NONFINITE)}, got {self.nonfinite!r}"
        )


COMPILE_MODES = ("default", "max-autotune")


@dataclass
class RunConfig(Section):
    TITLE: ClassVar[str] = "execution"

    precision: str = option(
        "fp32",
        "fp32, bf16 (autocast), fp16 (CUDA, with a grad scaler), or auto: bf16 where the device computes it natively "
        "(a GPU with bf16, a CPU with AVX-512), else fp32",
        choices=("fp32", "bf16", "fp16", "auto"),
    )
    channels_last: bool = option(True, "channels_last memory format (default on)")
    compile: bool = option(False, "torch.compile the model")
    train_step: str = option(
        "auto",
        "how the training step runs: eager; compiled (forward, backward and optimizer step as torch.compile "
        "graphs; also under DDP); graphed (compiled, replayed as CUDA graphs; one CUDA process); captured "
        "(compiled, the whole step captured as one CUDA graph; one CUDA process); auto (default: captured for one "
        "CUDA process with a model of trainscale's, graphed then eager if it fails in the warm-up; else eager)",
        choices=("auto", "eager", "compiled", "graphed", "captured"),
    )
    compile_mode: str = option(
        "default",
        "torch.compile's mode for a compiled, graphed or captured step and --compile: default, or max-autotune (times "
        "several kernels for each convolution and matrix product in the warm-up: minutes on a machine's first "
        "run, cached after; the evaluation's compiled forward keeps the default)",
        choices=COMPILE_MODES,
    )
    keep_memory: bool = option(
        True,
        "keep the host memory a step frees for the next step (glibc: no mmap, no "
        "trim: airbench94 10-29%% more img/s on a 2-core CPU; the resident set stays at its peak; default on)",
    )
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    threads: int | None = option(None, "torch intra-op threads", at_most=MAX_THREADS)
    seed: int = option(0, "random seed (model init, data order, augmentation)")
    mode: str = option(
        "auto",
        "auto (default: sync when several workers, async with --servers, else local), "
        "local, sync, or a parameter-server mode: async, ps-sync, ma",
    )
    target_acc: float | None = option(None, "test accuracy (fraction) whose first crossing gives time-to-accuracy")
    eval_every: int = option(
        1,
        "evaluate on the test set after every N-th epoch and always after the last (0: after "
        "the last only; skipped epochs have no test figures and cannot reach --target-acc)",
    )
    out: str | None = option(None, "run folder (default runs/<model>-<dataset>-<time>)")
    resume: bool = option(False, "continue the run in --out from its last checkpoint")
    checkpoint: bool = option(True, "write a checkpoint every epoch (default on)")
    progress: bool = option(True, "progress bar on a terminal, a line every --log-every steps otherwise (default on)")
    log_every: int = option(
        50,
        "every N steps, the loss, lr, img/s and step time into the run folder's steps.jsonl (one device sync "
        "per N steps; 0: off)",
        at_least=0,
    )
    tensorboard: bool = option(
        False, "also write TensorBoard event files into the run folder (needs trainscale[tensorboard])"
    )
    dry_run: bool = option(
        False,
        "check the settings, the mode, the run folder and the data (never downloaded), "
        "print the resolved config as JSON and exit without training or writing anything",
    )

    def validate(self) -> None:
        if self.out is not None and not self.out.strip():
            raise ConfigError("--out is empty; give a folder, or leave --out out for runs/<model>-<dataset>-<time>")
        if self.resume and self.out is None:  # else a new default folder, with no checkpoint to continue
            raise ConfigError("--resume continues the run in --out: give --out DIR, the run folder to continue")


@dataclass
class LaunchConfig(Section):
    """Several processes: local workers through torch's elastic agent, nodes over c10d (see app.launch).
    ``workers``: processes on this node (None: one, or one per ``--devices`` entry); world = workers x nnodes."""

    TITLE: ClassVar[str] = "data parallel (sync mode)"

    workers: int | None = option(None, "worker processes on this node (default 1, or one per --devices GPU)")
    nnodes: int = option(1, "number of machines (each runs the same command with its own --node-rank)")
    node_rank: int = option(0, "this machine's index, 0..nnodes-1; node 0 hosts the rendezvous and the run folder")
    rdzv_endpoint: str | None = option(
        None, "HOST:PORT of the c10d rendezvous on node 0 (single node: a free local port)"
    )
    rdzv_id: str | None = option(None, "job id shared by all nodes (default: 'trainscale' for several nodes)")
    rdzv_timeout: float = option(
        300.0, "seconds to wait for all nodes to join, and for node 0's endpoint", above=0, at_most=MAX_WAIT_S
    )
    hosts: str | None = option(
        None, "file with one host per line ('host' or 'host slots=N'): print the per-node commands"
    )
    ssh: bool = option(False, "with --hosts: run the per-node commands over ssh instead of printing them")
    cluster: str | None = option(
        None,
        "an emulated cluster (trainscale cluster up NAME): one node of --workers "
        "(and --servers) on each of its hosts, rendezvous at host 0",
    )
    devices: list[int] | None = option(
        None, "GPU indices, one worker per GPU, e.g. 0,1,2,3 (sets CUDA_VISIBLE_DEVICES)", aliases=("--gpus",)
    )
    backend: str = option("auto", "auto (nccl on CUDA, gloo on CPU), gloo or nccl", choices=("auto", "gloo", "nccl"))
    max_restarts: int = option(
        0, "let the elastic agent restart failed workers N times; they resume from the last finished epoch's checkpoint"
    )
    dist_timeout: float = option(
        300.0, "seconds any collective may wait for a peer before the job fails", above=0, at_most=MAX_WAIT_S
    )
    start_method: str = option(
        "auto",
        "how workers start: auto (forked from `trainscale train` where no CUDA can be inherited, so they share its "
        "imports; otherwise new interpreters) or spawn (new interpreters always, as torchrun starts them)",
        choices=("auto", "spawn"),
    )
    baseline: str | None = option(
        None, "a previous 1-worker run folder: summary.json gets scaling_efficiency against it"
    )

    def validate(self) -> None:
        """Process counts, rendezvous, devices."""
        require(self.workers is None or self.workers > 0, f"--workers must be a positive integer, got {self.workers}")
        require(self.nnodes > 0, f"--nnodes must be a positive integer, got {self.nnodes}")
        require(0 <= self.node_rank < self.nnodes, f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        require(self.max_restarts >= 0, f"--max-restarts must be >= 0, got {self.max_restarts}")
        require(self.dist_timeout > 0, f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}")
        require(self.rdzv_timeout > 0, f"--rdzv-timeout must be > 0 seconds, got {self.rdzv_timeout}")
        require(self.backend in BACKENDS, f"--backend must be one of {', '.join(BACKENDS)}, got '{self.backend}'")
        require(
            not self.devices or (len(set(self.devices)) == len(self.devices) and min(self.devices) >= 0),
            f"--devices must list distinct GPU indices, got {self.devices}",
        )
        require(
            not self.devices or self.workers in (None, len(self.devices)),
            f"--workers {self.workers} but --devices lists {len(self.devices or [])} GPU(s): one worker per GPU",
        )
        require(
            self.rdzv_endpoint is None or _endpoint_ok(self.rdzv_endpoint),
            f"--rdzv-endpoint must be HOST:PORT (port 1-65535), got '{self.rdzv_endpoint}'",
        )
        require(
            self.nnodes == 1 or self.rdzv_endpoint is not None,
            "--nnodes > 1 needs --rdzv-endpoint HOST:PORT of node 0 (the same on every node)",
        )
        require(
            not self.ssh or self.hosts is not None, "--ssh runs the per-node commands of --hosts FILE; give --hosts"
        )
        require(
            self.cluster is None or (self.nnodes, self.node_rank, self.rdzv_endpoint, self.hosts) == (1, 0, None, None),
            "--cluster places one node on each emulated host itself: leave out --nnodes, "
            "--node-rank, --rdzv-endpoint and --hosts",
        )

    @property
    def local_workers(self) -> int:
        """Worker processes on this node: ``workers``, else one per ``--devices`` entry, else one (what
        ``resolve_parallel`` fills ``workers`` with)."""
        return self.workers or (len(self.devices) if self.devices else 1)

    def processes(self) -> int | None:
        """Workers (replicas) of the whole job, ``workers`` per node: None in a ``--cluster`` parent that has not
        read its cluster yet (``app.preflight`` checks again with ``nnodes`` set to the hosts)."""
        if self.cluster and self.nnodes == 1:
            return None
        return (self.workers or 1) * max(self.nnodes, 1)


BACKENDS = ("auto", "gloo", "nccl")
NONFINITE = ("stop", "skip")


def _endpoint_ok(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


CORE_SECTIONS: tuple[type[Section], ...] = (DataConfig, OptimConfig, RunConfig, LaunchConfig)


_SCHEMAS: dict[tuple[type, tuple[object, ...]], Any] = {}  # CoreConfig._schema's, per class and plug-in key


@dataclass
class CoreConfig:
    """What every run has, whatever its mode: one typed attribute per core section (``cfg.optim.lr``).
    ``modes.config.TrainConfig`` adds the other built-in sections the same way; a section of a mode registered
    from outside trainscale is held in ``plugins`` and read with ``cfg.section(ItsConfig)``. Flat names (flags,
    TOML keys, ``config.json``) map to a section's field through ``field_map``; ``to_dict``/``from_flat``
    convert."""

    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    launch: LaunchConfig = dataclasses.field(default_factory=LaunchConfig)
    plugins: dict[str, Section] = dataclasses.field(default_factory=dict)

    @classmethod
    def plugin_types(cls) -> dict[str, type[Section]]:
        """Sections beyond the typed attributes, by name (``TrainConfig``: those of modes registered later)."""
        return {}

    @classmethod
    def plugin_key(cls) -> tuple[object, ...]:
        """What ``plugin_types`` depends on (the schema is cached per class and key)."""
        return ()

    @classmethod
    def section_types(cls) -> dict[str, type[Section]]:
        """Section name -> class: the typed attributes in declaration order (the order of ``--help`` and
        ``config.json``), then the plug-ins'."""
        return dict(cls._schema()[0])

    @classmethod
    def field_map(cls) -> dict[str, tuple[str, dataclasses.Field]]:
        """Flat field name -> (section name, field), for every section."""
        return dict(cls._schema()[1])

    @classmethod
    def _schema(cls) -> tuple[dict[str, type[Section]], dict[str, tuple[str, dataclasses.Field]]]:
        key = (cls, cls.plugin_key())
        if key not in _SCHEMAS:
            hints = typing.get_type_hints(cls)
            typed = {
                f.name: hints[f.name]
                for f in dataclasses.fields(cls)
                if isinstance(hints[f.name], type) and issubclass(hints[f.name], Section)
            }
            kinds = {**typed, **{k: v for k, v in cls.plugin_types().items() if k not in typed}}
            fields = {f.name: (attr, f) for attr, kind in kinds.items() for f in dataclasses.fields(kind)}
            _SCHEMAS[key] = (kinds, fields)
        return _SCHEMAS[key]

    def sections(self) -> Iterator[tuple[str, Section]]:
        """(name, section) for every section, plug-ins' included (at their defaults when not set)."""
        for attr, kind in self.section_types().items():
            yield attr, getattr(self, attr) if attr in self.__dataclass_fields__ else self.plugins.get(attr, kind())

    def section(self, kind: type[S]) -> S:
        """This config's section of class ``kind`` (e.g. a plug-in mode's own)."""
        found = next((s for _, s in self.sections() if type(s) is kind), None)
        if found is None:
            raise KeyError(f"{kind.__name__} is not a section of {type(self).__name__}")
        return found

    def to_dict(self) -> dict[str, Any]:
        """Every field of every section, flat (``config.json``'s form)."""
        return {k: v for _, section in self.sections() for k, v in section.to_dict().items()}

    @classmethod
    def from_flat(cls: type[C], values: Mapping[str, Any]) -> C:
        """A config from flat names (``config.json``, flags, TOML): each value goes to its section, the rest
        default; an unknown name is a KeyError."""
        fields, types_ = cls.field_map(), cls.section_types()
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise KeyError(f"unknown setting(s): {', '.join(unknown)}")
        grouped: dict[str, dict[str, Any]] = {attr: {} for attr in types_}
        for name, value in values.items():
            grouped[fields[name][0]][name] = value
        built = {attr: kind(**grouped[attr]) for attr, kind in types_.items()}
        typed = {k: v for k, v in built.items() if k in cls.__dataclass_fields__}
        plugins = {k: v for k, v in built.items() if k not in typed and v != types_[k]()}
        return cls(**typed, plugins=plugins)  # type: ignore[arg-type]

    @classmethod
    def flat(cls: type[C], **values: Any) -> C:
        """``from_flat`` with keywords: ``TrainConfig.flat(lr=0.1, workers=2)``."""
        return cls.from_flat(values)

    def replace(self: C, **values: Any) -> C:
        """A copy with the flat-named fields ``values`` changed (``dataclasses.replace`` across sections)."""
        unknown = sorted(set(values) - set(self.field_map()))
        if unknown:
            raise TypeError(f"unknown setting(s): {', '.join(unknown)}")
        return type(self).from_flat({**self.to_dict(), **values})


def field_types(cls: type) -> dict[str, Any]:
    """Each field's resolved type annotation (``int | None`` etc., not the string)."""
    return _field_types(cls)


@functools.cache
def _field_types(cls: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def type_name(hint: Any) -> str:
    """``int``, ``list[int]``, ``int or none``: how an expected type is named in an error."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args) + " (or absent)"
    if typing.get_origin(hint) is list:
        return f"a list of {PLURALS.get(args[0], type_name(args[0]))}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


PLURALS = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


def coerce(hint: Any, value: Any) -> Any:
    """``value`` as the type ``hint`` asks for, or TypeError. Strict: a string is never a number, a bool
    never an integer; an integer is accepted where a float is expected."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return coerce(inner, value)
    if typing.get_origin(hint) is list:
        if not isinstance(value, (list, tuple)):
            raise TypeError(type_name(hint))
        return [coerce(typing.get_args(hint)[0], v) for v in value]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float) and isinstance(value, bool) or not isinstance(value, hint):
        raise TypeError(type_name(hint))
    return value
