"""ppokit: PPO for language models that you can read, resume and trust."""

from ppokit.config import DataConfig, PPOConfig, PPOHyperparams, RewardConfig
from ppokit.errors import UserError
from ppokit.version import __version__

__all__ = ["PPOConfig", "PPOHyperparams", "RewardConfig", "DataConfig", "PPOTrainer", "UserError", "__version__"]


def __getattr__(name: str):
    # The trainer imports torch and transformers (seconds): only code that uses it pays for it, not
    # `ppokit --help` or `ppokit report`, which import this package too.
    if name == "PPOTrainer":
        from ppokit.trainer import PPOTrainer

        return PPOTrainer
    raise AttributeError(f"module 'ppokit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
