"""The run record's contract (``trainscale.record``): every key a run writes is defined, with a value of its type;
one writer merges the producers' parts; the docs' list of keys is the definitions."""

import json
import logging
import pickle
from pathlib import Path

import pytest

from trainscale import record
from trainscale.app.config import build_config
from trainscale.app.ft_launch import record_faults, record_ps_faults
from trainscale.app.run import run_training
from trainscale.cluster.dilation import projected
from trainscale.compression.setup import CompressionPlan
from trainscale.compression.stats import CompressionStats
from trainscale.modes.ps.stats import epoch_row, merge_server_stats
from trainscale.record import METRICS, SUMMARY, K, Key, merge, problems
from trainscale.results import RunWriter, read_summary
from trainscale.runtime import ft
from trainscale.runtime.comm_hooks import CommStats
from trainscale.runtime.faults import InjectedFault
from trainscale.train.trainer import step_split

ROOT = Path(__file__).resolve().parents[2]
KEYS_PAGE = ROOT / "docs" / "run-folder.md"
CHANGES_PAGE = ROOT / "docs" / "architecture.md"
TINY = {
    "model": "mlp",
    "dataset": "synthetic",
    "train_subset": 256,
    "test_subset": 64,
    "batch_size": 64,
    "epochs": 2,
    "progress": False,
    "threads": 1,
    "target_acc": 0.01,
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("record") / "run"
    run_training(build_config(TINY, {"out": str(out)}))
    return out


def test_every_key_a_run_writes_is_defined_with_a_value_of_its_type(tiny_run):
    summary = json.loads((tiny_run / SUMMARY).read_text())
    rows = [json.loads(line) for line in (tiny_run / METRICS).read_text().splitlines()]
    assert problems(summary, SUMMARY) == []
    assert [problems(row, METRICS) for row in rows] == [[], []]
    assert set(record.SUMMARY_FIELDS) <= set(summary) and all(set(record.EPOCH_FIELDS) <= set(r) for r in rows)


def test_the_figures_of_modes_clusters_and_faults_are_defined():
    """Producers a tiny local run does not reach: compression and plain collectives, local SGD's rounds, the
    parameter server's rows, a dilated cluster's projection; each key is defined for the file it goes to."""
    stats = CompressionStats(method="topk", steps=2, bytes_sent=10, dense_bytes=40, calls=2)
    plan = CompressionPlan("topk", "layerwise", {"ratio": 0.01}, True, 0)
    server = merge_server_stats(
        [
            {
                "updates": 2,
                "pushes": 2,
                "staleness_sum": 1,
                "staleness_max": 1,
                "staleness_hist": {"0": 1, "1": 1},
                "clock_gap_max": 0,
                "update_seconds": 0.1,
                "bytes_in": 8,
                "bytes_out": 8,
            }
        ]
    )
    workers = {
        "steps": 2,
        "push_seconds": 0.1,
        "pull_seconds": 0.1,
        "wait_seconds": 0.0,
        "bytes_pushed": 8,
        "bytes_pulled": 8,
    }
    rows = [
        stats.summary(),
        CommStats(bytes_sent=8, calls=1, steps=1).per_step(),
        epoch_row(server, workers, 1.0, 1),
        {K.rounds: 1, K.steps_per_round: 2.0},
    ]
    assert [problems(row, METRICS) for row in rows] == [[], [], [], []]
    run_rows = [{k: v for k, v in row.items() if k != K.ps_pushes} for row in rows]  # the PS's run_stats drops it
    assert [problems(row, SUMMARY) for row in run_rows] == [[], [], [], []]
    cluster = {
        K.cluster: {"name": "c", "dilation": {"target": "t", "factor": 2.0}},
        K.step_seconds: 1.0,
        K.samples_per_sec: 10.0,
    }
    assert problems({**plan.describe(), **cluster, **projected(cluster)}, SUMMARY) == []
    assert (
        problems(step_split([{K.step_seconds: 1.0, K.comm_seconds_per_step: 0.5, K.comm_ms_per_step: 400.0}]), SUMMARY)
        == []
    )


def test_a_key_is_its_string_wherever_a_bare_name_was_used():
    old = {"best_test_acc": 0.5}  # a summary.json of an earlier version, read back
    assert old.get(K.best_test_acc) == 0.5 and old[K.best_test_acc] == 0.5 and K.epochs_completed not in old
    assert json.dumps({K.model: "mlp"}) == '{"model": "mlp"}'
    assert type(pickle.loads(pickle.dumps(K.model))) is str  # sent to another process as the plain name
    assert K.lr.files == (SUMMARY, METRICS) and K.epoch.files == (METRICS,) and K.faults.files == (SUMMARY,)


def test_every_definition_has_a_meaning_and_its_own_name():
    for name, key in record.keys().items():
        assert name == key and key.meaning and key.files, name
    assert K.best_test_acc.accepts(1) and K.best_test_acc.accepts(None) and not K.best_test_acc.accepts(True)
    assert not K.epochs.accepts("2") and not K.model.accepts(3)


def test_merge_keeps_the_producers_order_and_a_later_part_wins(caplog):
    base = {K.world_size: 4, K.model: "mlp"}
    assert list(merge(base, {K.world_size: 2, K.backend: "gloo"})) == [K.world_size, K.model, K.backend]
    assert merge(base, {K.world_size: 2})[K.world_size] == 2
    with caplog.at_level(logging.WARNING, logger="trainscale.record"):
        merged = merge({"not_a_key_of_ours": 1}, file=METRICS)
        merge({"not_a_key_of_ours": 2}, file=METRICS)
    assert merged == {"not_a_key_of_ours": 1}  # kept, never lost
    assert [r.message for r in caplog.records].count(
        "metrics.jsonl key 'not_a_key_of_ours' has no definition in trainscale.record: define it "
        "(trainscale.record.define)"
    ) == 1


def test_a_plug_in_defines_its_own_key():
    key = record.define(Key("plugin_figure_per_step", float, "s", "a plug-in mode's figure", record.BOTH))
    try:
        assert problems({"plugin_figure_per_step": 1.0}, METRICS) == []
        with pytest.raises(ValueError, match="already defined"):
            record.define(Key("best_test_acc", float, "", "again"))
    finally:
        record._EXTRA.pop(key)


def test_the_writer_merges_parts_into_summary_json_and_metrics_jsonl(tmp_path):
    writer = RunWriter(tmp_path)
    row = writer.add_epoch({K.epoch: 1, K.test_acc: float("nan"), K.elapsed_seconds: 3.0}, {K.train_acc: 0.5})
    assert row == {K.epoch: 1, K.test_acc: None, K.elapsed_seconds: 3.0, K.train_acc: 0.5}
    assert json.loads((tmp_path / METRICS).read_text()) == row
    writer.write_summary({K.model: "mlp", K.world_size: 1}, {K.world_size: 2})
    assert read_summary(tmp_path) == {"model": "mlp", "world_size": 2}


def test_fault_records_are_merged_into_the_summary_by_the_writer(tmp_path):
    """After a fault-tolerant job the launcher adds its records as a part: nothing already there changes, the
    file is replaced atomically (no temporary file left), and every key it adds is defined."""
    before = {K.model: "mlp", K.world_size: 2, K.best_test_acc: 0.5}
    RunWriter(tmp_path).write_summary(before)
    events = tmp_path / "events.jsonl"
    lines = [
        {"event": "members", "time": 0.0, "replica": 0, "members": 2, "step": 0},
        {"event": "fault", "time": 1.0, "replica": 1, "kind": "crash", "rank": 1, "step": 5},
        {"event": "aborted", "time": 1.5, "replica": 0, "step": 5},
        {"event": "healed", "time": 3.0, "replica": 1, "step": 6},
        {"event": "final", "time": 4.0, "replica": 0, "digest": "a", "step": 9},
        {"event": "final", "time": 4.0, "replica": 1, "digest": "a", "step": 9},
    ]
    events.write_text("".join(json.dumps(e) + "\n" for e in lines))
    record_faults(tmp_path, events, [InjectedFault("crash", 1, 5)])
    after = read_summary(tmp_path)
    assert {k: after[k] for k in before} == before and problems(after, SUMMARY) == []
    assert after[K.faults] == [
        {"kind": "crash", "rank": 1, "step": 5, "detection_seconds": 0.5, "recovery_seconds": 2.0, "steps_lost": 1}
    ]
    assert after[K.replicas_equal] is True and after[K.replicas_finished] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", SUMMARY]


def test_parameter_server_fault_records_go_through_the_same_writer(tmp_path):
    RunWriter(tmp_path).write_summary({K.model: "mlp", K.mode: "async"})
    lines = [
        {"event": "fault", "time": 1.0, "kind": "crash", "rank": 1, "step": 3, "steps_lost": 2},
        {"event": "dead", "time": 1.5, "worker": 1},
        {"event": "resumed", "time": 2.0},
    ]
    (tmp_path / ft.EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in lines))
    record_ps_faults(tmp_path, [InjectedFault("crash", 1, 3)])
    after = read_summary(tmp_path)
    assert after[K.mode] == "async" and problems(after, SUMMARY) == []
    assert after[K.faults] == [
        {
            "kind": "crash",
            "rank": 1,
            "step": 3,
            "detection_seconds": 0.5,
            "recovery_seconds": 1.0,
            "steps_lost": 2,
            "handed_over": False,
        }
    ]


def test_the_docs_list_exactly_the_defined_keys():
    assert record.readme_section(KEYS_PAGE.read_text()) == record.readme_block().strip(), (
        "the docs' list of keys is stale: run `python -m trainscale.record docs/run-folder.md`"
    )


def test_the_docs_say_where_a_new_summary_key_goes():
    text = " ".join(CHANGES_PAGE.read_text().split())
    assert "**A summary key** (or a `metrics.jsonl` key): one definition plus its producer." in text


def test_the_docs_list_every_steps_jsonl_key():
    """steps.jsonl's keys (``record.StepK``) are listed by hand on the run-folder page: none may be missing."""
    section = KEYS_PAGE.read_text().split("### Live metrics: `steps.jsonl`")[1]
    missing = [name for name in record.step_keys() if f"| `{name}` |" not in section]
    assert not missing, f"docs/run-folder.md's steps.jsonl table lacks {missing}"


def test_the_settings_a_run_resolves_by_default_are_recorded():
    """``dense_below`` (layerwise sparsifiers) and DiLoCo's outer warm-up are settings with defaults a run resolves
    itself: the summary must say what they were, as it does for the outer lr and momentum."""
    from trainscale.modes.localsgd import PeriodicMode

    topk = CompressionPlan("topk", "layerwise", {"ratio": 0.01}, True, 0).describe()
    assert topk[K.dense_below] > 0 and problems(topk, SUMMARY) == []
    entire = CompressionPlan("topk", "entiremodel", {"ratio": 0.01}, True, 0).describe()
    assert entire[K.dense_below] is None  # every tensor compressed as one: nothing goes dense
    flags = {"model": "mlp", "dataset": "synthetic", "workers": 2}
    diloco = PeriodicMode("diloco", build_config(flags, {"mode": "diloco"})).describe()
    assert diloco[K.outer_warmup_rounds] is not None and problems(diloco, SUMMARY) == []
    assert build_config(flags, {"mode": "diloco", "outer_warmup_rounds": 3}).periodic.outer_warmup_rounds == 3
    assert (
        PeriodicMode("diloco", build_config(flags, {"mode": "diloco", "outer_warmup_rounds": 3})).describe()[
            K.outer_warmup_rounds
        ]
        == 3
    )
    localsgd = PeriodicMode("localsgd", build_config(flags, {"mode": "localsgd"})).describe()
    assert localsgd[K.outer_warmup_rounds] is None and problems(localsgd, SUMMARY) == []


def test_the_record_command_says_its_usage_and_refuses_a_page_without_its_block(tmp_path, capsys):
    from trainscale.record import main

    assert main(["--help"]) == 0 and "usage: python -m trainscale.record [PAGE]" in capsys.readouterr().out
    page = tmp_path / "page.md"
    page.write_text("no block here\n")
    assert main([str(page)]) == 2 and page.read_text() == "no block here\n"
    assert main([str(tmp_path / "missing.md")]) == 2
    assert capsys.readouterr().err.count("python -m trainscale.record: error: ") == 2
