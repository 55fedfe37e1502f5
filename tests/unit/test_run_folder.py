"""Nothing already written is lost: run folders are never clobbered, resumes must match, torn files are read."""

import logging
import time
from pathlib import Path

import pytest
import torch

from trainscale.app.config import build_config
from trainscale.errors import ConfigError, DataError
from trainscale.io import atomic_write_text, read_json, read_jsonl
from trainscale.results import RunWriter
from trainscale.train.loop import NonFiniteGuard, NonFiniteLoss
from trainscale.train.setup import check_run_folder


def cfg(tmp_path, **kw):
    return build_config({"model": "mlp", "out": str(tmp_path / "run"), **kw})


@pytest.mark.parametrize("existing", ["summary.json", "metrics.jsonl", "checkpoint.pt"])
def test_an_existing_run_is_never_overwritten_even_without_a_checkpoint(tmp_path, existing):
    out = tmp_path / "run"
    out.mkdir()
    (out / existing).write_text("{}")
    (out / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds a run; pass --resume"):
        check_run_folder(out, resume=False)


def test_a_run_that_stopped_before_its_first_epoch_is_kept_and_the_error_says_to_delete_it(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "run.toml").write_text("")
    with pytest.raises(ConfigError, match="stopped before its first epoch ended .* delete that folder"):
        check_run_folder(out, resume=False)
    assert (out / "config.json").exists()


def test_a_folder_that_is_not_a_run_or_is_a_file_is_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(ConfigError, match="already holds files and is not a trainscale run"):
        check_run_folder(tmp_path / "mine", resume=False)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        check_run_folder(tmp_path / "afile", resume=False)
    (tmp_path / "empty").mkdir()
    check_run_folder(tmp_path / "empty", resume=False)  # an empty folder is fine


def test_resume_refuses_other_settings_naming_each_key(tmp_path):
    first = cfg(tmp_path, epochs=2, lr=0.1)
    out = tmp_path / "run"
    RunWriter(out).write_config(first.to_dict())
    (out / "checkpoint.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"lr \(was 0.1, now 0.2\); momentum \(was 0.9, now 0.5\)"):
        check_run_folder(out, True, cfg(tmp_path, epochs=2, lr=0.2, momentum=0.5, resume=True))
    with pytest.raises(ConfigError, match="epochs may only grow"):
        check_run_folder(out, True, cfg(tmp_path, epochs=1, lr=0.1, resume=True))
    check_run_folder(out, True, cfg(tmp_path, epochs=4, lr=0.1, resume=True, progress=False))


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path):
    out = tmp_path / "run"
    RunWriter(out).write_config({"model": "mlp"})
    check_run_folder(out, resume=True)  # config.json but no checkpoint: allowed, from the beginning
    with pytest.raises(ConfigError, match="no checkpoint"):
        check_run_folder(tmp_path / "nothing", resume=True)


def test_resume_of_a_finished_run_without_its_checkpoint_keeps_its_results(tmp_path):
    """Told to delete a corrupt checkpoint, a user resumed the finished run: it trained again from the start, over
    the finished run's summary.json and metrics.jsonl."""
    import json

    out = tmp_path / "run"
    RunWriter(out).write_config({"model": "mlp"})
    (out / "summary.json").write_text(json.dumps({"epochs": 3, "epochs_completed": 3}))
    with pytest.raises(ConfigError, match="finished all its 3 epoch.s. and has no checkpoint to go on from"):
        check_run_folder(out, resume=True)
    assert json.loads((out / "summary.json").read_text())["epochs_completed"] == 3
    (out / "summary.json").write_text(json.dumps({"epochs": 3, "epochs_completed": 1}))  # stopped: starts over
    check_run_folder(out, resume=True)


def test_interrupted_writes_leave_no_debris(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".checkpoint.pt.abc123.tmp").write_bytes(b"half")
    RunWriter(out)
    assert not list(out.glob(".*.tmp"))
    atomic_write_text(out / "x.json", "{}")
    assert sorted(p.name for p in out.iterdir()) == ["x.json"]


def test_jsonl_tolerates_a_torn_last_line_and_refuses_real_corruption(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"epoch": 1}\n{"epoch": 2}\n{"epo')
    assert read_jsonl(path) == [{"epoch": 1}, {"epoch": 2}]
    path.write_text('{"epoch": 1}\n{"ep\n{"epoch": 3}\n')
    with pytest.raises(DataError, match="m.jsonl:2 is not valid JSON"):
        read_jsonl(path)
    (tmp_path / "s.json").write_text("{not json")
    with pytest.raises(DataError, match="s.json is not valid JSON"):
        read_json(tmp_path / "s.json")


@pytest.mark.parametrize("every", [1, 10])
def test_a_non_finite_loss_stops_training_naming_epoch_and_step(every):
    guard = NonFiniteGuard(torch.device("cpu"), epoch=2, lr_at=lambda t: 0.5, steps=25)
    guard.every = every  # 10: the GPU path, which records the first bad step on the device
    for step in range(3):
        guard.add(step, torch.tensor(1.0))
    with pytest.raises(NonFiniteLoss, match=r"not finite \(NaN or inf\) at epoch 3 step 4 \(lr 0.5\)"):
        for step in range(3, 25):
            guard.add(step, torch.tensor(float("nan") if step in (3, 4) else 1.0))


@pytest.fixture
def warnings_seen(caplog, monkeypatch):
    """The trainscale log records (the CLI's logging setup stops them propagating to pytest's handler)."""
    monkeypatch.setattr(logging.getLogger("trainscale"), "propagate", True)
    return caplog


def report_status(tmp_path, runs):
    import csv

    from trainscale.report.build import write_report

    write_report([runs], tmp_path / "report")
    with open(tmp_path / "report" / "results.csv", newline="") as f:
        return {r["run_id"]: (r["status"], r["error"]) for r in csv.DictReader(f)}


def test_report_counts_a_corrupt_summary_as_corrupt_never_ok_and_names_it_once(tmp_path, warnings_seen):
    from tests.unit.test_report_tables import make_run

    make_run(tmp_path / "runs" / "good")
    (make_run(tmp_path / "runs" / "torn") / "summary.json").write_text('{"model": "mlp", "epo')
    (make_run(tmp_path / "runs" / "empty") / "summary.json").write_text("{}")
    statuses = report_status(tmp_path, tmp_path / "runs")
    assert statuses["good"][0] == "ok" and statuses["empty"][0] == "incomplete"
    assert statuses["torn"][0] == "corrupt" and "torn/summary.json is not valid JSON" in statuses["torn"][1]
    named = [r for r in warnings_seen.records if "torn/summary.json" in r.getMessage()]
    assert len(named) == 1 and named[0].levelname == "WARNING"
    assert "torn/summary.json is not valid JSON" in (tmp_path / "report" / "results.md").read_text()


@pytest.mark.parametrize(
    "file, change, said",
    [
        ("summary.json", {"environment": "x"}, "environment is str 'x', not dict"),
        ("summary.json", {"world_size": "x"}, "world_size is str 'x', not int"),
        ("summary.json", {"world_size": float("nan")}, "world_size is float nan, not int"),
        ("summary.json", {"epochs": float("inf")}, "epochs is inf, not a finite number"),
        ("metrics.jsonl", {"test_acc": [1]}, "row 2: test_acc is list [1], not float"),
    ],
)
def test_report_counts_a_summary_or_metrics_value_trainscale_never_writes_as_corrupt(tmp_path, file, change, said):
    """Edited or damaged values (a bare NaN that only Python's json writes, a string for a number, an object
    that is not one) crashed the tables with a traceback, after the previous report had been deleted."""
    import json

    from tests.unit.test_report_tables import make_run

    make_run(tmp_path / "runs" / "good")
    path = make_run(tmp_path / "runs" / "bad") / file
    if file == "summary.json":
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows[1].update(change)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    statuses = report_status(tmp_path, tmp_path / "runs")
    assert statuses["good"][0] == "ok"
    assert statuses["bad"][0] == "corrupt" and said in statuses["bad"][1], statuses["bad"]


def test_a_report_that_fails_leaves_the_previous_one_whole_and_a_new_folder_unmade(tmp_path, monkeypatch):
    from tests.unit.test_report_tables import make_run
    from trainscale.report import build

    make_run(tmp_path / "runs" / "good")
    out = tmp_path / "report"
    build.write_report([tmp_path / "runs"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def failing(report):
        raise RuntimeError("stopped while writing")

    monkeypatch.setattr(build, "render_html", failing)
    for target in (out, tmp_path / "new" / "report"):
        with pytest.raises(RuntimeError, match="stopped while writing"):
            build.write_report([tmp_path / "runs"], target)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report", "runs"]  # no stage, no new folder


def test_report_reads_metrics_with_a_torn_last_line_and_names_a_bad_line_inside(tmp_path, warnings_seen):
    from tests.unit.test_report_tables import make_run

    torn = make_run(tmp_path / "runs" / "torn") / "metrics.jsonl"
    torn.write_text(torn.read_text() + '{"epoch": 4, "lr')
    inside = make_run(tmp_path / "runs" / "inside") / "metrics.jsonl"
    lines = inside.read_text().splitlines()
    inside.write_text("\n".join([lines[0], '{"epoch": 2, "lr', *lines[2:]]) + "\n")
    statuses = report_status(tmp_path, tmp_path / "runs")
    assert statuses["torn"][0] == "ok"
    assert statuses["inside"] == ("corrupt", f"{inside}:2 is not valid JSON; the file is corrupt: restore or delete it")
    assert (
        len([r for r in warnings_seen.records if "torn/metrics.jsonl: ignoring a torn last line" in r.getMessage()])
        == 1
    )


def test_report_tolerates_a_torn_ledger_line_and_refuses_a_corrupt_ledger_or_grid_json(tmp_path):
    from tests.unit.test_report_tables import make_grid_dir

    out, specs = make_grid_dir(tmp_path)
    ledger = out / "grid.jsonl"
    good = ledger.read_text()
    ledger.write_text(good + '{"run_id": "x", "sta')
    assert report_status(tmp_path, out)[specs[2].run_id][0] == "failed"
    ledger.write_text('{"run_id": "x", "sta\n' + good)
    with pytest.raises(DataError, match=r"grid.jsonl:1 is not valid JSON"):
        report_status(tmp_path, out)
    ledger.write_text(good)
    (out / "grid.json").write_text('{"name": "handmade", "runs": [')
    with pytest.raises(DataError, match=r"results/grid.json is not valid JSON"):
        report_status(tmp_path, out)


def test_an_append_after_a_torn_line_cuts_it_off_instead_of_burying_it(tmp_path):
    from trainscale.io import append_jsonl, read_jsonl

    ledger = tmp_path / "grid.jsonl"
    append_jsonl(ledger, {"run": 1})
    with open(ledger, "a") as f:
        f.write('{"run": 2, "sta')  # an append interrupted mid-line
    append_jsonl(ledger, {"run": 3})
    assert read_jsonl(ledger) == [{"run": 1}, {"run": 3}]


def one_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run folder name of the test made in one second (other uses of the clock, logging's, untouched)."""
    real = time.strftime
    monkeypatch.setattr(
        time, "strftime", lambda fmt, *t: "20260101-000000" if fmt == "%Y%m%d-%H%M%S" else real(fmt, *t)
    )


def test_runs_of_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    """Without --out, a run whose default name a run of the same second has (a sweep of short `trainscale.fit`
    calls; before, the second was refused: "already holds a run") gets `-2`, `-3`...; a job that takes a name
    another took between the look and the make (started at the same time) takes the next; a job that wrote
    nothing leaves none of the folders made for it."""
    from trainscale.train import setup

    monkeypatch.chdir(tmp_path)
    one_second(monkeypatch)
    config = build_config({"model": "mlp"})
    base = tmp_path / "runs" / "mlp-cifar10-20260101-000000"
    with setup.claimed_out(config) as first:
        (first / "summary.json").write_text("{}")
        assert setup.default_out_dir(config) == base.relative_to(tmp_path).with_name(f"{base.name}-2")
        assert setup.default_out_dir(config, free=False) == first  # another process of the job: main's choice
        with setup.claimed_out(config) as second:
            assert second.name == f"{base.name}-2" and second.is_dir()
        assert not second.exists()  # made here, nothing written: removed
        real_lexists = setup.os.path.lexists
        monkeypatch.setattr(setup.os.path, "lexists", lambda p: real_lexists(p) and p != Path(f"{first}-2"))
        (tmp_path / f"{first}-2").mkdir()  # made by another job after this one found the name free
        with setup.claimed_out(config) as third:
            assert third.name == f"{base.name}-3"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [base.name, f"{base.name}-2"]
    with setup.claimed_out(build_config({"model": "mlp", "out": "given"})) as given:
        assert given == Path("given") and not given.exists()  # --out: made (and locked) by the run itself


def test_a_run_that_wrote_nothing_leaves_no_runs_folder(tmp_path, monkeypatch):
    from trainscale.train.setup import claimed_out

    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError), claimed_out(build_config({"model": "mlp"})) as out:
        assert out.is_dir()
        raise RuntimeError
    assert not list(tmp_path.iterdir())


def test_a_sweep_of_fits_in_one_second_keeps_every_run(tmp_path, monkeypatch):
    import trainscale

    monkeypatch.chdir(tmp_path)
    one_second(monkeypatch)
    small = {"model": "mlp", "dataset": "synthetic", "train_subset": 128, "test_subset": 64, "epochs": 1}
    outs = [trainscale.fit(**small, lr=lr).out for lr in (0.1, 0.2)]
    assert [Path(o).name for o in outs] == ["mlp-synthetic-20260101-000000", "mlp-synthetic-20260101-000000-2"]
    assert all((Path(o) / "summary.json").exists() for o in outs)
