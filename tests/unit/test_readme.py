"""The Python examples of docs/python-api.md run as written (a stale example is a broken feature).

Its ```python blocks run in order in one namespace, in a fresh folder (they train a few tiny runs: slow tests); the
one that starts workers is a test of its own. A block fenced ```python no-run is shown, not run (it needs a module
of the user's on the path)."""

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def blocks() -> list[tuple[str, str]]:
    """(fence info after ``python``, code) of every python block, in order."""
    return [
        (m.group(1).strip(), m.group(2)) for m in re.finditer(r"```python([^\n]*)\n(.*?)```", PAGE.read_text(), re.S)
    ]


def run(code: str, namespace: dict) -> None:
    exec(compile(code, f"{PAGE.name} example", "exec"), namespace)


@pytest.mark.slow
def test_the_examples_run_here(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    fast = [code for info, code in blocks() if info != "no-run" and "workers=2" not in code]
    assert len(fast) >= 5
    for code in fast:
        run(code, namespace)
    assert namespace["result"].out == Path("runs/tiny") and len(namespace["result"].history) == 1
    assert (tmp_path / "runs/tiny/run.toml").is_file() and namespace["rows"]
    assert len(namespace["more"].history) == 2 and namespace["again"].summary["epochs"] == 2
    assert "--batch-size 100 is not divisible by 3 workers" in capsys.readouterr().out
    assert namespace["logits"].shape == (128, 10) and namespace["loss"].isfinite()


@pytest.mark.slow
def test_the_two_worker_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (code,) = [code for info, code in blocks() if info != "no-run" and "workers=2" in code]
    namespace: dict = {}
    run(code, namespace)
    summary = namespace["result"].summary
    assert (summary["world_size"], summary["compress_method"]) == (2, "topk")
    assert summary["bytes_sent_per_step"] < summary["dense_bytes_per_step"] / 10
    assert len(namespace["result"].history) == 1
