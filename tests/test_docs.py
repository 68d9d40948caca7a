from pathlib import Path

from ppokit.configdoc import reference_document

ROOT = Path(__file__).resolve().parents[1]


def test_config_reference_is_current():
    """docs/config.md is generated from the dataclasses' help texts; regenerate it when a key changes:
    python -m ppokit.configdoc > docs/config.md"""
    assert (ROOT / "docs" / "config.md").read_text() == reference_document()


def test_readme_has_the_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "ppokit demo" in readme
    test_command = 'pip install -q -c constraints/cpu.txt -e ".[dev]" && python -m pytest -q'
    assert test_command in readme and test_command in ci


def test_the_documented_generator_command_prints_the_reference_and_nothing_else():
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-m", "ppokit.configdoc"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout == reference_document()
