"""benchmarks/chaos.py's pure parts: where the faults go and how the run is judged."""

import pytest

from tests.scripts import load_benchmark

chaos = load_benchmark("chaos")


def test_faults_go_every_t_seconds_at_the_fault_free_step_rate():
    faults = chaos.schedule(steps=600, seconds=300.0, every=60.0, workers=4, kinds=["kill", "hang"], seed=3)
    steps = [int(f.rsplit("@", 1)[1]) for f in faults]
    assert steps == [120, 240, 360, 480]  # 2 steps/s; none in the last 30 s
    assert all(f.split(":")[0] in ("kill", "hang") and 0 <= int(f.split(":")[1].split("@")[0]) < 4 for f in faults)
    assert faults == chaos.schedule(600, 300.0, 60.0, 4, ["kill", "hang"], seed=3)  # the seed decides


def test_link_cuts_never_take_host_0():
    """Replica 0's host serves the lighthouse: every cut goes to another replica's host."""
    faults = chaos.schedule(steps=6000, seconds=3000.0, every=10.0, workers=4, kinds=["link"], seed=0)
    assert len(faults) > 200 and {int(f.split(":")[1].split("@")[0]) for f in faults} == {1, 2, 3}


def fault(steps_lost=1, detection=0.5, recovery=8.0):
    return {
        "kind": "kill",
        "rank": 1,
        "step": 5,
        "steps_lost": steps_lost,
        "detection_seconds": detection,
        "recovery_seconds": recovery,
    }


@pytest.mark.parametrize(
    "faults, kept, equal, met",
    [
        ([fault(), fault(detection=1.9)], 0.9, True, True),
        ([fault(steps_lost=2)], 0.9, True, False),
        ([fault(detection=2.5)], 0.9, True, False),
        ([fault(recovery=None)], 0.9, True, False),  # never healed
        ([fault()], 0.8, True, False),
        ([fault()], 0.9, False, False),
        ([], 1.0, True, False),  # nothing was tested
    ],
)
def test_the_goals(faults, kept, equal, met):
    assert chaos.verdict(faults, kept, equal)["goals_met"] is met


@pytest.mark.parametrize(
    "mode, lost, skipped, met",
    [
        ("async", 1, 0, True),
        ("async", 2, 0, False),
        ("ma", 2, 0, True),  # ma loses the local steps since its last average: up to its period (4 by default)
        ("ma", 5, 0, False),
        ("ps-sync", 1, 3, False),  # a batch no push committed
    ],
)
def test_the_parameter_server_goals(mode, lost, skipped, met):
    result = chaos.ps_verdict([fault(steps_lost=lost)], 0.9, skipped, {"mode": mode})
    assert result["goals_met"] is met and result["batches_skipped"] == skipped


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--every", "nan"], "a finite --every >= 10 s"),
        (["--every", "inf"], "a finite --every >= 10 s"),
        (["--every", "abc"], "invalid float value"),
        (["--workers", "-3"], "--workers >= 2"),
        (["--link-down", "nan"], "--link-down must be a positive number of seconds, at most 3600, got nan"),
        (["--link-down", "1e9"], "--link-down must be a positive number of seconds"),
        (["--ft-timeout", "-1"], "--ft-timeout must be a positive number of seconds"),
        (["--heartbeat-timeout", "1e300"], "--heartbeat-timeout must be a positive number of seconds"),
        (["--bandwidth", "10furlongs"], "--bandwidth must be a rate in bits per second"),
        (["--kinds", "kill,melt"], "--kinds: choose from kill, hang, link"),
        (["--set", "epochs=abc"], "'epochs' must be float"),
        (["--set", "epochs"], "give KEY=VALUE"),
        (["--set", "bogus=1"], "unknown key 'bogus'"),
        (["--seed", "x"], "invalid int value"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        chaos.parse_args(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("chaos.py: error: ") and fragment in error


def test_an_out_path_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("keep")
    with pytest.raises(SystemExit):
        chaos.parse_args(["--out", str(tmp_path / "f")])
    assert "is not a folder" in capsys.readouterr().err
    assert (tmp_path / "f").read_text() == "keep"


def test_good_arguments_carry_the_checked_job_settings():
    args = chaos.parse_args(["--set", "epochs=2", "--set", "mode=async"])
    assert args.settings == {**chaos.JOB, "epochs": 2, "mode": "async"}


def test_the_job_settings_go_through_trains_dry_run_first(tmp_path):
    args = chaos.parse_args(["--set", "epochs=-2", "--out", str(tmp_path / "c")])
    with pytest.raises(chaos.ConfigError, match=r"^the job's settings: --epochs must be a positive number, got -2$"):
        chaos.dry_run(args, chaos.job_settings(args))
    args = chaos.parse_args(["--set", "mode=ps-sync", "--set", "servers=0", "--out", str(tmp_path / "c")])
    with pytest.raises(chaos.ConfigError, match="^the job's settings: --mode ps-sync needs --servers"):
        chaos.dry_run(args, chaos.job_settings(args))
    assert not (tmp_path / "c").exists()


def test_a_job_train_would_run_passes_the_dry_run_and_nothing_is_written(tmp_path, cifar10_dir):
    for sets in ([], ["--set", "mode=ps-sync"]):
        args = chaos.parse_args([*sets, "--set", f"data_dir={cifar10_dir}", "--out", str(tmp_path / "c")])
        chaos.dry_run(args, chaos.job_settings(args))
    assert not (tmp_path / "c").exists()
