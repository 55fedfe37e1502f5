"""Time to 94% on CIFAR-10 with the airbench94 recipe: N seeds through the CLI, mean and spread of accuracy and time.

Each run is ``trainscale train --recipe airbench94 --seed S --precision P --target-acc 0.94`` on the real CIFAR-10,
exactly as a user runs it (add recipe settings with ``--set KEY=VALUE``, e.g. ``--set batch_size=1000``). The figure
is the reference's timer scope (summary.json ``reference_scope``: the whitening fit, the training steps and the
final 6-view test-time-augmented evaluation; not data loading, compile warm-up or the per-epoch evaluations), the
one airbench94_muon reports (2.59 s on an A100, 94.01% mean of 200 runs); trainscale's own trainer scope (training
steps only) is printed beside it. Runs go one after another (never two timings at once); a finished seed's folder
is kept and reused, so an interrupted benchmark resumes (the seed it stopped in runs again). ``result.json`` is
written again after every seed, so a benchmark stopped by a time limit still leaves the figures of the seeds it
finished (``complete``: false, ``runs_done`` of ``runs_asked``).

    .venv/bin/python benchmarks/time_to_94.py --runs 5 --out runs/time-to-94            # CPU, bf16 where native (auto)
    .venv/bin/python benchmarks/time_to_94.py --runs 5 --first-seed 5 --out runs/t94-more  # five more seeds: 5-9
    .venv/bin/python benchmarks/time_to_94.py --runs 10 --device cuda --out runs/t94-gpu
    .venv/bin/python benchmarks/time_to_94.py --recipe cifar10-fast --runs 5 --device cuda --out runs/r9-gpu
    .venv/bin/python benchmarks/time_to_94.py --recipe speedrun94 --runs 25 --device cuda --out runs/sr94-gpu

``--one-process`` runs every seed in this process through ``trainscale.fit`` (the Python API) instead: on a GPU,
where a run's timed part is a second or two, a new process's start, imports and data load took about 9 s of the
17 s between two seeds' starts through the CLI (an H200). Each run still warms up (compiles, from the caches on disk)
before its timers, but the runs share what a process keeps: cuDNN's algorithm choices (timed by the first run), so
their times do not sample that choice independently as a process each does.

``--recipe cifar10-fast`` runs ResNet-9 with the cifar10-fast recipe (24 epochs, 94% median published); its goal
is the accuracy alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainscale.app.worker_env import to_argv
from trainscale.bench.grid import GridError, parse_sets, set_argument
from trainscale.bench.script import COUNT, at_least, check_run, device_name, run_child, run_script
from trainscale.bench.timing import mean_and_spread, save_result
from trainscale.errors import ConfigError, OneLineParser, TrainscaleError
from trainscale.record import K
from trainscale.train.environment import environment

TARGET = 0.94
GOALS = {
    ("airbench94", "cpu"): 15 * 60.0,
    ("airbench94", "cuda"): 2.5,
    ("speedrun94", "cuda"): 1.1,
}  # seconds, reference scope
SEED = at_least(0)


def finished(out: Path, seed: int) -> dict[str, Any] | None:
    """The summary of a finished run in ``out``, else None; a run that was interrupted is run again from its start
    (a timed run cannot continue in another process): its folder is kept beside, renamed."""
    summary = out / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get(K.reference_scope):
        return json.loads(summary.read_text())
    if out.exists():
        aside = out.with_name(f"{out.name}.interrupted-{time.strftime('%Y%m%d-%H%M%S')}")
        out.rename(aside)
        print(f"seed {seed}: {out} holds an unfinished run, kept as {aside}; running the seed again", flush=True)
    return None


def run_seed(out: Path, recipe: str, seed: int, device: str, precision: str, sets: dict[str, Any]) -> dict[str, Any]:
    """One seed through the CLI (a process of its own), or its summary when ``out`` already holds the finished
    run (see ``finished``)."""
    done = finished(out, seed)
    if done is not None:
        return done
    extra = to_argv(sets)
    cmd = [
        sys.executable,
        "-m",
        "trainscale",
        "train",
        "--recipe",
        recipe,
        "--seed",
        str(seed),
        "--device",
        device,
        "--precision",
        precision,
        "--target-acc",
        str(TARGET),
        "--no-progress",
        "--out",
        str(out),
        *extra,
    ]
    print("$", " ".join(cmd[2:]), flush=True)
    status = run_child(cmd).returncode
    if status:
        raise SystemExit(f"seed {seed}: `trainscale train` exited with status {status} (its own message is above)")
    return json.loads((out / "summary.json").read_text())


def run_seed_here(
    out: Path, recipe: str, seed: int, device: str, precision: str, settings: dict[str, Any]
) -> dict[str, Any]:
    """One seed through ``trainscale.fit`` in this process (``--one-process``), or its summary when ``out`` already
    holds the finished run. torch.compile's in-memory caches are cleared first, as a new process would find them
    (a run's graphs guard on its own model: kept, they would pile up run after run); its warm-up compiles again,
    from the caches on disk, before its timers."""
    done = finished(out, seed)
    if done is not None:
        return done
    import trainscale

    print(f"fit(recipe={recipe!r}, seed={seed}, device={device!r}, precision={precision!r}, {settings})", flush=True)
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    run = dict(recipe=recipe, seed=seed, device=device, precision=precision, target_acc=TARGET, progress=False)
    try:
        return trainscale.fit(**run, out=str(out), **settings).summary
    except TrainscaleError as err:  # what `trainscale train` would say in one line, and its exit status
        print(f"seed {seed}: {err}", file=sys.stderr)
        raise SystemExit(2 if isinstance(err, ConfigError) else 1) from None


def row_of(seed: int, summary: dict[str, Any]) -> dict[str, Any]:
    """One finished seed's figures, from its summary.json."""
    scope = summary[K.reference_scope]
    fit, steps = summary.get(K.data_init_seconds) or 0.0, summary[K.total_train_seconds]
    return {
        "seed": seed,
        "acc": scope["test_acc"],
        "reference_seconds": scope["seconds"],
        "train_seconds": steps,
        "data_init_seconds": fit,
        "final_eval_seconds": scope["seconds"] - steps - fit,
        "eval_forward": summary.get(K.eval_forward),
        "steady_epoch_seconds": summary.get(K.steady_epoch_seconds),
        "gpu_clock_mhz": summary.get(K.gpu_clock_mhz),
        "gpu_power_w": summary.get(K.gpu_power_w),
        "warmup_seconds": summary.get(K.warmup_seconds),
        "train_step": summary.get(K.train_step),
        "out": summary[K.out],
    }


def figures(rows: list[dict[str, Any]], recipe: str, device: str) -> dict[str, Any]:
    """Mean and spread of the finished runs, and whether they meet the recipe's goal."""
    acc, ref, steps = ([r[k] for r in rows] for k in ("acc", "reference_seconds", "train_seconds"))
    (acc_m, acc_s), (ref_m, ref_s), (steps_m, steps_s) = map(mean_and_spread, (acc, ref, steps))
    goal = GOALS.get((recipe, "cuda" if device.startswith("cuda") else "cpu"))
    met = acc_m >= TARGET and (goal is None or all(r["reference_seconds"] < goal for r in rows))
    return {
        "accuracy_mean": acc_m,
        "accuracy_stdev": acc_s,
        "reference_seconds_mean": ref_m,
        "reference_seconds_stdev": ref_s,
        "train_seconds_mean": steps_m,
        "train_seconds_stdev": steps_s,
        "goal_seconds": goal,
        "goal_met": met,
    }


def report(rows: list[dict[str, Any]], found: dict[str, Any], recipe: str, machine: str) -> None:
    print(f"\n{recipe} recipe, {len(rows)} run(s) on {machine}")
    for r in rows:
        steady = f", a steady epoch {r['steady_epoch_seconds']:.3f} s" if r.get("steady_epoch_seconds") else ""
        if r.get("gpu_clock_mhz"):
            steady += f" at {r['gpu_clock_mhz']:.0f} MHz, {r.get('gpu_power_w') or 0.0:.0f} W"
        if r.get("final_eval_seconds") is not None:
            steady += (
                f"; whitening fit {1000 * r['data_init_seconds']:.0f} ms, final evaluation "
                f"{1000 * r['final_eval_seconds']:.0f} ms ({r.get('eval_forward') or 'eager'})"
            )
        print(
            f"  seed {r['seed']}: {100 * r['acc']:.2f}% in {r['reference_seconds']:.2f} s (reference scope), "
            f"{r['train_seconds']:.2f} s of training steps{steady}; warm-up and compilation before the timer "
            f"{r.get('warmup_seconds') or 0.0:.1f} s ({r.get('train_step') or 'eager'} step)"
        )
    print(
        f"accuracy {100 * found['accuracy_mean']:.2f} +- {100 * found['accuracy_stdev']:.2f}% "
        f"(goal: mean >= {100 * TARGET:.1f}%)"
    )
    goal = found["goal_seconds"]
    bound = f"goal: each < {goal:g} s" if goal else "no time goal"
    ref, steps = (
        f"{found[f'{k}_mean']:.2f} +- {found[f'{k}_stdev']:.2f} s" for k in ("reference_seconds", "train_seconds")
    )
    print(f"time {ref} in the reference's scope ({bound}); training steps alone {steps}")
    print("goal met" if found["goal_met"] else "goal NOT met")


def result(
    rows: list[dict[str, Any]], args: argparse.Namespace, last: dict[str, Any], env: dict[str, Any]
) -> dict[str, Any]:
    """result.json after the seeds in ``rows`` (``last``: the latest one's summary): figures, settings, machine."""
    found, complete = figures(rows, args.recipe, args.device), len(rows) == args.runs
    return {
        "complete": complete,
        "runs_done": len(rows),
        "runs_asked": args.runs,
        "first_seed": args.first_seed,
        "runs": rows,
        **found,
        "goal_met": found["goal_met"] and complete,  # a goal is over the runs asked for, never over a part
        "recipe": args.recipe,
        "device": args.device,
        "precision": last[K.precision],  # what ran: auto resolved for the device
        "sets": args.sets,
        "timer_scope": last[K.reference_scope]["scope"],
        "environment": env,
    }


def seeds(args: argparse.Namespace) -> range:
    """The series' seeds: ``--runs`` of them from ``--first-seed``."""
    return range(args.first_seed, args.first_seed + args.runs)


def first_run(args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    """The settings of the series' first seed as ``trainscale.fit`` takes them, in the first seed folder not yet
    there (the others are finished runs, or are kept aside and run again)."""
    fresh = [args.out / f"seed-{seed}" for seed in seeds(args) if not (args.out / f"seed-{seed}").exists()]
    run = dict(
        recipe=args.recipe, seed=args.first_seed, device=args.device, precision=args.precision, target_acc=TARGET
    )
    return {**run, "progress": False, **({"out": str(fresh[0])} if fresh else {}), **settings}


def main() -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--recipe",
        default="airbench94",
        choices=("airbench94", "speedrun94", "cifar10-fast"),
        help="airbench94 (default), speedrun94 (its faster variant) or cifar10-fast (ResNet-9, 24 epochs)",
    )
    parser.add_argument("--runs", type=COUNT, default=5, metavar="N", help="how many seeds (default 5)")
    parser.add_argument(
        "--first-seed",
        type=SEED,
        default=0,
        metavar="S",
        help="the first seed (default 0): the runs take seeds S..S+N-1",
    )
    parser.add_argument("--device", type=device_name, default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--precision",
        default="auto",
        help="auto (default: bf16 where the device computes it natively, else fp32), bf16 (autocast) or fp32",
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        type=set_argument,
        metavar="KEY=VALUE",
        help="a setting over the recipe's, e.g. batch_size=1000 (repeatable)",
    )
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="every seed in this process through trainscale.fit, not a `trainscale train` process each: the start, "
        "imports and data load are paid once (each run still warms up before its timers)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/time-to-94"))
    args = parser.parse_args()
    try:
        settings = parse_sets(args.sets)
    except GridError as err:
        parser.error(str(err))
    check_run(first_run(args, settings))
    env = environment(torch.device(args.device))
    machine = env["device_name"] if args.device.startswith("cuda") else f"{env['cpu']}, {env['cpu_count']} CPUs"
    rows: list[dict[str, Any]] = []
    run = run_seed_here if args.one_process else run_seed
    for seed in seeds(args):
        summary = run(args.out / f"seed-{seed}", args.recipe, seed, args.device, args.precision, settings)
        rows.append(row_of(seed, summary))
        saved = result(rows, args, summary, env)
        save_result(args.out / "result.json", saved)
    report(rows, saved, args.recipe, machine)  # the figures result.json holds, complete by now
    print(f"saved {args.out / 'result.json'} (each run's config.json and summary.json in its folder)")
    return 0


if __name__ == "__main__":
    run_script(main)
