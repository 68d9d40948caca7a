"""The words game of openenv_words.py (say at least N words: `good`, reward 1, done; else `bad`, reward words / 10) as a
SkyRL-gym BaseTextEnv subclass (N from its `extras`, the data row's `seed` column) and as a GEM-style environment
(N from reset's seed), for tests/test_gymtext.py. Resets and closes are logged to $PPOKIT_GYM_LOG, if set."""

import os
from typing import Any, Dict, Optional
from uuid import uuid4

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


def log(line: str) -> None:
    path = os.environ.get("PPOKIT_GYM_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


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
        words = len(action.split())
        if words >= self.target:
            return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={"words": words})
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": "bad"}], reward=words / 10, done=False,
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
        words = len(action.split())
        if words >= self.target:
            return "good", 1.0, True, False, {}
        return "bad", words / 10, False, False, {}

    def close(self):
        log(f"close {self.id}")
