"""The report's tables, in the columns of the results pages the grids reproduce, as one model rendered to
Markdown and HTML (the grid files under benchmarks/grids/ keep their "seedNNN" names).

- Configurations (the Multiverso benchmark, seed000): Short Name, processes, GPUs per process, parameter
  server, batch size, initial LR, seconds per epoch, best validation accuracy.
- Throughput and scaling (MXNet multi-GPU, seed001, and Keras-MXNet, seed003): images/s, scaling
  efficiency against the 1-worker row, train and test accuracy, peak memory.
- Communication (the layer-wise compression study, seed004): method, ratio, granularity, bytes per step,
  compression ratio.
- Accuracy by epoch (the MXNet distributed examples, seed002): epoch, train accuracy, validation accuracy,
  time.
A table or column appears only when some run has the data: nothing is shown that was not run.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainscale.record import EXCHANGE_SPLIT, K
from trainscale.report.aggregate import Group, Partition, Stat, run_throughput, uses_parameter_server
from trainscale.report.collect import RunRecord

MAX_EPOCH_ROWS = 12


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        head = [f"### {self.title}", "", _md_row(self.columns), _md_row(["---"] * len(self.columns))]
        body = [_md_row(r) for r in self.rows]
        notes = [""] + [f"- {n}" for n in self.notes] if self.notes else []
        return "\n".join(head + body + notes) + "\n"

    def html(self, heading: bool = True) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in self.rows)
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        title = f"<h3>{html.escape(self.title)}</h3>" if heading else ""
        return f"{title}<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>" + (
            f"<ul class='notes'>{notes}</ul>" if notes else ""
        )


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


# ------------------------------------------------------------------------------------ measures


def epoch_seconds(r: RunRecord) -> float | None:
    """Steady state (epochs after the first, which carries warm-up) when there are several, else all."""
    return r.summary.get(K.steady_epoch_seconds) or r.summary.get(K.mean_epoch_seconds)


def _summary(name: str) -> Any:
    return lambda r: r.summary.get(name)


def final_train_acc(r: RunRecord) -> float | None:
    return r.metrics[-1].get(K.train_acc) if r.metrics else None


def bytes_per_step(r: RunRecord) -> float | None:
    """What one worker moves per step: collective payload (sync), or pushed + pulled (parameter server)."""
    s = r.summary
    if s.get(K.bytes_sent_per_step) is not None:
        return s[K.bytes_sent_per_step]
    if s.get(K.bytes_pushed_per_step) is not None:
        return s[K.bytes_pushed_per_step] + (s.get(K.bytes_pulled_per_step) or 0.0)
    return None


def compression_ratio(r: RunRecord) -> float | None:
    s = r.summary
    if s.get(K.compression_ratio) is not None:
        return s[K.compression_ratio]
    if s.get(K.dense_bytes_per_step) and s.get(K.bytes_sent_per_step):
        return s[K.dense_bytes_per_step] / s[K.bytes_sent_per_step]
    return 1.0 if bytes_per_step(r) and _method(r) == "none" else None


def _method(r: RunRecord) -> str:
    return str(r.summary.get(K.compress_method) or r.config.get("compress") or "none")


def batch_text(g: Group) -> str:
    per, total, n = g.summary(K.batch_per_worker), g.summary(K.batch_size), g.world_size
    return f"{per}x{n}={total}" if n > 1 and per else str(total)


def _pct(stat: Stat) -> str:
    return stat.text(".2f", 100, " %")


def _runs(g: Group) -> str:
    return str(len(g.runs))


# ------------------------------------------------------------------------------------ tables


def configurations(part: Partition) -> Table:
    rows = [
        [
            g.label,
            str(g.summary(K.model)),
            str(g.world_size),
            "1" if _on_gpu(g) else "0",
            "on" if uses_parameter_server(g) else "off",
            batch_text(g),
            _lr(g),
            g.stat(epoch_seconds).text(".1f"),
            _pct(g.stat(_summary(K.best_test_acc))),
            _runs(g),
        ]
        for g in part.groups
    ]
    return Table(
        "Configurations",
        [
            "Short Name",
            "model",
            "processes",
            "GPUs per process",
            "parameter server",
            "batch size",
            "initial LR",
            "seconds per epoch",
            "best validation accuracy",
            "runs",
        ],
        rows,
        _config_notes(part),
    )


def _on_gpu(g: Group) -> bool:
    return str((g.first.environment or {}).get("device", "")).startswith("cuda")


def _lr(g: Group) -> str:
    return format(g.summary(K.lr), "g") if g.summary(K.lr) is not None else "-"


def _config_notes(part: Partition) -> list[str]:
    scopes = sorted({str(r.summary.get(K.timer_scope)) for r in part.runs})
    return [
        "batch size: per worker x workers = global batch; initial LR: the configured peak rate after any "
        "linear scaling (onecycle and warm-up schedules ramp up to it)",
        "seconds per epoch: mean over epochs after the first when a run has several (the first carries "
        "warm-up), else the single epoch; values are mean ± sample stdev over repeats (runs)",
        *(f"timer scope: {s}" for s in scopes),
    ]


def scaling(part: Partition) -> Table:
    with_eff = any(g.efficiency for g in part.groups) and len({g.world_size for g in part.groups}) > 1
    columns = [
        "Short Name",
        "model",
        "workers",
        "batch size",
        "images/s",
        *(["scaling efficiency"] if with_eff else []),
        "seconds per epoch",
        "training time (s)",
        "train accuracy",
        "test accuracy",
        "peak memory (MB)",
    ]
    rows = [
        [
            g.label,
            str(g.summary(K.model)),
            str(g.world_size),
            batch_text(g),
            g.stat(run_throughput).text(".0f") + _busy(g),
            *([_efficiency(g)] if with_eff else []),
            g.stat(epoch_seconds).text(".1f"),
            g.stat(_summary(K.total_train_seconds)).text(".1f"),
            _pct(g.stat(final_train_acc)),
            _pct(g.stat(_summary(K.final_test_acc))),
            g.stat(_summary(K.peak_memory_mb)).text(".0f"),
        ]
        for g in sorted(part.groups, key=lambda g: (str(g.summary(K.model)), g.world_size))
    ]
    notes = [
        "images/s: training images per second over all workers, from the same epochs as seconds per epoch; "
        "utilisation: each worker's device busy (GPU: NVML; "
        "CPU: process CPU time over wall time and the cores it may use), mean over workers and steady epochs",
        "peak memory: the largest per-process peak (CUDA allocator peak on GPUs, resident set size on CPUs)",
    ]
    if with_eff:
        notes.insert(
            1,
            "scaling efficiency: (images/s / workers) / (images/s of the 1-worker run with the same "
            "model, precision and per-worker batch); 1.00 is perfect linear scaling",
        )
    return Table("Throughput and scaling", columns, rows, notes)


def _busy(g: Group) -> str:
    util = g.stat(
        lambda r: r.summary.get(K.gpu_util) if r.summary.get(K.gpu_util) is not None else r.summary.get(K.cpu_util)
    )
    return f" at {100 * util.mean:.0f}% utilisation" if util.mean is not None else ""


def _efficiency(g: Group) -> str:
    if not g.efficiency:
        return "-"
    text = Stat(g.efficiency).text(".2f")
    return text if g.baseline == g.label else f"{text} (vs {g.baseline})"


def communication(part: Partition) -> Table | None:
    """Bytes and time of each method against both dense baselines: fp32 and bf16 all-reduce."""
    groups = [g for g in part.groups if any(bytes_per_step(r) for r in g.runs)]
    if not groups:
        return None
    rows = [
        [
            g.label,
            _method(g.first),
            _opt(g.config("ratio")),
            str(g.summary(K.compress_granularity) or g.config("granularity") or "-"),
            str(g.world_size),
            g.stat(bytes_per_step).text(",.0f"),
            g.stat(compression_ratio).text(".1f"),
            g.stat(lambda r: _half(compression_ratio(r))).text(".1f"),
            _pct(g.stat(_summary(K.best_test_acc))),
            g.stat(epoch_seconds).text(".1f"),
            _relative(g, _peer(part, g, "none")),
            _relative(g, _peer(part, g, "bf16")),
        ]
        for g in groups
    ]
    return Table(
        "Communication",
        [
            "Short Name",
            "method",
            "ratio",
            "granularity",
            "workers",
            "bytes per step",
            "compression vs fp32",
            "compression vs bf16",
            "best validation accuracy",
            "seconds per epoch",
            "time vs fp32",
            "time vs bf16",
        ],
        rows,
        [
            "bytes per step: what each worker hands to its collectives per training step (synchronous "
            "modes) or pushes plus pulls (parameter-server modes); each run's summary.json says exactly "
            "what (bytes_sent_scope, bytes_scope)",
            "compression vs fp32: dense fp32 bytes / bytes sent; vs bf16: the same against a bf16 "
            "all-reduce (half the dense bytes), the cheapest baseline a method has to beat",
            "time vs fp32 / bf16: seconds per epoch over those of the uncompressed (fp32) and bf16 runs "
            "with the same model, mode, workers, precision and network; - where that run is not in the "
            "report",
        ],
    )


def time_to_target(part: Partition) -> Table | None:
    """Time to the target accuracy of each method on each network, against dense fp32 and bf16 all-reduce
    on the same network (the slow-links grid's table)."""
    groups = [g for g in part.groups if g.summary(K.target_acc) is not None and g.summary(K.cluster)]
    if not groups:
        return None
    groups.sort(key=lambda g: (-_rate(g), str(g.label)))
    rows = [
        [
            g.label,
            str(g.summary(K.mode)),
            _method(g.first),
            network_text(g.first),
            _ttt_text(g),
            _ttt_relative(g, _peer(part, g, "none")),
            _ttt_relative(g, _peer(part, g, "bf16")),
            _pct(g.stat(_summary(K.final_test_acc))),
            g.stat(bytes_per_step).text(",.0f"),
        ]
        for g in groups
    ]
    target = _pct(groups[0].stat(_summary(K.target_acc)))
    return Table(
        f"Time to {target} test accuracy",
        [
            "Short Name",
            "mode",
            "method",
            "network",
            "time to target (s)",
            "vs fp32",
            "vs bf16",
            "final test accuracy",
            "bytes per step",
        ],
        rows,
        [
            "time to target: training time (evaluation excluded) until the end of the first epoch whose test "
            "accuracy reached the target; 'not reached' if none did",
            "vs fp32 / vs bf16: that time over the time of synchronous dense fp32 / bf16 all-reduce on the "
            "same network (below 1.00: faster); a run that did not reach the target counts as its whole "
            "training time and is marked '>'",
        ],
    )


def crossover(part: Partition, planner: Callable[[Group], str] | None = None) -> Table | None:
    """For each method measured on several networks: the bandwidth below which it reaches the target
    sooner than dense fp32 all-reduce, interpolated in log-bandwidth between the measured networks; with
    ``planner``, the planner's crossover of step time beside it."""
    families: dict[str, list[Group]] = {}
    for g in part.groups:
        if g.summary(K.target_acc) is not None and g.summary(K.cluster) and _peer(part, g, "none") is not g:
            families.setdefault(" ".join(map(str, _method_key(g))), []).append(g)
    rows = []
    for groups in families.values():
        measured = [(_rate(g), _ttt_ratio(g, _peer(part, g, "none"))) for g in groups]
        points = sorted((rate, ratio) for rate, ratio in measured if ratio is not None)
        if len(points) > 1:
            rows.append(
                [
                    groups[0].first.bench.get("short_name") or groups[0].label,
                    _method(groups[0].first),
                    str(groups[0].summary(K.mode)),
                    ", ".join(f"{_rate_text(r)}: {q:.2f}" for r, q in points),
                    _crossing(points),
                    *([planner(groups[0])] if planner else []),
                ]
            )
    if not rows:
        return None
    columns = ["method", "compressor", "mode", "time to target vs fp32, per network", "measured crossover"]
    notes = [
        "crossover: where the method's time to target equals dense fp32's, interpolated linearly in "
        "log-bandwidth between the two measured networks around it; the method wins below it"
    ]
    if planner:
        columns.append("planned crossover")
        notes.append(
            "planned: where the planner's step time equals dense fp32's (trainscale plan on the run's "
            "profile); it models time per step, not accuracy per step, so a method that learns less per "
            "step needs a slower network than this to win on time to target"
        )
    else:
        notes.append(
            "the planner's crossover stands beside it when the report is given the runs' profiles "
            "(trainscale report --profile)"
        )
    return Table("Crossover bandwidth against dense fp32", columns, rows, notes)


def _method_key(g: Group) -> tuple[str, ...]:
    config = g.first.config or {}
    knobs = (
        "compress",
        "ratio",
        "granularity",
        "powersgd_rank",
        "qstates",
        "sync_every",
        "outer_lr",
        "outer_momentum",
        "servers",
        "error_feedback",
    )
    return (str(g.summary(K.mode)), _method(g.first), *(str(config.get(k)) for k in knobs if config.get(k)))


def _rate(g: Group) -> float:
    cluster = g.summary(K.cluster) or {}
    return float(min(cluster.get("rates_bps") or [cluster.get("rate_bps") or 0]))


def _rate_text(rate: float) -> str:
    rate = float(f"{rate:.3g}")
    return f"{rate / 1e9:g} Gbit/s" if rate >= 1e9 else f"{rate / 1e6:g} Mbit/s"


def _ttt(r: RunRecord) -> tuple[float | None, bool]:
    """(seconds, reached): the time to target, or the whole training time when it was not reached."""
    reached = r.summary.get(K.time_to_target_seconds)
    return (reached, True) if reached is not None else (r.summary.get(K.total_train_seconds), False)


def _ttt_text(g: Group) -> str:
    reached = g.stat(lambda r: _ttt(r)[0] if _ttt(r)[1] else None)
    return reached.text(".1f") if len(reached.values) == len(g.runs) else "not reached"


def _ttt_ratio(g: Group, base: Group | None) -> float | None:
    if base is None:
        return None
    ours, theirs = g.stat(lambda r: _ttt(r)[0]).mean, base.stat(lambda r: _ttt(r)[0]).mean
    return ours / theirs if ours and theirs else None


def _ttt_relative(g: Group, base: Group | None) -> str:
    ratio = _ttt_ratio(g, base)
    if ratio is None:
        return "-"
    censored = any(not _ttt(r)[1] for r in g.runs)
    return f"{'>' if censored else ''}{ratio:.2f}"


def _crossing(points: list[tuple[float, float]]) -> str:
    """Where ``ratio`` (ascending bandwidth) crosses 1, as text."""
    if all(q < 1 for _, q in points):
        return f"wins on every network measured (up to {_rate_text(points[-1][0])})"
    if all(q >= 1 for _, q in points):
        return f"never wins (down to {_rate_text(points[0][0])})"
    for (r0, q0), (r1, q1) in zip(points, points[1:]):
        if (q0 - 1) * (q1 - 1) <= 0 and q0 != q1:
            at = math.exp(math.log(r0) + (1 - q0) / (q1 - q0) * (math.log(r1) - math.log(r0)))
            side = "below" if q0 < 1 else "above"
            return f"about {_rate_text(at)} (wins {side})"
    return "-"


def _half(ratio: float | None) -> float | None:
    return None if ratio is None else ratio / 2


def _peer(part: Partition, g: Group, method: str) -> Group | None:
    """The group that differs from ``g`` only in sending ``method`` (its dense fp32 or bf16 baseline)."""

    def setting(h: Group) -> tuple[Any, ...]:
        return (
            h.summary(K.model),
            h.world_size,
            h.summary(K.precision),
            network_text(h.first),
            h.summary(K.batch_size),
        )

    return next(
        (
            h
            for h in part.groups
            if _method(h.first) == method
            and setting(h) == setting(g)
            and h.summary(K.mode) in ("sync", "local", g.summary(K.mode))
        ),
        None,
    )


def _relative(g: Group, base: Group | None) -> str:
    if base is None or base is g:
        return "-" if base is None else "1.00"
    ours, theirs = g.stat(epoch_seconds).mean, base.stat(epoch_seconds).mean
    return f"{ours / theirs:.2f}" if ours and theirs else "-"


def step_split(part: Partition) -> Table | None:
    """Where a step's time goes (runs that measured it: sync and parameter-server modes), beside the network
    it ran on and, on an emulated cluster, what each host's interface really sent; the exchange itself
    split into encode, time in flight (and how much of it the backward pass hid) and decode."""
    groups = [g for g in part.groups if any(r.summary.get(K.compute_seconds_per_step) is not None for r in g.runs)]
    if not groups:
        return None
    rows = [
        [
            g.label,
            str(g.summary(K.mode)),
            _method(g.first),
            str(g.world_size),
            network_text(g.first),
            *(
                g.stat(_scaled(name, 1e3)).text(".1f")
                for name in (K.step_seconds, K.compute_seconds_per_step, K.comm_seconds_per_step)
            ),
            g.stat(_comm_share).text(".0%"),
            *(g.stat(_summary(name)).text(".1f") for name in EXCHANGE_SPLIT),
            g.stat(_scaled(K.wire_bytes_sent_per_step, 2**-20)).text(".2f"),
            g.stat(run_throughput).text(".0f"),
        ]
        for g in groups
    ]
    return Table(
        "Step time: compute and communication",
        [
            "Short Name",
            "mode",
            "method",
            "workers",
            "network",
            "step (ms)",
            "compute (ms)",
            "communication (ms)",
            "communication share",
            "encode (ms)",
            "in flight (ms)",
            "hidden (ms)",
            "decode (ms)",
            "wire MiB sent per host per step",
            "images/s",
        ],
        rows,
        [
            "step: a worker's training step over the epochs after the first (as seconds per epoch); "
            "communication: what the step waited for its exchange (sync: inside the DDP comm hooks plus "
            "from the last gradient bucket to the end of the last collective, so all-reduce time hidden "
            "behind the backward pass is compute; parameter server: push, pull and staleness wait); "
            "compute: the rest",
            "encode / decode: compressing and decompressing the step's gradients (compressed methods); in "
            "flight: wall time with a collective running; hidden: the part of it that ran while the "
            "backward pass was still computing, which the step did not wait for",
            "wire: the kernel's count of bytes each emulated host's interface sent per "
            "step (mean over hosts); - on one machine",
        ],
    )


def network_text(r: RunRecord) -> str:
    cluster = r.summary.get(K.cluster)
    if not cluster:
        return "one machine"
    rates = sorted(set(cluster.get("rates_bps") or [cluster["rate_bps"]]))
    text = "/".join(f"{b / 1e9:g} Gbit/s" if b >= 1e9 else f"{b / 1e6:g} Mbit/s" for b in rates)
    return f"{cluster['hosts']} hosts at {text}"


def _comm_share(r: RunRecord) -> float | None:
    step, comm = r.summary.get(K.step_seconds), r.summary.get(K.comm_seconds_per_step)
    return comm / step if step and comm is not None else None


def _scaled(name: str, scale: float) -> Any:
    return lambda r: None if r.summary.get(name) is None else scale * r.summary[name]


def _opt(value: Any) -> str:
    return "-" if value is None else format(value, "g") if isinstance(value, float) else str(value)


def epochs_table(run: RunRecord) -> Table:
    """The MXNet distributed examples' per-epoch table for one run (every epoch, or about a dozen spread
    over a long run)."""
    rows = run.metrics
    step = max(1, -(-len(rows) // MAX_EPOCH_ROWS))
    shown = [r for r in rows if r[K.epoch] % step == 0 or r is rows[-1]]
    body = [
        [
            str(r[K.epoch]),
            _fmt_pct(r.get(K.train_acc)),
            _fmt_pct(r.get(K.test_acc)),
            _fmt(r.get(K.epoch_seconds), ".1f"),
            _fmt(r.get(K.elapsed_seconds), ".1f"),
        ]
        for r in shown
    ]
    return Table(f"{run.run_id}", ["epoch", "train accuracy", "validation accuracy", "time (s)", "elapsed (s)"], body)


def _fmt(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _fmt_pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.2f} %"


def problems(records: list[RunRecord]) -> Table | None:
    bad = [r for r in records if not r.ok]
    if not bad:
        return None
    rows = [[r.run_id, r.status, r.error.splitlines()[0][:300] if r.error else "-"] for r in bad]
    return Table(
        "Failed, unfinished or excluded runs",
        ["run", "status", "error"],
        rows,
        [
            "these runs are in results.csv but in no other table or plot; the full error is in the run "
            "folder's error.txt and train.log"
        ],
    )


def environment_table(part: Partition) -> Table:
    keys = (
        "device_name",
        "device",
        "cpu",
        "cpu_count",
        "torch",
        "python",
        "cuda",
        "torch_threads",
        "hostname",
        "git_commit",
    )
    rows = [[k, ", ".join(sorted({str(r.environment.get(k)) for r in part.runs}))] for k in keys]
    return Table("Environment", ["field", "value"], rows)
