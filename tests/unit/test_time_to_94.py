"""``benchmarks/time_to_94.py``: a finished seed is reused, an interrupted one runs again from its start with its
folder kept beside (a timed run cannot continue in another process); ``--one-process`` fits each seed in the
benchmark's process."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.scripts import load_benchmark

t94 = load_benchmark("time_to_94")

FINISHED = {"reference_scope": {"test_acc": 0.94, "seconds": 1.0}, "out": "x"}
SUMMARY = {  # what a finished seed's summary.json holds of what the benchmark reads
    "reference_scope": {"test_acc": 0.94, "seconds": 1.5, "scope": "airbench's"},
    "out": "x",
    "total_train_seconds": 1.4,
    "data_init_seconds": 0.02,
    "eval_forward": "compiled",
    "steady_epoch_seconds": 0.17,
    "precision": "bf16",
}


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The commands run_seed launches; each 'run' writes a finished summary where --out points."""
    calls: list[list[str]] = []

    def run(cmd: list[str]) -> Any:
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)  # the CLI refuses a folder that holds a run: it must be gone by now
        (out / "summary.json").write_text(json.dumps(FINISHED))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(t94, "run_child", run)
    return calls


@pytest.fixture
def series(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A series through ``main`` with each seed's `trainscale train` replaced by one that writes ``SUMMARY``:
    ``started`` lists the seeds in the order they started; the first start of seed ``stop_at`` is stopped as a
    time limit stops the benchmark. The settings' own check and the machine's description are left out (their own
    tests are below)."""
    state = SimpleNamespace(started=[], stop_at=None)

    def run(cmd: list[str]) -> Any:
        seed = int(cmd[cmd.index("--seed") + 1])
        state.started.append(seed)
        if seed == state.stop_at and state.started.count(seed) == 1:
            raise KeyboardInterrupt  # the limit's signal, as the benchmark meets it
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "summary.json").write_text(json.dumps(SUMMARY))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(t94, "run_child", run)
    monkeypatch.setattr(t94, "environment", lambda device: {"cpu": "a CPU", "cpu_count": 2})
    monkeypatch.setattr(t94, "check_run", lambda flags: None)
    return state


def test_a_finished_seed_is_reused(tmp_path: Path, launched: list[list[str]]) -> None:
    out = tmp_path / "seed-0"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps(FINISHED))
    assert t94.run_seed(out, "speedrun94", 0, "cpu", "bf16", {}) == FINISHED
    assert launched == []


def test_an_interrupted_seed_runs_again_and_its_folder_is_kept(tmp_path: Path, launched: list[list[str]]) -> None:
    out = tmp_path / "seed-3"
    out.mkdir()
    (out / "config.json").write_text("{}")  # started, never finished: no summary with a reference scope
    (out / "summary.json").write_text(json.dumps({"epochs_completed": 2}))
    assert t94.run_seed(out, "speedrun94", 3, "cpu", "bf16", {"epochs": 2}) == FINISHED
    assert len(launched) == 1 and "--epochs" in launched[0]
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("seed-3.interrupted-")]
    assert len(kept) == 1 and json.loads((kept[0] / "summary.json").read_text()) == {"epochs_completed": 2}


def test_a_stopped_series_leaves_the_figures_of_the_seeds_it_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, series: SimpleNamespace
) -> None:
    """A time limit that stops the benchmark in its third seed: result.json holds the first two, marked
    incomplete and not meeting the goal (a goal is over the runs asked for); the next invocation reuses them."""
    series.stop_at = 2
    argv = ["time_to_94.py", "--recipe", "cifar10-fast", "--runs", "3", "--out", str(tmp_path)]  # its goal: accuracy
    monkeypatch.setattr(t94.sys, "argv", argv)
    with pytest.raises(KeyboardInterrupt):
        t94.main()
    partial = json.loads((tmp_path / "result.json").read_text())
    assert (partial["complete"], partial["runs_done"], partial["runs_asked"]) == (False, 2, 3)
    assert [r["seed"] for r in partial["runs"]] == [0, 1] and partial["runs"][0]["steady_epoch_seconds"] == 0.17
    first = partial["runs"][0]  # the scope's other two parts, apart: where a run's time beyond its steps goes
    assert first["data_init_seconds"] == 0.02 and first["final_eval_seconds"] == pytest.approx(0.08)
    assert first["eval_forward"] == "compiled"
    assert partial["reference_seconds_mean"] == 1.5 and partial["precision"] == "bf16" and not partial["goal_met"]
    assert t94.main() == 0
    done = json.loads((tmp_path / "result.json").read_text())
    assert (done["complete"], done["runs_done"], done["goal_met"]) == (True, 3, True) and series.started == [0, 1, 2, 2]


def test_one_process_fits_each_seed_here_with_fresh_compile_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--one-process``: a seed through ``trainscale.fit`` with the CLI's settings and the ``--set`` ones, after
    torch.compile's in-memory caches are cleared; a finished seed is reused, as through the CLI."""
    import trainscale

    calls: list[dict[str, Any]] = []
    resets: list[int] = []

    class Fitted:
        summary = FINISHED

    def fit(**settings: Any) -> Fitted:
        calls.append(settings)
        return Fitted()

    monkeypatch.setattr(trainscale, "fit", fit)
    monkeypatch.setattr(t94.torch._dynamo, "reset", lambda: resets.append(len(calls)))
    out = tmp_path / "seed-4"
    settings = {"epochs": 2, "model_args": ["pool=max"]}
    assert t94.run_seed_here(out, "speedrun94", 4, "cuda", "auto", settings) == FINISHED
    assert calls == [
        dict(recipe="speedrun94", seed=4, device="cuda", precision="auto", target_acc=t94.TARGET, progress=False,
             out=str(out), epochs=2, model_args=["pool=max"])
    ]  # fmt: skip
    assert resets == [0]
    out.mkdir()
    (out / "summary.json").write_text(json.dumps(FINISHED))
    assert t94.run_seed_here(out, "speedrun94", 4, "cuda", "auto", {}) == FINISHED and len(calls) == 1


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--set", "nosuchkey=1"], "argument --set: nosuchkey=1: unknown key 'nosuchkey'; --set takes the `trainscale"),
        (["--set", "epochs=x"], "argument --set: epochs=\"x\": 'epochs' must be float, got 'x'"),
        (["--set", "epochs=2", "--set", "epochs=3"], "--set epochs=3: 'epochs' is given twice with --set; keep one"),
        (["--device", "mps"], "argument --device: --device 'mps' is not supported; use auto, cpu, cuda or cuda:N"),
    ],
)
def test_a_bad_set_is_one_line_before_any_seed_runs(argv, line, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(t94, "run_seed", lambda *a: pytest.fail("a seed ran"))
    monkeypatch.setattr(t94.sys, "argv", ["time_to_94.py", *argv, "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as stopped:
        t94.main()
    assert stopped.value.code == 2 and line in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--set", "epochs=0"], "--epochs must be a positive number, got 0"),
        (["--precision", "fp8"], "--precision"),
    ],
)
def test_settings_a_run_would_refuse_are_refused_before_the_first_seed(argv, line, tmp_path, monkeypatch) -> None:
    """What every seed's `trainscale train` would refuse (a value out of range, a device or precision it does not
    know) is trainscale's one line from the script, before a seed or the machine's description is taken."""
    monkeypatch.setattr(t94, "run_seed", lambda *a: pytest.fail("a seed ran"))
    monkeypatch.setattr(t94, "environment", lambda device: pytest.fail("the machine was described"))
    monkeypatch.setattr(t94.sys, "argv", ["time_to_94.py", *argv, "--out", str(tmp_path / "out")])
    with pytest.raises(t94.TrainscaleError, match=line):
        t94.main()
    assert not (tmp_path / "out").exists()


def test_the_first_seed_checked_is_the_first_not_yet_run(tmp_path) -> None:
    args = t94.argparse.Namespace(
        recipe="airbench94", runs=3, first_seed=0, device="cpu", precision="auto", out=tmp_path
    )
    (tmp_path / "seed-0").mkdir()
    assert t94.first_run(args, {"epochs": 2}) == dict(
        recipe="airbench94", seed=0, device="cpu", precision="auto", target_acc=t94.TARGET, progress=False,
        out=str(tmp_path / "seed-1"), epochs=2,
    )  # fmt: skip
    for seed in (1, 2):
        (tmp_path / f"seed-{seed}").mkdir()
    assert "out" not in t94.first_run(args, {})


def test_first_seed_runs_the_seeds_after_it(tmp_path, monkeypatch, series) -> None:
    """``--first-seed 5 --runs 2``: seeds 5 and 6, each in its own folder, and result.json says where it began."""
    argv = ["--recipe", "cifar10-fast", "--runs", "2", "--first-seed", "5", "--out", str(tmp_path)]
    monkeypatch.setattr(t94.sys, "argv", ["time_to_94.py", *argv])
    assert t94.main() == 0
    assert series.started == [5, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json", "seed-5", "seed-6"]
    done = json.loads((tmp_path / "result.json").read_text())
    assert done["first_seed"] == 5 and [r["seed"] for r in done["runs"]] == [5, 6] and done["complete"]


def test_a_failed_seed_is_one_line_with_the_status_its_run_gave(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(t94, "run_child", lambda cmd: subprocess.CompletedProcess(cmd, 2))
    with pytest.raises(SystemExit, match=r"^seed 1: `trainscale train` exited with status 2 \(its own message"):
        t94.run_seed(tmp_path / "seed-1", "airbench94", 1, "cpu", "auto", {})


def test_a_refused_seed_in_this_process_is_one_line_and_status_2(tmp_path, monkeypatch, capsys) -> None:
    import trainscale
    from trainscale.errors import ConfigError

    def fit(**settings: Any) -> Any:
        raise ConfigError("--epochs must be at least 1")

    monkeypatch.setattr(trainscale, "fit", fit)
    with pytest.raises(SystemExit) as stopped:
        t94.run_seed_here(tmp_path / "seed-0", "airbench94", 0, "cpu", "auto", {"epochs": 0})
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "seed 0: --epochs must be at least 1\n"
