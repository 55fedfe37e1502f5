"""Run the real `trainscale` entry point in a subprocess, as a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE

STOP_GRACE_S = 60.0


def entry_point() -> list[str]:
    """The `trainscale` command users type, installed beside this interpreter (``make install``); ``python -m
    trainscale`` where it is not (tests run against a source tree on PYTHONPATH). The two differ in what they find on
    ``sys.path``, and users run the command."""
    command = Path(sys.executable).with_name("trainscale")
    return [str(command)] if command.exists() else [sys.executable, "-m", "trainscale"]


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 900, env: dict | None = None
) -> subprocess.CompletedProcess:
    """The finished process; a run past ``timeout`` fails the test with the tail of what it printed. That run is
    stopped as a user's Ctrl-C stops it (SIGINT, so its own teardown runs: workers, namespaces, CPU groups),
    killed only if it is still there after ``STOP_GRACE_S``: a SIGKILL would leave its workers training beside
    the tests that follow."""
    argv = [*entry_point(), *map(str, args)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with subprocess.Popen(argv, cwd=cwd, stdout=PIPE, stderr=PIPE, text=True, env=full_env) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                out, err = proc.communicate(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise AssertionError(
                f"trainscale {' '.join(map(str, args))} ran past {timeout} s\n"
                f"--- stdout\n{_text(out)[-4000:]}\n--- stderr\n{_text(err)[-4000:]}"
            ) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def small_run(train: int = 256, test: int = 64, batch: int = 64, model: str | None = "mlp") -> tuple[str, ...]:
    """The flags of a small run on synthetic images (``model`` None: the default model), without a progress bar."""
    named = ("--model", model) if model is not None else ()
    return (
        *named,
        *("--dataset", "synthetic", "--train-subset", str(train), "--test-subset", str(test)),
        *("--batch-size", str(batch), "--no-progress"),
    )


def _text(part: bytes | str | None) -> str:
    return part.decode(errors="replace") if isinstance(part, bytes) else part or ""


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [x for x in proc.stderr.splitlines() if x.strip() and " INFO " not in x]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert fragment in lines[0], lines[0]


def default_sigint() -> None:
    """In the child before exec: SIGINT as a terminal's Ctrl-C finds it. A test run started in the background
    of a non-interactive shell (CI's `.ci/run &`) inherits SIGINT ignored, Python then installs no
    KeyboardInterrupt handler, and the command would never see the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
