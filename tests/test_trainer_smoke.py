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
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in lines] == [1, 2]
    assert (run / "final" / "config.json").exists()
    assert (run / "final" / "value_model" / "config.json").exists()
    assert (run / "config.yaml").exists()
