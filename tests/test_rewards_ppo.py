import json

import pytest
import yaml
from conftest import tiny_ppo_config
from test_rewards_remote import running
from test_rewards_model import tiny_rm

from ppokit.config import PPOConfig
from ppokit.rewards import function_source, make_server
from ppokit.tiny import bpe_tokenizer
from ppokit.trainer import PPOTrainer

TARGET = "great"  # a word of the demo vocabulary that the untrained tiny model emits now and then


def prefers_great(prompts, completions, **columns):
    return [1.0 if TARGET in c.split() else 0.0 for c in completions]


def test_ppo_raises_the_rate_of_the_word_the_reward_prefers(model_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(
        model_dir("llama"), prompts_file, tmp_path / "run", total_episodes=128, per_device_train_batch_size=8,
        num_mini_batches=2, learning_rate=2e-2, num_sample_generations=0,
    )
    trainer = PPOTrainer(config, reward_functions=[prefers_great], show_progress=False)
    records = trainer.train()
    rates = [r["reward/prefers_great"] for r in records]  # fraction of the 16 completions with the word
    print(f"rate of {TARGET!r} per update: {[round(r, 2) for r in rates]}")
    first, last = sum(rates[:2]) / 2, sum(rates[-2:]) / 2
    assert last >= first + 0.3 and last >= 0.4, rates
    # The run records the functions it used; the caller's config is left as it was.
    assert trainer.config.reward.functions == ["prefers_great"] and config.reward.functions == ["sentiment"]
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["reward"]["functions"] == ["prefers_great"]


@pytest.fixture
def other_vocab_rm(tmp_path, demo_data):
    tok = bpe_tokenizer(r["prompt"] + " " + r["completion"] for r in demo_data["sft"])
    path = tmp_path / "rm"
    tiny_rm(tok, seed=4).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_every_source_from_the_config_with_skipped_rows_masked_out(model_dir, prompts_file, tmp_path, other_vocab_rm, monkeypatch):
    (tmp_path / "picky.py").write_text(
        "def picky(prompts, completions, **columns):\n"
        "    # user code with a bug: no score for prompts that start with 'the'\n"
        "    return [float('nan') if p.startswith('the ') else 1.0 for p in prompts]\n"
    )
    monkeypatch.chdir(tmp_path)
    served = function_source({"function": "length", "target": 5, "unit": "words"}, "served")
    with running(make_server(served, port=0)) as url:
        (tmp_path / "ppo.yaml").write_text(yaml.safe_dump({
            "model": str(model_dir("llama")), "output_dir": str(tmp_path / "run"), "seed": 3,
            "data": {"train": str(prompts_file)},
            "reward": {
                "model": str(other_vocab_rm),
                "functions": ["sentiment", {"function": "contains", "name": "likes_great", "required": ["great"]}, "picky.py:picky"],
                "remote": {"url": url, "max_retries": 0, "name": "served_length"},
                "weights": [0.5, 1.0, 2.0, 0.1, 0.2],
                "normalize": [True, False, False, False, True],
                "clip_range": [-3, 3],
                "on_error": "skip",
            },
            "ppo": {"total_episodes": 16, "per_device_train_batch_size": 4, "num_mini_batches": 2, "num_ppo_epochs": 1,
                    "response_length": 8, "temperature": 1.0, "num_sample_generations": 0},
        }))
        trainer = PPOTrainer(PPOConfig.load(tmp_path / "ppo.yaml"), show_progress=False)
        seen = []
        optimise = trainer.optimise
        monkeypatch.setattr(trainer, "optimise", lambda rollout: seen.append(rollout) or optimise(rollout))
        with pytest.warns(UserWarning, match="picky returned nan"):
            records = trainer.train()
    assert trainer.scorer.names == ["reward_model", "sentiment", "likes_great", "picky", "served_length"]
    for r in records:
        for name in trainer.scorer.names:
            assert f"reward/{name}" in r
        assert -3 <= r["objective/scores"] <= 3
    assert set(trainer.scorer.state_dict()["moments"]) == {"reward_model", "served_length"}
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["reward/skipped"] for line in lines] == [r["reward/skipped"] for r in records]
    skipped = sum(r["reward/skipped"] for r in records)
    assert skipped > 0
    for rollout in seen:  # skipped rows take no part in the update: no tokens, no advantage, score 0
        dropped = ~rollout.response_mask.any(1)
        assert rollout.advantages[dropped].abs().sum() == 0 and rollout.scores[dropped].abs().sum() == 0
    assert sum(int((~rollout.response_mask.any(1)).sum()) for rollout in seen) == skipped


def test_python_objects_as_sources(model_dir, prompts_file, tmp_path, tokenizer, demo_data):
    from ppokit.rewards import Contains, RemoteReward

    rm_tok = bpe_tokenizer(r["prompt"] + " " + r["completion"] for r in demo_data["sft"])
    rm = tiny_rm(rm_tok, seed=5)
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", total_episodes=8, num_sample_generations=0)
    with running(make_server(function_source("sentiment", "k"), port=0)) as url:
        trainer = PPOTrainer(
            config, reward_model=rm, reward_tokenizer=rm_tok, show_progress=False,
            reward_functions=[Contains(required=["great"]), RemoteReward(url, name="vader", max_retries=0)],
        )
        record = trainer.step()
    assert trainer.scorer.names == ["reward_model", "contains", "vader"]
    assert {"reward/reward_model", "reward/contains", "reward/vader"} <= set(record)
    assert trainer.config.reward.functions == ["contains", "vader"] and trainer.config.reward.model is None
    assert config.reward.functions == ["sentiment"]  # the caller's config is left as it was
    # the reward model has another vocabulary, so the critic starts from the policy, not from it
    assert trainer.value_model.get_input_embeddings().num_embeddings == len(tokenizer)
