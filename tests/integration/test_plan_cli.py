"""`trainscale profile` and `trainscale plan` as a user runs them: a real (tiny) profile, a plan in text and
JSON, a sweep with its plot and crossover table, and one-line errors for bad input. The profile is measured in a
subprocess, as a user runs it; the plans and the refusals run in this process (``main_cli``), without seconds of
interpreter start-up each, except where a regression would block on a FIFO (a subprocess with a timeout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.cli import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "mlp.json"
    proc = run_cli(
        "profile",
        "--model",
        "mlp",
        "--batch-size",
        "8",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--no-overlap",  # measured in tests/unit/test_plan_overlap.py
        "--compress",
        "bf16",
        "topk:ratio=0.01,granularity=entire",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stderr
    assert "mlp at batch 8 (fp32)" in proc.stdout and "topk:ratio=0.01,granularity=entire: encode" in proc.stdout
    return out


def test_plan_json_has_the_promised_keys(main_cli, profile):
    args = ("--hosts", "4", "--bandwidth", "1gbit", "--compress", "bf16", "--json")
    proc = main_cli("plan", "--profile", profile, *args)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    for key in ("step_seconds", "compute_seconds", "comm_seconds", "images_per_sec", "scaling_efficiency"):
        assert plan[key] > 0, key
    assert plan["step_seconds"] == pytest.approx(plan["compute_seconds"] + plan["comm_seconds"])


def test_sweep_prints_a_table_a_crossover_and_draws(main_cli, profile, tmp_path):
    plot = tmp_path / "sweep.png"
    proc = main_cli(
        "plan",
        "--profile",
        profile,
        "--hosts",
        "2",
        "--bandwidth",
        "1gbit",
        "--sweep",
        "workers=1,2,4",
        "bandwidth=10mbit,1gbit",
        "--plot",
        plot,
    )
    assert proc.returncode == 0, proc.stderr
    assert "beats bf16 all-reduce below" in proc.stdout and "topk:ratio=0.01,granularity=entire" in proc.stdout
    assert proc.stdout.count("10mbit") == 3 and plot.is_file()


def test_cluster_file_plan(main_cli, profile):
    proc = main_cli("plan", "--profile", profile, "--cluster", "pslite-gtx980", "--device-step-ms", "20")
    assert proc.returncode == 0, proc.stderr
    assert "5 host(s) x 2 worker(s)" in proc.stdout and "--device-step-ms 20" in proc.stdout


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (("--hosts", "2"), "2 host(s) x 2 worker(s)"),
        (("--workers-per-host", "1"), "5 host(s) x 1 worker(s)"),
        (("--bandwidth", "10gbit"), "10gbit links"),
    ],
)
def test_a_flag_wins_over_the_cluster_file(main_cli, profile, flags, fragment):
    proc = main_cli("plan", "--profile", profile, "--cluster", "pslite-gtx980", "--device-step-ms", "20", *flags)
    assert proc.returncode == 0, proc.stderr
    assert fragment in proc.stdout


def test_a_latency_flag_replaces_the_cluster_files_and_only_slows_the_step(main_cli, profile):
    def step(*flags: str) -> float:
        base = ("plan", "--profile", profile, "--cluster", "pslite-gtx980", "--device-step-ms", "20", "--json")
        proc = main_cli(*base, *flags)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["step_seconds"]

    file_only = step()
    assert step("--latency", "0us") <= file_only < step("--latency", "10ms")
    assert file_only < step("--intra-latency", "10ms") and file_only < step("--intra-bandwidth", "1mbit")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--cluster", "nope"), "unknown cluster 'nope'; known: "),
        (("--hosts", "4", "--bandwidth=-1gbit"), "--bandwidth must be a rate in bits per second such as 25gbit"),
        (("--hosts", "4", "--bandwidth", "1gbit", "--model", "resnet20"), "measured mlp, not --model resnet20"),
        (("--hosts", "4", "--bandwidth", "1gbit", "--compress", "powersgd:rank=2"), "no timings for --compress"),
        (
            (
                "--hosts",
                "4",
            ),
            "--hosts 4 needs --bandwidth",
        ),
        (("--hosts", "1", "--latency", "1ms"), "--latency needs a link: give --bandwidth too"),
        (
            ("--hosts", "1", "--mode", "ps-sync", "--ps-placement", "separate"),
            "--ps-placement separate puts the parameter servers on hosts of their own: give --bandwidth",
        ),
        (
            (
                "--cluster",
                "mxnet-p2-8xlarge",
            ),
            "device k80 has no throughput for model mlp",
        ),
        (("--hosts", "2", "--bandwidth", "1gbit", "--device", "nope"), "unknown device 'nope'"),
        (("--hosts", "2", "--bandwidth", "1gbit", "--sweep", "hosts=2"), "expected workers=1,2,4"),
        (("--hosts", "2", "--bandwidth", "1gbit", "--latency", "fast"), "--latency must look like 50us"),
        (("--hosts", "2", "--bandwidth", "1gbit", "--sweep", "bandwidth="), "give at least one value"),
        (("--hosts", "2", "--bandwidth", "1gbit", "--sweep", "workers=99999999999"), "every count must be 1 to"),
        (("--hosts", "2", "--bandwidth", "1gbit", "--sweep", "workers=1,2", "--plot", "sweep.xyz"), "cannot draw .xyz"),
        (
            ("--hosts", "2", "--bandwidth", "1gbit", "--sweep", "workers=1,2", "--plot", "/proc/sweep.png"),
            "--plot /proc/sweep.png: cannot write there",
        ),
        (("--hosts", "0", "--bandwidth", "1gbit"), "--hosts must be >= 1"),
        (
            ("--hosts", "2", "--bandwidth", "1gbit", "--device-step-ms", "nan"),
            "--device-step-ms must be a finite number",
        ),
        (
            ("--hosts", "2", "--bandwidth", "1gbit", "--mode", "localsgd", "--sync-every", "0"),
            "--sync-every must be >= 1",
        ),
        (("--hosts", "2", "--bandwidth", "1gbit", "--one-host-images-per-sec", "0"), "must be a positive number"),
        (
            ("--hosts", "2", "--bandwidth", "1gbit", "--one-host-images-per-sec", "100", "--step-overhead", "2ms"),
            "or --step-overhead, not both",
        ),
        (
            ("--hosts", "2", "--bandwidth", "1gbit", "--one-host-images-per-sec", "100", "--mode", "async"),
            "cost per step (--mode sync), not --mode async",
        ),
        (("--hosts", "2", "--bandwidth", "1gbit", "--two-host-images-per-sec", "100"), "needs --one-host-images"),
        (
            (
                "--hosts",
                "2",
                "--bandwidth",
                "1gbit",
                "--one-host-images-per-sec",
                "9",
                "--two-host-images-per-sec",
                "-1",
            ),
            "--two-host-images-per-sec must be a positive number",
        ),
        (
            ("--hosts", "4", "--bandwidth", "1gbit", "--efficiency", "0.5")
            + ("--one-host-images-per-sec", "100", "--two-host-images-per-sec", "150"),
            "or --efficiency, not both",
        ),
        (
            ("--hosts", "1", "--one-host-images-per-sec", "100", "--two-host-images-per-sec", "150"),
            "needs the link between hosts: give --bandwidth, or a cluster file with [link.inter]",
        ),
        (
            ("--workers-per-host", "2", "--intra-bandwidth", "1gbit", "--intra-efficiency", "1.5"),
            "--intra-efficiency must be a positive number and <= 1, got 1.5",
        ),
        (
            ("--hosts", "1", "--workers-per-host", "4", "--intra-bandwidth", "1gbit", "--intra-efficiency", "0.5")
            + ("--two-device-images-per-sec", "100"),
            "or --intra-efficiency, not both",
        ),
        (
            ("--hosts", "1", "--workers-per-host", "4", "--two-device-images-per-sec", "100"),
            "give its rate (--intra-bandwidth",
        ),
        (
            ("--hosts", "2", "--bandwidth", "1gbit", "--two-device-images-per-sec", "100"),
            "this plan has one worker per host: give --workers-per-host",
        ),
    ],
)
def test_bad_plan_input_is_one_line(main_cli, profile, args, fragment):
    assert_one_line_error(main_cli("plan", "--profile", profile, *args), fragment)


def test_the_devices_link_at_a_fraction_of_its_rate(main_cli, profile, tmp_path):
    """--intra-efficiency charges that fraction of the link inside a host: a slower plan, said in its first line
    and under a sweep of that link."""
    args = ("--profile", profile, "--hosts", "1", "--workers-per-host", "4", "--intra-bandwidth", "1gbit")
    full = json.loads(main_cli("plan", *args, "--json").stdout)
    quarter = json.loads(main_cli("plan", *args, "--intra-efficiency", "0.25", "--json").stdout)
    assert quarter["framework"]["intra_bits_per_sec"] == pytest.approx(full["framework"]["intra_bits_per_sec"] / 4)
    assert quarter["images_per_sec"] < full["images_per_sec"]
    text = main_cli("plan", *args, "--intra-efficiency", "0.25").stdout
    assert "250mbit links (devices' link at 25.0% of its rate)" in text.splitlines()[0]
    sweep = ("--sweep", "workers=2,4", "bandwidth=1gbit,10gbit", "--plot", str(tmp_path / "sweep.png"))
    swept = main_cli("plan", *args, "--intra-efficiency", "0.25", *sweep).stdout
    assert "bandwidth: the devices' link; the plan charges 25.0% of it" in swept


def test_a_measured_host_sets_the_cost_per_step_of_every_host_count(main_cli, profile):
    """The plan of one host reproduces the measured figure; the plan of four carries the same cost per step."""
    args = ("--profile", profile, "--workers-per-host", "2", "--bandwidth", "1gbit", "--json")
    free = json.loads(main_cli("plan", "--hosts", "1", *args).stdout)
    measured = 0.8 * free["images_per_sec"]
    fitted = main_cli("plan", "--hosts", "1", *args, "--one-host-images-per-sec", str(measured))
    assert fitted.returncode == 0, fitted.stderr
    fit = json.loads(fitted.stdout)
    assert fit["images_per_sec"] == pytest.approx(measured, rel=1e-6)
    assert fit["framework"]["one_host_images_per_sec"] == measured and free["framework"]["step_overhead_seconds"] == 0
    assert fit["framework"]["step_overhead_seconds"] == pytest.approx(
        free["images_per_sec"] / measured * free["step_seconds"] - free["step_seconds"]
    )
    four = [
        json.loads(main_cli("plan", "--hosts", "4", *args, *extra).stdout)["step_seconds"]
        for extra in ((), ("--one-host-images-per-sec", str(measured)))
    ]
    assert four[1] - four[0] == pytest.approx(
        free["images_per_sec"] / measured * free["step_seconds"] - free["step_seconds"]
    )
    text = main_cli("plan", "--hosts", "4", *args[:-1], "--one-host-images-per-sec", str(measured)).stdout
    assert (
        "framework cost per step" in text and "fitted to your one host's" in text and "a per-step cost of" not in text
    )


def test_missing_profile_is_one_line(main_cli, tmp_path):
    assert_one_line_error(
        main_cli("plan", "--profile", tmp_path / "none.json", "--hosts", "1"),
        "no such file; make one with trainscale profile",
    )


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--model", "resnet23"), "--model 'resnet23' is not registered"),
        (("--compress", "topk:k=3"), "topk takes ratio and granularity, not 'k'"),
        (("--compress", "zip"), "unknown method 'zip'"),
        (("--warmup", "0"), "--warmup must be at least 1"),
        (("--out", "/proc/p.json"), "--out /proc/p.json: cannot write there"),
        (("--cpus", "nan"), "--cpus must be a finite number"),
    ],
)
def test_bad_profile_input_is_one_line(main_cli, tmp_path, args, fragment):
    proc = main_cli("profile", "--model", "mlp", "--out", tmp_path / "p.json", *args)
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "p.json").exists()


def test_profile_out_that_is_not_a_file_is_refused_before_profiling(tmp_path):
    """A FIFO made here stands for any special file (root's /dev/null was replaced by a regular file): refused
    in one line, left as it was, and before the profile is measured (no wait on the FIFO either)."""
    import os
    import stat

    out = tmp_path / "p.json"
    os.mkfifo(out)
    proc = run_cli("profile", "--model", "mlp", "--repeats", "1000000", "--out", out, timeout=60)
    assert_one_line_error(proc, f"--out {out} is a FIFO, not a regular file")
    assert stat.S_ISFIFO(os.lstat(out).st_mode)


def test_plan_plot_that_is_not_a_file_is_refused_before_planning(profile, tmp_path):
    import os
    import stat

    plot = tmp_path / "sweep.png"
    os.mkfifo(plot)
    proc = run_cli(
        "plan",
        "--profile",
        profile,
        "--hosts",
        "2",
        "--bandwidth",
        "1gbit",
        "--sweep",
        "workers=1,2",
        "--plot",
        plot,
        timeout=120,
    )
    assert_one_line_error(proc, f"--plot {plot} is a FIFO, not a regular file")
    assert stat.S_ISFIFO(os.lstat(plot).st_mode) and proc.stdout == ""


def test_measured_one_and_two_hosts_set_the_link_of_every_host_count(main_cli, profile):
    """Two hosts reproduce their measured figure; four run on the same fraction of the line rate, which the plan
    says and ``--json`` gives as a rate."""
    args = ("--profile", profile, "--workers-per-host", "2", "--bandwidth", "1gbit", "--json")
    one = json.loads(main_cli("plan", "--hosts", "1", *args).stdout)["images_per_sec"]
    two = json.loads(main_cli("plan", "--hosts", "2", *args, "--one-host-images-per-sec", str(one)).stdout)
    measured = ("--one-host-images-per-sec", str(one), "--two-host-images-per-sec", str(0.8 * two["images_per_sec"]))
    fitted = json.loads(main_cli("plan", "--hosts", "2", *args, *measured).stdout)
    assert fitted["images_per_sec"] == pytest.approx(0.8 * two["images_per_sec"], rel=1e-6)
    rate = fitted["framework"]["inter_bits_per_sec"]
    assert 0 < rate < 1e9 and fitted["framework"]["two_host_images_per_sec"] == 0.8 * two["images_per_sec"]
    efficiency = ("--one-host-images-per-sec", str(one), "--efficiency", str(rate / 1e9))
    four = [json.loads(main_cli("plan", "--hosts", "4", *args, *extra).stdout) for extra in (measured, efficiency)]
    assert four[0]["step_seconds"] == pytest.approx(four[1]["step_seconds"], rel=1e-6)
    text = main_cli("plan", "--hosts", "4", *args[:-1], *measured).stdout
    assert "of its line rate, fitted to your two hosts'" in text
