"""`trainscale train --workers 2 --compress ...` end to end on real CIFAR-10, one run per compressor family with
error feedback: accuracy well above chance, and bytes measured below dense.
"""

import json

import pytest

from tests.integration.cli import assert_one_line_error, run_cli, small_run

# One real-data run per family (compression/methods: one module per family), each about half a minute on 2 cores:
# the sparsifiers' Top-k and the quantisers' TernGrad (the coarser of the two: 2 bits a value). The others of a
# family share its payload and exchange (all-gather, error feedback): Random-k's and Threshold's selections, QSGD's
# levels and Threshold's varying payload size (its exchange path) are covered by tests/unit/test_compression_props.py
# and, over a real 2-process gloo group in both granularities, by tests/dist/test_compression_ddp.py.
# Kept short, bar 0.25 (chance 0.10), one epoch at batch 100 (50 per worker): TernGrad learns in 25 steps of 2,500
# images (0.353, 0.369, 0.380 with seeds 0-2, about 27 s on a 2-core AVX2 machine; 0.39-0.41 in 25 steps of 200),
# Top-k at 1% in 34 steps of 3,400 (0.283, 0.317, 0.314, about 36 s; 0.33 in two epochs at batch 200, twice as long).
SEED_METHODS = [
    ("topk", ("--ratio", "0.01"), 30.0, 1, 3400),
    ("terngrad", (), 10.0, 1, 2500),
]
SYN = (*small_run(), "--epochs", "1")


@pytest.mark.dist
@pytest.mark.realdata
@pytest.mark.slow
@pytest.mark.parametrize("method, flags, min_ratio, epochs, images", SEED_METHODS, ids=[m[0] for m in SEED_METHODS])
def test_seed_method_with_error_feedback_learns_real_cifar(
    tmp_path, cifar10_dir, method, flags, min_ratio, epochs, images
):
    out = tmp_path / method
    proc = run_cli(
        "train",
        "--model",
        "airbench",
        "--dataset",
        "cifar10",
        "--data-dir",
        cifar10_dir,
        "--train-subset",
        str(images),
        "--test-subset",
        "1000",
        "--epochs",
        str(epochs),
        "--batch-size",
        "100",
        "--lr",
        "0.2",
        "--nesterov",
        "--label-smoothing",
        "0.2",
        "--crop-padding",
        "2",
        "--precision",
        "auto",
        "--workers",
        "2",
        "--compress",
        method,
        *flags,
        "--granularity",
        "layerwise",
        "--error-feedback",
        "--out",
        out,
        "--no-progress",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_test_acc"] > 0.25, summary  # chance is 0.10
    assert summary["compress_method"] == method
    assert summary["dense_bytes_per_step"] == pytest.approx(4 * summary["params"], rel=0.01)
    assert summary["compression_ratio"] >= min_ratio, summary
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["bytes_sent_per_step"] < r["dense_bytes_per_step"] for r in rows)
    assert len(rows) == epochs and all(r["encode_ms_per_step"] >= 0 and r["decode_ms_per_step"] >= 0 for r in rows)


# Entire model in seed 004's own spelling (--compress entiremodel --method TopK -K 0.01).
GRANULARITY_FLAGS = {
    "layerwise": ("--compress", "topk", "--ratio", "0.01", "--granularity", "layerwise"),
    "entiremodel": ("--compress", "entiremodel", "--method", "TopK", "-K", "0.01"),
}


@pytest.mark.dist
@pytest.mark.parametrize("granularity", GRANULARITY_FLAGS)
def test_synthetic_compressed_run_writes_compression_fields(tmp_path, granularity):
    out = tmp_path / "run"
    proc = run_cli("train", *SYN, "--workers", "2", *GRANULARITY_FLAGS[granularity], "--error-feedback", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["compression_ratio"] > 30
    expected = "entire" if granularity == "entiremodel" else "layerwise"
    assert (summary["compress_method"], summary["compress_granularity"]) == ("topk", expected)


def test_unknown_method_is_one_line(main_cli, tmp_path):
    proc = main_cli("train", *SYN, "--workers", "2", "--compress", "topkk", "--out", tmp_path / "run")
    assert_one_line_error(proc, "unknown compressor 'topkk' (did you mean 'topk'?)")


def test_compression_without_workers_is_one_line(main_cli, tmp_path):
    proc = main_cli("train", *SYN, "--compress", "qsgd", "--out", tmp_path / "run")
    assert_one_line_error(proc, "needs --workers N >= 2")


def test_flag_the_method_does_not_use_is_one_line(main_cli, tmp_path):
    proc = main_cli("train", *SYN, "--workers", "2", "--compress", "terngrad", "-K", "0.1", "--out", tmp_path / "r")
    assert_one_line_error(proc, "does not use --ratio")
