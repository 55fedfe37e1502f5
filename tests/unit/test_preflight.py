"""One pre-flight: the dry run, a run in this process, the launcher on this machine and the emulated-cluster
launcher refuse the same wrong settings with the same line, before any worker starts and writing nothing."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from trainscale.app.cluster_launch import cluster_main
from trainscale.app.config import build_config
from trainscale.app.dryrun import dry_run
from trainscale.app.launch import prepare
from trainscale.app.preflight import preflight
from trainscale.errors import TrainscaleError

SMALL = {"dataset": "synthetic", "model": "mlp", "train_subset": 256, "test_subset": 128, "batch_size": 32}


def refusal(check: Callable[[], Any]) -> str:
    with pytest.raises(TrainscaleError) as caught:
        check()
    return str(caught.value)


def wrong_settings(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """Settings that pass ``build_config`` but that no run may start with."""
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "empty").mkdir()
    held = tmp_path / "held"
    held.mkdir()
    (held / "summary.json").write_text("{}")
    cases = {
        "image size the model cannot take": {"model": "resnet9", "image_size": 4},
        "run folder is a file": {"out": str(tmp_path / "file")},
        "run folder holds a run": {"out": str(held)},
        "resume of nothing": {"out": str(tmp_path / "empty"), "resume": True},
        "baseline without a summary": {"baseline": str(tmp_path / "empty")},
        "batch larger than a shard": {"train_subset": 40, "batch_size": 64},
    }
    if not torch.cuda.is_available():
        cases["nccl on the CPU"] = {"backend": "nccl"}
    return cases


@pytest.mark.parametrize("workers", [1, 2])
def test_dry_run_and_every_launcher_refuse_alike(tmp_path: Path, workers: int) -> None:
    for name, values in wrong_settings(tmp_path).items():
        cfg = build_config({**SMALL, "out": str(tmp_path / "run"), "workers": workers, **values})
        line = refusal(functools.partial(dry_run, cfg))
        launcher = prepare if workers > 1 else functools.partial(preflight, data=False)
        if workers > 1 or "shard" not in name:  # one process checks its shard as it loads the data
            assert refusal(functools.partial(launcher, cfg)) == line, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "held"]  # nothing written


def test_a_cluster_run_and_its_dry_run_refuse_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINSCALE_CLUSTER_STATE", str(tmp_path / "state"))
    cfg = build_config({**SMALL, "cluster": "nosuch", "workers": 2})
    line = refusal(lambda: dry_run(cfg))
    assert refusal(lambda: cluster_main(cfg)) == line
    assert "no cluster named 'nosuch'" in line or "trainscale cluster needs" in line


def test_a_cluster_dry_run_checks_the_mode_against_the_clusters_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica numbers are bounded only once the hosts are known: the dry run refuses them as the run does."""
    pytest.importorskip("torchft")
    import trainscale.app.preflight as module

    monkeypatch.setattr(module, "check_cluster", lambda name: {"name": name, "hosts": 2})
    cfg = build_config(
        {
            **SMALL,
            "cluster": "fake",
            "mode": "sync",
            "fault_tolerance": True,
            "inject_fault": ["kill:5@3"],
            "out": str(tmp_path / "run"),
        }
    )
    line = refusal(lambda: dry_run(cfg))
    assert "there are only 2 replicas" in line
    assert refusal(lambda: cluster_main(cfg)) == line


def test_a_jobs_temporary_files_go_to_a_folder_of_the_launcher_that_goes_with_it(monkeypatch, tmp_path):
    import os
    import tempfile

    from trainscale.app.launch import SOCKET_FOLDER_MAX, job_temp_folder

    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TMPDIR", "/tmp")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with job_temp_folder() as folder:
        assert os.environ["TMPDIR"] == str(folder) and folder.parent == Path("/tmp")
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith("/tmp/torchinductor_")  # not in the job's folder
        (folder / "left-by-a-worker").write_text("x")
    assert not folder.exists() and os.environ["TMPDIR"] == "/tmp" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    deep = tmp_path / ("d" * SOCKET_FOLDER_MAX)  # too deep for the Unix sockets made in it: left as it was
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)
    with job_temp_folder() as folder:
        assert os.environ["TMPDIR"] == str(deep) and folder.parent == deep
