"""The input pipeline as the planner sees it: a user's dataset read by DataLoader workers, timed alone by
``trainscale profile --input-data``, scaled to a host, and taken by the plan as a floor under each host's step."""

from __future__ import annotations

import dataclasses
import multiprocessing

import pytest
import torch

from tests.unit.test_plan import make_profile
from trainscale.errors import ConfigError
from trainscale.plan.inputs import InputRate, check_input_data, measure_input
from trainscale.plan.plan import PlanConfig, setting_from

DATASETS = "tests.userpkg.data:datasets"


@pytest.mark.parametrize(
    "workers, cores, per_host, expected",
    [
        (2, 8, 1, 100.0),  # the machine measured: the same rate
        (2, 8, 4, 400.0),  # 8 loader processes fit 8 cores: four times the rate
        (2, 8, 8, 400.0),  # 16 do not: the cores are the limit
        (4, 2, 4, 100.0),  # the measurement already filled both cores
        (1, 0.5, 2, 100.0),  # under a CPU quota of half a core: no more to give
    ],
)
def test_a_hosts_input_rate_by_hand(workers, cores, per_host, expected):
    assert InputRate(100.0, workers, cores).host_rate(per_host, cores) == pytest.approx(expected)


def test_the_pipeline_is_timed_and_its_workers_end():
    rate = measure_input(DATASETS, None, workers=1, batch_size=32, count=5, cores=2)
    assert rate.images_per_sec > 0 and (rate.workers, rate.cores) == (1, 2)
    assert multiprocessing.active_children() == []  # the DataLoader's worker process is gone


@pytest.mark.parametrize(
    "path, workers, fragment",
    [
        ("cifar10", 2, "give your dataset's import path"),
        (DATASETS, 0, "give --loader-workers 1 or more"),
    ],
)
def test_what_cannot_be_timed_is_one_line(path, workers, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_input_data(path, workers)


def test_tensors_and_too_few_batches_are_refused():
    with pytest.raises(ConfigError, match="returns tensors"):
        measure_input("tests.userpkg.data:tensors", None, workers=1, batch_size=32, count=5, cores=2)
    with pytest.raises(ConfigError, match="give a smaller --batch-size"):
        measure_input(DATASETS, None, workers=2, batch_size=256, count=5, cores=2)


def _measured(rate: float = 100.0) -> object:
    return dataclasses.replace(make_profile(), input_images_per_sec=rate, input_workers=2, input_cores=8.0)


def test_the_plan_caps_each_host_at_the_measured_pipeline_and_says_so():
    cfg = PlanConfig(hosts=2, workers_per_host=4, bandwidth="1gbit")
    setting, _, origin = setting_from(cfg, _measured())
    assert setting.host_images_per_sec == pytest.approx(400.0)  # 4 processes x 2 workers on 8 cores
    assert "measured by trainscale profile: " in origin and "input pipeline 400 images/s per host" in origin
    plain, _, _ = setting_from(cfg, make_profile())
    assert plain.host_images_per_sec is None


def test_a_flag_or_another_device_wins_over_the_measured_pipeline():
    given = PlanConfig(hosts=2, workers_per_host=4, bandwidth="1gbit", host_images_per_sec=1000.0)
    setting, _, origin = setting_from(given, _measured())
    assert setting.host_images_per_sec == 1000.0 and "input pipeline" not in origin
    other = PlanConfig(hosts=2, workers_per_host=4, bandwidth="1gbit", device_step_ms=50.0)
    setting, _, origin = setting_from(other, _measured())
    assert setting.host_images_per_sec is None and "no input-pipeline limit" in origin


def test_a_slow_pipeline_makes_the_step_no_faster():
    from trainscale.plan.predict import predict

    profile = make_profile()
    cfg = PlanConfig(hosts=2, workers_per_host=4, bandwidth="1gbit")
    free = predict(profile, setting_from(cfg, profile)[0])
    slow = _measured(rate=10.0)
    capped = predict(profile, setting_from(cfg, slow)[0])  # type: ignore[arg-type]
    per_host_images = 4 * profile.batch_size
    assert capped.step_seconds == pytest.approx(max(free.step_seconds, per_host_images / 40.0))
    assert capped.step_seconds >= free.step_seconds


def test_profile_refuses_a_built_in_dataset_before_measuring(main_cli, tmp_path):
    result = main_cli("profile", "--model", "mlp", "--input-data", "cifar10", "--out", tmp_path / "p.json")
    assert result.returncode == 2 and "give your dataset's import path" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    "model, fragment",
    [
        ("tests.unit.test_user_code:frozen", "has no trainable parameters"),
        ("tests.userpkg.nets:not_a_module", "not_a_module returned int"),
        ("tests.unit.test_plan_inputs:too_wide", "cannot take the 3x32x32 images of the profile's synthetic batch"),
        ("mlp --input-data tests.userpkg.data:datasets", "--input-data times the loader over --repeats batches"),
    ],
)
def test_profile_refuses_a_model_it_cannot_time_before_measuring(main_cli, tmp_path, model, fragment):
    result = main_cli("profile", "--model", *model.split(), "--repeats", "1", "--out", tmp_path / "p.json")
    assert result.returncode == 2 and fragment in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "p.json").exists()


def too_wide(num_classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 64 * 64, num_classes))


def test_profile_records_the_pipeline_and_the_plan_says_when_it_binds(tmp_path, capsys):
    from trainscale.plan.cli import run_plan
    from trainscale.plan.profile import ProfileConfig, load_profile, profile_command

    out = tmp_path / "p.json"
    cfg = ProfileConfig(
        model="mlp", batch_size=32, repeats=3, warmup=1, threads=1, overlap=False, input_data=DATASETS, out=str(out)
    )
    profile_command(cfg)
    p = load_profile(out)
    assert p.input_images_per_sec is not None and p.input_images_per_sec > 0 and p.input_workers == 2
    out.write_text(dataclasses.replace(p, input_images_per_sec=1.0, input_cores=2.0).to_json())
    assert run_plan(PlanConfig(profile=str(out), hosts=2, workers_per_host=2, bandwidth="1gbit")) == 0
    text = capsys.readouterr().out
    assert "bound by the host's input pipeline (1 images/s for its 2 worker(s)); without it compute" in text
    assert "2 images/s, scaling efficiency 0.00" in text  # 1 image/s from each of 2 hosts
