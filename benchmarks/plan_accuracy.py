"""The planner against measured step times on emulated clusters: error per cell, mean absolute error, worst.

Runs ``benchmarks/grids/plan_accuracy.toml`` (the airbench net on 2 and 4 emulated hosts at three bandwidths,
six methods: 36 cells; resumable) through ``trainscale bench``, exactly as a user would, then profiles the
net once for every condition the runs met (per-worker batch, precision, and each host's threads and CPU
quota) with ``trainscale profile --cpus``, and predicts every run with ``trainscale plan``'s model.
``--also DIR`` adds other results folders of emulated-cluster runs (e.g. the slow-links grid) to the
check; their conditions are profiled too.

Timer scopes: measured is each run's mean step over its steady epochs (summary.json ``step_seconds``:
device-synchronised training steps, augmentation and optimizer included, evaluation excluded); planned
is compute from the profile (medians of timed steps after warm-up) plus the exposed communication of the
cost model. Goal (issue 12): mean absolute error <= 10%, no cell worse than 25%.

    sudo .venv/bin/python benchmarks/plan_accuracy.py --out runs/plan-accuracy
    sudo .venv/bin/python benchmarks/plan_accuracy.py --out runs/plan-accuracy --also runs/slow-links
    sudo .venv/bin/python benchmarks/plan_accuracy.py --out runs/plan-accuracy --scale quick   # 2 hosts only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainscale.bench.script import COUNT, run_child, run_script
from trainscale.bench.timing import save_result
from trainscale.errors import OneLineParser
from trainscale.plan.check import Check, check_run, key_of_run, method_spec, setting_for_run
from trainscale.plan.profile import load_profile
from trainscale.report.collect import collect
from trainscale.runtime.cpus import cpu_count
from trainscale.train.environment import environment

GRID = Path(__file__).resolve().parent / "grids" / "plan_accuracy.toml"
MEAN_GOAL, WORST_GOAL = 0.10, 0.25


def cli(*args: str) -> None:
    cmd = [sys.executable, "-m", "trainscale", *args]
    print("$", " ".join(cmd[2:]), flush=True)
    run_child(cmd, check=True)


def emulated_runs(dirs: list[Path]) -> list[Any]:
    """Finished runs on emulated clusters in modes the planner models."""
    records = collect(dirs).records
    return [r for r in records if r.status == "ok" and setting_for_run(r.config, r.summary) is not None]


def profile_conditions(runs: list[Any]) -> dict[tuple, set[str]]:
    """Each (model, batch, precision, threads, cpus) the runs met, with the compressors they used."""
    needed: dict[tuple, set[str]] = {}
    for r in runs:
        spec = method_spec(r.config)
        needed.setdefault(key_of_run(r.summary), set()).update([] if spec.dense else [spec.text])
    return needed


def profile_all(needed: dict[tuple, set[str]], folder: Path, repeats: int) -> dict[tuple, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    profiles = {}
    for (model, batch, precision, threads, cpus), specs in sorted(needed.items(), key=str):
        path = folder / f"{model}-b{batch}-{precision}-t{threads}-c{cpus}.json"
        args = [
            "profile",
            "--model",
            model,
            "--batch-size",
            str(batch),
            "--precision",
            precision,
            "--threads",
            str(threads or 1),
            "--repeats",
            str(repeats),
            "--no-overlap",  # as its published figures were taken: perfect overlap of the bucket schedule
            "--out",
            str(path),
        ]
        if cpus:
            args += ["--cpus", str(cpus)]
        if specs:
            args += ["--compress", *sorted(specs)]
        cli(*args)
        profiles[(model, batch, precision, threads, cpus)] = load_profile(path)
    return profiles


def print_checks(checks: list[Check]) -> dict[str, Any]:
    print(
        f"\n{'run':<48} {'hosts':>5} {'link':>8} {'mode':>9} {'compressor':>36} {'measured':>9} {'planned':>8} "
        f"{'error':>7}"
    )
    for c in sorted(checks, key=lambda c: (c.setting.hosts, -c.setting.link.bandwidth, c.run)):
        print(
            f"{c.run[:48]:<48} {c.setting.hosts:>5} {c.setting.link.bandwidth * 8 / 1e6:>6.0f}Mb "
            f"{c.setting.mode:>9} {c.setting.spec.text[:36]:>36} {1e3 * c.measured_step:>7.0f}ms "
            f"{1e3 * c.predicted.step_seconds:>6.0f}ms {100 * c.error:>+6.1f}%"
        )
    errors = [abs(c.error) for c in checks]
    worst = max(checks, key=lambda c: abs(c.error))
    mean = statistics.fmean(errors)
    print(
        f"\n{len(checks)} cells: mean absolute error {100 * mean:.1f}% (goal <= {100 * MEAN_GOAL:.0f}%: "
        f"{'PASS' if mean <= MEAN_GOAL else 'FAIL'}), worst {worst.run} {100 * worst.error:+.1f}% (goal <= "
        f"{100 * WORST_GOAL:.0f}%: {'PASS' if abs(worst.error) <= WORST_GOAL else 'FAIL'})"
    )
    return {"cells": len(checks), "mean_abs_error": mean, "worst": worst.run, "worst_error": worst.error}


def parse_args() -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/plan-accuracy"), help="results folder (resumable)")
    p.add_argument("--scale", default="full", help="full: 2 and 4 hosts (36 cells); quick: 2 hosts (18)")
    p.add_argument("--also", type=Path, nargs="*", default=[], help="other results folders of emulated-cluster runs")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to trainscale bench, e.g. --set cluster_hosts=2 (only the 2-host cells)",
    )
    p.add_argument("--no-bench", action="store_true", help="only profile and compare the runs already there")
    p.add_argument("--repeats", type=COUNT, default=20, help="timed steps of each profile")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    start = time.time()
    grid_out = args.out / "grid"
    if not args.no_bench:
        cli(
            "bench",
            str(GRID),
            "--scale",
            args.scale,
            "--out",
            str(grid_out),
            *(arg for item in args.sets for arg in ("--set", item)),
        )
    runs = emulated_runs([d for d in (grid_out, *args.also) if d.exists()])
    if not runs:
        print("no finished emulated-cluster runs to check", file=sys.stderr)
        return 1
    profiles = profile_all(profile_conditions(runs), args.out / "profiles", args.repeats)
    checks = [
        c
        for c in (
            check_run(r.bench.get("short_name", "") + ":" + r.run_id, r.config, r.summary, profiles) for r in runs
        )
        if c is not None
    ]
    result = print_checks(checks)
    env = environment(torch.device("cpu"))
    print(f"machine: {env['cpu']} ({cpu_count()} cores); {time.time() - start:.0f} s in all")
    save_result(
        args.out / "plan_accuracy.json",
        {
            **result,
            "environment": env,
            "cells_detail": [
                {
                    "run": c.run,
                    "hosts": c.setting.hosts,
                    "bandwidth_bps": c.setting.link.bandwidth * 8,
                    "mode": c.setting.mode,
                    "compressor": c.setting.spec.text,
                    "measured_step_seconds": c.measured_step,
                    "planned": c.predicted.to_dict(),
                }
                for c in checks
            ],
        },
    )
    return 0


if __name__ == "__main__":
    run_script(main)
