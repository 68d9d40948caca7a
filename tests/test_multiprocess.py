"""Two processes on CPU (torchrun, gloo): the run completes without hanging, the batch is split
across processes, metrics are reduced over them, and the main process alone writes the run directory."""

import json
import os
import shutil
import subprocess

import pytest
import yaml

TORCHRUN = shutil.which("torchrun")


def _config(model_dir, prompts_file, tmp_path, functions=("sentiment",), **ppo):
    config = tmp_path / "ppo.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model_dir("llama")), "output_dir": str(tmp_path / "run"),
        "reward": {"functions": list(functions)}, "data": {"train": str(prompts_file)},
        "ppo": {"total_episodes": 32, "per_device_train_batch_size": 4, "num_mini_batches": 2, "num_ppo_epochs": 2,
                "response_length": 8, "learning_rate": 1e-3, "num_sample_generations": 1, "save_steps": 1, **ppo},
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
    assert all(-1.0 <= r["val/explained_variance"] <= 1.0 for r in records)  # reduced over both processes' tokens
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith("update-")) == ["update-1", "update-2"]
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


REWARD_THAT_LOGS = """
import json, os

def logged_length(prompts, completions, row, **columns):
    with open({log!r} + "-" + os.environ["RANK"], "a") as f:
        f.write(json.dumps(row) + "\\n")
    return [len(c) / 40 for c in completions]
"""


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH")
def test_two_processes_keep_each_prompts_samples_together_for_grpo(model_dir, prompts_file, tmp_path):
    """GRPO's group statistics need a prompt's n samples in one place: each process takes whole prompts."""
    log = tmp_path / "scored"
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_THAT_LOGS.format(log=str(log)))
    numbered = tmp_path / "prompts.jsonl"  # prompt texts repeat in the demo data; a row number tells the rows apart
    rows = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    numbered.write_text("".join(json.dumps({**r, "row": i}) + "\n" for i, r in enumerate(rows)))
    config = _config(model_dir, numbered, tmp_path, functions=[f"{reward}:logged_length"], save_steps=0,
                     advantage_estimator="grpo", num_samples_per_prompt=4)
    result = _launch(config)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # 16 episodes per update = 4 prompts x 4 samples, 2 prompts on each process
    assert [(r["update"], r["episode"]) for r in records] == [(1, 16), (2, 32)]
    calls = [[json.loads(line) for line in (tmp_path / f"scored-{rank}").read_text().splitlines()] for rank in (0, 1)]
    assert [len(c) for c in calls] == [2, 2]  # one scoring call per update on each process
    for update in range(2):
        per_process = [calls[rank][update] for rank in (0, 1)]
        for rows in per_process:
            assert len(rows) == 8 and all(rows[i] == rows[i - i % 4] for i in range(8))  # runs of 4 samples of one row
        assert not set(per_process[0]) & set(per_process[1])  # no prompt's samples are split across processes
        assert len(set(per_process[0]) | set(per_process[1])) == 4
    assert not (tmp_path / "run" / "final" / "value_model").exists()
