"""Where a training step's time goes: one steady epoch of a recipe under torch.profiler, through the trainer.

The run is ``trainscale.fit`` of the recipe on synthetic images of CIFAR-10's shape, or on CIFAR-10 itself (the
path users run, its warm-up included); the trainer's epoch function is wrapped so that one epoch after the warm-up
and the first epochs runs under the profiler. For that epoch it prints:

- its wall time under the profiler, the time the GPU was busy (the union of the kernels' intervals) and the
  fraction: near 1 the step is bound by the GPU's kernels, well below by the host;
- GPU time per step in each compiled region (for ``--train-step captured``: the whole-step graph's replay with the
  copies of the batch into it) and in the kernels launched one by one (the rest), and the host's launches per step
  (kernels and graph replays): what a captured step has left outside its graphs;
- the top kernels by GPU time, and the top host operations by their own CPU time (where a host-bound step goes).

For every epoch, without the profiler: its seconds and the Python garbage collections during it (count, and the
milliseconds of full ones), since a collection inside a timed epoch stalls the host that feeds the GPU.
The settings, environment and figures go to ``--out`` (JSON).

    python benchmarks/step_profile.py --device cuda                       # speedrun94, the whole step captured
    python benchmarks/step_profile.py --device cuda --compile-mode max-autotune
    python benchmarks/step_profile.py --device cuda --train-step graphed    # three graphs a step
    python benchmarks/step_profile.py --device cuda --dataset cifar10 --images 50000
    python benchmarks/step_profile.py --device cpu --train-step eager --images 3072 --batch-size 256
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import trainscale.train.trainer as trainer
from trainscale.bench.timing import save_result
from trainscale.config import COMPILE_MODES
from trainscale.train.environment import environment
from trainscale.train.step import STEP_KINDS, CapturedStep

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
REGION = "## Call CompiledFxGraph"  # inductor's record_function around one compiled graph's call
WHOLE_STEP = "whole-step graph"  # this benchmark's record_function around a captured step's copies and replay


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="speedrun94")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--train-step",
        default="captured",
        choices=[k for k in STEP_KINDS if k != "auto"],
        help="default: captured, what trainscale train takes on one GPU (eager on a CPU)",
    )
    p.add_argument("--compile-mode", default="default", choices=COMPILE_MODES)
    p.add_argument("--dataset", default="synthetic", help="synthetic (default) or cifar10 (the real images)")
    p.add_argument("--images", type=int, default=49152, help="training images (default: 32 x 1536)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the recipe's")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--profile-epoch", type=int, default=3, help="1-based; after the first, which pays its own")
    p.add_argument("--top", type=int, default=15, help="kernels listed")
    p.add_argument("--out", type=Path, default=Path(f"runs/bench/step_profile-{time.strftime('%Y%m%d-%H%M%S')}"))
    args = p.parse_args(argv)
    if not 1 <= args.profile_epoch <= args.epochs:
        p.error(f"--profile-epoch must be within 1..--epochs ({args.epochs}), got {args.profile_epoch}")
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


def breakdown(prof: profile, steps: int, seconds: float, top: int, cuda: bool) -> dict[str, Any]:
    """The profiled epoch's figures (see the module docstring); on a CPU the host's alone."""
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy = busy_seconds([(e.time_range.start, e.time_range.end) for e in kernels])
    regions: dict[str, float] = {}  # GPU ms of each compiled graph's calls, by the graph's name
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith(REGION):
            regions[e.name] = regions.get(e.name, 0.0) + e.device_time_total / 1e3
    whole = [e.device_time_total / 1e3 for e in events if e.device_type == DeviceType.CPU and e.name == WHOLE_STEP]
    gpu_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    named = {f"compiled graph {i + 1}": ms / steps for i, ms in enumerate(sorted(regions.values(), reverse=True))}
    if whole:  # a captured step calls no compiled graph after its capture: one replay a step
        named = {f"{WHOLE_STEP} (with the batch's copies into it)": sum(whole) / steps}
    named["kernels outside the compiled graphs"] = (gpu_ms - sum(regions.values()) - sum(whole)) / steps
    launches = sum(1 for e in events if e.device_type == DeviceType.CPU and e.name in LAUNCHES)
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=60)
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)
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
        "top_host_ops": host,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    epochs: list[dict[str, Any]] = []
    found: dict[str, Any] = {}
    real_epoch = trainer.train_one_epoch

    def epoch(*a: Any, **k: Any) -> Any:
        watch, profiled = GcWatch(), len(epochs) + 1 == args.profile_epoch
        cuda = torch.cuda.is_available() and args.device.startswith("cuda")
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with watch.watching(), profile(activities=activities) if profiled else contextlib.nullcontext() as prof:
            stats = real_epoch(*a, **k)
        epochs.append({"seconds": stats.seconds, "profiled": profiled, "gc": watch.figures()})
        if profiled:
            found.update(breakdown(prof, stats.steps, stats.seconds, args.top, cuda))
        return stats

    from trainscale import fit

    sets = {"batch_size": args.batch_size} if args.batch_size else {}
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
    report(args, epochs, found, result.summary)
    save_result(
        args.out / "result.json",
        {"settings": vars(args), "epochs": epochs, **found, "summary": result.summary,
         "environment": environment(torch.device(args.device))},
    )  # fmt: skip
    print(f"saved {args.out / 'result.json'}")
    return 0


def report(
    args: argparse.Namespace, epochs: list[dict[str, Any]], found: dict[str, Any], summary: dict[str, Any]
) -> None:
    env = summary.get("environment") or {}
    print(f"\n{args.recipe}, {summary.get('train_step')} step ({summary.get('train_step_reason')}), compile mode "
          f"{args.compile_mode}, on {env.get('device_name') or env.get('cpu') or args.device}; warm-up "
          f"{summary.get('warmup_seconds') or 0:.1f} s")  # fmt: skip
    for i, e in enumerate(epochs, 1):
        gc_line = f"{e['gc']['count']} collections, {e['gc']['full']} full ({e['gc']['full_ms']:.1f} ms)"
        print(f"  epoch {i}: {e['seconds']:.4f} s{' (profiled)' if e['profiled'] else ''}; gc: {gc_line}")
    if not found:
        return
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


if __name__ == "__main__":
    raise SystemExit(main())
