"""Every Python snippet in the README runs as written, offline, on the bundled demo pair."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def readme_snippets() -> list:
    """The README's ```python blocks, in order."""
    return _FENCE.findall((REPO / "README.md").read_text())


def test_readme_has_python_snippets():
    assert len(readme_snippets()) >= 3


@pytest.mark.parametrize("index", range(len(readme_snippets())))
def test_readme_snippet_runs_as_written(index, tmp_path):
    snippet = readme_snippets()[index]
    # A fresh interpreter per snippet: each must stand alone (imports, models, names).
    result = subprocess.run(
        [sys.executable, "-c", snippet],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        result.returncode == 0
    ), f"snippet {index} failed:\n{snippet}\n{result.stderr[-3000:]}"
