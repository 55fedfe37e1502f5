"""How a trainscale command stops: the stop it was asked for, the one line and status it ends with, and the
moments a stop must wait for.

Ctrl-C raises KeyboardInterrupt; a scheduler's SIGTERM raises ``Terminated`` (a KeyboardInterrupt) where a command
asks for that (``runtime.orphans.sigterm_as_interrupt``), so both unwind alike and only the last line tells them
apart. This module imports nothing heavy: a command stopped while it still imports torch says so in its one line
too.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or ``timeout``'s stop) raised where the process is, as Ctrl-C raises
    KeyboardInterrupt: the same unwinding, told apart where the process says how it stopped (``stop_report``)."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C and a scheduler's stop
STOP_WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}


def stop_word(sig: signal.Signals) -> str:
    """How a command stopped by ``sig`` says so: Ctrl-C ``interrupted``, SIGTERM ``terminated``, any other
    ``stopped by SIGHUP`` and the like."""
    return STOP_WORDS.get(sig, f"stopped by {sig.name}")


def stop_signal(stop: KeyboardInterrupt) -> signal.Signals:
    """The signal a stop came from: SIGTERM for ``Terminated``, else Ctrl-C's SIGINT."""
    return signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT


def stop_report(stop: KeyboardInterrupt) -> tuple[str, int]:
    """The word and exit status a stopped trainscale command ends with, the same in every command: Ctrl-C
    ``interrupted`` and 130, SIGTERM ``terminated`` and 143 (128 plus the signal, as a shell reports it)."""
    sig = stop_signal(stop)
    return stop_word(sig), 128 + sig


def stop_of_status(status: int) -> type[KeyboardInterrupt] | None:
    """The stop a command's exit status reports (``stop_report``'s inverse): KeyboardInterrupt for 130,
    ``Terminated`` for 143, None for any other status."""
    return {128 + signal.SIGINT: KeyboardInterrupt, 128 + signal.SIGTERM: Terminated}.get(status)


def exit_with(status: int) -> NoReturn:
    """End the program with ``status``; a Ctrl-C's (130) ends it by SIGINT instead, after Python's usual exit (exit
    handlers run, files flushed), as Python ends on a Ctrl-C nothing caught. A shell reports 130 either way, but only
    a command that died by SIGINT stops a shell's loop of commands (``for seed in 1 2 3; do trainscale train ...;
    done``): after a plain exit 130 the shell takes it that the command handled Ctrl-C itself and goes on with the
    next one. Call it at the top of the program only: it raises a KeyboardInterrupt that must reach the
    interpreter, which then ends by SIGINT without printing it."""
    if status != 128 + signal.SIGINT:
        sys.exit(status)
    hook = sys.excepthook

    def unprinted(kind: type[BaseException], value: BaseException, traceback: object) -> None:
        if kind is not KeyboardInterrupt:
            hook(kind, value, traceback)  # type: ignore[arg-type]

    sys.excepthook = unprinted
    raise KeyboardInterrupt


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM take effect when the block ends, through the handlers they had before it. A stop
    raised inside C code that calls back into Python (torch.save's zip writer) leaves that code broken: the
    writer fails with its own RuntimeError, a traceback where the user asked for a stop. A second stop while
    one waits takes effect at once, so a write that hangs can still be stopped. An ignored signal stays ignored
    (a command started in the background of a shell ignores Ctrl-C); outside the main thread, where Python runs
    no handlers, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {
        sig: handler for sig in STOP_SIGNALS if (handler := signal.getsignal(sig)) not in (None, signal.SIG_IGN)
    }

    def release() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        previous.clear()

    def hold(signum: int, frame: object) -> None:
        if pending:
            release()
            signal.raise_signal(signum)
        pending.append(signum)

    for sig in previous:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        waiting = pending[:1] if previous else []
        release()
        for signum in waiting:
            signal.raise_signal(signum)
