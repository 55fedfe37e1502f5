"""Small runs are small: a synthetic run evaluates 2,000 random test images unless told otherwise, and a batch the
user did not choose that is larger than a tiny --train-subset allows is cut to fit (a chosen one stays, and is then
refused with one line before anything starts)."""

from __future__ import annotations

import pytest

from trainscale.app.config import build_config
from trainscale.errors import ConfigError
from trainscale.train import load_data
from trainscale.train.setup import SYNTHETIC_TEST_SIZE, check_fits


def test_a_synthetic_run_evaluates_a_small_test_set_by_default():
    train, test = load_data(build_config({"model": "mlp", "dataset": "synthetic", "train_subset": 64}))
    assert (len(train), len(test)) == (64, SYNTHETIC_TEST_SIZE) and SYNTHETIC_TEST_SIZE <= 2_000
    _, chosen = load_data(build_config({"model": "mlp", "dataset": "synthetic", "train_subset": 64, "test_subset": 96}))
    assert len(chosen) == 96


@pytest.mark.parametrize("workers, fits", [(1, 100), (3, 99)])
def test_a_default_batch_larger_than_a_tiny_subset_is_cut_to_fit(workers, fits):
    cfg = build_config({"model": "resnet9", "dataset": "synthetic", "train_subset": 100, "workers": workers})
    assert cfg.optim.batch_size == fits  # resnet9's recipe says 512
    assert check_fits(cfg, 100, 32, workers).per_worker == fits // workers


def test_a_batch_the_user_chose_is_kept_and_refused_in_one_line():
    cfg = build_config({"model": "resnet9", "dataset": "synthetic", "train_subset": 100, "batch_size": 512})
    assert cfg.optim.batch_size == 512
    with pytest.raises(ConfigError, match="batch size 512 per worker is larger than the 100 training samples"):
        check_fits(cfg, 100, 32, 1)


def test_a_batch_that_fits_is_untouched():
    assert build_config({"model": "resnet9", "train_subset": 5_000}).optim.batch_size == 512


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_the_missing_data_hint_gives_the_command_that_downloads_that_dataset(tmp_path, name):
    from trainscale.data import ensure_dataset
    from trainscale.errors import DataError

    with pytest.raises(DataError) as err:
        ensure_dataset(name, tmp_path, download=False)
    assert f"run `trainscale data download --dataset {name} --data-dir {tmp_path}`" in str(err.value)


def test_far_more_cpu_workers_than_cores_is_said_once_by_the_launcher():
    from trainscale.runtime.cpus import oversubscription

    assert oversubscription(4, cores=2) is None
    warning = oversubscription(16, cores=2)
    assert warning is not None and warning.startswith("16 worker and server processes share 2 core(s)")
    assert "\n" not in warning
