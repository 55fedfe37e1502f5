"""`trainscale report` on hand-made run folders: the results pages' columns, a header saying what ran, mean ±
spread over repeats, scaling efficiency, only what was run, environments never averaged together, and grid
folders never mixed."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
import textwrap
from pathlib import Path

import pytest
from PIL import Image

from trainscale.app.config import TrainConfig
from trainscale.bench.expand import plan_runs
from trainscale.bench.grid import load_grid
from trainscale.bench.runfolder import write_run_files
from trainscale.bench.runner import BenchOptions, write_grid_json
from trainscale.errors import ConfigError
from trainscale.report.aggregate import Stat
from trainscale.report.build import MANIFEST, write_report

CPU = {
    "torch": "2.13.0+cpu",
    "python": "3.11.7",
    "device": "cpu",
    "device_name": "cpu (Test CPU)",
    "cpu": "Test CPU",
    "cpu_count": 2,
    "torch_threads": 2,
    "cuda": None,
    "hostname": "box",
    "git_commit": "abc123",
}
GPU = {**CPU, "device": "cuda:0", "device_name": "NVIDIA H100", "cuda": "12.4"}
SCOPE = "training steps only (test)"


def make_run(
    folder: Path,
    *,
    workers: int = 1,
    seed: int = 0,
    rate: float = 100.0,
    acc: float = 0.5,
    env: dict | None = None,
    lr: float = 0.1,
    extra: dict | None = None,
    epochs: int = 3,
    config: dict | None = None,
) -> Path:
    """A finished run folder as `trainscale train` writes it; ``rate`` is its steady images/s."""
    folder.mkdir(parents=True)
    config = {
        **TrainConfig().to_dict(),
        "model": "mlp",
        "epochs": epochs,
        "workers": workers,
        "seed": seed,
        "lr": lr,
        "batch_per_worker": 100,
        "mode": "sync" if workers > 1 else "local",
        "out": str(folder),
        **(config or {}),
    }
    per_epoch = 1000 * workers
    steady = per_epoch / rate
    metrics = [
        {
            "epoch": e,
            "lr": lr,
            "train_acc": acc - 0.1,
            "test_acc": acc * e / epochs,
            "epoch_seconds": steady,
            "eval_seconds": 0.1,
            "elapsed_seconds": steady * e,
            "samples_per_sec": rate,
        }
        for e in range(1, epochs + 1)
    ]
    summary = {
        "out": str(folder),
        "model": "mlp",
        "params": 10,
        "dataset": "cifar10",
        "mode": config["mode"],
        "world_size": workers,
        "epochs": epochs,
        "epochs_completed": epochs,
        "batch_size": 100 * workers,
        "batch_per_worker": 100,
        "lr": lr,
        "precision": "fp32",
        "image_size": 32,
        "train_samples_per_epoch": per_epoch,
        "seed": seed,
        "environment": env or CPU,
        "best_test_acc": acc,
        "final_test_acc": acc,
        "mean_epoch_seconds": steady,
        "steady_epoch_seconds": steady,
        "samples_per_sec": rate,
        "peak_memory_mb": 500.0 + workers,
        "total_train_seconds": steady * epochs,
        "timer_scope": SCOPE,
        **(extra or {}),
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return folder


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def scaling_runs(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    make_run(runs / "w1-a", seed=0, rate=100.0, acc=0.50)
    make_run(runs / "w1-b", seed=1, rate=110.0, acc=0.52)  # a repeat: same config, another seed
    make_run(runs / "w2", workers=2, rate=168.0, acc=0.48)
    return runs


def test_csv_has_one_row_per_run_with_every_summary_config_and_environment_field(scaling_runs, tmp_path):
    write_report([scaling_runs], tmp_path / "report")
    rows = read_csv(tmp_path / "report" / "results.csv")
    assert len(rows) == 3
    summary = json.loads((scaling_runs / "w2" / "summary.json").read_text())
    expected = (
        {k for k in summary if k != "environment"}
        | {f"environment.{k}" for k in CPU}
        | {f"config.{k}" for k in TrainConfig().to_dict()}
        | {"run_id", "status", "scaling_efficiency"}
    )
    assert expected <= set(rows[0])
    w2 = next(r for r in rows if r["run_id"] == "w2")
    assert float(w2["scaling_efficiency"]) == pytest.approx((168 / 2) / 105)
    assert w2["timer_scope"] == SCOPE and w2["environment.device_name"] == "cpu (Test CPU)"


def test_markdown_tables_have_the_seeds_columns_and_mean_and_spread(scaling_runs, tmp_path):
    write_report([scaling_runs], tmp_path / "report")
    md = (tmp_path / "report" / "results.md").read_text()
    assert (
        "| Short Name | model | processes | GPUs per process | parameter server | batch size | initial LR | "
        "seconds per epoch | best validation accuracy | runs |"
    ) in md
    assert "| Short Name | model | workers | batch size | images/s | scaling efficiency |" in md
    assert "peak memory (MB)" in md and f"timer scope: {SCOPE}" in md
    # the two 1-worker repeats: images/s 100 and 110 -> mean 105, sample stdev 7.07
    assert "| w1-a | mlp | 1 | 100 | 105 ± 7 | 1.00 ± 0.07 |" in md
    assert "51.00 ± 1.41 %" in md  # best accuracy 0.50 and 0.52
    assert "| w2 | mlp | 2 | 100x2=200 | 168 | 0.80 (vs w1-a) |" in md
    assert "| w1-a | mlp | 1 | 0 | off | 100 | 0.1 |" in md and "| 2 |" in md
    assert "Communication" not in md  # no run reported bytes: no such table


def test_every_png_decodes_and_the_html_page_is_self_contained(scaling_runs, tmp_path):
    report = write_report([scaling_runs], tmp_path / "report")
    pngs = sorted((tmp_path / "report").glob("*.png"))
    assert [p.name for p in pngs] == ["accuracy_epoch.png", "accuracy_time.png", "throughput_workers.png"]
    for png in pngs:
        with Image.open(png) as image:
            image.load()
            low, high = image.convert("L").getextrema()
            assert image.size[0] > 300 and high - low > 100  # drawn, not one flat colour
    page = (tmp_path / "report" / "index.html").read_text()
    assert page.count("src='data:image/png;base64,") == 3
    assert not re.search(r"(src|href)\s*=\s*['\"]?(https?:|//)|<link|<script|@import|url\(", page)  # offline
    assert "<th>Short Name</th>" in page and "105 ± 7" in page
    assert {p.name for p in report.files} >= {"results.csv", "results.md", "index.html"}


def test_runs_from_two_environments_are_never_averaged_together(tmp_path):
    make_run(tmp_path / "runs" / "cpu", env=CPU, rate=100.0)
    make_run(tmp_path / "runs" / "gpu", env=GPU, rate=5000.0)
    write_report([tmp_path / "runs"], tmp_path / "report")
    md = (tmp_path / "report" / "results.md").read_text()
    assert "**Warning:** These runs were measured in 2 different environments" in md
    assert "## Environment 1: cpu (Test CPU), torch 2.13.0+cpu" in md and "## Environment 2: NVIDIA H100" in md
    assert "| cpu | mlp | 1 | 0 | off |" in md and "| gpu | mlp | 1 | 1 | off |" in md  # GPUs per process
    assert not [line for line in md.splitlines() if line.startswith("| ") and "±" in line]  # nothing averaged
    assert (tmp_path / "report" / "accuracy_epoch-env2.png").exists()
    rows = read_csv(tmp_path / "report" / "results.csv")
    assert sorted(r["partition"] for r in rows) == ["1", "2"]


def test_communication_table_and_plot_only_when_bytes_were_measured(tmp_path):
    make_run(tmp_path / "runs" / "dense", workers=2, extra={"bytes_sent_per_step": 4_000_000.0})
    make_run(
        tmp_path / "runs" / "topk",
        workers=2,
        lr=0.2,
        acc=0.45,
        extra={
            "bytes_sent_per_step": 80_000.0,
            "dense_bytes_per_step": 4_000_000.0,
            "compress_method": "topk",
            "compress_granularity": "layerwise",
        },
    )
    make_run(
        tmp_path / "runs" / "bf16",
        workers=2,
        rate=50.0,
        lr=0.3,
        extra={
            "bytes_sent_per_step": 2_000_000.0,
            "dense_bytes_per_step": 4_000_000.0,
            "compress_method": "bf16",
            "compress_granularity": "layerwise",
        },
    )
    write_report([tmp_path / "runs"], tmp_path / "report")
    md = (tmp_path / "report" / "results.md").read_text()
    assert (
        "| Short Name | method | ratio | granularity | workers | bytes per step | compression vs fp32 | "
        "compression vs bf16 |"
    ) in md
    rows = {line.split(" | ")[0]: line.split(" | ") for line in md.splitlines() if line.startswith("| ")}
    assert rows["| topk"][1:8] == ["topk", "-", "layerwise", "2", "80,000", "50.0", "25.0"]
    assert rows["| dense"][1:8] == ["none", "-", "-", "2", "4,000,000", "1.0", "0.5"]
    assert rows["| bf16"][1:8] == ["bf16", "-", "layerwise", "2", "2,000,000", "2.0", "1.0"]
    # time vs fp32 and vs bf16: the bf16 run is half as fast (50 img/s against 100)
    assert rows["| topk"][-2:] == ["1.00", "0.50 |"] and rows["| bf16"][-2:] == ["2.00", "1.00 |"]
    with Image.open(tmp_path / "report" / "accuracy_bytes.png") as image:
        image.load()


def make_grid_dir(tmp_path: Path) -> tuple[Path, list]:
    grid = tmp_path / "grid.toml"
    grid.write_text(
        textwrap.dedent("""
        name = "handmade"
        description = "for the report tests"
        [base]
        model = "mlp"
        epochs = 3
        [axes]
        lr = [0.1, 0.2, 0.3]
    """)
    )
    out = tmp_path / "results"
    specs = plan_runs(load_grid(grid), None)
    out.mkdir()
    write_grid_json(BenchOptions(grid=grid, out=out), load_grid(grid), specs)
    for spec in specs[:2]:
        folder = out / "runs" / spec.run_id
        make_run(folder, lr=spec.config["lr"])
        (folder / "config.json").write_text(json.dumps({**spec.config, "out": str(folder)}))
        write_run_files(folder, spec, resume=False)
    failed = out / "runs" / specs[2].run_id
    write_run_files(failed, specs[2], resume=False)
    (out / "grid.jsonl").write_text(
        json.dumps({"run_id": specs[2].run_id, "status": "failed", "error": "trainscale train: error: it broke"}) + "\n"
    )
    return out, specs


def test_grid_folder_reports_its_planned_runs_and_lists_the_failed_one(tmp_path):
    out, specs = make_grid_dir(tmp_path)
    make_run(out / "runs" / "lr0.9-0123abcd", lr=0.9)  # left over from older settings
    report = write_report([out], tmp_path / "report")
    md = (tmp_path / "report" / "results.md").read_text()
    assert "Grid handmade (scale none): 3 run(s) of mlp for 3 epochs on all cifar10 training images" in md
    assert "The grid file describes handmade as: for the report tests (its words" in md
    assert "| lr0.1 | mlp |" in md and "| lr0.2 | mlp |" in md and "lr0.9" not in md.split("**Warning:**")[0]
    assert "1 run folder(s) not planned by its grid.json (older settings) are left out: lr0.9-0123abcd" in md
    assert f"| {specs[2].run_id} | failed | trainscale train: error: it broke |" in md
    statuses = {r["run_id"]: r["status"] for r in read_csv(tmp_path / "report" / "results.csv")}
    assert statuses == {specs[0].run_id: "ok", specs[1].run_id: "ok", specs[2].run_id: "failed"}
    assert report.problems is not None


def test_grid_run_whose_folder_changed_settings_is_excluded_not_mixed(tmp_path):
    out, specs = make_grid_dir(tmp_path)
    config = out / "runs" / specs[0].run_id / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "momentum": 0.0}))
    write_report([out], tmp_path / "report")
    rows = {r["run_id"]: r for r in read_csv(tmp_path / "report" / "results.csv")}
    assert rows[specs[0].run_id]["status"] == "excluded" and "momentum" in rows[specs[0].run_id]["error"]
    assert "| lr0.1 | mlp |" not in (tmp_path / "report" / "results.md").read_text()


BIG_GRID = """
    name = "big-grid"
    description = "ResNet-32, 82 epochs on all 50,000 images"
    [base]
    model = "resnet32"
    epochs = 82
    [[rows]]
    short_name = "local"
    batch_size = 128
    [[rows]]
    short_name = "short"
    batch_size = 64
    scale.quick.epochs = 1
    [scale.quick]
    description = "ResNet-20 on 2,000 images"
    model = "resnet20"
    train_subset = 2000
    epochs = 2
    [scale.full]
"""


def test_header_describes_the_runs_that_were_made_not_the_grid_description(tmp_path):
    """The Multiverso grid at quick scale ran ResNet-20 on 2,000 images: its header must say so, not repeat the
    grid's full-scale "ResNet-32, 82 epochs" as if that had run; differing values are all listed."""
    grid = tmp_path / "big.toml"
    grid.write_text(textwrap.dedent(BIG_GRID))
    out = tmp_path / "results"
    out.mkdir()
    options = BenchOptions(grid=grid, out=out, scale="quick", sets={"lr": 0.05})
    specs = plan_runs(load_grid(grid), "quick", options.sets)
    write_grid_json(options, load_grid(grid), specs)
    for spec, seen in zip(specs, (1920, 1984)):
        folder = out / "runs" / spec.run_id
        make_run(
            folder, lr=0.05, epochs=spec.config["epochs"], extra={"model": "resnet20", "train_samples_per_epoch": seen}
        )
        (folder / "config.json").write_text(json.dumps({**spec.config, "out": str(folder)}))
        write_run_files(folder, spec, resume=False)
    make_run(tmp_path / "plain" / "mlp-run", epochs=1)
    report = write_report([out, tmp_path / "plain"], tmp_path / "report")
    head = next(line for line in report.intro if line.startswith("Grid big-grid"))
    assert head == (
        "Grid big-grid (scale quick, --set lr=0.05): 2 run(s) of resnet20 for 1 or 2 epochs on 2,000 "
        "cifar10 training images (1,920 or 1,984 per epoch)."
    )
    assert (
        "Runs outside a grid: 1 run(s) of mlp for 1 epoch on all cifar10 training images (1,000 per epoch)."
        in report.intro
    )
    md = (tmp_path / "report" / "results.md").read_text()
    page = (tmp_path / "report" / "index.html").read_text()
    assert head in md and head in page
    described = next(line for line in md.splitlines() if "ResNet-32" in line)  # the grid's own words: secondary
    assert described == (
        "The grid file describes big-grid as: ResNet-32, 82 epochs on all 50,000 images; scale "
        "quick: ResNet-20 on 2,000 images (its words, not a record of the runs above)."
    )
    assert md.index(head) < md.index(described)


def test_report_refuses_to_write_into_a_folder_that_is_not_a_report(scaling_runs, tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="holds notes.txt, which no trainscale report wrote"):
        write_report([scaling_runs], target)
    (target / "notes.txt").unlink()
    (target / "results.md").write_text("my own results")  # a user's file of a report's name: still not a report
    (target / "architecture.png").write_bytes(b"mine")
    with pytest.raises(ConfigError, match="holds architecture.png, which no trainscale report wrote"):
        write_report([scaling_runs], target)
    assert (target / "results.md").read_text() == "my own results"
    out = tmp_path / "report"
    write_report([scaling_runs], out)
    (out / "accuracy_bytes-env2.png").write_bytes(b"a plot the previous report drew and the next one does not")
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps([*manifest, "accuracy_bytes-env2.png"]))
    (out / "my_notes.md").write_text("keep me")
    write_report([scaling_runs], out)  # a previous report is replaced, its stale plots too; the user's file stays
    assert not (out / "accuracy_bytes-env2.png").exists() and (out / "my_notes.md").read_text() == "keep me"
    (out / MANIFEST).unlink()
    (out / "my_notes.md").unlink()
    write_report([scaling_runs], out)  # a report written before reports listed their files: replaced too
    (target / "architecture.png").unlink()
    with pytest.raises(ConfigError, match="holds files, which no trainscale report wrote"):
        write_report([scaling_runs], target)  # results.md alone is no report


def test_no_runs_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no runs found"):
        write_report([tmp_path / "empty"], tmp_path / "report")
    started = tmp_path / "runs" / "first"
    started.mkdir(parents=True)
    (started / "run.toml").write_text('model = "mlp"\n')  # written at the start; summary.json after an epoch
    with pytest.raises(ConfigError, match=f"has finished an epoch yet: {started} holds a run in progress"):
        write_report([tmp_path / "runs"], tmp_path / "report")


def test_stat_text_shows_spread_only_for_repeats():
    assert Stat([0.5]).text(".2f", 100, " %") == "50.00 %"
    assert Stat([1.0, 3.0]).text(".1f") == "2.0 ± 1.4"
    assert Stat([]).text() == "-"


def test_bsp_and_async_on_a_cluster_get_the_step_split_table_and_the_side_by_side_figure(tmp_path):
    cluster = {"name": "b5h1gbit", "hosts": 5, "rate_bps": 10**9, "rates_bps": [10**9] * 5}
    split = {"step_seconds": 0.5, "wire_bytes_sent_per_step": 2**21, "cluster": cluster}
    make_run(
        tmp_path / "runs" / "bsp",
        workers=5,
        extra={
            **split,
            "comm_seconds_per_step": 0.125,
            "compute_seconds_per_step": 0.375,
            "comm_ms_per_step": 200.0,
            "hidden_ms_per_step": 80.0,
        },
    )
    async_run = make_run(
        tmp_path / "runs" / "async",
        workers=5,
        extra={**split, "mode": "async", "servers": 5, "comm_seconds_per_step": 0.25, "compute_seconds_per_step": 0.25},
    )
    config = json.loads((async_run / "config.json").read_text())
    (async_run / "config.json").write_text(json.dumps({**config, "mode": "async", "servers": 1}))
    write_report([tmp_path / "runs"], tmp_path / "report")
    text = (tmp_path / "report" / "results.md").read_text()
    table = text.split("### Step time: compute and communication")[1].split("\n\n")[1].splitlines()
    assert (
        "| bsp | sync | none | 5 | 5 hosts at 1 Gbit/s | 500.0 | 375.0 | 125.0 | 25% | - | 200.0 | 80.0 | - | "
        "2.00 | 100 |"
    ) in table[2:]
    assert (
        "| async | async | none | 5 | 5 hosts at 1 Gbit/s | 500.0 | 250.0 | 250.0 | 50% | - | - | - | - | 2.00 | 100 |"
    ) in table[2:]
    with Image.open(tmp_path / "report" / "accuracy_bsp_async.png") as image:
        assert image.size[0] > 2 * 400  # two panels


def test_slow_links_report_times_each_method_to_target_against_fp32_and_bf16_per_network(tmp_path):
    """fp32, bf16 and Top-k on three networks: the time-to-target table relates each to both dense
    baselines on its own network, the crossover table interpolates where Top-k starts to win, and the
    accuracy-against-time figure gets one panel per network."""
    times = {"fp32": (100.0, 200.0, 800.0), "bf16": (100.0, 150.0, 420.0), "topk": (150.0, 150.0, 160.0)}
    for method, per_rate in times.items():
        for rate, seconds in zip((10**9, 10**8, 10**7), per_rate):
            cluster = {"name": f"b4h{rate}", "hosts": 4, "rate_bps": rate, "rates_bps": [rate] * 4}
            compress = {"fp32": "none", "bf16": "bf16", "topk": "topk"}[method]
            make_run(
                tmp_path / "runs" / f"{method}-{rate}",
                workers=4,
                config={"compress": compress, "cluster": cluster["name"]},
                extra={
                    "cluster": cluster,
                    "target_acc": 0.4,
                    "time_to_target_seconds": seconds,
                    "compress_method": compress,
                    "bytes_sent_per_step": 1000.0,
                },
            )
    write_report([tmp_path / "runs"], tmp_path / "report")
    text = (tmp_path / "report" / "results.md").read_text()
    table = text.split("### Time to 40.00 % test accuracy")[1].split("\n\n")[1].splitlines()
    rows = {r.split(" | ")[0][2:]: r.split(" | ") for r in table[2:]}
    assert rows["topk-10000000"][4:7] == ["160.0", "0.20", "0.38"]
    assert rows["bf16-1000000000"][4:7] == ["100.0", "1.00", "1.00"]
    assert rows["topk-1000000000"][3] == "4 hosts at 1 Gbit/s"
    cross = text.split("### Crossover bandwidth against dense fp32")[1].split("\n\n")[1].splitlines()[2:]
    by_method = {r.split(" | ")[1]: r for r in cross}
    assert "about 215 Mbit/s (wins below)" in by_method["topk"]  # 0.75 at 100 Mbit/s, 1.5 at 1 Gbit/s
    assert "about 1 Gbit/s (wins below)" in by_method["bf16"]  # level with fp32 at 1 Gbit/s
    assert (tmp_path / "report" / "accuracy_time_networks.png").exists()


def test_profile_puts_the_planner_beside_cluster_runs(tmp_path):
    """Runs on an emulated cluster with a matching profile get planned step times, a scatter and the planned
    crossover; a run the profile does not match (another batch) is left out, not predicted."""
    from tests.unit.test_plan import make_profile

    profile = dataclasses.replace(make_profile(), model="mlp", batch_size=100, threads=1, cpus=0.5)
    (tmp_path / "p.json").write_text(profile.to_json())
    cluster = {"hosts": 4, "rate_bps": 8e8, "rates_bps": [8e8] * 4, "threads_per_process": 1, "cpus_per_host": 0.5}
    for name, rate, compress, step in (
        ("fp32-fast", 8e8, "none", 0.75),
        ("fp32-slow", 8e7, "none", 6.0),
        ("bf16-fast", 8e8, "bf16", 0.55),
        ("bf16-slow", 8e7, "bf16", 3.2),
    ):
        make_run(
            tmp_path / "runs" / name,
            workers=1,
            extra={
                "world_size": 4,
                "batch_size": 400,
                "target_acc": 0.3,
                "time_to_target_seconds": step * 10,
                "step_seconds": step,
                "comm_seconds_per_step": step - 0.3,
                "cluster": {**cluster, "rate_bps": rate, "rates_bps": [rate] * 4},
            },
            config={"mode": "sync", "compress": compress, "cluster": name.split("-")[1]},
        )
    make_run(
        tmp_path / "runs" / "other-batch",
        workers=1,
        extra={"world_size": 4, "batch_per_worker": 64, "step_seconds": 1.0, "cluster": cluster},
        config={"mode": "sync", "cluster": "c"},
    )
    report = write_report([tmp_path / "runs"], tmp_path / "report", [tmp_path / "p.json"])
    md = (tmp_path / "report" / "results.md").read_text()
    table = md.split("### Planned against measured step time")[1].split("###")[0]
    assert "| fp32-fast |" in table and "| bf16-slow |" in table and "other-batch" not in table
    assert "4 run(s): mean absolute error" in table
    assert (tmp_path / "report" / "planned_measured.png").is_file()
    assert "Planned against measured step time" in report.sections[0].plots
    crossover_table = md.split("### Crossover bandwidth against dense fp32")[1].split("###")[0]
    assert "planned crossover" in crossover_table


def test_figures_with_nothing_to_draw_are_left_out_with_a_sentence(tmp_path):
    """Synthetic runs have no accuracy to draw, and one configuration with bytes is one dot: no blank figures."""
    runs = tmp_path / "runs"
    bytes_ = {"bytes_sent_per_step": 1000.0, "dense_bytes_per_step": 4000.0, "compression_ratio": 4.0}
    make_run(runs / "syn-1", extra={"dataset": "synthetic", **bytes_})
    make_run(runs / "syn-2", workers=2, extra={"dataset": "synthetic"})
    report = write_report([runs], tmp_path / "report")
    assert sorted(p.name for p in (tmp_path / "report").glob("*.png")) == ["throughput_workers.png"]
    reasons = report.sections[0].left_out
    assert reasons[0].startswith("No accuracy figures: no run evaluated real data")
    assert reasons[1].startswith("No accuracy-against-bytes figure: one configuration reports bytes per step")
    md = (tmp_path / "report" / "results.md").read_text()
    html = (tmp_path / "report" / "index.html").read_text()
    assert all(reason in md and reason in html for reason in reasons)


def test_utilisation_reads_as_a_sentence_and_labels_name_the_real_model(tmp_path):
    from trainscale.report.plots import run_label

    runs = tmp_path / "runs"
    make_run(runs / "1P1G0M", rate=772.0, extra={"cpu_util": 0.26})
    report = write_report([runs], tmp_path / "report")
    assert "772 at 26% utilisation" in (tmp_path / "report" / "results.md").read_text()
    group = report.sections[0]
    assert group.plots  # real data: the accuracy figures are drawn
    from trainscale.report.aggregate import partitions
    from trainscale.report.collect import collect

    (only,) = partitions(collect([runs]).records)[0].groups
    assert run_label(only) == "1P1G0M (mlp)"
