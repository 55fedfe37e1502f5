"""``trainscale profile``: what one worker's step costs on this machine, measured, for the planner.

A planner is only as good as its compute figure, so nothing here is estimated: the model runs real
training steps (synthetic images of its input size: shapes and speed only) under the run's precision and
memory format, wrapped in DDP on a one-rank group so that DDP's own buckets, and the moment each becomes
ready during backward, are observed rather than guessed. Each requested compressor then encodes and
decodes the model's real gradients through the exchange layer the training runs use, which also
reports the collectives it would launch and their sizes. Timings are medians of ``repeats`` steps after
``warmup`` steps; the spread (min, max) is kept beside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import statistics
import time
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from trainscale.compression import CompressionStats, Exchange, create_compressor
from trainscale.config import MAX_THREADS, DataConfig, Section, option, same_option
from trainscale.errors import ConfigError
from trainscale.io import atomic_write_text, check_output, check_replaceable, dumps
from trainscale.models import MODELS, create_model, list_models, model_info
from trainscale.models.registry import DataInitModel
from trainscale.plan.inputs import check_input_data, measure_input
from trainscale.plan.methods import MethodSpec, parse_spec
from trainscale.plan.overlap import (
    OverlapMeasurement,
    allreduce_hook,
    comm_alone,
    paired_exposure,
    per_collective,
    running_peer,
    schedule_bound,
)
from trainscale.registry import is_import_path, parse_args
from trainscale.train.precision import Precision, peak_memory_mb, resolve_device, synchronize
from trainscale.train.usermodel import check_model_takes

FORMAT = "trainscale-profile/1"
log = logging.getLogger("trainscale.plan")
LATE_EPOCH = 10**6  # past every compressor's warm-up (DGC's density ramp)


@dataclass
class ProfileConfig(Section):
    TITLE: ClassVar[str] = "profile"

    model: str = option(
        "resnet9", "model to profile: a registered name (trainscale models) or an import path package.module:function"
    )
    model_args: list[str] = option(
        [], "KEY=VALUE keyword argument for the model's function (repeatable)", flag="--model-arg", pairs=True
    )
    batch_size: int = option(128, "images per worker per step")
    precision: str = option(
        "fp32",
        "fp32, bf16 (autocast), fp16 (CUDA) or auto (bf16 where the device computes it natively, else fp32)",
        choices=("fp32", "bf16", "fp16", "auto"),
    )
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    channels_last: bool = option(True, "channels_last memory format, as training uses by default")
    threads: int | None = option(
        None,
        "torch intra-op threads (default: this machine's cores, or the CPUs of "
        "--cpus rounded up: what one worker gets)",
        at_most=MAX_THREADS,
    )
    cpus: float | None = option(
        None,
        "measure under a CPU quota of C CPUs, as an emulated host of "
        "`trainscale cluster` gets (0.5 for 4 hosts on 2 cores); needs root",
    )
    crop_padding: int = option(4, "augmentation as training does it: pad-and-random-crop padding (0: none)")
    compress: list[str] = option(
        [],
        "also time this compressor on the model's gradients: METHOD[:key=value,...], "
        "e.g. bf16, topk:ratio=0.01,granularity=entire, powersgd:rank=2 (repeatable)",
    )
    repeats: int = option(10, "timed steps (medians and spread are over these)")
    overlap: bool = option(
        True,
        "also measure what DDP costs per step and how much of a bucket's all-reduce hides under backward here "
        "(two ranks of this process: gloo over 127.0.0.1 on a CPU, NCCL between this GPU and a second one of the "
        "machine); the plan uses them",
    )
    warmup: int = option(3, "untimed steps first (allocation, DDP's bucket rebuild, caches)")
    input_data: str | None = option(
        None,
        "also time your dataset's input pipeline alone (package.module:function returning torch Datasets), read "
        "by --loader-workers DataLoader processes as training reads it; the plan caps each host at it",
    )
    data_dir: str | None = same_option(DataConfig, "data_dir")
    loader_workers: int = same_option(DataConfig, "loader_workers")
    out: str = option("profile.json", "where to write the profile (JSON)")


@dataclass
class Timing:
    """Seconds: the median of the repeats and their spread."""

    median: float
    min: float
    max: float
    repeats: int

    @classmethod
    def of(cls, samples: list[float]) -> Timing:
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))


@dataclass
class Bucket:
    """One DDP gradient bucket: its size and when it became ready (seconds after backward began)."""

    index: int
    nbytes: int
    ready_seconds: float


@dataclass
class CompressorProfile:
    """A compressor on this model's gradients: coding times for one step and the collectives it launches
    (``kind``, bytes this worker hands over), as measured by the exchange layer."""

    spec: str
    method: str
    granularity: str
    encode: Timing
    decode: Timing
    collectives: list[tuple[str, int]]

    @property
    def gathers(self) -> bool:
        """All-gather methods decode every worker's payload, so their decode grows with the workers."""
        return any(kind == "all_gather" for kind, _ in self.collectives)

    def bytes_of(self, kind: str) -> int:
        return sum(n for k, n in self.collectives if k == kind)


@dataclass
class Profile:
    model: str
    batch_size: int
    precision: str
    device: str
    threads: int
    cpus: float | None
    data: Timing
    forward: Timing
    backward: Timing
    optimizer: Timing
    gradient_bytes: int
    parameter_count: int
    buckets: list[Bucket]
    peak_memory_mb: float
    compressors: dict[str, CompressorProfile] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    tensor_bytes: list[int] = field(default_factory=list)  # every parameter's gradient, for whole-tensor PS
    format: str = FORMAT
    # measured here (None: not measured): the share of in-flight all-reduce that hid under backward, and what
    # DDP adds to a step (seconds); see trainscale.plan.overlap
    overlap: float | None = None
    step_overhead: float | None = None
    bucket_overhead: float | None = None  # what a collective costs beyond its bytes (seconds)
    # --input-data: images/s one training process's loader delivered, with how many workers, on how many cores
    input_images_per_sec: float | None = None
    input_workers: int | None = None
    input_cores: float | None = None
    overlap_seconds: dict[str, float] = field(default_factory=dict)  # the measurement behind ``overlap``
    overlap_unmeasured: str = ""  # why the overlap and DDP's costs were asked for but not measured

    @property
    def compute_seconds(self) -> float:
        """One step of one worker with nothing to communicate: its batch (augmented on the device),
        forward, backward, optimizer."""
        return self.data.median + self.forward.median + self.backward.median + self.optimizer.median

    def measured_costs(self) -> dict[str, Any]:
        """What this profile measured of a synchronous step's communication (``overlap``, ``step_overhead``,
        ``bucket_overhead``), by the Setting fields it fills; what it did not measure is absent."""
        costs = {"overlap": self.overlap, "step_overhead": self.step_overhead, "bucket_overhead": self.bucket_overhead}
        return {k: v for k, v in costs.items() if v is not None}

    @property
    def pair_bytes_per_sec(self) -> float | None:
        """The rate the overlap measurement's two ranks all-reduced the buckets at, beyond each collective's own
        cost: a ring of two sends each rank's whole buffer once, so it is the rate a plan's link between two
        workers of one host takes (``--intra-bandwidth``). None where nothing was measured."""
        if not self.overlap_seconds:
            return None
        wire = self.overlap_seconds["comm"] - len(self.buckets) * (self.bucket_overhead or 0.0)
        return sum(b.nbytes for b in self.buckets) / wire if wire > 0 else None

    @property
    def on_cpu(self) -> bool:
        """Measured on a CPU (whose cores the step's compute already fills), not an accelerator."""
        return str(self.environment.get("device", "cpu")).startswith("cpu")

    def compressor(self, spec: MethodSpec) -> CompressorProfile:
        if spec.text not in self.compressors:
            have = ", ".join(self.compressors) or "none"
            raise ConfigError(
                f"the profile has no timings for --compress {spec.text} (it has: {have}); "
                f"run trainscale profile again with --compress {spec.text}"
            )
        return self.compressors[spec.text]

    def to_json(self) -> str:
        return dumps(dataclasses.asdict(self))


def load_profile(path: str | Path) -> Profile:
    """A profile written by ``trainscale profile``; anything else is a one-line ConfigError."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--profile {path}: no such file; make one with trainscale profile --out {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        hint = " (a TOML file: a cluster file goes to --cluster)" if Path(path).suffix == ".toml" else ""
        raise ConfigError(
            f"--profile {path}: not JSON{hint}; make one with trainscale profile --out profile.json"
        ) from None
    except OSError as exc:  # a folder, a FIFO's error, no permission
        raise ConfigError(f"--profile {path}: cannot be read ({exc.strerror or exc}); give a profile file") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ConfigError(f"--profile {path}: not a trainscale profile ({FORMAT}); make one with trainscale profile")
    try:
        profile = _profile_from(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"--profile {path}: damaged ({type(exc).__name__}: {exc}); make it again with trainscale profile"
        ) from None
    problem = profile_problem(profile)
    if problem:
        raise ConfigError(f"--profile {path}: {problem}; make it again with trainscale profile")
    return profile


def profile_problem(profile: Profile) -> str | None:
    """What is wrong with a profile read back (None when nothing): every field of the type it is declared
    with, every number finite and >= 0, and a step that takes time (the planner divides by it)."""
    problem = _field_problem(profile, "")
    if problem:
        return problem
    if not profile.compute_seconds > 0 or profile.batch_size < 1:
        return f"its step takes {profile.compute_seconds} s at batch {profile.batch_size}, which plans nothing"
    bad = next((f"{name}.repeats" for name, t in _timings(profile) if t.repeats < 1), None)
    return f"{bad} is below 1" if bad else None


def _timings(profile: Profile) -> list[tuple[str, Timing]]:
    return [
        *((n, getattr(profile, n)) for n in ("data", "forward", "backward", "optimizer")),
        *(
            (f"compressors.{k}.{n}", getattr(c, n))
            for k, c in profile.compressors.items()
            for n in ("encode", "decode")
        ),
    ]


def _field_problem(obj: Any, prefix: str) -> str | None:
    """The first field of dataclass ``obj`` whose value does not fit its declared type (numbers finite and
    >= 0), named by its path in the file, with the value found."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), prefix + f.name
        problem = _value_problem(hints[f.name], value, name)
        if problem:
            return problem
    return None


def _value_problem(hint: Any, value: Any, name: str) -> str | None:
    if dataclasses.is_dataclass(hint):
        return _field_problem(value, name + ".")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return None if value is None else _value_problem(next(a for a in args if a is not type(None)), value, name)
    if origin is list:
        inner = args[0]
        if typing.get_origin(inner) is tuple and isinstance(value, list):  # JSON's tuples are lists
            return next(
                (
                    f"{name} holds {ascii(v)[:40]}, not a [kind, bytes] pair"
                    for v in value
                    if not (len(v) == 2 and isinstance(v[0], str) and _number_problem(int, v[1], name) is None)
                ),
                None,
            )
        if not isinstance(value, list):
            return f"{name} must be a list, got {ascii(value)[:40]}"
        return next((p for i, v in enumerate(value) if (p := _value_problem(inner, v, f"{name}[{i}]"))), None)
    if origin is dict:
        if not isinstance(value, dict):
            return f"{name} must be an object, got {ascii(value)[:40]}"
        return next((p for k, v in value.items() if (p := _value_problem(args[1], v, f"{name}.{k}"))), None)
    return _number_problem(hint, value, name)


def _number_problem(hint: Any, value: Any, name: str) -> str | None:
    if hint is str:
        return None if isinstance(value, str) else f"{name} must be text, got {ascii(value)[:40]}"
    if hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, int if hint is int else (int, float)):
            return f"{name} must be a {'whole ' if hint is int else ''}number, got {ascii(value)[:40]}"
        if not (math.isfinite(value) and value >= 0):
            return f"{name} must be a finite number >= 0, got {value}"
    return None


def _profile_from(raw: dict[str, Any]) -> Profile:
    timings = {k: Timing(**raw[k]) for k in ("data", "forward", "backward", "optimizer")}
    compressors = {
        k: CompressorProfile(
            v["spec"],
            v["method"],
            v["granularity"],
            Timing(**v["encode"]),
            Timing(**v["decode"]),
            [tuple(c) for c in v["collectives"]],
        )
        for k, v in raw.get("compressors", {}).items()
    }
    rest = {k: v for k, v in raw.items() if k not in (*timings, "compressors", "buckets")}
    return Profile(
        **rest,
        data=timings["data"],
        forward=timings["forward"],
        backward=timings["backward"],
        optimizer=timings["optimizer"],
        buckets=[Bucket(**b) for b in raw["buckets"]],
        compressors=compressors,
    )


def check_profile_config(cfg: ProfileConfig) -> list[MethodSpec]:
    """Every flag checked before anything is built; returns the compressor specs."""
    if cfg.model not in list_models() and not is_import_path(cfg.model):
        raise ConfigError(
            f"--model {cfg.model!r} is not registered; see trainscale models, or give an import path "
            "package.module:function"
        )
    MODELS.get(cfg.model)  # an import path: imported here, one line if it cannot be
    parse_args(cfg.model_args)
    for name in ("batch_size", "repeats"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.warmup < 1:
        raise ConfigError(
            f"--warmup must be at least 1 (DDP rebuilds its buckets after the first step), got {cfg.warmup}"
        )
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {cfg.threads}")
    if cfg.cpus is not None and not 0.01 <= cfg.cpus <= (os.cpu_count() or 1):
        raise ConfigError(f"--cpus must be between 0.01 and this machine's {os.cpu_count()} CPUs, got {cfg.cpus}")
    check_input_data(cfg.input_data, cfg.loader_workers)
    if cfg.input_data and cfg.repeats < 2:
        raise ConfigError(
            f"--input-data times the loader over --repeats batches, at least 2; got --repeats {cfg.repeats}"
        )
    side = model_info(cfg.model).input_size or 32
    check_model_takes(
        cfg.model,
        lambda: create_model(cfg.model, **{"num_classes": 10, **parse_args(cfg.model_args)}),
        (2, 3, side, side),
        10,
        "the profile's synthetic batch",
        "profile a model that takes them",
    )
    return [parse_spec(text) for text in cfg.compress]


class _Recorder:
    """Each bucket's index, size and ready mark in the current step (filled by :func:`_record_hook`); with a
    ``group``, the hook all-reduces the bucket in it instead of handing it straight back (the overlap
    measurement). On a GPU a mark is an event on the stream, which the GPU passes when the bucket's gradients
    are computed; the host reaches the hook when it has only queued them, often long before."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.calls: list[tuple[int, int, Any]] = []
        self.group: Any = None  # a loopback pair's rank 0 (torch's stubs omit a backend's collectives)
        self.start: Any = None

    def mark(self) -> Any:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def begin(self) -> None:
        """Backward starts: marks from here on count from this one."""
        self.calls.clear()
        self.start = self.mark()

    def ready(self) -> list[tuple[int, int, float]]:
        """Each bucket's index, size and seconds from :meth:`begin` to its mark (after the device finished)."""
        if self.device.type != "cuda":
            return [(index, nbytes, at - self.start) for index, nbytes, at in self.calls]
        return [(index, nbytes, self.start.elapsed_time(at) / 1e3) for index, nbytes, at in self.calls]


def _record_hook(state, bucket):  # unannotated: DDP rejects string annotations on a hook
    """Record the bucket and hand it straight back (a world of one needs no reduction), or all-reduce it in
    the recorder's loopback group."""
    buffer = bucket.buffer()
    state.calls.append((bucket.index(), buffer.numel() * buffer.element_size(), state.mark()))
    if state.group is not None:
        return allreduce_hook(state.group, bucket)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


@dataclass
class _Steps:
    data: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)
    optimizer: list[float] = field(default_factory=list)
    ready: dict[int, list[float]] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)
    plain: list[float] = field(default_factory=list)  # a DDP step minus the plain step before it
    overlap: OverlapMeasurement | None = None
    collective: float | None = None  # a one-element all-reduce with the loopback peer (seconds)
    unmeasured: str = ""  # why the overlap and DDP's costs were not measured, where they were asked for


@dataclass
class _Stepper:
    """The model, its DDP wrapper and what a training step of either needs."""

    model: nn.Module
    ddp: nn.Module
    opt: torch.optim.Optimizer
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    precision: Precision
    recorder: _Recorder

    def step(self, wrapped: bool = True) -> list[float]:
        """One training step (of the DDP wrapper, or of the bare model); returns its time points: start, batch
        ready, backward start, backward end, end."""
        device = self.precision.device
        synchronize(device)
        times = [time.perf_counter()]
        images, labels = next(self.batches)
        synchronize(device)
        times.append(time.perf_counter())
        with self.precision.autocast():
            loss = F.cross_entropy((self.ddp if wrapped else self.model)(images).float(), labels)
        synchronize(device)
        times.append(time.perf_counter())
        self.recorder.begin()
        loss.backward()
        synchronize(device)
        times.append(time.perf_counter())
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        synchronize(device)
        return times + [time.perf_counter()]


def _time_steps(cfg: ProfileConfig, model: nn.Module, precision: Precision) -> tuple[_Steps, list[int]]:
    from torch.nn.parallel import DistributedDataParallel

    from trainscale.modes.sync import no_forward_buffer_sync

    ddp = DistributedDataParallel(model, **no_forward_buffer_sync())
    recorder = _Recorder(precision.device)
    ddp.register_comm_hook(recorder, _record_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, nesterov=True, weight_decay=5e-4)
    pair = pair_devices(precision.device) if cfg.overlap else None
    extra = 4 * cfg.repeats if pair else 0
    batches = training_batches(cfg, precision.device, cfg.warmup + cfg.repeats + 2 + extra)
    stepper = _Stepper(model, ddp, opt, batches, precision, recorder)
    steps = _Steps()
    for i in range(cfg.warmup + cfg.repeats):
        t0, t1, t2, t3, t4 = stepper.step()
        if i < cfg.warmup:
            continue
        for samples, seconds in zip(
            (steps.data, steps.forward, steps.backward, steps.optimizer), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        ):
            samples.append(seconds)
        for index, nbytes, at in recorder.ready():
            steps.ready.setdefault(index, []).append(at)
            steps.sizes[index] = nbytes
    if cfg.overlap and pair is None:
        steps.unmeasured = "NCCL takes one rank per GPU and this machine has one"
    if pair:
        _time_pair(cfg, stepper, steps, pair)
    images, labels = next(batches)  # one more backward, so the compressors code real gradients, not zeros
    with precision.autocast():
        loss = F.cross_entropy(ddp(images).float(), labels)
    loss.backward()
    logged = ddp._get_ddp_logging_data()
    sizes = str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes", "")).split(", ")
    return steps, [int(s) for s in sizes if s]


def pair_devices(device: torch.device) -> tuple[torch.device, torch.device] | None:
    """The devices of the overlap measurement's two ranks: two CPU ranks, or the profiled GPU and another GPU
    of this machine (NCCL takes one rank per GPU); None where this machine has no second GPU."""
    if device.type != "cuda":
        return device, device
    index = torch.cuda.current_device() if device.index is None else device.index
    others = [i for i in range(torch.cuda.device_count()) if i != index]
    return (torch.device("cuda", index), torch.device("cuda", others[0])) if others else None


def _time_pair(
    cfg: ProfileConfig, stepper: _Stepper, steps: _Steps, devices: tuple[torch.device, torch.device]
) -> None:
    """DDP's costs and the overlap, measured together; where the pair cannot form (NCCL refusing two GPUs of a
    machine, say) the profile keeps everything else and says why these are missing."""
    from trainscale.runtime.process_group import PairError

    _time_ddp_cost(cfg, stepper, steps)
    try:
        _time_overlap(cfg, stepper, steps, devices)
    except PairError as exc:
        ranks = f"NCCL's ranks on {devices[0]} and {devices[1]}" if devices[0].type == "cuda" else "two gloo ranks"
        steps.plain.clear()
        steps.unmeasured = f"{ranks} did not form a pair ({exc})"
        log.warning("the overlap and DDP's costs are not measured: %s", steps.unmeasured)


def _time_ddp_cost(cfg: ProfileConfig, stepper: _Stepper, steps: _Steps) -> None:
    """DDP's per-step cost: each DDP step (its hook handing every bucket straight back) minus a plain step of
    the model just before it. Measured with the overlap only: on a GPU the published NCCL runs' overlap and
    per-step share, which a plan takes where nothing was measured, were fitted together, and DDP's own cost on one
    GPU (without NCCL's kernels beside backward's, or a slower peer to wait for) would replace only half of them."""
    for _ in range(cfg.repeats):
        plain = stepper.step(wrapped=False)
        wrapped = stepper.step()
        steps.plain.append((wrapped[-1] - wrapped[0]) - (plain[-1] - plain[0]))


def _time_overlap(
    cfg: ProfileConfig, stepper: _Stepper, steps: _Steps, devices: tuple[torch.device, torch.device]
) -> None:
    """The overlap measurement of :mod:`trainscale.plan.overlap` between the pair on ``devices``: the buckets'
    all-reduces alone, then launched from backward, each such step paired with one without."""
    from trainscale.runtime.process_group import loopback_pair

    recorder = stepper.recorder
    order = [(index, nbytes) for index, nbytes, _ in recorder.calls]  # the last step's launch order
    sizes = [nbytes for _, nbytes in order]

    def backward() -> float:
        t = stepper.step()
        return t[3] - t[2]

    with loopback_pair(devices) as (group, other), running_peer(other, devices[1]) as peer:
        comm = comm_alone(group, peer, sizes, cfg.repeats, devices[0])
        steps.collective = per_collective(group, peer, cfg.repeats, devices[0])

        def live() -> float:
            recorder.group = group
            try:
                return backward()
            finally:
                recorder.group = None

        exposed = paired_exposure(backward, live, peer, sizes, cfg.repeats)
    alone = statistics.median(steps.backward)
    ready = [statistics.median(steps.ready[index]) for index, _ in order]
    steps.overlap = OverlapMeasurement(alone, exposed, sum(comm), schedule_bound(ready, comm, alone))


def _phases(steps: _Steps) -> list[Timing]:
    """Data, forward, backward and optimizer, each scaled so that they add up to the mean of the whole steps.
    Under a CPU quota a phase's wall time depends on where the quota period falls (a 100 ms forward at half a
    CPU spans one, two or three periods); the mean of consecutive whole steps does not."""
    phases = [steps.data, steps.forward, steps.backward, steps.optimizer]
    whole = statistics.fmean(sum(parts) for parts in zip(*phases))
    scale = whole / sum(statistics.median(p) for p in phases)
    return [Timing(statistics.median(p) * scale, min(p) * scale, max(p) * scale, len(p)) for p in phases]


def _buckets(steps: _Steps, scale: float = 1.0) -> list[Bucket]:
    """Buckets in the order they became ready (DDP launches them in that order)."""
    buckets = [Bucket(i, steps.sizes[i], statistics.median(t) * scale) for i, t in steps.ready.items()]
    return sorted(buckets, key=lambda b: b.ready_seconds)


class _RecordingStats(CompressionStats):
    """Compression statistics that also keep the list of collectives of the last exchange."""

    def __init__(self) -> None:
        super().__init__()
        self.launched: list[tuple[str, int]] = []

    def add_collective(self, kind: str, nbytes: int, world_size: int) -> None:
        super().add_collective(kind, nbytes, world_size)
        self.launched.append((kind, int(nbytes)))


def _units(grads: list[tuple[str, torch.Tensor]], granularity: str) -> list[tuple[str, torch.Tensor]]:
    if granularity == "entire":
        return [("entire", torch.cat([g.reshape(-1) for _, g in grads]))]
    return grads


def profile_compressor(
    spec: MethodSpec, grads: list[tuple[str, torch.Tensor]], warmup: int, repeats: int
) -> CompressorProfile:
    """Encode + decode of one step's gradients through the exchange layer, timed by its own clocks."""
    stats = _RecordingStats()
    exchange = Exchange(
        create_compressor(spec.method, **spec.params),
        stats=stats,
        dense_below=spec.dense_below if spec.granularity == "layerwise" else 0,
    )
    units = _units(grads, spec.granularity)
    encode, decode = [], []
    for i in range(warmup + repeats):
        stats.launched.clear()
        before = (stats.encode_seconds, stats.decode_seconds)
        exchange.reduce([(k, g.clone()) for k, g in units], i, LATE_EPOCH)
        if i >= warmup:
            encode.append(stats.encode_seconds - before[0])
            decode.append(stats.decode_seconds - before[1])
    return CompressorProfile(
        spec.text, spec.method, spec.granularity, Timing.of(encode), Timing.of(decode), list(stats.launched)
    )


def training_batches(
    cfg: ProfileConfig, device: torch.device, steps: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of synthetic CIFAR-sized images through the training loader: on the device, cropped,
    flipped and normalised as a run's are (a 28-pixel model crops, a 299-pixel one upscales)."""
    from trainscale.data.loader import AugmentConfig, DeviceBatches
    from trainscale.data.synthetic import synthetic_dataset

    native = 32
    want = model_info(cfg.model).input_size or native  # a model given by import path: CIFAR's size
    augment = AugmentConfig(
        crop_padding=cfg.crop_padding, crop_size=want if want < native else None, resize=want if want > native else None
    )
    data = synthetic_dataset(cfg.batch_size * steps, native)
    loader = DeviceBatches(
        data, cfg.batch_size, train=True, augment=augment, device=device, channels_last=cfg.channels_last
    )
    return iter((b[0], b[1]) for b in loader.epoch(0))


def synthetic_batch(model: str, batch_size: int, device: torch.device) -> torch.Tensor:
    size = model_info(model).input_size or 32
    return torch.randn(batch_size, 3, size, size, device=device)


def build(cfg: ProfileConfig, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    kwargs = {"num_classes": 10, **parse_args(cfg.model_args)}
    model = create_model(cfg.model, **kwargs).to(device)
    images = model_info(cfg.model).data_init_images
    if images:
        assert isinstance(model, DataInitModel)  # registered with data_init_images, so it defines data_init
        model.data_init(synthetic_batch(cfg.model, images, device))
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stubs omit it
    return model


def measure(cfg: ProfileConfig, specs: list[MethodSpec]) -> Profile:
    """The profile of ``cfg`` on this machine (inside whatever CPU limit the caller set)."""
    from trainscale.runtime.process_group import local_group
    from trainscale.train.environment import device_name, environment

    device = resolve_device(cfg.device)
    precision = Precision(cfg.precision, device)
    model = build(cfg, device)
    with local_group():
        steps, ddp_sizes = _time_steps(cfg, model, precision)
    data, forward, backward, optimizer = _phases(steps)
    buckets = _buckets(steps, backward.median / statistics.median(steps.backward))
    if sorted(b.nbytes for b in buckets) != sorted(ddp_sizes):
        raise RuntimeError(f"recorded buckets {[b.nbytes for b in buckets]} differ from DDP's {ddp_sizes}")
    grads = [(n, p.grad.detach().float().clone()) for n, p in model.named_parameters() if p.grad is not None]
    compressors = {s.text: profile_compressor(s, grads, cfg.warmup, cfg.repeats) for s in specs}
    return Profile(
        cfg.model,
        cfg.batch_size,
        precision.name,
        device_name(device),
        torch.get_num_threads(),
        cfg.cpus,
        data,
        forward,
        backward,
        optimizer,
        sum(g.numel() * 4 for _, g in grads),
        sum(g.numel() for _, g in grads),
        buckets,
        peak_memory_mb(device),
        compressors,
        environment(device),
        [g.numel() * 4 for _, g in grads],
        overlap=steps.overlap.overlap if steps.overlap else None,
        overlap_seconds=dataclasses.asdict(steps.overlap) if steps.overlap else {},
        step_overhead=max(0.0, statistics.median(steps.plain)) if steps.plain else None,
        bucket_overhead=steps.collective,
        overlap_unmeasured=steps.unmeasured,
        **_input_fields(cfg),
    )


def _input_fields(cfg: ProfileConfig) -> dict[str, Any]:
    if cfg.input_data is None:
        return {}
    from trainscale.data.download import ENV_VAR
    from trainscale.runtime.cpus import cpu_count

    cores = cfg.cpus or cpu_count()  # under --cpus, the loader's processes share that quota
    data_dir = cfg.data_dir or os.environ.get(ENV_VAR) or None  # as training finds it
    rate = measure_input(cfg.input_data, data_dir, cfg.loader_workers, cfg.batch_size, cfg.repeats, cores)
    return {"input_images_per_sec": rate.images_per_sec, "input_workers": rate.workers, "input_cores": rate.cores}


@contextlib.contextmanager
def limits(cfg: ProfileConfig) -> Iterator[None]:
    """This process's threads and, with ``--cpus``, a CPU quota for the body (restored afterwards)."""
    from math import ceil

    from trainscale.runtime.cluster import cpu_limited

    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or (ceil(cfg.cpus) if cfg.cpus else (os.cpu_count() or 1)))
    try:
        with cpu_limited(cfg.cpus) if cfg.cpus else contextlib.nullcontext():
            yield
    finally:
        torch.set_num_threads(threads_before)


def is_profile(path: Path) -> bool:
    """Whether ``path`` holds a profile (of this format or an older one): what ``--out`` may replace."""
    raw = json.loads(path.read_text())
    return isinstance(raw, dict) and str(raw.get("format", "")).startswith(FORMAT.rsplit("/", 1)[0] + "/")


def profile_command(cfg: ProfileConfig) -> Profile:
    specs = check_profile_config(cfg)
    out = Path(cfg.out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file name such as {out / 'profile.json'}")
    check_output(out, "--out", probe=True)  # before the minutes of profiling, not after
    check_replaceable(out, "--out", "a trainscale profile", is_profile)
    with limits(cfg):
        profile = measure(cfg, specs)
    atomic_write_text(out, profile.to_json())
    return profile
