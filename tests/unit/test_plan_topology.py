"""The planner's topology: NCCL's all-reduce algorithms on hand-computed cases, the algorithm NCCL would pick,
parameter servers that place whole tensors, partial overlap and framework costs, and monotonicity (a slower
link, more latency, less overlap or more overhead never makes a step faster)."""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
from collections.abc import Callable
from typing import Any

import pytest

from tests.scripts import load_benchmark
from tests.unit.test_plan import make_profile
from trainscale.errors import ConfigError
from trainscale.plan.costs import (
    Fabric,
    Link,
    allreduce,
    flat_ring,
    hierarchical,
    nccl_choice,
    placed_parameter_server,
    server_loads,
    tree,
)
from trainscale.plan.predict import (
    PSLayout,
    Setting,
    fit_intra_efficiency,
    fit_link_efficiency,
    fit_step_overhead,
    predict,
)
from trainscale.plan.profile import Profile

GB = 1e9
FABRIC = Fabric(2, 4, Link(100 * GB, 1e-6), Link(10 * GB, 1e-5))


class TestAlgorithms:
    def test_flat_ring_by_hand(self):
        # 8 devices, bottleneck the 10 GB/s NIC and its 10 us: 2*7/8 * 1 GB / 10 GB/s + 14 * 10 us
        assert flat_ring(GB, FABRIC) == pytest.approx(0.175 + 14e-5)

    def test_tree_by_hand(self):
        # 2 M / B + 2 (log2(2) x 10 us + 3 x 1 us)
        assert tree(GB, FABRIC) == pytest.approx(0.2 + 2 * (1e-5 + 3e-6))

    def test_hierarchical_by_hand(self):
        # inside: 2 x (3/4 x 1 GB / 100 GB/s + 3 x 1 us); across 2 hosts: 2*1/2 x 1 GB / 10 GB/s + 2 x 10 us
        assert hierarchical(GB, FABRIC) == pytest.approx(2 * (0.0075 + 3e-6) + 0.1 + 2e-5)

    def test_several_nics_share_the_traffic(self):
        two = dataclasses.replace(FABRIC, nics=2)
        assert hierarchical(GB, two) == pytest.approx(2 * (0.0075 + 3e-6) + 0.05 + 2e-5)
        assert flat_ring(GB, two) == pytest.approx(0.0875 + 14e-5)

    def test_one_device_communicates_nothing(self):
        assert allreduce(GB, Fabric(1, 1, Link(GB), Link(GB)), "auto") == 0.0

    def test_one_host_rings(self):
        assert nccl_choice(1e3, Fabric(1, 8, Link(100 * GB, 1e-6), Link(GB)), "auto") == "ring"

    def test_many_hosts_small_messages_take_the_tree(self):
        big = Fabric(64, 8, Link(100 * GB, 1e-6), Link(12.5 * GB, 5e-6))
        assert nccl_choice(1e3, big, "auto") == "tree"
        assert allreduce(1e3, big, "auto") == pytest.approx(tree(1e3, big))

    def test_few_hosts_large_messages_take_the_ring(self):
        assert nccl_choice(GB, FABRIC, "auto") == "ring"

    def test_given_algorithm_is_kept_and_unknown_refused(self):
        assert nccl_choice(GB, FABRIC, "tree") == "tree"
        with pytest.raises(ValueError, match="unknown all-reduce algorithm 'butterfly'"):
            nccl_choice(GB, FABRIC, "butterfly")


class TestParameterServers:
    TENSORS = [90e6, 5e6, 5e6]

    def test_assignments(self):
        assert server_loads(self.TENSORS, 3, "round_robin") == [90e6, 5e6, 5e6]
        assert server_loads([4.0, 3.0, 2.0, 1.0], 2, "by_size") == [5.0, 5.0]
        assert server_loads(self.TENSORS, 4, "shard") == [25e6] * 4

    def test_one_dominant_tensor_makes_its_server_the_bottleneck(self):
        link = Link(GB)
        whole = placed_parameter_server(self.TENSORS, 4, 3, link, link, "by_size")
        shard = placed_parameter_server(self.TENSORS, 4, 3, link, link, "shard")
        assert whole == pytest.approx(4 * 90e6 / GB)  # the 90 MB tensor's server receives it from 4 workers
        assert shard == pytest.approx(4 * 100e6 / 3 / GB)
        more = placed_parameter_server(self.TENSORS, 4, 10, link, link, "by_size")
        assert more == pytest.approx(whole)  # more servers cannot split a whole tensor

    def test_efficiency_slows_the_transport(self):
        link = Link(GB)
        assert placed_parameter_server([1e8], 1, 1, link, link, efficiency=0.5) == pytest.approx(0.2)

    def test_through_the_plan(self):
        profile = dataclasses.replace(make_profile(), tensor_bytes=[int(n) for n in (36e6, 2e6, 2e6)])
        base = Setting(4, 1, Link(GB / 8), None, mode="ps-sync", servers=4)
        shard = predict(profile, dataclasses.replace(base, ps=PSLayout("separate", "shard")))
        whole = predict(profile, dataclasses.replace(base, ps=PSLayout("separate", "round_robin")))
        assert whole.step_seconds > 2 * shard.step_seconds - profile.compute_seconds

    def test_bytes_over_a_worker_hosts_link(self):
        """Servers of their own: each push and pull of a host's workers crosses its link (40 MB of gradients each
        way per worker, 2 workers a host), on one host of workers too; beside the workers: the 3 of 4 shards that
        live on other hosts."""
        profile = make_profile()
        separate = Setting(4, 2, Link(GB / 8), None, mode="ps-sync", ps=PSLayout("separate", "shard"))
        assert predict(profile, separate).bytes_per_step_per_link == pytest.approx(2 * 2 * 40e6)
        one_host = dataclasses.replace(separate, hosts=1, intra=Link(GB))
        assert predict(profile, one_host).bytes_per_step_per_link == pytest.approx(2 * 2 * 40e6)
        beside = dataclasses.replace(separate, ps=PSLayout())
        assert predict(profile, beside).bytes_per_step_per_link == pytest.approx(3 / 4 * 2 * 2 * 40e6)

    def test_whole_tensors_need_their_sizes(self):
        base = Setting(4, 1, Link(GB / 8), None, mode="ps-sync", ps=PSLayout("separate", "by_size"))
        with pytest.raises(ConfigError, match="--ps-assignment by_size places whole tensors, but this profile has no"):
            predict(make_profile(), base)

    def test_bad_layout_is_one_line(self):
        with pytest.raises(ConfigError, match="placement 'cloud': colocated or separate"):
            PSLayout("cloud")


def settings() -> list[Setting]:
    out = []
    for algorithm in ("ring", "tree", "hierarchical", "auto"):
        for mode in ("sync", "ps-sync", "async"):
            for layout in (PSLayout(), PSLayout("separate", "by_size", 0.7)):
                out.append(
                    Setting(
                        4,
                        2,
                        Link(GB / 8, 2e-5),
                        Link(10 * GB, 2e-6),
                        mode=mode,
                        algorithm=algorithm,
                        ps=layout,
                        overlap=0.6,
                    )
                )
    return out


@pytest.mark.parametrize("base", settings(), ids=lambda s: f"{s.algorithm}-{s.mode}-{s.ps.placement}")
def test_monotone(base):
    profile = dataclasses.replace(make_profile(), tensor_bytes=[int(n) for n in (30e6, 6e6, 4e6)])
    step = predict(profile, base).step_seconds
    worse = [
        dataclasses.replace(base, inter=Link(GB / 16, 2e-5)),
        dataclasses.replace(base, inter=Link(GB / 8, 2e-4)),
        dataclasses.replace(base, intra=Link(GB, 2e-6)),
        dataclasses.replace(base, intra=Link(10 * GB, 5e-5)),
        dataclasses.replace(base, overlap=0.2),
        dataclasses.replace(base, bucket_overhead=1e-3),
        dataclasses.replace(base, step_overhead=1e-3),
        dataclasses.replace(base, intra_efficiency=0.3),
        dataclasses.replace(base, efficiency=0.3),
    ]
    for s in worse:
        assert predict(profile, s).step_seconds >= step - 1e-12


def test_the_devices_link_at_a_fraction_of_its_rate_is_that_slower_link():
    """A framework that reaches a fraction of the link inside a host plans as that slower link, in every mode that
    crosses it (one host's ring, the hierarchical all-reduce, servers in host memory), and says so."""
    from trainscale.plan.cli import describe_setting

    profile = dataclasses.replace(make_profile(), tensor_bytes=[int(n) for n in (30e6, 6e6, 4e6)])
    cases = [
        Setting(1, 4, None, Link(10 * GB, 2e-6)),
        Setting(2, 4, Link(GB, 1e-5), Link(10 * GB, 2e-6), algorithm="hierarchical"),
        Setting(1, 4, None, Link(10 * GB, 2e-6), mode="ps-sync", servers=4),
    ]
    for full in cases:
        slow = dataclasses.replace(full, intra=Link(2.5 * GB, 2e-6))
        fraction = dataclasses.replace(full, intra_efficiency=0.25)
        assert predict(profile, fraction).step_seconds == pytest.approx(predict(profile, slow).step_seconds)
        assert predict(profile, fraction).step_seconds > predict(profile, full).step_seconds
    assert "(devices' link at 25.0% of its rate)" in describe_setting(
        dataclasses.replace(cases[0], intra_efficiency=0.25)
    )
    assert Setting(1, 4, None, Link(GB)).framework_costs()["intra_bits_per_sec"] == pytest.approx(8 * GB)
    with pytest.raises(ConfigError, match=r"--intra-efficiency is a fraction of line rate in \(0, 1\], got 1.5"):
        Setting(1, 4, None, Link(GB), intra_efficiency=1.5)


def test_partial_overlap_by_hand():
    # make_profile: buckets of 25 and 15 MB ready at 0.06 s and 0.2 s (end of backward); 2 hosts at 1 GB/s:
    # each bucket's ring moves 1/2 x 2 x its size: 25 ms then 15 ms; the first hides, the second is exposed
    profile = make_profile()
    perfect = predict(profile, Setting(2, 1, Link(GB), None))
    assert perfect.comm_seconds == pytest.approx(0.015)
    none = predict(profile, Setting(2, 1, Link(GB), None, overlap=0.0))
    assert none.comm_seconds == pytest.approx(0.040)
    half = predict(profile, Setting(2, 1, Link(GB), None, overlap=0.5, step_overhead=0.002))
    assert half.comm_seconds == pytest.approx(0.5 * 0.015 + 0.5 * 0.040 + 0.002)


@pytest.fixture
def published() -> Any:
    """``benchmarks/plan_published.py`` as a module."""
    return load_benchmark("plan_published")


def test_published_validation_set_is_complete(published):
    """Every published row names where it is from and has a one-GPU figure of its own source to calibrate on."""
    bench = published
    rows = bench.load_rows()
    singles = {r.calibration_key for r in rows if r.gpus == 1}
    scored = [r for r in rows if r.gpus > 1]
    known = bench.systems()
    assert all(r.where and r.assumed and r.system in known for r in rows)  # where it was read, what was assumed
    assert all(r.calibration_key in singles for r in scored)
    assert all(r.grad_bytes in (2, 4) and r.hosts <= r.gpus and r.gpus % r.hosts == 0 for r in rows)
    clusters = bench.cluster_results()
    assert len(scored) + len(clusters) >= 150
    assert len({r.source for r in rows} | {r.source for r, _, _ in clusters}) >= 5
    # every regime: one host and many, all-reduce and parameter servers; 1 Gbit Ethernet to InfiniBand
    assert {r.regime for r in scored} >= {
        "one host, all-reduce",
        "one host, ps",
        "multi-host, all-reduce",
        "multi-host, ps",
    }
    rates = {known[r.system]["nic"] for r in scored if r.hosts > 1}
    assert "100Gbps" in rates and "10Gbps" in rates
    assert any(r.source == "the MXNet distributed page" for r, _, _ in clusters)  # 1 Gbit Ethernet
    # every multi-host all-reduce row has its table's one-host row of as many GPUs as a host has to plan from
    measured_host = bench.from_measured_hosts(rows, known)
    assert len(measured_host) == sum(r.hosts > 1 and r.mode == "allreduce" for r in rows) > 100
    measured_two = bench.from_measured_hosts(rows, known, 2)  # and the two-host row of every larger one
    assert len(measured_two) == sum(r.hosts > 2 and r.mode == "allreduce" for r in rows) > 50


def test_held_out_sources_are_complete_and_kept_out_of_the_set(published):
    """The held-out rows (``--held-out``) name where they are from and what was assumed, plan on systems that say
    whether their GPUs have peer access, calibrate on a one-GPU row of their own table (but the one whose table
    has none at its batch), and are neither fitted on nor counted in the validation set."""
    bench = published
    rows, known = bench.load_rows(bench.HELD_OUT), bench.systems()
    assert len(rows) > 200 and not {r.where for r in rows} & {r.where for r in bench.load_rows()}
    assert all(r.where and r.assumed and r.series and "peer_access" in known[r.system] for r in rows)
    singles = bench.one_gpu_rows(rows)
    missing = [r for r in rows if r.gpus > 1 and r.calibration_key not in singles]
    assert [(r.system, r.model, r.precision, r.gpus) for r in missing] == [
        ("lambda-a100-pcie", "inception_v3", "fp16", 4)
    ]
    pcie = bench.setting_for(next(r for r in rows if r.system == "lambda-a100-pcie"), known["lambda-a100-pcie"])[0]
    assert pcie.intra is not None and pcie.intra.bandwidth == pytest.approx(31.5e9)  # NCCL over PCIe 4.0 x16
    assert known["lambda-a100-pcie"]["overlap"] == known["dgx1v"]["overlap"]  # the set's NCCL figures


def test_the_floor_of_a_framework_blind_plan_is_the_best_guess_that_grows_with_the_step(published):
    """Rows a plan cannot tell apart but by their one-GPU step: a longer step may only scale better. Where the
    published rows do so, a plan can follow them exactly; where the shorter step scales better, the best plan is
    one guess for both, and the floor is its error; against brute force over every non-decreasing guess."""
    floor = published.monotone_floor
    assert floor([(1.0, 0.5), (2.0, 1.0)]) == [0.0, 0.0]
    assert floor([(1.0, 1.0), (2.0, 0.5)]) == [0.5, 0.0]  # 0.5 for both: mean 0.25 (1.0 for both: 0.5)
    assert floor([(2.0, 0.5), (1.0, 1.0)]) == [0.0, 0.5]  # the order given is kept
    rng = random.Random(0)
    for _ in range(200):
        members = [(rng.random(), rng.uniform(0.2, 1.0)) for _ in range(rng.randint(1, 5))]
        by_step = sorted(range(len(members)), key=lambda i: members[i][0])
        values = sorted({e for _, e in members})
        best = min(
            sum(abs(g / members[i][1] - 1) for g, i in zip(guesses, by_step))
            for guesses in itertools.combinations_with_replacement(values, len(members))
        )
        assert sum(floor(members)) == pytest.approx(best)


def test_a_framework_blind_floor_groups_only_tables_a_plan_cannot_tell_apart(published):
    """The groups hold rows of several tables that agree on system, model, precision, gradient bytes, batch, GPUs,
    hosts, mode and data, with each table's efficiency over its own one GPU."""
    groups = published.blind_groups(published.load_rows())
    assert sum(len(g) for g in groups.values()) > 200
    for key, members in groups.items():
        assert len({r.calibration_key for r, _, _ in members}) > 1
        for r, eff, step in members:
            assert (r.system, r.model, r.precision, r.grad_bytes, r.batch, r.gpus, r.hosts, r.mode, r.data) == key
            assert 0 < eff < 1.2 and step > 0


TF2 = "TensorFlow 2.x official models (MultiWorkerMirroredStrategy)"
NLP = "MXNet gluon-nlp (Horovod)"


def _with_published(case: Any, images_per_sec: float) -> Any:
    return dataclasses.replace(case, row=dataclasses.replace(case.row, images_per_sec=images_per_sec))


def test_a_frameworks_figures_never_see_the_table_they_plan(published):
    """Leave one table out: a table's plan does not move when its own published figures do, and does when another
    table of its framework changes (the figures are fitted there)."""
    bench = published
    cases = [c for c in bench.row_cases(bench.load_rows(), bench.systems()) if bench.framework_of(c.row) == NLP]
    tables = sorted({bench.table_of(c.row) for c in cases}, key=repr)
    held, other = tables[0], tables[1]

    def plans(members: list[Any]) -> list[float]:
        return sorted(p for r, p, _ in bench.cross_validated(members) if bench.table_of(r) == held)

    def halved(table: Any) -> list[Any]:
        return [_with_published(c, c.row.images_per_sec / 2) if bench.table_of(c.row) == table else c for c in cases]

    before = plans(cases)
    assert plans(halved(held)) == before
    assert plans(halved(other)) != before


def test_fitted_figures_reproduce_the_rows_they_made(published):
    """Rows made by known figures (a framework at a fraction of both links, with a cost per step, part of its
    all-reduce hidden under backward and a host that feeds fewer images than its GPUs take) are planned back exactly
    by the figures fitted to them."""
    bench = published
    rows, known = bench.load_rows(), bench.systems()
    tf2 = [c for c in bench.row_cases(rows, known) if bench.framework_of(c.row) == TF2]
    key = next(k for c in tf2 if (k := bench.pipeline(c.row)) is not None)
    truth = bench.Figures(0.25, 0.5, step_overhead=bench.STEP_GRID[5], overlap=0.25)
    truth = truth.with_ceiling(key, bench.CEILING_GRID[11])
    made = [_with_published(c, c.plan(truth)) for c in tf2]
    fitted = bench.fit_figures(made)
    assert fitted != bench.BLIND
    assert all(c.plan(fitted) == pytest.approx(c.row.images_per_sec, rel=1e-9) for c in made)
    assert all(c.plan() > c.row.images_per_sec for c in made)  # blind, the same rows plan faster


def test_the_input_pipeline_is_read_from_the_tables_title(published):
    bench = published
    pipelines = {r.series: bench.pipeline(r) for r in bench.load_rows() if r.series}
    paddle, ngc_tf = (
        "PaddlePaddle 1.8 (fleet, NCCL) | resnet50 | amp | ",
        "NGC TensorFlow 1.x (Horovod, DALI) | resnet50 | ",
    )
    dali, own = ("dlperf-v100-edr", "DALI", "resnet50"), ("dlperf-v100-edr", "own", "resnet50")
    assert pipelines[paddle + "'ResNet50 v1.5 FP16 / batch size = 196 & with dali & without xla'"] == dali
    assert pipelines[paddle + "'ResNet50 v1.5 FP16 / batch size = 224 & without xla'"] == own
    assert pipelines[ngc_tf + "amp | 'ResNet50 V1.5 FP16 / batch size = 224 & without xla'"] == dali
    real = ngc_tf + "amp XLA | 'ResNet50 V1.5 FP16（真实数据 vs 合成数据） / real data & batch size = 224 & withxla'"
    assert pipelines[real] == own  # the DALI framework's table without DALI
    assert pipelines[real.replace("withxla'", "withxla & with dali'")] == dali
    assert pipelines[real.replace("real data", "synthetic data")] is None  # nothing decoded on the host
    assert not any(p for series, p in pipelines.items() if "| bert_base |" in series)  # text, not images


@pytest.mark.parametrize("hosts, per_host, intra", [(1, 4, None), (4, 1, None), (2, 2, None), (2, 2, Link(GB, 1e-6))])
def test_the_default_ring_is_the_setting_link(hosts, per_host, intra):
    """Emulated clusters' plans are unchanged: the default all-reduce is the ring over the setting's slow link."""
    from trainscale.plan.costs import ring_allreduce

    s = Setting(hosts, per_host, Link(GB / 8, 1e-4), intra)
    assert allreduce(40e6, s.fabric, s.algorithm) == pytest.approx(ring_allreduce(40e6, s.workers, s.link))


def test_a_hosts_input_pipeline_caps_its_devices():
    # 4 devices per host at batch 64, 0.3 s per step: 853 images/s per host; a pipeline of 400 images/s caps the step
    # at 4 x 64 / 400 = 0.64 s
    profile = make_profile()
    free = predict(profile, Setting(1, 4, None, Link(1e12)))
    capped = predict(profile, Setting(1, 4, None, Link(1e12), host_images_per_sec=400.0))
    assert capped.step_seconds == pytest.approx(0.64) and capped.images_per_sec == pytest.approx(400.0)
    assert predict(profile, Setting(1, 4, None, Link(1e12), host_images_per_sec=1e6)).step_seconds == free.step_seconds


Fit = Callable[[Profile, Setting, float], float]


def _check_fit_reproduces_and_carries(
    fit: Fit, setting: Setting, measured_on: dict[str, int], fraction_field: str, link_field: str
) -> None:
    """A link's fraction fitted to a throughput measured on part of ``setting`` (``measured_on``: two hosts, or two
    devices of one) plans that part at the measurement, and the whole as the same link that much slower."""
    profile = make_profile()
    part = dataclasses.replace(setting, **measured_on)
    measured = 0.6 * predict(profile, part).images_per_sec
    fraction = fit(profile, setting, measured)
    assert 0 < fraction < 1
    assert predict(profile, dataclasses.replace(part, **{fraction_field: fraction})).images_per_sec == pytest.approx(
        measured, rel=1e-6
    )
    link = getattr(setting, link_field)
    slower = Link(link.bandwidth * fraction, link.latency)
    assert predict(profile, dataclasses.replace(setting, **{fraction_field: fraction})) == predict(
        profile, dataclasses.replace(setting, **{link_field: slower})
    )


def _fitted_at_shares_of_the_plan(fit: Fit, setting: Setting, measured_on: dict[str, int]) -> list[float]:
    """The fractions fitted to 1.3, 1.0, 0.9 and 0.5 times the planned throughput of the measured part."""
    profile = make_profile()
    planned = predict(profile, dataclasses.replace(setting, **measured_on)).images_per_sec
    return [fit(profile, setting, f * planned) for f in (1.3, 1.0, 0.9, 0.5)]


class TestFittedToOneHost:
    """The framework's cost per step fitted to a throughput measured on one host (plan --one-host-images-per-sec)."""

    def test_by_hand(self):
        # make_profile: 0.3 s a step at batch 64; 4 workers on one host over a link too fast to matter plan
        # 4 x 64 / 0.3 = 853 images/s; measured 640 images/s is a 0.4 s step: 0.1 s the framework's
        profile = make_profile()
        host = Setting(1, 4, None, Link(1e15))
        assert fit_step_overhead(profile, host, 640.0) == pytest.approx(0.1, abs=1e-6)

    def test_one_host_reproduces_the_measurement_and_the_cost_carries_to_more_hosts(self):
        profile = make_profile()
        cluster = Setting(4, 8, Link(GB / 8, 1e-5), Link(10 * GB, 1e-6), overlap=0.3)
        one = dataclasses.replace(cluster, hosts=1)
        measured = 0.7 * predict(profile, one).images_per_sec
        cost = fit_step_overhead(profile, cluster, measured)
        assert predict(profile, dataclasses.replace(one, step_overhead=cost)).images_per_sec == pytest.approx(measured)
        plain, fitted = (predict(profile, dataclasses.replace(cluster, step_overhead=c)) for c in (0.0, cost))
        assert fitted.step_seconds == pytest.approx(plain.step_seconds + cost)

    def test_a_lower_measurement_is_a_larger_cost_and_one_at_or_above_the_plan_none(self):
        profile = make_profile()
        host = Setting(1, 4, None, Link(10 * GB, 1e-6))
        planned = predict(profile, host).images_per_sec
        costs = [fit_step_overhead(profile, host, f * planned) for f in (1.2, 1.0, 0.9, 0.5)]
        assert costs[:2] == [0.0, 0.0] and 0 < costs[2] < costs[3]

    def test_a_binding_input_pipeline_is_counted_before_the_cost(self):
        # the host's pipeline caps the 4 workers at 400 images/s (0.64 s a step): a host measured at 500 leaves
        # nothing to fit; one at 300 (0.853 s a step) leaves 0.853 - 0.3 s of framework cost
        profile = make_profile()
        host = Setting(1, 4, None, Link(1e15), host_images_per_sec=400.0)
        assert fit_step_overhead(profile, host, 500.0) == 0.0
        assert fit_step_overhead(profile, host, 300.0) == pytest.approx(4 * 64 / 300 - 0.3, abs=1e-6)

    def test_only_the_synchronous_all_reduce_is_fitted(self):
        with pytest.raises(ConfigError, match=r"cost per step \(--mode sync\), not --mode async"):
            fit_step_overhead(make_profile(), Setting(1, 4, None, Link(GB), "async"), 100.0)


class TestFittedToTwoHosts:
    """The link's achieved fraction of its line rate fitted to a throughput measured on two hosts
    (plan --two-host-images-per-sec)."""

    def test_by_hand(self):
        # two hosts of one worker, nothing hidden: the ring moves the gradients once, 0.1 s at line rate; measured
        # 128 images in 0.7 s is 0.3 s of compute and 0.4 s on the wire: a quarter of the line rate
        profile = make_profile()
        line = Link(profile.gradient_bytes / 0.1)
        two = Setting(2, 1, line, None, overlap=0.0)
        assert predict(profile, two).step_seconds == pytest.approx(0.4)
        assert fit_link_efficiency(profile, two, 128 / 0.7) == pytest.approx(0.25, rel=1e-9)

    def test_two_hosts_reproduce_the_measurement_and_the_fraction_carries_to_more_hosts(self):
        cluster = Setting(8, 4, Link(GB / 8, 1e-5), Link(10 * GB, 1e-6), overlap=0.3, algorithm="auto")
        _check_fit_reproduces_and_carries(fit_link_efficiency, cluster, {"hosts": 2}, "efficiency", "inter")

    def test_a_lower_measurement_is_a_slower_link_and_one_at_or_above_the_plan_line_rate(self):
        two = Setting(2, 4, Link(GB / 8, 1e-5), Link(10 * GB, 1e-6), overlap=0.0)
        fractions = _fitted_at_shares_of_the_plan(fit_link_efficiency, two, {})
        assert fractions[:2] == [1.0, 1.0] and 1 > fractions[2] > fractions[3] > 0

    def test_a_gap_the_link_cannot_explain_and_other_modes_are_refused(self):
        profile = make_profile()
        two = Setting(2, 1, Link(1e15), None, overlap=0.0)  # the wire costs nothing even at 1e-4 of this rate
        with pytest.raises(ConfigError, match="so the gap is not the link"):
            fit_link_efficiency(profile, two, 10.0)
        with pytest.raises(ConfigError, match=r"link between hosts \(--mode sync\), not --mode localsgd"):
            fit_link_efficiency(profile, dataclasses.replace(two, mode="localsgd"), 100.0)

    def test_a_fitted_efficiency_replaces_the_cluster_files_and_is_refused_beside_the_flag(self):
        from trainscale.plan.plan import PlanConfig, setting_from

        profile = make_profile()
        cfg = PlanConfig(cluster="example-a100-ib", step_time="100ms", batch_size=64)
        given, _, _ = setting_from(cfg, profile)
        host = predict(profile, dataclasses.replace(given, hosts=1)).images_per_sec
        two = predict(profile, dataclasses.replace(given, hosts=2, efficiency=1.0)).images_per_sec
        fitted, _, origin = setting_from(
            dataclasses.replace(cfg, one_host_images_per_sec=host, two_host_images_per_sec=0.5 * two), profile
        )
        assert fitted.efficiency < given.efficiency and "fitted to your two hosts' " in origin
        with pytest.raises(ConfigError, match="or --efficiency, not both"):
            setting_from(
                dataclasses.replace(cfg, one_host_images_per_sec=host, two_host_images_per_sec=two, efficiency=0.5),
                profile,
            )
        with pytest.raises(ConfigError, match="needs --one-host-images-per-sec"):
            setting_from(dataclasses.replace(cfg, two_host_images_per_sec=two), profile)


class TestFittedToTwoDevices:
    """The achieved fraction of the link between a host's devices fitted to a throughput measured on two of them
    (plan --two-device-images-per-sec): what a spec does not say, GPUs without peer access above all."""

    def test_by_hand(self):
        # two devices of one host, nothing hidden: the ring moves the gradients once, 0.1 s at the link's rate;
        # measured 128 images in 0.7 s is 0.3 s of compute and 0.4 s on the link: a quarter of its rate
        profile = make_profile()
        host = Setting(1, 8, None, Link(profile.gradient_bytes / 0.1), overlap=0.0)
        assert predict(profile, dataclasses.replace(host, per_host=2)).step_seconds == pytest.approx(0.4)
        assert fit_intra_efficiency(profile, host, 128 / 0.7) == pytest.approx(0.25, rel=1e-9)

    def test_two_devices_reproduce_the_measurement_and_the_fraction_carries_to_more(self):
        host = Setting(1, 8, None, Link(10 * GB, 1e-6), overlap=0.3)
        _check_fit_reproduces_and_carries(fit_intra_efficiency, host, {"per_host": 2}, "intra_efficiency", "intra")

    def test_a_lower_measurement_is_a_slower_link_and_one_at_or_above_the_plan_its_full_rate(self):
        host = Setting(1, 4, None, Link(10 * GB, 1e-6), overlap=0.0)
        fractions = _fitted_at_shares_of_the_plan(fit_intra_efficiency, host, {"per_host": 2})
        assert fractions[:2] == [1.0, 1.0] and 1 > fractions[2] > fractions[3] > 0

    def test_a_gap_the_link_cannot_explain_other_modes_and_no_link_are_refused(self):
        profile = make_profile()
        host = Setting(1, 4, None, Link(1e15), overlap=0.0)  # the link costs nothing even at 1e-4 of this rate
        with pytest.raises(ConfigError, match="inside a host the plan of two devices trains faster.*not the link"):
            fit_intra_efficiency(profile, host, 10.0)
        with pytest.raises(ConfigError, match=r"a host's devices \(--mode sync\), not --mode ps-sync"):
            fit_intra_efficiency(profile, dataclasses.replace(host, mode="ps-sync"), 100.0)
        with pytest.raises(ConfigError, match="give --intra-bandwidth, or a cluster file with"):
            fit_intra_efficiency(profile, dataclasses.replace(host, intra=None), 100.0)

    def test_a_fitted_efficiency_replaces_the_cluster_files_and_each_bad_input_is_one_line(self):
        from trainscale.plan.plan import PlanConfig, setting_from

        profile = make_profile()
        cfg = PlanConfig(cluster="example-a100-ib", step_time="100ms", batch_size=64, hosts=1)
        given, _, _ = setting_from(cfg, profile)
        two = predict(profile, dataclasses.replace(given, per_host=2)).images_per_sec
        fitted, _, origin = setting_from(dataclasses.replace(cfg, two_device_images_per_sec=0.5 * two), profile)
        assert fitted.intra_efficiency < given.intra_efficiency and "fitted to your two devices' " in origin
        assert "the devices' link at its full rate" not in origin
        refusals = {
            "or --intra-efficiency, not both": dict(two_device_images_per_sec=two, intra_efficiency=0.5),
            "this plan has one worker per host": dict(two_device_images_per_sec=two, workers_per_host=1),
        }
        for message, change in refusals.items():
            with pytest.raises(ConfigError, match=message):
                setting_from(dataclasses.replace(cfg, **change), profile)
        bare = PlanConfig(params=25_000_000, step_time="100ms", batch_size=64, hosts=1, workers_per_host=8)
        with pytest.raises(ConfigError, match=r"give its rate \(--intra-bandwidth"):
            setting_from(dataclasses.replace(bare, two_device_images_per_sec=100.0), profile)


def test_a_bandwidth_sweep_and_the_crossovers_charge_the_transports_efficiency():
    from trainscale.plan.methods import parse_spec
    from trainscale.plan.plan import with_bandwidth
    from trainscale.plan.predict import crossover

    profile = make_profile()
    half = Setting(4, 2, Link(GB, 1e-5), Link(10 * GB, 1e-6), efficiency=0.5, algorithm="ring")
    swept = with_bandwidth(half, "4gbit")  # 0.5 GB/s of line rate, 0.25 GB/s as driven
    assert predict(profile, swept) == predict(
        profile, dataclasses.replace(swept, inter=Link(GB / 4, 1e-5), efficiency=1)
    )
    bf16 = dataclasses.replace(half, spec=parse_spec("bf16"))  # 2 ms to encode and decode: dense wins on fast links
    full = crossover(profile, dataclasses.replace(bf16, efficiency=1.0), dataclasses.replace(half, efficiency=1.0))
    assert full is not None and crossover(profile, bf16, half) == pytest.approx(2 * full, rel=1e-3)


def test_a_fitted_cost_replaces_the_profiles_measured_one_and_says_so():
    from trainscale.plan.plan import PlanConfig, setting_from

    profile = dataclasses.replace(make_profile(), overlap=0.5, step_overhead=0.004, overlap_seconds={"comm": 0.01})
    cfg = PlanConfig(hosts=2, workers_per_host=4, bandwidth="1gbit")
    measured, _, origin = setting_from(cfg, profile)
    assert measured.step_overhead == 0.004 and "DDP's cost per step 4.0 ms" in origin
    host = predict(profile, dataclasses.replace(measured, hosts=1, step_overhead=0.0)).images_per_sec
    fitted, _, origin = setting_from(dataclasses.replace(cfg, one_host_images_per_sec=0.5 * host), profile)
    assert fitted.step_overhead > 0.1 and fitted.overlap == 0.5
    assert "fitted to your one host's" in origin and "DDP's cost per step" not in origin


def test_a_sweep_without_bandwidths_plans_at_the_plans_own_line_rate():
    """Its rows are the plan's: the transport's efficiency charged once (a sweep once took the rate already
    charged as its line rate, and charged it again)."""
    from trainscale.plan.cli import run_sweep, sweep_axes
    from trainscale.plan.plan import PlanConfig, setting_from

    profile = make_profile()
    cfg = PlanConfig(hosts=2, workers_per_host=2, bandwidth="1gbit", efficiency=0.5, sweep=["workers=2,4"])
    setting, _, _ = setting_from(cfg, profile)
    rows = run_sweep(profile, setting, *sweep_axes(cfg.sweep, setting))["rows"]
    assert [(r["bandwidth"], r["workers"]) for r in rows] == [("1gbit", 2), ("1gbit", 4)]
    assert rows[1]["images_per_sec"] == predict(profile, setting).images_per_sec


@pytest.mark.parametrize(
    "sweep, fragment",
    [
        (["workers=2,3"], "--sweep workers=3: hosts of 2 workers hold 1 to 2 workers or a multiple of 2"),
        (["workers=2", "workers=4"], "--sweep workers= given twice"),
        (["bandwidth=1gbit", "bandwidth=10gbit"], "--sweep bandwidth= given twice"),
    ],
)
def test_a_sweep_cell_never_plans_another_count_than_its_row_says(sweep, fragment):
    from trainscale.plan.cli import sweep_axes

    with pytest.raises(ConfigError, match=fragment):
        sweep_axes(sweep, Setting(2, 2, Link(GB), Link(10 * GB)))


def test_the_time_hidden_under_backward_is_communication_only():
    """The framework's cost per step is exposed, but it is not communication that failed to hide."""
    profile = make_profile()
    base = Setting(2, 2, Link(GB, 1e-5), Link(10 * GB, 1e-6), overlap=0.5)
    hidden = [predict(profile, dataclasses.replace(base, step_overhead=s)).hidden_seconds for s in (0.0, 1e-3, 2e-3)]
    assert hidden[0] > 0 and hidden == [hidden[0]] * 3


@pytest.mark.parametrize(
    "flags, fragment",
    [
        ({"servers": 4}, "--servers is for --mode ps-sync or async, and this plan is --mode sync"),
        ({"ps_assignment": "by_size", "mode": "localsgd"}, "--ps-assignment is for --mode ps-sync or async"),
        ({"sync_every": 8, "mode": "async"}, "--sync-every is for --mode localsgd or diloco"),
        ({"params": 10**6, "profile": "mine.json"}, "--params plans a model without a profile; drop --profile"),
    ],
)
def test_a_flag_the_plan_would_not_read_is_refused(flags, fragment):
    from trainscale.plan.cli import run_plan
    from trainscale.plan.plan import PlanConfig

    base = {"hosts": 2, "bandwidth": "1gbit", "params": 10**6, "step_time": "100ms", "batch_size": 64}
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        run_plan(PlanConfig(**{**base, **flags}))


def test_a_sweep_past_one_host_takes_the_link_between_hosts():
    from trainscale.plan.plan import PlanConfig, setting_from, unused_bandwidth

    cfg = PlanConfig(hosts=1, bandwidth="1gbit", params=10**6, step_time="100ms", batch_size=64, sweep=["workers=1,2"])
    setting, _, origin = setting_from(cfg, make_profile())
    assert setting.inter is not None and "between a host's workers" not in origin
    assert "unused" not in unused_bandwidth(cfg, setting, [1, 2])
    assert "--bandwidth 1gbit unused: one host" in unused_bandwidth(cfg, setting, [1])
    many, _, origin = setting_from(PlanConfig(hosts=2, workers_per_host=4, bandwidth="1gbit"), make_profile())
    assert "no limit on the link between a host's workers" in origin


def test_params_far_from_the_named_model_are_said_in_the_plan():
    from trainscale.plan.plan import PlanConfig, compute_scale

    given = {"params": 10**6, "step_time": "100ms", "batch_size": 64}
    _, origin = compute_scale(PlanConfig(model="resnet50", **given), make_profile(), None)
    assert "note: --model resnet50 has 23,520,842 parameters here" in origin
    _, origin = compute_scale(PlanConfig(model="resnet9", **{**given, "params": 6_500_000}), make_profile(), None)
    assert "note:" not in origin


def test_where_adding_hosts_stops_paying_is_the_first_host_count_that_gains_under_3_percent(published, capsys):
    """Each host count at its most GPUs; a series on one host is not counted."""
    row = published.Row("src", "sys", "resnet50", 1, 1, 64, "allreduce", "synthetic", 100.0, "here")

    def at(gpus: int, hosts: int, images_per_sec: float, planned: float, model: str = "resnet50") -> tuple:
        r = dataclasses.replace(row, gpus=gpus, hosts=hosts, images_per_sec=images_per_sec, model=model)
        return r, planned, planned / images_per_sec - 1

    stops = [at(4, 1, 50, 50), at(8, 1, 100, 100), at(16, 2, 190, 150), at(32, 4, 192, 250)]
    agrees = [at(8, 1, 100, 100, "vgg16"), at(16, 2, 150, 160, "vgg16"), at(32, 4, 300, 320, "vgg16")]
    one_host = [at(1, 1, 10, 10, "alexnet"), at(8, 1, 9, 80, "alexnet")]
    published.host_limits(stops + agrees + one_host)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-2:] == ["2", "50%"]
    assert out[1:] == [
        "  disagrees: src, sys, resnet50 fp32 batch 64: published stops paying at 4 hosts, planned pays up to 4 hosts"
    ]
