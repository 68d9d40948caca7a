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


def test_algorithms_page_has_every_estimator_and_knob():
    from ppokit.config import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS

    page = (ROOT / "docs" / "algorithms.md").read_text()
    knobs = ("top_k", "top_p", "min_p", "num_samples_per_prompt", "eval_temperature", "grpo_scale_std", "kl_in_reward",
             "kl_loss_coef", "kl_loss_estimator", "cliprange_low", "cliprange_high", "dual_clip_c", "entropy_coef",
             "vf_learning_rate", "critic_warmup_updates")
    table = [line for line in page.splitlines() if line.startswith("| `")]
    for name in [f"advantage_estimator: {e}" for e in ADVANTAGE_ESTIMATORS] + [f"loss_aggregation: {a}" for a in LOSS_AGGREGATIONS] + list(knobs):
        assert any(f"`{name}" in line or f", `{name}`" in line for line in table), name
