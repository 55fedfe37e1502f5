"""The profile's overlap and per-step cost: the formula on hand-computed cases, the measurement on a tiny model
(two gloo ranks of one process over 127.0.0.1), and a plan that uses what was measured, says so, and lets a
cluster file or a flag win."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest

from tests.unit.test_plan import make_profile
from trainscale.plan.overlap import overlap_fraction, schedule_bound


@pytest.mark.parametrize(
    "comm, exposed, bound, expected",
    [
        (0.100, 0.100, 0.020, 0.0),  # all of it exposed: no overlap
        (0.100, 0.020, 0.020, 1.0),  # only what the schedule cannot hide: perfect
        (0.100, 0.060, 0.020, 0.5),  # halfway
        (0.100, 0.000, 0.020, 1.0),  # noise below the bound is clipped
        (0.100, 0.150, 0.020, 0.0),  # and above everything
        (0.020, 0.020, 0.020, None),  # nothing could hide: no fraction to speak of
    ],
)
def test_overlap_fraction_by_hand(comm, exposed, bound, expected):
    assert overlap_fraction(comm, exposed, bound) == (None if expected is None else pytest.approx(expected))


def test_schedule_bound_by_hand():
    # backward 100 ms; buckets ready at 40 and 100 ms taking 30 and 20 ms: the first ends at 70, the second at 120
    assert schedule_bound([0.04, 0.10], [0.03, 0.02], 0.10) == pytest.approx(0.02)
    # the first bucket runs late (ends at 115), the second starts after it: 135 ms, 35 ms past backward
    assert schedule_bound([0.04, 0.10], [0.075, 0.02], 0.10) == pytest.approx(0.035)


@pytest.mark.slow
def test_profile_measures_overlap_and_leaves_no_group_behind(tmp_path):
    from trainscale.plan.cli import overlap_text
    from trainscale.plan.profile import ProfileConfig, load_profile, profile_command

    before = threading.active_count()
    out = tmp_path / "p.json"
    profile_command(ProfileConfig(model="mlp", batch_size=4, repeats=2, warmup=2, threads=1, out=str(out)))
    p = load_profile(out)
    assert p.overlap is None or 0.0 <= p.overlap <= 1.0
    assert p.step_overhead is not None and p.step_overhead >= 0.0
    assert p.bucket_overhead is not None and 0.0 < p.bucket_overhead < p.overlap_seconds["comm"]
    assert set(p.overlap_seconds) == {"backward", "exposed", "comm", "schedule_bound"}
    assert p.overlap_seconds["comm"] > 0  # real all-reduces ran
    assert "all-reduces take" in overlap_text(p) and "per bucket" in overlap_text(p)
    assert threading.active_count() == before  # the peer thread ended and the groups were shut down


def test_profile_without_overlap_measures_none(tmp_path):
    from trainscale.plan.profile import ProfileConfig, profile_command

    out = tmp_path / "p.json"
    p = profile_command(
        ProfileConfig(model="mlp", batch_size=4, repeats=1, warmup=1, threads=1, overlap=False, out=str(out))
    )
    assert (p.overlap, p.step_overhead, p.bucket_overhead, p.overlap_seconds) == (None, None, None, {})
    assert p.overlap_unmeasured == ""  # not asked for: nothing to explain


@pytest.mark.parametrize(
    "device, visible, expected",
    [
        ("cpu", 0, ("cpu", "cpu")),  # two gloo ranks
        ("cuda", 1, None),  # NCCL takes one rank per GPU: no second one here
        ("cuda", 2, ("cuda:0", "cuda:1")),
        ("cuda:1", 4, ("cuda:1", "cuda:0")),  # the profiled GPU keeps rank 0; the first other one is its peer
    ],
)
def test_the_overlap_pair_is_two_cpu_ranks_or_the_profiled_gpu_and_another(monkeypatch, device, visible, expected):
    import torch

    from trainscale.plan.profile import pair_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    pair = pair_devices(torch.device(device))
    assert (None if pair is None else tuple(str(d) for d in pair)) == expected


@pytest.mark.parametrize("devices", [("cuda:0", "cuda:0"), ("cpu", "cuda:0")])
def test_a_pair_refuses_one_gpu_twice_or_a_cpu_beside_a_gpu(devices):
    import torch

    from trainscale.runtime.process_group import loopback_pair

    with pytest.raises(ValueError, match="two different GPUs"):
        with loopback_pair((torch.device(devices[0]), torch.device(devices[1]))):
            pass


def test_on_a_gpu_a_buckets_ready_time_is_read_from_events_on_the_stream(monkeypatch):
    """On a GPU the recorder marks a bucket with an event on the stream (passed when the GPU gets there, not when
    the host queued the work) and reads seconds between events after the step; a stand-in event keeps CUDA's
    contract (``elapsed_time`` in milliseconds between two recorded events)."""
    import time

    import torch

    from trainscale.plan.profile import _Recorder

    class StandInEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at: float | None = None

        def record(self, stream=None) -> None:
            self.at = time.perf_counter()

        def elapsed_time(self, end: StandInEvent) -> float:
            assert self.at is not None and end.at is not None  # both recorded
            return 1e3 * (end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", StandInEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    recorder = _Recorder(torch.device("cuda:0"))
    recorder.begin()
    time.sleep(0.02)
    recorder.calls.append((1, 400, recorder.mark()))
    time.sleep(0.02)
    recorder.calls.append((0, 800, recorder.mark()))
    (first, size1, at1), (second, size0, at0) = recorder.ready()
    assert (first, size1, second, size0) == (1, 400, 0, 800)
    assert 0.015 < at1 < at0 < 5 and at0 - at1 > 0.015  # seconds (not milliseconds) from backward's start


def test_an_nccl_pair_forms_on_each_ranks_device_and_leaves_as_a_collective(monkeypatch):
    """Two NCCL ranks of one process: each formed on its own thread with its own GPU set, and destroyed at once
    (NCCL destroys a communicator as a collective of its ranks: one thread shutting both down in turn would wait
    for itself). A stand-in NCCL whose shutdown waits for both ranks checks it without GPUs."""
    import threading

    import torch
    import torch.distributed as dist

    from trainscale.runtime.process_group import loopback_pair

    current = threading.local()
    both_leave = threading.Barrier(2, timeout=5)
    formed, left = {}, []

    class StandInNCCL:
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, options):
            formed[rank] = (current.device, size, options._timeout.total_seconds())

        def shutdown(self):
            both_leave.wait()
            left.append(threading.current_thread().name)

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: setattr(current, "device", str(device)))
    monkeypatch.setattr(dist, "ProcessGroupNCCL", StandInNCCL, raising=False)
    with loopback_pair((torch.device("cuda:1"), torch.device("cuda:0")), timeout_s=7) as (rank0, rank1):
        assert isinstance(rank0, StandInNCCL) and isinstance(rank1, StandInNCCL)
    assert formed == {0: ("cuda:1", 2, 7.0), 1: ("cuda:0", 2, 7.0)}
    assert len(left) == 2 and len(set(left)) == 2  # both shut down, each from its own thread


def test_a_one_gpu_profile_says_why_it_measured_no_overlap(monkeypatch, capsys):
    """On a machine with one GPU the profile measures no overlap nor DDP's costs (NCCL needs a second GPU) and says
    so; the plan takes both from published NCCL runs, as the pair they were fitted as."""
    from trainscale.plan import cli
    from trainscale.plan.plan import GPU_OVERLAP, GPU_STEP_SHARE, PlanConfig, setting_from
    from trainscale.plan.profile import ProfileConfig

    one_gpu = "NCCL takes one rank per GPU and this machine has one"
    gpu = dataclasses.replace(make_profile(), environment={"device": "cuda:0"}, overlap_unmeasured=one_gpu)
    monkeypatch.setattr(cli, "profile_command", lambda cfg: gpu)
    assert cli.run_profile(ProfileConfig()) == 0
    out = capsys.readouterr().out
    assert f"overlap and DDP's per-step and per-bucket costs not measured: {one_gpu}" in out
    setting, _, origin = setting_from(PlanConfig(hosts=2, bandwidth="10gbit"), gpu)
    assert (setting.overlap, setting.step_share) == (GPU_OVERLAP, GPU_STEP_SHARE)
    assert "no overlap of communication with backward (as published NCCL runs show)" in origin


@pytest.mark.parametrize("why", ["no second GPU", "the pair does not form"])
def test_a_profile_without_a_pair_keeps_the_rest_and_says_why(monkeypatch, tmp_path, why):
    """Where the two ranks cannot be had (one GPU) or do not form (NCCL refusing, say), the profile still times the
    step and its buckets, measures none of DDP's costs (they go with the overlap) and says why."""
    import contextlib

    from trainscale.plan import profile as profile_module
    from trainscale.plan.profile import ProfileConfig, load_profile, profile_command
    from trainscale.runtime import process_group
    from trainscale.runtime.process_group import PairError

    if why == "no second GPU":
        monkeypatch.setattr(profile_module, "pair_devices", lambda device: None)
        expected = "NCCL takes one rank per GPU and this machine has one"
    else:

        @contextlib.contextmanager
        def refused(devices, timeout_s=60.0):
            raise PairError("unhandled system error")
            yield

        monkeypatch.setattr(process_group, "loopback_pair", refused)
        expected = "two gloo ranks did not form a pair (unhandled system error)"
    out = tmp_path / "p.json"
    profile_command(ProfileConfig(model="mlp", batch_size=4, repeats=2, warmup=1, threads=1, out=str(out)))
    p = load_profile(out)
    assert p.overlap_unmeasured == expected
    assert (p.overlap, p.step_overhead, p.bucket_overhead, p.overlap_seconds) == (None, None, None, {})
    assert p.buckets and p.compute_seconds > 0


def test_a_gpu_overlap_names_nccl():
    from trainscale.plan.cli import overlap_text

    seconds = {"backward": 0.1, "exposed": 0.02, "comm": 0.03, "schedule_bound": 0.01}
    on = {"cpu": "gloo, two ranks here", "cuda:0": "NCCL, with a second GPU of this machine"}
    for device, pair in on.items():
        p = dataclasses.replace(make_profile(), overlap=0.5, overlap_seconds=seconds, environment={"device": device})
        assert f"alone ({pair})" in overlap_text(p)


class TestPlanUsesTheMeasurement:
    def _plan(self, tmp_path, capsys, profile, **extra):
        from trainscale.plan.cli import run_plan
        from trainscale.plan.plan import PlanConfig

        path = tmp_path / "p.json"
        path.write_text(profile.to_json())
        base = dict(profile=str(path), hosts=2, bandwidth="1gbit", json=True)
        assert run_plan(PlanConfig(**{**base, **extra})) == 0
        return json.loads(capsys.readouterr().out)

    def test_measured_overlap_and_cost_are_used_and_named(self, tmp_path, capsys):
        from trainscale.plan.plan import PlanConfig, setting_from

        measured = dataclasses.replace(make_profile(), overlap=0.25, step_overhead=0.004, bucket_overhead=2e-4)
        setting, _, origin = setting_from(PlanConfig(hosts=2, bandwidth="1gbit"), measured)
        assert (setting.overlap, setting.step_overhead, setting.bucket_overhead) == (0.25, 0.004, 2e-4)
        assert (
            "measured by trainscale profile: overlap 0.25, DDP's cost per step 4.0 ms, cost per bucket 200 us" in origin
        )
        # less overlap and a per-step cost make the plan slower than the same profile without them
        slower = self._plan(tmp_path, capsys, measured)
        plain = self._plan(tmp_path, capsys, make_profile())
        assert slower["step_seconds"] > plain["step_seconds"]

    def test_the_pairs_rate_given_as_the_hosts_link_plans_the_all_reduces_it_measured(self, tmp_path, capsys):
        """The rate the profile prints for its two ranks is the link that makes a plan of two workers on one host
        take as long for the buckets' all-reduces as the measurement did (their per-collective cost apart)."""
        from trainscale.plan.cli import overlap_text

        seconds = {"backward": 0.2, "exposed": 0.02, "comm": 0.05, "schedule_bound": 0.01}
        p = dataclasses.replace(
            make_profile(), overlap=0.5, overlap_seconds=seconds, bucket_overhead=2e-4, step_overhead=1e-3
        )
        rate = p.pair_bytes_per_sec
        assert rate == pytest.approx(sum(b.nbytes for b in p.buckets) / (0.05 - 2 * 2e-4))
        assert f"all-reduced at {rate / 1e9:.3g}GB/s" in overlap_text(p)
        link = f"{rate / 1e9:.9f}GB/s"
        plan = self._plan(tmp_path, capsys, p, hosts=1, bandwidth=None, workers_per_host=2, intra_bandwidth=link)
        assert plan["wire_seconds"] == pytest.approx(0.05, rel=1e-4)
        assert dataclasses.replace(p, overlap_seconds={}).pair_bytes_per_sec is None  # nothing measured
        within_cost = dataclasses.replace(p, overlap_seconds={**seconds, "comm": 1e-4})  # all per-collective cost
        assert within_cost.pair_bytes_per_sec is None and "all-reduced at" not in overlap_text(within_cost)

    def test_a_flag_wins_over_the_measurement(self, tmp_path, capsys):
        from trainscale.plan.plan import PlanConfig, setting_from

        measured = dataclasses.replace(make_profile(), overlap=0.25, step_overhead=0.004, bucket_overhead=2e-4)
        cfg = PlanConfig(hosts=2, bandwidth="1gbit", overlap=1.0, bucket_overhead="1ms")
        setting, _, origin = setting_from(cfg, measured)
        assert (setting.overlap, setting.bucket_overhead) == (1.0, 1e-3)
        assert "overlap 0.25" not in origin and "200 us" not in origin and "4.0 ms" in origin

    def test_another_devices_plan_ignores_this_machines_measurement(self):
        from trainscale.plan.plan import GPU_OVERLAP, PlanConfig, setting_from

        measured = dataclasses.replace(make_profile(), overlap=0.25, step_overhead=0.004, bucket_overhead=2e-4)
        cfg = PlanConfig(hosts=2, bandwidth="1gbit", device_step_ms=50.0)
        setting, _, origin = setting_from(cfg, measured)
        assert (setting.overlap, setting.step_overhead, setting.bucket_overhead) == (GPU_OVERLAP, 0.0, 0.0)
        assert "measured by" not in origin


def test_the_check_of_a_run_uses_the_profiles_measurement():
    """A run on an emulated cluster is checked against the plan with what its profile measured."""
    from trainscale.plan.check import check_run, key_of_profile
    from trainscale.record import K

    summary = {
        K.cluster: {"hosts": 2, "rate_bps": 1e9, "rtt_seconds": 2e-4},
        K.mode: "sync",
        K.batch_per_worker: 64,
        K.model: "m",
        K.precision: "fp32",
        K.step_seconds: 0.5,
    }
    base = dataclasses.replace(make_profile(), model="m", batch_size=64, precision="fp32", threads=1, cpus=None)
    summary[K.cluster] |= {"threads_per_process": base.threads, "cpus_per_host": base.cpus}
    measured = dataclasses.replace(base, overlap=0.0, step_overhead=0.003, bucket_overhead=1e-4)
    plain = check_run("r", {"workers": 1}, summary, {key_of_profile(base): base})
    used = check_run("r", {"workers": 1}, summary, {key_of_profile(measured): measured})
    assert plain is not None and used is not None
    assert (used.setting.overlap, used.setting.step_overhead, used.setting.bucket_overhead) == (0.0, 0.003, 1e-4)
    assert used.predicted.step_seconds > plain.predicted.step_seconds


@pytest.mark.parametrize(
    "exposed, overlap, note",
    [
        (0.005, 1.0, "within the noise, so 1.00 is a bound"),
        (0.05, 0.0, "compete for this machine's cores"),
        (0.02, 0.5, ""),
    ],
)
def test_an_overlap_clipped_to_its_range_says_it_is_a_bound(exposed, overlap, note):
    """comm 30 ms, perfect overlap 10 ms: a lengthening outside [10, 30] ms is clipped, and the text says so."""
    import dataclasses

    from tests.unit.test_plan import make_profile
    from trainscale.plan.cli import overlap_text

    seconds = {"backward": 0.1, "exposed": exposed, "comm": 0.03, "schedule_bound": 0.01}
    p = dataclasses.replace(make_profile(), overlap=overlap, overlap_seconds=seconds)
    text = overlap_text(p)
    assert f"overlap {overlap:.2f}" in text
    assert (note in text) if note else "is a bound" not in text


def test_a_stop_leaves_the_pair_at_once_while_its_peer_waits_in_a_collective():
    """Ctrl-C during the profile's overlap measurement waited 60 s for the peer, which waited in an all-reduce
    rank 0 would never make, then printed gloo's timeout as a traceback: a stop leaves without waiting it out."""
    import time

    import torch

    from trainscale.plan.overlap import running_peer
    from trainscale.runtime.process_group import loopback_pair

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), loopback_pair(timeout_s=30) as (group, other):
        with running_peer(other, torch.device("cpu")) as peer:
            peer.rounds.put([4096])  # rank 1 all-reduces; rank 0 never does
            time.sleep(0.2)
            raise KeyboardInterrupt
    assert time.monotonic() - started < 10  # gloo's timeout here is 30 s
