"""Parameter-server flags, roles by rank, and the batches each worker sees."""

import re
from types import SimpleNamespace

import pytest
import torch

from trainscale.app.config import build_config
from trainscale.data import AugmentConfig, DeviceBatches, synthetic_dataset
from trainscale.errors import ConfigError
from trainscale.modes.ps.batches import TrainBatches, unsharded
from trainscale.modes.ps.config import resolve_async_momentum
from trainscale.modes.ps.membership import Membership
from trainscale.modes.ps.mode import ParameterServerMode, Role, role_from_env
from trainscale.modes.ps.optimizer import EpochClock, injected_slowdown
from trainscale.modes.ps.server import Rule, ShardServer

BASE = {"model": "mlp", "dataset": "synthetic", "epochs": 3}


def test_servers_alone_select_async_and_modes_register():
    cfg = build_config(BASE, {"servers": 2, "workers": 2})
    assert (cfg.run.mode, cfg.ps.servers, cfg.launch.workers) == ("async", 2, 2)
    assert build_config(BASE, {"mode": "ma", "servers": 1, "average_every": 5}).ps.average_every == 5


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"mode": "async"}, "--mode async needs --servers S >= 1"),
        ({"mode": "sync", "servers": 1, "workers": 2}, "--servers is for the parameter-server modes"),
        ({"mode": "ps-sync", "servers": 1, "staleness": 2}, "--staleness bounds ASGD"),
        ({"mode": "async", "servers": 1, "staleness": -1}, "--staleness must be >= 0"),
        ({"mode": "async", "servers": 1, "average_every": 2}, "--average-every is the period of --mode ma"),
        ({"mode": "ma", "servers": 1, "average_every": 0}, "--average-every must be a positive"),
        ({"mode": "async", "servers": 1, "warm_start_epochs": 3}, "--warm-start-epochs must be in [0, epochs=3)"),
        ({"warm_start_epochs": 1}, "--warm-start-epochs is for the parameter-server modes"),
        ({"mode": "async", "servers": 1, "rpc_timeout": 0}, "--rpc-timeout must be > 0"),
        (
            {"mode": "async", "servers": 1, "async_momentum": "fast"},
            "--async-momentum must be 'auto' or a number in [0, 1), got 'fast'",
        ),
        (
            {"mode": "async", "servers": 1, "async_momentum": "1"},
            "--async-momentum must be 'auto' or a number in [0, 1)",
        ),
        ({"mode": "async", "servers": 1, "async_momentum": "-0.1"}, "got '-0.1'"),
        ({"mode": "async", "servers": 1, "async_momentum": "nan"}, "got 'nan'"),
        ({"mode": "ps-sync", "servers": 1, "async_momentum": "0.5"}, "--async-momentum sets ASGD's server momentum"),
        ({"mode": "ma", "servers": 1, "staleness_lr": False}, "--no-staleness-lr applies to --mode async"),
        ({"mode": "async", "servers": 1, "heartbeat_timeout": 0}, "--heartbeat-timeout must be > 0"),
        (
            {"mode": "async", "servers": 1, "workers": 2, "inject_fault": ["kill:0@3,hang:1@9"]},
            "every worker of node 0 (0, 1) would die",
        ),
        (
            {"mode": "async", "servers": 1, "workers": 2, "inject_fault": ["hang:2@3"]},
            "there are only 2 workers (0..1)",
        ),
        (
            {"mode": "async", "servers": 1, "workers": 2, "inject_fault": ["link:1@3"]},
            "parameter-server jobs take kill",
        ),
        (
            {"mode": "ma", "servers": 1, "workers": 3, "inject_fault": ["kill:1@3,hang:1@9"]},
            "worker 1 already dies in an earlier fault",
        ),
        ({"mode": "async", "servers": 1, "workers": 2, "inject_fault": ["kill:1"]}, "expected KIND:RANK@STEP"),
        ({"mode": "async", "servers": 2, "workers": 2, "inject_fault": ["hang:s0@3"]}, "can be killed, not hung"),
        (
            {"mode": "async", "servers": 2, "workers": 2, "inject_fault": ["kill:s2@3"]},
            "only 2 server shard(s) (s0..s1)",
        ),
        (
            {"mode": "async", "servers": 2, "workers": 2, "inject_fault": ["kill:s1@3,kill:s1@9"]},
            "shard 1 already dies in an earlier fault",
        ),
        (
            {"mode": "sync", "workers": 2, "fault_tolerance": True, "inject_fault": ["kill:s0@3"]},
            "names a parameter-server shard",
        ),
    ],
)
def test_bad_settings_name_the_flag(bad, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        build_config(BASE, bad)


def test_async_remedies_are_on_by_default():
    cfg = build_config(BASE, {"servers": 1, "workers": 2})
    assert (cfg.ps.async_momentum, cfg.ps.staleness_lr) == ("auto", True)
    cfg = build_config(BASE, {"servers": 1, "async_momentum": "0.25", "staleness_lr": False})
    assert cfg.ps.async_momentum == "0.25"


@pytest.mark.parametrize("workers, expected", [(1, 0.9), (2, 0.4), (4, 0.15), (5, 0.1), (10, 0.0), (64, 0.0)])
def test_auto_async_momentum_takes_off_the_implicit_one_minus_one_over_w(workers, expected):
    explicit = resolve_async_momentum("auto", 0.9, workers)
    assert explicit == pytest.approx(expected, abs=1e-12)
    # Mitliagkas et al.: explicit + implicit (1 - 1/W) is the momentum asked for, until explicit reaches 0
    if expected > 0:
        assert explicit + (1 - 1 / workers) == pytest.approx(0.9)
    assert resolve_async_momentum("AUTO", 0.0, workers) == 0.0
    assert resolve_async_momentum("0.3", 0.9, workers) == 0.3  # a number is used as is


def ps_mode(name: str, workers: int, **flags) -> ParameterServerMode:
    mode = ParameterServerMode(name, build_config(BASE, {"mode": name, "servers": 1, "workers": workers, **flags}))
    mode._role = Role("worker", 0, workers, 1, 0, workers + 1)
    return mode


def test_async_rule_gets_the_resolved_momentum_and_staleness_lr_other_rules_do_not():
    asked = Rule("async", momentum=0.9, nesterov=True, weight_decay=5e-4)
    rule = ps_mode("async", 2).async_remedies(asked)
    assert (rule.momentum, rule.nesterov, rule.weight_decay, rule.staleness_lr) == (
        pytest.approx(0.4),
        True,
        5e-4,
        True,
    )
    assert ps_mode("async", 2, async_momentum="0.9", staleness_lr=False).async_remedies(asked) == asked
    # 10 workers bring 0.9 themselves: no explicit momentum is left, so no Nesterov (torch's SGD would refuse it)
    none_left = ps_mode("async", 10).async_remedies(asked)
    assert (none_left.momentum, none_left.nesterov) == (0.0, False)
    ShardServer(0, Membership(10)).initialize(torch.zeros(3), none_left)
    synced = Rule("ps-sync", momentum=0.9)
    assert ps_mode("ps-sync", 2).async_remedies(synced) is synced


def env(rank, local, group, world=8, per_node=4):
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "GROUP_RANK": str(group),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(per_node),
    }


def test_roles_by_local_rank_across_nodes():
    # 2 nodes x (2 workers + 2 servers): node 1's local ranks 0,1 are workers 2,3; 2,3 are shards 2,3.
    roles = [role_from_env(2, 2, env(r, r % 4, r // 4)) for r in range(8)]
    assert [(r.kind, r.index) for r in roles] == [
        ("worker", 0),
        ("worker", 1),
        ("server", 0),
        ("server", 1),
        ("worker", 2),
        ("worker", 3),
        ("server", 2),
        ("server", 3),
    ]
    assert {(r.workers, r.servers, r.world) for r in roles} == {(4, 4, 8)}
    with pytest.raises(ConfigError, match="needs 3 processes per node, but the launcher started 4"):
        role_from_env(2, 1, env(0, 0, 0))


def batches(train: bool, **kw) -> DeviceBatches:
    data = (
        synthetic_dataset(num_samples=100, image_size=8, seed=1)
        if train
        else synthetic_dataset(num_samples=30, image_size=8, seed=2)
    )
    aug = AugmentConfig(crop_padding=2, flip=True) if train else None
    return DeviceBatches(data, 8, train=train, augment=aug, device="cpu", seed=3, **kw)


def same(a, b) -> bool:
    xs, ys = list(a), list(b)
    return len(xs) == len(ys) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(xs, ys))


@pytest.mark.parametrize("train", [True, False])
def test_unsharded_view_is_a_one_process_loader(train):
    view, fresh = unsharded(batches(train, rank=1, world_size=3)), batches(train)
    assert len(view) == len(fresh) and view.num_samples == fresh.num_samples
    assert same(view.epoch(2), fresh.epoch(2))


def test_warm_start_epochs_train_the_main_worker_on_everything_and_the_others_on_nothing():
    calls = []
    clock = EpochClock()
    shard = batches(True, rank=0, world_size=2)
    client = SimpleNamespace(worker=0, covers=[])
    main = TrainBatches(
        shard, clock, warm_epochs=1, is_main=True, main=0, on_epoch=lambda e, a: calls.append(a), client=client
    )
    other = TrainBatches(
        batches(True, rank=1, world_size=2),
        clock,
        1,
        False,
        0,
        lambda e, a: calls.append(a),
        SimpleNamespace(worker=1, covers=[]),
    )
    assert (len(main), len(other)) == (12, 0)  # epoch 0: all 100 samples -> 12 batches of 8; none
    assert sum(1 for _ in main.epoch(0)) == 12 and main.finished[0] == 96
    assert list(other.epoch(0)) == []
    clock.next_epoch = 1
    assert len(main) == len(shard) == 6 and same(main.epoch(1), shard.epoch(1))
    assert calls == [(0,), (0,), None]
    assert client.covers == [(0, b) for b in range(12)] + [(0, b) for b in range(6)]  # each batch, for its push


def test_slowdown_is_off_unless_the_test_variable_is_set(monkeypatch):
    from trainscale.runtime.job import Job

    def slow(worker, env):  # the variable as the entry reads it into the job
        return injected_slowdown(worker, Job.from_environ(env).ps_slow)

    assert slow(1, {}) == 0.0
    assert (
        slow(0, {"TRAINSCALE_PS_SLOW": "worker=1:seconds=0.25"}),
        slow(1, {"TRAINSCALE_PS_SLOW": "worker=1:seconds=0.25"}),
    ) == (0.0, 0.25)
    with pytest.raises(ConfigError, match="worker=W:seconds=S"):
        slow(1, {"TRAINSCALE_PS_SLOW": "oops"})
