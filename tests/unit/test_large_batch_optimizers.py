"""``benchmarks/large_batch_optimizers.py``: its runs are ``trainscale train`` with the shared settings and each
optimizer's own; a bad ``--run`` or ``--set`` is argparse's one line before any run starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.scripts import load_benchmark

lbo = load_benchmark("large_batch_optimizers")


def test_each_run_is_trainscale_train_with_the_shared_settings(tmp_path, monkeypatch, capsys) -> None:
    launched: list[list[str]] = []

    def run(cmd: list[str]) -> Any:
        launched.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "summary.json").write_text(json.dumps({"final_test_acc": 0.5, "best_test_acc": 0.6, "batch_size": 1024}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(lbo, "run_child", run)
    checked: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(lbo, "check_run", lambda flags, what: checked.append((what, flags)))
    argv = ["--out", str(tmp_path), "--run", "lamb:0.02", "--set", "train_subset=10000", "--set", "epochs=3"]
    monkeypatch.setattr(sys, "argv", ["large_batch_optimizers.py", *argv])
    lbo.main()
    (cmd,) = launched
    assert cmd[cmd.index("--epochs") + 1] == "3" and cmd[cmd.index("--train-subset") + 1] == "10000"
    assert cmd[cmd.index("--optimizer") + 1 :][:3] == ["lamb", "--lr", "0.02"]
    assert "lamb" in capsys.readouterr().out
    ((what, flags),) = checked
    assert what == "lamb at lr 0.02" and lbo.to_argv(flags) == cmd[4:]


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--run", "lars"], "argument --run: give OPTIMIZER:LR with a positive LR, e.g. lars:10, got 'lars'"),
        (["--run", "lars:-1"], "argument --run: give OPTIMIZER:LR with a positive LR, e.g. lars:10, got 'lars:-1'"),
        (["--run", "larz:10"], "argument --run: unknown optimizer 'larz' (did you mean 'lars'?)"),
        (["--set", "nosuch=1"], "argument --set: nosuch=1: unknown key 'nosuch'"),
        (["--set", "epochs=1", "--set", "epochs=2"], "--set epochs=2: 'epochs' is given twice with --set; keep one"),
    ],
)
def test_bad_arguments_are_one_line_before_any_run(argv, line, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(lbo, "run_child", lambda cmd: pytest.fail("a run started"))
    monkeypatch.setattr(sys, "argv", ["large_batch_optimizers.py", "--out", str(tmp_path / "out"), *argv])
    with pytest.raises(SystemExit) as stopped:
        lbo.main()
    assert stopped.value.code == 2 and line in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--set", "epochs=0"], "sgd at lr 0.8: --epochs must be a positive number, got 0"),
        (["--run", "sgd:0.1", "--run", "lamb:1", "--set", "weight_decay=-1"], "sgd at lr 0.1: --weight-decay"),
    ],
)
def test_settings_a_run_would_refuse_are_refused_before_the_first_run(argv, line, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lbo, "run_child", lambda cmd: pytest.fail("a run started"))
    monkeypatch.setattr(sys, "argv", ["large_batch_optimizers.py", "--out", str(tmp_path / "out"), *argv])
    with pytest.raises(lbo.ConfigError, match=line):
        lbo.main()
    assert not (tmp_path / "out").exists()
