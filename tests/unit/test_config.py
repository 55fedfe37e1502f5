import re

import pytest

from trainscale.app.config import FIELDS, TrainConfig, build_config, load_toml, train_settings
from trainscale.errors import ConfigError
from trainscale.train.setup import BatchPlan


def test_defaults_validate():
    assert build_config({}).data.model == "resnet9"


def test_layers_merge_left_to_right():
    cfg = build_config({"epochs": 3, "lr": 0.2}, {"epochs": 5})
    assert (cfg.optim.epochs, cfg.optim.lr) == (5, 0.2)


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"epochs": 0}, "--epochs must be a positive number"),
        ({"batch_size": -1}, "--batch-size must be a positive integer"),
        ({"precision": "fp8"}, "--precision must be one of"),
        ({"momentum": 1.5}, "--momentum"),
        ({"target_acc": 94}, "fraction"),
        ({"train_subset": 0}, "--train-subset"),
        ({"model": "resnet23"}, "did you mean 'resnet32'"),
        ({"dataset": "cifar11"}, "unknown dataset 'cifar11'"),
        ({"schedule": "stepp"}, "did you mean 'step'"),
        ({"milestones": [61, 41]}, "--milestones"),
        ({"out": " "}, "--out is empty; give a folder"),
        ({"resume": True}, "--resume continues the run in --out: give --out DIR"),  # not a new default folder
    ],
)
def test_bad_values_name_the_problem(bad, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        build_config(bad)


def test_toml_accepts_dashes_and_underscores(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "resnet20"\nbatch-size = 64\nlabel_smoothing = 0.1\nmilestones = [2, 3]\n')
    cfg = build_config(load_toml(path))
    assert (cfg.data.model, cfg.optim.batch_size, cfg.optim.label_smoothing, cfg.optim.milestones) == (
        "resnet20",
        64,
        0.1,
        [2, 3],
    )


def test_toml_unknown_key_names_file_and_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "resnet20"\n\nepochz = 3\n')
    with pytest.raises(ConfigError, match=r"run.toml:3: unknown key 'epochz'"):
        load_toml(path)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("epochs = 1\n[optim]\nepochs = 2\n", "'epochs' set twice (again in [optim])"),
        ("batch-size = 1\nbatch_size = 2\n", "'batch_size' set twice (again at the top level)"),
    ],
)
def test_toml_setting_given_twice_is_refused(tmp_path, text, fragment):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_toml(path)


def test_toml_syntax_error_is_config_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("model = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(path)
    path.write_text('\ufeffmodel = "mlp"\n', encoding="utf-8")  # what "UTF-8 with BOM" editors save
    with pytest.raises(ConfigError, match="it starts with a byte-order mark: save it as UTF-8 without one$"):
        load_toml(path)


def test_every_field_has_a_cli_flag():
    from trainscale.cli import build_parser

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    dests = {a.dest for a in train._actions}
    assert set(FIELDS) <= dests


def test_every_switch_turns_its_field_on_and_its_negation_turns_it_off():
    """A switch's own name may begin with ``no-`` (``--no-decay-norm-bias``): it still turns its field on."""
    from trainscale.app.config import TYPES
    from trainscale.cli import build_parser
    from trainscale.config import flag_name

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    switches = [name for name, kind in TYPES.items() if kind is bool]
    assert "no_decay_norm_bias" in switches
    for name in switches:
        flag = flag_name(FIELDS[name])
        assert getattr(train.parse_args([flag]), name) is True, flag
        assert getattr(train.parse_args(["--no-" + flag[2:]]), name) is False, flag


@pytest.mark.parametrize(
    "kw, workers, expected",
    [
        ({"batch_size": 512}, 1, (512, 512)),
        ({"batch_size": 512}, 4, (128, 512)),
        ({"batch_per_worker": 64}, 8, (64, 512)),
    ],
)
def test_batch_plan(kw, workers, expected):
    plan = BatchPlan.resolve(TrainConfig.flat(**kw), workers)
    assert (plan.per_worker, plan.global_batch) == expected


def test_the_batch_given_last_wins_and_both_in_the_flags_are_refused(tmp_path):
    from trainscale.app.cluster_launch import resolved_flags
    from trainscale.app.config import resumed_settings, train_settings

    assert build_config({"batch_per_worker": 32}, {"batch_size": 64}).optim.batch_per_worker is None
    assert build_config({"batch_size": 64}, {"batch_per_worker": 32}).optim.batch_per_worker == 32
    record = tmp_path / "run.toml"  # a run folder's record holds both; its batch per worker is what ran
    record.write_text("batch_size = 512\nbatch_per_worker = 32\n")
    assert train_settings({}, record).optim.batch_per_worker == 32
    assert train_settings({"batch_size": 64}, record).optim.batch_per_worker is None
    with pytest.raises(ConfigError, match="--batch-size 64 .* and --batch-per-worker 32 both set the batch"):
        train_settings({"batch_size": 64, "batch_per_worker": 32})
    (tmp_path / "config.json").write_text("{}")  # the flags a resumed or clustered run hands its nodes: one batch
    assert resumed_settings({"resume": True, "out": str(tmp_path)}) == {"batch_per_worker": 32}
    assert resolved_flags(build_config({"batch_per_worker": 32}))["batch_per_worker"] == 32
    assert "batch_size" not in resolved_flags(build_config({"batch_per_worker": 32}))


def test_linear_lr_scaling_rule():
    plan = BatchPlan.resolve(TrainConfig.flat(batch_size=1024, lr=0.1, lr_scaling="linear", base_batch_size=256), 4)
    assert plan.lr == pytest.approx(0.4)


def test_indivisible_global_batch_is_an_error():
    with pytest.raises(ConfigError, match="not divisible by 3 workers"):
        BatchPlan.resolve(TrainConfig.flat(batch_size=512), 3)


def test_toml_section_tables_read_like_flat_keys(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "resnet20"\n\n[optim]\nlr = 0.1\nbatch-size = 64\n\n[launch]\nworkers = 2\n')
    assert load_toml(path) == {"model": "resnet20", "lr": 0.1, "batch_size": 64, "workers": 2}
    cfg = build_config(load_toml(path))
    assert (cfg.data.model, cfg.optim.lr, cfg.optim.batch_size, cfg.launch.workers) == ("resnet20", 0.1, 64, 2)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[optim]\nlrr = 0.1\n", r"run.toml:2: unknown key 'lrr' in \[optim\]"),
        ("[optim]\n\nworkers = 2\n", r"run.toml:3: unknown key 'workers' in \[optim\] \(it belongs in \[launch\]"),
        ("[optim]\nepochs = 2\nlr = 'fast'\n", r"run.toml:3: key 'lr' must be a number, got 'fast' \(str\)"),
        (
            "model = 'mlp'\n[optimiser]\nlr = 0.1\n",
            r"run.toml:2: unknown table \[optimiser\]; the tables are the config "
            "sections: data, optim, run, launch, compression, faults, replication",
        ),
    ],
)
def test_toml_section_table_errors_name_file_line_and_key(tmp_path, text, fragment):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_toml(path)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('model = "mlpp"\n', r"run.toml:1: key 'model': unknown model 'mlpp' \(did you mean 'mlp'\?\)"),
        ('model = "mlp"\n[optim]\noptimizer = "adamx"\n', r"run.toml:3: key 'optimizer': unknown optimizer 'adamx'"),
        ('model = "mlp"\nschedule = "cosin"\n', r"run.toml:2: key 'schedule': unknown schedule 'cosin'"),
    ],
)
def test_an_unknown_name_in_a_toml_file_names_file_and_line(tmp_path, text, fragment):
    """A registry's refusal (an unknown model, optimizer, schedule) of a value the file gave names the file's line,
    as a refusal starting with the value's flag does."""
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        train_settings({}, path)
    path.write_text('model = "mlp"\nschedule = "cosine"\n')
    with pytest.raises(ConfigError, match=r"^unknown schedule 'cosin2'"):  # the flag's value: no file line
        train_settings({"schedule": "cosin2"}, path)


def test_config_json_is_flat_and_reads_back(tmp_path):
    import json

    from trainscale.app.config import config_from_dict, read_run_config

    cfg = build_config({"model": "mlp", "workers": 2, "compress": "topk", "ratio": 0.01, "lr": 0.2})
    flat = cfg.to_dict()
    assert list(flat) == list(FIELDS) and not any(isinstance(v, dict) for v in flat.values())
    (tmp_path / "config.json").write_text(json.dumps({**flat, "resolved": {"world_size": 2}}))
    assert read_run_config(tmp_path / "config.json") == cfg
    assert config_from_dict({"optim": {"lr": 0.2}, "model": "mlp"}).optim.lr == 0.2


def test_sections_are_typed_attributes_not_flat_ones():
    cfg = TrainConfig.flat(lr=0.3, workers=2, servers=1)
    assert (cfg.optim.lr, cfg.launch.workers, cfg.ps.servers) == (0.3, 2, 1)
    assert not hasattr(cfg, "lr")
    assert cfg.replace(lr=0.5).optim.lr == 0.5 and cfg.optim.lr == 0.3
    with pytest.raises(TypeError, match="unknown setting"):
        cfg.replace(lrr=0.5)


def test_a_mode_takes_only_the_sections_it_declares():
    from trainscale.compression.config import CompressionConfig
    from trainscale.modes import mode_class

    assert CompressionConfig in mode_class("sync").sections and CompressionConfig in mode_class("async").sections
    assert CompressionConfig not in mode_class("local").sections
    with pytest.raises(ConfigError, match="--servers is for the parameter-server modes .*, not --mode sync"):
        build_config({"workers": 2, "mode": "sync", "servers": 1})
    with pytest.raises(ConfigError, match="--sync-every is for --mode diloco, localsgd, not --mode sync"):
        build_config({"workers": 2, "mode": "sync", "sync_every": 4})
    with pytest.raises(ConfigError, match="--fault-tolerance is for --mode diloco, localsgd, sync, not --mode async"):
        build_config({"workers": 2, "servers": 1, "fault_tolerance": True})


def test_a_worker_started_by_trainscale_keeps_the_settings_notes_its_launcher_said(caplog, tmp_path):
    """A node of an emulated cluster too: it is given every resolved setting as a flag, so each note about a
    setting that does nothing (--muon-lr with --optimizer sgd...) came back from every node, about flags the user
    never gave. Through the command's own reading of its flags, as each process of a job reads them."""
    import argparse
    import logging

    from trainscale.commands import train_config
    from trainscale.runtime.job import Job, installed

    flags = {"model": "mlp", "dataset": "synthetic", "train_subset": 256}  # the default batch is cut: a note
    args = argparse.Namespace(command="train", **flags, gamma=0.5, schedule="onecycle")
    node = Job(node_report=tmp_path / "node0.json")
    for job, said in ((Job(), True), (Job(launched=True, launcher_pid=1), False), (node, False)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trainscale"), installed(job):
            train_config(args)
        assert any("larger than --train-subset" in r.message for r in caplog.records) is said
        assert any("--gamma does nothing with --schedule onecycle" in r.message for r in caplog.records) is said


def test_ft_timeout_is_a_positive_number_with_or_without_fault_tolerance():
    """Refused only with --fault-tolerance before: a sync run took --ft-timeout -5 in silence."""
    for settings in ({"workers": 2}, {"workers": 2, "fault_tolerance": True}):
        with pytest.raises(ConfigError, match="--ft-timeout must be a positive number and <= 604800, got -5.0"):
            build_config({"model": "mlp", "ft_timeout": -5.0, **settings})


def test_a_refused_setting_is_the_one_line_said_not_a_note_before_it(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="trainscale"), pytest.raises(ConfigError, match="--epochs must be"):
        build_config({"model": "mlp", "dataset": "synthetic", "train_subset": 64, "epochs": 0})
    assert caplog.records == []


def test_a_node_resuming_a_run_on_an_emulated_cluster_takes_its_placement_from_its_launcher(tmp_path):
    """run.toml records `cluster = NAME`; each node, given --nnodes and --node-rank by `train --cluster`, read it
    back on --resume and refused its own flags: a run on a cluster (a bench's too) could never be resumed."""
    from trainscale.app.config import resumed_settings

    (tmp_path / "run.toml").write_text('model = "mlp"\ncluster = "lab"\nepochs = 2.0\n')
    user = {"resume": True, "out": str(tmp_path)}
    assert resumed_settings(user)["cluster"] == "lab"  # the user's `train --out DIR --resume`: on the cluster again
    node = {**user, "nnodes": 2, "node_rank": 1, "rdzv_endpoint": "10.77.0.1:29400"}
    assert "cluster" not in resumed_settings(node) and resumed_settings(node)["epochs"] == 2.0
    build_config({**resumed_settings(node), **node})  # the node's settings are valid together
