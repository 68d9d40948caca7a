import json

import pytest
from conftest import tiny_ppo_config

from ppokit.trainer import PPOTrainer


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_ppo_runs_and_writes_run_directory(arch, model_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(model_dir(arch), prompts_file, tmp_path / "run")
    records = PPOTrainer(config, show_progress=False).train()
    assert len(records) == 2
    run = tmp_path / "run"
    lines = [json.loads(row) for row in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in lines] == [1, 2]
    assert (run / "final" / "config.json").exists()
    assert (run / "final" / "value_model" / "config.json").exists()
    assert (run / "config.yaml").exists()


def test_the_console_names_the_entropy_it_prints_as_the_report_does(capsys):
    """objective/entropy is a sum over a response's tokens (14.16 for the quick demo's 91-word vocabulary): the line says
    "entropy per sequence", the words of the report's panel, not a bare "entropy" a reader takes per token."""
    from ppokit.metrics.sinks import ConsoleReporter
    from ppokit.report.figures import figure_specs

    ConsoleReporter(1).record({"update": 1, "objective/scores": 0.5, "objective/kl": 0.25, "objective/entropy": 14.16, "eps": 8.0})
    line = capsys.readouterr().err
    assert " | entropy per sequence 14.16 | " in line, line
    panels = [panel.title for spec in figure_specs([]) for panel in spec.panels]
    assert "entropy per sequence (objective/entropy)" in panels


def test_progress_into_a_log_file_is_plain_lines_without_library_bars(model_dir, prompts_file, tmp_path, capsys):
    """stderr that is no terminal (a log file, a pipe; pytest's capture here): one plain line per update with
    the time left, instead of a bar redrawn with carriage returns, and no transformers bar ("Loading
    weights", "Writing model shards") for the models ppokit loads and saves."""
    from transformers.utils import logging as hf_logging

    config = tiny_ppo_config(model_dir(), prompts_file, tmp_path / "run", total_episodes=24, logging_steps=2)
    capsys.readouterr()
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as in a fresh process: an earlier in-process `ppokit` command turns them off
    try:
        PPOTrainer(config).train()
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err and "Loading weights" not in err and "Writing model shards" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("update ")]
    assert [line.split(" | ")[0] for line in lines] == ["update 1/3", "update 2/3", "update 3/3"], err
    assert "score" not in lines[0] and "score" in lines[1] and "score" in lines[2]  # metrics every logging_steps, and the last
    assert all(line.endswith(" left") and " elapsed, " in line for line in lines), lines
