"""Preflight for a PPO run: parameters, memory and batch sizes, with no weights loaded.

Every model is built on the meta device from its config.json (no weights are read, no memory
is allocated) to count parameters; LoRA adapters are added the same way, so trainable counts
are exactly what the trainer will optimise. The memory formulas are in docs/memory.md.

The estimate is persistent memory (weights, gradients, optimiser state of every role) plus the
largest of three phases that never overlap: sampling (KV cache), the no-gradient forwards
(reference, value, reward) and training (policy and value activations of one micro-batch), plus
what the rollout engine holds of its own during each (`engines.EngineMemory`: vLLM's weight copy and
KV cache). A sequence is the longest prompt + the room after it: ppo.response_length, or a multi-turn
episode's budget (`PPOConfig.response_room`, as the trainer reads it).

It is per device, for `processes` processes (WORLD_SIZE, or `ppokit plan --processes N`), under
both parallel strategies: ddp holds every role whole on each device; fsdp holds 1/N of each
sharded role (the trainable ones always, the frozen ones with parallel.shard_frozen) and, while a
phase runs, the units FSDP gathers whole (`Sharding`).

Before the estimate, the run's own start-up checks (`startup.prepare`: this machine, the prompts, the output folder, the
token budget, the reward functions; no weights, nothing written): what `ppokit ppo` would refuse is the plan's first
stop, in the same words, and `ppokit plan` exits 2 on it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ppokit import engines
from ppokit.training.batch_sizes import BatchSizes, derive
from ppokit.config.schema import LoraConfig, PPOConfig
from ppokit.environments.conversation import conversation_for
from ppokit.errors import UserError
from ppokit.process.launcher import launched_processes
from ppokit.models.loading import load_tokenizer, position_limit, prompt_room, resolve_model_path, same_vocabulary, tightest
from ppokit.process.parallel import backward_separately
from ppokit.data.lengths import encode_prompts
from ppokit.data.prompts import as_prompt_dataset
from ppokit.data.reasoning_gym import is_gym_spec
from ppokit.models.adapters import peft_lora_config
from ppokit.models.roles import (
    CRITIC_ON_REWARD,
    CRITIC_OWN,
    CRITIC_SHARED,
    REFERENCE_BASE,
    REFERENCE_OWN,
    RoleLayout,
    decide_roles,
)
from ppokit.training.startup import prepare
from ppokit.process.strategies import DEFAULT as DEFAULT_STRATEGY, SHARDING, STRATEGIES

GiB = 1024**3
HEADROOM = 0.9  # CUDA context, allocator fragmentation and framework buffers are not counted
DEFAULT_PROMPT_LENGTH = 128
# Bytes per weight of a quantised linear layer: NF4 with double quantisation stores 4 bits, an
# 8-bit absmax per 64-weight block and an fp32 scale per 256 blocks; LLM.int8 one byte (+ a row scale).
QUANTIZED_BYTES = {"4bit": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0}
# Activation elements stored per token per layer for backward: about 8 x hidden (norm inputs and
# outputs, q/k/v, attention output, residual stream) + 4 x intermediate (MLP up, gate, activation,
# product). Attention probabilities are not stored with SDPA/flash attention.
ACT_HIDDEN_FACTOR, ACT_INTERMEDIATE_FACTOR = 8, 4
LOGIT_COPIES = 4  # logits, logits / T, log-softmax, entropy terms: float32, (R + 1) positions
LIGHT_HEAD_COPIES = 2  # the memory-light head: a chunk's logits and their gradient (logprobs.head_logprobs_and_entropy)


@dataclass
class RoleEstimate:
    """One role's share of memory, in bytes. `params` counts weights this role holds itself."""

    role: str
    source: str
    params: int
    trainable: int
    weights: int
    gradients: int
    optimizer: int
    activations: int  # training activations of one micro-batch (0 for frozen roles)

    @property
    def persistent(self) -> int:
        return self.weights + self.gradients + self.optimizer


@dataclass
class Sharding:
    """What fsdp changes per device: `processes` shards, and the whole units gathered during each phase.

    gathered (bytes, per phase): sampling holds the whole policy when parallel.unshard_for_generation
    (else one layer); a forward holds two decoder layers (one running, one prefetched) and the
    model's root unit (embeddings, final norm, head); training holds the same twice (the unit's
    weights and its unsharded gradients before they are reduce-scattered).
    """

    processes: int = 1
    shard_frozen: bool = True
    cpu_offload: bool = False
    gathered: dict = field(default_factory=dict)

    def per_device(self, role: "RoleEstimate", strategy: str) -> int:
        """The role's weights + gradients + optimiser state on one device under `strategy`."""
        if not STRATEGIES[strategy].shards or not (role.trainable or self.shard_frozen):
            return role.persistent
        if self.cpu_offload:
            return 0  # shards live in host memory; only gathered units reach the device
        return -(-role.persistent // self.processes)


@dataclass
class Plan:
    roles: list[RoleEstimate]
    phases: dict[str, int]  # bytes at the peak of each phase, on top of persistent memory
    sizes: Optional[BatchSizes]
    sequence: dict[str, int]
    device: str
    device_memory: int
    warnings: list[str] = field(default_factory=list)
    suggestion: Optional[str] = None
    layout: Optional[RoleLayout] = None  # which model plays which role (roles.decide_roles)
    # What `ppokit ppo` will refuse with its own one-line error (so its preflight does not repeat them).
    stops: list[str] = field(default_factory=list)
    strategy: str = DEFAULT_STRATEGY  # parallel.strategy of the config: what `total` and `fits` are for
    sharding: Sharding = field(default_factory=Sharding)
    sharding_suggestion: Optional[str] = None  # "parallel.strategy: fsdp with N processes (...)"
    rollback: str = "off"  # ppo.nonfinite_rollback: where the copy of each update's start goes (host memory, disk, none)
    engine: engines.EngineMemory = field(default_factory=engines.EngineMemory)  # the rollout engine's own memory

    def rollback_bytes(self) -> int:
        """The copy ppo.nonfinite_rollback memory/disk makes before every update, per process: the trainable
        weights and their AdamW moments (each process its shard under fsdp); 0 when off."""
        if self.rollback == "off":
            return 0
        copy = sum(r.gradients + r.optimizer for r in self.roles)  # gradients: one trainable weight's bytes each
        return -(-copy // self.sharding.processes) if STRATEGIES[self.strategy].shards else copy

    def total_for(self, strategy: str) -> int:
        """Peak bytes on one device under `strategy` with `sharding.processes` processes."""
        persistent = sum(self.sharding.per_device(r, strategy) for r in self.roles)
        gathered = self.sharding.gathered if STRATEGIES[strategy].shards else {}
        return persistent + max(v + gathered.get(k, 0) + self.engine.during(k) for k, v in self.phases.items())

    @property
    def total(self) -> int:
        return self.total_for(self.strategy)

    @property
    def fits(self) -> bool:
        return self.total <= HEADROOM * self.device_memory

    def to_dict(self) -> dict:
        return {
            "roles": [dataclasses.asdict(r) for r in self.roles],
            "phases": self.phases,
            "total_bytes": self.total,
            "device": self.device,
            "device_memory_bytes": self.device_memory,
            "fits": self.fits,
            "sizes": self.sizes._asdict() if self.sizes else None,
            "sequence": self.sequence,
            "warnings": self.warnings,
            "stops": self.stops,
            "suggestion": self.suggestion,
            "layout": dataclasses.asdict(self.layout) if self.layout else None,
            "strategy": self.strategy,
            "processes": self.sharding.processes,
            "per_device": {
                strategy: {"total_bytes": self.total_for(strategy), "fits": self.total_for(strategy) <= HEADROOM * self.device_memory,
                           "roles": {r.role: self.sharding.per_device(r, strategy) for r in self.roles}}
                for strategy in STRATEGIES
            },
            "sharding_suggestion": self.sharding_suggestion,
            "rollback": {"mode": self.rollback, "bytes_per_process": self.rollback_bytes()},
            "engine": dataclasses.asdict(self.engine),
        }

    def render(self) -> str:
        """The table `ppokit plan` prints."""
        n = self.sharding.processes
        lines = [f"{'role':<10} {'params':>9} {'trainable':>9} {'weights':>9} {'grads':>9} {'optim':>9} {'activ.':>9} "
                 + "".join(f"{s + '/dev':>9} " for s in STRATEGIES) + " source"]
        for r in self.roles:
            lines.append(
                f"{r.role:<10} {_count(r.params):>9} {_count(r.trainable):>9} {_gib(r.weights):>9} {_gib(r.gradients):>9} "
                f"{_gib(r.optimizer):>9} {_gib(r.activations):>9} "
                + "".join(f"{_gib(self.sharding.per_device(r, s)):>9} " for s in STRATEGIES) + f" {r.source}"
            )
        if self.engine.what and not self.engine.held:  # it holds nothing on this device (its memory is elsewhere)
            lines.append(self.engine.what)
        elif self.engine.what:
            lines.append(f"{self.engine.what}: {_gib(self.engine.held)} per device"
                         + (", not during training" if self.engine.released_for_training else ", all run long"))
        lines.append(f"per device with {n} process{'' if n == 1 else 'es'} (weights + grads + optim; fsdp adds the units it gathers): "
                     + ", ".join(f"{s} {_gib(self.total_for(s))} peak" for s in STRATEGIES))
        lines.append("phases (on top of weights, gradients and optimiser state): "
                     + ", ".join(f"{k} {_gib(v)}" for k, v in self.phases.items())
                     + "; fsdp gathers whole units on top: " + ", ".join(f"{k} {_gib(v)}" for k, v in self.sharding.gathered.items()))
        seq = self.sequence
        lines.append(f"sequence: prompt <= {seq['prompt']} + {seq['room']} {seq['response']} tokens; micro-batch {seq['micro_batch']}, "
                     f"forward chunk {seq['forward_chunk']}; training micro-batch <= {seq['micro_batch_tokens']} tokens, "
                     f"LM head {seq['lm_head_positions']} positions at a time")
        if self.sizes:
            s = self.sizes
            lines.append(f"batches: micro {s.micro_batch}, rollout batch {s.batch} (per process {s.local_batch}), minibatch "
                         f"{s.local_mini_batch}, {s.total_episodes} episodes = {s.num_updates} update{'' if s.num_updates == 1 else 's'}")
        if self.rollback != "off":
            where = "host memory" if self.rollback == "memory" else "the run folder, rewritten every update"
            lines.append(f"non-finite rollback (ppo.nonfinite_rollback: {self.rollback}): {_gib(self.rollback_bytes())} per process "
                         f"in {where}, not on the device")
        lines.append(self.summary())
        lines.extend(f"warning: {w}" for w in self.warnings)
        lines.extend(f"error: {w}" for w in self.stops)
        if self.sharding_suggestion:
            lines.append(f"would fit with: {self.sharding_suggestion}")
        if self.suggestion:
            lines.append(f"would fit with: {self.suggestion}")
        return "\n".join(lines)

    def summary(self) -> str:
        verdict = "fits" if self.fits else "DOES NOT FIT"
        n = self.sharding.processes
        per_device = f"; {self.strategy}, per device of {n} process{'es' if n > 1 else ''}" if n > 1 or self.strategy != DEFAULT_STRATEGY else ""
        # The share said in words: "22.9M of 23.54G" read as nearly full at a glance.
        return (f"estimated peak {_gib(self.total)}: {_share(self.total, self.device_memory)} of {_gib(self.device_memory)} "
                f"({self.device}{per_device}, {int(HEADROOM * 100)}% usable): {verdict}")


def _host_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}G" if n >= GiB / 10 else f"{n / 1024**2:.1f}M"


def _share(part: float, whole: float) -> str:
    """`part` as a percentage of `whole`; a small share is never rounded to 0%."""
    share = 100 * part / whole
    return "under 0.1%" if 0 < share < 0.1 else f"{share:.1f}%" if share < 10 else f"{share:.0f}%"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


# --------------------------------------------------------------------------- device


def device_memory() -> tuple[str, int]:
    """(description, bytes): the CUDA device's memory if there is one, else the system's RAM."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"cuda:0 {props.name}", props.total_memory
    return "cpu RAM", _host_memory() or 16 * GiB


# --------------------------------------------------------------------------- models on meta


def _auto_config(name: str, role: str, trust_remote_code: bool):
    from transformers import AutoConfig

    path = resolve_model_path(name, role)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"{role}: could not read the config of {name!r}: {str(e).splitlines()[0]}") from None


_STATS: dict = {}


def _stats(model_config, scalar: bool, dtype: torch.dtype, quantization: Optional[str],
           lora: Optional[LoraConfig] = None, task_type: Optional[str] = None, trust_remote_code: bool = False) -> tuple[int, int, int]:
    """(parameters, weight bytes, adapter parameters) of a model built on meta; memoised, since
    suggestions re-estimate the same models under several switches."""
    key = (model_config.to_json_string(), scalar, dtype, quantization, repr(lora), task_type, trust_remote_code)
    if key not in _STATS:
        meta = _meta_model(model_config, scalar, trust_remote_code)
        params = sum(p.numel() for _, p in _unique_params(meta))
        weights = _weight_bytes(meta, dtype, quantization)
        adapter = _adapter_count(meta, lora, task_type) if lora is not None else 0
        _STATS[key] = (params, weights, adapter)
    return _STATS[key]


def _meta_model(model_config, scalar: bool, trust_remote_code: bool = False) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    model_config = copy.deepcopy(model_config)
    if scalar:
        model_config.num_labels = 1
        if model_config.pad_token_id is None:
            model_config.pad_token_id = 0
    cls = AutoModelForSequenceClassification if scalar else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            # The config's own choice, always given: left unset, transformers asks on the terminal for a model with custom code.
            model = cls.from_config(model_config, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise UserError(f"cannot build a {model_config.model_type} model as {cls.__name__}: {str(e).splitlines()[0]}") from None
    # Tied input and output embeddings are one tensor, as in the model that loads: transformers 5.0.0 builds them untied
    # on meta (the LM head counted twice: 262M parameters too many for Llama-3.2-1B); from 5.1 on this changes nothing.
    model.tie_weights()
    return model


def _dtype(model_config) -> torch.dtype:
    dtype = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, torch.float32)
    return dtype


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    seen, out = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _weight_bytes(model: nn.Module, dtype: torch.dtype, quantization: Optional[str]) -> int:
    """Bytes of the base weights; quantised linear layers (not the output heads) at QUANTIZED_BYTES."""
    quantized_ids = set()
    if quantization is not None:
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith(("lm_head", "score", "classifier")):
                quantized_ids.add(id(module.weight))
    total = 0.0
    for _, p in _unique_params(model):
        total += p.numel() * (QUANTIZED_BYTES[quantization] if id(p) in quantized_ids else _bytes(dtype))
    return int(total)


def _adapter_count(model: nn.Module, lora: LoraConfig, task_type: str) -> int:
    """Trainable parameters once peft adds the adapter (on meta: nothing is allocated)."""
    import warnings

    from peft import get_peft_model  # an optional dependency (the lora extra)

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            adapted = get_peft_model(model, peft_lora_config(lora, task_type))
        except ValueError as e:
            raise UserError(f"lora.target_modules: {str(e).splitlines()[0]}") from None
    return sum(p.numel() for _, p in _unique_params(adapted) if p.requires_grad)


# --------------------------------------------------------------------------- activation formulas


def _dims(model_config) -> dict:
    c = model_config.get_text_config()
    hidden = c.hidden_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    intermediate = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden
    return dict(hidden=hidden, layers=c.num_hidden_layers, kv=kv_heads * head_dim, intermediate=intermediate, vocab=c.vocab_size)


def train_activation_bytes(dims: dict, tokens: int, act_bytes: int, checkpointing: bool) -> int:
    """Stored backbone activations of one forward+backward over a micro-batch of `tokens` token positions
    (rows x their width; with ppo.max_tokens_per_micro_batch, at most the budget) (docs/memory.md)."""
    per_layer = tokens * (ACT_HIDDEN_FACTOR * dims["hidden"] + ACT_INTERMEDIATE_FACTOR * dims["intermediate"]) * act_bytes
    if checkpointing:
        return dims["layers"] * tokens * dims["hidden"] * act_bytes + per_layer  # layer inputs + one layer recomputed
    return dims["layers"] * per_layer


def training_activations(roles, processes: int) -> int:
    """The training phase's activations: the larger of the policy's and the critic's where they are
    back-propagated one after the other (`parallel.backward_separately`: one process), else their sum."""
    activations = [r.activations for r in roles]
    return max(activations) if backward_separately(processes) else sum(activations)


def lm_head_bytes(dims: dict, positions: int, chunk: Optional[int], copies: Optional[int] = None) -> int:
    """float32 tensors over the vocabulary for `positions` response positions of one pass: all of them at once
    (the direct computation, LOGIT_COPIES of them), or one chunk of lm_head_chunk_size tokens at a time (the
    memory-light head, LIGHT_HEAD_COPIES)."""
    if copies is None:
        copies = LIGHT_HEAD_COPIES if chunk else LOGIT_COPIES
    return copies * (min(positions, chunk) if chunk else positions) * dims["vocab"] * 4


def inference_bytes(dims: dict, rows: int, seq: int, act_bytes: int, logits_positions: int, chunk: Optional[int] = None) -> int:
    """Peak of one no-gradient forward: a layer's transient tensors and the float32 logits."""
    layer = rows * seq * (ACT_HIDDEN_FACTOR * dims["hidden"] + ACT_INTERMEDIATE_FACTOR * dims["intermediate"]) * act_bytes
    return layer + lm_head_bytes(dims, rows * logits_positions, chunk, copies=2)


def micro_batch_shape(config: PPOConfig, seq: int, room: int) -> tuple[int, int]:
    """(token positions, response positions through the LM head) of the largest training micro-batch of rows of
    `seq` tokens, `room` of them after the prompt: per_device_train_batch_size longest rows, or with a token budget
    at most the budget and at most the whole minibatch it packs (per_device_train_batch_size x
    gradient_accumulation_steps longest rows; every position a response position, at worst). ppo.padding_free changes
    neither: at worst every episode is the longest, one to a packed row, as in a padded micro-batch. ppo.shared_prompt
    (no budget) counts each group's prompt once: rows / n groups of one prompt and n responses (its 4-D mask, a byte
    per pair of positions of a group, is not counted)."""
    hp = config.ppo
    rows = hp.per_device_train_batch_size
    if hp.max_tokens_per_micro_batch is None and hp.shared_prompt:
        groups, width = rows // hp.num_samples_per_prompt, seq - room + hp.num_samples_per_prompt * room
        return groups * width, rows * (room + 1)
    if hp.max_tokens_per_micro_batch is None:
        return rows * seq, rows * (room + 1)
    minibatch_rows = rows * hp.gradient_accumulation_steps
    return min(hp.max_tokens_per_micro_batch, minibatch_rows * seq), min(hp.max_tokens_per_micro_batch, minibatch_rows * (room + 1))


def sequence_room(config: PPOConfig) -> tuple[int, str, str]:
    """(tokens after the prompt, what they are, the key that sets them): ppo.response_length, or with an environment
    the episode's budget, model turns and observations together (`PPOConfig.response_room`, as the trainer reads it)."""
    room = config.response_room
    if not config.episodes_answered:
        return room, "response", "ppo.response_length"
    return room, "episode", "rollout.max_episode_tokens" if config.rollout.max_episode_tokens else "rollout.max_turns x ppo.response_length"


def on_gpu(device_description: str) -> bool:
    """Whether the planned device is a GPU: one described as cuda (`device_memory`); memory given in GiB
    (`--device-memory`) is of this machine's kind."""
    return device_description.startswith("cuda") or (torch.cuda.is_available() and not device_description.startswith("cpu"))


# --------------------------------------------------------------------------- the estimate


def reward_vocabulary(config: PPOConfig) -> Optional[bool]:
    """None without reward.model, else whether it reads the policy's token ids (from the tokenizer files)."""
    if not config.reward.model:
        return None
    return _same_vocabulary(config.tokenizer or config.model, config.reward.model, config.trust_remote_code)


@functools.lru_cache(maxsize=8)
def _same_vocabulary(policy_tokenizer: str, reward_model: str, trust_remote_code: bool) -> bool:
    return same_vocabulary(load_tokenizer(policy_tokenizer, trust_remote_code), load_tokenizer(reward_model, trust_remote_code, "reward.model"))



def estimate(config: PPOConfig, prompt_length: int, num_prompts: Optional[int], device: tuple[str, int], suggest: bool = True,
             processes: Optional[int] = None) -> Plan:
    """Estimate for `config` with prompts of at most `prompt_length` tokens (no weights loaded), per
    device of `processes` processes (default: WORLD_SIZE, else 1)."""
    processes = processes or launched_processes()
    hp, lora, quant = config.ppo, config.lora, config.quantization
    trc = config.trust_remote_code
    policy_config = _auto_config(config.model, "model", trc)
    dtype = _dtype(policy_config)
    mixed = config.bf16 or config.fp16
    act_bytes = 2 if mixed else _bytes(dtype)
    dims = _dims(policy_config)
    room, room_words, room_key = sequence_room(config)
    seq = prompt_length + room
    micro, chunk = hp.per_device_train_batch_size, hp.local_rollout_forward_batch_size

    policy_params, policy_weights, _ = _stats(policy_config, False, dtype, quant, trust_remote_code=trc)
    roles: list[RoleEstimate] = []

    def trained(role, source, params, weights, trainable, trainable_bytes, activations):
        return RoleEstimate(role, source, params, trainable, weights, trainable * trainable_bytes, 2 * trainable * trainable_bytes, activations)

    tokens, head_positions = micro_batch_shape(config, seq, room)
    head_chunk = config.lm_head_chunk_size
    policy_act = train_activation_bytes(dims, tokens, act_bytes, config.gradient_checkpointing) + lm_head_bytes(dims, head_positions, head_chunk)
    if lora is None:
        roles.append(trained("policy", f"{config.model} ({policy_config.model_type}, {_bytes(dtype) * 8}-bit)", policy_params,
                             policy_weights, policy_params, _bytes(dtype), policy_act))
    else:
        adapter = _stats(policy_config, False, dtype, quant, lora, "CAUSAL_LM", trust_remote_code=trc)[2]
        roles.append(trained("policy", f"{config.model} + LoRA r={lora.r}" + (f", {quant} base" if quant else ""),
                             policy_params + adapter, policy_weights + 4 * adapter, adapter, 4, policy_act))

    reads_policy_ids = reward_vocabulary(config)
    layout = decide_roles(config, reward_vocabulary=reads_policy_ids)  # as the trainer decides it
    limits = [position_limit(policy_config, "model")]  # of every model that reads the policy's ids, as the trainer checks

    # Reference.
    if layout.reference == REFERENCE_OWN:
        ref_config = _auto_config(config.ref_model, "ref_model", trc)
        limits.append(position_limit(ref_config, "ref_model"))
        ref_params, ref_weights, _ = _stats(ref_config, False, _dtype(ref_config), None, trust_remote_code=trc)
        roles.append(RoleEstimate("reference", config.ref_model, ref_params, 0, ref_weights, 0, 0, 0))
    elif layout.reference == REFERENCE_BASE:
        roles.append(RoleEstimate("reference", "the policy's base, adapter disabled (no copy)", 0, 0, 0, 0, 0, 0))
    else:
        roles.append(RoleEstimate("reference", "frozen copy of the policy", policy_params, 0, policy_weights, 0, 0, 0))

    # Teacher (on-policy distillation): a frozen model of its own, loaded and scored as an own reference is.
    teacher_config = None
    if config.teacher is not None:
        teacher_config = _auto_config(config.teacher, "teacher", trc)
        limits.append(position_limit(teacher_config, "teacher"))
        teacher_params, teacher_weights, _ = _stats(teacher_config, False, _dtype(teacher_config), None, trust_remote_code=trc)
        roles.append(RoleEstimate("teacher", config.teacher, teacher_params, 0, teacher_weights, 0, 0, 0))

    # Reward.
    reward_config = None
    if config.reward.model:
        reward_config = _auto_config(config.reward.model, "reward.model", trc)
        if reads_policy_ids:
            limits.append(position_limit(reward_config, "reward.model"))
        reward_params, reward_weights, _ = _stats(reward_config, True, _dtype(reward_config), quant, trust_remote_code=trc)
        roles.append(RoleEstimate("reward", config.reward.model, reward_params, 0, reward_weights, 0, 0, 0))

    # Value.
    value_dims = dims
    if not layout.has_critic:
        value_dims = None  # a critic-free estimator: no value model, no value forward or backward
    elif layout.critic == CRITIC_SHARED:
        head = dims["hidden"]
        adapter = _stats(policy_config, False, dtype, quant, lora, None, trust_remote_code=trc)[2]
        roles.append(trained("value", "adapter `value` + head on the policy's base (no copy)", adapter + head,
                             4 * (adapter + head), adapter + head, 4,
                             train_activation_bytes(dims, tokens, act_bytes, config.gradient_checkpointing)))
    else:
        if layout.critic == CRITIC_OWN:
            value_config, source = _auto_config(config.value_model, "value_model", trc), config.value_model
            limits.append(position_limit(value_config, "value_model"))
        elif layout.copies_reward_model:
            value_config, source = reward_config, "the reward model's weights"
        else:
            value_config, source = policy_config, "the policy's backbone + a scalar head"
        value_dtype = _dtype(value_config)
        value_dims = _dims(value_config)
        act = train_activation_bytes(value_dims, tokens, act_bytes, config.gradient_checkpointing)
        if layout.critic_adapter:
            shares_reward = layout.critic == CRITIC_ON_REWARD
            params, base_weights, adapter = _stats(value_config, True, value_dtype, quant, lora, "SEQ_CLS", trust_remote_code=trc)
            weights = 4 * adapter + (0 if shares_reward else base_weights)
            source += " (shared with the reward model)" if shares_reward else ""
            roles.append(trained("value", f"{source} + LoRA r={lora.r}", adapter + (0 if shares_reward else params), weights,
                                 adapter, 4, act))
        else:
            params, weights, _ = _stats(value_config, True, value_dtype, None, trust_remote_code=trc)
            roles.append(trained("value", source, params, weights, params, _bytes(value_dtype), act))

    # Batch sizes that do not divide are a config error, as `ppokit ppo` (the trainer) raises it: not a warning.
    sizes = derive(hp, processes, num_prompts or 0) if hp.total_episodes is not None or num_prompts is not None else None
    engine = engines.engine_class(config.rollout.engine).memory(engines.EngineSizing(
        policy_config, dims, _stats(policy_config, False, dtype, None, trust_remote_code=trc)[1], dtype, act_bytes, chunk,
        sizes.local_batch if sizes else 0, seq, config.rollout, device[1], on_gpu(device[0])))
    # Phases that do not overlap.
    phases = {
        "sampling": engine.sampling,
        "forward": max(inference_bytes(dims, chunk, seq, act_bytes, room + 1, head_chunk),
                       inference_bytes(_dims(teacher_config), chunk, seq, act_bytes, room + 1, head_chunk) if teacher_config else 0,
                       inference_bytes(value_dims, chunk, seq, act_bytes, 0) if value_dims else 0,
                       inference_bytes(_dims(reward_config), config.reward.batch_size, seq, act_bytes, 0) if reward_config else 0),
        "training": training_activations(roles, processes),
    }

    models = ([(policy_config, policy_weights)] + ([(reward_config, reward_weights)] if reward_config is not None else [])
              + ([(teacher_config, teacher_weights)] if teacher_config is not None else []))
    unit = max(_unit_bytes(c, w) for c, w in models)  # the largest layer and root unit FSDP gathers
    settings = config.parallel
    sharding = Sharding(processes, settings.shard_frozen, settings.cpu_offload, gathered={
        "sampling": policy_weights if settings.unshard_for_generation else unit[0],
        "forward": 2 * unit[0] + unit[1],
        "training": 2 * (2 * unit[0] + unit[1]),
    })

    warnings: list[str] = []  # what this machine lacks for the config is the run's refusal (`startup.prepare`), a stop
    stops = []
    limit = tightest(limits)
    if limit is not None and seq > limit.tokens:
        stops.append(f"the longest prompt + {room_words} is {seq} tokens ({prompt_length} + {room_key} {room}), "
                     f"over {limit.describe()}: `ppokit ppo` will stop; "
                     f"{prompt_room(limit, room, config.data.max_prompt_length)}")
    plan = Plan(roles, phases, sizes,
                {"prompt": prompt_length, "response": room, "room": room_words, "micro_batch": micro, "forward_chunk": chunk,
                 "micro_batch_tokens": tokens, "lm_head_positions": min(head_positions, head_chunk or head_positions)},
                device[0], device[1], warnings, layout=layout, stops=stops, strategy=settings.strategy, sharding=sharding,
                rollback=hp.rollback, engine=engine)
    host = _host_memory()
    if plan.rollback == "memory" and host and plan.rollback_bytes() * processes > HEADROOM * host:
        plan.warnings.append(f"ppo.nonfinite_rollback: memory copies {_gib(plan.rollback_bytes())} per process to host memory "
                             f"({_gib(plan.rollback_bytes() * processes)} for {processes} on one machine), more than this machine's "
                             f"{_gib(host)} of RAM can spare; use off (the default) or disk")
    if not plan.fits and suggest:
        plan.warnings.append(f"estimated {_gib(plan.total)} exceeds {int(HEADROOM * 100)}% of {_gib(plan.device_memory)} ({plan.device})")
        plan.sharding_suggestion = _suggest_processes(plan)
        plan.suggestion = _suggest(config, prompt_length, num_prompts, device, processes, engine)
        if plan.suggestion is None:
            frozen = sum(r.weights for r in plan.roles)
            plan.warnings.append(f"no combination of ppokit's switches fits: the weights alone take {_gib(frozen)}"
                                 + ("" if torch.cuda.is_available() else "; on a CUDA device quantization: 4bit is one more"))
    return plan


def suggested_lm_head_chunk(vocab: int) -> int:
    """A chunk whose float32 logits take about 128 MiB (1024 tokens at a 32k vocabulary, 256 at 128k), a power of two."""
    tokens = max(1, (128 * 1024**2) // (4 * vocab))
    return max(16, 1 << (tokens.bit_length() - 1))


def _switches(config: PPOConfig, seq: int, chunk: int, engine: engines.EngineMemory) -> list[tuple[str, Callable[[PPOConfig], None]]]:
    """Memory switches in the order worth trying: cheapest loss of fidelity first. The rollout engine's lighter
    settings (rollout.sleep: time only), the memory-light LM head and a token budget lose none (float rounding,
    docs/speed.md); the budget starts at one longest row and `_suggest` raises it as far as the other switches allow."""
    hp = config.ppo
    out: list[tuple[str, Callable[[PPOConfig], None]]] = [
        (f"rollout.{key}: {json.dumps(value)}", lambda c, key=key, value=value: setattr(c.rollout, key, value)) for key, value in engine.lighter]
    if config.lm_head_chunk_size is None:
        out.append((LIGHT_HEAD_SWITCH, lambda c: setattr(c, "lm_head_chunk_size", chunk)))
    if hp.max_tokens_per_micro_batch is None or hp.max_tokens_per_micro_batch > seq:
        out.append((BUDGET_SWITCH, lambda c: setattr(c.ppo, "max_tokens_per_micro_batch", seq)))
    if config.lora is None:
        out.append(("lora: {}", lambda c: setattr(c, "lora", LoraConfig())))
    if config.value_model is None and hp.estimator.critic:
        out.append(("value_model: shared", lambda c: setattr(c, "value_model", "shared")))
    if not config.gradient_checkpointing:
        out.append(("gradient_checkpointing: true", lambda c: setattr(c, "gradient_checkpointing", True)))
    if not config.bf16 and not config.fp16:
        out.append(("bf16: true", lambda c: setattr(c, "bf16", True)))
    if config.quantization is None and torch.cuda.is_available():
        out.append(("quantization: 4bit", lambda c: setattr(c, "quantization", "4bit")))
    if hp.local_rollout_forward_batch_size > 8:
        out.append(("ppo.local_rollout_forward_batch_size: 8", lambda c: setattr(c.ppo, "local_rollout_forward_batch_size", 8)))
    return out


def _suggest_processes(plan: Plan, most: int = 1024) -> Optional[str]:
    """parallel.strategy: fsdp (strategies.SHARDING) with the smallest process count (from this plan's, doubling) that fits,
    every other setting unchanged; None when even `most` processes do not (activations are per device)."""
    n = max(2, plan.sharding.processes)
    while n <= most:
        trial = dataclasses.replace(plan, strategy=SHARDING, sharding=dataclasses.replace(plan.sharding, processes=n),
                                    phases={**plan.phases, "training": training_activations(plan.roles, n)})
        if trial.fits:
            return f"parallel.strategy: {SHARDING} with {n} processes (estimated {_gib(trial.total)} per device)"
        n *= 2
    return None


def _unit_bytes(model_config, weight_bytes: int) -> tuple[int, int]:
    """(one decoder layer, the root unit: embeddings and head) of a model, in bytes, from its dims."""
    d = _dims(model_config)
    tied = getattr(model_config.get_text_config(), "tie_word_embeddings", False)
    root = d["vocab"] * d["hidden"] * (1 if tied else 2) * _bytes(_dtype(model_config))
    return max(0, (weight_bytes - root) // max(1, d["layers"])), root


BUDGET_SWITCH, LIGHT_HEAD_SWITCH = "ppo.max_tokens_per_micro_batch", "lm_head_chunk_size"


def _suggest(config: PPOConfig, prompt_length: int, num_prompts: Optional[int], device: tuple[str, int],
             processes: Optional[int] = None, engine: engines.EngineMemory = engines.EngineMemory()) -> Optional[str]:
    """The shortest prefix of `_switches` whose estimate fits, with that estimate. The memory-light head and
    the token budget are then left out again where the rest fits without them, and the budget is raised to
    the largest number of longest rows (up to a micro-batch's) that still fits."""
    seq = prompt_length + sequence_room(config)[0]
    chunk = suggested_lm_head_chunk(_dims(_auto_config(config.model, "model", config.trust_remote_code))["vocab"])
    fits = lambda c: estimate(c, prompt_length, num_prompts, device, suggest=False, processes=processes).fits  # noqa: E731
    trial = copy.deepcopy(config)
    applied = []
    for text, apply in _switches(config, seq, chunk, engine):
        apply(trial)
        applied.append(text)
        if fits(trial):
            break
    else:
        return None
    # Left out again means back to the config's own value (a budget the config set stays as it was, so the
    # suggestion never drops a switch it changed).
    for text, undo in ((LIGHT_HEAD_SWITCH, lambda c: setattr(c, "lm_head_chunk_size", config.lm_head_chunk_size)),
                       (BUDGET_SWITCH, lambda c: setattr(c.ppo, "max_tokens_per_micro_batch", config.ppo.max_tokens_per_micro_batch))):
        without = copy.deepcopy(trial)
        undo(without)
        if text in applied and fits(without):
            applied.remove(text)
            trial = without
    if not applied:
        return None
    if BUDGET_SWITCH in applied:
        hp = config.ppo
        minibatch_rows = hp.per_device_train_batch_size * hp.gradient_accumulation_steps  # more rows than this a micro-batch never holds
        low, high = 1, (min(hp.max_tokens_per_micro_batch // seq, minibatch_rows) if hp.max_tokens_per_micro_batch else hp.per_device_train_batch_size)
        while low < high:  # the most longest rows per micro-batch that fit (fitting only gets harder with more)
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(_with_budget(trial, middle * seq)) else (low, middle - 1)
        rows = low
        trial = _with_budget(trial, rows * seq)
        applied[applied.index(BUDGET_SWITCH)] = f"{BUDGET_SWITCH}: {rows * seq}"
    if LIGHT_HEAD_SWITCH in applied:
        applied[applied.index(LIGHT_HEAD_SWITCH)] = f"{LIGHT_HEAD_SWITCH}: {chunk}"
    total = estimate(trial, prompt_length, num_prompts, device, suggest=False, processes=processes).total
    return f"{'; '.join(applied)} (estimated {_gib(total)})"


def _with_budget(config: PPOConfig, tokens: int) -> PPOConfig:
    trial = copy.deepcopy(config)
    trial.ppo.max_tokens_per_micro_batch = tokens
    return trial


# --------------------------------------------------------------------------- inputs from the config


def data_shape(config: PPOConfig) -> tuple[int, Optional[int], list[str]]:
    """(longest prompt in tokens, number of training prompts, notes) from data.train and the tokenizer, the prompts
    rendered by the run's conversation (`environments.conversation.conversation_for`: a UserError where the trainer would refuse it)."""
    notes = []
    train = config.data.train
    dataset = prompts = None
    if train and (Path(train).is_file() or is_gym_spec(train)):  # files and reasoning-gym's tasks are read here; hub sets are not
        dataset = as_prompt_dataset(train, config.data.prompt_field, config.data.format)
        if config.data.eval is None and config.data.eval_fraction:
            dataset = dataset.split(config.data.eval_fraction, config.seed)[0]  # as the trainer holds them out
        prompts = dataset.prompts
    elif train:
        notes.append(f"data.train {train} not found; batch sizes need ppo.total_episodes")
    limit = config.data.max_prompt_length
    longest = None
    if prompts:
        try:
            tokenizer = load_tokenizer(config.tokenizer or config.model, config.trust_remote_code)
        except UserError as e:
            tokenizer = None
            notes.append(f"prompt lengths unknown ({e})")
        if tokenizer is not None:
            # rendered as the trainer renders them (the environment's tools' schemas too); what it refuses, the plan refuses
            conversation_for(config, tokenizer, [dataset])
            longest = max(len(ids) for ids in encode_prompts(tokenizer, {"data.train": dataset}, limit, lambda _: None)[0])
    if longest is None:
        longest = limit or DEFAULT_PROMPT_LENGTH
        if limit is None:
            notes.append(f"assumed prompts of {DEFAULT_PROMPT_LENGTH} tokens")
    return longest, (len(prompts) if prompts is not None else None), notes


def plan_for(config: PPOConfig, memory_gib: Optional[float] = None, processes: Optional[int] = None, *,
             overwrite: bool = False, startup_checks: bool = True) -> Plan:
    """The plan for a loaded config, against this machine's device memory or `memory_gib`, per device
    of `processes` processes (default: WORLD_SIZE, else 1). With `startup_checks`, the run's own refusals before any
    weights load (`startup.prepare`, output_dir checked as with `--overwrite` when `overwrite`) are the plan's first
    stop, in the run's words; the estimate is still made where it can be (a CUDA config planned on this CPU machine)."""
    refusal: Optional[UserError] = None
    if startup_checks:
        try:
            prepare(config, processes=processes or launched_processes(), overwrite=overwrite)
        except UserError as e:
            refusal = e
    try:
        prompt_length, num_prompts, notes = data_shape(config)
        device = (f"given {memory_gib:g} GiB", int(memory_gib * GiB)) if memory_gib else device_memory()
        plan = estimate(config, prompt_length, num_prompts, device, processes=processes)
    except UserError:
        if refusal is None:
            raise
        raise refusal from None  # what the run says first
    plan.warnings.extend(notes)
    try:  # the rollout engine's own refusals (vLLM not installed, say), as the run meets them: the engine's check
        engines.check(config.rollout.engine, _auto_config(config.model, "model", config.trust_remote_code), config.rollout)
    except UserError as e:
        plan.stops.insert(0, str(e))
    if refusal is not None:  # before any engine is made: the run's first line
        plan.stops.insert(0, str(refusal))
    return plan


def to_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict())
