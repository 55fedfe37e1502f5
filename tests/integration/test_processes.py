"""Processes end with their job: workers die with a killed launcher, Ctrl-C is one line, and no two jobs write
one run folder. Each test starts a real `trainscale train` that would run for minutes and stops it itself."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.cli import assert_one_line_error, run_cli, small_run
from trainscale.bench.process import descendants

LONG = (*small_run(train=512, test=128), "--epochs", "500", "--threads", "1")
INTERRUPTED = "trainscale train: interrupted; workers stopped"


def start(tmp_path: Path, *args: object, temp: Path | None = None) -> subprocess.Popen:
    """`trainscale train ARGS` in a session of its own (like a terminal's job), output to files in tmp_path, its
    temporary files in ``temp`` (if given)."""
    with open(tmp_path / "stdout", "wb") as out, open(tmp_path / "stderr", "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "trainscale", "train", *map(str, args)],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **({"TMPDIR": str(temp)} if temp else {})},
        )


def wait_until(done: Callable[[], bool], timeout: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            return done()
        time.sleep(0.1)
    return True


def wait_running(proc: subprocess.Popen, path: Path, tmp_path: Path) -> list[int]:
    """Wait until the job has written ``path``; its processes then."""
    if not wait_until(path.exists, 120, proc):
        pytest.fail(f"{path.name} never appeared: {(tmp_path / 'stderr').read_text()[-3000:]}")
    return descendants(proc.pid)


def alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] != "Z"  # a zombie has ended; its new parent may never reap it


def too_deep(short_temp: Path) -> Path:
    """A TMPDIR inside ``short_temp`` too deep for the Unix sockets of DataLoader workers (98 characters)."""
    deep = short_temp / ("t" * 80)
    deep.mkdir()
    return deep


def left_in(temp: Path) -> list[str]:
    """What a job left in its temporary folder, but torch.compile's cache (kept on purpose, one per user)."""
    return [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]


def kill_leftovers(proc: subprocess.Popen, pids: list[int]) -> None:
    for pid in [proc.pid, *pids]:
        with contextlib.suppress(OSError):
            if alive(pid) and "trainscale" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                os.kill(pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def running_job(
    tmp_path: Path, out: Path, *args: str, until: str = "config.json", temp: Path | None = None
) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """A 2-worker job on ``out``, once it has written ``until``: (launcher, its processes); whatever of it
    is still alive afterwards is killed, also when the test fails."""
    proc = start(tmp_path, *LONG, "--workers", "2", *args, "--out", out, temp=temp)
    pids: list[int] = []
    try:
        pids = wait_running(proc, out / until, tmp_path)
        yield proc, pids
    finally:
        kill_leftovers(proc, pids)


@pytest.mark.dist
def test_a_second_job_on_a_folder_in_use_is_refused_and_workers_die_with_a_launcher_killed_by_sigkill(
    tmp_path, short_temp
):
    """One running job for both (each was a job of its own, 4.5 s of the suite more): a second job on its folder,
    plain or resuming, is one line naming it and leaves it running; then SIGKILL to its launcher takes its
    workers with it (and leaves its temporary folder, in ``short_temp``, which the fixture removes)."""
    out = tmp_path / "run"
    with running_job(tmp_path, out, temp=short_temp) as (first, workers):
        in_use = f"--out {out} is in use by another trainscale job (pid {first.pid})"
        assert_one_line_error(run_cli("train", *LONG, "--out", out, timeout=120), in_use)  # the lock
        assert_one_line_error(
            run_cli("train", *LONG, "--workers", "2", "--resume", "--out", out, timeout=120), in_use
        )  # the launcher's checks
        assert first.poll() is None
        assert len(workers) >= 2, workers
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        assert wait_until(lambda: not any(map(alive, workers)), 5), [p for p in workers if alive(p)]


@pytest.mark.dist
@pytest.mark.parametrize(
    "mode",
    [
        ("--mode", "sync"),
        ("--mode", "async", "--servers", "1"),
        ("--model", "tests.userpkg.nets:tiny", "--dataset", "tests.userpkg.data:datasets", "--loader-workers", "1"),
    ],
    ids=["sync", "async", "loader-workers"],
)
def test_ctrl_c_stops_the_job_with_one_line(tmp_path, short_temp, mode):
    """With DataLoader workers, under a TMPDIR too deep for their sockets: the job makes its temporary folder in
    /tmp and runs (before, the workers could not start), and leaves nothing in that TMPDIR."""
    out, temp = tmp_path / "run", too_deep(short_temp) if "--loader-workers" in mode else short_temp
    with running_job(tmp_path, out, *mode, until="metrics.jsonl", temp=temp) as (proc, tree):
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert proc.wait(timeout=60) == -signal.SIGINT  # a shell says 130
        stderr = (tmp_path / "stderr").read_text()
        assert "Traceback" not in stderr
        assert [x for x in stderr.splitlines() if x.strip() and " INFO " not in x] == [INTERRUPTED], stderr
        assert wait_until(lambda: not any(map(alive, tree)), 5), [p for p in tree if alive(p)]
        assert not (out / ".lock").exists()
        assert not left_in(temp)  # torch's agent folders included


@pytest.mark.dist
def test_sigterm_to_a_fault_tolerant_launcher_alone_stops_its_replicas_and_removes_its_folders(tmp_path, short_temp):
    """A scheduler that signals the launcher only (not its process group; the replicas run in sessions of their
    own): it stops as on Ctrl-C, its replicas with it, and leaves neither its temporary folder nor the lock."""
    out = tmp_path / "run"
    with running_job(tmp_path, out, "--fault-tolerance", until="metrics.jsonl", temp=short_temp) as (proc, tree):
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        stderr = (tmp_path / "stderr").read_text()
        assert "Traceback" not in stderr and stderr.splitlines()[-1] == "trainscale train: terminated", stderr[-2000:]
        assert wait_until(lambda: not any(map(alive, tree)), 10), [p for p in tree if alive(p)]
        assert not (out / ".lock").exists()
        assert not left_in(short_temp)


@pytest.mark.dist
def test_sigterm_to_a_run_in_one_process_unwinds_it_as_ctrl_c_does(tmp_path, short_temp):
    """A scheduler's stop of `trainscale train` without workers (before: the process ended at once, saying nothing
    and leaving its lock file): one line, status 143, its input processes stopped, nothing left in its temporary
    folder, and the finished epoch resumable. That folder is too deep for the input processes' sockets: the run
    trains with a short one of its own (``runtime.tempdir``; before, it waited forever for input processes that
    could not hand over a batch)."""
    out, deep = tmp_path / "run", too_deep(short_temp)
    proc = start(tmp_path, *LONG, "--loader-workers", "1", "--out", out, temp=deep)
    pids: list[int] = []
    try:
        pids = wait_running(proc, out / "metrics.jsonl", tmp_path)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        stderr = (tmp_path / "stderr").read_text()
        assert [x for x in stderr.splitlines() if " INFO " not in x] == ["trainscale train: terminated"], stderr
        assert wait_until(lambda: not any(map(alive, pids)), 5), [p for p in pids if alive(p)]
        assert not (out / ".lock").exists() and (out / "checkpoint.pt").exists()
        assert not left_in(deep)
    finally:
        kill_leftovers(proc, pids)
