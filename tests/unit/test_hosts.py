"""Hosts files and ssh: a line can only ever name a machine, never reach ssh as an option (no ssh is run)."""

from __future__ import annotations

import pytest

from trainscale.app.config import build_config
from trainscale.app.hosts import Host, host_problem, node_commands, parse_hosts, ssh_argv
from trainscale.errors import ConfigError


@pytest.mark.parametrize(
    "name",
    [
        "gpu-a",
        "node_1",
        "n1.cluster.example.org",
        "10.0.0.1",
        "::1",
        "fe80::1",
        "alice@gpu-a",
        "_svc@10.0.0.2",
        "bob.smith@node-b",
    ],
)
def test_host_names_addresses_and_user_at_host_are_accepted(name):
    assert host_problem(name) is None


@pytest.mark.parametrize(
    "name",
    [
        "-oProxyCommand=touch /tmp/pwned",
        "-p2222",
        "a..b",
        "host.",
        "-host",
        "host-",
        "@host",
        "user@",
        "-u@host",
        "us er@host",
        "a@b@c",
        "ho$st",
        "h;rm",
        "fe80::1%eth0",
        "x" * 64,
        "é.example",
    ],
)
def test_anything_else_is_refused(name):
    assert host_problem(name) is not None


def test_a_hosts_line_that_is_an_ssh_option_is_one_error_naming_file_line_and_name(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("gpu-a slots=2\n-oProxyCommand=sh slots=2\n")
    with pytest.raises(ConfigError) as info:
        parse_hosts(path)
    message = str(info.value)
    assert message.startswith(f"{path}:2: '-oProxyCommand=sh' is not a host name or IP address")
    assert "\n" not in message


def test_user_at_host_keeps_the_user_for_ssh_and_the_address_for_the_rendezvous(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("alice@node-a slots=2\nalice@node-b slots=2\n")
    hosts = parse_hosts(path)
    assert hosts == [Host("alice@node-a", 2), Host("alice@node-b", 2)]
    cfg = build_config({"model": "mlp", "hosts": str(path)})
    commands = node_commands(cfg, {"model": "mlp"}, hosts)
    assert [host for host, _ in commands] == ["alice@node-a", "alice@node-b"]
    assert "node-a:29400" in commands[0][1] and "alice@node-a:29400" not in commands[0][1]


def test_an_ipv6_first_host_gets_a_bracketed_endpoint(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("fe80::1\nfe80::2\n")
    cfg = build_config({"model": "mlp", "hosts": str(path)})
    argv = node_commands(cfg, {"model": "mlp"}, parse_hosts(path))[1][1]
    assert argv[argv.index("--rdzv-endpoint") + 1] == "[fe80::1]:29400"


def test_ssh_argv_ends_the_options_before_the_host():
    argv = ssh_argv("alice@node-a", ["trainscale", "train", "--model", "mlp"], "/work/my dir")
    assert argv[:5] == ["ssh", "-o", "BatchMode=yes", "--", "alice@node-a"]
    assert argv[5] == "cd '/work/my dir' && trainscale train --model mlp"
    assert len(argv) == 6


def test_ssh_argv_refuses_an_option_even_when_called_directly():
    with pytest.raises(ConfigError, match="is not a host name"):
        ssh_argv("-oProxyCommand=sh", ["trainscale", "train"], "/tmp")


def test_a_binary_or_missing_hosts_file_is_one_error(tmp_path):
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00host")
    for path in (tmp_path / "bin", tmp_path / "missing", tmp_path):
        with pytest.raises(ConfigError, match="--hosts"):
            parse_hosts(path)


@pytest.mark.parametrize(
    "given",
    [
        {"model": "airbench", "dataset": "synthetic", "label_smoothing": 0.0},  # a default the recipe would fill
        {"model": "resnet20", "epochs": 3, "milestones": [2], "mode": "sync", "workers": 2},
        {"model": "airbench94", "compress": "topk", "ratio": 0.01, "error_feedback": True, "verify": False},
    ],
)
def test_an_emulated_clusters_nodes_resolve_exactly_the_launchers_run(given):
    """Each node of ``--cluster`` re-reads its flags: they must give the same run, a value equal to a field's
    default included (the recipe fills what is absent: an explicit label smoothing of 0 came back as 0.2)."""
    from trainscale.app.cluster_launch import resolved_flags
    from trainscale.cli import build_parser

    cfg = build_config({**given, "cluster": "c1"})
    argv = node_commands(cfg, resolved_flags(cfg), [Host("10.0.0.1")])[0][1]
    parsed = vars(build_parser().parse_args(argv[1:]))
    node = build_config({k: v for k, v in parsed.items() if k != "command"})
    mine, theirs = cfg.to_dict(), node.to_dict()
    node_only = ("cluster", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id")
    assert {k: theirs[k] for k in mine if k not in node_only} == {k: mine[k] for k in mine if k not in node_only}
