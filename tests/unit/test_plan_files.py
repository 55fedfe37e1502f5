"""The planner's input files, checked once against their schema: every bad value is one ConfigError naming
the file (and the line, where TOML gives one), never a traceback and never a plan built on nonsense."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_plan import make_profile
from trainscale.errors import ConfigError
from trainscale.plan.describe import CHECKOUT_CONFIGS, load_cluster, load_device, parse_link
from trainscale.plan.profile import load_profile

CLUSTER = (CHECKOUT_CONFIGS / "clusters" / "pslite-gtx980.toml").read_text()
DEVICE = (CHECKOUT_CONFIGS / "devices" / "gtx980.toml").read_text()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "f.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "old, new, fragment",
    [
        ("hosts = 5\n", 'hosts = "five"\n', r":16: key 'hosts' must be a whole number, got 'five'"),
        ("hosts = 5\n", "hosts = 0\n", r":16: key 'hosts' must be a positive number, got 0"),
        ("hosts = 5\n", "hosts = 2.5\n", "key 'hosts' must be a whole number"),
        ("hosts = 5\n", "hosts = 99999999999999999999999\n", "key 'hosts' must be at most"),
        ('name = "pslite-gtx980"', "name = {a = 1}", r":13: key 'name' must be text"),
        ('device = "gtx980"', "device = 3", "key 'device' must be text, got 3"),
        (
            '[link.inter]\nbandwidth = "1gbit"',
            "[link.inter]\nbandwidth = 1000",
            r":22: \[link.inter\] key 'bandwidth' must "
            "be text",
        ),
        ('latency = "50us"', "latency = 5", r"\[link.inter\] key 'latency' must be text"),
        ("devices = 10", "devices = 0", r":59: \[\[published\]\] #3 key 'devices' must be a positive number, got 0"),
        ("images_per_sec = 714.29\n", "", r"\[\[published\]\] #1 missing key 'images_per_sec'"),
        ("images_per_sec = 714.29", "images_per_sec = nan", "key 'images_per_sec' must be a positive number, got nan"),
        ("batch_size = 256", 'batch_size = "256"', r"\[\[published\]\] #1 key 'batch_size' must be a whole number"),
        ("devices = 10\nhosts = 5", "devices = 2\nhosts = 5", "key 'hosts' is 5, more than its 2 devices"),
        ("workers_per_host = 1", "workers_per_host = 0", "key 'workers_per_host' must be a positive number"),
        (
            "devices = 10\nhosts = 5",
            "devices = 9\nhosts = 5",
            r":59: \[\[published\]\] #3 key 'devices' is 9, not a whole",
        ),
        (
            "devices = 10\nhosts = 5",
            "devices = 12\nhosts = 6",
            "12 devices on 6 host.s., more than the cluster's 5 x 2",
        ),
        (
            "devices = 10\nhosts = 5",
            "devices = 12\nhosts = 4",
            "12 devices on 4 host.s., more than the cluster's 5 x 2",
        ),
        ('mode = "ps-sync"', 'mode = "bsp"', r"\[\[published\]\] #3 key 'mode' is 'bsp'; the planner knows sync"),
        (
            'model = "inception_bn_small"',
            'model = "inception_bn_big"',
            "key 'model' is 'inception_bn_big', not a model",
        ),
        ('device = "gtx980"', 'device = "gtx9800"', r":18: key 'device': unknown device 'gtx9800'"),
    ],
)
def test_bad_cluster_file_is_one_line_with_its_line(tmp_path, old, new, fragment):
    assert old in CLUSTER
    path = write(tmp_path, CLUSTER.replace(old, new, 1))
    with pytest.raises(ConfigError, match=f"^{path}.*{fragment}"):
        load_cluster(str(path))


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ("link = 3", r":3: key 'link' must be a table, got 3"),
        ("published = [1, 2]", r":3: key 'published' must be an array of tables"),
        ('[link]\ninter = "fast"', r":4: \[link\] key 'inter' must be a table"),
    ],
)
def test_a_value_where_a_table_goes(tmp_path, extra, fragment):
    path = write(tmp_path, f'name = "x"\nhosts = 1\n{extra}\n')
    with pytest.raises(ConfigError, match=f"^{path}{fragment}"):
        load_cluster(str(path))


@pytest.mark.parametrize(
    "old, new, fragment",
    [
        (
            "images_per_sec = 714.29",
            "images_per_sec = 0",
            r":16: \[\[throughput\]\] #1 key 'images_per_sec' must be a "
            "positive number, got 0",
        ),
        ("images_per_sec = 714.29", "images_per_sec = nan", "must be a positive number, got nan"),
        ("images_per_sec = 714.29", "images_per_sec = -3", "must be a positive number, got -3"),
        ('model = "inception_bn_small"\n', "", r":13: \[\[throughput\]\] #1 missing key 'model'"),
        ("batch_size = 256", "batch_size = 25.6", "key 'batch_size' must be a whole number, got 25.6"),
        ('model = "inception_bn_small"', 'model = ["mlp"]', "key 'model' must be text"),
    ],
)
def test_bad_device_file_is_one_line_with_its_line(tmp_path, old, new, fragment):
    path = write(tmp_path, DEVICE.replace(old, new, 1))
    with pytest.raises(ConfigError, match=f"^{path}{fragment}" if fragment.startswith(":") else fragment):
        load_device(str(path))


def test_a_device_path_in_a_cluster_file_is_relative_to_that_file(tmp_path, monkeypatch):
    (tmp_path / "mine" / "devs").mkdir(parents=True)
    (tmp_path / "mine" / "devs" / "card.toml").write_text(DEVICE)
    (tmp_path / "mine" / "clusters").mkdir()
    cluster = tmp_path / "mine" / "clusters" / "c.toml"
    cluster.write_text(CLUSTER.replace('device = "gtx980"', 'device = "../devs/card.toml"'))
    monkeypatch.chdir(tmp_path)  # elsewhere: ../devs/card.toml does not exist from here
    found = load_cluster(str(cluster)).device
    assert found is not None and Path(found).resolve() == (tmp_path / "mine" / "devs" / "card.toml").resolve()
    assert load_device(found).step_seconds("inception_bn_small", 256)[0] == pytest.approx(256 / 714.29)
    cluster.write_text(CLUSTER.replace('device = "gtx980"', 'device = "../devs/nope.toml"'))
    with pytest.raises(ConfigError, match=r":18: key 'device' '../devs/nope.toml': no such device file"):
        load_cluster(str(cluster))


def test_a_device_name_beside_the_cluster_file_wins(tmp_path):
    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / "mycard.toml").write_text(DEVICE.replace('name = "gtx980"', 'name = "mycard"'))
    (tmp_path / "clusters").mkdir()
    cluster = tmp_path / "clusters" / "c.toml"
    cluster.write_text(CLUSTER.replace('device = "gtx980"', 'device = "mycard"'))
    assert load_device(load_cluster(str(cluster)).device or "").name == "mycard"


def test_the_device_figure_in_the_profiles_precision(tmp_path):
    path = write(
        tmp_path,
        DEVICE + '\n[[throughput]]\nmodel = "inception_bn_small"\nbatch_size = 256\n'
        'images_per_sec = 2000.0\nprecision = "fp16"\nsource = "x"\n',
    )
    device = load_device(str(path))
    assert device.step_seconds("inception_bn_small", 256, "fp32")[0] == pytest.approx(256 / 714.29)
    assert device.step_seconds("inception_bn_small", 256, "fp16")[0] == pytest.approx(256 / 2000)
    with pytest.raises(ConfigError, match="has inception_bn_small only in fp16, fp32, not bf16"):
        device.step_seconds("inception_bn_small", 256, "bf16")
    bad = write(tmp_path, DEVICE.replace('precision = "fp32"', 'precision = "half"', 1))
    with pytest.raises(ConfigError, match=r":17: \[\[throughput\]\] #1 key 'precision' is 'half'; give one of fp32"):
        load_device(str(bad))


@pytest.mark.parametrize(
    "text, bits",
    [("25gbit", 25e9), ("25Gbps", 25e9), ("25 Gb/s", 25e9), ("25Gbit/s", 25e9), ("12GB/s", 96e9), ("100mbps", 1e8)],
)
def test_rate_spellings(text, bits):
    assert parse_link(text).bandwidth * 8 == pytest.approx(bits)


def test_an_unknown_rate_says_bits():
    with pytest.raises(
        ConfigError, match=r"--bandwidth must be a rate in bits per second such as 25gbit.*12GB/s = 96gbit"
    ):
        parse_link("25 gigs")


def test_throughput_that_is_not_an_array_of_tables(tmp_path):
    path = write(tmp_path, DEVICE.split("[[throughput]]")[0] + "throughput = 3\n")
    with pytest.raises(ConfigError, match="key 'throughput' must be an array, got 3"):
        load_device(str(path))


def test_a_folder_named_as_a_file_is_one_line(tmp_path):
    (tmp_path / "c.toml").mkdir()
    with pytest.raises(ConfigError, match="cluster file .* is not a file"):
        load_cluster(str(tmp_path / "c.toml"))


def test_the_shipped_files_all_load():
    for path in sorted((CHECKOUT_CONFIGS / "clusters").glob("*.toml")):
        load_cluster(str(path))
    for path in sorted((CHECKOUT_CONFIGS / "devices").glob("*.toml")):
        load_device(str(path))


def _set(*keys: Any) -> Callable[[dict[str, Any]], None]:
    def change(raw: dict[str, Any]) -> None:
        target = raw
        for key in keys[:-2]:
            target = target[key]
        target[keys[-2]] = keys[-1]

    return change


@pytest.mark.parametrize(
    "change, fragment",
    [
        (_set("forward", "median", math.nan), "forward.median must be a finite number >= 0, got nan"),
        (_set("backward", "median", -1.0), "backward.median must be a finite number >= 0, got -1"),
        (_set("batch_size", "big"), "batch_size must be a whole number, got 'big'"),
        (_set("model", {"a": 1}), "model must be text"),
        (_set("buckets", 0, "nbytes", "x"), r"buckets\[0\].nbytes must be a whole number"),
        (_set("compressors", "bf16", "encode", "median", math.inf), "compressors.bf16.encode.median must be a finite"),
        (
            _set("compressors", "bf16", "collectives", [["all_reduce", -5]]),
            r"compressors.bf16.collectives holds .*, not a \[kind, bytes\] pair",
        ),
        (_set("peak_memory_mb", math.nan), "peak_memory_mb must be a finite number"),
    ],
)
def test_profile_values_are_checked(tmp_path, change, fragment):
    raw = json.loads(make_profile().to_json())
    change(raw)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"^--profile {path}: {fragment}.*make it again"):
        load_profile(path)


def test_profile_whose_step_takes_no_time_plans_nothing(tmp_path):
    raw = json.loads(make_profile().to_json())
    for phase in ("data", "forward", "backward", "optimizer"):
        raw[phase]["median"] = 0.0
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="its step takes 0.0 s at batch 64, which plans nothing"):
        load_profile(path)


def test_profile_that_is_a_folder_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=f"--profile {tmp_path}: cannot be read"):
        load_profile(tmp_path)


def test_plan_json_stays_json_when_a_figure_is_not_finite(tmp_path, capsys, monkeypatch):
    """Machine-readable output: NaN or inf (here a prediction on a link of no latency and a zero step) is
    written as null, never as the NaN that strict JSON readers refuse."""
    from trainscale.plan import cli
    from trainscale.plan.plan import PlanConfig

    path = tmp_path / "p.json"
    path.write_text(make_profile().to_json())
    real = cli.predict

    def with_nan(*args: Any, **kw: Any) -> Any:
        prediction = real(*args, **kw)
        prediction.scaling_efficiency = math.nan
        return prediction

    monkeypatch.setattr(cli, "predict", with_nan)
    assert cli.run_plan(PlanConfig(profile=str(path), hosts=2, bandwidth="1gbit", json=True)) == 0
    plan = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert plan["scaling_efficiency"] is None


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ("[system]\noverlap = 1.5", r"\[system\] key 'overlap' must be a fraction in \(0, 1\], got 1.5"),
        ('[system]\nalgorithm = "butterfly"', r"\[system\] key 'algorithm' is 'butterfly'; give auto, ring"),
        ('[system]\nps_assignment = "random"', r"key 'ps_assignment' is 'random'; give shard"),
        ('[system]\nbucket_overhead = "fast"', r":104: \[system\] key 'bucket_overhead' must look like 50us"),
    ],
)
def test_bad_system_table(tmp_path, extra, fragment):
    path = write(tmp_path, CLUSTER + "\n" + extra + "\n")
    with pytest.raises(ConfigError, match=fragment):
        load_cluster(str(path))


def test_system_table_and_nics(tmp_path):
    text = CLUSTER.replace(
        '[link.inter]\nbandwidth = "1gbit"', '[link.inter]\nnics = 2\nefficiency = 0.8\nbandwidth = "1gbit"'
    )
    text += '\n[system]\noverlap = 0.7\nbucket_overhead = "100us"\nalgorithm = "hierarchical"\n'
    system = load_cluster(str(write(tmp_path, text))).system
    assert (system.nics, system.efficiency, system.overlap, system.algorithm) == (2, 0.8, 0.7, "hierarchical")
    assert system.bucket_overhead == pytest.approx(1e-4)
    assert set(system.assumed) == {"step_overhead", "ps_efficiency", "host_images_per_sec", "intra_efficiency"}
    assert system.intra_efficiency == 1.0


def test_the_devices_link_efficiency_is_read_and_checked(tmp_path):
    text = CLUSTER.replace("[link.intra]\n", "[link.intra]\nefficiency = 0.25\n")
    assert text != CLUSTER
    system = load_cluster(str(write(tmp_path, text))).system
    assert (system.intra_efficiency, "intra_efficiency" in system.assumed) == (0.25, False)
    bad = CLUSTER.replace("[link.intra]\n", "[link.intra]\nefficiency = 2\n")
    with pytest.raises(ConfigError, match=r"\[link.intra\] key 'efficiency' must be a fraction in \(0, 1\], got 2"):
        load_cluster(str(write(tmp_path, bad)))


@pytest.mark.parametrize(
    "flags, fragment",
    [
        ({"hosts": 3}, "3 hosts need a link between them: give --bandwidth"),
        ({"workers_per_host": 2}, "2 workers per host need a link between them: give --intra-bandwidth"),
        ({"intra_latency": "1ms"}, "--intra-latency needs a link: give --intra-bandwidth too"),
    ],
)
def test_a_flag_beside_a_cluster_file_without_that_link_is_refused(tmp_path, flags, fragment):
    from trainscale.plan.plan import PlanConfig, layout_of

    text = CLUSTER.replace("hosts = 5\n", "hosts = 1\n").replace("devices_per_host = 2\n", "devices_per_host = 1\n")
    text = text.split("[link.inter]")[0]  # neither link: one host of one device
    cluster = load_cluster(str(write(tmp_path, text)))
    assert layout_of(PlanConfig(cluster="f"), cluster) == (1, 1, None, None)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        layout_of(PlanConfig(cluster="f", **flags), cluster)


def test_servers_on_hosts_of_their_own_need_a_link_to_them():
    """One host of workers and its servers on hosts of their own (a cluster file's placement): without a link
    between hosts the servers' traffic would cost nothing, so the plan asks for one."""
    from trainscale.plan.describe import System
    from trainscale.plan.plan import PlanConfig, check_server_link

    separate = System(placement="separate")
    fragment = 'f\'s ps_placement = "separate" puts the parameter servers on hosts of their own: give --bandwidth'
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        check_server_link(PlanConfig(cluster="f", mode="ps-sync"), separate, None)
    check_server_link(PlanConfig(cluster="f", mode="sync"), separate, None)  # no servers in this mode
    check_server_link(PlanConfig(cluster="f", mode="async"), separate, parse_link("1gbit", "0us"))
    check_server_link(PlanConfig(cluster="f", mode="async"), System(), None)  # beside the workers


def test_flags_replace_the_cluster_files_layout_and_links():
    from trainscale.plan.plan import PlanConfig, layout_of

    cluster = load_cluster("pslite-gtx980")
    assert layout_of(PlanConfig(cluster="pslite-gtx980"), cluster) == (5, 2, cluster.inter, cluster.intra)
    hosts, per_host, inter, intra = layout_of(
        PlanConfig(cluster="pslite-gtx980", hosts=2, workers_per_host=4, latency="1ms", intra_bandwidth="8gbit"),
        cluster,
    )
    assert (hosts, per_host) == (2, 4)
    assert inter == parse_link("1gbit", "1ms") and intra == parse_link("8gbit", "10us")
    _, _, inter, _ = layout_of(PlanConfig(cluster="pslite-gtx980", bandwidth="10gbit"), cluster)
    assert inter == parse_link("10gbit", "50us")  # a rate alone keeps the file's latency


@pytest.mark.parametrize(
    "old, new, fragment",
    [
        (
            "devices_per_host = 2\n",
            "device_per_host = 2\n",
            r":17: key 'device_per_host' .*did you mean 'devices_per_h",
        ),
        ('topology = "switch"', 'topology = "nvswich"', r":19: key 'topology' is 'nvswich'; give one of switch"),
        (
            '[link.inter]\nbandwidth = "1gbit"',
            '[link.inter]\nnic = 2\nbandwidth = "1gbit"',
            r":22: \[link.inter\] key 'nic'",
        ),
        ("[link.inter]", "[link.intre]", r":21: \[link\] key 'intre' .*did you mean 'intra'"),
        ("devices = 10", "device = 10", r":59: \[\[published\]\] #3 key 'device' .*did you mean 'devices'"),
    ],
)
def test_a_misspelt_key_in_a_cluster_file_is_refused_not_dropped(tmp_path, old, new, fragment):
    """A key the planner does not read would plan the default in silence (``device_per_host = 8``: 8 hosts of
    one device); every table of the file is checked against what its reader takes."""
    assert old in CLUSTER
    path = write(tmp_path, CLUSTER.replace(old, new, 1))
    with pytest.raises(ConfigError, match=f"^{path}{fragment}"):
        load_cluster(str(path))


def test_a_misspelt_table_or_device_key_is_refused(tmp_path):
    path = write(tmp_path, CLUSTER + "\n[sytem]\noverlap = 0.5\n")
    with pytest.raises(ConfigError, match=r":103: key 'sytem' .*did you mean 'system'"):
        load_cluster(str(path))
    path = write(tmp_path, CLUSTER + "\n[system]\noverlapp = 0.5\n")
    with pytest.raises(ConfigError, match=r":104: \[system\] key 'overlapp' .*did you mean 'overlap'"):
        load_cluster(str(path))
    path = write(tmp_path, DEVICE.replace("batch_size = 256", "batch = 256", 1))
    with pytest.raises(ConfigError, match=r"\[\[throughput\]\] #1 key 'batch' .*did you mean 'batch_size'"):
        load_device(str(path))
