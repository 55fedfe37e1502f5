"""Run the real `trainscale` entry point in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 900, env: dict | None = None
) -> subprocess.CompletedProcess:
    """The finished process; a run past ``timeout`` fails the test with the tail of what it printed."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        return subprocess.run(
            [sys.executable, "-m", "trainscale", *map(str, args)],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
        )
    except subprocess.TimeoutExpired as exc:
        tails = [_text(part)[-4000:] for part in (exc.stdout, exc.stderr)]
        raise AssertionError(
            f"trainscale {' '.join(map(str, args))} ran past {timeout} s\n"
            f"--- stdout\n{tails[0]}\n--- stderr\n{tails[1]}"
        ) from None


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
