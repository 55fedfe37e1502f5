"""The Python API page's example runs as written (a stale example is a broken feature)."""

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def test_use_it_from_python_example_runs():
    code = re.search(r"```python\n(.*?)```", PAGE.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/python-api.md", "exec"), namespace)
    assert namespace["logits"].shape == (128, 10) and namespace["loss"].isfinite()
