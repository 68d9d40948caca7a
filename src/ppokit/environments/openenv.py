"""`ppokit.environments:OpenEnv`: an OpenEnv environment (the `openenv-core` package) as a ppokit environment.

    environment: ppokit.environments:OpenEnv
    environment_args: {env: envs/echo.py:EchoEnvironment}          # the Environment class, used in this process
                  or  {base_url: http://localhost:8000}             # a running server, through openenv's client
                  or  {docker_image: echo-env:latest}               # a server started from an image (one per run)
                      action: file.py:make_action                   # optional: text -> Action (or its fields, remotely)
                      observation: file.py:observation_text         # optional: Observation -> str or None
                      reset_columns: [seed, episode_id]             # the row's columns passed to reset, where present
                      env_args: {...}                               # in-process: the class's keyword arguments

One instance per episode (as every ppokit environment): in-process it makes one instance of the class; remotely it is
one WebSocket session of openenv's `GenericEnvClient` (openenv's server makes one Environment per session), opened at
reset, closed by `close()` when the episode ends. The action is made from the model's text: by default the Action's one
`str` field gets the whole text; the observation's text is its one `str` field; `reward` and `done` are the
Observation's. What is decided once per configuration (the class, its action type, the server's schema, a container) is
kept in `_SETUPS`, since the runner makes an instance per episode.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import json
import threading
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

from ppokit.errors import UserError
from ppokit.user_code import load_attribute

SPEC = "ppokit.environments:OpenEnv"
EXTRA = "pip install 'ppokit[openenv]'"
WHERE = ("env", "base_url", "docker_image")
TEXT_TYPES = (str, Optional[str])  # what "a str field" is: an Optional[str] too
SESSION_CLOSE_WAIT_S = 5.0  # how long a session's end waits for the server to close the socket (it does at once)


def import_openenv():
    """The openenv package's pieces this adapter uses; a one-line UserError naming the extra when it is not installed."""
    try:
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.types import Action, Observation
    except ImportError:
        raise UserError(f"environment {SPEC}: the openenv-core package is not installed; {EXTRA}") from None
    return Environment, Action, Observation


@dataclass
class _Setup:
    """What one configuration resolves to, once: in-process the class (`env_class`) and its Action class; remotely the
    server's URL and the text fields of its schema. `make_action(text)`, `observation_text(observation)`."""

    where: str
    make_action: Callable[[str], Any]
    observation_text: Callable[[Any], Optional[str]]
    env_class: Optional[type] = None
    base_url: Optional[str] = None
    notes: tuple = ()


_SETUPS: dict[str, _Setup] = {}
_SETUPS_LOCK = threading.Lock()


class OpenEnv:
    """An OpenEnv `Environment` (in-process, a server, or a Docker image) answering the model; see the module docstring
    and docs/environments.md."""

    def __init__(self, env: Optional[str] = None, base_url: Optional[str] = None, docker_image: Optional[str] = None,
                 action: Optional[str] = None, observation: Optional[str] = None, reset_columns=("seed", "episode_id"),
                 env_args: Optional[dict] = None, base_dir: Optional[str] = None):
        given = {key: value for key, value in zip(WHERE, (env, base_url, docker_image)) if value is not None}
        if len(given) != 1:
            said = ", ".join(given) if given else "none of them"
            raise UserError(f"environment {SPEC}: environment_args needs exactly one of env (FILE.py:Class), base_url or "
                            f"docker_image; got {said}")
        if env_args is not None and env is None:
            raise UserError(f"environment {SPEC}: environment_args.env_args are the keyword arguments of an in-process class "
                            f"(env); a server makes its own instances")
        import_openenv()  # every instance: a missing package is said the same way whatever was set up before
        self.reset_columns = list(reset_columns or [])
        self.env_args = dict(env_args or {})
        key = json.dumps([given, action, observation, base_dir], sort_keys=True)
        with _SETUPS_LOCK:  # the runner makes instances side by side; one setup (one container) per configuration
            setup = _SETUPS.get(key)
            if setup is None:
                setup = _SETUPS[key] = _resolve(given, action, observation, Path(base_dir) if base_dir else None)
        self.setup = setup
        self.notes = list(setup.notes)
        self._env = None  # in-process: the Environment instance; remotely: the client session (opened at reset)
        if setup.env_class is not None:
            try:
                self._env = setup.env_class(**self.env_args)
            except TypeError as e:
                raise UserError(f"environment {SPEC}: {env} (environment_args.env_args {self.env_args}) raised TypeError: {e}") from None

    # ------------------------------------------------------------------ the ppokit protocol

    def reset(self, row: dict):
        wanted = {column: row[column] for column in self.reset_columns if column in row}
        if self.setup.env_class is not None:
            observation = self._env.reset(**_accepted(self._env.reset, wanted))
            return self.setup.observation_text(observation)
        return self._reset_remote(wanted)

    def step(self, completion: str):
        action = self.setup.make_action(completion)
        if self.setup.env_class is not None:
            observation = self._env.step(action)
            return self.setup.observation_text(observation), observation.reward, observation.done
        return self._step_remote(action)

    def close(self):
        env, self._env = self._env, None
        if env is None:
            return None
        return env.close() if self.setup.env_class is not None else _end_session(env)

    # ------------------------------------------------------------------ a server's session

    async def _reset_remote(self, wanted: dict):
        from openenv.core.generic_client import GenericEnvClient

        self._env = GenericEnvClient(base_url=self.setup.base_url)
        result = await self._remote(self._env.reset(**wanted))
        return self.setup.observation_text(result.observation)

    async def _step_remote(self, action):
        result = await self._remote(self._env.step(action))
        return self.setup.observation_text(result.observation), result.reward, result.done

    async def _remote(self, call):
        """A client call. A server at its session capacity sends an error and closes the socket as the session opens; the
        client reads it as a server error, or fails to send on the closed socket with the error still unread: either way
        the run stops in one line (it would refuse every episode beyond its capacity)."""
        from websockets.exceptions import ConnectionClosed

        try:
            return await call
        except RuntimeError as e:
            if "CAPACITY_REACHED" in str(e):
                raise self._refused(str(e)) from None
            raise
        except ConnectionClosed as e:
            said = await _unread_error(self._env)
            if said.get("code") == "CAPACITY_REACHED":
                raise self._refused(f"{said.get('message')}, max_sessions {said.get('max_sessions')}") from None
            raise ConnectionError(f"the OpenEnv server at {self.setup.base_url} closed the session ({e}){_said(said)}") from None
        except ConnectionError as e:  # the server went away mid-run: this episode's failure
            raise ConnectionError(f"{e} (environment_args.base_url: {self.setup.base_url})") from None

    def _refused(self, said: str) -> UserError:
        return UserError(f"environment {SPEC}: the OpenEnv server at {self.setup.base_url} refused a session ({said}); ppokit "
                         "opens one session per episode, up to rollout.max_concurrent_episodes at once, and the server takes at "
                         "most its max_concurrent_envs (1 unless its create_app sets it): set rollout.max_concurrent_episodes "
                         "to that number, or serve it with a larger max_concurrent_envs (its Environment must declare "
                         "SUPPORTS_CONCURRENT_SESSIONS = True for that)")


async def _unread_error(client) -> dict:
    """The error message a server sent before it closed the socket, if one is still unread; {} otherwise."""
    try:
        message = json.loads(await asyncio.wait_for(client._ws.recv(), 1.0))
        return message.get("data", {}) if message.get("type") == "error" else {}
    except Exception:
        return {}


def _said(data: dict) -> str:
    return f": {data.get('message')}" if data.get("message") else ""


async def _end_session(client) -> None:
    """End a server session so that the server logs nothing: send the session's `close` message and wait for the server
    to close the socket, then let the client clean up. (openenv's `EnvClient.close()` sends the message and closes the
    socket at once; the server then fails to send its own close frame and logs a WebSocketDisconnect traceback for
    every session, normal ones included: openenv-core 0.3.0's websocket_endpoint catches only RuntimeError there.)"""
    socket = client._ws  # openenv's client keeps its connection here (None: never connected)
    if socket is not None:
        try:
            await client._send({"type": "close"})
            await asyncio.wait_for(socket.wait_closed(), SESSION_CLOSE_WAIT_S)
        except Exception:  # a connection already gone, or a server that does not close: closed from this side below
            pass
    await client.close()


# ---------------------------------------------------------------------- resolving a configuration


def _resolve(given: dict, action: Optional[str], observation: Optional[str], base_dir: Optional[Path]) -> _Setup:
    Environment, Action, Observation = import_openenv()
    action_fn = _function(action, "action", base_dir)
    observation_fn = _function(observation, "observation", base_dir)
    if "env" in given:
        return _in_process(given["env"], action_fn, observation_fn, base_dir, Environment, Action, Observation)
    base_url = given.get("base_url")
    if base_url is None:
        base_url = _start_container(given["docker_image"])
    base_url = base_url.rstrip("/")
    schema = _server_schema(base_url)
    make_action = action_fn or _text_to_field(_string_fields(schema.get("action", {}), "action"), "action", base_url)
    if observation_fn is not None:
        observation_text = _checked_text(observation_fn)
    else:
        field = _one_field(_string_fields(schema.get("observation", {}), "observation"), "observation", base_url)
        observation_text = lambda fields: _text_of(fields.get(field))  # noqa: E731
    return _Setup("server", make_action, observation_text, base_url=base_url)


def _in_process(spec: str, action_fn, observation_fn, base_dir, Environment, Action, Observation) -> _Setup:
    name, cls = load_attribute(spec, base_dir, "environment_args.env", "class", "'FILE.py:Class' or 'package.module:Class'")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise UserError(f"environment_args.env {spec!r}: {name} is not an OpenEnv Environment class "
                        "(openenv.core.env_server.interfaces.Environment)")
    notes = ()
    if not getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
        notes = (f"environment {SPEC}: {name}.SUPPORTS_CONCURRENT_SESSIONS is False (OpenEnv's default: its server would "
                 "serve one session at a time); in this process each episode has its own instance, up to "
                 "rollout.max_concurrent_episodes at once: set it to 1 if its instances share state",)
    make_action = action_fn
    if make_action is None:
        action_cls = _action_class(cls, Environment, Action)
        if action_cls is None:
            raise UserError(f"environment_args.env {spec!r}: cannot tell {name}'s action type: annotate step(self, action: "
                            f"MyAction) or subclass Environment[MyAction, MyObservation, State], or give environment_args.action "
                            "(FILE.py:function: text -> Action)")
        field = _one_field(_model_string_fields(action_cls), f"action ({action_cls.__name__})", spec)
        make_action = _text_to_model(action_cls, field)
    if observation_fn is not None:
        observation_text = _checked_text(observation_fn)
    else:
        fields: dict[type, str] = {}

        def observation_text(value):
            kind = type(value)
            if kind not in fields:  # per Observation class, once: the class step returns may vary
                fields[kind] = _one_field(_model_string_fields(kind), f"observation ({kind.__name__})", spec)
            return _text_of(getattr(value, fields[kind]))
    return _Setup("in-process", make_action, observation_text, env_class=cls, notes=notes)


def _action_class(cls: type, Environment: type, Action: type) -> Optional[type]:
    """The Action class of an Environment class: step's annotation, else the class's generic arguments."""
    try:
        hint = typing.get_type_hints(cls.step).get("action")
    except Exception:  # a forward reference that does not resolve: try the generics
        hint = None
    if isinstance(hint, type) and issubclass(hint, Action) and hint is not Action:
        return hint
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin, args = typing.get_origin(base), typing.get_args(base)
            if isinstance(origin, type) and issubclass(origin, Environment) and args:
                if isinstance(args[0], type) and issubclass(args[0], Action):
                    return args[0]
    return None


def _model_string_fields(model: type) -> list[str]:
    return [name for name, info in model.model_fields.items() if name != "metadata" and info.annotation in TEXT_TYPES]


def _string_fields(schema: dict, what: str) -> list[str]:
    """The names of a JSON schema's string properties (a `str` or `Optional[str]` field), metadata left out."""

    def is_text(prop: dict) -> bool:
        kinds = [prop.get("type")] + [option.get("type") for option in prop.get("anyOf", [])]
        return "string" in kinds and not {"object", "array", "integer", "number", "boolean"} & set(kinds)

    return [name for name, prop in (schema.get("properties") or {}).items() if name != "metadata" and is_text(prop)]


def _one_field(fields: list[str], what: str, where: str) -> str:
    if len(fields) != 1:
        key = what.split()[0]
        said = f"its str fields are {', '.join(fields)}" if fields else "it has no str field"
        raise UserError(f"environment {SPEC} ({where}): the {what} has not exactly one str field ({said}); give "
                        f"environment_args.{key}: FILE.py:function ({'text -> Action' if key == 'action' else 'Observation -> str or None'})")
    return fields[0]


def _text_to_model(action_cls: type, field: str):
    def make(text: str):
        return action_cls(**{field: text})
    return make


def _text_to_field(fields: list[str], what: str, where: str):
    field = _one_field(fields, what, where)
    return lambda text: {field: text}


def _text_of(value) -> Optional[str]:
    """An observation's text field: None or "" is no observation."""
    return value if value else None


def _function(spec: Optional[str], key: str, base_dir: Optional[Path]):
    """environment_args.action / .observation loaded; a call that raises becomes one line naming the key and the spec."""
    if spec is None:
        return None
    name, fn = load_attribute(spec, base_dir, f"environment_args.{key}", "function", "'FILE.py:function' or 'package.module:function'")
    if not callable(fn):
        raise UserError(f"environment_args.{key} {spec!r}: {name} is not callable")

    def call(value):
        try:
            return fn(value)
        except Exception as e:
            raise ValueError(f"environment_args.{key} {spec} raised {type(e).__name__}: {_one_line(e)}") from None

    return call


def _checked_text(fn):
    def text(observation):
        value = fn(observation)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"environment_args.observation returned a {type(value).__name__}; expected a str or None")
        return value or None
    return text


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _accepted(method, kwargs: dict) -> dict:
    """The keyword arguments `method` accepts (as openenv's server filters reset's: all of them with **kwargs)."""
    parameters = inspect.signature(method).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in parameters}


# ---------------------------------------------------------------------- servers


def _server_schema(base_url: str) -> dict:
    """GET /health, then /schema (action, observation and state JSON schemas); a server that does not answer is one line."""
    for path in ("/health", "/schema"):
        try:
            response = httpx.get(base_url + path, timeout=10)
            response.raise_for_status()
            body = response.content
        except (httpx.HTTPError, OSError, ValueError) as e:
            reason = e
            raise UserError(f"environment {SPEC}: the OpenEnv server at {base_url} does not answer {path} ({reason}); start it, "
                            "or fix environment_args.base_url") from None
    try:
        return json.loads(body)
    except ValueError:
        raise UserError(f"environment {SPEC}: {base_url}/schema did not answer JSON; is it an OpenEnv server?") from None


def _start_container(image: str) -> str:
    """One container of `image` for the whole run (openenv's LocalDockerProvider, as EnvClient.from_docker_image uses it),
    stopped when the process exits; its URL."""
    try:
        from openenv.core.containers.runtime import LocalDockerProvider

        provider = LocalDockerProvider()
    except RuntimeError as e:
        raise UserError(f"environment {SPEC}: environment_args.docker_image {image!r} needs Docker, and `docker version` "
                        f"fails here ({_one_line(e)}); start the image yourself and give environment_args.base_url") from None
    try:
        base_url = provider.start_container(image)
        provider.wait_for_ready(base_url)
    except Exception as e:
        provider.stop_container()
        raise UserError(f"environment {SPEC}: starting the Docker image {image!r} failed: {_one_line(e)}") from None
    atexit.register(provider.stop_container)
    return base_url
