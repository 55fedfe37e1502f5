"""`trainscale bench`: flags and the command (kept here so cli.py and commands.py only gain two lines)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from trainscale.config import bound_problem

if TYPE_CHECKING:
    from trainscale.bench.expand import RunSpec
    from trainscale.bench.grid import Grid
    from trainscale.bench.runner import BenchOptions


def add_bench_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "grid",
        type=Path,
        help="grid file (TOML), e.g. benchmarks/grids/seed003_keras_scaling.toml (the Keras-MXNet scaling study)",
    )
    p.add_argument("--out", type=Path, required=True, help="results folder (re-run the same command to resume)")
    p.add_argument(
        "--scale",
        default=None,
        help="the grid's [scale.NAME] to apply: quick (minutes on a CPU, "
        "the default for a grid with scales) or full (the original study's own settings, for GPU machines)",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a `trainscale train` setting for every run of the grid, e.g. --set epochs=2, --set "
        "precision=bf16, --set milestones=[2,3] (repeatable; VALUE is a TOML value, a bare word is "
        "text; KEY with dashes or underscores). It wins over everything the grid file says about KEY "
        "([base], rows, axes and the scale): an axis of KEY runs its one value. The values are "
        "recorded in grid.json and each run's config, so a changed --set plans new runs",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder holding the dataset, for every run: --set data_dir=DIR, but checked to exist "
        "before any run starts and recorded as an absolute path (with neither this nor a data_dir in "
        "the grid, runs look in $TRAINSCALE_DATA, else ~/.cache/trainscale)",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        help="seconds one run may take before it is stopped and recorded as failed (default: no limit)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the planned runs and exit (nothing is written)")
    p.add_argument(
        "--allow-ssh",
        action="store_true",
        help="let the grid set `hosts`/`ssh` (its runs then start "
        "commands on the machines its hosts files name); refused without it",
    )
    p.add_argument(
        "--update",
        action="store_true",
        help="allow a results folder planned from other settings: "
        "runs whose settings still match are kept, the others run",
    )


def _seconds(text: str) -> float:
    """``--timeout``: a finite positive number (NaN would never stop a run, a negative one stops every run)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    problem = bound_problem(value, above=0)
    if problem:
        raise argparse.ArgumentTypeError(f"must be {problem} (seconds), got {text}")
    return value


def bench_command(args: argparse.Namespace) -> int:
    """0 when every run finished, 1 when some failed (they are recorded and the grid went on)."""
    from trainscale.bench.grid import parse_sets
    from trainscale.bench.runner import BenchOptions, check_same_plan, plan, run_grid
    from trainscale.io import check_folder_writable

    check_folder_writable(args.out, "--out")  # a file or an unwritable place: one line before any run
    options = BenchOptions(
        grid=args.grid,
        out=args.out,
        scale=args.scale,
        timeout=args.timeout,
        update=args.update,
        sets=parse_sets(args.sets),
        data_dir=args.data_dir,
        allow_ssh=args.allow_ssh,
    )
    if args.dry_run:
        grid, specs = plan(options)
        check_same_plan(options, grid, specs)
        print_plan(options, grid, specs)
        return 0
    results = run_grid(options)  # a scheduler's SIGTERM stops it as Ctrl-C does (``commands.stops_as_ctrl_c``)
    counts = {s: sum(1 for r in results if r.status == s) for s in ("ok", "skipped", "failed", "timeout")}
    print(
        f"{len(results)} run(s): "
        + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        + f"; ledger {args.out / 'grid.jsonl'}; report with `trainscale report {args.out} --out REPORT`"
    )
    for r in results:
        if r.status in ("failed", "timeout"):
            print(f"  {r.status}: {r.run_id}: {r.error}")
    return 1 if counts["failed"] or counts["timeout"] else 0


def print_plan(options: BenchOptions, grid: Grid, specs: list[RunSpec]) -> None:
    """One line per planned run: its id, the axis values and the settings that most often differ."""
    from trainscale.bench.grid import set_text
    from trainscale.bench.runner import effective_scale, overrides
    from trainscale.console import format_table

    shown = [k for s in specs for k in s.point if k not in ("batch_size", "batch_per_worker")]
    keys = list(dict.fromkeys(shown + ["model", "mode", "workers", "batch", "epochs", "seed"]))
    rows = [
        {
            "run": s.run_id,
            **{k: s.config.get(k, s.point.get(k)) for k in keys},
            "batch": _batch(s.config),
            "state": _state(options, s),
        }
        for s in specs
    ]
    sets = set_text(overrides(options))
    print(
        f"grid {grid.name} (scale {effective_scale(options, grid) or 'none'}{', ' + sets if sets else ''}): "
        f"{len(specs)} run(s) into {options.out / 'runs'}"
    )
    print(format_table(rows, [("run", "run", str)] + [(k, k, str) for k in keys] + [("state", "state", str)]))


def _batch(config: dict) -> str:
    """Per worker x workers = global, as the run will split it."""
    from trainscale.app.config import TrainConfig
    from trainscale.train import BatchPlan

    workers = int(config.get("workers") or 1) * int(config.get("nnodes") or 1)
    plan = BatchPlan.resolve(TrainConfig.flat(**config), workers)
    return f"{plan.per_worker}x{workers}={plan.global_batch}" if workers > 1 else str(plan.global_batch)


def _state(options: BenchOptions, spec: RunSpec) -> str:
    """What a real run would do with this run: run it, resume it, skip it, or refuse its folder."""
    from trainscale.bench.runfolder import State, folder_state
    from trainscale.errors import ConfigError

    try:
        state = folder_state(options.out / "runs" / spec.run_id, spec)
    except ConfigError:
        return "folder holds other settings"
    return {State.TODO: "to run", State.RESUME: "to resume", State.DONE: "done (skipped)"}[state]
