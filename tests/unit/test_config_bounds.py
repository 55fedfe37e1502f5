"""Every number setting is finite and in its range, refused in one line before anything starts: from a flag,
a TOML file or a dry run alike (they all build the same config)."""

from __future__ import annotations

import math

import pytest

from trainscale.app.config import FIELDS, TYPES, build_config, load_toml
from trainscale.errors import ConfigError
from trainscale.plan.plan import PlanConfig
from trainscale.plan.profile import ProfileConfig

FLOAT_FIELDS = sorted(  # scalar floats (a list of floats, --milestones, has its own check)
    name for name, hint in TYPES.items() if float in (hint, *getattr(hint, "__args__", ())) and "list" not in str(hint)
)


def test_there_are_float_settings_to_check():
    assert {"lr", "link_down", "ft_timeout", "heartbeat_timeout", "outer_lr", "dist_timeout"} <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_every_float_setting_must_be_finite(name, value):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ConfigError, match=f"^{flag}.* must be a finite number, got"):
        build_config({name: value})


FT = {"mode": "sync", "workers": 2, "fault_tolerance": True}
PS = {"mode": "async", "servers": 1, "workers": 2}


@pytest.mark.parametrize(
    "settings, fragment",
    [
        ({**FT, "link_down": 1e9}, "--link-down must be a positive number and <= 3600"),
        ({**FT, "link_down": -1.0}, "--link-down must be a positive number"),
        ({**FT, "ft_timeout": 1e300}, "--ft-timeout must be a positive number and <= 604800"),
        ({"threads": 100_000}, "--threads must be <= 1024, got 100000"),  # OpenMP crashed on it, no message
        ({**PS, "heartbeat_timeout": 1e300}, "--heartbeat-timeout must be <= 604800"),
        ({**PS, "rpc_timeout": math.inf}, "--rpc-timeout must be a finite number"),
        ({"dist_timeout": 1e12}, "--dist-timeout must be a positive number and <= 604800"),
        ({"rdzv_timeout": -5.0}, "--rdzv-timeout must be a positive number"),
        ({"gamma": 0.0}, "--gamma must be a positive number"),
        ({"lr": 1e300}, "--lr must be within float32's range"),  # finite, but the optimizer's float32 update overflows
        ({"mode": "diloco", "workers": 2, "outer_lr": math.inf}, "--outer-lr must be a finite number"),
        ({"mode": "diloco", "workers": 2, "sync_every": 0}, "--sync-every must be a positive number"),
        ({"mode": "diloco", "workers": 2, "outer_lr": 1e30}, "--outer-lr must be a positive number and <= 2"),
        ({"mode": "diloco", "workers": 2, "outer_lr": 2.5}, "--outer-lr must be a positive number and <= 2"),
        ({"mode": "diloco", "workers": 2, "outer_lr": 0.0}, "--outer-lr must be a positive number"),
        ({"mode": "diloco", "workers": 2, "outer_momentum": 1.0}, r"--outer-momentum must be in \[0, 1\)"),
        ({"mode": "diloco", "workers": 2, "outer_momentum": -0.1}, r"--outer-momentum must be in \[0, 1\)"),
    ],
)
def test_ranges(settings, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("+", r"\+")):
        build_config(settings)


def test_toml_nan_is_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("lr = nan\n")
    with pytest.raises(ConfigError, match="--lr must be a finite number, got nan"):
        build_config(load_toml(path))


@pytest.mark.parametrize(
    "cls, settings, fragment",
    [
        (PlanConfig, {"device_step_ms": math.nan}, "--device-step-ms must be a finite number"),
        (PlanConfig, {"device_step_ms": -1.0}, "--device-step-ms must be a positive number"),
        (PlanConfig, {"sync_every": 0}, "--sync-every must be >= 1"),
        (PlanConfig, {"hosts": 0}, "--hosts must be >= 1"),
        (PlanConfig, {"workers_per_host": 0}, "--workers-per-host must be >= 1"),
        (PlanConfig, {"servers": 0}, "--servers must be >= 1"),
        (ProfileConfig, {"cpus": math.inf}, "--cpus must be a finite number"),
    ],
)
def test_plan_and_profile_settings(cls, settings, fragment):
    with pytest.raises(ConfigError, match=fragment):
        cls(**settings)


def test_fields_are_all_known():
    assert set(FLOAT_FIELDS) <= set(FIELDS)


def test_profile_threads_are_bounded_as_trainings_are(capsys):
    from trainscale.cli import main

    assert main(["profile", "--model", "mlp", "--threads", "100000", "--no-overlap"]) == 2
    assert capsys.readouterr().err == "trainscale profile: error: --threads must be <= 1024, got 100000\n"
