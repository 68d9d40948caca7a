"""Model cards (ppokit.run.model_card): README.md beside every saved model. The sft/rm cards are checked on
the pipeline's outputs (tests/test_stages.py), the LoRA and merged cards on the LoRA run of
tests/test_roles.py."""

import pytest
import torch
import yaml
from conftest import tiny_ppo_config

from ppokit import __version__
from ppokit.config.schema import LoraConfig, PPOConfig, RemoteRewardConfig
from ppokit.run.model_card import ppo_card


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_a_full_fine_tune_gets_a_card_and_transformers_still_loads_final(model_dir, prompts_file, tmp_path):
    from transformers import AutoModelForCausalLM

    from ppokit.trainer import PPOTrainer

    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", total_episodes=8)
    config.data.eval = str(prompts_file)
    trainer = PPOTrainer(config, show_progress=False)
    last = trainer.train()[-1]
    final = tmp_path / "run" / "final"
    card = (final / "README.md").read_text()
    assert front_matter(card) == {"library_name": "transformers", "pipeline_tag": "text-generation", "tags": ["ppokit", "rlhf", "ppo"]}
    for fact in (
        f"| base model | `{model_dir('llama')}` |",  # a local path: in the text, not in the hub's base_model
        f"| data | train: `{prompts_file}`; eval: `{prompts_file}` |",
        "| reward | function `sentiment` |",
        "| advantage estimator | `gae`: PPO with a learned value model and GAE |",
        "| trained weights | all weights |",
        "| value model | in value_model/ beside the policy |",
        f"| ppokit | {__version__} (`ppokit ppo`) |",
        "| `ppo.learning_rate` | 0.001 |", "| `ppo.total_episodes` | 8 |", "| `ppo.kl_coef` | 0.05 |", "| `ppo.lam` | 0.95 |",
        "## Results (update 1 of 1, episode 8)",
        f"| `objective/scores` | {last['objective/scores']:.6g} |", f"| `objective/kl` | {last['objective/kl']:.6g} |",
        f"| `eval/scores` | {last['eval/scores']:.6g} |",
        f"model = AutoModelForCausalLM.from_pretrained({str(final)!r})",
    ):
        assert fact in card, fact
    loaded = AutoModelForCausalLM.from_pretrained(final)
    trained = dict(trainer.policy.named_parameters())
    assert all(torch.equal(p, trained[name]) for name, p in loaded.named_parameters())


def _config(**changes) -> PPOConfig:
    config = PPOConfig.load(None, ["model=org/base-1b", "data.train=org/prompts:train", "reward.functions=[sentiment]", "output_dir=runs/r"])
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def test_the_card_says_what_the_run_was_without_loading_anything():
    config = _config(lora=LoraConfig(r=8, alpha=16))
    config.ppo.advantage_estimator, config.ppo.num_samples_per_prompt = "grpo", 4
    config.reward.model = "runs/rm"
    config.reward.functions = [{"function": "contains", "required": ["<b>great</b>"]}, "my|rewards.py:fn"]
    config.reward.remote = RemoteRewardConfig(url="https://scores.example/v1/score?token=secret")
    config.reward.weights = [1.0, 0.5, 2.0, 1.0]
    card = ppo_card(config, {"update": 3, "episode": 48, "objective/scores": 0.25, "lr": 1e-6}, 4)
    text = card.render()
    assert front_matter(text) == {"base_model": "org/base-1b", "library_name": "peft", "pipeline_tag": "text-generation",
                                  "tags": ["ppokit", "rlhf", "grpo"], "datasets": ["org/prompts"]}
    assert ("| reward | reward model `runs/rm` × 1; function `function: contains, required: ['<b>great</b>']` × 0.5; "
            "function `my\\|rewards.py:fn` × 2; remote `https://scores.example/v1/score` × 1 |") in text
    assert "secret" not in text  # a query string may hold a token
    assert "| trained weights | a LoRA adapter (r 8, alpha 16) on the frozen base |" in text
    assert "ppo.vf_coef" not in text and "| value model |" not in text  # grpo trains no critic
    assert "| `ppo.num_samples_per_prompt` | 4 |" in text and "| `lora.r` | 8 |" in text
    assert "## Results (update 3 of 4, episode 48)" in text and "| `objective/scores` | 0.25 |" in text and "`lr`" not in text
    assert "AutoPeftModelForCausalLM.from_pretrained('runs/r/final')" in text
    merged = card.merged().render()
    assert front_matter(merged)["library_name"] == "transformers"
    assert "| trained weights | the LoRA adapter merged into the base weights |" in merged
    assert "AutoModelForCausalLM.from_pretrained('runs/r/final/merged')" in merged


DR_GRPO = ["ppo.advantage_estimator=grpo", "ppo.num_samples_per_prompt=4", "ppo.grpo_scale_std=false", "ppo.kl_in_reward=false",
           "ppo.kl_loss_coef=0.01", "ppo.loss_aggregation=seq_mean_token_sum_norm"]


def test_a_dr_grpo_cards_and_config_say_what_trained(tmp_path):
    """Dr. GRPO (grpo with grpo_scale_std: false, no KL in the reward, a KL term in the loss): the card says the rewards are
    not divided by a std and lists only the keys the run read; config.yaml leaves the others out of `ppo:` and names
    them in a comment with their values, and loads back as the same config (a resume compares it so)."""
    config = PPOConfig.load(None, ["model=org/base-1b", "data.train=org/prompts:train", "reward.functions=[sentiment]",
                                   "output_dir=runs/r", *DR_GRPO]).validate()
    text = ppo_card(config, None, 2).render()
    assert ("| advantage estimator | `grpo`: Dr. GRPO: each reward less the mean of its prompt's group of samples, not divided by "
            "a standard deviation, no value model |") in text
    assert "normalised within each prompt's group" not in text
    for shown in ("| `ppo.grpo_scale_std` | False |", "| `ppo.kl_in_reward` | False |", "| `ppo.kl_loss_coef` | 0.01 |",
                  "| `ppo.kl_loss_estimator` | k3 |", "| `ppo.loss_aggregation` | seq_mean_token_sum_norm |",
                  "| `ppo.kl_estimator` | k1 (of the reported objective/kl only: no KL in the reward) |",
                  "Keys of the `ppo:` section that this run did not read are left out (config.yaml names them)."):
        assert shown in text, shown
    for hidden in ("ppo.kl_coef", "ppo.kl_target", "ppo.vf_coef", "ppo.lam", "ppo.gamma", "ppo.whiten_advantages", "ppo.cliprange_value"):
        assert f"`{hidden}`" not in text, hidden

    config.save(tmp_path / "config.yaml")
    written = (tmp_path / "config.yaml").read_text()
    saved = yaml.safe_load(written)["ppo"]
    unread = ("vf_learning_rate", "critic_warmup_updates", "vf_coef", "cliprange_value", "lam", "gamma", "whiten_advantages",
              "whiten_rewards", "kl_coef", "kl_target", "kl_horizon")
    assert set(unread).isdisjoint(saved) and saved["grpo_scale_std"] is False and saved["kl_estimator"] == "k1"
    assert "  #   vf_coef: 0.1  (for the value model, which ppo.advantage_estimator grpo does not build)\n" in written
    assert "  #   kl_coef: 0.05  (for the KL penalty in the reward, and ppo.kl_in_reward is false)\n" in written
    assert [line.split(":")[0].strip("# ") for line in written.splitlines() if line.startswith("  #   ")] == list(unread)
    assert PPOConfig.load(tmp_path / "config.yaml").validate().to_dict() == config.to_dict()


def test_a_gae_cards_and_config_keep_every_key_it_read(tmp_path):
    config = PPOConfig.load(None, ["model=m", "reward.functions=[sentiment]"]).validate()
    text = ppo_card(config, None, 2).render()
    assert "| `ppo.kl_coef` | 0.05 |" in text and "| `ppo.vf_coef` | 0.1 |" in text and "| `ppo.whiten_advantages` | True |" in text
    assert "`ppo.grpo_scale_std`" not in text and "`ppo.kl_loss_estimator`" not in text
    config.save(tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["ppo"]
    assert {"kl_coef", "vf_coef", "lam", "whiten_advantages", "gamma"} <= set(saved) and "grpo_scale_std" not in saved
    assert PPOConfig.load(tmp_path / "config.yaml").validate().to_dict() == config.to_dict()


@pytest.mark.parametrize("title", ["a|b", "<script>x</script>", "two\nlines"])
def test_names_cannot_break_the_card(title, tmp_path):
    config = _config(output_dir=str(tmp_path / title))
    text = ppo_card(config, None, 2).render()
    heading = next(line for line in text.splitlines() if line.startswith("# "))
    assert "<" not in heading and "\n" not in heading and ("|" not in title or "\\|" in heading)
    assert "No metrics were recorded." in text


def test_a_distilled_policys_card_names_its_teacher_and_its_kl():
    config = PPOConfig.load(None, ["model=org/base-1b", "data.train=org/prompts:train", "output_dir=runs/r", "teacher=runs/teacher",
                                   "teacher_coef=0.5", "ppo.advantage_estimator=grpo", "ppo.num_samples_per_prompt=4"]).validate()
    text = ppo_card(config, {"update": 2, "episode": 32, "teacher/kl": 0.75}, 2).render()
    assert ("| teacher | `runs/teacher`: each sampled token's reward less 0.5 x its reverse KL log pi_student - log pi_teacher "
            "(on-policy distillation) |") in text
    assert "| reward | none: the teacher's alone |" in text and "| `teacher/kl` | 0.75 |" in text
