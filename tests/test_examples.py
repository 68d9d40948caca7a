"""The recipe configs in examples/ load and pass every check `ppokit ppo` makes before any model loads:
the keys and their ranges, the rules across keys (PPOConfig.validate), the batch arithmetic for the
process count each is meant for, and the reward functions' parameters. Their model and data paths are
placeholders (hub ids, `ppokit sft` / `ppokit rm` outputs), so nothing is loaded."""

from pathlib import Path

import pytest

from ppokit.training.batch_sizes import derive
from ppokit.config.schema import PPOConfig
from ppokit.rewards.scorer import function_source

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {  # file -> processes it is launched with, and what it is a recipe for
    "ppo_reward_model.yaml": (1, lambda c: c.reward.model and c.ppo.advantage_estimator == "gae" and c.value_model is None),
    "grpo_verifiable.yaml": (1, lambda c: c.ppo.advantage_estimator == "grpo" and c.reward.functions and not c.reward.model),
    "lora_shared_critic.yaml": (1, lambda c: c.lora is not None and c.value_model == "shared"),
    "fsdp_8gpu.yaml": (8, lambda c: c.parallel.strategy == "fsdp"),
}


def test_every_recipe_is_checked_and_named_in_the_readme():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.yaml")) == sorted(RECIPES)
    readme = (ROOT / "README.md").read_text()
    assert [name for name in RECIPES if f"examples/{name}" not in readme] == []


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_config_loads_and_validates(name):
    processes, is_that_recipe = RECIPES[name]
    config = PPOConfig.load(ROOT / "examples" / name)
    assert is_that_recipe(config)
    sizes = derive(config.ppo, processes, num_prompts=1000)  # total_episodes is set: the prompt count does not matter
    assert sizes.num_updates >= 100
    for i, entry in enumerate(config.reward.functions):
        function_source(entry, f"reward.functions[{i}]")
