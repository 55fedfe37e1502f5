"""The planner: cost formulas on hand-computed cases, the prediction of each mode on a hand-made profile,
monotonicity over bandwidth, the profile's buckets against DDP's own, and one-line errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from trainscale.errors import ConfigError
from trainscale.plan.costs import (
    Link,
    colocated_parameter_server,
    overlapped_finish,
    parameter_server,
    ring_allgather,
    ring_allreduce,
)
from trainscale.plan.describe import load_cluster, load_device, parse_latency, parse_link
from trainscale.plan.methods import parse_spec
from trainscale.plan.predict import MODES, Setting, crossover, predict
from trainscale.plan.profile import Bucket, CompressorProfile, Profile, Timing, _profile_from, load_profile

MB = 1e6


def timing(seconds: float) -> Timing:
    return Timing(seconds, seconds, seconds, 1)


def make_profile() -> Profile:
    """40 MB of gradients in two buckets (ready at 30% and 100% of a 0.2 s backward), 0.3 s per step."""
    buckets = [Bucket(1, int(25 * MB), 0.06), Bucket(0, int(15 * MB), 0.2)]
    compressors = {
        "bf16": CompressorProfile(
            "bf16", "bf16", "layerwise", timing(0.002), timing(0.002), [("all_reduce", int(20 * MB))]
        ),
        "topk:ratio=0.01,granularity=entire": CompressorProfile(
            "topk:ratio=0.01,granularity=entire",
            "topk",
            "entire",
            timing(0.01),
            timing(0.001),
            [("all_gather", int(0.8 * MB))],
        ),
    }
    return Profile(
        "resnet9",
        64,
        "fp32",
        "test cpu",
        1,
        None,
        timing(0.0),
        timing(0.09),
        timing(0.2),
        timing(0.01),
        int(40 * MB),
        int(10 * MB),
        buckets,
        100.0,
        compressors,
    )


def setting(bandwidth_bits: float, hosts: int = 4, **kw) -> Setting:
    return Setting(hosts, 1, Link(bandwidth_bits / 8), None, **kw)


class TestCosts:
    def test_ring_allreduce_by_hand(self):
        # 4 workers, 100 MB over 1 GB/s links with 10 us: 2*3/4 * 0.1 s + 6 * 10 us
        assert ring_allreduce(100 * MB, 4, Link(1e9, 1e-5)) == pytest.approx(0.15 + 6e-5)
        assert ring_allreduce(100 * MB, 1, Link(1e9)) == 0.0

    def test_ring_allgather_by_hand(self):
        assert ring_allgather(1 * MB, 5, Link(1e8, 1e-4)) == pytest.approx(4 * 0.01 + 4e-4)

    def test_parameter_server_by_hand(self):
        # 8 workers, 2 shards: the servers' links carry 8 x 10 MB / 2 = 40 MB: 0.4 s at 100 MB/s
        assert parameter_server(10 * MB, 8, 2, Link(1e8), Link(1e8)) == pytest.approx(0.4)
        # many shards: the worker's own link (10 MB) is the bound
        assert parameter_server(10 * MB, 8, 16, Link(1e8), Link(1e8)) == pytest.approx(0.1)

    def test_colocated_parameter_server_by_hand(self):
        # 4 hosts x 2 workers: each host sends 2 x 3/4 of 10 MB = 15 MB; 3 messages at 1 ms
        assert colocated_parameter_server(10 * MB, 4, 2, Link(1e8, 1e-3)) == pytest.approx(0.15 + 3e-3)

    def test_overlap_chain(self):
        # a collective starts when its bucket is ready and after the one before
        assert overlapped_finish([0.0, 1.0], [2.0, 1.0]) == 3.0
        assert overlapped_finish([0.0, 5.0], [2.0, 1.0]) == 6.0

    def test_bad_links(self):
        with pytest.raises(ValueError):
            Link(-1.0)
        with pytest.raises(ValueError):
            Link(1.0, -1e-3)


class TestPredict:
    def test_single_worker_is_compute(self):
        p = predict(make_profile(), setting(1e9, hosts=1))
        assert p.step_seconds == pytest.approx(0.3) and p.scaling_efficiency == pytest.approx(1.0)

    def test_dense_sync_overlap_by_hand(self):
        # 4 hosts at 800 Mbit/s (100 MB/s): bucket 25 MB -> 0.375 s from 0.06; bucket 15 MB -> 0.225 s after
        p = predict(make_profile(), setting(8e8))
        finish = 0.06 + 0.375 + 0.225
        assert p.comm_seconds == pytest.approx(finish - 0.2)
        assert p.step_seconds == pytest.approx(0.3 + finish - 0.2)
        assert p.hidden_seconds == pytest.approx(0.6 - (finish - 0.2))
        assert p.bytes_per_step_per_link == pytest.approx(1.5 * 40 * MB)

    def test_entire_topk_by_hand(self):
        # all-gather of 0.8 MB from 4 workers: 3 x 0.8 MB at 100 MB/s; decode 4 payloads
        spec = parse_spec("topk:ratio=0.01,granularity=entire")
        p = predict(make_profile(), setting(8e8, spec=spec))
        assert p.comm_seconds == pytest.approx(0.01 + 0.024 + 4 * 0.001)

    def test_localsgd_amortises(self):
        every = predict(make_profile(), setting(8e8, mode="localsgd", sync_every=1))
        eight = predict(make_profile(), setting(8e8, mode="localsgd", sync_every=8))
        assert eight.comm_seconds == pytest.approx(every.comm_seconds / 8)
        assert every.comm_seconds == pytest.approx(ring_allreduce(40 * MB, 4, Link(1e8)))

    def test_async_shares_the_link(self):
        # own transfers stretched by the server's replies: slower than push + pull alone, faster than twice
        sync = predict(make_profile(), setting(8e8, mode="ps-sync"))
        asyn = predict(make_profile(), setting(8e8, mode="async"))
        assert sync.comm_seconds < asyn.comm_seconds < 2 * sync.comm_seconds

    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize("compress", ["none", "bf16", "topk:ratio=0.01,granularity=entire"])
    def test_slower_links_never_faster(self, mode, compress):
        rates = [1e7, 1e8, 4e8, 1e9, 1e10, 1e11]
        steps = [
            predict(make_profile(), setting(r, mode=mode, spec=parse_spec(compress), sync_every=4)).step_seconds
            for r in rates
        ]
        assert steps == sorted(steps, reverse=True)

    def test_more_workers_never_more_efficient_in_sync(self):
        s = setting(1e9)
        effs = [predict(make_profile(), s.with_workers(w)).scaling_efficiency for w in (1, 2, 4, 8, 16)]
        assert effs == sorted(effs, reverse=True)

    def test_crossover_of_topk_against_bf16(self):
        base = setting(1e9, spec=parse_spec("bf16"))
        topk = setting(1e9, spec=parse_spec("topk:ratio=0.01,granularity=entire"))
        found = crossover(make_profile(), topk, base)
        assert found is not None
        below = dataclasses.replace(topk, inter=Link(found * 0.9))
        above = dataclasses.replace(topk, inter=Link(found * 1.1))
        for s, faster in ((below, True), (above, False)):
            b = dataclasses.replace(base, inter=s.inter)
            assert (predict(make_profile(), s).step_seconds < predict(make_profile(), b).step_seconds) is faster

    def test_unprofiled_compressor_is_one_line(self):
        with pytest.raises(ConfigError, match="no timings for --compress powersgd"):
            predict(make_profile(), setting(1e9, spec=parse_spec("powersgd:rank=2")))


class TestDescriptions:
    def test_units(self):
        assert parse_latency("50us") == pytest.approx(5e-5)
        assert parse_link("8gbit", "1ms").bandwidth == 1e9
        with pytest.raises(ConfigError, match="--bandwidth must be a rate in bits per second"):
            parse_link("-1gbit")
        with pytest.raises(ConfigError, match="--latency must look like"):
            parse_latency("-5us")

    def test_every_shipped_cluster_loads(self):
        from trainscale.plan.describe import CHECKOUT_CONFIGS

        names = sorted(p.stem for p in (CHECKOUT_CONFIGS / "clusters").glob("*.toml"))
        assert len(names) >= 6
        for name in names:
            cluster = load_cluster(name)
            if cluster.device:
                load_device(cluster.device)

    def test_unknown_names_are_one_line(self):
        with pytest.raises(ConfigError, match="unknown cluster 'nope'; known: "):
            load_cluster("nope")
        with pytest.raises(ConfigError, match="unknown device 'nope'"):
            load_device("nope")

    def test_device_without_the_model(self):
        with pytest.raises(ConfigError, match="has no throughput for model mlp"):
            load_device("k80").step_seconds("mlp", 64)


def test_profile_json_round_trip(tmp_path):
    profile = make_profile()
    path = tmp_path / "p.json"
    path.write_text(profile.to_json())
    assert load_profile(path) == _profile_from(json.loads(profile.to_json()))
    assert load_profile(path).compute_seconds == pytest.approx(0.3)


@pytest.mark.parametrize("text", ["", "{}", "[1]"])
def test_not_a_profile(tmp_path, text):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="--profile .*make one with trainscale profile"):
        load_profile(path)


@pytest.mark.parametrize("model", ["mlp", "resnet20"])
def test_profile_buckets_are_ddps(model):
    """The recorded buckets (sizes, ready order) are the ones DDP really built after its rebuild."""
    from trainscale.plan.profile import ProfileConfig, limits, measure

    cfg = ProfileConfig(model=model, batch_size=4, repeats=2, warmup=2, threads=1, compress=["bf16"], overlap=False)
    with limits(cfg):
        profile = measure(cfg, [parse_spec("bf16")])  # raises if the sizes differ from DDP's logging data
    assert sum(b.nbytes for b in profile.buckets) == profile.gradient_bytes
    assert [b.ready_seconds for b in profile.buckets] == sorted(b.ready_seconds for b in profile.buckets)
    assert all(0 <= b.ready_seconds <= profile.backward.max * 1.5 for b in profile.buckets)
    assert profile.compressors["bf16"].collectives == [("all_reduce", profile.gradient_bytes // 2)]
    assert math.isfinite(profile.compute_seconds)


def test_profile_leaves_real_gradients_for_the_compressors():
    """The compressors are timed on a real backward's gradients (once they were the optimizer's zeroed ones,
    and Top-k took its slow path on all-zero input)."""
    import torch

    from trainscale.plan.profile import ProfileConfig, _time_steps, build, limits
    from trainscale.runtime.process_group import local_group
    from trainscale.train.precision import Precision

    cfg = ProfileConfig(model="mlp", batch_size=4, repeats=1, warmup=1, threads=1, overlap=False)
    with limits(cfg):
        model = build(cfg, torch.device("cpu"))
        with local_group():
            _time_steps(cfg, model, Precision("fp32", torch.device("cpu")))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


class TestDilation:
    def profile_file(self, tmp_path, cpus):
        profile = dataclasses.replace(make_profile(), model="inception_bn_small", batch_size=128, cpus=cpus)
        path = tmp_path / "p.json"
        path.write_text(profile.to_json())
        return path

    def test_links_slowed_by_the_compute_ratio(self, tmp_path, monkeypatch):
        from trainscale.cluster import dilation
        from trainscale.plan.describe import load_device

        monkeypatch.setattr(dilation, "cpu_count", lambda: 2)
        rates, record = dilation.dilated_rates("pslite-gtx980", str(self.profile_file(tmp_path, 0.4)), None, None)
        target, _ = load_device("gtx980").step_seconds("inception_bn_small", 128)
        factor = 0.3 / target
        assert record["factor"] == pytest.approx(factor)
        assert rates == [int(1e9 / factor)] * 5
        assert "every link runs" in record["text"]

    def test_profile_under_other_cpus_is_refused(self, tmp_path, monkeypatch):
        from trainscale.cluster import dilation

        monkeypatch.setattr(dilation, "cpu_count", lambda: 2)
        with pytest.raises(ConfigError, match="profile again with --cpus 0.4"):
            dilation.dilated_rates("pslite-gtx980", str(self.profile_file(tmp_path, 1.0)), None, None)
        with pytest.raises(ConfigError, match="has 5 hosts"):
            dilation.dilated_rates("pslite-gtx980", str(self.profile_file(tmp_path, 0.4)), 4, None)

    def test_summary_projected_back(self):
        from trainscale.cluster.dilation import projected

        summary = {
            "step_seconds": 2.0,
            "samples_per_sec": 100.0,
            "steady_epoch_seconds": 50.0,
            "cluster": {"dilation": {"target": "t", "factor": 4.0}},
        }
        assert projected(summary)["projected"] == {
            "target": "t",
            "factor": 4.0,
            "step_seconds": 0.5,
            "steady_epoch_seconds": 12.5,
            "samples_per_sec": 400.0,
        }
        assert projected({"step_seconds": 1.0, "cluster": {"hosts": 2}}) == {}


def test_damaged_profile_is_one_line(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": "trainscale-profile/1", "model": "mlp"}))
    with pytest.raises(ConfigError, match="damaged .*make it again with trainscale profile"):
        load_profile(path)


def test_one_worker_parameter_server_pushes_nothing():
    profile = make_profile()
    for mode in ("ps-sync", "sync"):
        p = predict(profile, Setting(1, 1, None, Link(1e8, 1e-4), mode=mode))
        assert p.step_seconds == pytest.approx(profile.compute_seconds) and p.comm_seconds == 0.0


class TestWithoutProfile:
    def test_ddp_bucket_layout(self):
        from trainscale.plan.synthetic import MIB, ddp_buckets

        buckets = ddp_buckets(60 * MIB, 0.3)
        assert [b.nbytes for b in buckets] == [MIB, 25 * MIB, 25 * MIB, 9 * MIB]
        assert buckets[0].ready_seconds == pytest.approx(0.3 / 60) and buckets[-1].ready_seconds == pytest.approx(0.3)
        assert [b.nbytes for b in ddp_buckets(60 * MIB, 0.3, bucket_mb=100)] == [MIB, 59 * MIB]

    def _plan(self, capsys, **extra) -> dict:
        from trainscale.plan.cli import run_plan
        from trainscale.plan.plan import PlanConfig

        base = dict(params=25_000_000, step_time="200ms", batch_size=64, hosts=4, bandwidth="10gbit", json=True)
        assert run_plan(PlanConfig(**{**base, **extra})) == 0
        return json.loads(capsys.readouterr().out)

    def test_a_parameter_count_may_be_written_in_scientific_notation(self, capsys):
        from trainscale.cli import main

        flags = [
            "plan",
            "--step-time",
            "200ms",
            "--batch-size",
            "64",
            "--hosts",
            "4",
            "--bandwidth",
            "10gbit",
            "--json",
        ]
        plans = []
        for params in ("25000000", "25e6", "2.5e7", "25_000_000", "25M", "25m", "0.025B", "25000k"):
            assert main([*flags, "--params", params]) == 0
            plans.append(json.loads(capsys.readouterr().out))
        assert all(p == plans[0] for p in plans) and plans[0]["images_per_sec"] > 0
        with pytest.raises(SystemExit) as exit_:
            main([*flags, "--params", "2.5e-1"])
        assert exit_.value.code == 2
        refusal = "--params: expected a whole number (e.g. 512, 25000000, 25e6 or 25M), got '2.5e-1'"
        assert refusal in capsys.readouterr().err

    def test_a_parameter_server_plan_says_where_its_servers_are(self, capsys):
        from trainscale.cli import main

        flags = ["plan", "--params", "25e6", "--step-time", "100ms", "--batch-size", "32", "--mode", "ps-sync"]
        said = {}
        for name, extra in {
            "one host": ["--hosts", "1", "--workers-per-host", "4", "--servers", "2"],
            "colocated": ["--hosts", "2", "--bandwidth", "25gbit", "--servers", "2"],
            "separate": ["--hosts", "2", "--bandwidth", "25gbit", "--ps-placement", "separate", "--servers", "3"],
            "one host, separate": ["--hosts", "1", "--workers-per-host", "2", "--ps-placement", "separate"]
            + ["--bandwidth", "10gbit"],
            "slower": ["--hosts", "2", "--bandwidth", "25gbit", "--ps-efficiency", "0.5"],
        }.items():
            assert main([*flags, *extra]) == 0
            said[name] = capsys.readouterr().out.splitlines()[0]
        assert said["one host"].endswith("; 2 server(s) on the host, the model sharded evenly")
        assert said["colocated"].endswith(  # the count per host does not change what crosses the hosts' links
            "; servers beside the workers on every host, the model sharded evenly (--servers 2 per host: the same "
            "traffic between hosts)"
        )
        assert said["separate"].endswith("; 3 server host(s) of their own, the model sharded evenly")
        assert said["one host, separate"].endswith("; 1 server host(s) of their own, the model sharded evenly")
        assert "unused" not in said["one host, separate"]  # --bandwidth is the link to the servers' host
        assert said["slower"].endswith(
            "; 1 server(s) beside the workers on every host, the model sharded evenly, at 50% of line rate"
        )

    def test_the_plan_names_an_assumed_link_fraction_only_where_it_charges_that_link(self, capsys):
        from trainscale.cli import main

        flags = ["plan", "--params", "25e6", "--step-time", "100ms", "--batch-size", "32", "--bandwidth", "25gbit"]
        inter, intra = "the link between hosts at its line rate", "the devices' link at its full rate"
        said = {}
        for name, extra in {
            "one host": ["--hosts", "1", "--workers-per-host", "4"],
            "one device a host": ["--hosts", "2", "--workers-per-host", "1"],
            "both": ["--hosts", "2", "--workers-per-host", "4"],
            "both given": ["--hosts", "2", "--workers-per-host", "4", "--efficiency", "0.8"]
            + ["--intra-efficiency", "0.5"],
            "servers apart": ["--hosts", "1", "--workers-per-host", "1", "--mode", "ps-sync"]
            + ["--ps-placement", "separate"],
        }.items():
            assert main([*flags, *extra]) == 0
            said[name] = capsys.readouterr().out.splitlines()[1]
        assert [(inter in said[k], intra in said[k]) for k in said] == [
            (False, True),
            (True, False),
            (True, True),
            (False, False),
            (True, False),  # the servers' own hosts are reached over the link between hosts
        ]

    def test_params_plan_needs_a_step_time(self):
        from trainscale.plan.plan import PlanConfig, plan_profile

        with pytest.raises(ConfigError, match="--params 1000 needs --step-time"):
            plan_profile(PlanConfig(params=1000))

    def test_params_plan_by_hand(self, capsys):
        # 100 MB over 4 hosts at 10 Gbit/s: ring 1.5 x 100 MB / 1.25 GB/s = 120 ms; a GPU plan given no overlap
        # takes none (what published NCCL runs show): all of it is exposed, and given no cost per step it takes
        # 3% of the device's step (6 ms), as published NCCL runs show too
        p = self._plan(capsys)
        assert p["compute_seconds"] == pytest.approx(0.2)
        assert p["wire_seconds"] == pytest.approx(0.12, rel=1e-6)
        assert p["comm_seconds"] == pytest.approx(p["wire_seconds"] + 0.006)
        assert p["framework"]["step_overhead_share"] == 0.03 and p["framework"]["step_overhead_seconds"] == 0.0
        given = self._plan(capsys, step_overhead="1ms")  # a cost given replaces the assumed share
        assert given["comm_seconds"] == pytest.approx(p["wire_seconds"] + 0.001)
        assert given["framework"]["step_overhead_share"] == 0.0

    def test_the_assumed_cost_per_step_grows_with_the_device_step_and_is_not_charged_to_one_device(self, capsys):
        slow, fast = self._plan(capsys), self._plan(capsys, step_time="100ms")
        assert slow["comm_seconds"] - slow["wire_seconds"] == pytest.approx(
            2 * (fast["comm_seconds"] - fast["wire_seconds"])
        )
        one = self._plan(capsys, hosts=1)
        assert one["step_seconds"] == pytest.approx(one["compute_seconds"])

    def test_given_overlap_hides_what_the_schedule_allows(self, capsys):
        # with perfect overlap the last 25 MiB bucket, ready at the end of backward, is still exposed
        p = self._plan(capsys, overlap=1.0)
        assert 0 < p["comm_seconds"] < p["wire_seconds"]

    def test_16_bit_gradients_halve_the_wire(self, capsys):
        full, half = self._plan(capsys), self._plan(capsys, grad_dtype="bf16")
        assert half["wire_seconds"] == pytest.approx(full["wire_seconds"] / 2)
        assert half["step_seconds"] < full["step_seconds"]

    def test_accumulation_communicates_once_per_n(self, capsys):
        one, four = self._plan(capsys), self._plan(capsys, accumulate=4)
        assert four["compute_seconds"] == pytest.approx(4 * one["compute_seconds"])
        assert four["wire_seconds"] == pytest.approx(one["wire_seconds"])
        assert four["images_per_sec"] > one["images_per_sec"]
        assert four["scaling_efficiency"] > one["scaling_efficiency"]


def test_plan_batch_size_scales_the_profile(tmp_path, capsys):
    from trainscale.plan.cli import run_plan
    from trainscale.plan.plan import PlanConfig

    path = tmp_path / "p.json"
    path.write_text(make_profile().to_json())
    runs = {}
    for batch in (None, 128):
        run_plan(PlanConfig(profile=str(path), hosts=4, bandwidth="1gbit", batch_size=batch, json=True))
        runs[batch] = json.loads(capsys.readouterr().out)
    assert runs[128]["compute_seconds"] == pytest.approx(2 * runs[None]["compute_seconds"])
    assert runs[128]["scaling_efficiency"] > runs[None]["scaling_efficiency"]
