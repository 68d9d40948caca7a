"""Multi-turn episodes: environments that answer the model, tools it can call (docs/environments.md).

    base.py   the Environment protocol, load_environment(spec), EnvironmentRunner (deadlines, checks)
    tools.py  the Hermes/Qwen tool-call parser, loading tools, running one call under a deadline
    builtin.py  the built-in environments: Tools, GuessNumber (the demo game)
"""

from ppokit.environments.base import (
    Environment,
    EnvironmentEpisode,
    EnvironmentFailure,
    EnvironmentRunner,
    EnvironmentTimeout,
    Step,
    load_environment,
)

__all__ = [
    "Environment", "EnvironmentEpisode", "EnvironmentFailure", "EnvironmentRunner", "EnvironmentTimeout", "Step",
    "load_environment",
]
