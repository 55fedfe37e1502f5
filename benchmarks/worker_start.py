"""How long a short `trainscale train --workers N` takes, forked workers against a new interpreter for each.

Forked workers are the default on the CPU; a new interpreter per worker is ``--start-method spawn``, as torchrun
starts them.

Both sides run the same command in a new process, as a user does, with a run so short (one epoch of a small MLP on
synthetic images) that what is timed is the job's start and end: the launcher's imports and pre-flight, the
workers' start, the rendezvous, the process group, and the results. Timer scope: the whole command, from its start
to its exit (wall clock), and the CPU time it and its workers used; ``--warmup`` runs per side excluded (the first
run of a machine also reads torch from disk), repeats interleaved so drift and background load hit both alike.

    python benchmarks/worker_start.py --workers 2 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from subprocess import PIPE
from typing import Any

import torch

from trainscale.app.worker_env import to_argv
from trainscale.bench.script import COUNT, WARMUP, check_run, model_name, run_child, run_script
from trainscale.bench.timing import Timing, paired_ratios, save_result
from trainscale.errors import OneLineParser
from trainscale.train.environment import environment

METHODS = ("auto", "spawn")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=COUNT, default=2, help="workers of the job (default 2)")
    p.add_argument("--model", type=model_name, default="mlp", help="a registered model or an import path (mlp)")
    p.add_argument("--repeats", type=COUNT, default=5, help="timed runs per side (default 5)")
    p.add_argument("--warmup", type=WARMUP, default=1, help="untimed runs per side first (default 1)")
    default = f"runs/bench/worker-start-{time.strftime('%Y%m%d-%H%M%S')}.json"
    p.add_argument("--out", default=default, help="the figures, with settings and environment (JSON)")
    return p.parse_args(argv)


def settings(args: argparse.Namespace, method: str, out: Path) -> dict[str, Any]:
    """The short run's `trainscale train` settings (``trainscale.fit``'s keywords)."""
    return dict(
        model=args.model, dataset="synthetic", train_subset=256, test_subset=64, batch_size=64, epochs=1,
        progress=False, checkpoint=False, workers=args.workers, start_method=method, out=str(out),
    )  # fmt: skip


def command(args: argparse.Namespace, method: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "trainscale", "train", *to_argv(settings(args, method, out))]


def run_once(args: argparse.Namespace, method: str, folder: Path, index: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and its workers) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    run_child(command(args, method, folder / f"{method}-{index}"), check=True, stdout=PIPE, stderr=PIPE)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(args: argparse.Namespace) -> dict[str, dict[str, Timing]]:
    walls: dict[str, list[float]] = {m: [] for m in METHODS}
    cpus: dict[str, list[float]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory(prefix="ts-start") as tmp:
        for index in range(args.warmup + args.repeats):
            for method in METHODS:
                wall, cpu = run_once(args, method, Path(tmp), index)
                if index >= args.warmup:
                    walls[method].append(wall)
                    cpus[method].append(cpu)
    return {m: {"wall": Timing(walls[m]), "cpu": Timing(cpus[m])} for m in METHODS}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ts-start") as tmp:
        for method in METHODS:
            check_run(settings(args, method, Path(tmp) / method))
    env = environment(torch.device("cpu"))
    figures = measure(args)
    print(f"{args.workers} worker(s), {args.model}, {env['cpu']} ({env['cpu_count']} cores), torch {env['torch']}")
    for method, said in (("auto", "forked (default)"), ("spawn", "new interpreters")):
        wall, cpu = figures[method]["wall"], figures[method]["cpu"]
        print(
            f"  {said:<18} command {wall.mean:5.2f} s +- {wall.stdev:.2f} wall, "
            f"{cpu.mean:5.2f} s +- {cpu.stdev:.2f} CPU ({args.repeats} runs)"
        )
    ratios = paired_ratios(figures["auto"]["wall"], figures["spawn"]["wall"])
    print(f"  forked / new interpreters, wall: {statistics.median(ratios):.2f} (median of {len(ratios)} pairs)")
    save_result(
        Path(args.out),
        {"config": vars(args), "environment": env, "pid": os.getpid(), "figures": figures, "wall_ratios": ratios},
    )
    print(f"  saved {args.out}")


if __name__ == "__main__":
    run_script(main)
