"""Plain-text tables for the terminal: the per-epoch table and the run summary printed after training."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from trainscale.record import K, finished

Column = tuple[str, str, Callable[[Any], str]]


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _num(fmt: str) -> Callable[[Any], str]:
    return lambda v: "-" if v is None else format(v, fmt)


EPOCH_COLUMNS: list[Column] = [
    (K.epoch, "epoch", str),
    (K.lr, "lr", _num(".4f")),
    (K.train_loss, "train loss", _num(".4f")),
    (K.train_acc, "train acc", _pct),
    (K.test_loss, "test loss", _num(".4f")),
    (K.test_acc, "test acc", _pct),
    (K.epoch_seconds, "epoch s", _num(".1f")),
    (K.elapsed_seconds, "total s", _num(".1f")),
    (K.samples_per_sec, "img/s", _num(".0f")),
    (K.peak_memory_mb, "peak MB", _num(".0f")),
]


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """Right-aligned fixed-width table; a missing value prints as '-'."""
    cells = [[title for _, title, _ in columns]]
    cells += [[fmt(row.get(key)) if row.get(key) is not None else "-" for key, _, fmt in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def exchange_line(summary: dict[str, Any]) -> str:
    """Per step: encode, collectives in flight (and how much of that the backward pass hid), decode."""
    ms = _num(".1f")
    parts = [f"in flight {ms(summary[K.comm_ms_per_step])}"]
    if summary.get(K.hidden_ms_per_step) is not None:
        parts[0] += f" ({ms(summary[K.hidden_ms_per_step])} hidden under backward)"
    if summary.get(K.encode_ms_per_step) is not None:
        parts = [
            f"encode {ms(summary[K.encode_ms_per_step])}",
            *parts,
            f"decode {ms(summary.get(K.decode_ms_per_step))}",
        ]
    return "exchange per step (ms): " + ", ".join(parts)


def _epochs_done(summary: dict[str, Any]) -> Any:
    """The epochs the run trained: its ``--epochs`` once it finished (2.5 where the third trained in part), else
    the count it finished."""
    return f"{summary[K.epochs]:g}" if finished(summary) else summary.get(K.epochs_completed)


def format_summary(summary: dict[str, Any]) -> str:
    env = summary.get(K.environment) or {}
    ttt = summary.get(K.time_to_target_seconds)
    target = summary.get(K.target_acc)
    lines = [
        f"model {summary[K.model]} ({summary[K.params]:,} params) on {summary[K.dataset]}, mode {summary[K.mode]}, "
        f"{summary[K.world_size]} worker(s), global batch {summary[K.batch_size]}, {summary[K.precision]}, "
        f"{env.get('device_name', '?')}",
        f"best test acc {_pct(summary.get(K.best_test_acc))}, final {_pct(summary.get(K.final_test_acc))} "
        f"after {_epochs_done(summary)} epoch(s)",
        f"training {summary[K.total_train_seconds]:.1f} s, {_num('.1f')(summary.get(K.mean_epoch_seconds))} s/epoch, "
        f"{_num('.0f')(summary.get(K.samples_per_sec))} img/s, peak memory "
        f"{_num('.0f')(summary.get(K.peak_memory_mb))} MB",
    ]
    if summary.get(K.compute_seconds_per_step) is not None:
        step, compute, comm = (
            1e3 * summary[k] for k in (K.step_seconds, K.compute_seconds_per_step, K.comm_seconds_per_step)
        )
        lines.append(f"step {step:.1f} ms = compute {compute:.1f} + communication {comm:.1f} (steady epochs)")
    if summary.get(K.comm_ms_per_step) is not None:
        lines.append(exchange_line(summary))
    if target is not None:
        reached = f"{ttt:.1f} s (epoch {summary.get(K.epoch_to_target)})" if ttt is not None else "not reached"
        lines.append(f"time to {_pct(target)}: {reached}")
    lines.append(f"timer: {summary.get(K.timer_scope)}")
    scope = summary.get(K.reference_scope)
    if scope:
        lines.append(
            f"in airbench's timer scope (data-based init + training + last evaluation, {scope['test_views']} "
            f"view(s)): {_pct(scope['test_acc'])} in {scope['seconds']:.1f} s"
        )
    return "\n".join(lines)
