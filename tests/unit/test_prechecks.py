"""Checks that run before anything is created or any worker starts: the model takes the image size, the
output folder can be written, and data is downloaded only into a folder that exists (or the default cache)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import trainscale.data.download as download_mod
from trainscale.app.config import build_config
from trainscale.data import ensure_dataset
from trainscale.errors import ConfigError
from trainscale.io import check_folder_writable
from trainscale.models import create_model, list_models, model_info
from trainscale.train.setup import check_model_input


def real_forward_fails(name: str, size: int) -> bool:
    torch.manual_seed(0)
    model = create_model(name)
    try:
        with torch.no_grad():
            model(torch.zeros(2, 3, size, size))
    except (RuntimeError, ValueError):
        return True
    return False


@pytest.mark.parametrize("name", list_models())
def test_every_model_takes_its_own_input_size(name):
    size = model_info(name).input_size
    check_model_input(build_config({"model": name, "image_size": size}))
    check_model_input(build_config({"model": name}))


@pytest.mark.parametrize("size", [8, 16])
@pytest.mark.parametrize("name", list_models())
def test_the_image_size_check_agrees_with_a_real_forward(name, size):
    cfg = build_config({"model": name, "image_size": size})
    if real_forward_fails(name, size):
        with pytest.raises(ConfigError, match=rf"--image-size {size}: model {name} cannot take {size}x{size} images"):
            check_model_input(cfg)
    else:
        check_model_input(cfg)


def test_a_size_the_model_cannot_take_says_what_to_do():
    with pytest.raises(ConfigError, match=r"mlp cannot take 16x16 images .*leave --image-size out for its 32x32"):
        check_model_input(build_config({"model": "mlp", "image_size": 16}))


def test_an_out_folder_under_a_file_is_refused_and_nothing_is_made(tmp_path):
    (tmp_path / "file.txt").write_text("keep")
    with pytest.raises(ConfigError, match=r"--out .*file.txt/a/run: cannot write there \(.*file.txt is a file\)"):
        check_folder_writable(tmp_path / "file.txt" / "a" / "run")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        check_folder_writable(tmp_path / "file.txt", "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]
    assert (tmp_path / "file.txt").read_text() == "keep"


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux sysfs (no files can be made in it)")
def test_a_place_nobody_can_write_is_refused_even_as_root():
    with pytest.raises(ConfigError, match=r"--out /sys/trainscale-run: cannot write there \(.+: /sys/trainscale-run"):
        check_folder_writable(Path("/sys/trainscale-run"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only (0555) folder anyway")
def test_a_read_only_folder_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match=r"cannot write there \(Permission denied"):
            check_folder_writable(locked / "run")
    finally:
        locked.chmod(0o755)


def test_a_writable_place_passes_and_the_probe_leaves_nothing(tmp_path):
    check_folder_writable(tmp_path / "new" / "deep" / "run")
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    check_folder_writable(tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []


@pytest.fixture
def no_download(monkeypatch):
    """Any download attempt fails the test: the refusal must come before network access."""
    calls = []

    def fail(*args, **kwargs):
        calls.append(args)
        raise AssertionError(f"download attempted: {args}")

    monkeypatch.setattr(download_mod, "download_dataset", fail)
    monkeypatch.setattr(download_mod, "fetch_url", fail)
    return calls


def test_a_mistyped_data_dir_is_refused_before_any_download(tmp_path, no_download):
    typo = tmp_path / "dtaa" / "cifar"
    with pytest.raises(
        ConfigError,
        match=rf"--data-dir {typo} does not exist; fix the path, or create the folder "
        rf"\(mkdir -p {typo}\).*`trainscale data download --dataset cifar10",
    ):
        ensure_dataset("cifar10", typo, download=True, verify=False)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="afile is a file, not a folder"):
        ensure_dataset("cifar10", tmp_path / "afile", download=True, verify=False)
    assert not (tmp_path / "dtaa").exists() and no_download == []


def test_a_missing_trainscale_data_folder_is_refused_too(tmp_path, monkeypatch, no_download):
    monkeypatch.setenv("TRAINSCALE_DATA", str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"\$TRAINSCALE_DATA .*nope does not exist"):
        ensure_dataset("cifar10", None, download=True, verify=False)
    assert not (tmp_path / "nope").exists() and no_download == []


def test_downloads_go_into_an_existing_folder_or_the_default_cache(tmp_path, monkeypatch):
    roots = []
    monkeypatch.setattr(download_mod, "download_dataset", lambda name, root: roots.append(Path(root)) or root)
    (tmp_path / "data").mkdir()
    ensure_dataset("cifar10", tmp_path / "data", download=True, verify=False)
    monkeypatch.delenv("TRAINSCALE_DATA", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    ensure_dataset("cifar10", None, download=True, verify=False)
    assert roots == [tmp_path / "data", tmp_path / "home" / ".cache" / "trainscale"]


SHORT = {"model": "mlp", "dataset": "synthetic", "train_subset": 512, "test_subset": 64, "epochs": 2, "batch_size": 64}


def dry_preflight(tmp_path: Path, **settings: object) -> None:
    from trainscale.app.preflight import preflight

    preflight(build_config({**SHORT, "out": str(tmp_path / "run"), **settings}), dry=True)


@pytest.mark.parametrize(
    "settings, fragment",
    [  # 2 workers of 32 images on 512: 8 steps an epoch, 16 in the run
        ({"mode": "diloco", "workers": 2, "sync_every": 9}, r"--sync-every 9 is longer than an epoch \(8 steps"),
        ({"mode": "localsgd", "workers": 2, "sync_every": 100000}, "give --sync-every 1..8"),
        ({"mode": "ma", "servers": 1, "workers": 2, "average_every": 9}, r"--average-every 9 is longer than an epoch"),
        (
            {"mode": "sync", "workers": 2, "fault_tolerance": True, "inject_fault": ["kill:1@17"]},
            r"kill:1@17: the run has only 16 committed steps",
        ),
        (
            {"mode": "diloco", "workers": 2, "fault_tolerance": True, "inject_fault": ["kill:1@3,hang:0@100"]},
            "hang:0@100: the run has only 16 committed steps",
        ),
        (  # a worker may train every batch of the epoch (hand-overs, warm start): 2 x 16
            {"mode": "async", "servers": 1, "workers": 2, "inject_fault": ["kill:1@33"]},
            r"kill:1@33: the run has only 32 steps \(pushes\)",
        ),
    ],
)
def test_a_period_or_fault_the_run_never_reaches_is_refused_by_the_dry_run(tmp_path, settings, fragment):
    with pytest.raises(ConfigError, match=fragment):
        dry_preflight(tmp_path, **settings)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "settings",
    [
        {"mode": "diloco", "workers": 2, "sync_every": 8},
        {"mode": "diloco", "workers": 2},  # the default 8 (a shorter epoch would simply end with a round)
        {"mode": "sync", "workers": 2, "fault_tolerance": True, "inject_fault": ["kill:1@16"]},
        {"mode": "async", "servers": 1, "workers": 2, "inject_fault": ["kill:1@32"]},
        {"mode": "ma", "servers": 1, "workers": 2, "average_every": 8},
    ],
)
def test_the_last_reachable_period_and_step_pass(tmp_path, settings):
    dry_preflight(tmp_path, **settings)
