"""Tools the model calls: loading tools by name, their JSON schemas for the chat template, running one call
under a deadline, and the built-in `Tools` environment. The call formats are in `tool_parsers` (by vLLM's
`--tool-call-parser` names: hermes, qwen3_coder, llama3_json, pythonic, mistral, openai, or auto), e.g. Hermes:

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

Every failure that is the model's (a call that does not parse, an unknown tool, wrong arguments) or the tool's
(it raised, it hung) becomes an error text that goes back to the model as that call's result: the episode goes
on, and the model can learn from it. Only the configuration's mistakes (a tools list that does not import, a tool
without a docstring, an unknown tool_parser) stop the run, in one line, at the start.
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ppokit.environments.python_tool import checked_for_isolation
from ppokit.environments.tool_parsers import PARSER_NAMES, BadToolCall, ToolCall, parse_hermes, resolve_parser
from ppokit.errors import UserError
from ppokit.process.workers import DeadlineExceeded, ThreadCall, code_raised, raised_text
from ppokit.user_code import load_attribute

TOOL_SPEC_FORMS = "'path/to/tools.py:function' or 'package.module:function'"
TOOL_SCHEMAS = ("template", "none")


def parse_tool_calls(completion: str) -> list[Union[ToolCall, BadToolCall]]:
    """The Hermes/Qwen calls of a model turn (`tool_parsers.parse_hermes`); [] when the turn calls nothing."""
    return parse_hermes(completion)


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
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{where}: tool {name}: its schema for the chat template cannot be made: {why} "
                            "(a tool needs type hints and a docstring with an Args: section)") from None
    return schemas


# --------------------------------------------------------------------------- running a call


def run_tool(tools: dict[str, Callable], call: Union[ToolCall, BadToolCall], timeout_s: Optional[float],
             as_text: Optional[Callable[[Any], str]] = None) -> str:
    """The text the model gets back for one call: the tool's result (`as_text`; by default a str as is, anything else
    as JSON, or str() when it is not JSON), or an error text (unknown tool, wrong arguments, the tool raised or
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
    thread = None
    try:
        if timeout_s is None:
            result = fn(**call.arguments)
        else:
            thread = ThreadCall(lambda: fn(**call.arguments), name=f"ppokit-tool-{call.name}")
            result = thread.result(timeout_s)
    except DeadlineExceeded:
        return f"error: {call.name} did not return within {timeout_s:g}s"
    except UserError:  # the user's to fix (a tool that cannot run on this machine), not the model's: the run stops
        raise
    except BaseException as e:  # KeyboardInterrupt and other BaseExceptions the tool raised are its failure too
        if not code_raised(e, thread):
            raise  # a stop request (Ctrl-C) that reached the main thread while it ran the tool
        return f"error: {call.name} raised {raised_text(e)}"
    return (as_text or _as_text)(result)


def _as_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


# --------------------------------------------------------------------------- the built-in environment


@functools.lru_cache(maxsize=16)
def loaded_tools(specs: tuple, base_dir: Optional[str]) -> tuple[dict, list]:
    """Tools and schemas per (tools list, folder): an instance is made per episode, the files are read once."""
    tools = load_tools(list(specs), None if base_dir is None else Path(base_dir))
    return tools, tool_schemas(tools)


def check_call_limits(timeout_s, max_calls) -> None:
    """environment_args.timeout_s (each tool call's deadline) and max_calls (calls run per turn), checked in one line each."""
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not 0 < timeout_s <= threading.TIMEOUT_MAX):
        raise UserError(f"environment_args.timeout_s: expected a number of seconds in (0, {threading.TIMEOUT_MAX:.0f}] "
                        f"(threading.TIMEOUT_MAX: the longest wait Python takes) or null, got {timeout_s!r}")
    if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
        raise UserError(f"environment_args.max_calls: expected an integer >= 1, got {max_calls!r}")


class ToolCalling:
    """What an environment whose model calls tools does with a turn (`Tools`, `TRLEnvironment`): its calls read in the
    run's call format (`parser`, with the tools' `schemas`), run in order (`functions`: name -> callable, each under
    `timeout_s`, at most `max_calls` of a turn; `result_text` makes a result the model's text), and answered with one
    `tool` message each; a turn without a call ends the episode, with reward 0."""

    observation_role = "tool"
    result_text: Optional[Callable[[Any], str]] = None  # None: run_tool's (a str as is, anything else as JSON)

    def step(self, completion: str) -> tuple[Optional[str], float, bool]:
        """completion: the model's turn with its special tokens (a call's markers), without its stop token."""
        calls = self.parser.parse(completion, self.schemas)
        self._messages = []
        if not calls:
            return None, 0.0, True
        for i, call in enumerate(calls):
            name = call.name if call.name is not None else "?"
            if i >= self.max_calls:
                result = f"error: at most {self.max_calls} tool calls run per turn; this one did not"
            else:
                result = run_tool(self.functions, call, self.timeout_s, self.result_text)
            self._messages.append({"role": "tool", "name": name, "content": result})
        text = "\n".join(f"<tool_response>\n{m['content']}\n</tool_response>" for m in self._messages)
        return text, 0.0, False

    def observation_messages(self, observation: str) -> list[dict]:
        """One `tool` message per call of the last step (the chat template groups them)."""
        return list(self._messages)


class Tools(ToolCalling):
    """The built-in environment `ppokit.environments:Tools`: the model calls Python functions.

    environment_args: tools (["file.py:fn", "package.module:fn", ...], required); tool_parser (the call format, by
    vLLM's --tool-call-parser name, default `auto`: the one the chat template writes, said at the start); timeout_s
    (each call's deadline, default 10, at most threading.TIMEOUT_MAX; keep it under environment_timeout_s, which
    bounds a whole step); max_calls (calls run per turn, default 8; the others get an error text); tool_schemas
    (`template`, the default: the chat template writes the tools' schemas into the prompt, so chat prompts are
    needed; `none`: the prompts describe the tools themselves and no schemas are added);
    unsafe_python_without_isolation (default false: a tool that runs the model's code, like run_python, is refused
    where no sandbox can be made; true runs it unisolated there, python_tool.py). Relative file paths are
    looked up from the working directory, then from the config file's folder (`base_dir`, given by the runner, as
    is `chat_template`, the run's template or None for plain-text prompts).

    reset: no observation (the prompt carries the tools: `tools` holds their schemas for the chat template).
    step: runs the turn's calls in order and answers with their results, one `tool` message each; a turn without
    a tool call ends the episode. The reward is always 0: score the transcript with reward functions (they see
    every turn and every tool result).
    """

    def __init__(self, tools=None, timeout_s: Optional[float] = 10.0, max_calls: int = 8, tool_parser: str = "auto",
                 tool_schemas: str = "template", base_dir: Optional[str] = None, chat_template: Optional[str] = None,
                 unsafe_python_without_isolation: bool = False):
        if tools is None:
            raise UserError("environment_args.tools: required by ppokit.environments:Tools (a list of 'file.py:function')")
        check_call_limits(timeout_s, max_calls)
        if tool_schemas not in TOOL_SCHEMAS:
            raise UserError(f"environment_args.tool_schemas: expected one of {', '.join(TOOL_SCHEMAS)}, got {tool_schemas!r}")
        if isinstance(tools, str) or not isinstance(tools, (list, tuple)) or not tools or not all(isinstance(t, str) for t in tools):
            raise UserError(f"environment_args.tools: expected a list of tools ({TOOL_SPEC_FORMS}), got {tools!r}")
        if not isinstance(unsafe_python_without_isolation, bool):
            raise UserError(f"environment_args.unsafe_python_without_isolation: expected true or false, got {unsafe_python_without_isolation!r}")
        functions, schemas = loaded_tools(tuple(tools), None if base_dir is None else str(base_dir))
        self.functions = checked_for_isolation(functions, unsafe_python_without_isolation)
        self.tools = schemas if tool_schemas == "template" else None  # what the chat template gets as `tools=`
        self.schemas = schemas
        self.parser, note = resolve_parser(tool_parser, chat_template)
        self.notes = [note] if note else []
        self.timeout_s = timeout_s
        self.max_calls = max_calls
        self._messages: list[dict] = []

    def reset(self, row: dict) -> None:
        return None


__all__ = ["PARSER_NAMES", "BadToolCall", "ToolCall", "ToolCalling", "Tools", "check_call_limits", "load_tools", "parse_tool_calls", "run_tool", "tool_schemas"]
