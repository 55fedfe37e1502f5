"""`trainscale cluster` without root: name validation, rate parsing and the ip/tc command lines it would run."""

from __future__ import annotations

import pytest

from trainscale.errors import ConfigError
from trainscale.runtime import cluster as net


@pytest.mark.parametrize("name", ["a", "demo", "Lab-2", "x" * 16])
def test_valid_names(name: str) -> None:
    assert net.validate_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "-a",
        "a b",
        "a_b",
        "a/b",
        "a.b",
        "x" * 17,
        "é",
        "a\nb",
        "a\n",
        "demo\n",
        "a\t",
        "a\x00",
        "..",
        "x" * 16 + "\n",
    ],
)
def test_invalid_names_are_one_line(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        net.validate_name(name)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "text, bits",
    [
        ("500kbit", 500_000),
        ("100mbit", 100_000_000),
        ("1gbit", 10**9),
        ("1.5mbit", 1_500_000),
        ("8000bit", 8000),
        (" 20MBit ", 20_000_000),
        ("1Gbit/s", 10**9),  # a data sheet's spellings, as `trainscale plan` takes them
        ("1Gb/s", 10**9),
        ("1 gbit", 10**9),
        ("125MB/s", 10**9),
    ],
)
def test_parse_rate(text: str, bits: int) -> None:
    assert net.parse_rate(text) == bits


@pytest.mark.parametrize(
    "text", ["", "100", "1gbps", "100mb", "fast", "-1mbit", "1kbit", "200gbit", "1e3mbit", "\u0661\u0660mbit"]
)
def test_bad_rates(text: str) -> None:
    with pytest.raises(ConfigError, match="--bandwidth"):
        net.parse_rate(text)


def test_bps_is_refused_for_a_shaped_link_and_bits_for_a_plan() -> None:
    """tc reads 1gbps as gigabytes per second, a NIC's data sheet as gigabits: a shaped link refuses the spelling
    and says both ways of writing it; the planner, which reads data sheets, takes bits."""
    from trainscale.plan.describe import parse_plan_rate

    with pytest.raises(ConfigError, match="^--bandwidth 1Gbps: tc reads bps as bytes per second, data sheets as bits; "
                       "write 1gbit for bits or 1GB/s for bytes$"):  # fmt: skip
        net.parse_rate("1Gbps")
    assert parse_plan_rate("1Gbps") == 10**9


def test_parse_rates_one_or_one_per_host() -> None:
    assert net.parse_rates("1gbit", 3) == [10**9] * 3
    assert net.parse_rates("1gbit,1gbit,100mbit", 3) == [10**9, 10**9, 10**8]
    with pytest.raises(ConfigError, match="one per host"):
        net.parse_rates("1gbit,100mbit", 3)


@pytest.mark.parametrize("hosts", [0, 1, 65])
def test_host_count_bounds(hosts: int) -> None:
    with pytest.raises(ConfigError, match="--hosts"):
        net.check_hosts(hosts)


def test_format_rate_round_trips() -> None:
    for text in ("500kbit", "100mbit", "1gbit", "1500kbit", "8001bit"):
        assert net.format_rate(net.parse_rate(text)) == text


def test_names_and_addresses() -> None:
    c = net.Cluster("lab", (10**9,) * 3)
    assert c.namespaces == ["tsc-lab-sw", "tsc-lab-h0", "tsc-lab-h1", "tsc-lab-h2"]
    assert [net.address(i) for i in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert net.address(63) == "10.77.0.64"


def test_each_host_resolves_the_machine_name_to_its_own_address() -> None:
    """As on real machines, where torchrun's c10d rendezvous compares the endpoint with the name's address."""
    lab = net.Cluster("lab", (10**9,) * 2)
    lines = [net.hosts_text(lab, i, "node-a.example").splitlines() for i in range(2)]
    assert [x[-1] for x in lines] == ["10.77.0.1 node-a.example", "10.77.0.2 node-a.example"]
    assert "10.77.0.1 h0 tsc-lab-h0" in lines[1]
    for odd in (None, "", "localhost", "h1", "a b", "#x"):
        assert net.hosts_text(lab, 0, odd) == net.hosts_text(lab, 0)


def test_burst_covers_one_tick_at_hz_100() -> None:
    for rate in (500_000, 20_000_000, 10**9, 10 * 10**9):
        assert net.burst_bytes(rate) >= rate / 8 / 100
    assert net.burst_bytes(500_000) == net.MIN_BURST_BYTES


def test_host_plan_shapes_both_directions() -> None:
    plan = net.plan_host(net.Cluster("lab", (10**9, 10**8)), 1)
    assert ["ip", "netns", "add", "tsc-lab-h1"] == plan[0]
    assert [
        "ip",
        "link",
        "add",
        "eth0",
        "netns",
        "tsc-lab-h1",
        "type",
        "veth",
        "peer",
        "name",
        "p1",
        "netns",
        "tsc-lab-sw",
    ] in plan
    assert ["ip", "-n", "tsc-lab-h1", "addr", "add", "10.77.0.2/24", "dev", "eth0"] in plan
    shapers = [argv for argv in plan if argv[0] == "tc"]
    assert [(a[2], a[6]) for a in shapers] == [("tsc-lab-h1", "eth0"), ("tsc-lab-sw", "p1")]
    assert all(a[a.index("rate") + 1] == "100000000bit" and "tbf" in a for a in shapers)


def test_switch_plan_and_link_commands() -> None:
    plan = net.plan_switch(net.Cluster("lab", (10**9, 10**9)))
    assert plan[0] == ["ip", "netns", "add", "tsc-lab-sw"]
    assert ["ip", "-n", "tsc-lab-sw", "link", "add", "br0", "type", "bridge"] in plan
    assert net.link_argv("lab", 2, up=False) == ["ip", "-n", "tsc-lab-sw", "link", "set", "p2", "down"]
    assert [a[2] for a in net.rate_plan("lab", 0, 10**6)] == ["tsc-lab-h0", "tsc-lab-sw"]


def test_namespaces_map_back_to_their_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    listing = "tsc-a-sw (id: 1)\ntsc-a-h0\ntsc-a-b-sw\ntsc-a-b-h10\nts-l0-abc123\nother\ntsc-a-h1-h0\n"
    monkeypatch.setattr(net, "run", lambda argv: listing)
    assert net.trainscale_namespaces() == {
        "a": ["tsc-a-sw", "tsc-a-h0"],
        "a-b": ["tsc-a-b-sw", "tsc-a-b-h10"],
        "a-h1": ["tsc-a-h1-h0"],
    }


def test_failed_command_is_one_line() -> None:
    with pytest.raises(net.CommandError) as info:
        net.run(["sh", "-c", r"printf 'first\nsecond\n' >&2; exit 3"])
    message = str(info.value)
    assert "\n" not in message and "sh -c" in message and "first second" in message


def test_needs_root_and_tools_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(net.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    with pytest.raises(ConfigError, match="needs iproute2's tc"):
        net.check_tools()
    monkeypatch.setattr(net.shutil, "which", lambda tool: "/usr/sbin/" + tool)
    monkeypatch.setattr(net.os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="needs root"):
        net.check_tools()


def test_a_cluster_removes_only_its_own_paths(tmp_path) -> None:
    """``tsc-a-h*`` also matches cluster ``a-h1``'s namespaces: ``down a`` must leave that cluster alone."""
    for ns in ("tsc-a-h0", "tsc-a-h1", "tsc-a-h1-h0", "tsc-a-h1-h1", "tsc-ab-h0"):
        (tmp_path / ns).mkdir()
    assert [p.name for p in net._of("a", tmp_path.glob("tsc-a-h*"))] == ["tsc-a-h0", "tsc-a-h1"]
    assert [p.name for p in net._of("a-h1", tmp_path.glob("tsc-a-h1-h*"))] == ["tsc-a-h1-h0", "tsc-a-h1-h1"]


@pytest.mark.parametrize("name", ["a/b", "x" * 17, "a.b"])
def test_train_refuses_a_cluster_name_before_anything_starts(name: str) -> None:
    from trainscale.app.config import build_config

    with pytest.raises(ConfigError, match="cluster name must be"):
        build_config({"cluster": name, "workers": 1})


@pytest.mark.parametrize("size", ["0", "-1", str((1 << 30) + 1)])
def test_probe_refuses_a_transfer_size_before_it_starts_anything(size: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--bytes -1 started the probe's processes and ended in their traceback; 100 GB ran for minutes."""
    from trainscale.cli import main

    assert main(["cluster", "probe", "nosuch", f"--bytes={size}"]) == 2
    assert capsys.readouterr().err == (
        f"trainscale cluster: error: --bytes {size}: give 1 to 1073741824 bytes (default 4000000)\n"
    )


def test_a_probe_client_that_cannot_connect_says_why_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Its traceback, flattened, was the `cluster probe` error."""
    import socket

    from trainscale.runtime import netprobe

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, not listening: refused
        assert netprobe.main(["client", "127.0.0.1", str(port), "10", "1"]) == 1
    assert capsys.readouterr().err == "Connection refused\n"
