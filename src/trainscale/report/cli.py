"""`trainscale report`: flags and the command (kept here so cli.py and commands.py only gain two lines)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_report_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dirs",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="results folders of `trainscale bench`, run folders, or folders holding them",
    )
    p.add_argument("--out", type=Path, required=True, help="report folder (new, or a previous report to replace)")
    p.add_argument(
        "--profile",
        type=Path,
        nargs="+",
        default=[],
        metavar="PROFILE",
        help="profiles from trainscale profile: each run on an emulated cluster that one of them matches "
        "(model, per-worker batch, precision, threads and CPUs per host) gets the planner's step time "
        "beside its measured one, and the crossover table the planner's crossover",
    )


def report_command(args: argparse.Namespace) -> int:
    from trainscale.report.build import write_report

    report = write_report(args.dirs, args.out, args.profile)
    for path in report.files:
        print(path)
    return 0
