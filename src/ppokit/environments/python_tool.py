"""A built-in tool that runs the model's Python code in a sandbox: `ppokit.environments:run_python`.

    environment: ppokit.environments:Tools
    environment_args: {tools: ["ppokit.environments:run_python"]}

Each call runs the code as `python -I -B main.py` (the trainer's interpreter and packages, read-only) in a
sandbox of its own (sandbox.py: bubblewrap namespaces, a system-call filter, resource limits), with a fresh
empty folder, and answers with what it printed or with `error: ...`. The model's code is hostile input:
nothing in this process or in Python itself is trusted to contain it.

Where the machine cannot isolate it (no bwrap, user namespaces disabled, not Linux), a run that names the
tool stops at start-up with one line saying what is missing (`ppokit ppo` and `ppokit plan`: as soon as the config is
read, before any heavy import or run folder: `check_config`), unless the user opts in with
`environment_args.unsafe_python_without_isolation: true`: then the code runs with the same limits in a
fresh folder on the host, with the trainer's permissions (it can read and write what the trainer can); on Linux
every process it starts ends with the call (sandbox.py's keeper), on macOS its process group.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from ppokit.environments import sandbox
from ppokit.errors import UserError
from ppokit.user_code import load_attribute

WALL_S = 5.0  # below the Tools environment's default per-call deadline (10 s), start-up included
MEMORY_MB = 1024
MAX_OUTPUT_BYTES = 1 << 16
ANSWER_CHARS = 4000  # the most text one call sends back to the model
OPT_IN = "environment_args.unsafe_python_without_isolation"
# One thread for numerical libraries: the sandbox is one process with one thread (its system-call filter).
THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1"}
WHY = {"SIGXCPU": "the CPU time limit", "SIGXFSZ": "the file size limit", "SIGKILL": "a limit, or the code itself",
       "SIGSYS": "a refused system call"}


def execute_python(code: str, wall_s: float = WALL_S, memory_mb: int = MEMORY_MB, max_output_bytes: int = MAX_OUTPUT_BYTES,
                   unsafe_without_isolation: bool = False) -> str:
    """Run `code` in the sandbox and return what the model gets back: its stdout (and stderr), or 'error: ...'
    when it failed, was stopped or ran out of time. Never raises for anything the code does; a UserError
    (the run stops) when this machine cannot isolate it and `unsafe_without_isolation` is not set."""
    problem = sandbox.problem()
    if problem is not None and not unsafe_without_isolation:
        raise UserError(refusal(problem))
    limits = sandbox.Limits(wall_s=wall_s, memory_mb=memory_mb, max_file_bytes=max_output_bytes)
    outcome = sandbox.run([sys.executable, "-I", "-B", "main.py"], limits, files={"main.py": code.encode("utf-8", "surrogatepass")},
                          environment=THREADS, isolated=problem is None)
    stdout, stderr = (text.decode("utf-8", errors="replace") for text in (outcome.stdout, outcome.stderr))
    if outcome.timed_out:
        return _cut(f"error: the code did not finish within {wall_s:g}s" + _tail(stdout, "output so far"))
    name = outcome.signal_name()
    if name is not None:
        return _cut(f"error: the code was stopped by {name} ({WHY.get(name, 'a signal')}) after {outcome.elapsed_s:.1f}s"
                    + _tail(stderr, "stderr"))
    if outcome.status != 0:
        return _cut(f"error: exit status {outcome.status}" + _tail(stderr, "stderr"))
    text = stdout + (f"\n[stderr]\n{stderr}" if stderr.strip() else "")
    return _cut(text if text.strip() else "(no output)")


def run_python(code: str) -> str:
    """Run Python code in a fresh process and return what it printed.

    Args:
        code: a complete Python program; print what you want to see
    """
    return execute_python(code)


def _run_python_unisolated(code: str) -> str:
    return execute_python(code, unsafe_without_isolation=True)


# The tool's twin without isolation: `checked_for_isolation` swaps it in where the user opted in.
run_python.unisolated = _run_python_unisolated


def refusal(problem: str) -> str:
    return (f"the Python tool runs the model's code only in a sandbox, and this machine cannot make one: {problem}; "
            f"to run it without isolation anyway (unsafe: the code can read and write what the trainer can), set {OPT_IN}: true")


TOOLS_ENVIRONMENT = "ppokit.environments:Tools"


def check_config(environment: Optional[str], environment_args: Any, base_dir: Optional[Path] = None) -> None:
    """`checked_for_isolation` from a run's config alone, before any heavy import or run folder (`ppokit ppo` and
    `ppokit plan` call it on the loaded config): the built-in Tools environment naming a tool that runs the model's code,
    on a machine that cannot isolate it, is refused in the same one line. Tools that do not load are left to the
    environment, which says so in its own words when it is made."""
    if environment != TOOLS_ENVIRONMENT or not isinstance(environment_args, dict):
        return
    specs, unsafe = environment_args.get("tools"), environment_args.get("unsafe_python_without_isolation", False)
    if not isinstance(specs, (list, tuple)) or not isinstance(unsafe, bool):
        return
    tools = {}
    for spec in specs:
        try:
            name, fn = load_attribute(spec, base_dir, "environment_args.tools: tool", "function", "'file.py:function'")
        except UserError:
            continue
        tools[name] = fn
    checked_for_isolation(tools, unsafe)


def checked_for_isolation(tools: dict[str, Callable], unsafe_without_isolation: bool) -> dict[str, Callable]:
    """`tools` as they run here, checked at start-up: a tool that runs the model's code (it has an
    `unisolated` twin) needs the sandbox; without one it is refused in one line (UserError naming it and
    the opt-in key) or, with the opt-in, replaced by its twin, said once on stderr."""
    needing = [name for name, fn in tools.items() if callable(getattr(fn, "unisolated", None))]
    problem = sandbox.problem() if needing else None
    if problem is None:
        return tools
    if not unsafe_without_isolation:
        raise UserError(f"environment_args.tools: {', '.join(needing)}: {refusal(problem)}")
    if os.name != "posix":
        raise UserError(f"environment_args.tools: {', '.join(needing)}: {problem}, and even unisolated the Python tool needs a POSIX "
                        "system (its limits are rlimits, its process group is killed after the wall clock): on Windows run ppokit in WSL2")
    _say_unisolated(", ".join(needing), problem)
    return {name: getattr(fn, "unisolated", fn) if name in needing else fn for name, fn in tools.items()}


@functools.lru_cache(maxsize=None)
def _say_unisolated(names: str, problem: str) -> None:
    print(f"ppokit: warning: {names} runs the model's code WITHOUT isolation ({OPT_IN} is true): {problem}", file=sys.stderr)


def _tail(text: str, what: str) -> str:
    text = text.strip()
    return f"\n[{what}]\n{text[-ANSWER_CHARS // 2:]}" if text else ""


def _cut(text: str) -> str:
    return text if len(text) <= ANSWER_CHARS else text[:ANSWER_CHARS] + "\n[cut]"
