"""A TRL GRPO config in ppokit: every GRPOConfig name is told the exact ppokit key and value that does the same, or
that there is none; never a close spelling of an unrelated key (num_generations once pointed at
ppo.num_sample_generations, epsilon at ppo.adam_epsilon)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from ppokit.config.schema import PPOConfig
from ppokit.config.fields import _key_paths
from ppokit.errors import UserError
from ppokit.config.trl_names import LOSS_TYPES, TRL_GRPO_EQUIVALENTS, TRL_GRPO_NAMES, WITHOUT_EQUIVALENT, Equivalent

BASE = ["model=some/model", "reward.functions=[sentiment]", "data.train=p.jsonl"]


def hint_of(override: str) -> str:
    with pytest.raises(UserError) as error:
        PPOConfig.load(None, BASE + [override])
    message = str(error.value)
    assert "\n" not in message
    found = re.match(r"unknown config key \S+ \((.*)\); known keys here", message)
    assert found, message
    return found.group(1)


@pytest.mark.parametrize("override, hint", [
    # the four that pointed wrong, and the five that got nothing (issue 31)
    ("num_generations=8", "TRL's GRPO name; ppokit's is ppo.num_samples_per_prompt: 8; TRL's default is 8, ppokit's 1"),
    ("ppo.num_generations=4", "TRL's GRPO name; ppokit's is ppo.num_samples_per_prompt: 4; TRL's default is 8, ppokit's 1"),
    ("epsilon=0.2", "TRL's GRPO name; ppokit's is ppo.cliprange: 0.2; both bounds unless ppo.cliprange_high is set"),
    ("ppo.epsilon=0.1", "TRL's GRPO name; ppokit's is ppo.cliprange: 0.1; both bounds unless ppo.cliprange_high is set"),
    ("scale_rewards=batch", "TRL's GRPO name; ppokit's is ppo.grpo_scale_std: batch; the group's mean over the whole batch's standard deviation"),
    ("scale_rewards=group", "TRL's GRPO name; ppokit's is ppo.grpo_scale_std: true; ppokit's default"),
    ("scale_rewards=none", "TRL's GRPO name; ppokit's is ppo.grpo_scale_std: false; Dr. GRPO's r - mean"),
    ("scale_rewards=false", "TRL's GRPO name; ppokit's is ppo.grpo_scale_std: false; Dr. GRPO's r - mean"),
    ("num_iterations=2", "TRL's GRPO name; ppokit's is ppo.num_ppo_epochs: 2; TRL's default is 1, ppokit's 4"),
    ("beta=0.04", "TRL's GRPO name; ppokit's is ppo.kl_in_reward: false with ppo.kl_loss_coef: 0.04; the k3 KL in the loss"),
    ("beta=0.0", "TRL's GRPO name; ppokit's is ppo.kl_in_reward: false; no KL term anywhere"),
    ("max_completion_length=256", "TRL's GRPO name; ppokit's is ppo.response_length: 256"),
    ("epsilon_high=0.28", "TRL's GRPO name; ppokit's is ppo.cliprange_high: 0.28"),
    ("delta=4", "TRL's GRPO name; ppokit's is ppo.dual_clip_c: 4; the same loss where delta > 1 + epsilon_high"),
    ("loss_type=grpo", "TRL's GRPO name; ppokit's is ppo.loss_aggregation: seq_mean_token_mean; each sequence's mean"),
    ("loss_type=bnpo", "TRL's GRPO name; ppokit's is ppo.loss_aggregation: token_mean; ppokit's default"),
    ("loss_type=dr_grpo", "TRL's GRPO name; ppokit's is ppo.loss_aggregation: seq_mean_token_sum_norm; a sum over each"),
    ("loss_type=dapo", "TRL's GRPO name; ppokit's is ppo.loss_aggregation: token_mean; normalised over the tokens of a whole "
                       "optimiser step on every process, as dapo, once ppo.max_tokens_per_micro_batch sets a token budget"),
    ("loss_type=cispo", "TRL's GRPO name; ppokit has no equivalent of loss_type: cispo"),
    ("loss_type=nonsense", "TRL's GRPO name; ppokit knows the values grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo of loss_type, not nonsense"),
    ("use_vllm=true", "TRL's GRPO name; ppokit's is rollout.engine: vllm"),
    ("vllm_gpu_memory_utilization=0.5", "TRL's GRPO name; ppokit's is rollout.engine: vllm with rollout.gpu_memory_utilization: 0.5"),
    ("vllm_importance_sampling_clip_max=3.0", "TRL's GRPO name; ppokit's is ppo.rollout_is: tis with ppo.rollout_is_cap: 3.0"),
    ("reward_weights=[1.0, 0.5]", "TRL's GRPO name; ppokit's is reward.weights: [1.0, 0.5]"),
    ("max_tool_calling_iterations=3", "TRL's GRPO name; ppokit's is rollout.max_turns: 4; model turns"),
    ("top_entropy_quantile=0.2", "TRL's GRPO name; ppokit has no equivalent"),
    ("ppo.sync_ref_model=true", "TRL's GRPO name; ppokit has no equivalent"),
    # names ppokit spells the same, in its ppo section
    ("warmup_ratio=0.1", "did you mean ppo.warmup_ratio?"),
    ("mask_truncated_completions=true", "did you mean ppo.mask_truncated_completions?"),
    ("importance_sampling_level=sequence", "did you mean ppo.importance_sampling_level?"),
    ("temperature=1.0", "did you mean ppo.temperature?"),
])
def test_a_trl_grpo_name_is_told_the_exact_ppokit_key_and_value(override, hint):
    assert hint_of(override).startswith(hint)


SAMPLE_VALUES = {  # values a TRL GRPO user writes, for each name with an equivalent
    "num_generations": [8], "max_completion_length": [256], "num_iterations": [2], "beta": [0.0, 0.04],
    "epsilon": [0.2, 3e-4], "epsilon_high": [0.28], "delta": [4.0], "loss_type": [v for v, said in LOSS_TYPES.items() if isinstance(said, Equivalent)],
    "scale_rewards": ["group", "batch", "none", True, False], "reward_weights": [[1.0]],
    "multi_objective_aggregation": [], "max_tool_calling_iterations": [2], "use_vllm": [True, False],
    "vllm_mode": ["colocate"], "vllm_gpu_memory_utilization": [0.5], "vllm_tensor_parallel_size": [1],
    "vllm_max_model_length": [1024], "vllm_enable_sleep_mode": [False],
    "vllm_importance_sampling_correction": [True, False], "vllm_importance_sampling_mode": ["token_truncate", "sequence_truncate"],
    "vllm_importance_sampling_clip_min": [0.5],
    "vllm_importance_sampling_clip_max": [3.0], "vllm_importance_sampling_cap": [2.5], "ds3_gather_for_generation": [False],
}


def test_every_suggested_setting_is_a_valid_ppokit_config_that_holds_the_value():
    """The suggestion is the config: each (key, value) it names, set on a base config, loads and reads back as given
    (grpo keys with the grpo estimator, environment keys with an environment)."""
    tried = 0
    for name, said in TRL_GRPO_EQUIVALENTS.items():
        for value in SAMPLE_VALUES.get(name, []):
            equivalent = said(value)
            assert isinstance(equivalent, Equivalent), (name, value, equivalent)
            overrides = [f"{key}={_yaml(v)}" for key, v in equivalent.settings]
            keys = {key for key, _ in equivalent.settings}
            context = []
            if "ppo.grpo_scale_std" in keys:
                context = ["ppo.advantage_estimator=grpo", "ppo.num_samples_per_prompt=4"]
            if "rollout.max_turns" in keys:
                context = ["environment=ppokit.environments:GuessNumber"]
            config = PPOConfig.load(None, BASE + context + overrides)
            for key, v in equivalent.settings:
                section, _, leaf = key.rpartition(".")
                node = config
                for part in filter(None, section.split(".")):
                    node = getattr(node, part)
                assert getattr(node, leaf) == v, (name, value, key)
            tried += 1
    assert tried >= 30


def _yaml(value) -> str:
    from ppokit.config.trl_names import yaml_value

    return yaml_value(value)


def test_every_field_of_trls_grpoconfig_is_a_ppokit_key_or_has_a_hint():
    """Read from the installed TRL (a dev dependency): a GRPOConfig field that is neither one of ppokit's keys (in any
    section) nor in the table would get a close spelling of some other key, as epsilon once did."""
    trl = pytest.importorskip("trl")
    from transformers import TrainingArguments

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = [f.name for f in dataclasses.fields(trl.GRPOConfig) if f.name not in base]
    ppokit_keys = set(_key_paths(PPOConfig))
    assert len(own) > 50, own
    assert [name for name in own if name not in ppokit_keys and name not in TRL_GRPO_NAMES] == []
    # and the table's names are GRPOConfig's or TrainingArguments' (no invented TRL names)
    known = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert [name for name in TRL_GRPO_NAMES if name not in known] == []


def test_the_grpo_names_are_in_docs_trl_side_by_side():
    table = Path(__file__).resolve().parents[1].joinpath("docs", "trl.md").read_text()
    names = list(TRL_GRPO_EQUIVALENTS) + ["warmup_ratio", "mask_truncated_completions", "importance_sampling_level"]
    assert [name for name in names if f"| `{name}`" not in table] == []
    assert [name for name in WITHOUT_EQUIVALENT if f"`{name}`" not in table] == []


def test_the_documented_trl_grpo_defaults_are_a_valid_ppokit_config(tmp_path):
    import yaml

    page = Path(__file__).resolve().parents[1].joinpath("docs", "trl.md").read_text()
    after = page.index("TRL's GRPO defaults as a ppokit config")
    start = page.index("```yaml\n", after) + len("```yaml\n")
    block = yaml.safe_load(page[start:page.index("```", start)])
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(block))
    config = PPOConfig.load(tmp_path / "grpo.yaml", BASE)
    assert (config.ppo.advantage_estimator, config.ppo.num_samples_per_prompt, config.ppo.kl_in_reward) == ("grpo", 8, False)


def test_transformers_warmup_ratio_spelling_is_pointed_at_warmup_ratio():
    with pytest.raises(UserError, match=re.escape("ppo.warmup_steps: expected an integer, got 0.1; a share of the run's steps "
                                                  "(transformers' and TRL's warmup_steps: 0.1) is ppo.warmup_ratio")):
        PPOConfig.load(None, BASE + ["ppo.warmup_steps=0.1"])
