"""TRL's environment classes (`GRPOTrainer(environment_factory=...)`, trl >= 1.16) as a ppokit environment,
`ppokit.environments:TRLEnvironment`, one class or several chosen per row. trl itself is not imported: its protocol is
a few conventions, read here from the user's class.

    environment: ppokit.environments:TRLEnvironment
    environment_args: {factory: "envs/increment.py:IncrementEnv"}            # TRL: environment_factory=IncrementEnv
    environment_args: {factories: {coding: "envs.py:CodingEnv", game: "envs.py:GameEnv"}}   # TRL: a dict of factories
    environment_args: {factory: ..., tools: ["tools.py:search"]}        # TRL: tools=[search] beside the factory

The class (or any callable that makes an instance, as TRL's factory) is called with no arguments once per episode:

    reset(**row) -> str | None   the data row as keyword arguments (with `factories`, without its `environment` column);
                                 a string is appended to the prompt's last message, as TRL does (`reset_appends`)
    public methods               the tools: every function of the class not starting with `_`, other than reset and
                                 get_reward, its JSON schema from its signature and Google-style docstring (TRL's
                                 `inspect.getmembers(type(env), inspect.isfunction)`, in name order); `async def` ones
                                 run on the environments' event loop
    get_reward() -> float        optional, sync or async: called once when the episode ends (however it ended, unless it
                                 failed), the episode's reward from the environment's own state

A model turn is answered as the built-in Tools environment answers it (`tools.ToolCalling`: the run's call format,
each call under `timeout_s`, at most `max_calls` of a turn; a turn without a call ends the episode); a result is the
model's text as TRL makes it, `str(result)`. With `factories`, each row's `environment` column names its class: its
prompt shows that class's tools only (`tools_for`), and its episode's metrics are `env/<name>/...`
(`environment_for`, `environment_names`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ppokit.environments.base import environment_event_loop
from ppokit.environments.tool_parsers import resolve_parser
from ppokit.environments.python_tool import checked_for_isolation
from ppokit.environments.tools import TOOL_SPEC_FORMS, ToolCalling, check_call_limits, loaded_tools, tool_schemas
from ppokit.errors import UserError
from ppokit.user_code import load_attribute

FACTORY_FORMS = "'path/to/env.py:ClassName' or 'package.module:ClassName'"
RESERVED = ("reset", "get_reward")  # TRL's lifecycle methods: never tools
CHOICE_COLUMN = "environment"  # TRL's column that chooses a row's environment among several


@dataclass(frozen=True)
class Factory:
    """One environment class as TRL reads it: what makes an instance, its class's name, its tools' method names (in
    TRL's order) and schemas, whether it owns a reward (`get_reward`)."""

    make: Callable[[], Any]
    name: str
    methods: tuple[str, ...]
    schemas: tuple
    rewards: bool


@functools.lru_cache(maxsize=32)
def _factory(spec: str, base_dir: Optional[str], where: str) -> Factory:
    """The class `spec` names, read once per spec (an instance is made per episode; the file is executed once): one
    instance is made now, as TRL probes each factory, and its class's functions are read."""
    name, make = load_attribute(spec, None if base_dir is None else Path(base_dir), f"{where}:", "class", FACTORY_FORMS)
    if not callable(make):
        raise UserError(f"{where}: {spec!r}: {name} is not a class (its type is {type(make).__name__}); an instance per episode is made as {name}()")
    try:
        probe = make()
    except Exception as e:  # noqa: BLE001 - the user's constructor: its failure is one line at start
        raise UserError(f"{where}: {spec!r}: making an instance, {name}(), raised {type(e).__name__}: {e}") from None
    functions = dict(inspect.getmembers(type(probe), predicate=inspect.isfunction))  # the class's, not the instance's: no property runs
    if "reset" not in functions:
        raise UserError(f"{where}: {spec!r}: {type(probe).__name__} has no reset method; TRL's environment classes define "
                        "reset(**row) -> str | None (docs/environments.md)")
    methods = tuple(m for m in functions if not m.startswith("_") and m not in RESERVED)
    schemas = tool_schemas({m: getattr(probe, m) for m in methods}, where=f"{where}: {spec}")
    return Factory(make, type(probe).__name__, methods, tuple(schemas), "get_reward" in functions)


def _on_event_loop(method):
    """An `async def` tool as a function that runs it to its end on the environments' event loop (the one every
    `async def` reset and step of a run shares), so that a call waits for its result; others as they are."""
    if not inspect.iscoroutinefunction(method):
        return method

    @functools.wraps(method)  # keeps the signature the call's arguments are checked against
    def call(*args, **kwargs):
        return asyncio.run_coroutine_threadsafe(method(*args, **kwargs), environment_event_loop()).result()

    return call


class TRLEnvironment(ToolCalling):
    """TRL's environment classes: `ppokit.environments:TRLEnvironment` (see the module docstring).

    environment_args: factory ("file.py:Class": one class for every row) or factories ({name: "file.py:Class", ...}: each
    row's `environment` column chooses one); tools (["file.py:function", ...], TRL's standalone `tools`: functions every
    class's episodes can call besides its methods; unsafe_python_without_isolation as for Tools); tool_parser (the call
    format, by vLLM's --tool-call-parser name, default `auto`: the one the chat template writes); timeout_s (each tool
    call's deadline, default 10); max_calls (calls run per turn, default 8). base_dir and chat_template come from the
    runner (the config file's folder; the run's template).

    One instance per episode (its reset, its turns' calls, its get_reward); `get_reward` is 0 for a class without one.
    """

    reset_appends = True  # reset's text goes at the end of the prompt's last message (TRL's), not in a message of its own

    def __init__(self, factory: Optional[str] = None, factories: Optional[dict] = None, tools: Optional[list] = None,
                 tool_parser: str = "auto", timeout_s: Optional[float] = 10.0, max_calls: int = 8,
                 unsafe_python_without_isolation: bool = False, base_dir: Optional[str] = None, chat_template: Optional[str] = None):
        if (factory is None) == (factories is None):
            raise UserError("environment_args: ppokit.environments:TRLEnvironment takes factory ('file.py:Class', TRL's "
                            "environment_factory) or factories ({name: 'file.py:Class', ...}, each row's environment column "
                            f"choosing one), exactly one of them; got {'both' if factory is not None else 'neither'}")
        check_call_limits(timeout_s, max_calls)
        folder = None if base_dir is None else str(base_dir)
        if factory is not None:
            if not isinstance(factory, str):
                raise UserError(f"environment_args.factory: expected {FACTORY_FORMS}, got {factory!r}")
            self.factories = {None: _factory(factory, folder, "environment_args.factory")}
        else:
            if not isinstance(factories, dict) or not factories or not all(isinstance(k, str) and isinstance(v, str) for k, v in factories.items()):
                raise UserError(f"environment_args.factories: expected a mapping of names to {FACTORY_FORMS}, got {factories!r}")
            self.factories = {name: _factory(spec, folder, f"environment_args.factories.{name}") for name, spec in factories.items()}
        self.environment_names = [name for name in self.factories if name is not None]
        if tools is not None and (isinstance(tools, str) or not isinstance(tools, (list, tuple)) or not all(isinstance(t, str) for t in tools)):
            raise UserError(f"environment_args.tools: expected a list of tools ({TOOL_SPEC_FORMS}), got {tools!r}")
        if not isinstance(unsafe_python_without_isolation, bool):
            raise UserError(f"environment_args.unsafe_python_without_isolation: expected true or false, got {unsafe_python_without_isolation!r}")
        standalone, standalone_schemas = loaded_tools(tuple(tools), folder) if tools else ({}, [])
        self.standalone = checked_for_isolation(standalone, unsafe_python_without_isolation)
        # a class's tools: the standalone ones, then its methods (TRL's `tools + methods`; a method wins a shared name)
        self.schemas_of = {name: list({s["function"]["name"]: s for s in [*standalone_schemas, *f.schemas]}.values())
                           for name, f in self.factories.items()}
        # every class's tools, once each by name: what the start-up checks of the chat template read (a prompt gets its own)
        self.tools = list({s["function"]["name"]: s for schemas in self.schemas_of.values() for s in schemas}.values()) or None
        self.parser, note = resolve_parser(tool_parser, chat_template)
        self.notes = [note] if note else []
        self.timeout_s, self.max_calls = timeout_s, max_calls
        self.result_text = str  # TRL's: str(result)
        self.env, self.schemas, self.functions, self._messages = None, [], {}, []
        self._factory: Optional[Factory] = None

    # ------------------------------------------------------------------ which class a row uses

    def environment_for(self, row: dict) -> Optional[str]:
        """The name of the class a row's episode uses (its `environment` column), None with one `factory`; a UserError
        in one line for a row that names none or one that is not among `factories`."""
        if not self.environment_names:
            return None
        names = ", ".join(self.environment_names)
        name = row.get(CHOICE_COLUMN)
        if name is None:  # a data file's row without the column reads as None (the columns are every row's)
            raise UserError(f"the row has no {CHOICE_COLUMN} column, which chooses its environment among "
                            f"environment_args.factories ({names})")
        if name not in self.environment_names:
            raise UserError(f"the row's {CHOICE_COLUMN} {name!r} is not one of environment_args.factories ({names})")
        return name

    def tools_for(self, row: dict) -> Optional[list[dict]]:
        """The tools a row's prompt shows: its class's only (None: a class without public methods)."""
        return list(self.schemas_of[self.environment_for(row)]) or None

    # ------------------------------------------------------------------ one episode

    def reset(self, row: dict):
        """A new instance of the row's class, reset on the row (TRL's keyword arguments); its text, or None."""
        try:
            name = self.environment_for(row)
        except UserError as e:  # a row the start-up did not see (a dataset given later): its episode fails, in this line
            raise ValueError(str(e)) from None
        self._factory = factory = self.factories[name]
        self.env = factory.make()
        self.functions = {**{n: _on_event_loop(f) for n, f in self.standalone.items()},
                          **{m: _on_event_loop(getattr(self.env, m)) for m in factory.methods}}
        self.schemas = list(self.schemas_of[name])
        arguments = {k: v for k, v in row.items() if k != CHOICE_COLUMN} if self.environment_names else dict(row)
        return self.env.reset(**arguments)

    def get_reward(self):
        """The episode's reward from the instance's state (its class's get_reward, sync or async), 0 without one."""
        return self.env.get_reward() if self._factory is not None and self._factory.rewards else 0.0

    @property
    def gives_rewards(self) -> bool:
        """Whether any of its classes scores its episodes (get_reward); without one, reward functions must."""
        return any(f.rewards for f in self.factories.values())
