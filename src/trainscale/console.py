"""Plain-text tables for the terminal: the per-epoch table and the run summary printed after training."""

from __future__ import annotations

from typing import Any, Callable, Sequence

Column = tuple[str, str, Callable[[Any], str]]


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _num(fmt: str) -> Callable[[Any], str]:
    return lambda v: "-" if v is None else format(v, fmt)


EPOCH_COLUMNS: list[Column] = [
    ("epoch", "epoch", str),
    ("lr", "lr", _num(".4f")),
    ("train_loss", "train loss", _num(".4f")),
    ("train_acc", "train acc", _pct),
    ("test_loss", "test loss", _num(".4f")),
    ("test_acc", "test acc", _pct),
    ("epoch_seconds", "epoch s", _num(".1f")),
    ("elapsed_seconds", "total s", _num(".1f")),
    ("samples_per_sec", "img/s", _num(".0f")),
    ("peak_memory_mb", "peak MB", _num(".0f")),
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
    parts = [f"in flight {ms(summary['comm_ms_per_step'])}"]
    if summary.get("hidden_ms_per_step") is not None:
        parts[0] += f" ({ms(summary['hidden_ms_per_step'])} hidden under backward)"
    if summary.get("encode_ms_per_step") is not None:
        parts = [f"encode {ms(summary['encode_ms_per_step'])}", *parts, f"decode {ms(summary.get('decode_ms_per_step'))}"]
    return "exchange per step (ms): " + ", ".join(parts)


def format_summary(summary: dict[str, Any]) -> str:
    env = summary.get("environment") or {}
    ttt = summary.get("time_to_target_seconds")
    target = summary.get("target_acc")
    lines = [
        f"model {summary['model']} ({summary['params']:,} params) on {summary['dataset']}, mode {summary['mode']}, "
        f"{summary['world_size']} worker(s), global batch {summary['batch_size']}, {summary['precision']}, "
        f"{env.get('device_name', '?')}",
        f"best test acc {_pct(summary.get('best_test_acc'))}, final {_pct(summary.get('final_test_acc'))} "
        f"after {summary.get('epochs_completed')} epoch(s)",
        f"training {summary['total_train_seconds']:.1f} s, {_num('.1f')(summary.get('mean_epoch_seconds'))} s/epoch, "
        f"{_num('.0f')(summary.get('samples_per_sec'))} img/s, peak memory "
        f"{_num('.0f')(summary.get('peak_memory_mb'))} MB",
    ]
    if summary.get("compute_seconds_per_step") is not None:
        step, compute, comm = (1e3 * summary[k] for k in ("step_seconds", "compute_seconds_per_step",
                                                          "comm_seconds_per_step"))
        lines.append(f"step {step:.1f} ms = compute {compute:.1f} + communication {comm:.1f} (steady epochs)")
    if summary.get("comm_ms_per_step") is not None:
        lines.append(exchange_line(summary))
    if target is not None:
        reached = f"{ttt:.1f} s (epoch {summary.get('epoch_to_target')})" if ttt is not None else "not reached"
        lines.append(f"time to {_pct(target)}: {reached}")
    lines.append(f"timer: {summary.get('timer_scope')}")
    scope = summary.get("reference_scope")
    if scope:
        lines.append(f"in airbench's timer scope (data-based init + training + last evaluation, {scope['test_views']} "
                     f"view(s)): {_pct(scope['test_acc'])} in {scope['seconds']:.1f} s")
    return "\n".join(lines)
