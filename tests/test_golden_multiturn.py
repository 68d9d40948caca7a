"""A golden multi-turn run: the per-episode loop's metrics, recorded when it landed (issue 29), must stay what they are,
compared as tests/test_golden.py compares the single-turn runs (its tolerance, its reasons). Two updates of multi-turn
grpo over an environment that answers every turn and rewards it, its episodes seeded by (run seed, update, row, turn).

Multi-turn metrics changed once with this loop (its seeds are per request, where the lock-step loop drew every turn
from torch's generator); single-turn runs did not (tests/test_golden.py).

PPOKIT_WRITE_GOLDEN=1 rewrites tests/golden/multiturn_grpo.json from the code as it is (only for a change that is meant to
change results; say so in the commit)."""

from __future__ import annotations

import json
import math
import os

import pytest
from conftest import tiny_ppo_config
from test_golden import ATOL, GOLDEN, RTOL
from test_multiturn import CRITIC

from ppokit.config.schema import RolloutConfig
from ppokit.trainer import PPOTrainer


def test_a_multi_turn_run_keeps_its_recorded_metrics(sft_model_dir, prompts_file, tmp_path):
    env_file = tmp_path / "critic.py"
    env_file.write_text(CRITIC)
    out = tmp_path / "run"
    config = tiny_ppo_config(sft_model_dir, prompts_file, out, total_episodes=16, per_device_train_batch_size=8, response_length=8,
                             stop_token="eos", num_sample_generations=1, learning_rate=2e-5, advantage_estimator="grpo",
                             num_samples_per_prompt=4)
    config.environment = f"{env_file}:Critic"
    config.rollout = RolloutConfig(max_turns=3, max_episode_tokens=24)
    records = PPOTrainer(config, show_progress=False).train()
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    got = {"metrics": [{k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"} for r in records],
           "completions": [s["completion"] for s in samples],
           "turns": [[{"role": t["role"], "text": t["text"]} for t in s["turns"]] for s in samples]}  # what was said, in order
    path = GOLDEN / "multiturn_grpo.json"
    if os.environ.get("PPOKIT_WRITE_GOLDEN") == "1":
        path.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip(f"wrote {path}")
    want = json.loads(path.read_text())
    assert got["completions"] == want["completions"] and got["turns"] == want["turns"], "the sampled episodes differ: another token was drawn"
    assert [sorted(r) for r in got["metrics"]] == [sorted(r) for r in want["metrics"]], "the metric names differ"
    assert got["metrics"][0]["rollout/turns"] == 2 and got["metrics"][0]["rollout/observation_tokens"] > 0
    for update, (g, w) in enumerate(zip(got["metrics"], want["metrics"]), 1):
        for key, value in w.items():
            assert math.isclose(g[key], value, rel_tol=RTOL, abs_tol=ATOL), f"update {update} {key}: {g[key]!r}, recorded {value!r}"
