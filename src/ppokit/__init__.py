"""ppokit: PPO for language models that you can read, resume and trust."""

from ppokit.config import DataConfig, PPOConfig, PPOHyperparams, RewardConfig
from ppokit.errors import UserError
from ppokit.trainer import PPOTrainer
from ppokit.version import __version__

__all__ = ["PPOConfig", "PPOHyperparams", "RewardConfig", "DataConfig", "PPOTrainer", "UserError", "__version__"]
