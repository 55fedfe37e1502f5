"""A user's model and data, defined outside trainscale (``tests/userpkg``) and given by import path, trained through
the CLI in every kind of job: in this process, on 2 workers, under the parameter server, with fault tolerance and
on 2 emulated hosts; and a model that imports in the launcher but not in a worker fails with one line naming the
worker and the import error. Tiny model, 512 images of 16x16, one epoch: each run is seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.cli import run_cli
from tests.integration.test_cluster import cli, cluster_names  # noqa: F401  (the fixture that cleans clusters up)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]  # the user's working folder: `tests.userpkg` imports from here
TINY = "tests.userpkg.nets:tiny"
TENSORS = "tests.userpkg.data:tensors"
DATASETS = "tests.userpkg.data:datasets"
USER = ("--model", TINY, "--model-arg", "width=6", "--epochs", "1", "--batch-per-worker", "64", "--no-progress")


def summary_of(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def check_run(folder: Path, dataset: str, world: int) -> None:
    summary = summary_of(folder)
    assert (summary["model"], summary["dataset"], summary["world_size"]) == (TINY, dataset, world)
    assert summary["params"] == 3 * 6 * 9 + 6 + 6 * 4 + 4  # width 6 reached every process; 4 classes from the data
    assert summary["epochs_completed"] == 1 and summary["final_test_acc"] > 0.4  # 4 classes: chance is 0.25
    config = json.loads((folder / "config.json").read_text())
    assert config["model_args"] == ["width=6"] and config["resolved"]["image_size"] == 16


def test_user_model_and_data_train_locally_on_workers_under_the_parameter_server_and_fault_tolerant(
    tmp_path: Path,
) -> None:
    """The user's Datasets reach worker processes, and their DataLoader's worker process, in the fault-tolerant
    run (2 workers, each an elastic agent's child); plain sync on 2 workers is the 2-host cluster test's run (a
    separate sync run on 2 local workers here cost 7 s of the suite and proved nothing these two do not)."""
    runs = {
        "local": (TENSORS, 1, ()),
        "async": (TENSORS, 2, ("--workers", "2", "--mode", "async", "--servers", "1")),
        "ft": (
            DATASETS,
            2,
            ("--workers", "2", "--fault-tolerance", "--batch-per-worker", "32", "--loader-workers", "1"),
        ),
    }
    for name, (dataset, world, flags) in runs.items():
        out = tmp_path / name
        proc = run_cli("train", *USER, "--dataset", dataset, *flags, "--out", out, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        check_run(out, dataset, world if name != "ft" else summary_of(out)["world_size"])


def test_a_model_that_does_not_import_on_a_worker_is_one_line_naming_the_worker(tmp_path: Path) -> None:
    model = "tests.userpkg.broken_on_workers:tiny"
    flags = ("--model", model, "--dataset", TENSORS, "--epochs", "1", "--workers", "2", "--no-progress")
    proc = run_cli("train", *flags, "--out", tmp_path / "run", cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("trainscale train: error: worker rank "), last
    assert "cannot import module 'tests.userpkg.broken_on_workers' (ImportError: No module named 'fancy_lay" in last


def test_a_bug_in_the_users_model_on_the_workers_is_one_traceback_and_one_line(tmp_path: Path) -> None:
    flags = ("--model", "tests.userpkg.nets:explodes", "--dataset", TENSORS, "--epochs", "1", "--workers", "2")
    proc = run_cli("train", *flags, "--no-progress", "--out", tmp_path / "run", cwd=ROOT, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr  # the root cause's, once
    assert 'tests/userpkg/nets.py", line' in proc.stderr and "RuntimeError: my layer exploded" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("trainscale train: error: worker rank ") and "my layer exploded" in last, last
    assert "exitcode" not in proc.stderr  # torch's agent's own notices of the stop are left out


def test_fit_on_several_workers_raises_the_jobs_root_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import trainscale
    from trainscale.api import TrainingFailed

    monkeypatch.chdir(ROOT)  # the workers import tests.userpkg from here, as a user's script's folder
    with pytest.raises(TrainingFailed, match=r"^worker rank \d \(local rank \d\) failed: RuntimeError: my layer"):
        trainscale.fit(
            "tests.userpkg.nets:explodes", dataset=TENSORS, epochs=1, workers=2, progress=False, out=tmp_path / "r"
        )


@pytest.mark.cluster
def test_user_model_and_data_train_on_two_emulated_hosts(
    cluster_names: Callable[[], str],  # noqa: F811
    capsys: pytest.CaptureFixture,
    tmp_path: Path,
) -> None:
    name = cluster_names()
    assert cli(capsys, "up", name, "--hosts", "2", "--bandwidth", "1gbit")[0] == 0
    proc = run_cli("train", "--cluster", name, *USER, "--dataset", TENSORS, "--out", tmp_path / "run", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_run(tmp_path / "run", TENSORS, 2)
    assert summary_of(tmp_path / "run")["cluster"]["hosts"] == 2


def test_the_trainscale_command_imports_a_package_of_the_folder_it_runs_in(tmp_path: Path) -> None:
    """The installed `trainscale` command, not `python -m trainscale`: a console script's ``sys.path`` starts with its
    own folder, so a package beside the user (``my_nets``, in the folder the command runs in) was not found by it
    while ``python -m`` and the workers found it."""
    command = Path(sys.executable).with_name("trainscale")
    if not command.exists():
        pytest.fail(f"no {command}: install the project first (make install)")
    (tmp_path / "my_nets").mkdir()
    (tmp_path / "my_nets" / "__init__.py").write_text("")
    (tmp_path / "my_nets" / "nets.py").write_text(
        "import torch\n\n\ndef build(num_classes=10):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, num_classes))\n"
    )
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != tmp_path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(kept)}
    argv = [str(command), "train", "--model", "my_nets.nets:build", "--dataset", "synthetic", "--dry-run"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"] == "my_nets.nets:build"
