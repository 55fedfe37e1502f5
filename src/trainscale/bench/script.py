"""The command line every script in ``benchmarks/`` shares. A benchmark is a user's command as much as
``trainscale`` is, so bad input is one line and exit status 2 before anything is timed: argparse types that check
counts and model names as the line is read, and :func:`run_script`, which turns trainscale's refusals and a failed
child run into one line and an exit status instead of a traceback."""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from trainscale.errors import ConfigError, TrainscaleError
from trainscale.registry import is_import_path
from trainscale.runtime.orphans import dying_with_this_process, sigterm_as_interrupt
from trainscale.stops import exit_with, stop_report, stop_signal


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number no smaller than ``minimum`` (repeats, steps, workers, images)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


COUNT = at_least(1)  # repeats, steps, workers, images, batches: zero of them measures nothing
WARMUP = at_least(0)


def model_name(text: str) -> str:
    """An argparse ``type``: a registered model's name (the registry's one line, with the closest name, when it is
    not), or ``package.module:function`` for a model of the user's, imported where the script builds it."""
    from trainscale.models import MODELS

    if text in MODELS or is_import_path(text):
        return text
    raise argparse.ArgumentTypeError(MODELS.unknown_message(text))


def check_run(flags: Mapping[str, Any], what: str = "", folder: Path | None = None) -> None:
    """A run the script is about to start, given by ``trainscale.fit``'s keyword settings, checked as `trainscale
    train --dry-run` checks it (values, devices, run folder, data; nothing written): a series of runs that one of them
    would refuse is refused before the first starts or anything is timed, in trainscale's own line (after ``what``,
    which names the run where a script starts several kinds). ``folder``: where the run will start (default: here);
    importable during the check, as ``python -m trainscale`` makes it, so a model given by import path is found as
    the run will find it."""
    from trainscale.app.config import train_settings
    from trainscale.app.dryrun import dry_run

    where = str((folder or Path.cwd()).resolve())
    added = where not in sys.path
    if added:
        sys.path.insert(0, where)
    try:
        dry_run(train_settings(flags))
    except TrainscaleError as err:
        raise type(err)(f"{what}: {err}" if what else str(err)) from None
    finally:
        if added:
            sys.path.remove(where)


def device_name(text: str) -> str:
    """An argparse ``type``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` that this machine has (``--device cuda``
    where there is none is refused as the line is read, not in a traceback after the first import of CUDA); the
    text comes back unchanged, and no CUDA context is made."""
    from trainscale.train.precision import named_device

    try:
        named_device(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix(f"--device {text}: ")) from None
    return text


CHILD_HEARS_S = 2.0  # a child that got the stop itself (Ctrl-C at a terminal, a process group's SIGTERM) ends in this
CHILD_STOP_S = 60.0  # what a stopped run may take to take down its workers, servers and temporary folders


def run_child(cmd: Sequence[str], check: bool = False, **popen: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` for the runs a script starts, except when the script is stopped (Ctrl-C, SIGTERM): where
    ``subprocess.run`` kills the child a quarter second later, cutting its own teardown short (its temporary
    folder, its workers' and servers' stop), the child is given the stop (if it did not get it too) and the time to
    end as it does when stopped itself; killed only after ``CHILD_STOP_S``. A script killed outright (SIGKILL, a
    test's timeout) leaves no child running: the kernel sends it SIGTERM, and it stops as it would on Ctrl-C."""
    popen.setdefault("preexec_fn", dying_with_this_process(signal.SIGTERM))
    with subprocess.Popen(list(cmd), **popen) as proc:
        try:
            out, err = proc.communicate()
        except KeyboardInterrupt as stop:
            _stop_child(proc, stop_signal(stop))
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def _stop_child(proc: subprocess.Popen, sig: int) -> None:
    for send, wait_s in ((None, CHILD_HEARS_S), (sig, CHILD_STOP_S)):
        if send is not None:
            proc.send_signal(send)
        try:
            proc.communicate(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    proc.communicate()


def run_script(main: Callable[[], int | None]) -> NoReturn:
    """Run a benchmark's ``main`` and exit with its status: a refusal of trainscale's (a setting, a model, missing
    data) is one line and status 2, as ``trainscale`` gives it; a child run that failed is one line naming it and
    its status, below the child's own message; Ctrl-C is one line and 130, SIGTERM the same unwinding, one line and
    143."""
    prog = Path(sys.argv[0]).name
    try:
        with sigterm_as_interrupt():
            status = main() or 0
    except TrainscaleError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        status = 2
    except subprocess.CalledProcessError as err:
        show_captured(err)
        command = shlex.join(str(a) for a in err.cmd) if isinstance(err.cmd, list | tuple) else str(err.cmd)
        failed = f"{command[:200]} exited with status {err.returncode}"
        print(f"{prog}: error: {failed} (its message is above)", file=sys.stderr)
        status = 1
    except KeyboardInterrupt as stop:
        word, status = stop_report(stop)
        print(f"{prog}: {word}", file=sys.stderr)
    exit_with(status)


CAPTURED_LINES = 20


def show_captured(err: subprocess.CalledProcessError) -> None:
    """The last lines a failed child wrote, where the script captured them instead of letting them through, so
    that its message is above the line that names it."""
    captured = err.stderr or err.output
    if not captured:
        return
    text = captured.decode(errors="replace") if isinstance(captured, bytes) else str(captured)
    lines = text.rstrip().splitlines()[-CAPTURED_LINES:]
    print("\n".join(lines), file=sys.stderr)
