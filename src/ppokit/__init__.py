"""ppokit: PPO for language models that you can read, resume and trust."""

from ppokit.errors import UserError

__version__ = "0.1.0"

_CONFIG_CLASSES = ("DataConfig", "PPOConfig", "PPOHyperparams", "RewardConfig")


def __getattr__(name):
    # The trainer pulls in transformers and accelerate; import it only when asked for. The config
    # classes load on first use too, so `python -m ppokit.config` runs the module once (no runpy warning).
    if name == "PPOTrainer":
        from ppokit.trainer import PPOTrainer

        return PPOTrainer
    if name in _CONFIG_CLASSES:
        from ppokit import config

        return getattr(config, name)
    raise AttributeError(name)


__all__ = ["PPOConfig", "PPOHyperparams", "RewardConfig", "DataConfig", "PPOTrainer", "UserError", "__version__"]
