"""Chaos: a fault-tolerant sync job with a fault every T seconds, against the same job without faults.

Both runs are ``trainscale train --fault-tolerance`` through the CLI, in this invocation, one after the other: first
the job without faults, whose step rate places the faults (fault k at the step the job reaches after k x T seconds),
then the same job with them (``--inject-fault``, kinds and replicas drawn with ``--seed``). Kinds: kill (SIGKILL),
hang (SIGSTOP; the launcher's watchdog kills the stopped worker and its agent restarts it) and link (the replica's
host is cut off its emulated cluster's switch for ``--link-down`` seconds, then plugged back in; never host 0, which
serves the lighthouse). With link among the kinds, or ``--emulated``, both runs go to an emulated cluster of one host
per replica (``--bandwidth`` links, this machine's cores shared out evenly), made here and deleted at the end.

The timer: from the job's first quorum to the last replica's end (the fault log's ``members`` and ``final`` events):
training and the per-epoch evaluations, not process start-up and data loading, the same work in both runs, so
``throughput kept`` = fault-free seconds / seconds with faults. Per fault (summary.json ``faults``): steps lost,
detection (the fault to the first survivor that dropped the step or the replica) and recovery (the fault to the
replica healed and back in the quorum). Goals (issue 14, this machine): <= 1 step lost per fault, detection <= 2 s,
recovery <= 20 s, throughput kept >= 85% at one fault per 60 s, replicas bitwise equal at the end.

    .venv/bin/python benchmarks/chaos.py --every 60 --out runs/chaos
    .venv/bin/python benchmarks/chaos.py --every 60 --kinds kill,hang,link --out runs/chaos-cluster  # as root

Parameter-server modes (``--set mode=async``, ``ps-sync`` or ``ma``; ``--set servers=S``, default 1) have their own
guarantees: a dead worker is not restarted; the servers drop it (detection: the fault to the first server that
did, ``--heartbeat-timeout`` for a hang) and the others train the batches it left, so no batch of an epoch is
skipped (checked per epoch: ``batches_committed``); recovery is the fault to the first update applied without
it; steps lost are the victim's uncommitted steps (ma: its local steps since the last average, <= the period).
Worker 0 writes the run folder and is never a victim, so at most workers - 1 faults. The timer: the job's
training seconds (every epoch's slowest pass, hand-overs included), the same work in both runs.

    .venv/bin/python benchmarks/chaos.py --every 60 --set mode=async --out runs/chaos-ps
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainscale.app.worker_env import to_argv
from trainscale.bench.grid import GridError, parse_sets, set_argument
from trainscale.bench.script import check_run, run_child, run_script
from trainscale.bench.timing import save_result
from trainscale.config import MAX_WAIT_S
from trainscale.errors import ConfigError, OneLineParser
from trainscale.modes.ps import DEFAULT_AVERAGE_EVERY, PS_MODES
from trainscale.record import K
from trainscale.runtime import ft
from trainscale.runtime.cluster import parse_rate
from trainscale.runtime.faults import DEFAULT_LINK_DOWN_S
from trainscale.train.environment import environment

JOB = {
    "model": "airbench",
    "dataset": "cifar10",
    "epochs": 3,
    "train_subset": 25600,
    "test_subset": 2000,
    "batch_per_worker": 64,
    "precision": "bf16",
}
KINDS = ("kill", "hang", "link")
DEFAULT_KINDS = ("kill", "hang")
GOALS = {"steps_lost": 1, "detection_seconds": 2.0, "recovery_seconds": 20.0, "kept": 0.85}


def is_ps(settings: dict[str, Any]) -> bool:
    return settings.get("mode") in PS_MODES


def run_job(
    out: Path, workers: int, settings: dict[str, Any], extra: list[str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(summary.json, the fault log's events) of one job; a finished run in ``out`` is reused, so an interrupted
    benchmark resumes."""
    summary = out / "summary.json"
    if not (summary.exists() and K.faults in json.loads(summary.read_text())):
        how = [] if is_ps(settings) else ["--fault-tolerance"]
        cmd = [
            sys.executable,
            "-m",
            "trainscale",
            "train",
            *how,
            "--workers",
            str(workers),
            *to_argv(settings),
            *extra,
            "--no-progress",
            "--out",
            str(out),
        ]
        print("$", " ".join(cmd[2:]), flush=True)
        started = time.monotonic()
        run_child(cmd, check=True)
        print(f"  {time.monotonic() - started:.1f} s start to end", flush=True)
    return json.loads(summary.read_text()), ft.read_events(out / ft.EVENTS_FILE)


def job_span(events: list[dict[str, Any]]) -> float:
    """Seconds from the job's first quorum to the last replica's end."""
    first = min(e["time"] for e in events if e["event"] == "members")
    return max(e["time"] for e in events if e["event"] == "final") - first


def schedule(steps: int, seconds: float, every: float, workers: int, kinds: list[str], seed: int) -> list[str]:
    """``--inject-fault`` items: fault k at the step the fault-free job reached after k x ``every`` seconds
    (none in its last ``every`` / 2 seconds, so each can be seen and healed), kind and replica drawn (a link cut
    from replicas 1..: replica 0's host serves the lighthouse)."""
    rng, rate, out, k = random.Random(seed), steps / seconds, [], 1
    while k * every <= seconds - every / 2:
        kind = rng.choice(kinds)
        victim = rng.randrange(1 if kind == "link" else 0, workers)
        out.append(f"{kind}:{victim}@{max(1, round(k * every * rate))}")
        k += 1
    return out


def ps_schedule(steps: int, seconds: float, every: float, workers: int, kinds: list[str], seed: int) -> list[str]:
    """As ``schedule`` for a parameter-server job: STEP is the victim's own step (every worker's rate is the
    job's), victims are drawn without replacement from workers 1.. (worker 0 writes the run folder)."""
    rng, rate, out = random.Random(seed), steps / seconds, []
    victims = rng.sample(range(1, workers), workers - 1)
    for k, victim in enumerate(victims, 1):
        if k * every > seconds - every / 2:
            break
        out.append(f"{rng.choice(kinds)}:{victim}@{max(1, round(k * every * rate))}")
    return out


def worker_steps(settings: dict[str, Any], workers: int) -> int:
    """A worker's own steps over the job (its shard's batches per epoch x epochs)."""
    samples = int(settings.get("train_subset") or 50000)
    return settings["epochs"] * (samples // workers // int(settings["batch_per_worker"]))


def ps_verdict(faults: list[dict[str, Any]], kept: float, skipped: int, settings: dict[str, Any]) -> dict[str, Any]:
    """The parameter-server goals: detection and recovery as for replicas, steps lost within the mode's bound (1;
    ma: its averaging period), no batch skipped, throughput kept."""
    bound = int(settings.get("average_every") or DEFAULT_AVERAGE_EVERY) if settings.get("mode") == "ma" else 1
    return judged(faults, kept, bound, {"batches_skipped": skipped, "steps_lost_bound": bound}, skipped == 0)


def batches_skipped(out: Path, settings: dict[str, Any], workers: int) -> int:
    """Batches of the epochs that no push committed (metrics.jsonl ``batches_committed``)."""
    per_epoch = worker_steps(settings, workers) // settings["epochs"] * workers
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return sum(per_epoch - r[K.batches_committed] for r in rows)


def final_step(events: list[dict[str, Any]]) -> int:
    return max(e["step"] for e in events if e["event"] == "final")


def verdict(faults: list[dict[str, Any]], kept: float, equal: bool | None) -> dict[str, Any]:
    """The fault-tolerant sync job's goals: the issue's bounds, and the replicas bitwise equal at the end."""
    return judged(faults, kept, GOALS["steps_lost"], {"replicas_equal": equal}, equal is True)


def judged(
    faults: list[dict[str, Any]], kept: float, steps_bound: int, extra: dict[str, Any], extra_ok: bool
) -> dict[str, Any]:
    """The worst fault's figures and whether every goal is met: steps lost <= ``steps_bound``, detection and
    recovery within ``GOALS``, throughput kept, and the mode's own ``extra_ok`` (its figures in ``extra``)."""

    def worst(key: str) -> float | None:
        values = [f[key] for f in faults if f[key] is not None]
        return max(values) if len(values) == len(faults) and values else None

    figures = {
        "max_steps_lost": worst("steps_lost"),
        "max_detection_seconds": worst("detection_seconds"),
        "max_recovery_seconds": worst("recovery_seconds"),
        "throughput_kept": kept,
        **extra,
    }
    checks = [
        figures["max_steps_lost"] is not None and figures["max_steps_lost"] <= steps_bound,
        figures["max_detection_seconds"] is not None and figures["max_detection_seconds"] <= GOALS["detection_seconds"],
        figures["max_recovery_seconds"] is not None and figures["max_recovery_seconds"] <= GOALS["recovery_seconds"],
        kept >= GOALS["kept"],
        extra_ok,
    ]
    return {**figures, "goals_met": all(checks) and bool(faults)}


def show(value: float | None, fmt: str) -> str:
    return "never" if value is None else format(value, fmt)


def report(faults: list[dict[str, Any]], result: dict[str, Any], clean: float, faulty: float) -> None:
    print(
        f"\nfault-free {clean:.1f} s, with {len(faults)} fault(s) {faulty:.1f} s: throughput kept "
        f"{100 * result['throughput_kept']:.1f}% (goal >= {100 * GOALS['kept']:.0f}%)"
    )
    print(f"{'#':>2}  {'kind':<5} {'rank':>4} {'step':>5}  {'detection s':>11}  {'recovery s':>10}  {'steps lost':>10}")
    for i, f in enumerate(faults, 1):
        print(
            f"{i:>2}  {f['kind']:<5} {f['rank']:>4} {f['step']:>5}  {show(f['detection_seconds'], '.2f'):>11}  "
            f"{show(f['recovery_seconds'], '.1f'):>10}  {f['steps_lost']:>10}"
        )
    bound = result.get("steps_lost_bound", GOALS["steps_lost"])
    print(
        f"worst: {result['max_steps_lost']} step(s) lost (goal <= {bound}), detection "
        f"{show(result['max_detection_seconds'], '.2f')} s (goal <= {GOALS['detection_seconds']:g}), recovery "
        f"{show(result['max_recovery_seconds'], '.1f')} s (goal <= {GOALS['recovery_seconds']:g}); replicas bitwise "
        f"equal: {result['replicas_equal']}"
    )
    print("goals met" if result["goals_met"] else "goals NOT met")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(prog="chaos.py", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="replicas (default 4)")
    parser.add_argument("--every", type=float, default=60.0, help="seconds between faults (default 60)")
    parser.add_argument(
        "--kinds",
        default=",".join(DEFAULT_KINDS),
        help="fault kinds to draw from: kill, hang, link (default kill,hang)",
    )
    parser.add_argument(
        "--emulated",
        action="store_true",
        help="run on an emulated cluster of one host per replica (implied by link; needs root)",
    )
    parser.add_argument("--bandwidth", default="1gbit", help="the emulated cluster's links (default 1gbit)")
    parser.add_argument(
        "--link-down",
        type=float,
        default=DEFAULT_LINK_DOWN_S,
        help=f"seconds a link cut lasts (default {DEFAULT_LINK_DOWN_S:g})",
    )
    parser.add_argument("--ft-timeout", type=float, default=1.5, help="--ft-timeout of both runs (default 1.5 s)")
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=1.5,
        help="parameter-server modes: --heartbeat-timeout of both runs (default 1.5 s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the faults' kinds and replicas (default 0)")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        type=set_argument,
        metavar="KEY=VALUE",
        help="a job setting over the default job's, e.g. epochs=3 (repeatable)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/chaos"))
    args = parser.parse_args(argv)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    args.emulated = args.emulated or "link" in args.kinds
    problem = args_problem(args)
    if problem:
        parser.error(problem)
    return args


def args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, in one line (None: nothing), checked before any job starts: every number
    finite and in range, the kinds known, the bandwidth tc's, the --set keys `trainscale train` flags, --out a
    folder it can make."""
    if not args.kinds or set(args.kinds) - set(KINDS):
        return f"--kinds: choose from {', '.join(KINDS)}"
    if args.workers < 2 or not args.every >= 10 or not math.isfinite(args.every):
        return "needs --workers >= 2 (a survivor) and a finite --every >= 10 s (a replica heals between faults)"
    for flag, value, high in (
        ("--link-down", args.link_down, 3600.0),
        ("--ft-timeout", args.ft_timeout, MAX_WAIT_S),
        ("--heartbeat-timeout", args.heartbeat_timeout, MAX_WAIT_S),
    ):
        if not (math.isfinite(value) and 0 < value <= high):
            return f"{flag} must be a positive number of seconds, at most {high:g}, got {value}"
    try:
        parse_rate(args.bandwidth)
        args.settings = {**JOB, **parse_sets(args.sets)}
    except (ConfigError, GridError) as err:
        return str(err)
    if args.out.exists() and not args.out.is_dir():
        return f"--out {args.out} exists and is not a folder; give a folder (made if absent)"
    return None


def ps_main(args: argparse.Namespace, settings: dict[str, Any]) -> int:
    """The parameter-server variant (see the module docstring)."""
    common = ["--heartbeat-timeout", str(args.heartbeat_timeout)]
    summary, _ = run_job(args.out / "fault-free", args.workers, settings, common)
    clean = summary[K.total_train_seconds]
    faults = ps_schedule(worker_steps(settings, args.workers), clean, args.every, args.workers, args.kinds, args.seed)
    if not faults:
        too_short(clean, args.every)
    summary, _ = run_job(args.out / "faults", args.workers, settings, [*common, "--inject-fault", ",".join(faults)])
    faulty = summary[K.total_train_seconds]
    recorded = summary[K.faults]
    skipped = batches_skipped(args.out / "faults", settings, args.workers)
    result = ps_verdict(recorded, clean / faulty, skipped, settings)
    env = environment(torch.device("cpu"))
    print(
        f"\nchaos: {settings['mode']} with {args.workers} workers and {settings['servers']} server shard(s), "
        f"{settings['model']} ({settings['dataset']}, {settings['precision']}, {settings['batch_per_worker']} images "
        f"per worker per step), a fault every {args.every:g} s from {', '.join(args.kinds)}, --heartbeat-timeout "
        f"{args.heartbeat_timeout:g}; {env['cpu']}, {env['cpu_count']} CPUs"
    )
    report(recorded, {**result, "replicas_equal": "n/a (one copy, on the servers)"}, clean, faulty)
    print(
        f"batches skipped: {skipped} (goal 0); steps lost bound {result['steps_lost_bound']}; "
        f"final test accuracy {summary[K.final_test_acc]:.4f}"
    )
    save(
        args,
        {
            **result,
            "faults": recorded,
            "injected": faults,
            "job": settings,
            "fault_free_seconds": clean,
            "faulty_seconds": faulty,
            "heartbeat_timeout": args.heartbeat_timeout,
            "environment": env,
        },
    )
    return 0


def too_short(clean: float, every: float) -> None:
    sys.exit(
        f"chaos.py: error: the fault-free job ran {clean:.0f} s, too short for a fault every {every:g} s; "
        "lengthen it (--set epochs=N) or lower --every"
    )


def save(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """result.json: the figures with the job, the faults, the settings and the environment."""
    save_result(
        args.out / "result.json",
        {**result, "every_seconds": args.every, "seed": args.seed, "workers": args.workers, "goals": GOALS},
    )
    print(f"saved {args.out / 'result.json'} (both runs' folders beside it)")


@contextlib.contextmanager
def emulated_cluster(args: argparse.Namespace) -> Iterator[list[str]]:
    """The `train` flags of the runs' place: none on this machine; with ``--emulated`` a cluster of one host per
    replica, made with `trainscale cluster up` and always deleted."""
    if not args.emulated:
        yield []
        return
    name = f"chaos{os.getpid() % 10**6}"
    cli = [sys.executable, "-m", "trainscale", "cluster"]
    subprocess.run([*cli, "up", name, "--hosts", str(args.workers), "--bandwidth", args.bandwidth], check=True)
    try:
        yield ["--cluster", name]
    finally:
        subprocess.run([*cli, "down", name], check=False)


def main() -> int:
    args = parse_args()
    settings = job_settings(args)
    if is_ps(settings) and args.emulated:
        refuse("the parameter-server variant runs on this machine: leave out link and --emulated")
    dry_run(args, settings)
    try:
        if is_ps(settings):
            return ps_main(args, settings)
        with emulated_cluster(args) as place:
            return sync_main(args, settings, place)
    except subprocess.CalledProcessError as err:
        sys.exit(f"chaos.py: error: `{' '.join(map(str, err.cmd[2:5]))} ...` failed (exit {err.returncode}); see above")


def job_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The job's `trainscale train` settings: the default job's, then --set; a parameter-server job on one server
    shard unless --set servers says otherwise."""
    return {"servers": 1, **args.settings} if is_ps(args.settings) else args.settings


def dry_run(args: argparse.Namespace, settings: dict[str, Any]) -> None:
    """The fault-free job checked as `trainscale train --dry-run` checks it, before anything starts: a setting the
    run would refuse is refused now, in train's own line (the faults are placed later, from the fault-free job)."""
    how = (
        {"heartbeat_timeout": args.heartbeat_timeout}
        if is_ps(settings)
        else {"fault_tolerance": True, "ft_timeout": args.ft_timeout}
    )
    out = args.out / "fault-free"
    where = {} if out.exists() else {"out": str(out)}  # there: a finished job, reused
    check_run({**how, "workers": args.workers, **where, **settings}, "the job's settings")


def refuse(message: str) -> None:
    """Bad input: one line, exit 2 (argparse's way), before any job starts."""
    print(f"chaos.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def sync_main(args: argparse.Namespace, settings: dict[str, Any], place: list[str]) -> int:
    """The fault-tolerant sync job (``place``: its `train` flags for an emulated cluster, if any)."""
    workers = 1 if place else args.workers  # per host
    common = [*place, "--ft-timeout", str(args.ft_timeout)]
    _, events = run_job(args.out / "fault-free", workers, settings, common)
    clean = job_span(events)
    faults = schedule(final_step(events), clean, args.every, args.workers, args.kinds, args.seed)
    if not faults:
        too_short(clean, args.every)
    cuts = ["--link-down", str(args.link_down)] if any(f.startswith("link:") for f in faults) else []
    extra = [*common, *cuts, "--max-restarts", str(len(faults)), "--inject-fault", ",".join(faults)]
    summary, events = run_job(args.out / "faults", workers, settings, extra)
    faulty = job_span(events)
    recorded = summary[K.faults]
    result = verdict(recorded, clean / faulty, summary.get(K.replicas_equal))
    env = environment(torch.device("cpu"))
    extra_settings = "".join(f", {key} {value}" for key, value in settings.items() if key not in JOB)
    where = f" on an emulated cluster of {args.workers} hosts at {args.bandwidth}" if place else ""
    print(
        f"\nchaos: {args.workers} replicas{where} of {settings['model']} ({settings['dataset']}, "
        f"{settings['precision']}, "
        f"{settings['batch_per_worker']} images per replica per step{extra_settings}), a fault every "
        f"{args.every:g} s from {', '.join(args.kinds)}, --ft-timeout {args.ft_timeout:g}"
        f"{f', --link-down {args.link_down:g}' if place else ''}; {env['cpu']}, "
        f"{env['cpu_count']} CPUs"
    )
    report(recorded, result, clean, faulty)
    save(
        args,
        {
            **result,
            "faults": recorded,
            "injected": faults,
            "job": settings,
            "fault_free_seconds": clean,
            "faulty_seconds": faulty,
            "ft_timeout": args.ft_timeout,
            "environment": env,
            "emulated_cluster": {
                "hosts": args.workers,
                "bandwidth": args.bandwidth,
                "link_down_seconds": args.link_down,
            }
            if place
            else None,
        },
    )
    return 0


if __name__ == "__main__":
    run_script(main)
