"""``--staleness K`` is never exceeded, with one worker slowed down (TRAINSCALE_PS_SLOW, test-only:
worker 1 sleeps before each step) so that the other one keeps running into the bound."""

import json

import pytest

from tests.integration.cli import run_cli, small_run

K = 1


@pytest.mark.alone
@pytest.mark.dist
def test_bounded_staleness_holds_with_a_slowed_worker(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        *small_run(train=512, test=128),
        "--epochs",
        "2",
        "--mode",
        "async",
        "--staleness",
        str(K),
        "--workers",
        "2",
        "--servers",
        "2",
        "--out",
        out,
        timeout=300,
        env={"TRAINSCALE_PS_SLOW": "worker=1:seconds=0.15"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["ps_pushes"] == 2 * 8  # 2 workers x (256 samples / 32 per worker step)
        assert row["clock_gap_max"] == K  # reached (the fast worker ran into the bound) and never exceeded
        assert row["wait_seconds_per_step"] > 0.02  # ... so it really waited for the slow one
        # Updates applied between a worker's pull and its push: at most (workers - 1) * (2K + 1).
        assert row["staleness_max"] <= (2 - 1) * (2 * K + 1), row["staleness_hist"]
        assert sum(row["staleness_hist"].values()) == 2 * row["ps_pushes"]  # per shard update, 2 shards
    summary = json.loads((out / "summary.json").read_text())
    assert summary["staleness_bound"] == K and summary["clock_gap_max"] == K
