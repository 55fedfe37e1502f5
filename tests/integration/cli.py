"""Run the real `trainscale` entry point in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 900, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "trainscale", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=full_env)


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [x for x in proc.stderr.splitlines() if x.strip() and " INFO " not in x]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert fragment in lines[0], lines[0]
