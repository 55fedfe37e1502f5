"""The command explains itself: --version, a did-you-mean for a mistyped flag (one line, exit 2, the same
`trainscale <command>:` prefix as every other error), the defaults that matter in --help, every registered mode
in --mode's help, and `trainscale models` in 100 columns with recipe values as a person writes them."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.cli import default_sigint
from trainscale import __version__
from trainscale.cli import build_parser, main
from trainscale.modes import list_modes
from trainscale.runtime.orphans import sigterm_as_interrupt
from trainscale.stops import Terminated


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"trainscale {__version__}"


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["train", "--epohcs", "3"],
            "trainscale train: error: unknown flag --epohcs; did you mean --epochs? (see trainscale train --help)",
        ),
        (
            ["train", "--lr=0.1", "--momentm=0.9"],
            "trainscale train: error: unknown flag --momentm; did you mean --momentum?",
        ),
        (
            ["data", "verify", "--datset", "cifar10"],
            "trainscale data verify: error: unknown flag --datset; did you mean",
        ),
        (["models", "--xyzzy"], "trainscale models: error: unknown flag --xyzzy (see trainscale models --help)"),
        (["train", "stray"], "trainscale train: error: unexpected argument 'stray'"),
        (  # it said: unknown flag --hosts; did you mean --hosts?
            ["cluster", "up", "--", "-fz", "--hosts", "2"],
            "trainscale cluster up: error: --hosts came after --, where every word is an argument; put it before --",
        ),
    ],
)
def test_a_mistyped_flag_is_one_line_with_the_commands_prefix(capsys, argv, line):
    assert one_line_error(capsys, argv).startswith(line)


def train_help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_help_shows_the_defaults_that_matter(capsys):
    text = train_help(capsys)
    assert "import path package.module:function (default: from the recipe, else resnet9)" in text
    assert "(default: cifar10)" in text
    assert "the schedule ending there) (default: from the recipe, else 24)" in text
    assert "(default: fp32)" in text


def test_mode_help_lists_every_registered_mode(capsys):
    text = train_help(capsys)
    listed = text.split("--mode MODE auto", 1)[1].split("--target-acc", 1)[0]
    assert all(name in listed for name in list_modes()), listed


def test_models_fit_in_100_columns_with_details_on_request(capsys):
    assert main(["models"]) == 0
    narrow = capsys.readouterr().out.splitlines()
    assert max(map(len, narrow)) <= 100
    assert main(["models", "--wide"]) == 0
    assert "description" in capsys.readouterr().out.splitlines()[0]
    assert main(["models", "airbench94"]) == 0
    one = capsys.readouterr().out
    assert "recipe airbench94" in one and max(map(len, one.splitlines())) <= 100


def test_recipe_values_are_printed_as_written(capsys):
    assert main(["models", "--recipes"]) == 0
    out = capsys.readouterr().out
    assert "--head-lr-factor 12.6415 " in out and "12.641509433962264" not in out
    assert max(map(len, out.splitlines())) <= 100


def test_a_run_says_what_it_is_before_its_first_epoch(tmp_path, capsys):
    """The start line (run folder, device, world size, recipe) comes before the first epoch's line; the airbench
    timer-scope line belongs only to runs of a recipe with such a reference (mlp's recipe has none)."""
    import logging

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    lines: list[str] = []
    keep = Keep(logging.INFO)
    logging.getLogger("trainscale").addHandler(keep)  # the CLI's own handler may hold an earlier test's stderr
    out = tmp_path / "run"
    argv = ["train", "--model", "mlp", "--dataset", "synthetic", "--train-subset", "128", "--test-subset", "32"]
    try:
        assert main([*argv, "--epochs", "1", "--batch-size", "64", "--no-progress", "--out", str(out)]) == 0
    finally:
        logging.getLogger("trainscale").removeHandler(keep)
    printed = capsys.readouterr()
    start = next(i for i, line in enumerate(lines) if line.startswith("run folder "))
    assert start < next(i for i, line in enumerate(lines) if line.startswith("epoch 1/1"))
    assert lines[start].startswith(f"run folder {out}; mlp on synthetic, cpu")
    assert lines[start].endswith(", world size 1, mode local, recipe mxnet-mnist")
    assert "timer scope" not in printed.out


@pytest.mark.parametrize(
    "toml, line",
    [
        ('model = "mlp"\nprecision = "bf61"\n', ":2: key 'precision' must be one of fp32, bf16, fp16, auto, got"),
        ('model = "mlp"\n[optim]\nlr = -1\n', ":3: key 'lr' must be >= 0"),
    ],
)
def test_a_bad_value_in_a_toml_file_names_file_and_line(tmp_path, capsys, toml, line):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    assert f"trainscale train: error: {path}{line}" in one_line_error(capsys, ["train", "--config", str(path)])


def test_a_bad_value_given_as_a_flag_still_names_the_flag(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('model = "mlp"\n')
    assert "--lr must be >= 0" in one_line_error(capsys, ["train", "--config", str(path), "--lr", "-1"])


@pytest.mark.parametrize(
    "stop, status, word", [(KeyboardInterrupt, 130, "interrupted"), (Terminated, 143, "terminated")]
)
def test_a_stop_is_one_line_and_the_status_a_shell_gives_the_signal(capsys, monkeypatch, stop, status, word):
    """Ctrl-C and a scheduler's SIGTERM end every command alike: one line naming the command, 130 or 143 (before,
    a SIGTERM that a launcher turned into an interrupt ended as if Ctrl-C had been pressed)."""
    from trainscale import commands

    def stopped(*args: object) -> int:
        with sigterm_as_interrupt():
            if stop is Terminated:
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                raise stop
        return 0

    monkeypatch.setattr(commands, "dispatch", stopped)
    assert main(["models"]) == status
    assert capsys.readouterr().err == f"trainscale models: {word}\n"


def test_ctrl_c_while_the_command_still_imports_torch_waits_for_the_import_and_is_one_line(capsys, monkeypatch):
    """The first second of every command imports torch (building its flags). A Ctrl-C there printed the import's
    traceback, or, landing inside torch's C start-up, ended the process by SIGINT after its line, not with 130."""
    from trainscale import cli

    built = []

    def importing(*only: object) -> argparse.ArgumentParser:
        signal.raise_signal(signal.SIGINT)
        built.append("whole")
        return build_parser()

    monkeypatch.setattr(cli, "build_parser", importing)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored where the tests run in the background
    try:
        assert main(["models"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert built == ["whole"]
    assert capsys.readouterr().err == "trainscale models: interrupted\n"


CTRL_C_HANDLED = """
import pathlib, sys, time
from trainscale.stops import exit_with
try:
    pathlib.Path(sys.argv[1]).touch()
    time.sleep(60)
except KeyboardInterrupt:
    print("cleaned up", flush=True)
    exit_with(130)
"""


def test_ctrl_c_in_a_shell_loop_of_commands_stops_the_loop(tmp_path):
    """A command that handled Ctrl-C still ends by SIGINT (a shell says 130 all the same), so that a loop of runs
    stops: after a plain exit 130, bash takes it that the command dealt with Ctrl-C and runs the next one."""
    script, ready = tmp_path / "command.py", tmp_path / "ready"
    script.write_text(CTRL_C_HANDLED)
    loop = f'for seed in 1 2; do "{sys.executable}" "{script}" "{ready}"; echo "after $seed: $?"; done'
    proc = subprocess.Popen(
        ["bash", "-c", loop],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_sigint,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the shell and the command get it
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert (out, err) == ("cleaned up\n", "")
    assert proc.returncode == -signal.SIGINT


IMPORTS_TORCH = """
import sys
from trainscale.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as stop:
    status = stop.code
print("torch" in sys.modules, status)
"""


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"], ["cluster", "status"], ["cluster", "up", "--help"], ["report", "--help"], ["trian"]],
)
def test_a_command_that_does_not_train_starts_without_torch(argv):
    """A command builds only its own flags: `trainscale --help` or `cluster status` took two seconds, all of it
    importing torch and every model, mode and compressor to list flags of `train` it never reads."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS_TORCH, *argv], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split()[-2] == "False", done.stdout + done.stderr


def test_a_command_built_alone_has_the_flags_it_has_among_all():
    def flags(parser: argparse.ArgumentParser, command: str) -> list[tuple[str, ...]]:
        sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
        return [tuple(action.option_strings) for action in sub._actions]

    whole = build_parser()
    for command in ("train", "plan", "cluster", "models", "data"):
        assert flags(build_parser({command}), command) == flags(whole, command)


@pytest.mark.parametrize(
    "argv, name",
    [
        (["train", "--config", "", "--model", "mlp", "--dry-run"], "--config"),
        (["train", "--model", "mlp", "--data-dir", "", "--dry-run"], "--data-dir"),
        (["train", "--model", "mlp", "--model-arg", "", "--dry-run"], "--model-arg"),
        (["data", "verify", "--data-dir", ""], "--data-dir"),
        (["cluster", "status", ""], "NAME"),
    ],
)
def test_an_empty_value_is_refused_not_read_as_absent(capsys, argv, name):
    """An unset shell variable (`--config "$CFG"`) gave an empty path, read as no path: the run went on with the
    defaults (or $TRAINSCALE_DATA, or every cluster) in silence."""
    assert (
        one_line_error(capsys, argv) == f"trainscale {argv[0]}: error: {name} is empty: give a value, or leave it out"
    )


def test_an_empty_value_in_a_config_file_is_refused_at_its_line(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('model = "mlp"\ndata_dir = ""\n')
    assert one_line_error(capsys, ["train", "--config", str(config), "--dry-run"]) == (
        f"trainscale train: error: {config}:2: key 'data_dir' is empty: give a value, or leave it out"
    )


def test_a_very_long_unknown_name_is_shortened_in_its_line(capsys):
    line = one_line_error(capsys, ["train", "--model", "x" * 100_000, "--dry-run"])
    assert f"unknown model '{'x' * 77}...'" in line and len(line) < 400
