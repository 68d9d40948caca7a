"""Multi-turn episodes: environments that answer the model, tools it can call (docs/environments.md).

    base.py   the Environment protocol, load_environment(spec), EnvironmentRunner (deadlines, checks)
    tools.py  loading tools, their schemas, running a call; the built-in Tools environment
    conversation.py  a run's conversation decided before any weights load: environment, template, renderer, prompts
    trl_environment.py  TRLEnvironment: TRL's environment classes (environment_factory), one or several per run
    tool_parsers.py  the tool-call formats by name (hermes, qwen3_coder, llama3_json, pythonic, mistral, openai, auto)
    guess.py  the demo game GuessNumber, its data rows and SFT transcripts
    gymtext.py  GymText: SkyRL-gym BaseTextEnv classes and GEM environments as ppokit environments
    openenv.py  OpenEnv: an OpenEnv Environment (in-process, a server, a Docker image) as a ppokit environment
    python_tool.py  run_python: a tool that runs the model's code in the sandbox; the start-up check
    sandbox.py      run a command isolated by the OS (bubblewrap namespaces, a system-call filter, rlimits)

The names below are imported when first used, so that reading a config that names one (`ppokit.environments:run_python`,
the sandbox's check) imports only its module, not torch with the rest.
"""

import importlib

_WHERE = {
    "base": ["Environment", "EpisodeEnvironment", "EnvironmentFailure", "EnvironmentRunner", "EnvironmentTimeout", "Step",
             "load_environment"],
    "guess": ["GuessNumber", "guess_rows", "guess_transcripts"],
    "gymtext": ["GymText"],
    "openenv": ["OpenEnv"],
    "python_tool": ["execute_python", "run_python"],
    "tool_parsers": ["PARSERS", "BadToolCall", "ToolCall", "resolve_parser"],
    "tools": ["Tools", "load_tools", "parse_tool_calls", "run_tool", "tool_schemas"],
    "trl_environment": ["TRLEnvironment"],
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
