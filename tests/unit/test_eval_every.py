"""--eval-every: epochs without an evaluation have no test figures, the last epoch always has them, and nothing
that reads the rows (the console table, logs.tsv, the accuracy plots) trips over the gaps."""

import json

import pytest

from tests.unit.small import SMALL_RUN
from trainscale.app.config import build_config
from trainscale.app.run import run_training

SMALL = {**SMALL_RUN, "epochs": 3, "checkpoint": False}


@pytest.mark.parametrize("every, evaluated", [(1, [1, 2, 3]), (2, [2, 3]), (0, [3])])
def test_only_every_nth_and_the_last_epoch_are_evaluated(tmp_path, every, evaluated):
    out = tmp_path / "run"
    summary, rows = run_training(build_config(SMALL, {"eval_every": every, "out": str(out), "target_acc": 0.01}))
    assert [r["epoch"] for r in rows if r["test_acc"] is not None] == evaluated
    skipped = [r for r in rows if r["test_acc"] is None]
    assert all(r["test_loss"] is None and r["eval_seconds"] == 0.0 and r["test_views"] == 0 for r in skipped)
    assert summary["epoch_to_target"] == evaluated[0]  # an epoch that is not evaluated cannot reach the target
    assert summary["final_test_acc"] == rows[-1]["test_acc"] is not None
    tsv = (out / "logs.tsv").read_text().splitlines()[1:]
    assert [int(line.split("\t")[0]) for line in tsv] == evaluated
    assert [json.loads(x)["epoch"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_the_accuracy_plot_draws_only_evaluated_epochs(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from trainscale.report import plots

    class Run:
        run_id, summary = "r", {"dataset": "cifar10"}
        metrics = [{"epoch": 1, "test_acc": None}, {"epoch": 2, "test_acc": 0.5}, {"epoch": 3, "test_acc": 0.7}]

    class Group:
        label, runs = "g", [Run]

        @staticmethod
        def summary(name: str) -> str:
            return "resnet20" if name == "model" else ""

    fig, ax = plt.subplots()
    plots._accuracy(ax, plots.Partition({}, [Group], [Run]), "epoch", "epoch")
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [2, 3] and list(line.get_ydata()) == [50.0, 70.0]
    plt.close(fig)
