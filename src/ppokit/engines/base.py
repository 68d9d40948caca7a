"""The rollout-engine interface: what the trainer asks of whatever samples its episodes.

Two kinds of engine sit behind it: one that samples from the training weights themselves (`hf`:
transformers with its KV cache), and one that holds its own copy of the policy (an inference server
such as vLLM), whose weights the trainer pushes after every optimiser update and whose logprobs are
not bit-for-bit the training forward's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional, Protocol, Sequence

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ppokit.episodes import Episodes

PURPOSES = ("train", "eval", "greedy")


@dataclass(frozen=True)
class Sampling:
    """How to sample one call's responses; the same meaning for every engine.

    temperature: tokens are drawn from softmax(logits / temperature); the logprobs returned are of that
    full distribution (not of the truncated one), which is what the training forward computes.
    top_k 0, top_p 1, min_p 0: off. greedy: the most likely token at every step (logprobs still at
    `temperature`). max_new_tokens: the response budget; stop_token_id: ends a response (None: none).
    """

    max_new_tokens: int
    temperature: float
    stop_token_id: Optional[int]
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    greedy: bool = False

    @classmethod
    def for_purpose(cls, hp, stop_token_id: Optional[int], purpose: str = "train") -> "Sampling":
        """The sampling of the `ppo:` section `hp` for one purpose:
          train   temperature, top_k / top_p / min_p;
          eval    evaluate() and sample generations: eval_temperature (null: temperature), greedy at 0;
          greedy  the most likely token at every step (a greedy-baseline estimator's responses).
        Only training reads the logprobs; a greedy sampling keeps them at the training temperature."""
        if purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
        eval_temperature = hp.temperature if hp.eval_temperature is None else hp.eval_temperature
        greedy = purpose == "greedy" or (purpose == "eval" and eval_temperature == 0)
        temperature = eval_temperature if purpose == "eval" and not greedy else hp.temperature
        return cls(hp.response_length, temperature, stop_token_id, top_k=hp.top_k, top_p=hp.top_p, min_p=hp.min_p, greedy=greedy)


@dataclass(frozen=True)
class EngineSetup:
    """What the trainer hands to the engine it builds (`ppokit.engines.build`); each engine reads what it needs.

    policy: the current policy module (unwrapped), asked for at every call: the trainer's wrapping may change it.
    pad_token_id: what pads every model input (`models.input_pad_id`). device: where the episodes' tensors go.
    rows_per_forward: rows per forward pass while sampling (ppo.local_rollout_forward_batch_size).
    sampling_contexts(policy): context managers entered in order around sampling from the training weights:
        the parallel strategy's (fsdp: the policy unsharded) and the training forward's precision (autocast),
        so that the sampled logprobs are the training forward's (the first PPO ratio is 1).
    settings: the `rollout:` section.
    longest_sequence: the longest prompt + the response budget (an engine holding its own KV cache sizes it so).
    rows_per_rollout: the rows of one update's rollout on this process (sequences decoded together).
    seed: the run's seed (an engine with a generator of its own).
    """

    policy: Callable[[], "nn.Module"]
    pad_token_id: int
    device: "torch.device"
    rows_per_forward: int
    sampling_contexts: Callable[["nn.Module"], Sequence[ContextManager]]
    settings: Any  # the `rollout:` section, ppokit.config.RolloutConfig (config imports this package: no import back)
    longest_sequence: int = 0
    rows_per_rollout: int = 0
    seed: int = 0


@dataclass(frozen=True)
class EngineSizing:
    """What `ppokit plan` knows of a run, for an engine class to say its memory (`memory(sizing)`), read from
    config files alone (nothing loaded, vLLM not imported).

    model_config: the policy's transformers config. dims: the plan's model dimensions (layers, kv = key/value
    heads x head_dim, vocab, ...). weight_bytes: the policy's weights once, unquantised, in `dtype` (a copy of them).
    act_bytes: bytes per activation of the training forwards. rows_per_forward / rows_per_rollout / longest_sequence /
    settings: as in EngineSetup (rows_per_rollout 0: unknown). device_memory: the device's bytes; on_gpu: it is a GPU.
    """

    model_config: Any
    dims: dict
    weight_bytes: int
    dtype: "torch.dtype"
    act_bytes: int
    rows_per_forward: int
    rows_per_rollout: int
    longest_sequence: int
    settings: Any  # the `rollout:` section
    device_memory: int
    on_gpu: bool


@dataclass(frozen=True)
class EngineMemory:
    """An engine's device memory, in bytes, as `ppokit plan` counts it.

    held: memory of its own (a weight copy, a KV cache reserved up front), from its start to the run's end, or, with
        `released_for_training`, given back during each optimisation (`release`) and taken back before sampling again.
    sampling: what sampling needs on top of everything else while it runs.
    what: `held` in words, for the plan's table ("" when it holds nothing). lighter: `rollout:` keys and values with
        which it would hold less (what the plan's suggestions may try).
    """

    held: int = 0
    sampling: int = 0
    released_for_training: bool = False
    what: str = ""
    lighter: tuple[tuple[str, Any], ...] = ()

    def during(self, phase: str) -> int:
        """What it holds during one of the plan's phases (sampling, forward, training)."""
        return 0 if phase == "training" and self.released_for_training else self.held


def step_logits_bytes(rows: int, vocab: int) -> int:
    """One decoding step's float32 logits over the vocabulary and their log-softmax, for `rows` sequences."""
    return 2 * rows * vocab * 4


class RolloutEngine(Protocol):
    """What samples episodes for the trainer; an engine class is declared once in `ppokit.engines.ENGINES`.

    The class:
    create(setup): the engine, built from what the trainer hands over (`EngineSetup`; its own `rollout:` keys
        in `setup.settings`).
    memory(sizing): what it holds of its own on the device (all run long, or freed while training) and what
        sampling needs on top (`EngineMemory`), from config files alone (no engine library imported): `ppokit plan`.
    check_installed(): None, or a UserError saying how to install what the engine needs (before any work).

    An engine:
    logprobs_are_trainers: True when the logprobs `generate` returns are the training forward's own
        (same weights, same kernels, same precision), so they serve as the PPO ratio's old logprobs.
        False: the trainer recomputes them with one no-gradient forward of the policy and logs the
        difference (an external engine: vLLM).
    generate(prompts, sampling): one response per prompt (token ids, no padding) -> Episodes with
        query_ids, response_ids, attention_mask, loss_mask, logprobs, ended, score_index filled.
        Rows come back in the order of `prompts`. Randomness comes from torch's generator.
    sync_weights(policy): make the engine sample from `policy`'s current weights (after an update);
        a no-op for an engine that samples from the training weights.
    release() / resume(): around training, free / take back the engine's memory (KV cache, its
        weight copy); no-ops where there is nothing to free.
    close(): free everything; the trainer calls it when train() ends. A later `generate` (evaluate() or
        sample_completions() after training) must still work: an engine that freed itself builds itself again.

    Built by `ppokit.engines.build(name, EngineSetup)`; the trainer calls `generate` in stage 1 (and for
    evaluation and greedy baselines), `release` / `resume` / `sync_weights` around and after the optimisation
    of every update (`training_between_rollouts`), `sync_weights` after a resume restored the weights.
    """

    logprobs_are_trainers: bool

    @classmethod
    def create(cls, setup: EngineSetup) -> "RolloutEngine": ...

    @staticmethod
    def memory(sizing: EngineSizing) -> EngineMemory: ...

    @staticmethod
    def check_installed() -> None: ...

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> "Episodes": ...

    def sync_weights(self, policy: "nn.Module") -> None: ...

    def release(self) -> None: ...

    def resume(self) -> None: ...

    def close(self) -> None: ...


# Every method an engine class must have (`ppokit.engines.engine_class` checks them), read from the Protocol
# (`logprobs_are_trainers` may be set per instance).
ENGINE_METHODS = tuple(name for name, value in vars(RolloutEngine).items()
                       if not name.startswith("_") and callable(getattr(value, "__func__", value)))


@contextlib.contextmanager
def training_between_rollouts(engine: RolloutEngine, policy: "nn.Module"):
    """Around the optimisation of an update: the engine's memory released to the training, taken back after
    it (also when it fails), and, once the update is done, the engine synced to the trained `policy`."""
    engine.release()
    try:
        yield
    finally:
        engine.resume()
    engine.sync_weights(policy)
