"""`ppokit.environments:GymText`: Gym-style text environments, SkyRL-gym's `BaseTextEnv` and GEM's `Env`, as ppokit
environments.

    environment: ppokit.environments:GymText
    environment_args:
      env: envs/count.py:CountEnv        # a class ('FILE.py:Class' or 'package.module:Class'), a GEM id
                                         # ('game:GuessTheNumber-v0'), or a SkyRL-gym registered id ('gsm8k')
      env_args: {}                       # keyword arguments of the class / of gem.make
      env_config: {}                     # SkyRL-gym: its `env_config` (an OmegaConf DictConfig, as SkyRL passes it)
      extras: {}                         # SkyRL-gym: added to each row's `extras` (SkyRL adds max_turns there)

One instance per episode, made at reset (a SkyRL-gym environment needs its row). Which protocol a class speaks is read
from its methods: `init` and `step` is SkyRL-gym's (`init(prompt) -> (prompt, metadata)`, `step(text) -> {observations,
reward, done, metadata}`), `reset` and `step` without `init` is GEM's (`reset(seed) -> (observation, info)`,
`step(text) -> (observation, reward, terminated, truncated, info)`). Neither package is imported unless an id names one
of its registries or the class's own file imports it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ppokit.errors import UserError
from ppokit.user_code import load_attribute

SPEC = "ppokit.environments:GymText"
EXTRA = "pip install 'ppokit[gym]'"
SKYRL, GEM = "SkyRL-gym", "GEM"


@dataclass
class _Setup:
    """What `env` names, resolved once: the protocol (SKYRL or GEM) and how an instance is made (`make(row) -> env`)."""

    protocol: str
    make: Callable[[dict], Any]
    name: str


_SETUPS: dict[str, _Setup] = {}
_SETUPS_LOCK = threading.Lock()


class GymText:
    """A SkyRL-gym or GEM text environment answering the model; see the module docstring and docs/environments.md."""

    def __init__(self, env: Optional[str] = None, env_args: Optional[dict] = None, env_config: Optional[dict] = None,
                 extras: Optional[dict] = None, reset_columns=("seed",), base_dir: Optional[str] = None):
        if not isinstance(env, str) or not env:
            raise UserError(f"environment {SPEC}: environment_args.env is required: a class ('FILE.py:Class' or "
                            "'package.module:Class'), a GEM id or a SkyRL-gym id")
        key = json.dumps([env, env_args, env_config, extras, base_dir], sort_keys=True, default=str)
        with _SETUPS_LOCK:
            setup = _SETUPS.get(key)
            if setup is None:
                setup = _SETUPS[key] = _resolve(env, dict(env_args or {}), env_config, dict(extras or {}),
                                                Path(base_dir) if base_dir else None)
        self.setup = setup
        self.reset_columns = list(reset_columns or [])
        self._env = None
        self._said: list[dict] = []  # the last observation's messages (SkyRL-gym's observations)

    # ------------------------------------------------------------------ the ppokit protocol

    def reset(self, row: dict) -> Optional[str]:
        self._env = self.setup.make(row)
        if self.setup.protocol == GEM:
            wanted = {column: row[column] for column in self.reset_columns if column in row}
            observation, _info = self._env.reset(**wanted)
            return _text(observation, "reset")
        prompt = _prompt_messages(row)
        returned = self._env.init(prompt)
        messages = returned[0] if isinstance(returned, tuple) else returned
        if not isinstance(messages, list) or messages[: len(prompt)] != prompt:
            raise ValueError(f"{self.setup.name}.init returned a prompt other than the row's ({_short(messages)}); ppokit "
                             "renders the data's prompt, and takes messages init adds after it as the first observation")
        return self._observation(messages[len(prompt):])

    def step(self, completion: str):
        if self.setup.protocol == GEM:
            observation, reward, terminated, truncated, _info = self._env.step(completion)
            return _text(observation, "step"), reward, bool(terminated) or bool(truncated)
        out = self._env.step(completion)
        if not isinstance(out, dict) or not {"observations", "reward", "done"} <= set(out):
            raise ValueError(f"{self.setup.name}.step returned {_short(out)}; expected a dict with observations, reward, done")
        return self._observation(out["observations"] or []), out["reward"], out["done"]

    def observation_messages(self, observation: str) -> list[dict]:
        """SkyRL-gym's observations are chat messages (a `user` or a `tool` message each): rendered as they are."""
        if self.setup.protocol == SKYRL and self._said:
            return [{"role": m["role"], "content": m["content"]} for m in self._said]
        return [{"role": "user", "content": observation}]

    def close(self):
        env, self._env = self._env, None
        close = getattr(env, "close", None)
        return close() if callable(close) else None

    def _observation(self, messages) -> Optional[str]:
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
                                                     for m in messages):
            raise ValueError(f"{self.setup.name}: observations {_short(messages)} are not chat messages ({{role, content}})")
        self._said = list(messages)
        return "\n".join(m["content"] for m in messages) if messages else None


# ---------------------------------------------------------------------- resolving `env`


def _resolve(env: str, env_args: dict, env_config: Optional[dict], extras: dict, base_dir: Optional[Path]) -> _Setup:
    target = env.split(":", 1)[0]
    if ":" in env and (target.endswith(".py") or _is_module(target)):
        name, cls = _load_class(env, base_dir)
        return _class_setup(env, name, cls, env_args, env_config, extras)
    gem = _registry("gem", "gem.envs.registration", "ENV_REGISTRY")
    if gem is not None and env in gem:
        import gem as gem_package

        return _Setup(GEM, lambda row: gem_package.make(env, **env_args), env)
    skyrl = _registry("skyrl_gym", "skyrl_gym.envs.registration", "registry")
    if skyrl is not None and env in skyrl:
        import skyrl_gym

        config = _env_config(env_config)
        return _Setup(SKYRL, lambda row: skyrl_gym.make(env, env_config=config, extras=_extras(row, extras), **env_args), env)
    if gem is None and skyrl is None:
        raise UserError(f"environment {SPEC}: environment_args.env {env!r} is not a class ('FILE.py:Class' or "
                        f"'package.module:Class'), and neither gem-llm nor skyrl-gym is installed to look it up as an id; {EXTRA}")
    where = " or ".join(name for name, registry in (("GEM's", gem), ("SkyRL-gym's", skyrl)) if registry is not None)
    close = _close_names(env, list(gem or []) + list(skyrl or []))
    raise UserError(f"environment {SPEC}: environment_args.env {env!r} is not a class nor an id of {where} registry"
                    f"{'; close: ' + ', '.join(close) if close else ''}")


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _registry(package: str, module: str, attribute: str) -> Optional[dict]:
    """A package's registry of environment ids, or None when the package is not installed (or not importable)."""
    if importlib.util.find_spec(package) is None:
        return None
    try:
        importlib.import_module(package)
        if package == "gem":
            importlib.import_module("gem.envs")  # registers its environments
        return getattr(importlib.import_module(module), attribute)
    except Exception:  # a package that does not import here (a dependency missing): as if it were not installed
        return None


def _load_class(env: str, base_dir: Optional[Path]):
    try:
        name, cls = load_attribute(env, base_dir, "environment_args.env", "class", "'FILE.py:Class' or 'package.module:Class'")
    except UserError as e:
        if "No module named 'skyrl_gym" in str(e) or "No module named 'gem" in str(e):
            raise UserError(f"{e}; {EXTRA}") from None
        raise
    if not isinstance(cls, type):
        raise UserError(f"environment_args.env {env!r}: {name} is not a class")
    return name, cls


def _class_setup(env: str, name: str, cls: type, env_args: dict, env_config: Optional[dict], extras: dict) -> _Setup:
    methods = {m for m in ("init", "reset", "step") if callable(getattr(cls, m, None))}
    if {"init", "step"} <= methods:
        parameters = _parameters(cls)
        config = _env_config(env_config) if "env_config" in parameters else None

        def make(row: dict):
            kwargs = dict(env_args)
            if "env_config" in parameters:
                kwargs.setdefault("env_config", config)
            if "extras" in parameters:
                kwargs.setdefault("extras", _extras(row, extras))
            return cls(**kwargs)

        return _Setup(SKYRL, make, name)
    if {"reset", "step"} <= methods:
        if env_config is not None or extras:
            raise UserError(f"environment {SPEC}: environment_args.env_config and .extras are SkyRL-gym's; {name} is a GEM-style "
                            "environment (reset and step, no init): give its arguments as env_args")
        return _Setup(GEM, lambda row: cls(**env_args), name)
    raise UserError(f"environment_args.env {env!r}: {name} has neither SkyRL-gym's init and step nor GEM's reset and step")


def _parameters(cls: type) -> set[str]:
    try:
        return set(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return set()


def _env_config(env_config: Optional[dict]):
    """SkyRL-gym environments read `env_config` as an OmegaConf DictConfig (attribute access), as SkyRL passes it."""
    from omegaconf import OmegaConf

    return OmegaConf.create(dict(env_config or {}))


def _extras(row: dict, added: dict) -> dict:
    """A SkyRL-gym environment's `extras`: the row's columns but its prompt (as SkyRL's `env_extras`: reward_spec, ...),
    then environment_args.extras."""
    return {**{key: value for key, value in row.items() if key != "prompt"}, **added}


def _prompt_messages(row: dict) -> list[dict]:
    """The row's prompt as chat messages (SkyRL-gym's init takes the conversation): its `messages` without a final
    assistant turn, else the prompt text as one user message."""
    messages = row.get("messages")
    if isinstance(messages, list) and messages:
        return list(messages[:-1] if messages[-1].get("role") == "assistant" else messages)
    return [{"role": "user", "content": row.get("prompt", "")}]


def _text(observation, what: str) -> Optional[str]:
    if observation is None or isinstance(observation, str):
        return observation or None
    raise ValueError(f"{what} returned the observation {_short(observation)} (a {type(observation).__name__}); GymText "
                     "reads text observations")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _close_names(name: str, names: list[str]) -> list[str]:
    import difflib

    return difflib.get_close_matches(name, names, n=3, cutoff=0.6)
