"""ppokit: PPO for language models that you can read, resume and trust."""

from ppokit.errors import UserError
from ppokit.version import __version__

__all__ = ["PPOConfig", "PPOHyperparams", "RewardConfig", "DataConfig", "PPOTrainer", "UserError", "__version__"]

_CONFIG_NAMES = ("PPOConfig", "PPOHyperparams", "RewardConfig", "DataConfig")


def __getattr__(name: str):
    # Imported when first asked for. The trainer imports torch and transformers (seconds): only code that uses it
    # pays for it, not `ppokit --help` or `ppokit report`, which import this package too. The config (yaml, the
    # engines' keys: a few tenths of a second) waits too, so that the `ppokit` program acts on Ctrl-C from its first
    # lines (cli.main) rather than after them: until then Python's own handler prints a traceback.
    if name == "PPOTrainer":
        from ppokit.trainer import PPOTrainer

        return PPOTrainer
    if name in _CONFIG_NAMES:
        from ppokit.config import schema as config

        return getattr(config, name)
    raise AttributeError(f"module 'ppokit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
