"""Two processes on CPU (torchrun, gloo): the run completes without hanging, the batch is split
across processes, metrics are reduced over them, and the main process alone writes the run directory."""

import json
import os
import shutil
import subprocess

import pytest
import yaml

TORCHRUN = shutil.which("torchrun")


def _config(model_dir, prompts_file, tmp_path):
    config = tmp_path / "ppo.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model_dir("llama")), "output_dir": str(tmp_path / "run"),
        "reward": {"functions": ["sentiment"]}, "data": {"train": str(prompts_file)},
        "ppo": {"total_episodes": 32, "per_device_train_batch_size": 4, "num_mini_batches": 2, "num_ppo_epochs": 2,
                "response_length": 8, "learning_rate": 1e-3, "num_sample_generations": 1, "save_steps": 1},
    }))
    return config


def _launch(config, *extra, use_cpu=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if use_cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    command = [TORCHRUN, "--nproc_per_node", "2", "-m", "ppokit", "ppo", str(config), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH")
def test_two_process_cpu_run_with_checkpoints_and_resume(model_dir, prompts_file, tmp_path):
    config = _config(model_dir, prompts_file, tmp_path)
    result = _launch(config)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # 2 processes x 4 per device x 2 minibatches = 16 episodes per update: 2 updates of 32 episodes
    assert [(r["update"], r["episode"]) for r in records] == [(1, 16), (2, 32)]
    assert len(result.stdout.strip().splitlines()) == 1  # one summary line, from the main process
    assert (tmp_path / "run" / "final" / "value_model").is_dir()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith("update-")) == ["update-1", "update-2"]
    # The main process alone holds the run lock (a second holder would have stopped with "in use by another ppokit run").
    assert len((tmp_path / "run" / ".ppokit.lock").read_text().split()) == 1 and "in use by" not in result.stderr
    # resuming a finished run trains nothing and says so, on every process, without hanging
    resumed = _launch(config, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "nothing left to train" in resumed.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH")
def test_processes_that_do_not_see_each_other_refuse_to_share_a_run_directory(model_dir, prompts_file, tmp_path):
    result = _launch(_config(model_dir, prompts_file, tmp_path), use_cpu=False)  # on CPU accelerate then sees 1 process each
    assert result.returncode != 0
    assert "launched as 2 processes (WORLD_SIZE) but accelerate sees 1" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
