"""Tools the model calls: the Hermes/Qwen tool-call parser, loading tools by name, their JSON schemas for
the chat template, running one call under a deadline, and the built-in `Tools` environment.

A model turn calls tools in the Hermes form that Qwen's chat templates teach:

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

several per turn. Every failure that is the model's (JSON that does not parse, an unknown tool, wrong
arguments) or the tool's (it raised, it hung) becomes an error text that goes back to the model as that
call's result: the episode goes on, and the model can learn from it. Only the configuration's mistakes
(a tools list that does not import, a tool without a docstring) stop the run, in one line.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ppokit.environments.python_tool import checked_for_isolation
from ppokit.errors import UserError
from ppokit.rewards.sources import DeadlineExceeded, ThreadCall
from ppokit.user_code import load_attribute

TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
TOOL_SPEC_FORMS = "'path/to/tools.py:function' or 'package.module:function'"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class BadToolCall:
    """A <tool_call> block that is not a call: `error` is the text the model gets back as its result."""

    text: str
    error: str
    name: Optional[str] = None  # the name, when one could be read


def parse_tool_calls(completion: str) -> list[Union[ToolCall, BadToolCall]]:
    """Every <tool_call>...</tool_call> block in a model turn, in order; [] when the turn calls nothing.

    A block must hold one JSON object {"name": str, "arguments": object}; "arguments" may also be a JSON
    string of an object (some models write it so) or absent (no arguments). A block left open at the end
    of the turn (the turn was cut) is a BadToolCall, as is anything else that is not a call.
    """
    calls: list[Union[ToolCall, BadToolCall]] = []
    for match in TOOL_CALL.finditer(completion):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(BadToolCall(body, "error: the tool call is not closed with </tool_call>"))
            continue
        calls.append(_parse_one(body))
    return calls


def _parse_one(body: str) -> Union[ToolCall, BadToolCall]:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return BadToolCall(body, f"error: the tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                                 'write {"name": "TOOL", "arguments": {...}}')
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return BadToolCall(body, 'error: a tool call is a JSON object {"name": "TOOL", "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return BadToolCall(body, f"error: the arguments of {name} must be a JSON object of named arguments", name)
    return ToolCall(name, arguments)


# --------------------------------------------------------------------------- loading and schemas


def load_tools(specs: Any, base_dir: Optional[Path] = None, where: str = "environment_args.tools") -> dict[str, Callable]:
    """["file.py:fn", "package.module:fn", ...] -> {name: function}, in order. A one-line UserError naming
    `where` and the spec when one does not import, is not callable, or two share a name."""
    if isinstance(specs, str) or not isinstance(specs, (list, tuple)) or not specs or not all(isinstance(t, str) for t in specs):
        raise UserError(f"{where}: expected a list of tools ({TOOL_SPEC_FORMS}), got {specs!r}")
    tools: dict[str, Callable] = {}
    for spec in specs:
        name, fn = load_attribute(spec, base_dir, f"{where}: tool", "function", TOOL_SPEC_FORMS)
        if not callable(fn):
            raise UserError(f"{where}: tool {spec!r}: {name} is not a function (its type is {type(fn).__name__})")
        if name in tools:
            raise UserError(f"{where}: two tools are named {name}; the model calls tools by name")
        tools[name] = fn
    return tools


def tool_schemas(tools: dict[str, Callable], where: str = "environment_args.tools") -> list[dict]:
    """The JSON schema of every tool, as transformers' chat templates take them (`tools=`): from each
    function's signature (type hints) and docstring (a summary and an `Args:` section)."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, fn in tools.items():
        try:
            schemas.append(get_json_schema(fn))
        except Exception as e:  # DocstringParsingException, TypeHintParsingException
            raise UserError(f"{where}: tool {name}: its schema for the chat template cannot be made: {e} "
                            "(a tool needs type hints and a docstring with an Args: section)") from None
    return schemas


# --------------------------------------------------------------------------- running a call


def run_tool(tools: dict[str, Callable], call: Union[ToolCall, BadToolCall], timeout_s: Optional[float]) -> str:
    """The text the model gets back for one call: the tool's result (a str as is, anything else as JSON,
    or str() when it is not JSON), or an error text (unknown tool, wrong arguments, the tool raised or
    did not return within `timeout_s` seconds: its thread is left running, Python cannot stop it)."""
    if isinstance(call, BadToolCall):
        return call.error
    fn = tools.get(call.name)
    if fn is None:
        return f"error: there is no tool {call.name!r}; the tools are {', '.join(tools)}"
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as e:
        return f"error: {call.name}: {e}"
    except ValueError:  # a builtin without a signature: let the call say what is wrong
        pass
    try:
        if timeout_s is None:
            result = fn(**call.arguments)
        else:
            result = ThreadCall(lambda: fn(**call.arguments), name=f"ppokit-tool-{call.name}").result(timeout_s)
    except DeadlineExceeded:
        return f"error: {call.name} did not return within {timeout_s:g}s"
    except UserError:  # the user's to fix (a tool that cannot run on this machine), not the model's: the run stops
        raise
    except (Exception, SystemExit) as e:
        return f"error: {call.name} raised {type(e).__name__}: {e}"
    return _as_text(result)


def _as_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


# --------------------------------------------------------------------------- the built-in environment


@functools.lru_cache(maxsize=16)
def _loaded(specs: tuple, base_dir: Optional[str]) -> tuple[dict, list]:
    """Tools and schemas per (tools list, folder): an instance is made per episode, the files are read once."""
    tools = load_tools(list(specs), None if base_dir is None else Path(base_dir))
    return tools, tool_schemas(tools)


class Tools:
    """The built-in environment `ppokit.environments:Tools`: the model calls Python functions.

    environment_args: tools (["file.py:fn", "package.module:fn", ...], required), timeout_s (each call's
    deadline, default 10; keep it under environment_timeout_s, which bounds a whole step), max_calls
    (calls run per turn, default 8; the others get an error text), unsafe_python_without_isolation (default
    false: a tool that runs the model's code, like run_python, is refused where no sandbox can be made;
    true runs it unisolated there, python_tool.py). Relative file paths are looked up from the working
    directory, then from the config file's folder (`base_dir`, given by the runner).

    reset: no observation (the prompt carries the tools: `tools` holds their schemas for the chat
    template). step: runs the turn's calls in order and answers with their results, one `tool` message
    each; a turn without a tool call ends the episode. The reward is always 0: score the transcript
    with reward functions (they see every turn and every tool result).
    """

    observation_role = "tool"

    def __init__(self, tools=None, timeout_s: Optional[float] = 10.0, max_calls: int = 8, base_dir: Optional[str] = None,
                 unsafe_python_without_isolation: bool = False):
        if tools is None:
            raise UserError("environment_args.tools: required by ppokit.environments:Tools (a list of 'file.py:function')")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0):
            raise UserError(f"environment_args.timeout_s: expected a number of seconds > 0 or null, got {timeout_s!r}")
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
            raise UserError(f"environment_args.max_calls: expected an integer >= 1, got {max_calls!r}")
        if isinstance(tools, str) or not isinstance(tools, (list, tuple)) or not tools or not all(isinstance(t, str) for t in tools):
            raise UserError(f"environment_args.tools: expected a list of tools ({TOOL_SPEC_FORMS}), got {tools!r}")
        if not isinstance(unsafe_python_without_isolation, bool):
            raise UserError(f"environment_args.unsafe_python_without_isolation: expected true or false, got {unsafe_python_without_isolation!r}")
        functions, self.tools = _loaded(tuple(tools), None if base_dir is None else str(base_dir))
        self.functions = checked_for_isolation(functions, unsafe_python_without_isolation)
        self.timeout_s = timeout_s
        self.max_calls = max_calls
        self._messages: list[dict] = []

    def reset(self, row: dict) -> None:
        return None

    def step(self, completion: str) -> tuple[Optional[str], float, bool]:
        calls = parse_tool_calls(completion)
        if not calls:
            self._messages = []
            return None, 0.0, True
        self._messages = []
        for i, call in enumerate(calls):
            name = call.name if call.name is not None else "?"
            if i >= self.max_calls:
                result = f"error: at most {self.max_calls} tool calls run per turn; this one did not"
            else:
                result = run_tool(self.functions, call, self.timeout_s)
            self._messages.append({"role": "tool", "name": name, "content": result})
        text = "\n".join(f"<tool_response>\n{m['content']}\n</tool_response>" for m in self._messages)
        return text, 0.0, False

    def observation_messages(self, observation: str) -> list[dict]:
        """One `tool` message per call of the last step (the chat template groups them)."""
        return list(self._messages)
