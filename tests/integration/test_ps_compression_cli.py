"""`trainscale train --mode async|ps-sync --compress ...`: compressed pushes end to end, bytes measured exactly."""

import itertools
import json
import math

import pytest

from tests.integration.cli import assert_one_line_error, run_cli
from trainscale.compression.bitpack import bits_for, packed_nbytes

SYN = ("--model", "mlp", "--dataset", "synthetic", "--test-subset", "64", "--no-progress", "--threads", "1")
# mlp's parameters in order: 3072 -> 512 -> 256 -> 10, weight then bias
MLP_SIZES = (3072 * 512, 512, 512 * 256, 256, 256 * 10, 10)


def rows_of(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def topk_bytes(numel: int, ratio: float) -> int:
    """Top-k's wire size for one unit: k fp32 values plus the cheapest of int32 indices, a bitmap or dense."""
    k = min(numel, max(1, math.ceil(numel * ratio - 1e-9)))
    return min(8 * k, 4 * k + math.ceil(numel / 8), 4 * numel)


def qsgd_bytes(numel: int, levels: int, bucket: int) -> int:
    """QSGD's wire size for one unit: one fp32 norm per bucket, one packed code of log2(2S+1) bits per value."""
    return 4 * math.ceil(numel / bucket) + packed_nbytes(numel, bits_for(2 * levels + 1))


def units_at(sizes: tuple[int, ...], shards: int) -> list[int]:
    """The parameters cut where the flat vector is cut into ``shards`` (the first ones one value longer)."""
    base, extra = divmod(sum(sizes), shards)
    cuts, at = [], 0
    for s in range(shards - 1):
        at += base + (1 if s < extra else 0)
        cuts.append(at)
    units, start = [], 0
    for size in sizes:
        edges = [start, *(c for c in cuts if start < c < start + size), start + size]
        units += [b - a for a, b in itertools.pairwise(edges)]
        start += size
    return units


@pytest.mark.dist
def test_async_topk_pushes_with_error_feedback_train_and_send_exactly_topk_bytes(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        *SYN,
        "--train-subset",
        "128",
        "--batch-size",
        "16",
        "--epochs",
        "3",
        "--lr",
        "0.1",
        "--schedule",
        "constant",
        "--mode",
        "async",
        "--workers",
        "2",
        "--servers",
        "1",
        "--compress",
        "topk",
        "--ratio",
        "0.01",
        "--error-feedback",
        "--out",
        out,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["params"] == sum(MLP_SIZES)
    expected = sum(topk_bytes(n, 0.01) for n in MLP_SIZES)  # 136,606 bytes: 1% of each layer, values + indices
    rows = rows_of(out)
    assert [r["bytes_per_push"] for r in rows] == [expected] * 3
    assert summary["bytes_per_push"] == summary["bytes_pushed_per_step"] == expected  # async: one push a step
    assert summary["dense_bytes_per_push"] == 4 * summary["params"]
    assert summary["compression_ratio"] == pytest.approx(4 * summary["params"] / expected)
    assert (summary["compress_method"], summary["compress_granularity"], summary["error_feedback"]) == (
        "topk",
        "layerwise",
        True,
    )
    assert summary["compress_params"]["ratio"] == 0.01
    # it trains: 2 workers x 3 epochs x 8 steps (64 samples each, 8 a step), every push applied, and the
    # (memorised) training loss falls
    assert sum(summary["staleness_hist"].values()) == 2 * 3 * 8
    assert all(math.isfinite(r["train_loss"]) for r in rows) and rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert f"topk pushes of {expected:,} bytes" in proc.stdout


@pytest.mark.dist
def test_ps_sync_qsgd_pushes_use_the_bucket_flag_over_two_shards(tmp_path):
    """--qsgd-bucket reaches the parameter server's codec: one norm per 64 values, in each shard's part of each
    parameter (the first weight straddles the two shards)."""
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        *SYN,
        "--train-subset",
        "64",
        "--batch-size",
        "16",
        "--epochs",
        "1",
        "--mode",
        "ps-sync",
        "--workers",
        "2",
        "--servers",
        "2",
        "--compress",
        "qsgd",
        "--qsgd-bucket",
        "64",
        "--out",
        out,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    units = units_at(MLP_SIZES, 2)
    assert len(units) == len(MLP_SIZES) + 1
    expected = sum(qsgd_bytes(n, 255, 64) for n in units)
    assert expected != sum(qsgd_bytes(n, 255, n) for n in units)  # one norm per unit would be fewer bytes
    assert summary["bytes_per_push"] == expected
    assert (summary["compress_method"], summary["compress_params"]["bucket_size"]) == ("qsgd", 64)
    assert summary["staleness_max"] == 0 and rows_of(out)[0]["ps_pushes"] == 2 * 4  # 2 workers x 4 steps of 8


def test_powersgd_pushes_are_refused_in_one_line_before_any_worker_starts(main_cli, tmp_path):
    proc = main_cli(
        "train",
        *SYN,
        "--epochs",
        "1",
        "--mode",
        "async",
        "--workers",
        "2",
        "--servers",
        "1",
        "--compress",
        "powersgd",
        "--out",
        tmp_path / "run",
    )
    assert_one_line_error(proc, "--compress powersgd cannot compress parameter-server pushes")
    assert not (tmp_path / "run").exists()
