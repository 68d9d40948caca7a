"""A TRL GRPO config in ppokit: every GRPOConfig name is told the exact ppokit key and value that does the same, or
that there is none; never a close spelling of an unrelated key (num_generations once pointed at
ppo.num_sample_generations, epsilon at ppo.adam_epsilon)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from ppokit.config.schema import PPOConfig
from ppokit.config.fields import key_paths
from ppokit.errors import UserError
from ppokit.config.trl_names import (
    GRPO_ADVICE, GRPO_ONLY_NAMES, LOSS_TYPES, TRAINING_ARGUMENTS_NAMES, TRL_GRPO_EQUIVALENTS, TRL_GRPO_NAMES, WITHOUT_EQUIVALENT,
    Equivalent,
)

BASE = ["model=some/model", "reward.functions=[sentiment]", "data.train=p.jsonl"]


def hint_of(override: str) -> str:
    """The hint of one unknown key: its one line, then (a GRPOConfig name) the line of what GRPO needs besides."""
    with pytest.raises(UserError) as error:
        PPOConfig.load(None, BASE + [override])
    first, *more = str(error.value).split("\n")
    name = override.split("=")[0].split(".")[-1]
    assert more == ([GRPO_ADVICE] if name in GRPO_ONLY_NAMES else []), str(error.value)
    found = re.match(r"unknown config key \S+ \((.*)\); known keys here", first)
    assert found, first
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
    # TRL's vLLM server mode is ppokit's servers placement (issue 47: these once said "no equivalent")
    ("vllm_mode=server", "TRL's GRPO name; ppokit's is rollout.engine: vllm with rollout.placement: servers; with rollout.servers: "
                         "[HOST:PORT], TRL's vllm_server_host and vllm_server_port"),
    ("vllm_server_host=10.0.0.9", "TRL's GRPO name; ppokit's is rollout.servers: [HOST:PORT] with rollout.engine: vllm and "
                                  "rollout.placement: servers (servers you start: docs/rollout.md): HOST is vllm_server_host"),
    ("vllm_server_port=8001", "TRL's GRPO name; ppokit's is rollout.servers: [HOST:PORT] with rollout.engine: vllm and "
                              "rollout.placement: servers (servers you start: docs/rollout.md): HOST is vllm_server_host, PORT vllm_server_port"),
    ("vllm_server_base_url=http://10.0.0.9:8001", "TRL's GRPO name; ppokit's is rollout.engine: vllm with rollout.placement: servers "
                                                  "with rollout.servers: [10.0.0.9:8001]"),
    ("vllm_server_timeout=300", "TRL's GRPO name; ppokit's is rollout.engine: vllm with rollout.placement: servers with "
                                "rollout.server_timeout_s: 300"),
    ("vllm_group_port=51216", "TRL's GRPO name; ppokit has no equivalent: ppokit's weight-transfer group takes a free port"),
    ("disable_dropout=true", "TRL's GRPO name; ppokit always zeroes every dropout probability, in every role; remove the key"),
    ("disable_dropout=false", "TRL's GRPO name; ppokit has no equivalent of false: ppokit always zeroes every dropout probability"),
    ("lr_scheduler_kwargs={min_lr_rate: 0.1}", "TRL's GRPO name; ppokit's is ppo.min_lr_rate: 0.1; with ppo.lr_scheduler_type: "
                                               "cosine_with_min_lr"),
    ("lr_scheduler_kwargs={min_lr: 1e-7}", "TRL's GRPO name; ppokit's is ppo.min_lr_rate (the floor as a share of the peak rate, "
                                           "transformers' min_lr_rate; min_lr / learning_rate)"),
    ("ppo.sync_ref_model=true", "TRL's GRPO name; ppokit has no equivalent"),
    # names ppokit spells the same, in its ppo section
    ("warmup_ratio=0.1", "did you mean ppo.warmup_ratio?"),
    ("mask_truncated_completions=true", "did you mean ppo.mask_truncated_completions?"),
    ("importance_sampling_level=sequence", "did you mean ppo.importance_sampling_level?"),
    ("temperature=1.0", "did you mean ppo.temperature?"),
    ("chat_template_kwargs={enable_thinking: false}", "did you mean data.chat_template_kwargs?"),  # once "no equivalent"
    ("lr_scheduler_type=cosine", "did you mean ppo.lr_scheduler_type?"),
    ("adam_beta1=0.9", "did you mean ppo.adam_beta1?"),
    ("adam_beta2=0.99", "did you mean ppo.adam_beta2?"),
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
    "vllm_server_base_url": ["http://10.0.0.9:8001"], "vllm_server_timeout": [300.0], "lr_scheduler_kwargs": [{"min_lr_rate": 0.1}],
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
            if "rollout.placement" in keys and "rollout.servers" not in keys:
                context = ["rollout.servers=[10.0.0.9:8001]"]
            if "ppo.min_lr_rate" in keys:
                context = ["ppo.lr_scheduler_type=cosine_with_min_lr"]
            config = PPOConfig.load(None, BASE + context + overrides)
            for key, v in equivalent.settings:
                section, _, leaf = key.rpartition(".")
                node = config
                for part in filter(None, section.split(".")):
                    node = getattr(node, part)
                assert getattr(node, leaf) == v, (name, value, key)
            tried += 1
    assert tried >= 33


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
    ppokit_keys = set(key_paths(PPOConfig))
    assert len(own) > 50, own
    assert [name for name in own if name not in ppokit_keys and name not in TRL_GRPO_NAMES] == []
    # and the table's names are GRPOConfig's or TrainingArguments' (no invented TRL names)
    known = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert [name for name in TRL_GRPO_NAMES if name not in known] == []


def test_the_grpo_names_are_in_docs_trl_side_by_side():
    table = Path(__file__).resolve().parents[1].joinpath("docs", "trl.md").read_text()
    names = list(TRL_GRPO_EQUIVALENTS) + ["warmup_ratio", "mask_truncated_completions", "importance_sampling_level", "chat_template_kwargs",
                                          "lr_scheduler_type", "adam_beta1", "adam_beta2", "adam_epsilon"]
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


def test_the_grpo_only_names_are_grpoconfigs_own_not_training_arguments():
    """The names that make a refusal say what GRPO needs besides: GRPOConfig's own, never a TrainingArguments name
    that a TRL PPO config has too."""
    trl = pytest.importorskip("trl")
    from transformers import TrainingArguments

    training_arguments = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert {name for name in TRL_GRPO_NAMES if name in training_arguments} == TRAINING_ARGUMENTS_NAMES
    assert GRPO_ONLY_NAMES == {f.name for f in dataclasses.fields(trl.GRPOConfig)} & set(TRL_GRPO_NAMES) - training_arguments


def test_a_trl_grpo_config_is_refused_a_key_a_line_with_the_grpo_estimator(tmp_path):
    """Issue 47: 18 keys once made one line of 2,000 characters that mapped each key but never said
    ppo.advantage_estimator: grpo; translated as told, the run trained GAE with a critic."""
    import yaml

    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": "m", "num_generations": 8, "beta": 0.04, "learning_rate": 1e-6,
                                    "vllm_mode": "server", "chat_template_kwargs": {"enable_thinking": False}}, sort_keys=False))
    with pytest.raises(UserError) as error:
        PPOConfig.load(path)
    lines = str(error.value).split("\n")
    assert lines[0] == "unknown config keys:"
    assert [line.split(" (")[0] for line in lines[1:7]] == ["  model_name_or_path", "  num_generations", "  beta", "  learning_rate",
                                                            "  vllm_mode", "  chat_template_kwargs"]
    assert lines[-1] == GRPO_ADVICE and "ppo.advantage_estimator: grpo" in GRPO_ADVICE and "from-trl" in GRPO_ADVICE
    assert len(lines) == 8 and max(map(len, lines)) < 300
