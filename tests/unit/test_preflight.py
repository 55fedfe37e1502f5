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
from trainscale.app.launch import prepared
from trainscale.app.preflight import preflight
from trainscale.errors import TrainscaleError

SMALL = {"dataset": "synthetic", "model": "mlp", "train_subset": 256, "test_subset": 128, "batch_size": 32}


def refusal(check: Callable[[], Any]) -> str:
    with pytest.raises(TrainscaleError) as caught:
        check()
    return str(caught.value)


def launch_checks(cfg: Any) -> None:
    """What the launcher of several workers checks before any of them starts."""
    with prepared(cfg):
        pass


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
        launcher = launch_checks if workers > 1 else functools.partial(preflight, data=False)
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

    from trainscale.app.launch import job_temp_folder
    from trainscale.runtime import tempdir

    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TMPDIR", "/tmp")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with job_temp_folder() as folder:
        assert os.environ["TMPDIR"] == str(folder) and folder.parent == Path("/tmp")
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith("/tmp/torchinductor_")  # not in the job's folder
        (folder / "left-by-a-worker").write_text("x")
    assert not folder.exists() and os.environ["TMPDIR"] == "/tmp" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    deep = tmp_path / ("d" * tempdir.SOCKET_FOLDER_MAX)  # too deep for the Unix sockets made in it
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)
    with job_temp_folder() as folder:  # so the job's is made in /tmp, and handed down
        assert os.environ["TMPDIR"] == str(folder) and folder.parent == Path("/tmp")
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(deep))  # the cache keeps its usual place
        with job_temp_folder(folder) as inner:  # a replica's goes in its launcher's, gone with it if killed
            assert inner.parent == folder and os.environ["TMPDIR"] == str(inner)
    assert not folder.exists() and os.environ["TMPDIR"] == str(deep)
    with job_temp_folder(deep) as folder:  # a parent given too deep: kept (the folder goes with it), not handed down
        assert folder.parent == deep and os.environ["TMPDIR"] == str(deep)
    monkeypatch.setattr(tempdir, "SHORT_TEMP", str(tmp_path / "none"))  # no short folder to be had: as it was
    with job_temp_folder() as folder:
        assert os.environ["TMPDIR"] == str(deep) and folder.parent == deep


SHORT_FOR_ITS_RUN = """
import multiprocessing.util, os, tempfile
from trainscale.runtime.tempdir import socket_safe_tempdir
deep = tempfile.gettempdir()
with socket_safe_tempdir():
    inside = tempfile.gettempdir()
    pymp = multiprocessing.util.get_temp_dir()  # where a DataLoader's workers make their sockets
    print(inside, pymp, os.environ["TMPDIR"], os.environ["TORCHINDUCTOR_CACHE_DIR"])
assert tempfile.gettempdir() == os.environ["TMPDIR"] == deep and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
"""


def test_a_run_in_one_process_under_a_deep_tmpdir_trains_with_a_short_folder_gone_at_exit(tmp_path):
    """Its DataLoader workers' sockets fit there; torch's compiler cache stays where it would be."""
    import os
    import subprocess
    import sys

    from trainscale.runtime.tempdir import SOCKET_FOLDER_MAX

    deep = tmp_path / ("d" * SOCKET_FOLDER_MAX)
    deep.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, "-c", SHORT_FOR_ITS_RUN], capture_output=True, text=True, env={**env, "TMPDIR": str(deep)}
    )
    assert done.returncode == 0 and not done.stderr, done.stderr
    inside, pymp, tmpdir, cache = done.stdout.split()
    assert Path(inside).parent == Path("/tmp") and tmpdir == inside and Path(pymp).parent == Path(inside)
    assert cache.startswith(str(deep / "torchinductor_"))
    assert not Path(inside).exists() and list(deep.iterdir()) == []
