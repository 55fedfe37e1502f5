"""Where a training step's time goes: steady epochs of a recipe under torch.profiler, through the trainer.

The run is ``trainscale.fit`` of the recipe on synthetic images of CIFAR-10's shape, or on CIFAR-10 itself (the
path users run, its warm-up included); the trainer's epoch function is wrapped so that the epochs named by
``--profile-epoch`` (one by default, after the warm-up and the first epochs) run under the profiler. For each it
prints:

- its wall time under the profiler, the time the GPU was busy (the union of the kernels' intervals) and the
  fraction: near 1 the step is bound by the GPU's kernels, well below by the host;
- GPU time per step in each compiled region (for ``--train-step captured``: the whole-step graph's replay with the
  copies of the batch into it, beside the replays' ranges on the GPU from first kernel to last: on an H200 the
  kernels counted inside took 3.6 ms a step of ranges 4.25 ms long, with the GPU busy 4.2 ms a step, so some of the
  replay's kernels may be counted outside) and in the kernels launched one by one (the rest), and the host's
  launches per step (kernels and graph replays): what a captured step has left outside its graphs;
- the top kernels by GPU time, and the top host operations by their own CPU time (where a host-bound step goes);
- where the GPU sat idle: before the epoch's first kernel, after its last, and between kernels in bands of gap
  length (a graph's own latency between dependent kernels, or the device waiting for the host).

For every epoch, without the profiler: its seconds, on a GPU its SM clock and power draw as NVML reports them
(a throttled GPU runs slower epochs), and the Python garbage collections during it (count, and the
milliseconds of full ones), since a collection inside a timed epoch stalls the host that feeds the GPU.
The settings, environment and figures go to ``--out`` (JSON).

    python benchmarks/step_profile.py --device cuda                       # speedrun94, the whole step captured
    python benchmarks/step_profile.py --device cuda --compile-mode max-autotune
    python benchmarks/step_profile.py --device cuda --recipe airbench94 --model-arg bn_momentum=0.6
    python benchmarks/step_profile.py --device cuda --train-step graphed    # three graphs a step
    python benchmarks/step_profile.py --device cuda --profile-epoch 3 5     # before and after a freeze
    python benchmarks/step_profile.py --device cuda --dataset cifar10 --images 50000
    python benchmarks/step_profile.py --device cpu --train-step eager --images 3072 --batch-size 256
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import trainscale.train.trainer as trainer
from trainscale.bench.script import COUNT, device_name, run_script
from trainscale.bench.timing import save_result
from trainscale.config import COMPILE_MODES
from trainscale.errors import OneLineParser
from trainscale.train.environment import environment
from trainscale.train.step import STEP_KINDS, CapturedStep

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
REGION = "## Call CompiledFxGraph"  # inductor's record_function around one compiled graph's call
WHOLE_STEP = "whole-step graph"  # this benchmark's record_function around a captured step's copies and replay


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="speedrun94")
    p.add_argument("--device", type=device_name, default="cuda")
    p.add_argument(
        "--train-step",
        default="captured",
        choices=[k for k in STEP_KINDS if k != "auto"],
        help="default: captured, what trainscale train takes on one GPU (eager on a CPU)",
    )
    p.add_argument("--compile-mode", default="default", choices=COMPILE_MODES)
    p.add_argument("--dataset", default="synthetic", help="synthetic (default) or cifar10 (the real images)")
    p.add_argument("--images", type=COUNT, default=49152, help="training images (default: 32 x 1536)")
    p.add_argument("--batch-size", type=COUNT, default=None, help="default: the recipe's")
    p.add_argument("--model-arg", action="append", default=[], help="KEY=VALUE for the model (repeatable)")
    p.add_argument("--epochs", type=COUNT, default=4)
    p.add_argument(
        "--profile-epoch",
        type=int,
        nargs="+",
        default=[3],
        help="1-based, one or more (e.g. 3 5: before and after airbench's whitening bias freezes); after the first, "
        "which pays its own",
    )
    p.add_argument("--top", type=COUNT, default=15, help="kernels listed")
    p.add_argument("--out", type=Path, default=Path(f"runs/bench/step_profile-{time.strftime('%Y%m%d-%H%M%S')}"))
    args = p.parse_args(argv)
    outside = [e for e in args.profile_epoch if not 1 <= e <= args.epochs]
    if outside:
        p.error(f"--profile-epoch must be within 1..--epochs ({args.epochs}), got {outside[0]}")
    return args


class GcWatch:
    """Python's garbage collections while active: count, full (generation 2) ones and their milliseconds."""

    def __init__(self) -> None:
        self.count, self.full, self.full_ms = 0, 0, 0.0
        self._started = 0.0

    def figures(self) -> dict[str, Any]:
        return {"count": self.count, "full": self.full, "full_ms": self.full_ms}

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.count += 1
        if info["generation"] == 2:
            self.full += 1
            self.full_ms += 1e3 * (time.perf_counter() - self._started)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        gc.callbacks.append(self)
        try:
            yield
        finally:
            gc.callbacks.remove(self)


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``intervals`` (microseconds, as the profiler gives them)."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e6


GAP_BANDS_US = (10.0, 100.0)  # a gap between kernels: inside a graph (dependency latency), short, or the host's


def kernel_gaps(intervals: list[tuple[float, float]], first: float, last: float, steps: int) -> dict[str, Any]:
    """Where the GPU was idle in the profiled epoch (``first``..``last``: its host events' span, microseconds):
    before its first kernel (the epoch's draws on the host), after its last, and between kernels, in the bands of
    ``GAP_BANDS_US``: many gaps of a few microseconds are a graph's own launch latency between dependent kernels
    (fewer, fused kernels shrink them); gaps of 100 us or more are the device waiting for the host."""
    spans = sorted(intervals)
    lo, hi = GAP_BANDS_US
    names = (f"under {lo:g} us", f"{lo:g}-{hi:g} us", f"{hi:g} us or more")
    counts, micros = [0, 0, 0], [0.0, 0.0, 0.0]
    end = spans[0][1] if spans else first
    for start, stop in spans[1:]:
        gap = start - end
        if gap > 0:
            band = 0 if gap < lo else 1 if gap < hi else 2
            counts[band] += 1
            micros[band] += gap
        end = max(end, stop)
    bands = {name: {"count": n / steps, "ms": us / 1e3 / steps} for name, n, us in zip(names, counts, micros)}
    return {
        "kernels_per_step": len(spans) / steps,
        "idle_ms_before_first_kernel": (spans[0][0] - first) / 1e3 if spans else None,
        "idle_ms_after_last_kernel": (last - end) / 1e3 if spans else None,
        "gaps_per_step": bands,
    }


def is_annotation(e: Any) -> bool:
    """A ``record_function`` range drawn on the GPU's timeline (kineto's user annotation): no kernel."""
    return bool(getattr(e, "is_user_annotation", False))


def within(start: float, spans: list[tuple[float, float]]) -> bool:
    """Whether ``start`` falls inside one of the sorted, disjoint ``spans``."""
    i = bisect.bisect_right(spans, (start, math.inf)) - 1
    return i >= 0 and start < spans[i][1]


def graph_ms(events: list[Any], kernels: list[Any], steps: int) -> dict[str, float]:
    """GPU ms per step in each compiled region and, for a captured step, in its replays (the kernels inside the
    GPU-side ranges of this benchmark's marks; without those, the marks' own device time), and outside them."""
    regions: dict[str, float] = {}  # GPU ms of each compiled graph's calls, by the graph's name
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith(REGION):
            regions[e.name] = regions.get(e.name, 0.0) + e.device_time_total / 1e3
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if is_annotation(e) and e.name == WHOLE_STEP)
    marks = [e for e in events if e.device_type == DeviceType.CPU and e.name == WHOLE_STEP]
    if spans:
        whole = sum(k.time_range.elapsed_us() for k in kernels if within(k.time_range.start, spans)) / 1e3
    else:
        whole = sum(e.device_time_total for e in marks) / 1e3
    gpu_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    named = {f"compiled graph {i + 1}": ms / steps for i, ms in enumerate(sorted(regions.values(), reverse=True))}
    if marks:  # a captured step calls no compiled graph after its capture: one replay a step
        named = {f"{WHOLE_STEP} (with the batch's copies into it)": whole / steps}
        if spans:  # beside the kernels counted in them: a check on that count (a range with idle gaps is longer)
            named[f"{WHOLE_STEP}'s ranges on the GPU, first kernel to last"] = (
                sum(b - a for a, b in spans) / 1e3 / steps
            )
    named["kernels outside the compiled graphs"] = (gpu_ms - sum(regions.values()) - whole) / steps
    return named


def breakdown(prof: profile, steps: int, seconds: float, top: int, cuda: bool) -> dict[str, Any]:
    """The profiled epoch's figures (see the module docstring); on a CPU the host's alone."""
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not is_annotation(e)]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    busy = busy_seconds(intervals)
    host = [e for e in events if e.device_type == DeviceType.CPU]
    span = (min(e.time_range.start for e in host), max(e.time_range.end for e in host)) if host else (0.0, 0.0)
    named = graph_ms(events, kernels, steps)
    launches = sum(1 for e in events if e.device_type == DeviceType.CPU and e.name in LAUNCHES)
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=60)
    host_ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)
    return {
        "epoch_seconds_profiled": seconds,
        "gpu_busy_seconds": busy if cuda else None,
        "gpu_busy_fraction": busy / seconds if cuda and seconds else None,
        "gpu_ms_per_step": named if cuda else {},
        "host_launches_per_step": launches / steps,
        "host_cpu_ms_per_step": sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU)
        / 1e3
        / steps,
        "top_kernels": table,
        "top_host_ops": host_ops,
        "gpu_idle": kernel_gaps(intervals, *span, steps) if cuda else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    epochs: list[dict[str, Any]] = []
    found: dict[int, dict[str, Any]] = {}  # by profiled epoch, 1-based
    real_epoch = trainer.train_one_epoch

    def epoch(*a: Any, **k: Any) -> Any:
        watch, profiled = GcWatch(), len(epochs) + 1 in args.profile_epoch
        cuda = torch.cuda.is_available() and args.device.startswith("cuda")
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with watch.watching(), profile(activities=activities) if profiled else contextlib.nullcontext() as prof:
            stats = real_epoch(*a, **k)
        epochs.append({"seconds": stats.seconds, "profiled": profiled, "gc": watch.figures()})
        if profiled:
            found[len(epochs)] = breakdown(prof, stats.steps, stats.seconds, args.top, cuda)
        return stats

    from trainscale import fit

    sets: dict[str, Any] = {"batch_size": args.batch_size} if args.batch_size else {}
    if args.model_arg:
        sets["model_args"] = args.model_arg
    whole_step = CapturedStep.__call__

    def marked(self: CapturedStep, images: torch.Tensor, labels: torch.Tensor) -> Any:
        with record_function(WHOLE_STEP):
            return whole_step(self, images, labels)

    with mock.patch.object(trainer, "train_one_epoch", epoch), mock.patch.object(CapturedStep, "__call__", marked):
        result = fit(
            args.recipe,
            recipe=args.recipe,
            dataset=args.dataset,
            train_subset=args.images,
            test_subset=2000,
            epochs=args.epochs,
            device=args.device,
            precision="auto",
            train_step=args.train_step,
            compile_mode=args.compile_mode,
            progress=False,
            out=str(args.out / "run"),
            **sets,
        )
    for e, row in zip(epochs, result.history):  # NVML's readings of each epoch (one at its end when it is short)
        e.update({k: row.get(k) for k in ("gpu_clock_mhz", "gpu_power_w")})
    report(args, epochs, found, result.summary)
    save_result(
        args.out / "result.json",
        {"settings": vars(args), "epochs": epochs, "profiled": found, "summary": result.summary,
         "environment": environment(torch.device(args.device))},
    )  # fmt: skip
    print(f"saved {args.out / 'result.json'}")
    return 0


def report(
    args: argparse.Namespace, epochs: list[dict[str, Any]], found: dict[int, dict[str, Any]], summary: dict[str, Any]
) -> None:
    env = summary.get("environment") or {}
    print(f"\n{args.recipe}, {summary.get('train_step')} step ({summary.get('train_step_reason')}), compile mode "
          f"{args.compile_mode}, on {env.get('device_name') or env.get('cpu') or args.device}; warm-up "
          f"{summary.get('warmup_seconds') or 0:.1f} s")  # fmt: skip
    if summary.get("gpu_clock_mhz"):
        print(f"GPU during the steady epochs: SM clock {summary['gpu_clock_mhz']:.0f} MHz, power "
              f"{summary.get('gpu_power_w') or 0.0:.0f} W (NVML)")  # fmt: skip
    for i, e in enumerate(epochs, 1):
        gc_line = f"{e['gc']['count']} collections, {e['gc']['full']} full ({e['gc']['full_ms']:.1f} ms)"
        gpu = f"; {e['gpu_clock_mhz']:.0f} MHz, {e.get('gpu_power_w') or 0.0:.0f} W" if e.get("gpu_clock_mhz") else ""
        print(f"  epoch {i}: {e['seconds']:.4f} s{' (profiled)' if e['profiled'] else ''}; gc: {gc_line}{gpu}")
    for epoch, figures in found.items():
        print(f"\nprofiled epoch {epoch}:")
        report_profiled(figures)


def report_profiled(found: dict[str, Any]) -> None:
    fraction = found["gpu_busy_fraction"]
    print(found["top_kernels"])
    if fraction is not None:  # on a CPU the kernels' table is the host's already
        print(found["top_host_ops"])
    busy = f", GPU busy {found['gpu_busy_seconds']:.4f} s ({100 * fraction:.0f}%)" if fraction is not None else ""
    print(
        f"profiled epoch: {found['epoch_seconds_profiled']:.4f} s{busy}; per step: "
        f"{found['host_launches_per_step']:.0f} host launches, {found['host_cpu_ms_per_step']:.2f} ms host CPU "
        "(under the profiler)"
    )
    for name, ms in found["gpu_ms_per_step"].items():
        print(f"  GPU ms per step, {name}: {ms:.3f}")
    idle = found.get("gpu_idle")
    if idle:
        print(
            f"  kernels per step {idle['kernels_per_step']:.0f}; GPU idle before the first kernel "
            f"{idle['idle_ms_before_first_kernel']:.2f} ms, after the last {idle['idle_ms_after_last_kernel']:.2f} ms"
        )
        for name, band in idle["gaps_per_step"].items():
            print(f"  gaps between kernels {name}: {band['count']:.1f} per step, {band['ms']:.3f} ms per step")


if __name__ == "__main__":
    run_script(main)
