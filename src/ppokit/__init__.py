"""ppokit: PPO for language models that you can read, resume and trust."""

from ppokit.config import DataConfig, PPOConfig, PPOHyperparams, RewardConfig
from ppokit.errors import UserError

__version__ = "0.1.0"


def __getattr__(name):
    # The trainer pulls in transformers and accelerate; import it only when asked for.
    if name == "PPOTrainer":
        from ppokit.trainer import PPOTrainer

        return PPOTrainer
    raise AttributeError(name)


__all__ = ["PPOConfig", "PPOHyperparams", "RewardConfig", "DataConfig", "PPOTrainer", "UserError", "__version__"]
