"""The `trainscale` command: a thin layer that turns flags into configs and calls the packages.

User errors (bad flags, bad files, missing data) print one line and exit 2, with no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import difflib
import errno
import gc
import logging
import os
import sys
import traceback
import types
import typing
from collections.abc import Callable, Collection, Sequence
from typing import Any

from trainscale.config import CoreConfig, Section, field_types, spellings
from trainscale.errors import OneLineParser, TrainscaleError
from trainscale.stops import exit_with, stop_report, stops_held

log = logging.getLogger("trainscale")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


_MAGNITUDES = {"k": 3, "m": 6, "b": 9}  # --params 44.5M, 1.3B: how parameter counts are written


def _integer(text: str) -> int:
    """An integer flag's value, also in scientific notation or with a K, M or B suffix (thousand, million,
    billion) where it is a whole number (``--params 25e6``, ``--params 44.5M``)."""
    try:
        return int(text)
    except ValueError:
        pass
    digits, exponent = text, 0
    if text[-1:].lower() in _MAGNITUDES:
        digits, exponent = text[:-1], _MAGNITUDES[text[-1].lower()]
    try:
        value = decimal.Decimal(digits.replace("_", "")).scaleb(exponent)
    except decimal.InvalidOperation:
        value = decimal.Decimal("NaN")
    if not value.is_finite() or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"expected a whole number (e.g. 512, 25000000, 25e6 or 25M), got '{text}'")
    if abs(value) >= 2**63:
        raise argparse.ArgumentTypeError(f"'{text}' is too large for a whole number here (at most {2**63 - 1:.3g})")
    return int(value)


def _numbers(text: str) -> list[float | int]:
    """Comma-separated numbers, each an integer where it is written as one."""
    try:
        return [int(x) if x.strip().lstrip("-").isdigit() else float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got '{text}'") from None


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type, sections: Sequence[type], from_recipe: frozenset[str] = frozenset()
) -> None:
    """One flag per field of the config class ``cls`` (a ``Section``, or every section of a ``CoreConfig``),
    derived from the field: name, type, help, choices, short and alternative spellings (see
    ``trainscale.config.option``). Grouped by section, in the order of ``sections`` (then ``cls``'s own;
    same-titled sections share a group). Absent flags stay absent (SUPPRESS), so they fall back to --config,
    then to the defaults; the help says which default applies (``from_recipe``: fields a recipe may fill)."""
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
                *spellings(f),
                dest=f.name,
                default=argparse.SUPPRESS,
                help=_help(f, from_recipe),
                **(PAIRS if f.metadata.get("pairs") else _kind(hints[f.name], f.metadata.get("choices"))),
            )


class Switch(argparse.BooleanOptionalAction):
    """``--flag`` / ``--no-flag``, where the flag's own name may begin with ``no-`` (``--no-decay-norm-bias`` turns
    the field on; argparse's own action reads every ``--no-`` spelling as off)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.positive = frozenset(option_strings)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if option_string in self.option_strings:
            setattr(namespace, self.dest, option_string in self.positive)


PAIRS: dict[str, Any] = {"action": "extend", "nargs": "+", "metavar": "KEY=VALUE"}  # repeatable KEY=VALUE


def _help(f: dataclasses.Field, from_recipe: frozenset[str]) -> str | None:
    """The field's help with the default that applies when the flag is absent: the recipe's value where a recipe
    may set the field, else the field's own default (no note for an absent value or a switch that is off)."""
    text = f.metadata.get("help")
    if text is None or "default" in text:
        return text
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if f.name in from_recipe:
        note = f"from the recipe, else {_shown(default)}" if default not in (None, False, [], "") else "from the recipe"
    elif default in (None, False, [], ""):
        return text
    else:
        note = _shown(default)
    return f"{text} (default: {note})".replace("%", "%%") if "%" not in text else f"{text} (default: {note})"


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value).replace("%", "%%")


def _section_rank(section: type, order: Sequence[type]) -> int:
    return order.index(section) if section in order else len(order)


def _kind(hint: Any, choices: Sequence[str] | None) -> dict[str, Any]:
    """argparse's action/type for a field type: switches for bools, comma lists for list[int]."""
    inner = (
        [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else [hint]
    )
    base = inner[0]
    if base is bool:
        return {"action": Switch}
    if typing.get_origin(base) is list:
        item = typing.get_args(base)[0]
        if item is str:
            return {"nargs": "+", "action": "extend"}  # repeatable: --flag A --flag B is [A, B]
        return {"type": _numbers if item is float else _ints}
    kind: dict[str, Any] = {"type": _integer if base is int else base} if base in (int, float) else {}
    return {**kind, "choices": list(choices)} if choices else kind


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """``--config`` and every TrainConfig field as a flag."""
    from trainscale.app.config import TrainConfig
    from trainscale.compression.config import CompressionConfig
    from trainscale.config import CORE_SECTIONS
    from trainscale.models import recipes  # noqa: F401  (registers the built-in recipes)
    from trainscale.modes import list_modes
    from trainscale.recipes import RECIPES, get_recipe

    p.add_argument(
        "--config", default=argparse.SUPPRESS, help="TOML file with the same keys as these flags (flags given here win)"
    )
    filled = frozenset(key for name in RECIPES.names() for key in get_recipe(name).settings)
    add_config_flags(p, TrainConfig, (*CORE_SECTIONS, CompressionConfig), filled)
    for action in p._actions:
        if action.dest == "mode":
            action.help = (
                "auto (the default: sync with several workers, async with --servers, else local) or a registered "
                f"mode: {', '.join(list_modes())}"
            )


def installed_version() -> str:
    """The installed distribution's version (pyproject.toml's), which ``trainscale.__version__`` repeats."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainscale")
    except PackageNotFoundError:
        return "(not installed: run `make install` or `pip install -e .`)"


DESCRIPTION = (
    "Train image classifiers on one process, many processes or many machines, and measure how training scales."
)
COMMANDS = {
    "train": "train a model and write a run folder",
    "models": "list the registered models with parameter counts, input sizes and default recipes",
    "data": "check or fetch datasets",
    "profile": "measure a model's step on this machine for the planner",
    "plan": "predict step time and scaling on a cluster from a profile",
    "bench": "run a benchmark grid (each run a `trainscale train`), resumably",
    "report": "tables, plots and an HTML page from grid or run folders",
    "cluster": "emulated clusters on this machine: namespaces + tc",
}


def build_parser(only: Collection[str] | None = None) -> OneLineParser:
    """The whole command line, or (``only``) the flags of those subcommands alone, the others named with their
    help line: a command builds what it parses, so ``trainscale --help`` or ``trainscale cluster status`` does not
    import torch and every model, mode and compressor to list flags it never reads."""
    parser = OneLineParser(prog="trainscale", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"trainscale {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name, text in COMMANDS.items():
        command = sub.add_parser(name, help=text, description=_DESCRIPTIONS.get(name))
        if only is None or name in only:
            _FLAGS[name](command)
    return parser


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand an argument list names (its first word that is not a flag: the program's own flags take no
    value), or None."""
    return next((word for word in argv if not word.startswith("-")), None)


def _add_models_flags(models: argparse.ArgumentParser) -> None:
    models.add_argument("name", nargs="?", help="one model: its description, recipe and the recipe's settings")
    models.add_argument(
        "--recipes", action="store_true", help="list the recipes instead: each one's settings and source"
    )
    models.add_argument("--wide", action="store_true", help="add each model's description (wider than 100 columns)")


def _add_data_flags(data: argparse.ArgumentParser) -> None:
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=OneLineParser)
    for name, text in (
        ("verify", "check the dataset files' sizes and MD5 checksums"),
        ("download", "download and verify the official archive"),
    ):
        d = data_sub.add_parser(name, help=text)
        d.add_argument("--dataset", default="cifar10", choices=["cifar10", "cifar100"])
        d.add_argument("--data-dir", default=None, help="target folder (else $TRAINSCALE_DATA, else ~/.cache)")


def _add_profile_flags(p: argparse.ArgumentParser) -> None:
    from trainscale.plan.profile import ProfileConfig

    add_config_flags(p, ProfileConfig, (ProfileConfig,))


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    from trainscale.plan.plan import PlanConfig

    add_config_flags(p, PlanConfig, (PlanConfig,))


def _add_bench_flags(p: argparse.ArgumentParser) -> None:
    from trainscale.bench.cli import add_bench_parser

    add_bench_parser(p)


def _add_report_flags(p: argparse.ArgumentParser) -> None:
    from trainscale.report.cli import add_report_parser

    add_report_parser(p)


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    from trainscale.cluster.command import add_cluster_parser

    add_cluster_parser(p)


_FLAGS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "train": add_train_flags,
    "models": _add_models_flags,
    "data": _add_data_flags,
    "profile": _add_profile_flags,
    "plan": _add_plan_flags,
    "bench": _add_bench_flags,
    "report": _add_report_flags,
    "cluster": _add_cluster_flags,
}
_DESCRIPTIONS = {
    "cluster": "Emulated hosts (network namespaces) on a switch (a bridge), each link shaped in bandwidth with tc tbf "
    "both ways. Bandwidth only: the kernel has no netem here, so no delay or loss is added; the base round trip is "
    "measured at 'up' (and by 'probe') and recorded with every run."
}


def _unknown_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> int:
    """One line for arguments no flag takes, with the prefix of the command they were given to and, for a
    mistyped flag, the closest flag of that command."""
    command, options = parser.prog, _options(parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            sub = action.choices[getattr(args, action.dest)]
            command, options = sub.prog, _options(sub)
            for inner in sub._actions:  # trainscale data verify
                if isinstance(inner, argparse._SubParsersAction) and getattr(args, inner.dest, None) in inner.choices:
                    command, options = (
                        inner.choices[getattr(args, inner.dest)].prog,
                        _options(inner.choices[getattr(args, inner.dest)]),
                    )
    flag = next((e.split("=", 1)[0] for e in extra if e.startswith("-")), None)
    if flag is None:
        print(f"{command}: error: unexpected argument {extra[0]!r} (see {command} --help)", file=sys.stderr)
        return 2
    if flag in options:  # read as an argument: it came after a bare --
        print(
            f"{command}: error: {flag} came after --, where every word is an argument; put it before --",
            file=sys.stderr,
        )
        return 2
    swapped = [o for o in options if sorted(o) == sorted(flag)]  # letters typed in another order: --modle
    close = swapped or difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    print(f"{command}: error: unknown flag {flag}{hint} (see {command} --help)", file=sys.stderr)
    return 2


def _empty_value(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """An empty value given to a flag or argument, said in words; no setting takes one, and an empty path (an
    unset shell variable: ``--config "$CFG"``) read as absent would run with the defaults in silence."""
    names = {action.dest: _shown_name(action) for action in _all_actions(parser)}
    for dest, value in vars(args).items():
        if value == "" or (isinstance(value, list) and "" in value):
            return f"{names.get(dest, dest)} is empty: give a value, or leave it out"
    return None


def _all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    actions = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            actions += [a for sub in action.choices.values() for a in _all_actions(sub)]
    return actions


def _shown_name(action: argparse.Action) -> str:
    longest = max(action.option_strings, key=len, default=None)
    return longest or str(action.metavar or action.dest).upper()


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for action in parser._actions for o in action.option_strings if o.startswith("--")]


# A path the user gave that the file system refuses outright, wherever it is first touched.
PATH_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR})


def run() -> None:
    """The ``trainscale`` program: :func:`main`, then exit without a last garbage collection over everything the
    process imported (torch and its compiler: about half a second at every exit, the workers' included, after
    all was written and closed). Objects are still released and exit handlers still run; only the final search
    for reference cycles is skipped. :func:`main` itself leaves the collector alone, for callers in a process that
    goes on. After Ctrl-C the program ends by SIGINT (``stops.exit_with``)."""
    current_folder_importable()
    status = main()
    gc.freeze()
    exit_with(status)


def current_folder_importable() -> None:
    """The current folder first on ``sys.path``, as ``python -m trainscale`` has it: a model, dataset or optimizer
    given by import path from the folder the command runs in imports alike whether the program started as the
    ``trainscale`` command (whose ``sys.path`` starts with the folder of the command, not the current one) or as
    ``python -m trainscale``, and as the workers import it (the launcher puts the folder on their PYTHONPATH)."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


def forked_worker(*argv: str) -> None:
    """A worker that torch's agent forked from the `trainscale train` launcher (``app.launch``) rather than starting
    ``python -m trainscale``: the launcher's changes to itself undone, then :func:`main` on the worker's command
    line; its status, or 1 with the traceback on stderr for an exception nothing recorded, is the exit status, as
    a new interpreter's would be."""
    from trainscale.app.launch import as_new_process

    as_new_process()
    try:
        status = main(argv)
    except Exception:
        traceback.print_exc()
        status = 1
    if status:
        raise SystemExit(status)


def main(argv: Sequence[str] | None = None) -> int:
    from trainscale.log import setup_logging

    setup_logging()
    try:
        with stops_held():  # `train`'s flags import torch, whose start-up a stop would interrupt in its C code
            words = sys.argv[1:] if argv is None else argv
            parser = build_parser({command_of(words) or ""})
        args, extra = parser.parse_known_args(words)
    except KeyboardInterrupt as stop:
        named = command_of(sys.argv[1:] if argv is None else argv)
        return _stopped(" ".join(["trainscale", *([named] if named else [])]), stop)
    if extra:
        return _unknown_flags(parser, args, extra)
    empty = _empty_value(parser, args)
    if empty:
        print(f"trainscale {args.command}: error: {empty}", file=sys.stderr)
        return 2
    try:
        from trainscale import commands

        return commands.dispatch(args, forked_worker)
    except TrainscaleError as exc:
        print(f"trainscale {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        return _stopped(f"trainscale {args.command}", stop)
    except BrokenPipeError:  # the reader went away (`trainscale ... | head`): what was asked is done, say nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it
    except OSError as exc:
        if exc.errno not in PATH_ERRNOS:
            raise
        where = f"{str(exc.filename)[:120]}: " if exc.filename else ""
        print(f"trainscale {args.command}: error: {where}{exc.strerror}; check the paths given", file=sys.stderr)
        return 2


def _stopped(command: str, stop: KeyboardInterrupt) -> int:
    """The one line a stopped command ends with, and its status (``stops.stop_report``)."""
    word, status = stop_report(stop)
    print(f"{command}: {word}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
