"""The words game (words_rules.py: say at least N words) as a SkyRL-gym BaseTextEnv subclass (N from its `extras`, the
data row's `seed` column) and as a GEM-style environment (N from reset's seed), for tests/test_gymtext.py. Resets and
closes are logged to $PPOKIT_WORDS_LOG, if set."""

from typing import Any, Dict, Optional
from uuid import uuid4

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from words_rules import log, play


class WordsTextEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Dict[str, Any] = {}):
        super().__init__()
        self.id, self.target = uuid4().hex, int(extras["seed"])  # the row's column
        assert env_config.max_turns == extras["max_turns"] == 3  # env_config as a DictConfig; environment_args.extras added
        self.max_turns = env_config.max_turns

    def init(self, prompt):
        log(f"reset {self.id}")
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        reply, reward, done, words = play(self.target, action)
        return BaseTextEnvStepOutput(observations=[] if done else [{"role": "user", "content": reply}], reward=reward, done=done,
                                     metadata={"words": words})

    def close(self):
        log(f"close {self.id}")


class WordsGemEnv:
    """GEM's Env interface (gem.core.Env), duck-typed so that the test runs without gem-llm."""

    def __init__(self):
        self.id, self.target = uuid4().hex, 1

    def reset(self, seed: Optional[int] = None):
        self.target = 1 if seed is None else int(seed)
        log(f"reset {self.id}")
        return "the movie", {}

    def step(self, action: str):
        reply, reward, done, _ = play(self.target, action)
        return reply, reward, done, False, {}

    def close(self):
        log(f"close {self.id}")
