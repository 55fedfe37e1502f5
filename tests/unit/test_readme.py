"""The README's "Use it from Python" example runs as written (a stale example is a broken feature)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_use_it_from_python_example_runs():
    section = README.read_text().split("## Use it from Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md (Use it from Python)", "exec"), namespace)
    assert namespace["logits"].shape == (128, 10) and namespace["loss"].isfinite()
