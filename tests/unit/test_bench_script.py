"""``trainscale.bench.script``: what every benchmark script's command line shares. Counts and model names are
checked as the line is read; a refusal of trainscale's, a failed child run and Ctrl-C are one line each with the
exit status ``trainscale`` would give."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainscale.bench.script import (
    COUNT,
    WARMUP,
    at_least,
    check_run,
    device_name,
    model_name,
    run_child,
    run_script,
)
from trainscale.errors import ConfigError, DataError
from trainscale.stops import Terminated


def test_counts_are_whole_numbers_from_their_minimum():
    assert (COUNT("3"), WARMUP("0"), at_least(2)("2")) == (3, 0, 2)
    for parse, text, message in (
        (COUNT, "0", "must be at least 1, got 0"),
        (WARMUP, "-1", "must be at least 0, got -1"),
        (COUNT, "2.5", "expected a whole number, got '2.5'"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)


def test_a_model_is_a_registered_name_or_an_import_path():
    assert model_name("resnet9") == "resnet9" and model_name("my_pkg.nets:build") == "my_pkg.nets:build"
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown model 'resnt9' \(did you mean 'resnet9'\?\)"):
        model_name("resnt9")


def test_a_bad_flag_is_argparses_one_line(capsys):
    parser = argparse.ArgumentParser(prog="bench.py")
    parser.add_argument("--repeats", type=COUNT, default=3)
    with pytest.raises(SystemExit) as stopped:
        parser.parse_args(["--repeats", "0"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "bench.py: error: argument --repeats: must be at least 1, got 0"


def _fail(exc: BaseException):
    def main() -> int:
        raise exc

    return main


@pytest.mark.parametrize(
    "exc, status, line",
    [
        (ConfigError("--epochs must be at least 1"), 2, "bench.py: error: --epochs must be at least 1"),
        (DataError("cifar10 files not found in /x"), 2, "bench.py: error: cifar10 files not found in /x"),
        (
            subprocess.CalledProcessError(3, ["python", "-m", "trainscale", "train", "--out", "runs/a b"]),
            1,
            "bench.py: error: python -m trainscale train --out 'runs/a b' exited with status 3 (its message is above)",
        ),
        (Terminated(), 143, "bench.py: terminated"),
    ],
)
def test_what_stops_a_script_is_one_line_and_a_status(exc, status, line, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench.py"])
    with pytest.raises(SystemExit) as stopped:
        run_script(_fail(exc))
    assert stopped.value.code == status and capsys.readouterr().err == line + "\n"


def test_ctrl_c_ends_a_script_by_sigint_after_its_one_line(monkeypatch, capsys):
    """A KeyboardInterrupt that reaches the interpreter, which then ends by SIGINT without printing it
    (``stops.exit_with``; that end is checked in a real process in test_cli_explains.py)."""
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench.py"])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    with pytest.raises(KeyboardInterrupt):
        run_script(_fail(KeyboardInterrupt()))
    assert capsys.readouterr().err == "bench.py: interrupted\n"
    sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert capsys.readouterr().err == ""


def test_a_failed_child_whose_output_was_captured_shows_its_last_lines_above_the_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench.py"])
    said = "\n".join(f"line {i}" for i in range(30)).encode() + b"\ntrainscale train: error: unknown model 'x'\n"
    with pytest.raises(SystemExit):
        run_script(_fail(subprocess.CalledProcessError(2, ["python", "-m", "trainscale"], b"out", said)))
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "line 11" and err[-2] == "trainscale train: error: unknown model 'x'" and len(err) == 21
    assert err[-1] == "bench.py: error: python -m trainscale exited with status 2 (its message is above)"


def test_a_script_that_returns_exits_with_its_status():
    for returned, status in ((None, 0), (0, 0), (4, 4)):
        with pytest.raises(SystemExit) as stopped:
            run_script(lambda r=returned: r)
        assert stopped.value.code == status


def test_an_unexpected_error_keeps_its_traceback():
    with pytest.raises(ZeroDivisionError):
        run_script(_fail(ZeroDivisionError("a bug, not bad input")))


def test_a_run_is_checked_as_its_dry_run_would_check_it_and_nothing_is_written(tmp_path, monkeypatch):
    """The settings' refusal keeps its class (a ConfigError, a DataError: exit 2 either way) and gets the run's
    name in front; a run that would start passes and leaves no folder behind."""
    out = str(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^lamb at lr 1: --epochs must be a positive number, got 0$"):
        check_run({"model": "resnet20", "epochs": 0, "out": out}, "lamb at lr 1")
    monkeypatch.setenv("TRAINSCALE_DATA", str(tmp_path / "nothing"))
    with pytest.raises(DataError, match=r"^cifar10 files not found in"):
        check_run({"model": "resnet20", "dataset": "cifar10", "out": out})
    check_run({"model": "resnet20", "dataset": "synthetic", "epochs": 1, "out": out})
    assert not (tmp_path / "run").exists()


def test_a_device_is_one_this_machine_has_and_no_cuda_context_is_made(monkeypatch):
    import torch

    assert (device_name("cpu"), device_name("auto")) == ("cpu", "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for text, message in (
        ("cuda", r"^CUDA is not available on this machine; use --device cpu$"),
        ("mps", r"^--device 'mps' is not supported; use auto, cpu, cuda or cuda:N$"),
        ("gpu0", r"^--device 'gpu0' is not a device; use auto, cpu, cuda or cuda:N$"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            device_name(text)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("a CUDA context was made"))
    assert (device_name("cuda"), device_name("cuda:1")) == ("cuda", "cuda:1")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^only 2 CUDA device\(s\) present$"):
        device_name("cuda:2")


def test_a_model_by_import_path_is_found_where_the_run_will_start(tmp_path, monkeypatch):
    """The runs a script starts are `python -m trainscale` in a folder (the current one by default), which finds
    a package there; the check finds it alike, and leaves ``sys.path`` as it was."""
    (tmp_path / "start" / "pkg_of_user").mkdir(parents=True)
    (tmp_path / "start" / "pkg_of_user" / "__init__.py").write_text("")
    (tmp_path / "start" / "pkg_of_user" / "nets.py").write_text(
        "import torch\n\n\ndef build(num_classes=10):\n    return torch.nn.Sequential(torch.nn.Flatten(), "
        "torch.nn.Linear(3 * 32 * 32, num_classes))\n"
    )
    run = {"model": "pkg_of_user.nets:build", "dataset": "synthetic", "out": str(tmp_path / "run")}
    path = list(sys.path)
    with pytest.raises(ConfigError, match="cannot import module 'pkg_of_user.nets'"):
        check_run(run)
    check_run(run, folder=tmp_path / "start")
    sys.modules.pop("pkg_of_user.nets"), sys.modules.pop("pkg_of_user")
    monkeypatch.chdir(tmp_path / "start")
    check_run(run)
    assert sys.path == path and not (tmp_path / "run").exists()


def test_sigterm_unwinds_as_ctrl_c_does_and_the_handler_is_given_back(tmp_path, monkeypatch, capsys):
    """A scheduler's SIGTERM: the script's temporary folder is removed (Python's default would leave it), one line,
    status 143; the process's own SIGTERM handling comes back after."""
    import os
    import signal
    import tempfile

    monkeypatch.setattr(sys, "argv", ["benchmarks/bench.py"])
    made = []

    def main() -> int:
        with tempfile.TemporaryDirectory(dir=tmp_path) as folder:
            made.append(folder)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        return 0

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        run_script(main)
    assert stopped.value.code == 143 and capsys.readouterr().err == "bench.py: terminated\n"
    assert made and not Path(made[0]).exists() and signal.getsignal(signal.SIGTERM) is before


STOPPABLE_CHILD = """
import pathlib, signal, sys, time
def stop(signum, frame):
    time.sleep(0.5)  # a teardown that takes longer than the quarter second subprocess.run would give it
    pathlib.Path(sys.argv[1]).write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
pathlib.Path(sys.argv[2]).write_text("running")
time.sleep(60)
"""


def test_a_stopped_script_gives_its_child_run_the_stop_and_the_time_to_end_itself(tmp_path, monkeypatch, capsys):
    """SIGTERM to the script alone (a scheduler that signals the one process): the child is sent SIGTERM too and
    ends through its own handler, where ``subprocess.run`` would have killed it a quarter second later."""
    import os
    import signal

    monkeypatch.setattr(sys, "argv", ["benchmarks/bench.py"])
    stopped_as, running = tmp_path / "stopped", tmp_path / "running"

    def main() -> int:
        def stop_when_running(signum: int, frame: object) -> None:
            if running.exists():
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                signal.setitimer(signal.ITIMER_REAL, 0.1)

        signal.signal(signal.SIGALRM, stop_when_running)
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        run_child([sys.executable, "-c", STOPPABLE_CHILD, str(stopped_as), str(running)], check=True)
        return 0

    with pytest.raises(SystemExit) as stopped:
        run_script(main)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    assert stopped.value.code == 143 and capsys.readouterr().err == "bench.py: terminated\n"
    assert stopped_as.read_text() == "SIGTERM"


def test_a_child_run_that_fails_is_a_called_process_error_with_what_it_said():
    with pytest.raises(subprocess.CalledProcessError) as failed:
        run_child([sys.executable, "-c", "import sys; sys.exit('no')"], check=True, stderr=subprocess.PIPE, text=True)
    assert failed.value.returncode == 1 and failed.value.stderr.strip() == "no"
    assert run_child([sys.executable, "-c", "print(1)"], stdout=subprocess.PIPE, text=True).stdout == "1\n"


def test_a_script_killed_outright_leaves_no_child_run(tmp_path):
    """SIGKILL to a script (a test's timeout does it) reaches its child run as SIGTERM, which it stops on (before, a
    `torch.distributed.run` job a killed script had started ran on with its workers)."""
    from trainscale.runtime.orphans import is_running

    pid_file = tmp_path / "child.pid"
    script = (
        "import sys\nfrom trainscale.bench.script import run_child\n"
        "run_child(['sh', '-c', 'echo $$ > \"$0\"; exec sleep 60', sys.argv[1]])\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, str(pid_file)])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert time.monotonic() < deadline and parent.poll() is None, "the child run never started"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    try:
        while is_running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_running(child), "the child run outlived the script killed outright"
    finally:
        if is_running(child):
            subprocess.run(["kill", "-9", str(child)])
