"""The report's PNG figures (matplotlib, Agg backend: no display needed).

- ``accuracy_epoch.png`` and ``accuracy_time.png``: test accuracy per run against epoch and against
  cumulative training time (the Multiverso benchmark's two figures, grid seed000).
- ``throughput_workers.png``: images/s and scaling efficiency against workers (MXNet multi-GPU and
  Keras-MXNet, grids seed001 and seed003), drawn only when the runs span several worker counts.
- ``accuracy_bsp_async.png``: the same two curves side by side, drawn when the runs hold both
  synchronous (BSP) and parameter-server (async, SSP, ps-sync, model averaging) training: the MXNet
  distributed examples' BSP against Async (grid seed002, at its emulated scale on 5 hosts).
- ``accuracy_time_networks.png``: test accuracy against training time, one panel per network, when
  runs on emulated clusters span several bandwidths (the slow-links grid).
- ``accuracy_bytes.png``: best accuracy against bytes per step and against compression ratio (the
  layer-wise compression study, grid seed004), drawn only when runs report bytes per step.
- ``training_curves.png``: each run's training loss and learning rate against step, from its live metrics
  (``steps.jsonl``, every ``--log-every`` steps), drawn when runs have them.
With several environments each gets its own set (``-env2`` ...), never one plot across machines.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from trainscale.errors import DataError  # noqa: E402
from trainscale.io import read_jsonl, save_figure  # noqa: E402
from trainscale.record import STEPS, K, StepK  # noqa: E402
from trainscale.report.aggregate import (  # noqa: E402
    GROUP_EXCLUDE,
    Group,
    Partition,
    run_throughput,
    uses_parameter_server,
)
from trainscale.report.collect import RunRecord  # noqa: E402
from trainscale.report.tables import bytes_per_step, compression_ratio, network_text  # noqa: E402

DPI = 100
STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v")
FAMILY_EXCLUDE = GROUP_EXCLUDE | {"workers", "mode", "batch_size", "devices"}


def write_plots(part: Partition, out: Path, suffix: str = "") -> dict[str, Path]:
    """Every figure this partition has data for: title -> PNG path."""
    figures = {
        "Test accuracy against epoch": ("accuracy_epoch", lambda ax: _accuracy(ax, part, K.epoch, "epoch")),
        "Test accuracy against training time": (
            "accuracy_time",
            lambda ax: _accuracy(ax, part, K.elapsed_seconds, "training time (s)"),
        ),
    }
    written = {title: _save(out / f"{stem}{suffix}.png", draw) for title, (stem, draw) in figures.items()}
    if (
        len({uses_parameter_server(g) for g in part.groups if g.world_size > 1 and g.summary(K.dataset) != "synthetic"})
        == 2
    ):
        written["BSP and parameter-server training: test accuracy against epoch and against time"] = _save_pair(
            out / f"accuracy_bsp_async{suffix}.png", lambda axes: _side_by_side(axes, part)
        )
    if len({g.world_size for g in part.groups}) > 1:
        written["Images/s and scaling efficiency against workers"] = _save_pair(
            out / f"throughput_workers{suffix}.png", lambda axes: _scaling(axes, part)
        )
    networks = _by_network(part)
    if len(networks) > 1:
        written["Test accuracy against training time on each network"] = _save_row(
            out / f"accuracy_time_networks{suffix}.png", len(networks), lambda axes: _networks(axes, networks)
        )
    if any(bytes_per_step(r) for r in part.runs):
        written["Accuracy against bytes per step and compression ratio"] = _save_pair(
            out / f"accuracy_bytes{suffix}.png", lambda axes: _bytes(axes, part)
        )
    curves = step_rows(part.runs)
    if curves:
        written["Training loss and learning rate against step"] = _save_pair(
            out / f"training_curves{suffix}.png", lambda axes: _curves(axes, curves)
        )
    return written


def step_rows(runs: Sequence[RunRecord]) -> dict[str, list[dict]]:
    """Each run's ``steps.jsonl`` rows by its label (runs without the file, or with an unreadable one, left out)."""
    found: dict[str, list[dict]] = {}
    for run in runs:
        path = run.folder / STEPS
        try:
            rows = read_jsonl(path) if path.is_file() else []
        except (DataError, OSError, UnicodeDecodeError):
            continue
        if rows:
            found[run.folder.name if run.label in found else run.label] = rows
    return found


def _curves(axes: Sequence[Axes], curves: dict[str, list[dict]]) -> None:
    for i, (label, rows) in enumerate(curves.items()):
        steps = [r[StepK.step] for r in rows]
        style = STYLES[i % len(STYLES)]
        loss = [float("nan") if r.get(StepK.loss) is None else r[StepK.loss] for r in rows]
        axes[0].plot(steps, loss, linestyle=style, label=label)
        axes[1].plot(steps, [r[StepK.lr] for r in rows], linestyle=style, label=label)
    for ax, name in zip(axes, ("training loss (main worker)", "learning rate")):
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    _legend(axes[0])


def _save(path: Path, draw: Callable[[Axes], None]) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=DPI)
    try:
        draw(ax)
        fig.tight_layout()
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return path


def _save_pair(path: Path, draw: Callable[[Sequence[Axes]], None]) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), dpi=DPI)
    try:
        draw(axes)
        fig.tight_layout()
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return path


def _save_row(path: Path, panels: int, draw: Callable[[list[Axes]], None]) -> Path:
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.5), dpi=DPI, sharey=True, squeeze=False)
    try:
        draw(list(axes[0]))
        fig.tight_layout()
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return path


def _by_network(part: Partition) -> dict[str, list[Group]]:
    """Real-data runs on emulated clusters, by network, fastest first."""
    found: dict[float, list[Group]] = {}
    for g in part.groups:
        cluster = g.summary(K.cluster)
        if cluster and g.summary(K.dataset) != "synthetic":
            found.setdefault(min(cluster.get("rates_bps") or [cluster["rate_bps"]]), []).append(g)
    return {network_text(groups[0].first): groups for _, groups in sorted(found.items(), reverse=True)}


def _networks(axes: list[Axes], networks: dict[str, list[Group]]) -> None:
    for ax, (network, groups) in zip(axes, networks.items()):
        _accuracy(
            ax, Partition({}, groups, [r for g in groups for r in g.runs]), K.elapsed_seconds, "training time (s)"
        )
        ax.set_title(network)


def _accuracy(ax: Axes, part: Partition, x_key: str, x_label: str) -> None:
    runs = [
        (group, run) for group in part.groups for run in group.runs if run.summary.get(K.dataset) != "synthetic"
    ]  # random images: speed only, no accuracy curve
    for index, (group, run) in enumerate(runs):
        evaluated = [m for m in run.metrics if m.get(K.test_acc) is not None]  # --eval-every skips some epochs
        xs: list[float] = [m[x_key] for m in evaluated if m.get(x_key) is not None]
        ys = [100 * m[K.test_acc] for m in evaluated]
        if ys and len(xs) == len(ys):  # line styles cycle so runs with equal curves stay visible
            ax.plot(
                xs,
                ys,
                marker=MARKERS[index % len(MARKERS)],
                markersize=4,
                linestyle=STYLES[index % len(STYLES)],
                label=run.run_id if len(group.runs) > 1 else group.label,
            )
    ax.set_xlabel(x_label)
    ax.set_ylabel("test accuracy (%)")
    if x_key == K.epoch:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    _legend(ax)


def _side_by_side(axes: Sequence[Axes], part: Partition) -> None:
    _accuracy(axes[0], part, K.epoch, "epoch")
    _accuracy(axes[1], part, K.elapsed_seconds, "training time (s)")


def _legend(ax: Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="best")


def families(part: Partition) -> dict[str, list[Group]]:
    """Groups that differ only in the number of workers (and the global batch that follows from it);
    local and sync count as one kind (1 sync worker is local training), parameter-server modes as another."""
    found: dict[str, list[Group]] = {}
    for group in part.groups:
        config = group.first.config or {}
        kind = "ps" if uses_parameter_server(group) else "data-parallel"
        key = json.dumps(
            {"kind": kind, **{k: v for k, v in config.items() if k not in FAMILY_EXCLUDE}}, sort_keys=True, default=str
        )
        found.setdefault(key, []).append(group)
    return {_family_label(gs): sorted(gs, key=lambda g: g.world_size) for gs in found.values()}


def _family_label(groups: list[Group]) -> str:
    g = groups[0]
    kind = f"{g.summary(K.mode)}, " if uses_parameter_server(g) else ""
    return (
        f"{kind}{g.summary(K.model)}, {g.summary(K.batch_per_worker)}/worker, {g.summary(K.precision)}, "
        f"lr {g.summary(K.lr)}"
    )


def _scaling(axes: Sequence[Axes], part: Partition) -> None:
    for label, groups in families(part).items():
        workers = [g.world_size for g in groups]
        rates = [g.stat(run_throughput) for g in groups]
        axes[0].errorbar(
            workers, [s.mean or 0 for s in rates], yerr=[s.stdev for s in rates], marker="o", capsize=3, label=label
        )
        effs = [(g.world_size, g.efficiency) for g in groups if g.efficiency]
        if effs:
            axes[1].plot([w for w, _ in effs], [sum(e) / len(e) for _, e in effs], marker="o", label=label)
    axes[1].axhline(1.0, color="grey", linestyle="--", linewidth=1)
    axes[1].set_ylim(0, max(1.1, axes[1].get_ylim()[1]))
    ticks = sorted({g.world_size for g in part.groups})
    for ax, ylabel in zip(axes, ("images/s (all workers)", "scaling efficiency")):
        ax.set_xlabel("workers")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_ylim(bottom=0)  # from zero: a small loss must not look like a collapse
        ax.grid(alpha=0.3)
        _legend(ax)


def _bytes(axes: Sequence[Axes], part: Partition) -> None:
    groups = [g for g in part.groups if any(bytes_per_step(r) for r in g.runs)]
    for g in groups:
        acc = 100 * (g.stat(lambda r: r.summary.get(K.best_test_acc)).mean or 0)
        axes[0].scatter([g.stat(bytes_per_step).mean or 0], [acc], label=g.label)
        ratio = g.stat(compression_ratio).mean
        if ratio:
            axes[1].scatter([ratio], [acc], label=g.label)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("bytes per step and worker")
    axes[1].set_xlabel("compression ratio (dense / sent)")
    for ax in axes:
        ax.set_ylabel("best test accuracy (%)")
        ax.grid(alpha=0.3)
        _legend(ax)
