"""One description of compression for every user (sync's hook and reducer, the planner, the parameter server), and
compressed parameter-server pushes in one process: encoded with error feedback on the worker, decoded by a shard."""

import math
import re

import pytest
import torch
from torch import nn

from trainscale.app.config import build_config
from trainscale.compression.setup import plan_from_config
from trainscale.compression.spec import CompressionSpec
from trainscale.errors import ConfigError
from trainscale.modes.ps.codec import PushCodec, codec_spec, decode_push, payload_nbytes, push_compressor
from trainscale.modes.ps.membership import Membership
from trainscale.modes.ps.mode import ParameterServerMode, Role, servers_momentum_for, unit_sizes
from trainscale.modes.ps.server import Rule, ShardServer
from trainscale.modes.ps.shards import shard_bounds, split
from trainscale.modes.ps.stats import epoch_row, merge_server_stats
from trainscale.plan.check import method_spec
from trainscale.plan.methods import parse_spec

BASE = {"model": "mlp", "dataset": "synthetic", "epochs": 3}


def ps_mode(name: str, **flags) -> ParameterServerMode:
    mode = ParameterServerMode(name, build_config(BASE, {"mode": name, "servers": 1, "workers": 2, **flags}))
    mode._role = Role("worker", 0, 2, 1, 0, 3)
    return mode


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 10))  # 1,200 + 30 + 300 + 10 values


def topk_bytes(numel: int, ratio: float) -> int:
    """Top-k's wire size for one unit, written out: k fp32 values plus the cheapest of int32 indices, a bitmap
    or nothing (all values, dense)."""
    k = min(numel, max(1, math.ceil(numel * ratio - 1e-9)))
    return min(8 * k, 4 * k + math.ceil(numel / 8), 4 * numel)


# --- one vocabulary ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["async", "ps-sync", "ma"])
def test_parameter_server_pushes_take_each_flag_under_the_compressors_own_name(mode):
    """--qsgd-bucket is QSGD's bucket_size: a push codec built from the flags must use it (it used to be dropped,
    leaving one norm per shard)."""
    model = small_model()
    codec = ps_mode(mode, compress="qsgd", qsgd_bucket=64, qstates=15).push_codec(model, list(model.parameters()))
    assert (codec.compressor.bucket_size, codec.compressor.levels) == (64, 15)
    assert codec.spec.params == {"bucket_size": 64, "qstates": 15, "seed": 0}


@pytest.mark.parametrize(
    "flags, text, described",
    [
        (
            {"compress": "qsgd", "qsgd_bucket": 64, "qstates": 15},
            "qsgd:bucket_size=64,qstates=15",
            "qsgd(S=15, 5 bits, bucket=64)",
        ),
        ({"compress": "powersgd", "powersgd_rank": 3}, "powersgd:rank=3", "powersgd(rank=3)"),
        ({"compress": "topk", "ratio": 0.05, "granularity": "entire"}, "topk:ratio=0.05,granularity=entire", "topk"),
    ],
)
def test_the_flags_the_planners_text_and_a_run_folders_config_give_one_spec(flags, text, described):
    cfg = build_config(BASE, {"workers": 2, **flags})
    spec = plan_from_config(cfg.compression, cfg.run.seed)  # what sync, local SGD and DiLoCo build their exchange from
    assert spec.without_seed() == parse_spec(text) == method_spec(flags)
    assert spec.text == text
    assert spec.hook_state().compressor.describe().startswith(described)  # the DDP hook's and reducer's compressor


def test_a_flag_the_method_does_not_take_is_refused_naming_the_flags_it_takes():
    with pytest.raises(
        ConfigError, match=re.escape("--compress qsgd does not use --ratio; it takes: --qstates, --qsgd-bucket")
    ):
        build_config(BASE, {"mode": "async", "servers": 1, "compress": "qsgd", "ratio": 0.1})


@pytest.mark.parametrize(
    "flags, fragment",
    [
        ({"compress": "topk", "method": "randomk"}, "--compress topk and --method randomk name two methods"),
        ({"compress": "layerwise", "granularity": "entire"}, "--compress layerwise and --granularity entire disagree"),
    ],
)
def test_two_flags_that_name_different_settings_are_refused(flags, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        build_config(BASE, {"workers": 2, **flags})
    same = {"compress": "topk", "method": "topk"} if "method" in flags else {**flags, "granularity": "layerwise"}
    build_config(BASE, {"workers": 2, **same})


def test_powersgd_has_no_parameter_server_form_and_says_why():
    with pytest.raises(ConfigError, match="cannot compress parameter-server pushes: it exchanges between the workers"):
        build_config(BASE, {"mode": "async", "servers": 1, "compress": "powersgd"})
    with pytest.raises(ConfigError, match="cannot compress parameter-server pushes"):
        push_compressor(CompressionSpec("powersgd", "entire"))


def test_dgc_pushes_are_accepted_and_switch_the_servers_momentum_off():
    model = small_model()
    codec = ps_mode("async", compress="dgc", ratio=0.01).push_codec(model, list(model.parameters()))
    assert codec.compressor.replaces_optimizer_momentum and codec.feedback is None  # DGC keeps its own residual
    rule = Rule("async", momentum=0.4, nesterov=True)
    assert servers_momentum_for(rule, codec) == Rule("async", momentum=0.0, nesterov=False)
    topk = ps_mode("async", compress="topk", ratio=0.01).push_codec(model, list(model.parameters()))
    assert servers_momentum_for(rule, topk) is rule and servers_momentum_for(rule, None) is rule


# --- compressed pushes: round trip with error feedback ---------------------------------------------------


@pytest.mark.parametrize("granularity", ["layerwise", "entire"])
@pytest.mark.parametrize(
    "method, params",
    [
        ("topk", {"ratio": 0.01}),
        ("randomk", {"ratio": 0.05, "seed": 4}),
        ("qsgd", {"qstates": 15, "bucket_size": 64, "seed": 4}),
        ("signsgd", {}),
    ],
)
def test_pushes_lose_no_gradient_mass_with_error_feedback(granularity, method, params):
    """Over several pushes to two shards, what the shards decoded plus what the worker still holds back is the sum
    of the gradients: error feedback delays what compression dropped, never loses it."""
    model = small_model()
    spec = CompressionSpec(method, granularity, params, error_feedback=True)
    codec = PushCodec(spec, units=unit_sizes(model, list(model.parameters())))
    decoders = [push_compressor(spec) for _ in range(2)]  # each server shard builds its own from the spec
    bounds = shard_bounds(1540, 2)
    gen = torch.Generator().manual_seed(1)
    pushed, applied = torch.zeros(1540), torch.zeros(1540)
    for _ in range(5):
        grad = torch.randn(1540, generator=gen)
        pushed += grad
        for s, payload in enumerate(codec.encode(split(grad, bounds), epoch=0)):
            assert payload_nbytes(payload) < 4 * (bounds[s][1] - bounds[s][0])
            applied[bounds[s][0] : bounds[s][1]] += decode_push(decoders[s], payload)
    if granularity == "layerwise":  # residuals per unit, in the flat vector's order
        held = torch.cat([codec.feedback.residual(key).reshape(-1) for units in codec.layout for key, _ in units])
    else:
        held = torch.cat([codec.feedback.residual(f"shard{s}").reshape(-1) for s in range(2)])
    assert torch.allclose(applied + held, pushed, atol=1e-4)


def test_layerwise_topk_pushes_cut_parameters_at_shard_boundaries_and_send_the_exact_bytes():
    model = small_model()
    codec = PushCodec(
        CompressionSpec("topk", "layerwise", {"ratio": 0.01}, True), units=unit_sizes(model, list(model.parameters()))
    )
    bounds = shard_bounds(1540, 2)  # [0, 770) and [770, 1540): the first weight (1,200 values) straddles them
    payloads = codec.encode(split(torch.randn(1540), bounds), epoch=0)
    assert codec.layout == [
        [("shard0/0.weight", 770)],
        [("shard1/0.weight", 430), ("shard1/0.bias", 30), ("shard1/2.weight", 300), ("shard1/2.bias", 10)],
    ]
    assert [payload_nbytes(p) for p in payloads] == [
        topk_bytes(770, 0.01),
        sum(topk_bytes(n, 0.01) for n in (430, 30, 300, 10)),
    ]


def test_a_shard_applies_a_layerwise_push_and_the_worker_keeps_the_rest():
    model = small_model()
    spec = codec_spec("topk", {"ratio": 0.1})
    spec = CompressionSpec(spec.method, "layerwise", spec.params, error_feedback=True)
    codec = PushCodec(spec, units=unit_sizes(model, list(model.parameters())))
    bounds = shard_bounds(1540, 2)
    servers = [ShardServer(s, Membership(1)) for s in range(2)]
    for server, (start, stop) in zip(servers, bounds):
        server.initialize(torch.zeros(stop - start), Rule("ma", codec=spec))
    grad = torch.linspace(-1, 1, 1540)
    for server, payload in zip(servers, codec.encode(split(grad, bounds), epoch=0)):
        server.push(0, 0, 0, payload, 1.0, 0, (0,))
        assert server.take_stats()["bytes_in"] == payload_nbytes(payload)
    applied = torch.cat([server.pull(0, 0, 1, (0,)).wait()[0] for server in servers])
    held = torch.cat([codec.feedback.residual(key).reshape(-1) for units in codec.layout for key, _ in units])
    assert torch.allclose(applied + held, grad)
    assert int((applied != 0).sum()) == sum(math.ceil(n * 0.1) for n in (770, 430, 30, 300, 10))


def test_pushes_go_dense_during_the_compression_warm_up():
    model = small_model()
    codec = PushCodec(
        CompressionSpec("topk", "entire", {"ratio": 0.01}, True, warmup_epochs=1),
        units=unit_sizes(model, list(model.parameters())),
    )
    pieces = split(torch.randn(1540), shard_bounds(1540, 2))
    assert all(p is q for p, q in zip(codec.encode(pieces, epoch=0), pieces)) and codec.feedback.keys() == []
    assert payload_nbytes(codec.encode(pieces, epoch=1)) == 2 * topk_bytes(770, 0.01)


def test_the_epoch_row_reports_bytes_per_push_and_the_compression_ratio():
    workers = {
        "steps": 10,
        "push_seconds": 1,
        "pull_seconds": 1,
        "wait_seconds": 0,
        "bytes_pushed": 1000,
        "bytes_pulled": 40000,
        "pushes": 5,
        "dense_bytes_pushed": 20000,
    }
    row = epoch_row(merge_server_stats([]), workers, epoch_seconds=1.0, servers=1)
    assert (row["bytes_per_push"], row["dense_bytes_per_push"], row["compression_ratio"]) == (200, 4000, 20)
    assert row["bytes_pushed_per_step"] == 100  # ma: one push every other step here


def test_the_planner_prices_compressed_pushes_and_dense_pulls():
    from tests.unit.test_plan import MB, make_profile, setting
    from trainscale.plan.costs import Link, colocated_parameter_server
    from trainscale.plan.predict import predict

    spec = parse_spec("topk:ratio=0.01,granularity=entire")  # 0.8 MB a push, encode 10 ms, decode 1 ms (profile)
    dense = predict(make_profile(), setting(8e8, mode="ps-sync"))
    topk = predict(make_profile(), setting(8e8, mode="ps-sync", spec=spec))
    link = Link(1e8)
    assert dense.wire_seconds == pytest.approx(2 * colocated_parameter_server(40 * MB, 4, 1, link))
    assert topk.wire_seconds == pytest.approx(
        colocated_parameter_server(0.8 * MB, 4, 1, link) + colocated_parameter_server(40 * MB, 4, 1, link)
    )
    assert topk.comm_seconds == pytest.approx(topk.wire_seconds + 0.01 + 4 * 0.001)  # 4 pushes decoded per shard
    assert topk.comm_seconds < dense.comm_seconds


# --- small tensors dense: one setting for flag, TOML, planner ----------------------------------------------------


def test_dense_below_is_one_setting_for_the_flag_the_planners_text_and_a_run_folders_config():
    default = plan_from_config(build_config(BASE, {"workers": 2, "compress": "topk", "ratio": 0.01}).compression, 0)
    assert default.dense_below == 1024 and default.text == "topk:ratio=0.01"
    cfg = build_config(BASE, {"workers": 2, "compress": "topk", "ratio": 0.01, "dense_below": 0})
    spec = plan_from_config(cfg.compression, cfg.run.seed)
    assert spec.text == "topk:ratio=0.01,dense_below=0"
    assert (
        spec.without_seed()
        == parse_spec(spec.text)
        == method_spec({"compress": "topk", "ratio": 0.01, "dense_below": 0})
    )
    assert spec.hook_state().exchange.dense_below == 0
    assert not parse_spec("qsgd").splits_small  # a quantiser sends every element anyway


@pytest.mark.parametrize(
    "flags",
    [
        {"compress": "qsgd", "dense_below": 64},
        {"compress": "topk", "ratio": 0.01, "granularity": "entire", "dense_below": 64},
    ],
)
def test_dense_below_where_it_does_nothing_is_refused(flags):
    with pytest.raises(ConfigError, match="--dense-below is for layerwise randomk, topk and threshold"):
        build_config(BASE, {"workers": 2, **flags})


def test_dense_below_must_be_a_count():
    with pytest.raises(ConfigError, match="--dense-below must be >= 0"):
        build_config(BASE, {"workers": 2, "compress": "topk", "dense_below": -1})
    with pytest.raises(ConfigError, match="dense_below is a number of elements"):
        parse_spec("topk:ratio=0.01,dense_below=x")


def test_the_planner_counts_the_same_bytes_as_the_run():
    """The profile's collectives for layerwise Top-k: the small tensors' fp32 values in one all-reduce, the rest's
    Top-k payloads in one all-gather: what the run's exchange hands over."""
    from trainscale.plan.profile import profile_compressor

    model = small_model()  # 1,200-value weight compressed; 30 + 300 + 10 dense
    grads = [(n, torch.randn_like(p)) for n, p in model.named_parameters()]
    profile = profile_compressor(parse_spec("topk:ratio=0.01"), grads, warmup=0, repeats=1)
    assert sorted(profile.collectives) == [("all_gather", topk_bytes(1200, 0.01)), ("all_reduce", 4 * 340)]
    state = parse_spec("topk:ratio=0.01").hook_state()
    state.reduce(grads)
    assert state.stats.bytes_sent == topk_bytes(1200, 0.01) + 4 * 340
    published = profile_compressor(parse_spec("topk:ratio=0.01,dense_below=0"), grads, warmup=0, repeats=1)
    assert published.collectives == [("all_gather", sum(topk_bytes(n, 0.01) for n in (1200, 30, 300, 10)))]


def test_dense_below_is_refused_for_parameter_server_pushes():
    with pytest.raises(ConfigError, match="--dense-below is for the collectives of sync, localsgd and diloco"):
        build_config(BASE, {"mode": "async", "servers": 1, "workers": 2, "compress": "topk", "dense_below": 64})


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("topk:ratio=0.01,ratio=0.5", "ratio given twice; give it once"),
        (":ratio=0.1", "no method before the ':'"),
        ("topk:ratio=abc", "(ratio must be a number)"),
        ("topk:ratio", "'ratio' is not key=value"),
        ("nope:ratio=0.1", "unknown method 'nope'"),
    ],
)
def test_a_bad_compressor_text_is_one_line_saying_what_is_wrong(text, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        parse_spec(text)


def test_a_plan_style_spec_given_to_a_run_says_the_flags_to_write():
    """`trainscale profile` and `plan` take topk:ratio=0.01; a run refused it as an unknown compressor."""
    from trainscale.app.config import build_config
    from trainscale.errors import ConfigError

    with pytest.raises(ConfigError, match=r"a run takes the method alone and its parameters as flags: "
                       r"--compress topk --ratio 0.1 --dense-below 0$"):  # fmt: skip
        build_config({"model": "mlp", "workers": 2, "compress": "topk:ratio=0.1,dense_below=0"})
