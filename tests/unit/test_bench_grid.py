"""Grid files: parsing, expansion, precedence, and every bad input named by file and line before any run."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from trainscale.bench.expand import config_hash, plan_runs
from trainscale.bench.grid import GridError, load_grid, parse_sets, set_argument
from trainscale.bench.locate import KeyLocator
from trainscale.errors import ConfigError

GRIDS = sorted((Path(__file__).parents[2] / "benchmarks" / "grids").glob("*.toml"))


def grid_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def plan(tmp_path: Path, text: str, scale: str | None = None):
    return plan_runs(load_grid(grid_file(tmp_path, text)), scale)


BASIC = """
    name = "basic"
    [base]
    model = "mlp"
    epochs = 1
    [axes]
    lr = [0.1, 0.2]
    momentum = [0.0, 0.9]
"""


def test_axes_expand_to_their_cartesian_product(tmp_path):
    runs = plan(tmp_path, BASIC)
    assert [(r.config["lr"], r.config["momentum"]) for r in runs] == [(0.1, 0.0), (0.1, 0.9), (0.2, 0.0), (0.2, 0.9)]
    assert all(r.config["model"] == "mlp" and r.config["epochs"] == 1 for r in runs)
    assert runs[0].run_id == f"lr0.1-momentum0.0-{runs[0].config_hash}"
    assert len({r.run_id for r in runs}) == 4


def test_rows_cross_the_axes_and_carry_their_own(tmp_path):
    runs = plan(
        tmp_path,
        """
        name = "rows"
        [base]
        model = "mlp"
        [axes]
        lr = [0.1, 0.2]
        [[rows]]
        short_name = "A"
        batch_size = 64
        [[rows]]
        short_name = "B"
        axes.momentum = [0.0, 0.5]
    """,
    )
    assert [r.name for r in runs] == [
        "A-lr0.1",
        "A-lr0.2",
        "B-lr0.1-momentum0.0",
        "B-lr0.1-momentum0.5",
        "B-lr0.2-momentum0.0",
        "B-lr0.2-momentum0.5",
    ]
    assert {r.config["batch_size"] for r in runs if r.short_name == "A"} == {64}


SCALED = """
    name = "scaled"
    repeats = 1
    [base]
    model = "resnet32"
    epochs = 82
    seed = 7
    [[rows]]
    short_name = "one"
    batch_size = 128
    [[rows]]
    short_name = "many"
    workers = 8
    batch_per_worker = 64
    axes.lr = [0.1, 0.4]
    scale.quick.workers = 2
    [[rows]]
    short_name = "big"
    model = "resnet110"
    [scale.quick]
    rows = ["one", "many"]
    model = "mlp"
    epochs = 1
    repeats = 2
    axes.lr = [0.05]
    [scale.full]
"""


def test_quick_scale_shrinks_every_row_and_rows_keep_their_own_overrides(tmp_path):
    quick = plan(tmp_path, SCALED, "quick")
    assert [r.name for r in quick] == ["one-r0", "one-r1", "many-lr0.05-r0", "many-lr0.05-r1"]
    assert {r.config["model"] for r in quick} == {"mlp"} and {r.config["epochs"] for r in quick} == {1}
    assert [r.config["workers"] for r in quick] == [1, 1, 2, 2]
    assert [r.config["seed"] for r in quick] == [7, 8, 7, 8]  # repeat r trains with seed + r
    assert quick[2].config["mode"] == "sync" and quick[0].config["mode"] == "local"


def test_full_scale_is_the_base_settings(tmp_path):
    full = plan(tmp_path, SCALED, "full")
    assert [r.name for r in full] == ["one", "many-lr0.1", "many-lr0.4", "big"]
    assert [r.config["model"] for r in full] == ["resnet32", "resnet32", "resnet32", "resnet110"]
    assert full[1].config["workers"] == 8 and full[1].config["epochs"] == 82


def test_hash_ignores_plumbing_and_follows_settings(tmp_path):
    run = plan(tmp_path, BASIC)[0]
    assert config_hash({**run.config, "progress": True, "checkpoint": False, "rdzv_endpoint": "h:1"}) == run.config_hash
    assert config_hash({**run.config, "seed": 1}) != run.config_hash
    assert config_hash({**run.config, "lr": 0.3}) != run.config_hash
    assert plan(tmp_path, BASIC)[0].run_id == run.run_id  # stable across processes and calls


def test_a_trainscale_that_adds_a_flag_keeps_the_run_ids(tmp_path):
    run = plan(tmp_path, BASIC)[0]
    older = {k: v for k, v in run.config.items() if k != "tta"}  # as if `tta` did not exist yet
    assert config_hash(older) == run.config_hash


@pytest.mark.parametrize(
    "text, line, fragment",
    [
        ('name = "x"\n[base]\nmodel = "mlp"\nepochz = 3\n', 4, "unknown key 'epochz' (did you mean 'epochs'?)"),
        ('name = "x"\nrepeat = 2\n', 2, "unknown key 'repeat' (did you mean 'repeats'?)"),
        ('name = "x"\n[axes]\nlr = [0.1]\nbatchsize = [64]\n', 4, "unknown key 'batchsize'"),
        (
            'name = "x"\n\n[[rows]]\nshort_name = "a"\nwrokers = 2\n',
            5,
            "unknown key 'wrokers' (did you mean 'workers'?)",
        ),
        ('name = "x"\n[scale.quick]\nepochs = 1\nmodle = "mlp"\n', 4, "unknown key 'modle'"),
        ('name = "x"\n[base]\nepochs = "ten"\n', 3, "'epochs' must be float, got 'ten'"),
        (
            'name = "x"\n[base]\nmodel = "mlp"\n[axes]\nepochs = [1, 0]\n',
            5,
            "--epochs must be a positive number, got 0",
        ),
        ('name = "x"\n[base]\nmodel = "mlp"\nlr = -1.0\n', 4, "--lr must be >= 0"),
        ('name = "x"\n[base]\nmodel = "resnet23"\n', 3, "did you mean 'resnet32'"),
        ('name = "x"\n[axes]\n\nlr = []\n', 4, "axis 'lr' is empty"),
        ('name = "x"\n[axes]\nlr = 0.1\n', 3, "axis 'lr' must be a list"),
        ('name = "x"\n[base]\nout = "somewhere"\n', 3, "key 'out' is set by `trainscale bench`"),
        ('name = "x"\n[[rows]]\nlr = 0.1\naxes.lr = [0.2]\n', 4, "'lr' is an axis and is also set by row"),
        ('name = "x"\n[[rows]]\nworkers = 3\nbatch_size = 100\n', 4, "not divisible by 3 workers"),
        ('name = "x"\n[scale.quick]\nrows = ["nope"]\n', 3, "no row has short_name 'nope'"),
        ('[base]\nmodel = "mlp"\n', None, "the grid needs a 'name'"),
        ('name = "x"\n[base]\nbatch-size = 64\nbatch_size = 32\n', 3, "'batch_size' is given twice in this table"),
        ('name = "x"\n[axes]\nbatch-size = [64]\nbatch_size = [32]\n', 3, "'batch_size' is given twice"),
        ('name = "x"\n[[rows]]\nshort_name = "a"\n[[rows]]\nshort_name = "b"\n', None, "have the same settings"),
        (  # what a run reads that the grid only names: checked now, not by each run that starts and fails
            'name = "x"\n[base]\nmodel = "mlp"\n[axes]\nbaseline = ["/nonexistent-run"]\n',
            5,
            "--baseline /nonexistent-run: no summary.json there",
        ),
        ('name = "x"\n[base]\nmodel = "mlp"\ncluster = "tnone0"\n', 4, "--cluster tnone0: no cluster named 'tnone0'"),
    ],
)
def test_bad_grids_fail_naming_file_line_and_key(tmp_path, text, line, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(GridError) as info:
        plan_runs(load_grid(path), None)
    message = str(info.value)
    assert fragment in message
    if line is not None:
        assert message.startswith(f"{path}:{line}: "), message


def test_unknown_scale_lists_the_grid_scales(tmp_path):
    with pytest.raises(GridError, match="no scale 'huge'; its scales are: full, quick"):
        plan(tmp_path, SCALED, "huge")


def test_invalid_toml_is_a_grid_error(tmp_path):
    with pytest.raises(GridError, match="not valid TOML"):
        load_grid(grid_file(tmp_path, 'name = "x"\n[base\n'))


@pytest.mark.parametrize(
    "text, line",
    [
        ('name = "x"\n[[rows]]\nshort_name = "a"\nmode = "lcoal"\n', 4),
        ('name = "x"\n[axes]\nmode = ["local", "lcoal"]\n', 3),
        ('name = "x"\n[base]\nmodel = "mlp"\nmode = "lcoal"\n', 4),
    ],
)
def test_unknown_mode_names_file_line_and_a_suggestion(tmp_path, text, line):
    path = tmp_path / "modes.toml"
    path.write_text(text)
    with pytest.raises(GridError) as info:
        plan_runs(load_grid(path), None)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: unknown mode 'lcoal' (did you mean 'local'?); choose one of: "), message
    assert "sync" in message and "async" in message  # every mode this version has is listed


def test_an_unknown_optimizer_on_an_axis_names_the_axis_line(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text('name = "x"\n[base]\nmodel = "mlp"\n[axes]\noptimizer = ["sgd", "adamx"]\n')
    with pytest.raises(GridError, match=r"g.toml:5: unknown optimizer 'adamx' \(did you mean 'adam'\?\)"):
        plan_runs(load_grid(path), None)


def test_locator_maps_tables_rows_dotted_and_multiline_keys():
    text = textwrap.dedent("""
        name = "x"  # a comment with = sign
        [base]
        model = "mlp"
        [axes]
        workers = [
            1, 2,
        ]
        lr = [0.1]
        [[rows]]
        short_name = "a"
        [[rows]]
        "batch-size" = 64
        axes.momentum = [0.0]
        [scale.quick]
        axes.workers = [1]
        [rows.scale]
        quick.epochs = 1
    """).lstrip()
    lines = KeyLocator(text)
    assert [
        lines.line(p)
        for p in (
            "name",
            "base.model",
            "axes.workers",
            "axes.lr",
            "rows[0].short_name",
            "rows[1].batch_size",
            "rows[1].axes.momentum",
            "scale.quick.axes.workers",
            "rows[1].scale.quick.epochs",
            "rows[1].nothing",
        )
    ] == [1, 3, 5, 8, 10, 12, 13, 15, 17, 11]


@pytest.mark.parametrize("path", GRIDS, ids=[p.stem for p in GRIDS])
@pytest.mark.parametrize("scale", ["quick", "full"])
def test_shipped_grids_validate(path, scale):
    """Every shipped grid validates at both scales against this version's modes and flags."""
    grid = load_grid(path)
    assert grid.scales.keys() >= {"quick", "full"} and grid.source
    runs = plan_runs(grid, scale)
    assert runs
    if scale == "quick":  # minutes on a 2-core CPU (the issues' grids: under 20 minutes for 18 short runs)
        issue_grid = path.stem in ("slow_links", "plan_accuracy")
        assert len(runs) <= (18 if issue_grid else 6)
        most = 8000 if issue_grid else 5000
        assert all(r.config["epochs"] <= 3 and (r.config["train_subset"] or 50_000) <= most for r in runs)
        assert all(r.config["model"] in ("mlp", "resnet20", "airbench") for r in runs)


def test_every_results_page_has_its_grid():
    assert [p.stem for p in GRIDS] == [
        "plan_accuracy",
        "seed000_multiverso",
        "seed001_mxnet_multigpu",
        "seed002_mxnet_dist",
        "seed003_keras_scaling",
        "seed004_compression",
        "slow_links",
    ]


def test_the_slow_links_grid_runs_every_method_at_three_bandwidths_on_four_hosts():
    grid = load_grid(next(p for p in GRIDS if p.stem == "slow_links"))
    full = plan_runs(grid, "full")
    assert len(full) == 11 * 3 and {r.config["cluster"] for r in full} == {"b4h1gbit", "b4h200mbit", "b4h40mbit"}
    cells = {(r.short_name, r.config["cluster"]) for r in full}
    assert len(cells) == 33 and all(r.config["workers"] == 1 and r.config["target_acc"] == 0.7 for r in full)
    modes = {r.short_name: (r.config["mode"], r.config.get("compress")) for r in full}
    assert modes["diloco-q4"] == ("diloco", "qsgd") and modes["async"][0] == "async"
    assert modes["fp32"] == ("sync", "none") and modes["bf16"] == ("sync", "bf16")
    quick = plan_runs(grid, "quick")
    assert len(quick) == 18 and {r.short_name for r in quick} >= {"fp32", "bf16", "diloco"}


# ------------------------------------------------------------------ `trainscale bench --set KEY=VALUE`


def test_set_values_are_toml_and_a_bare_word_is_text():
    sets = parse_sets(
        [
            "epochs=2",
            "lr=0.05",
            'precision="bf16"',
            "compress=topk",
            "milestones=[2, 3]",
            "nesterov=true",
            "batch-size=64",
            "rdzv_id=42",
            "data_dir=/data/cifar",
        ]
    )
    assert sets == {
        "epochs": 2,
        "lr": 0.05,
        "precision": "bf16",
        "compress": "topk",
        "milestones": [2, 3],
        "nesterov": True,
        "batch_size": 64,
        "rdzv_id": "42",
        "data_dir": "/data/cifar",
    }


def test_set_wins_over_every_layer_of_the_grid(tmp_path):
    grid = load_grid(grid_file(tmp_path, SCALED))
    runs = plan_runs(grid, "quick", {"epochs": 2, "workers": 2, "batch_per_worker": 32})
    assert {r.config["epochs"] for r in runs} == {2}  # [base] 82, [scale.quick] 1
    assert {r.config["workers"] for r in runs} == {2}  # row "one": default 1, row "many": its scale's 2
    assert {r.config["batch_per_worker"] for r in runs} == {32}  # row "many" said 64
    model = plan_runs(grid, "full", {"model": "mlp"})
    assert {r.config["model"] for r in model} == {"mlp"}  # row "big" said resnet110
    seeds = plan_runs(grid, "quick", {"seed": 100})
    assert [r.config["seed"] for r in seeds] == [100, 101, 100, 101]  # the first repeat's seed


def test_set_on_an_axis_runs_its_one_value(tmp_path):
    runs = plan(tmp_path, BASIC)
    one = plan_runs(load_grid(tmp_path / "grid.toml"), None, {"lr": 0.3})
    assert [(r.config["lr"], r.config["momentum"]) for r in one] == [(0.3, 0.0), (0.3, 0.9)]
    assert [r.name for r in one] == ["lr0.3-momentum0.0", "lr0.3-momentum0.9"]
    assert {r.run_id for r in one}.isdisjoint(r.run_id for r in runs)


def test_set_changes_the_config_hash_so_old_runs_are_never_reused(tmp_path):
    base = plan(tmp_path, BASIC)
    grid = load_grid(tmp_path / "grid.toml")
    longer = plan_runs(grid, None, {"epochs": 2})
    assert [r.config["epochs"] for r in longer] == [2] * 4
    assert [r.config_hash for r in longer] == [config_hash(r.config) for r in longer]
    assert not {r.config_hash for r in longer} & {r.config_hash for r in base}
    assert [r.run_id for r in plan_runs(grid, None, {"epochs": 1})] == [r.run_id for r in base]  # the grid's value
    data = plan_runs(grid, None, {"data_dir": str(tmp_path)})
    assert {r.config["data_dir"] for r in data} == {str(tmp_path)}
    assert not {r.config_hash for r in data} & {r.config_hash for r in base}


@pytest.mark.parametrize(
    "items, fragment",
    [
        (
            ["epochz=3"],
            "--set epochz=3: unknown key 'epochz' (did you mean 'epochs'?); --set takes the `trainscale train` flags",
        ),
        (["epochs=ten"], "--set epochs=\"ten\": 'epochs' must be float, got 'ten'"),
        (["lr=[0.1]"], "--set lr=[0.1]: 'lr' must be float, got [0.1]"),
        (["milestones=[2,3"], "--set milestones=[2,3: '[2,3' is not a TOML value"),
        (["out=elsewhere"], "--set out=\"elsewhere\": key 'out' is set by `trainscale bench` for each run"),
        (["resume=true"], "--set resume=true: key 'resume' is set by `trainscale bench`"),
        (["epochs"], "--set epochs: give KEY=VALUE"),
        (["epochs=1", "epochs=2"], "--set epochs=2: 'epochs' is given twice with --set"),
    ],
)
def test_bad_set_is_one_line_naming_it(items, fragment):
    with pytest.raises(GridError) as info:
        parse_sets(items)
    assert str(info.value).startswith(fragment), str(info.value)
    assert "\n" not in str(info.value)


def test_a_scripts_set_is_checked_as_its_command_line_is_read():
    import argparse

    assert set_argument("epochs=2") == "epochs=2"  # the text, for parse_sets to read once all are in
    with pytest.raises(argparse.ArgumentTypeError, match=r"^epochz=3: unknown key 'epochz' \(did you mean 'epochs'"):
        set_argument("epochz=3")


TWO_ROWS = 'name = "x"\n[base]\nmodel = "mlp"\n[axes]\nlr = [0.1]\n[[rows]]\nmomentum = 0.0\n[[rows]]\nmomentum = 0.9\n'


@pytest.mark.parametrize(
    "text, sets, fragment",
    [
        (BASIC, {"epochz": 3}, "--set epochz=3: unknown key 'epochz' (did you mean 'epochs'?)"),
        (BASIC, {"epochs": "ten"}, "--set epochs=\"ten\": 'epochs' must be float, got 'ten'"),
        (BASIC, {"progress": True}, "--set progress=true: key 'progress' is set by `trainscale bench`"),
        (BASIC, {"epochs": 0}, "--set epochs=0: --epochs must be a positive number, got 0"),
        (BASIC, {"mode": "lcoal"}, "--set mode=\"lcoal\": unknown mode 'lcoal' (did you mean 'local'?)"),
        (
            TWO_ROWS,
            {"momentum": 0.5},
            ": runs 'lr0.1' and 'lr0.1' have the same settings once --set momentum=0.5 applies to every run",
        ),
    ],
)
def test_set_is_checked_when_the_runs_are_planned(tmp_path, text, sets, fragment):
    """Planning checks --set values too (a caller of plan_runs may skip parse_sets), naming the --set."""
    with pytest.raises(GridError) as info:
        plan_runs(load_grid(grid_file(tmp_path, text)), None, sets)
    assert fragment in str(info.value), str(info.value)


# ------------------------------------------------------------------ a grid may not start ssh on its own

REMOTE = """
    name = "remote"
    [base]
    model = "mlp"
    hosts = "hosts.txt"
    ssh = true
"""


@pytest.mark.parametrize(
    "text, line, key",
    [
        (REMOTE, 4, "hosts"),
        ('name = "r"\n[base]\nmodel = "mlp"\n[axes]\nhosts = ["h"]\n', 5, "hosts"),
        ('name = "r"\n[base]\nmodel = "mlp"\n[[rows]]\nshort_name = "A"\nhosts = "h"\n', 6, "hosts"),
    ],
)
def test_a_grid_that_sets_ssh_or_hosts_is_refused_without_allow_ssh(tmp_path, text, line, key):
    grid = load_grid(grid_file(tmp_path, text))
    with pytest.raises(GridError) as info:
        plan_runs(grid, None)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'grid.toml'}:{line}: '{key}' = "), message
    assert "--allow-ssh" in message and "\n" not in message
    assert {r.config[key] for r in plan_runs(grid, None, allow_ssh=True)} - {None, False}


def test_ssh_alone_is_refused_on_its_axis_line(tmp_path):
    grid = load_grid(grid_file(tmp_path, 'name = "r"\n[base]\nmodel = "mlp"\n[axes]\nssh = [false, true]\n'))
    with pytest.raises(GridError, match=r"grid.toml:5: 'ssh' = True would make the runs start commands"):
        plan_runs(grid, None)


def test_a_set_of_ssh_needs_allow_ssh_too(tmp_path):
    grid = load_grid(grid_file(tmp_path, BASIC))
    with pytest.raises(GridError, match=r"^--set hosts=\"h\": 'hosts' = 'h' would make the runs start commands"):
        plan_runs(grid, None, {"hosts": "h"})
    assert plan_runs(grid, None, {"hosts": "h", "ssh": False}, allow_ssh=True)


def test_bench_dry_run_refuses_a_grid_with_ssh_and_names_the_flag(tmp_path, capsys):
    from trainscale.cli import main

    path = grid_file(tmp_path, REMOTE)
    assert main(["bench", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "grid.toml:4: 'hosts' = 'hosts.txt'" in err[0] and "--allow-ssh" in err[0]
    assert main(["bench", str(path), "--out", str(tmp_path / "out"), "--dry-run", "--allow-ssh"]) == 0
    assert "1 run(s)" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_a_grid_may_not_choose_dry_run(tmp_path):
    text = 'name = "d"\n[base]\nmodel = "mlp"\ndry_run = true\n'
    with pytest.raises(GridError, match="grid.toml:4: key 'dry_run' is set by `trainscale bench`"):
        load_grid(grid_file(tmp_path, text))


def test_a_grid_of_absurdly_many_runs_is_refused_before_any_config_is_built(tmp_path):
    with pytest.raises(GridError, match=r"grid.toml:2: the grid plans 4,000,000,000 runs .*more than 10,000"):
        plan(tmp_path, 'name = "big"\nrepeats = 1000000000\n[axes]\nlr = [0.1, 0.2, 0.3, 0.4]\n')


def test_cluster_hosts_and_bandwidth_name_a_cluster_the_bench_makes(tmp_path):
    from trainscale.cluster.bench import bench_cluster, take_cluster_keys

    path = tmp_path / "g.toml"
    path.write_text(
        'name = "c"\n[base]\nmodel = "mlp"\ndataset = "synthetic"\nepochs = 1\n'
        '[axes]\ncluster_hosts = [2, 4]\nbandwidth = ["100mbit", "1gbit"]\n'
    )
    specs = plan_runs(load_grid(path), None)
    assert sorted(s.config["cluster"] for s in specs) == ["b2h100mbit", "b2h1gbit", "b4h100mbit", "b4h1gbit"]
    assert bench_cluster("b4h100mbit") == (4, 100_000_000) and bench_cluster("lab") is None
    assert take_cluster_keys({"lr": 0.1}) == {"lr": 0.1}
    for values, fragment in (
        ({"cluster_hosts": 2}, "go together"),
        ({"cluster_hosts": 1, "bandwidth": "1gbit"}, "--hosts must be between"),
        ({"cluster_hosts": 2, "bandwidth": "1gbps"}, "--bandwidth"),
        ({"cluster_hosts": 2, "bandwidth": "1gbit", "cluster": "lab"}, "not both"),
    ):
        with pytest.raises(ConfigError, match=fragment):
            take_cluster_keys(values)
    path.write_text('name = "c"\n[base]\nmodel = "mlp"\ncluster_hosts = "two"\nbandwidth = "1gbit"\n')
    with pytest.raises(GridError, match=r"g.toml:4: 'cluster_hosts' must be int"):
        plan_runs(load_grid(path), None)


def test_the_ps_lite_grid_has_emulated_cluster_scales():
    """seed002's BSP against Async on 5 emulated hosts at 1 Gbit/s (the page's cluster), and on 4 hosts at
    two rates for the step-time split; the single-worker row stays on this machine."""
    grid = load_grid(next(p for p in GRIDS if p.stem == "seed002_mxnet_dist"))
    emulated = {r.short_name: r.config for r in plan_runs(grid, "emulated")}
    assert emulated["1GPU"].get("cluster") is None
    assert {emulated[n]["cluster"] for n in ("BSP", "Async")} == {"b5h1gbit"} and emulated["Async"]["servers"] == 1
    links = plan_runs(grid, "links")
    assert sorted((r.config["mode"], r.config["cluster"]) for r in links) == [
        ("async", "b4h100mbit"),
        ("async", "b4h1gbit"),
        ("sync", "b4h100mbit"),
        ("sync", "b4h1gbit"),
    ]
