"""The planner beside the measured runs: predicted against measured step time for every run on an emulated
cluster that has a matching profile (``trainscale report --profile``), as a table and a scatter plot with
the y = x line, and the planner's crossover bandwidth for the crossover table."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from trainscale.io import save_figure
from trainscale.plan.check import Check, check_run, key_of_profile, mean_absolute_error
from trainscale.plan.methods import MethodSpec
from trainscale.plan.predict import crossover, crossover_text
from trainscale.plan.profile import Profile, load_profile
from trainscale.report.aggregate import Group, Partition
from trainscale.report.tables import Table

Profiles = dict[tuple, Profile]


def load_profiles(paths: list[Path]) -> Profiles:
    """Profiles by what they measured (model, batch, precision, threads, CPU quota); one per key."""
    return {key_of_profile(p): p for p in (load_profile(path) for path in paths)}


def checks(part: Partition, profiles: Profiles) -> list[Check]:
    found = (
        check_run(r.bench.get("short_name") or r.run_id, r.config, r.summary, profiles)
        for r in part.runs
        if r.status == "ok"
    )
    return [c for c in found if c is not None]


def planned_table(part: Partition, profiles: Profiles) -> Table | None:
    done = checks(part, profiles)
    if not done:
        return None
    rows = [
        [
            c.run,
            _network(c),
            c.setting.mode,
            c.setting.spec.text,
            f"{1e3 * c.measured_step:.0f}",
            f"{1e3 * c.predicted.step_seconds:.0f}",
            f"{1e3 * (c.measured_comm or 0):.0f}",
            f"{1e3 * c.predicted.comm_seconds:.0f}",
            f"{100 * c.error:+.1f}%",
        ]
        for c in done
    ]
    worst = max(done, key=lambda c: abs(c.error))
    return Table(
        "Planned against measured step time",
        [
            "run",
            "network",
            "mode",
            "compressor",
            "measured ms",
            "planned ms",
            "measured comm ms",
            "planned comm ms",
            "error",
        ],
        rows,
        [
            f"{len(done)} run(s): mean absolute error {100 * mean_absolute_error(done):.1f}%, worst "
            f"{worst.run} ({100 * worst.error:+.1f}%)",
            "planned: trainscale plan's model on the profile that measured this model, per-worker batch "
            "and precision under the threads and CPU quota each emulated host had; measured: the run's "
            "mean step over its steady epochs (summary.json step_seconds)",
        ],
    )


def _network(c: Check) -> str:
    rate = c.setting.link.bandwidth * 8
    return (
        f"{c.setting.hosts} hosts, {rate / 1e9:g} Gbit/s"
        if rate >= 1e9
        else (f"{c.setting.hosts} hosts, {rate / 1e6:g} Mbit/s")
    )


def planned_plot(part: Partition, profiles: Profiles, path: Path) -> Path | None:
    done = checks(part, profiles)
    if not done:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5), dpi=110)
    for mode in sorted({c.setting.mode for c in done}):
        mine = [c for c in done if c.setting.mode == mode]
        ax.scatter([1e3 * c.measured_step for c in mine], [1e3 * c.predicted.step_seconds for c in mine], label=mode)
    top = 1.1e3 * max(max(c.measured_step, c.predicted.step_seconds) for c in done)
    ax.plot([0, top], [0, top], color="grey", lw=1, label="y = x")
    ax.set(
        xlabel="measured step (ms)",
        ylabel="planned step (ms)",
        xlim=(0, top),
        ylim=(0, top),
        title=f"planner against {len(done)} runs (MAPE {100 * mean_absolute_error(done):.1f}%)",
    )
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def planned_crossover(group: Group, profiles: Profiles) -> str:
    """The bandwidth below which the planner says ``group``'s method steps faster than dense fp32 all-reduce."""
    found = check_run(group.label, group.first.config, group.first.summary, profiles)
    if found is None:
        return "-"
    dense = replace(found.setting, spec=MethodSpec("none"), mode="sync", sync_every=1)
    text = crossover_text(crossover(found.profile, found.setting, dense))
    return text if text in ("never", "at every bandwidth") else f"about {text}"
