"""The linter the project keeps: ruff's pycodestyle errors and warnings and pyflakes (E, F, W) at the line length set
in pyproject.toml ([tool.ruff]), over every Python file of the repository. An unused import, an undefined name, a line
over the length: this test fails, in the suite CI runs."""

import subprocess
from pathlib import Path

from ruff.__main__ import find_ruff_bin  # ruff is in the dev extras

ROOT = Path(__file__).resolve().parent.parent


def test_the_repository_passes_the_linter():
    checked = subprocess.run([find_ruff_bin(), "check", "--no-cache", "--output-format", "concise", str(ROOT)], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr

