"""The `trainscale` command: a thin layer that turns flags into configs and calls the packages.

User errors (bad flags, bad files, missing data) print one line and exit 2, with no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from trainscale.config import CoreConfig, Section, field_types, flag_name
from trainscale.errors import TrainscaleError

log = logging.getLogger("trainscale")


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit status 2 (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def _numbers(text: str) -> list[float | int]:
    """Comma-separated numbers, each an integer where it is written as one."""
    try:
        return [int(x) if x.strip().lstrip("-").isdigit() else float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got '{text}'") from None


def add_config_flags(parser: argparse.ArgumentParser, cls: type, sections: Sequence[type]) -> None:
    """One flag per field of the config class ``cls`` (a ``Section``, or every section of a ``CoreConfig``),
    derived from the field: name, type, help, choices, short and alternative spellings (see
    ``trainscale.config.option``). Grouped by section, in the order of ``sections`` (then ``cls``'s own;
    same-titled sections share a group). Absent flags stay absent (SUPPRESS), so they fall back to --config,
    then to the defaults."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    own: list[type[Section]] = (
        list(cls.section_types().values()) if issubclass(cls, CoreConfig) else [typing.cast("type[Section]", cls)]
    )
    kinds = sorted(own, key=lambda kind: _section_rank(kind, sections))
    for kind in kinds:
        hints = field_types(kind)
        group = groups.get(kind.TITLE) or groups.setdefault(kind.TITLE, parser.add_argument_group(kind.TITLE))
        for f in dataclasses.fields(kind):  # type: ignore[arg-type]
            group.add_argument(
                *_spellings(f),
                dest=f.name,
                default=argparse.SUPPRESS,
                help=f.metadata.get("help"),
                **_kind(hints[f.name], f.metadata.get("choices")),
            )


def _section_rank(section: type, order: Sequence[type]) -> int:
    return order.index(section) if section in order else len(order)


def _spellings(f: dataclasses.Field) -> list[str]:
    short = [f.metadata["short"]] if f.metadata.get("short") else []
    return [*short, flag_name(f), *f.metadata.get("aliases", ())]


def _kind(hint: Any, choices: Sequence[str] | None) -> dict[str, Any]:
    """argparse's action/type for a field type: switches for bools, comma lists for list[int]."""
    inner = (
        [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else [hint]
    )
    base = inner[0]
    if base is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(base) is list:
        item = typing.get_args(base)[0]
        if item is str:
            return {"nargs": "+", "action": "extend"}  # repeatable: --flag A --flag B is [A, B]
        return {"type": _numbers if item is float else _ints}
    kind: dict[str, Any] = {"type": base} if base in (int, float) else {}
    return {**kind, "choices": list(choices)} if choices else kind


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """``--config`` and every TrainConfig field as a flag."""
    from trainscale.app.config import TrainConfig
    from trainscale.compression.config import CompressionConfig
    from trainscale.config import CORE_SECTIONS

    p.add_argument(
        "--config", default=argparse.SUPPRESS, help="TOML file with the same keys as these flags (flags given here win)"
    )
    add_config_flags(p, TrainConfig, (*CORE_SECTIONS, CompressionConfig))


def build_parser() -> Parser:
    parser = Parser(prog="trainscale", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_train_flags(sub.add_parser("train", help="train a model and write a run folder"))
    models = sub.add_parser(
        "models", help="list the registered models with parameter counts, input sizes and default recipes"
    )
    models.add_argument(
        "--recipes", action="store_true", help="list the recipes instead: each one's settings and source"
    )
    data = sub.add_parser("data", help="check or fetch datasets")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=Parser)
    for name, text in (
        ("verify", "check the dataset files' sizes and MD5 checksums"),
        ("download", "download and verify the official archive"),
    ):
        d = data_sub.add_parser(name, help=text)
        d.add_argument("--dataset", default="cifar10", choices=["cifar10", "cifar100"])
        d.add_argument("--data-dir", default=None, help="target folder (else $TRAINSCALE_DATA, else ~/.cache)")
    from trainscale.bench.cli import add_bench_parser
    from trainscale.cluster.command import add_cluster_parser
    from trainscale.plan.plan import PlanConfig
    from trainscale.plan.profile import ProfileConfig
    from trainscale.report.cli import add_report_parser

    add_config_flags(
        sub.add_parser("profile", help="measure a model's step on this machine for the planner"),
        ProfileConfig,
        (ProfileConfig,),
    )
    add_config_flags(
        sub.add_parser("plan", help="predict step time and scaling on a cluster from a profile"),
        PlanConfig,
        (PlanConfig,),
    )
    add_bench_parser(sub.add_parser("bench", help="run a benchmark grid (each run a `trainscale train`), resumably"))
    add_report_parser(sub.add_parser("report", help="tables, plots and an HTML page from grid or run folders"))
    add_cluster_parser(
        sub.add_parser(
            "cluster",
            help="emulated clusters on this machine: namespaces + tc",
            description="Emulated hosts (network namespaces) on a switch (a bridge), each link shaped in bandwidth "
            "with tc tbf both ways. Bandwidth only: the kernel has no netem here, so no delay or loss is added; "
            "the base round trip is measured at 'up' (and by 'probe') and recorded with every run.",
        )
    )
    return parser


# A path the user gave that the file system refuses outright, wherever it is first touched.
PATH_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR})


def main(argv: Sequence[str] | None = None) -> int:
    from trainscale.log import setup_logging

    setup_logging()
    args = build_parser().parse_args(argv)
    try:
        from trainscale import commands

        return commands.dispatch(args)
    except TrainscaleError as exc:
        print(f"trainscale {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("trainscale: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.errno not in PATH_ERRNOS:
            raise
        where = f"{str(exc.filename)[:120]}: " if exc.filename else ""
        print(f"trainscale {args.command}: error: {where}{exc.strerror}; check the paths given", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
