"""The grid runner with a stand-in for `trainscale train`: skip finished runs, record failures and go on,
stop runs past their timeout (with everything they started), and never mix folders of other settings."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import tomllib

from trainscale.app.config import TrainConfig, build_config
from trainscale.bench.expand import plan_runs
from trainscale.bench.grid import GridError, load_grid
from trainscale.bench.runfolder import RunFolderError, State, folder_state, to_toml, write_run_files
from trainscale.bench.runner import BenchOptions, check_same_plan, plan, run_grid
from trainscale.runtime.orphans import is_running

# Stands in for `python -m trainscale train --config RUN.toml --out DIR`: lr 0.5 fails, lr 0.7 hangs
# (with a grandchild in its own session, like torch's elastic workers), anything else succeeds.
FAKE_TRAIN = r"""
import json, os, subprocess, sys, time, tomllib
from pathlib import Path
args = sys.argv[sys.argv.index("train") + 1:]
config = tomllib.loads(Path(args[args.index("--config") + 1]).read_text())
out = Path(args[args.index("--out") + 1])
with open(out.parent.parent.parent / "calls.txt", "a") as f:
    f.write(out.name + "\n")
if config["lr"] == 0.5:
    print("trainscale train: error: --lr 0.5 is cursed", file=sys.stderr)
    sys.exit(2)
if config["lr"] == 0.7:
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    (out.parent.parent.parent / "grandchild.pid").write_text(str(child.pid))
    (out.parent.parent.parent / "train.pid").write_text(str(os.getpid()))
    time.sleep(600)
defaults = json.loads((out.parent.parent.parent / "defaults.json").read_text())  # TrainConfig's, all fields
(out / "config.json").write_text(json.dumps({**defaults, **config, "out": str(out)}))
rows = [{"epoch": e + 1, "test_acc": 0.5, "train_acc": 0.5, "epoch_seconds": 1.0, "elapsed_seconds": e + 1.0}
        for e in range(config["epochs"])]
(out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
(out / "summary.json").write_text(json.dumps({"epochs": config["epochs"], "epochs_completed": config["epochs"],
                                              "resumed": config.get("resume", False)}))
"""

GRID = """
    name = "fake"
    [base]
    model = "mlp"
    epochs = 2
    [axes]
    lr = {lrs}
"""


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    return fake_python(tmp_path)


def fake_python(tmp_path: Path) -> Path:
    """An executable that runs FAKE_TRAIN with this interpreter (the runner calls it as `python`)."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    exe = tmp_path / "fakepython"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    exe.chmod(0o755)
    (tmp_path / "defaults.json").write_text(json.dumps(TrainConfig().to_dict()))
    return exe


def options(tmp_path: Path, fake: Path, lrs: str, **kw) -> BenchOptions:
    grid = tmp_path / "grid.toml"
    grid.write_text(textwrap.dedent(GRID.format(lrs=lrs)))
    return BenchOptions(grid=grid, out=tmp_path / "results", python=str(fake), **kw)


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls.txt"
    return path.read_text().split() if path.exists() else []


def ledger(opts: BenchOptions) -> list[dict]:
    return [json.loads(x) for x in (opts.out / "grid.jsonl").read_text().splitlines()]


def test_failure_is_recorded_and_the_grid_goes_on_then_rerun_skips_finished(tmp_path, fake):
    opts = options(tmp_path, fake, "[0.1, 0.5, 0.2]")
    first = run_grid(opts)
    assert [r.status for r in first] == ["ok", "failed", "ok"]
    failed = first[1]
    assert failed.returncode == 2 and "--lr 0.5 is cursed" in failed.error
    error_txt = (opts.out / "runs" / failed.run_id / "error.txt").read_text()
    assert "--lr 0.5 is cursed" in error_txt and "exit status: 2" in error_txt
    assert [e["status"] for e in ledger(opts)] == ["ok", "failed", "ok"]
    grid = json.loads((opts.out / "grid.json").read_text())
    assert [r["run_id"] for r in grid["runs"]] == [r.run_id for r in first]
    assert 'name = "fake"' in grid["grid_text"]
    assert grid["sessions"][0]["environment"]["torch"]

    second = run_grid(opts)
    assert [r.status for r in second] == ["skipped", "failed", "skipped"]  # in plan order
    assert calls(tmp_path).count(failed.run_id) == 2  # only the failed run ran again
    assert len(calls(tmp_path)) == 4
    log = (opts.out / "runs" / failed.run_id / "train.log").read_text()
    assert log.count("--- attempt of ") == 2 and log.count("--lr 0.5 is cursed") == 2  # the first attempt's kept
    error_txt = (opts.out / "runs" / failed.run_id / "error.txt").read_text()
    assert error_txt.count("--lr 0.5 is cursed") == 2  # the error line and the last attempt's tail, once each


def test_results_folder_of_other_settings_is_refused_unless_update(tmp_path, fake):
    run_grid(options(tmp_path, fake, "[0.1]"))
    changed = options(tmp_path, fake, "[0.1, 0.2]")
    with pytest.raises(GridError, match="planned from other settings .*1 new.*--update"):
        run_grid(changed)
    with pytest.raises(GridError, match="planned from other settings"):
        check_same_plan(changed, *plan(changed))  # what `bench --dry-run` says too
    assert len(calls(tmp_path)) == 1
    changed.update = True
    assert [r.status for r in run_grid(changed)] == ["skipped", "ok"]
    assert len(calls(tmp_path)) == 2


def test_folder_holding_another_run_stops_the_grid_before_any_run(tmp_path, fake):
    opts = options(tmp_path, fake, "[0.1, 0.2]")
    results = run_grid(opts)
    marker = opts.out / "runs" / results[1].run_id / "bench.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "config_hash": "deadbeef"}))
    (opts.out / "runs" / results[0].run_id / "summary.json").unlink()
    with pytest.raises(RunFolderError, match="config hash deadbeef.*never mixed"):
        run_grid(opts)
    assert len(calls(tmp_path)) == 2  # the unfinished first run did not start either


def test_config_json_of_other_settings_is_never_reused(tmp_path, fake):
    opts = options(tmp_path, fake, "[0.1]")
    (result,) = run_grid(opts)
    config = opts.out / "runs" / result.run_id / "config.json"
    written = json.loads(config.read_text())
    config.write_text(json.dumps({k: v for k, v in written.items() if k != "tta"}))  # an older trainscale's
    assert [r.status for r in run_grid(opts)] == ["skipped"]
    config.write_text(json.dumps({**written, "weight_decay": 0.1}))
    with pytest.raises(RunFolderError, match="weight_decay"):
        run_grid(opts)


def test_run_past_its_timeout_is_stopped_with_everything_it_started(tmp_path, fake):
    opts = options(tmp_path, fake, "[0.7, 0.1]", timeout=3)
    start = time.monotonic()
    results = run_grid(opts)
    assert [r.status for r in results] == ["timeout", "ok"]
    assert "timeout of 3 s" in results[0].error
    assert time.monotonic() - start < 30
    pid = int((tmp_path / "grandchild.pid").read_text())
    assert not is_running(pid), "the run's grandchild (own session) survived"


def test_checkpointed_unfinished_run_is_resumed(tmp_path, fake):
    opts = options(tmp_path, fake, "[0.1]")
    (spec,) = plan_runs(load_grid(opts.grid), None)
    folder = opts.out / "runs" / spec.run_id
    write_run_files(folder, spec, resume=False)
    (folder / "checkpoint.pt").write_bytes(b"x")
    (folder / "summary.json").write_text(json.dumps({"epochs": 2, "epochs_completed": 1}))
    assert folder_state(folder, spec) is State.RESUME
    run_grid(opts)
    assert json.loads((folder / "summary.json").read_text())["resumed"] is True


@pytest.mark.parametrize("held", ["summary.json", "notes.txt"])
def test_a_results_folder_that_is_no_benchs_is_refused_before_anything_runs(tmp_path, fake, held):
    opts = options(tmp_path, fake, "[0.1]")
    opts.out.mkdir(parents=True)
    (opts.out / held).write_text("{}")  # a `trainscale train` run, or a user's file
    with pytest.raises(GridError, match=f"holds {held} and is no trainscale bench folder"):
        plan(opts)  # the dry run's check too
    assert sorted(p.name for p in opts.out.iterdir()) == [held]


def test_a_folder_another_bench_is_using_is_refused_and_a_finished_bench_leaves_no_lock(tmp_path, fake):
    from trainscale.results import lock_run_folder

    opts = options(tmp_path, fake, "[0.1]")
    with lock_run_folder(opts.out), pytest.raises(GridError, match="is in use by another trainscale job"):
        plan(opts)  # the dry run says so too
    run_grid(opts)
    assert not (opts.out / ".lock").exists()


def test_foreign_folder_is_refused(tmp_path, fake):
    opts = options(tmp_path, fake, "[0.1]")
    (spec,) = plan_runs(load_grid(opts.grid), None)
    folder = opts.out / "runs" / spec.run_id
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text("{}")
    with pytest.raises(RunFolderError, match="not written by `trainscale bench`"):
        folder_state(folder, spec)


def test_generated_run_toml_rebuilds_the_same_config(tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text(
        'name = "t"\n[base]\nmodel = "mlp"\nmilestones = [2, 3]\nweight_decay = 1e-5\n'
        "target_acc = 0.5\nlabel_smoothing = 0.1\n"
    )
    (spec,) = plan_runs(load_grid(grid), None)
    values = tomllib.loads(to_toml(spec.config))
    rebuilt = build_config(values).to_dict()
    assert {k: rebuilt[k] for k in spec.config} == spec.config


def test_cli_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    from trainscale.cli import main

    grid = tmp_path / "g.toml"
    grid.write_text('name = "t"\n[base]\nmodel = "mlp"\n[axes]\nlr = [0.1, 0.2]\n')
    out = tmp_path / "never"
    assert main(["bench", str(grid), "--out", str(out), "--dry-run"]) == 0
    assert not out.exists()


def test_cli_bad_grid_is_one_line_and_status_2(tmp_path, capsys):
    from trainscale.cli import main

    grid = tmp_path / "g.toml"
    grid.write_text('name = "t"\n[axes]\nlr = []\n')
    assert main(["bench", str(grid), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"trainscale bench: error: {grid}:3: axis 'lr' is empty: give at least one value"]
    assert not (tmp_path / "o").exists()


def test_set_and_data_dir_reach_the_plan_and_every_run_config(tmp_path, fake):
    data = tmp_path / "data"
    data.mkdir()
    opts = options(tmp_path, fake, "[0.1, 0.2]", sets={"epochs": 3, "weight-decay": 1e-3}, data_dir=data)
    results = run_grid(opts)
    assert [r.status for r in results] == ["ok", "ok"]
    grid = json.loads((opts.out / "grid.json").read_text())
    assert grid["set"] == {"epochs": 3, "weight_decay": 1e-3, "data_dir": str(data.resolve())}
    for run, result in zip(grid["runs"], results):
        folder = opts.out / "runs" / result.run_id
        written = tomllib.loads((folder / "run.toml").read_text())  # what `trainscale train` is given
        for config in (run["config"], written, json.loads((folder / "config.json").read_text())):
            assert (config["epochs"], config["weight_decay"], config["data_dir"]) == (3, 1e-3, str(data.resolve()))
        assert json.loads((folder / "summary.json").read_text())["epochs_completed"] == 3


def test_changed_set_plans_new_runs_and_is_refused_unless_update(tmp_path, fake):
    first = run_grid(options(tmp_path, fake, "[0.1]"))
    changed = options(tmp_path, fake, "[0.1]", sets={"epochs": 3})
    with pytest.raises(
        GridError,
        match=r"other settings \(no --set -> --set epochs=3; 1 run\(s\) no longer "
        r"planned, 1 new\)",
    ):
        run_grid(changed)
    changed.update = True
    (second,) = run_grid(changed)
    assert second.status == "ok" and second.run_id != first[0].run_id  # a new run, not the 2-epoch one reused
    assert calls(tmp_path) == [first[0].run_id, second.run_id]
    assert [r.status for r in run_grid(changed)] == ["skipped"]  # the same --set again: nothing to do


def test_cli_set_overrides_the_grid_in_the_dry_run(tmp_path, capsys):
    from trainscale.cli import main

    grid = tmp_path / "g.toml"
    grid.write_text('name = "t"\n[base]\nmodel = "mlp"\nepochs = 5\n[axes]\nlr = [0.1, 0.2]\n')
    assert (
        main(
            [
                "bench",
                str(grid),
                "--out",
                str(tmp_path / "o"),
                "--dry-run",
                "--set",
                "epochs=2",
                "--set",
                "precision=bf16",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert 'grid t (scale none, --set epochs=2 --set precision="bf16"): 2 run(s)' in out
    rows = [line.split() for line in out.splitlines()[3:]]
    assert [row[-4] for row in rows] == ["2", "2"]  # the epochs column
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--set", "epochz=2"],
            "--set epochz=2: unknown key 'epochz' (did you mean 'epochs'?); --set takes the "
            "`trainscale train` flags (see `trainscale train --help`)",
        ),
        (["--set", "epochs=two"], "--set epochs=\"two\": 'epochs' must be float, got 'two'"),
        (
            ["--set", "out=x"],
            "--set out=\"x\": key 'out' is set by `trainscale bench` for each run; it cannot be given with --set",
        ),
        (["--data-dir", "{tmp}/no-such-data"], "--data-dir {tmp}/no-such-data: no such folder"),
        (
            ["--data-dir", "{tmp}", "--set", "data_dir=/x"],
            '--data-dir {tmp} and --set data_dir="/x" both choose the data folder; give one',
        ),
    ],
)
@pytest.mark.parametrize("dry_run", [False, True])
def test_cli_bad_set_or_data_dir_is_one_line_and_status_2_before_any_run(tmp_path, capsys, flags, message, dry_run):
    from trainscale.cli import main

    grid = tmp_path / "g.toml"
    grid.write_text('name = "t"\n[base]\nmodel = "mlp"\n')
    flags = [f.format(tmp=tmp_path) for f in flags] + (["--dry-run"] if dry_run else [])
    assert main(["bench", str(grid), "--out", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"trainscale bench: error: {message.format(tmp=tmp_path)}"]
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux /proc")
def test_descendants_finds_the_process_tree():

    from trainscale.bench.process import descendants

    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess,time; p=subprocess.Popen(['sleep','30']); time.sleep(30)"]
    )
    try:
        for _ in range(50):
            found = descendants(os.getpid())
            if len([p for p in found if p != child.pid]) >= 1:
                break
            time.sleep(0.1)
        assert child.pid in found and len(found) >= 2
    finally:
        for pid in descendants(child.pid):
            os.kill(pid, 9)
        child.kill()
        child.wait()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux /proc")
def test_stop_also_stops_what_the_run_starts_after_the_signal(tmp_path: Path) -> None:
    """A run that starts a process just as it is stopped (a node, a worker): that process is stopped too before
    `stop` returns (before, the tree was collected once, and a process started after it outlived the bench)."""
    from trainscale.bench.process import start, stop
    from trainscale.runtime.orphans import is_running

    late = tmp_path / "late.pid"
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "time.sleep(0.5)\n"
        "child = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        f"open({str(late)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    proc = start([sys.executable, "-c", script], tmp_path / "run.log", dict(os.environ))
    time.sleep(0.2)  # started, not yet its child
    stop(proc, grace=2.0)
    pid = int(late.read_text())
    try:
        assert not is_running(pid), "a process the run started after the signal outlived the stop"
    finally:
        if is_running(pid):
            os.kill(pid, 9)


@pytest.mark.parametrize("scales", ["", "[scale.quick]\nepochs = 1\n"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_scale_the_grid_lacks_is_one_line_and_status_2(tmp_path, capsys, scales, dry_run):
    """Also on a grid without scales: running its own settings under a name the user asked for would record
    runs they did not ask for."""
    from trainscale.cli import main

    grid = tmp_path / "g.toml"
    grid.write_text('name = "t"\n[base]\nmodel = "mlp"\n' + scales)
    flags = ["--dry-run"] if dry_run else []
    assert main(["bench", str(grid), "--out", str(tmp_path / "o"), "--scale", "full", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "grid has no scale 'full'; its scales are: " in err[0], err
    assert not (tmp_path / "o").exists()


# A bench in a process of its own (as `trainscale bench` runs), with the stand-in for `trainscale train`.
BENCH = """
import sys
from pathlib import Path
from trainscale.bench.runner import BenchOptions, run_grid
from trainscale.commands import stops_as_ctrl_c
from trainscale.runtime.job import Job
from trainscale.stops import stop_report
try:
    with stops_as_ctrl_c(Job()):  # as `trainscale bench`, a command the user started, runs
        run_grid(BenchOptions(grid=Path(sys.argv[1]), out=Path(sys.argv[2]), python=sys.argv[3]))
except KeyboardInterrupt as stop:
    sys.exit(stop_report(stop)[1])
"""


def _bench_process(tmp_path: Path, fake: Path) -> tuple[subprocess.Popen, int]:
    """A bench whose run hangs, and the pid of that run once it started."""
    opts = options(tmp_path, fake, "[0.7]")
    bench = subprocess.Popen([sys.executable, "-c", BENCH, str(opts.grid), str(opts.out), str(fake)])
    deadline = time.monotonic() + 60
    while not (tmp_path / "grandchild.pid").exists():
        assert bench.poll() is None and time.monotonic() < deadline, "the bench never started its run"
        time.sleep(0.05)
    return bench, int((tmp_path / "train.pid").read_text())


def _gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not is_running(pid)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux /proc")
def test_a_bench_killed_with_sigkill_takes_its_run_with_it(tmp_path, fake):
    """The parent-death signal: before, the run went on without a parent (and a re-run collided with it)."""
    bench, train = _bench_process(tmp_path, fake)
    try:
        bench.kill()
        bench.wait()
        assert _gone(train, 10), "the run outlived the bench killed with SIGKILL"
    finally:
        for pid in (train, int((tmp_path / "grandchild.pid").read_text())):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux /proc")
def test_sigterm_stops_a_bench_as_ctrl_c_does(tmp_path, fake):
    """SIGTERM (a scheduler's stop) ends the bench through its clean-up: the run and all it started are stopped
    (before, the bench died at once and its run and the run's own children were left)."""
    bench, train = _bench_process(tmp_path, fake)
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    try:
        bench.terminate()
        assert bench.wait(timeout=60) == 143
        assert _gone(train, 5) and _gone(grandchild, 5), "SIGTERM left the bench's run behind"
    finally:
        for pid in (train, grandchild):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
