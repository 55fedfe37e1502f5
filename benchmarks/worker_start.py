"""How long a short `trainscale train --workers N` takes from the command line with forked workers (the default on
the CPU) against workers that are each a new interpreter (``--start-method spawn``, as torchrun starts them).

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from trainscale.bench.script import COUNT, WARMUP, model_name, run_script
from trainscale.bench.timing import Timing, paired_ratios, save_result
from trainscale.errors import OneLineParser
from trainscale.train.environment import environment

METHODS = ("auto", "spawn")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=COUNT, default=2)
    p.add_argument("--model", type=model_name, default="mlp")
    p.add_argument("--repeats", type=COUNT, default=5)
    p.add_argument("--warmup", type=WARMUP, default=1)
    p.add_argument("--out", default=f"runs/bench/worker-start-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return p.parse_args(argv)


def command(args: argparse.Namespace, method: str, out: Path) -> list[str]:
    run = ["--model", args.model, "--dataset", "synthetic", "--train-subset", "256", "--test-subset", "64"]
    run += ["--batch-size", "64", "--epochs", "1", "--no-progress", "--no-checkpoint"]
    return [sys.executable, "-m", "trainscale", "train", *run, "--workers", str(args.workers)] + [
        "--start-method",
        method,
        "--out",
        str(out),
    ]


def run_once(args: argparse.Namespace, method: str, folder: Path, index: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and its workers) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command(args, method, folder / f"{method}-{index}"), check=True, capture_output=True)
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
