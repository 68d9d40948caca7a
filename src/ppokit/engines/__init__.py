"""Rollout engines: what samples the episodes of an update (`base.RolloutEngine`).

`ENGINES` names every engine `rollout.engine` may take, each with where its class lives; `build` makes
one, importing its module only then. Importing this package imports no torch (the config reads ENGINES).

To add an engine: one module here with a class that implements `base.RolloutEngine` and the three
class methods below (`create`, `memory`, `check_installed`, `check`), and one entry in ENGINES.
"""

from __future__ import annotations

from importlib import import_module

from ppokit.engines.base import EngineMemory, EngineSetup, EngineSizing, RolloutEngine, Sampling, training_between_rollouts  # noqa: F401  (torch-free)

# name -> "module:class". Every engine class has
#   create(setup: EngineSetup) -> the engine, reading what it needs of the setup;
#   memory(sizing: EngineSizing) -> EngineMemory: what it holds of its own on the device (all run long, or freed
#     while training) and what sampling needs on top, from config files alone (no engine library imported), for `ppokit plan`.
#   check_installed() -> None, or a UserError saying how to install what the engine needs (before any work).
#   check(model_config, settings, model_name) -> None, or a UserError: what the engine refuses about this model and its
#     `rollout:` keys (check_installed's refusal included), from config files alone; the engine makes the same checks
#     when built, and `ppokit plan` calls this, so that the plan refuses what a run would.
ENGINES = {
    "hf": "ppokit.engines.hf:HFEngine",
    "vllm": "ppokit.engines.vllm:VLLMEngine",
}


def engine_class(name: str) -> type:
    """The class of engine `name` (a key of ENGINES; the config has checked it)."""
    module, _, cls = ENGINES[name].partition(":")
    return getattr(import_module(module), cls)


def check_installed(name: str) -> None:
    """A UserError saying how to install what engine `name` needs, if it is missing: for a command to refuse
    before it does any work (the demo, before its SFT)."""
    engine_class(name).check_installed()


def check(name: str, model_config, settings, model_name: str) -> None:
    """What engine `name` refuses about the model of `model_config` (`model_name`) and the `rollout:` keys (`settings`)."""
    engine_class(name).check(model_config, settings, model_name)


def build(name: str, setup: "EngineSetup") -> "RolloutEngine":
    """The engine `name`, built from what the trainer hands over."""
    return engine_class(name).create(setup)
