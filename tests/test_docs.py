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


def test_the_cpu_constraints_select_the_cpu_build_of_torch():
    """`torch==2.13.0` alone resolves from PyPI to the CUDA build on Linux: on x86-64 the pin carries the
    `+cpu` local version, which only PyTorch's CPU index (named in the file) or a local CPU wheel has."""
    from packaging.requirements import Requirement

    lines = [line.strip() for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines()]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    pins = [Requirement(line) for line in lines if line and not line.startswith(("#", "--"))]
    for machine, platform, version in (("x86_64", "linux", "2.13.0+cpu"), ("AMD64", "win32", "2.13.0+cpu"),
                                       ("aarch64", "linux", "2.13.0"), ("arm64", "darwin", "2.13.0")):
        applying = [r for r in pins if r.marker is None or r.marker.evaluate({"platform_machine": machine, "sys_platform": platform})]
        assert [(r.name, str(r.specifier)) for r in applying] == [("torch", f"=={version}")], (machine, platform)
