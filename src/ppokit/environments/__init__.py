"""Multi-turn episodes: environments that answer the model, tools it can call (docs/environments.md).

    base.py   the Environment protocol, load_environment(spec), EnvironmentRunner (deadlines, checks)
    tools.py  loading tools, their schemas, running a call; the built-in Tools environment
    tool_parsers.py  the tool-call formats by name (hermes, qwen3_coder, llama3_json, pythonic, mistral, openai, auto)
    guess.py  the demo game GuessNumber, its data rows and SFT transcripts
    python_tool.py  run_python: a tool that runs the model's code in the sandbox; the start-up check
    sandbox.py      run a command isolated by the OS (bubblewrap namespaces, a seccomp filter, rlimits)
"""

from ppokit.environments.base import (
    Environment,
    EpisodeEnvironment,
    EnvironmentFailure,
    EnvironmentRunner,
    EnvironmentTimeout,
    Step,
    load_environment,
)
from ppokit.environments.guess import GuessNumber, guess_rows, guess_transcripts
from ppokit.environments.python_tool import execute_python, run_python
from ppokit.environments.tool_parsers import PARSERS, BadToolCall, ToolCall, resolve_parser
from ppokit.environments.tools import Tools, load_tools, parse_tool_calls, run_tool, tool_schemas

__all__ = [
    "Environment", "EpisodeEnvironment", "EnvironmentFailure", "EnvironmentRunner", "EnvironmentTimeout", "Step",
    "load_environment",
    "GuessNumber", "guess_rows", "guess_transcripts",
    "execute_python", "run_python",
    "PARSERS", "BadToolCall", "ToolCall", "resolve_parser",
    "Tools", "load_tools", "parse_tool_calls", "run_tool", "tool_schemas",
]
