"""What a run folder holds besides its results: run.toml (the run's settings, which --config and --resume read),
the live metrics (steps.jsonl, TensorBoard) and the Python entry trainscale.fit's checks."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainscale.app.config import build_config, train_settings
from trainscale.errors import ConfigError
from trainscale.record import RUN_TOML, STEPS, StepK, step_keys
from trainscale.results import PATH_SETTINGS, RunWriter
from trainscale.train.setup import check_resume_matches
from trainscale.train.steplog import StepLog

CONFIGS = [
    {},
    {
        "model": "resnet20",
        "epochs": 3,
        "lr": 0.123456789012345,
        "schedule": "step",
        "milestones": [2, 3],
        "weight_decay": 1e-5,
        "label_smoothing": 0.1,
        "seed": 7,
        "precision": "bf16",
        "cutout": 8,
        "train_subset": 100,
        "data_dir": '/data/ü y "quoted"',
        "target_acc": 0.5,
        "log_every": 7,
        "out": "runs/a b",
    },
    {"model": "mlp", "workers": 2, "compress": "topk", "ratio": 0.01, "error_feedback": True, "batch_per_worker": 32},
    {"model": "resnet20", "mode": "diloco", "workers": 2, "sync_every": 4, "outer_lr": 0.5},
    {"model": "mlp", "mode": "async", "workers": 2, "servers": 1, "staleness": 2, "devices": None, "eval_every": 0},
    {"model": "airbench94", "tta": True, "tta_translate": 1, "optimizer": "muon", "progress": False},
]


@pytest.mark.parametrize("settings", CONFIGS, ids=range(len(CONFIGS)))
def test_run_toml_recreates_the_config_exactly(tmp_path, settings, monkeypatch):
    cfg = build_config(settings)
    RunWriter(tmp_path).write_run_toml(cfg)
    paths = {k: str(Path(v).absolute()) for k, v in cfg.to_dict().items() if k in PATH_SETTINGS and isinstance(v, str)}
    monkeypatch.chdir(tmp_path)  # read from another folder: its paths still name the run's folders
    assert train_settings({}, tmp_path / RUN_TOML) == cfg.replace(**paths)  # `trainscale train --config DIR/run.toml`


def test_resume_takes_the_run_folders_settings_and_compares_only_those_given(tmp_path):
    cfg = build_config(CONFIGS[1], {"out": str(tmp_path)})
    writer = RunWriter(tmp_path)
    writer.write_run_toml(cfg)
    writer.write_config(cfg.to_dict())
    resumed = train_settings({"out": str(tmp_path), "resume": True})
    assert resumed == cfg.replace(resume=True)
    check_resume_matches(cfg.to_dict(), resumed)  # nothing given: nothing differs
    check_resume_matches(cfg.to_dict(), train_settings({"out": str(tmp_path), "resume": True, "epochs": 5}))
    with pytest.raises(ConfigError, match=r"other settings: lr \(was 0.123456789012345, now 0.9\)"):
        check_resume_matches(cfg.to_dict(), train_settings({"out": str(tmp_path), "resume": True, "lr": 0.9}))
    (tmp_path / RUN_TOML).unlink()  # a folder from before run.toml: its config.json
    assert train_settings({"out": str(tmp_path), "resume": True}) == cfg.replace(resume=True)


def test_tensorboard_without_the_package_is_one_line_before_training(tmp_path, monkeypatch, capsys):
    from trainscale.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name))
    out = tmp_path / "run"
    assert main(["train", "--model", "mlp", "--tensorboard", "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("trainscale train: error: --tensorboard") and "pip install 'trainscale[tensorboard]'" in line
    assert not out.exists()


class Sums:
    def __init__(self):
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.count = 0


def test_step_log_rows_every_n_steps_and_the_last_with_window_means(caplog):
    rows, sums = [], Sums()
    log = StepLog(every=3, workers=2, sink=rows.append, lines=True)
    log.start_epoch(epoch=1, steps=7, sums=sums, started=0.0)
    with caplog.at_level(logging.INFO, logger="trainscale.train"):
        for step in range(7):
            sums.loss_sum += float(step) * 4  # loss of step s is s, over a batch of 4
            sums.count += 4
            log.after_step(step, 4, lr=0.1 * step)
    assert [r[StepK.step] for r in rows] == [10, 13, 14]  # epoch 2 of 7 steps: global steps 8..14
    assert [r[StepK.loss] for r in rows] == [1.0, 4.0, 6.0]  # means of steps 0-2, 3-5, 6
    assert [r[StepK.epoch] for r in rows] == [2, 2, 2] and rows[-1][StepK.lr] == pytest.approx(0.6)
    assert all(set(r) == set(step_keys()) and r[StepK.samples_per_sec] > 0 for r in rows)
    assert len([m for m in caplog.messages if m.startswith("epoch 2 step ")]) == 3


def test_step_rows_of_epochs_after_the_checkpoint_are_dropped_on_resume(tmp_path):
    writer = RunWriter(tmp_path)
    for step in range(1, 7):
        writer.add_steps({StepK.step: step, StepK.epoch: (step + 1) // 2, StepK.loss: 1.0, StepK.lr: 0.1})
    with (tmp_path / STEPS).open("a") as f:
        f.write('{"step": 7, "ep')  # a torn line from a kill mid-write
    resumed = RunWriter(tmp_path)
    resumed.restore_steps(2)
    resumed.add_steps({StepK.step: 5, StepK.epoch: 3, StepK.loss: 2.0, StepK.lr: 0.1})
    rows = [json.loads(x) for x in (tmp_path / STEPS).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]


def test_tensorboard_events_hold_the_step_and_epoch_figures(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = RunWriter(tmp_path, tensorboard=True)
    writer.add_steps({StepK.step: 5, StepK.epoch: 1, StepK.loss: 2.5, StepK.lr: 0.1})
    writer.add_epoch({"epoch": 1, "train_loss": 2.4, "test_acc": 0.3, "elapsed_seconds": 1.0})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("step/loss")] == [(5, 2.5)]
    assert [e.value for e in events.Scalars("epoch/test_acc")] == [pytest.approx(0.3)]


def test_import_trainscale_loads_nothing_and_fit_is_there():
    code = "import sys, trainscale; assert 'torch' not in sys.modules; print(trainscale.fit.__module__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "trainscale.api"


def test_fit_raises_the_line_the_cli_prints(capsys):
    import trainscale
    from trainscale.cli import main

    assert main(["train", "--model", "mlp", "--lr", "-1", "--dry-run"]) == 2
    cli_line = capsys.readouterr().err.strip().removeprefix("trainscale train: error: ")
    with pytest.raises(ConfigError) as raised:
        trainscale.fit("mlp", lr=-1, dry_run=True)
    assert str(raised.value) == cli_line


def test_fit_refuses_an_instance_on_several_workers_and_a_wrong_head(tmp_path):
    import trainscale

    with pytest.raises(ConfigError, match="a model instance trains in this process"):
        trainscale.fit(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10)), workers=2)
    head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 7))
    with pytest.raises(ConfigError, match=r"outputs of shape \(2, 7\) for 2 images; the data has 10 classes"):
        trainscale.fit(head, dataset="synthetic", train_subset=64, batch_size=32, out=str(tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_fit_feeds_an_instance_the_datas_size_and_says_what_it_cannot_take(tmp_path):
    import trainscale

    small = "tests.userpkg.data:tensors"  # 16x16 images, 4 classes
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4))
    result = trainscale.fit(net, dataset=small, epochs=1, progress=False, out=tmp_path / "r")  # a Path, as given
    assert result.summary["image_size"] == 16 and net.training  # the caller's mode back after the evaluation
    wide = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 64 * 64, 10))
    with pytest.raises(ConfigError, match=r"^model Sequential cannot take 3x32x32 images \(RuntimeError: mat1"):
        trainscale.fit(wide, dataset="synthetic", train_subset=64, out=str(tmp_path / "w"))
    with pytest.raises(ConfigError, match="^model Flatten has no trainable parameters"):
        trainscale.fit(torch.nn.Flatten(), dataset="synthetic", train_subset=64, out=str(tmp_path / "f"))
    with pytest.raises(ConfigError, match="--model-arg width: model Sequential takes no argument 'width'"):
        trainscale.fit(net, dataset=small, model_args=["width=4"], dry_run=True)


def test_fit_takes_every_flag_spelling_and_keeps_the_callers_torch_state(tmp_path, monkeypatch):
    import trainscale
    from tests.userpkg.nets import tiny

    monkeypatch.setattr(sys.modules["__main__"], "build", tiny, raising=False)  # a factory in the user's script

    torch.manual_seed(123)
    expected, threads = torch.rand(1), torch.get_num_threads()
    torch.manual_seed(123)
    result = trainscale.fit("mlp", dataset="synthetic", train_subset=64, threads=1, dry_run=True, model_arg=[])
    assert result.summary["model_args"] == []
    trainscale.fit("mlp", dataset="synthetic", train_subset=64, epochs=1, threads=1, out=str(tmp_path / "r"))
    assert torch.equal(torch.rand(1), expected) and torch.get_num_threads() == threads
    with pytest.raises(ConfigError, match=r"unknown setting\(s\): batchsize \(did you mean batch_size\?\)"):
        trainscale.fit("mlp", batchsize=32, dry_run=True)
    with pytest.raises(ConfigError, match="config= takes the path of a TOML file .*, not a dict"):
        trainscale.fit("mlp", config={"epochs": 2})
    with pytest.raises(ConfigError, match="gpus and devices are the same setting"):
        trainscale.fit("mlp", gpus="0", devices="1", dry_run=True)
    with pytest.raises(ConfigError, match="other processes of this job cannot import your script's build"):
        trainscale.fit("__main__:build", workers=2, dry_run=True)


@pytest.mark.parametrize(
    ("settings", "tty", "expected"),
    [
        ({}, True, (True, False)),  # a terminal: the bar shows, rows go to the file only
        ({}, False, (True, True)),  # piped: plain lines too
        ({"progress": False}, False, (True, False)),
        ({"log_every": 0}, False, None),
        ({"fault_tolerance": True, "workers": 2}, False, (False, True)),  # replicas take turns: no file rows
    ],
)
def test_live_metrics_go_to_the_file_and_to_plain_lines_only_off_a_terminal(
    tmp_path, monkeypatch, settings, tty, expected
):
    from trainscale.app import run

    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    cfg = build_config({"model": "mlp", **settings})
    writer = RunWriter(tmp_path)
    got = run.step_log(cfg, writer, 1)
    assert (got if got is None else (got.sink is not None, got.lines)) == expected


def test_a_cluster_nodes_run_toml_records_the_cluster_run_not_the_node():
    from trainscale.app.run import recorded_settings

    parent = build_config({"model": "mlp", "workers": 2, "cluster": "api-runs-c", "threads": 1, "out": "runs/c"})
    node = {"nnodes": 3, "node_rank": 2, "rdzv_endpoint": "10.77.0.1:29400", "rdzv_id": "trainscale"}
    built = build_config({"model": "mlp", "workers": 2, "threads": 1, "out": "runs/c", **node})
    assert recorded_settings(built, "api-runs-c") == parent
    assert recorded_settings(parent, None) is parent


def test_resume_with_hosts_gives_every_node_the_runs_settings(tmp_path, capsys):
    from trainscale.cli import main

    out = tmp_path / "run"
    node0 = {"nnodes": 2, "rdzv_endpoint": "10.0.0.1:29400"}  # what node 0 of the run recorded
    cfg = build_config(
        {"model": "resnet20", "epochs": 3, "lr": 0.123, "schedule": "step", "milestones": [2, 3], **node0}
    )
    RunWriter(out).write_run_toml(cfg.replace(out=str(out)))
    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.1\n10.0.0.2\n")
    assert main(["train", "--hosts", str(hosts), "--out", str(out), "--resume"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("trainscale train")]
    assert len(commands) == 2  # the other machine has no run folder to read the settings from
    for command in commands:
        for flag in ("--model resnet20", "--lr 0.123", "--milestones 2.0,3.0", "--epochs 3", "--resume"):
            assert f" {flag}" in command, (flag, command)
