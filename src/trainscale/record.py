"""The run record's contract: every key of ``summary.json`` and ``metrics.jsonl``, with its type, unit and meaning.

This module is the one place the keys are defined. A producer (the engine, a mode, the wire counter, the
fault-tolerant launcher) returns a part: a dict keyed by these definitions; ``merge`` combines parts (a later
part wins a key it shares with an earlier one) and ``results.RunWriter`` writes them. A reader (console,
report, bench, the planner's check) names a key as ``K.<name>``: a ``Key`` is the key's string itself, so
``summary.get(K.best_test_acc)`` reads an old run folder exactly as the bare string did.

A new key is one definition here plus its producer. A plug-in mode with keys of its own defines them with
``define`` (the writer warns once about a key it cannot find). ``python -m trainscale.record [docs/run-folder.md]``
prints the documentation's tables of the keys (with a path: rewrites them there).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from trainscale.io import atomic_write_text

log = logging.getLogger("trainscale.record")

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
STEPS = "steps.jsonl"  # live metrics: one row every --log-every steps (``StepK``)
RUN_TOML = (
    "run.toml"  # the run's settings, in the form `trainscale train --config` reads (``RunWriter.write_run_toml``)
)
BOTH = (SUMMARY, METRICS)

Kind = type | tuple[type, ...]


class Key(str):
    """One key of the run record: the string itself (so it indexes a dict as the bare name does), plus what
    it holds. ``kind``: the JSON value's Python type (``None`` is always allowed: not measured, not
    applicable); ``unit``: empty where none applies; ``files``: where it appears."""

    kind: Kind
    unit: str
    meaning: str
    files: tuple[str, ...]

    def __new__(cls, name: str, kind: Kind, unit: str, meaning: str, files: tuple[str, ...] = (SUMMARY,)) -> Key:
        key = super().__new__(cls, name)
        key.kind, key.unit, key.meaning, key.files = kind, unit, meaning, files
        return key

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` (as read back from JSON) fits this key's kind; an int fits a float key."""
        kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        if float in kinds and not isinstance(value, bool):
            kinds = (*kinds, int)
        return value is None or isinstance(value, kinds)

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        """Pickled (sent to another process, copied) as the plain string: the definition stays here."""
        return str, (str(self),)


S = "s"
MS = "ms"
BYTES = "bytes"
FRACTION = "fraction 0..1"


class K:
    """Every key of summary.json and metrics.jsonl (see ``Key``), in the order a run writes them."""

    # --- the run's description (train.setup.summary_base, app.run)
    out = Key("out", str, "", "the run folder")
    model = Key("model", str, "", "the model's registered name")
    params = Key("params", int, "parameters", "trainable and frozen parameters of the model")
    dataset = Key("dataset", str, "", "the dataset's registered name")
    mode = Key("mode", str, "", "the training mode")
    world_size = Key("world_size", int, "processes", "workers in the process group (fault tolerance: replicas)", BOTH)
    epochs = Key(
        "epochs",
        float,
        "epochs",
        "epochs the run was asked for (a fraction: its last epoch trained that part of its steps)",
    )
    batch_size = Key("batch_size", int, "images", "global batch: images per optimizer step over all workers")
    batch_per_worker = Key("batch_per_worker", int, "images", "each worker's share of a step's batch")
    lr = Key("lr", float, "", "learning rate: the run's peak after batch scaling; per epoch, at its last step", BOTH)
    precision = Key("precision", str, "", "numeric precision of the training steps (fp32, bf16, fp16)")
    image_size = Key("image_size", int, "pixels", "side of the square images the model sees")
    train_samples_per_epoch = Key("train_samples_per_epoch", int, "images", "training images per epoch, all workers")
    seed = Key("seed", int, "", "the run's random seed")
    environment = Key(
        "environment", dict, "", "torch, python, device and its name, CPU model, cores, threads, CUDA, host, git commit"
    )
    data_init_seconds = Key(
        "data_init_seconds", float, S, "the model's data-based init (the whitening fit), not its construction"
    )
    warmup_seconds = Key("warmup_seconds", float, S, "the compile/cuDNN warm-up before the timers start")
    train_step = Key(
        "train_step", str, "", "how the training step ran: eager, compiled, graphed or captured (CUDA graphs)"
    )
    train_step_reason = Key("train_step_reason", str, "", "why that step: asked for, or what --train-step auto saw")
    eval_forward = Key(
        "eval_forward",
        str,
        "",
        "how evaluation ran the model: captured (CUDA graphs, beside the captured training step), compiled (on a "
        "GPU, beside a compiled training step) or eager",
    )

    # --- what the mode says about itself (Mode.describe)
    backend = Key("backend", str, "", "the collective backend (gloo, nccl; rpc for the parameter server)")
    batchnorm = Key("batchnorm", str, "", "how BatchNorm statistics are kept across workers")
    evaluation = Key("evaluation", str, "", "who evaluates, on which test images")
    compress_method = Key("compress_method", str, "", "the gradient compressor (none: dense all-reduce)", BOTH)
    compress_granularity = Key("compress_granularity", str, "", "layerwise or entiremodel compression", BOTH)
    compress_params = Key("compress_params", dict, "", "the compressor's parameters")
    error_feedback = Key("error_feedback", bool, "", "whether compression error is fed back into the next step")
    compress_warmup_epochs = Key("compress_warmup_epochs", int, "epochs", "dense epochs before compression starts")
    dense_below = Key(
        "dense_below",
        int,
        "elements",
        "layerwise Top-k, Random-k, Threshold: tensors under this many elements, and 1-D ones, sent dense (0: none)",
    )
    bytes_sent_scope = Key("bytes_sent_scope", str, "", "what bytes_sent_per_step counts")
    sync_every = Key("sync_every", int, "steps", "local SGD / DiLoCo: steps between averaging rounds")
    local_after_epochs = Key("local_after_epochs", int, "epochs", "local SGD: synchronous epochs before going local")
    outer_lr = Key("outer_lr", float, "", "DiLoCo: the outer optimizer's learning rate")
    outer_momentum = Key("outer_momentum", float, "", "DiLoCo: the outer optimizer's Nesterov momentum")
    outer_warmup_rounds = Key(
        "outer_warmup_rounds", int, "rounds", "DiLoCo: rounds over which the outer step grows from local SGD's"
    )
    transport = Key("transport", str, "", "parameter server: how pushes and pulls travel")
    workers = Key("workers", int, "processes", "parameter server: training workers")
    servers = Key("servers", int, "processes", "parameter server: server shards")
    ps_rule = Key("ps_rule", str, "", "parameter server: the update rule (async, ps-sync, ma)")
    staleness_bound = Key("staleness_bound", int, "steps", "parameter server: the bound on a worker's lead")
    async_momentum = Key("async_momentum", float, "", "async: the server's momentum")
    staleness_lr = Key("staleness_lr", bool, "", "async: whether the lr is divided by each update's staleness")
    average_every = Key("average_every", int, "steps", "model averaging: steps between averages")
    warm_start_epochs = Key("warm_start_epochs", int, "epochs", "parameter server: epochs worker 0 trains alone")
    push_compression = Key("push_compression", str, "", "parameter server: the compressor of pushes")
    bytes_scope = Key("bytes_scope", str, "", "what the parameter server's byte counts include")

    # --- the run's results (train.trainer)
    epochs_completed = Key(
        "epochs_completed", int, "epochs", "epochs finished, a partial last one counted (fewer than epochs: cut short)"
    )
    best_test_acc = Key("best_test_acc", float, FRACTION, "best top-1 test accuracy of any evaluated epoch")
    final_test_acc = Key("final_test_acc", float, FRACTION, "top-1 test accuracy of the last epoch")
    ema_final_test_acc = Key(
        "ema_final_test_acc", float, FRACTION, "--ema: the weight average's top-1 test accuracy at the last epoch"
    )
    ema_best_test_acc = Key("ema_best_test_acc", float, FRACTION, "--ema: the weight average's best test accuracy")
    mean_epoch_seconds = Key("mean_epoch_seconds", float, S, "mean training time of an epoch (whole epochs only)")
    steady_epoch_seconds = Key(
        "steady_epoch_seconds", float, S, "mean training time of the whole epochs after the first"
    )
    samples_per_sec = Key("samples_per_sec", float, "images/s", "training throughput, all workers", BOTH)
    peak_memory_mb = Key(
        "peak_memory_mb",
        float,
        "MiB",
        "peak GPU memory allocated, or the CPU's peak resident set, the largest over workers",
        BOTH,
    )
    total_train_seconds = Key("total_train_seconds", float, S, "training time of all epochs (timer_scope)")
    total_eval_seconds = Key("total_eval_seconds", float, S, "evaluation time of all epochs")
    skipped_steps = Key("skipped_steps", int, "steps", "steps skipped for a non-finite loss (--nonfinite skip)", BOTH)
    target_acc = Key("target_acc", float, FRACTION, "the --target-acc the run was timed to")
    time_to_target_seconds = Key("time_to_target_seconds", float, S, "training time to the first epoch at target")
    epoch_to_target = Key("epoch_to_target", int, "epochs", "the first epoch whose evaluation reached the target")
    timer_scope = Key("timer_scope", str, "", "what the training timers include and exclude")
    reference_scope = Key("reference_scope", dict, "", "the run's time and accuracy in airbench's timer scope")
    cpu_util = Key("cpu_util", float, FRACTION, "busy share of the worker's cores, mean over workers", BOTH)
    gpu_util = Key("gpu_util", float, FRACTION, "busy share of the worker's GPU, mean over workers", BOTH)
    gpu_clock_mhz = Key(
        "gpu_clock_mhz",
        float,
        "MHz",
        "the GPU's SM clock (NVML; below its boost clock: throttled), mean over workers",
        BOTH,
    )
    gpu_power_w = Key("gpu_power_w", float, "W", "the GPU's power draw (NVML), mean over workers", BOTH)
    step_seconds = Key("step_seconds", float, S, "training time of a step (run: mean over the steady epochs)", BOTH)
    comm_seconds_per_step = Key("comm_seconds_per_step", float, S, "time a step waited for communication", BOTH)
    compute_seconds_per_step = Key("compute_seconds_per_step", float, S, "step_seconds less comm_seconds_per_step")
    scaling_efficiency = Key(
        "scaling_efficiency", float, "", "per-worker throughput over the --baseline's (1.0: linear scaling)"
    )
    scaling_baseline = Key("scaling_baseline", dict, "", "the --baseline run: out, world_size, config_mismatches")
    projected = Key("projected", dict, "", "time-dilated cluster: the times and throughput of the target cluster")

    # --- communication, measured (runtime.comm_hooks, compression.stats)
    compress_steps = Key("compress_steps", int, "steps", "steps the compression figures cover", BOTH)
    compress_dense_steps = Key("compress_dense_steps", int, "steps", "of those, steps sent dense (warm-up)", BOTH)
    bytes_sent_per_step = Key("bytes_sent_per_step", float, BYTES, "payload a worker hands to collectives", BOTH)
    dense_bytes_per_step = Key("dense_bytes_per_step", float, BYTES, "what a dense all-reduce would hand over", BOTH)
    wire_bytes_per_step = Key(
        "wire_bytes_per_step", float, BYTES, "estimated bytes leaving a worker (ring algorithms)", BOTH
    )
    compression_ratio = Key("compression_ratio", float, "", "dense bytes over bytes sent", BOTH)
    allreduce_calls_per_step = Key("allreduce_calls_per_step", float, "calls", "collectives per step", BOTH)
    encode_ms_per_step = Key("encode_ms_per_step", float, MS, "compressing the gradients", BOTH)
    comm_ms_per_step = Key("comm_ms_per_step", float, MS, "collectives in flight", BOTH)
    hidden_ms_per_step = Key("hidden_ms_per_step", float, MS, "of comm_ms_per_step, hidden under backward", BOTH)
    decode_ms_per_step = Key("decode_ms_per_step", float, MS, "decompressing the gradients", BOTH)
    density = Key("density", float, FRACTION, "share of gradient entries a sparse compressor sent", BOTH)
    fallback_units_per_step = Key(
        "fallback_units_per_step", float, "units", "sparse payloads sent as a bitmap or dense (smaller)", BOTH
    )
    rounds = Key("rounds", int, "rounds", "local SGD / DiLoCo: averaging rounds", BOTH)
    steps_per_round = Key("steps_per_round", float, "steps", "local SGD / DiLoCo: steps per round", BOTH)

    # --- the parameter server (modes.ps)
    ps_pushes = Key("ps_pushes", float, "pushes", "full-model pushes the servers applied", (METRICS,))
    pushes_per_sec = Key("pushes_per_sec", float, "pushes/s", "full-model pushes per second", BOTH)
    staleness_mean = Key("staleness_mean", float, "updates", "mean staleness of a shard update", BOTH)
    staleness_max = Key("staleness_max", int, "updates", "largest staleness of a shard update", BOTH)
    staleness_hist = Key("staleness_hist", dict, "updates", "shard updates per staleness", BOTH)
    clock_gap_max = Key("clock_gap_max", int, "steps", "largest lead of a worker over the slowest", BOTH)
    dead_workers = Key("dead_workers", list, "", "workers the servers dropped", BOTH)
    batches_committed = Key("batches_committed", int, "batches", "batches whose pushes the servers committed", BOTH)
    server_update_seconds = Key("server_update_seconds", float, S, "time the servers spent applying updates", BOTH)
    server_update_seconds_per_update = Key("server_update_seconds_per_update", float, S, "per shard update", BOTH)
    bytes_pushed_per_step = Key("bytes_pushed_per_step", float, BYTES, "a worker's push payload per step", BOTH)
    bytes_pulled_per_step = Key("bytes_pulled_per_step", float, BYTES, "a worker's pull payload per step", BOTH)
    bytes_per_push = Key("bytes_per_push", float, BYTES, "a compressed push's payload (--compress)", BOTH)
    dense_bytes_per_push = Key("dense_bytes_per_push", float, BYTES, "the same push in fp32", BOTH)
    push_seconds_per_step = Key("push_seconds_per_step", float, S, "a worker's push time per step", BOTH)
    pull_seconds_per_step = Key("pull_seconds_per_step", float, S, "a worker's pull time per step", BOTH)
    wait_seconds_per_step = Key("wait_seconds_per_step", float, S, "a worker's wait for the staleness bound", BOTH)
    worker_samples_per_sec = Key("worker_samples_per_sec", list, "images/s", "each worker's throughput", BOTH)
    workers_finished = Key("workers_finished", int, "workers", "workers that finished the epoch's pass", (METRICS,))
    handed_over_batches = Key(
        "handed_over_batches", int, "batches", "dead workers' batches the live ones trained", BOTH
    )

    # --- emulated clusters (train.wire)
    cluster = Key("cluster", dict, "", "the emulated cluster: name, hosts, rates, rtt, threads, CPU quota, dilation")
    wire_bytes_sent_per_step = Key("wire_bytes_sent_per_step", float, BYTES, "a host's interface sent, per step", BOTH)
    wire_bytes_received_per_step = Key(
        "wire_bytes_received_per_step", float, BYTES, "a host's interface received, per step", BOTH
    )

    # --- fault records (app.ft_launch, after the job)
    faults = Key("faults", list, "", "per injected fault: kind, rank, step, detection and recovery seconds, steps lost")
    replicas_equal = Key("replicas_equal", bool, "", "fault tolerance: whether the replicas ended bit-identical")
    replicas_finished = Key("replicas_finished", int, "replicas", "fault tolerance: replicas that logged their end")

    # --- one epoch (metrics.jsonl only; train.trainer)
    epoch = Key("epoch", int, "", "the epoch, from 1", (METRICS,))
    train_loss = Key("train_loss", float, "", "mean training loss of the epoch", (METRICS,))
    train_acc = Key("train_acc", float, FRACTION, "training accuracy of the epoch", (METRICS,))
    test_loss = Key("test_loss", float, "", "test loss (None: not evaluated, --eval-every)", (METRICS,))
    test_acc = Key("test_acc", float, FRACTION, "top-1 test accuracy (None: not evaluated)", (METRICS,))
    ema_test_loss = Key("ema_test_loss", float, "", "--ema: the weight average's test loss", (METRICS,))
    ema_test_acc = Key("ema_test_acc", float, FRACTION, "--ema: the weight average's test accuracy", (METRICS,))
    epoch_seconds = Key("epoch_seconds", float, S, "the epoch's training time, slowest worker", (METRICS,))
    eval_seconds = Key("eval_seconds", float, S, "the epoch's evaluation time", (METRICS,))
    elapsed_seconds = Key("elapsed_seconds", float, S, "training time so far", (METRICS,))
    train_samples = Key("train_samples", int, "images", "images trained on this epoch, all workers", (METRICS,))
    test_views = Key(
        "test_views", int, "views", "views per test image (test-time augmentation; 0: not evaluated)", (METRICS,)
    )


class StepK:
    """Every key of steps.jsonl: one row every ``--log-every`` steps, measured on the main worker (its loss and
    step times; the throughput scaled to the whole job), read from the device once per row."""

    step = Key("step", int, "steps", "steps since the run began, at the row's last step", (STEPS,))
    epoch = Key("epoch", int, "", "the epoch of the row's last step, from 1", (STEPS,))
    loss = Key("loss", float, "", "the main worker's mean training loss over the row's steps", (STEPS,))
    lr = Key("lr", float, "", "the learning rate of the row's last step", (STEPS,))
    samples_per_sec = Key(
        "samples_per_sec", float, "images/s", "the row's training throughput: the main worker's x workers", (STEPS,)
    )
    step_seconds = Key("step_seconds", float, S, "mean time of the row's steps (synchronised at each row)", (STEPS,))


def step_keys() -> dict[str, Key]:
    """The keys of steps.jsonl, by name."""
    return {name: key for name, key in vars(StepK).items() if isinstance(key, Key)}


_EXTRA: dict[str, Key] = {}
_WARNED: set[tuple[str, str]] = set()

# The exchange's split of a step (the report's "Step time" table), and the times a dilated cluster projects.
EXCHANGE_SPLIT = (K.encode_ms_per_step, K.comm_ms_per_step, K.hidden_ms_per_step, K.decode_ms_per_step)
PROJECTED_TIMES = (
    K.step_seconds,
    K.compute_seconds_per_step,
    K.comm_seconds_per_step,
    K.mean_epoch_seconds,
    K.steady_epoch_seconds,
    K.total_train_seconds,
    K.time_to_target_seconds,
)
# The summary fields two runs must share for their throughputs to be comparable.
SAME_CONFIG = (K.model, K.dataset, K.precision, K.image_size)
# Keys every finished run writes (the others depend on the mode, the cluster, the flags).
SUMMARY_FIELDS = (
    K.model,
    K.params,
    K.dataset,
    K.mode,
    K.world_size,
    K.epochs,
    K.batch_size,
    K.best_test_acc,
    K.final_test_acc,
    K.mean_epoch_seconds,
    K.samples_per_sec,
    K.peak_memory_mb,
    K.total_train_seconds,
    K.time_to_target_seconds,
    K.reference_scope,
    K.skipped_steps,
    K.environment,
)
EPOCH_FIELDS = (
    K.epoch,
    K.lr,
    K.train_loss,
    K.train_acc,
    K.test_loss,
    K.test_acc,
    K.epoch_seconds,
    K.eval_seconds,
    K.elapsed_seconds,
    K.samples_per_sec,
    K.peak_memory_mb,
    K.skipped_steps,
    K.test_views,
)


def finished(summary: Mapping[str, Any], epochs: Any = None) -> bool:
    """Whether the run's ``epochs_completed`` covers every epoch it was asked for (``epochs``, else its own
    ``epochs``): a fractional length's last epoch counts as one, trained in part."""
    asked = summary.get(K.epochs) if epochs is None else epochs
    if isinstance(asked, bool) or not isinstance(asked, (int, float)):
        return False
    return summary.get(K.epochs_completed) == math.ceil(asked)


# --- figures derived from summaries (the trainer's scaling_efficiency, the report's throughput columns).
# Scaling efficiency: ``(throughput_N / N) / (throughput_B / B)``: 1.0 means perfect linear scaling; with a
# 1-worker baseline (B = 1) this is throughput_N / (N x throughput_1). Throughput is training images per second
# over all workers, steady-state (epochs after the first, which carries warm-up) when the run has several.
def throughput(summary: dict[str, Any]) -> float:
    """Training images/s of a run summary (steady state when available)."""
    steady = summary.get(K.steady_epoch_seconds)
    per_epoch = summary.get(K.train_samples_per_epoch)
    if steady and per_epoch:
        return per_epoch / steady
    value = summary.get(K.samples_per_sec)
    if not value:
        raise ValueError(f"summary of {summary.get(K.out)} has no throughput (no finished epoch?)")
    return float(value)


def scaling_efficiency(run_summary: dict[str, Any], baseline_summary: dict[str, Any]) -> float:
    """Per-worker throughput of ``run_summary`` over that of ``baseline_summary`` (usually 1 worker)."""
    n = int(run_summary.get(K.world_size) or 1)
    b = int(baseline_summary.get(K.world_size) or 1)
    return (throughput(run_summary) / n) / (throughput(baseline_summary) / b)


def config_mismatches(run_summary: dict[str, Any], baseline_summary: dict[str, Any]) -> list[str]:
    """Fields that differ between the runs (a non-empty list means the efficiency compares apples to pears)."""
    return [
        f"{k}: {baseline_summary.get(k)!r} vs {run_summary.get(k)!r}"
        for k in SAME_CONFIG
        if run_summary.get(k) != baseline_summary.get(k)
    ]


def keys(file: str | None = None) -> dict[str, Key]:
    """The defined keys (built-in then plug-ins'), by name; only those of ``file`` when given."""
    found = {**{k: v for k, v in vars(K).items() if isinstance(v, Key)}, **_EXTRA}
    return {name: key for name, key in found.items() if file is None or file in key.files}


def define(key: Key) -> Key:
    """Define a plug-in's key (a mode registered by import path reporting a figure of its own); a built-in
    name cannot be redefined."""
    if key in keys() and keys()[key] is not _EXTRA.get(key):
        raise ValueError(f"{key!r} is already defined in trainscale.record")
    _EXTRA[str(key)] = key
    return key


def merge(*parts: Mapping[str, Any], file: str = SUMMARY) -> dict[str, Any]:
    """One record from producers' parts, in order (a later part wins a key it shares with an earlier one).
    A key with no definition is kept, with one warning per key, so a figure is never lost."""
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    for name in undefined(merged, file):
        if (file, name) not in _WARNED:
            _WARNED.add((file, name))
            log.warning(
                "%s key %r has no definition in trainscale.record: define it (trainscale.record.define)", file, name
            )
    return merged


def undefined(record: Iterable[str], file: str = SUMMARY) -> list[str]:
    """The names in ``record`` that ``file`` does not define."""
    defined = keys(file)
    return [name for name in record if name not in defined]


def problems(record: Mapping[str, Any], file: str = SUMMARY) -> list[str]:
    """Each key of ``record`` that ``file`` does not define, or whose value does not fit its kind."""
    defined = keys(file)
    return [
        f"{name}: not defined for {file}"
        if name not in defined
        else f"{name}: {type(value).__name__} {value!r} is not {defined[name].kind}"
        for name, value in record.items()
        if name not in defined or not defined[name].accepts(value)
    ]


def malformed(record: Mapping[str, Any], file: str = SUMMARY) -> str | None:
    """The first key ``file`` defines whose value in ``record`` does not fit its kind, or is a number that is not
    finite (never written: trainscale's JSON is strict), said in words; None when all fit. What a reader checks
    before it computes with a record that may have been edited or damaged."""
    defined = keys(file)
    for name, value in record.items():
        key = defined.get(name)
        if key is None:
            continue
        if not key.accepts(value):
            return f"{name} is {type(value).__name__} {_short(value)}, not {_kind_text(key.kind)}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name} is {value}, not a finite number"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def markdown(file: str) -> str:
    """The table of ``file``'s keys for the docs (generated, so the documented list is the definitions)."""
    rows = [f"| `{k}` | {_kind_text(k.kind)} | {k.unit or '-'} | {k.meaning} |" for k in keys(file).values()]
    return "\n".join(["| key | type | unit | meaning |", "| --- | --- | --- | --- |", *rows])


def _kind_text(kind: Kind) -> str:
    return " or ".join(t.__name__ for t in (kind if isinstance(kind, tuple) else (kind,)))


README_MARKERS = ("<!-- record keys: begin -->", "<!-- record keys: end -->")


def readme_block() -> str:
    """The generated block of the docs page (docs/run-folder.md): both tables."""
    return f"`{SUMMARY}`:\n\n{markdown(SUMMARY)}\n\n`{METRICS}` (one object per epoch):\n\n{markdown(METRICS)}\n"


def readme_section(text: str) -> str:
    """What a Markdown page holds between the two markers (stripped), or '' without them."""
    begin, end = README_MARKERS
    if begin not in text or end not in text:
        return ""
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


def rewrite_readme(text: str) -> str:
    """``text`` with the block between the markers replaced by the tables of the current definitions."""
    begin, end = README_MARKERS
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n\n{readme_block()}\n{end}{rest.split(end, 1)[1]}"


USAGE = (
    "usage: python -m trainscale.record [PAGE]\n"
    "prints the tables of the run folder's files (keys, types, units); with PAGE, a Markdown page holding the\n"
    f"markers {README_MARKERS[0]} and {README_MARKERS[1]}, rewrites the tables between them in place"
)


def main(argv: list[str]) -> int:
    """``python -m trainscale.record``: print the tables; with a path, rewrite that page's block in place."""
    if not argv:
        print(readme_block(), end="")
        return 0
    if argv[0] in ("-h", "--help") or len(argv) > 1:
        print(USAGE, file=sys.stdout if argv[0] in ("-h", "--help") else sys.stderr)
        return 0 if argv[0] in ("-h", "--help") else 2
    path = Path(argv[0])
    try:
        text = path.read_text()
    except OSError as exc:
        print(f"python -m trainscale.record: error: {path}: {exc.strerror}", file=sys.stderr)
        return 2
    if not all(marker in text for marker in README_MARKERS):
        print(f"python -m trainscale.record: error: {path} holds no {README_MARKERS[0]} ... block", file=sys.stderr)
        return 2
    atomic_write_text(path, rewrite_readme(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
