"""Modes are plug-ins: every registered mode builds and validates, and a new mode's own config section
reaches TrainConfig, the CLI flags and config.json without an edit outside its own file."""

import argparse
from dataclasses import dataclass
from typing import ClassVar

import pytest

from trainscale.app import config as app_config
from trainscale.app.config import TrainConfig, build_config, load_toml
from trainscale.cli import add_config_flags, build_parser
from trainscale.config import CORE_SECTIONS, Section, option
from trainscale.errors import ConfigError
from trainscale.modes import MODES, Mode, create_mode, list_modes, mode_class, register_mode
from trainscale.train import Callbacks


def test_builtin_modes_are_registered():
    assert {"local", "sync", "async", "ps-sync", "ma"} <= set(list_modes())


@pytest.mark.parametrize("name", list_modes())
def test_every_mode_builds_from_a_valid_config_and_is_a_callbacks_object(name, monkeypatch):
    extra = {"servers": 1, "workers": 2} if mode_class(name).uses_servers else {}
    extra |= {"workers": 2} if mode_class(name).distributed else {}
    cfg = build_config({"mode": name, **extra})
    if mode_class(name).uses_servers:  # roles come from the launcher's variables: rank 0 of 2 workers + 1 server
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}.items():
            monkeypatch.setenv(key, value)
    mode = create_mode(cfg)
    assert isinstance(mode, Callbacks) and mode.name == name
    assert mode.role() in ("trainer", "server", "supervisor")


def test_every_config_field_has_help_and_a_flag():
    parser = build_parser()
    train = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("train"))
    dests = {a.dest for a in train._actions}
    for name, field in app_config.FIELDS.items():
        assert field.metadata.get("help"), f"{name} has no help text"
        assert name in dests, f"{name} has no flag"


def test_a_new_mode_is_one_class_with_its_own_section(monkeypatch, tmp_path):
    """A mode registered from outside trainscale brings its section (flags, TOML table, config.json, validation,
    refusal under other modes) with its registration alone: nothing in trainscale is patched."""

    @dataclass
    class GossipConfig(Section):
        TITLE: ClassVar[str] = "gossip"
        FOR: ClassVar[str] = "--mode gossip"
        gossip_peers: int = option(2, "peers each worker averages with")

        def validate(self) -> None:
            if self.gossip_peers < 1:
                raise ConfigError(f"--gossip-peers must be >= 1, got {self.gossip_peers}")

    class GossipMode(Mode):
        distributed = True
        sections = (GossipConfig,)

        def __init__(self, name: str, cfg: TrainConfig) -> None:
            self.name, self.peers = name, cfg.section(GossipConfig).gossip_peers

    monkeypatch.setattr(MODES, "_entries", dict(MODES._entries))  # registration undone after the test
    register_mode("gossip")(GossipMode)
    assert TrainConfig().section(GossipConfig).gossip_peers == 2 and "gossip_peers" in TrainConfig().to_dict()
    parser = argparse.ArgumentParser()
    add_config_flags(parser, TrainConfig, CORE_SECTIONS)
    assert parser.parse_args(["--gossip-peers", "5"]).gossip_peers == 5
    assert "peers each worker averages with" in parser.format_help()
    assert create_mode(build_config({"mode": "gossip", "workers": 2, "gossip_peers": 3})).peers == 3
    path = tmp_path / "gossip.toml"
    path.write_text("[gossip]\ngossip_peers = 4\n")
    assert create_mode(build_config({"mode": "gossip", "workers": 2}, load_toml(path))).peers == 4
    with pytest.raises(ConfigError, match="--gossip-peers is for --mode gossip, not --mode sync"):
        build_config({"workers": 2, "gossip_peers": 3})
    with pytest.raises(ConfigError, match="--gossip-peers must be >= 1, got 0"):
        build_config({"mode": "gossip", "workers": 2, "gossip_peers": 0})


@pytest.mark.parametrize(
    "values, fragment",
    [
        ({"batch_size": "1"}, "must be an integer, got '1' (str)"),
        ({"batch_size": True}, "must be an integer, got True (bool)"),
        ({"epochs": "1"}, "must be a number, got '1' (str)"),
        ({"lr": "0.1"}, "must be a number, got '0.1' (str)"),
        ({"milestones": "41,61"}, "must be a list of numbers, got '41,61' (str)"),
        ({"flip": 1}, "must be true or false, got 1 (int)"),
    ],
)
def test_wrong_types_are_one_line_errors(values, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        build_config(values)


def test_toml_type_errors_name_file_line_and_key(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('model = "mlp"\nbatch_size = "64"\n')
    with pytest.raises(ConfigError, match=r"c.toml:2: key 'batch_size' must be an integer, got '64' \(str\)"):
        app_config.load_toml(path)
    path.write_text("lr = 1\n")
    assert app_config.load_toml(path) == {"lr": 1.0}


def test_train_config_is_picklable_for_spawned_workers():
    import pickle

    cfg = build_config({"model": "mlp"})
    assert pickle.loads(pickle.dumps(cfg)) == cfg and type(cfg) is TrainConfig


def test_the_wire_counter_hands_every_hook_it_does_not_wrap_to_the_mode():
    """Every public member of Callbacks reaches the wrapped mode: a wrapper that dropped ``before_fit`` left a
    fault-tolerant replica on a cluster without its state functions (it could not heal a peer)."""
    import inspect

    from trainscale.cluster.wire import WireCounter

    calls = []

    class Recording(Callbacks):
        def __getattribute__(self, name):
            value = object.__getattribute__(self, name)
            if callable(value) and not name.startswith("_"):
                return lambda *args: calls.append(name) or value(*args)
            return value

    wrapped = WireCounter(Recording(), lambda epoch: 4, {"interface": "lo"})
    hooks = [name for name, member in inspect.getmembers(Callbacks) if callable(member) and not name.startswith("_")]
    arguments = {"before_fit": (dict, dict), "epoch_samples": (3,), "load_state_dict": ({},)}
    for name in hooks:
        if name in ("before_train_epoch", "after_train_epoch"):
            continue  # wrapped: they read the interface counters around the mode's own hook
        calls.clear()
        getattr(wrapped, name)(*arguments.get(name, ()))
        assert calls == [name], name
